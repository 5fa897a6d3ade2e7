"""DiffusionNFT against Flow-GRPO on the toy colour task, side by side in one run.

The setup of ``bench_grpo_colour.py``: the demo's tiny SD3 (``scripts/demo.sh``; trained first when the checkpoint
is missing), the 9 prompts that name no colour, the reward "share of the coloured pixels that are green". Both
objectives start from the same weights, train the same number of iterations on the same prompts (4 prompts x 8
samples per iteration, full fine-tuning, AdamW at the same learning rate, one optimiser step per iteration, no KL),
and are evaluated alike every ``--eval-every`` iterations (``--seeds`` ODE samples per prompt). GRPO: its recipe's
Flow-SDE rollouts (eta 0.7 on the first 8 of 10 steps) and clipped surrogate. DiffusionNFT:
``configs/sd3/nft_tiny.yaml`` (ODE rollouts with the old policy, 9 of the 10 levels trained per sample, beta 1,
the official decay schedule). Reports, per objective, the evaluation reward at each evaluation and the wall
time of the training.

    python benchmarks/bench_nft_colour.py [--checkpoint runs/demo/version_0/checkpoints/last.ckpt]
        [--base build/tiny-sd3] [--out runs/bench_nft] [--steps 60] [--eval-every 10] [--seeds 4]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_dpo_preference import reference_folder  # noqa: E402  (benchmarks/ is the script's folder)
from bench_grpo_colour import ColourShareReward, Probe, demo_checkpoint  # noqa: E402

from ff_core.cli.flow_cli import FlowCLI  # noqa: E402
from ff_core.data.datamodule import FlowDataModule  # noqa: E402
from ff_core.module import FlowModule  # noqa: E402
from ff_core.testing.shapes import write_prompt_dataset  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
REWARD = [{"name": "bench_grpo_colour:ColourShareReward", "label": "green_share"}]


def objective_args(name: str, args) -> list[str]:
    """The recipe and its overrides for ``grpo`` or ``nft``; the shared settings alike."""
    common = [
        "--model.objective.init_args.rewards", json.dumps(REWARD),
        "--model.objective.init_args.group_size", str(args.group_size),
        "--model.objective.init_args.prompts_per_step", str(args.prompts_per_step),
        "--model.objective.init_args.micro_batch_size", str(args.group_size * args.prompts_per_step // 2),
        "--model.objective.init_args.num_steps", str(args.sample_steps),
        "--model.objective.init_args.kl_beta", "0",
    ]  # fmt: skip
    if name == "grpo":
        return ["--config", str(REPO / "configs" / "sd3" / "grpo_tiny.yaml"), *common,
                "--model.objective.init_args.sampler",
                json.dumps({"kind": "flow_sde", "eta": 0.7, "window": [0, args.sample_steps - 2]})]  # fmt: skip
    return ["--config", str(REPO / "configs" / "sd3" / "nft_tiny.yaml"), *common,
            "--model.objective.init_args.nft_beta", str(args.nft_beta)]  # fmt: skip


def train(name: str, reference: Path, prompts: Path, args, probe: Probe) -> tuple[FlowCLI, float]:
    shutil.rmtree(args.out / name, ignore_errors=True)  # this script's own previous run
    torch.manual_seed(0)
    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        *objective_args(name, args),
        "--model.pretrained_model_name_or_path", str(reference),
        "--model.optimizer.init_args.lr", str(args.lr), "--model.lora", "null",
        "--data.datasets", json.dumps([{"name": "prompts", "dataset_dir": str(prompts)}]),
        "--trainer.max_steps", str(args.steps), "--trainer.limit_val_batches", "0",
        "--trainer.enable_progress_bar", "false", "--trainer.callbacks", "[]",
        "--trainer.default_root_dir", str(args.out),
        "--trainer.logger", json.dumps({"class_path": "lightning.pytorch.loggers.CSVLogger",
                                        "init_args": {"save_dir": str(args.out), "name": name, "version": 0}}),
    ])  # fmt: skip
    cli.trainer.callbacks.append(probe)
    start = time.perf_counter()
    cli.trainer.fit(cli.model, cli.datamodule)
    return cli, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=Path("runs/demo/version_0/checkpoints/last.ckpt"))
    parser.add_argument("--base", type=Path, default=Path("build/tiny-sd3"), help="the demo's base folder")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_nft"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--sample-steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--nft-beta", type=float, default=1.0)
    parser.add_argument("--objectives", nargs="+", default=["nft", "grpo"], choices=["nft", "grpo"])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).parent))  # the reward's dotted path

    reference = reference_folder(demo_checkpoint(args.checkpoint), args.base, args.out / "reference")
    prompts_dir = write_prompt_dataset(args.out / "prompts")
    prompts = (prompts_dir / "test.txt").read_text().split("\n")[:-1]
    results = {}
    for name in args.objectives:
        probe = Probe(prompts, args.eval_every, args.seeds, args.sample_steps, ColourShareReward(), bare_every=0)
        cli, seconds = train(name, reference, prompts_dir, args, probe)
        if probe.evals[-1][0] != args.steps:
            probe.evaluate(cli.trainer, cli.model, args.steps)
        results[name] = (probe.evals, seconds)
        print(f"{name}: {seconds:.0f} s for {args.steps} iterations", flush=True)
    names = list(results)
    print("\n| iteration | " + " | ".join(f"{n} eval reward" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for i, (step, *_) in enumerate(results[names[0]][0]):
        print(f"| {step} | " + " | ".join(f"{results[n][0][i][1]:.3f}" for n in names) + " |")
    print("| training wall time | " + " | ".join(f"{results[n][1]:.0f} s" for n in names) + " |")
    with open(args.out / "evals.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(("objective", "step", "eval_reward", "green_share", "training_seconds"))
        for n in names:
            writer.writerows((n, s, r, g, f"{results[n][1]:.1f}") for s, r, g in results[n][0])


if __name__ == "__main__":
    main()
