"""Toy preference benchmark: does offline DPO move the demo model towards the colour its preference pairs choose?

The demo's tiny SD3 (SFT on the shapes dataset, ``scripts/demo.sh``) draws the colour its prompt asks for, and for
a prompt that names no colour ("a circle on a white background") a spread of colours. Preference pairs then rank two
colours for such prompts: every *chosen* image shows ``--pair``'s first colour (default green, which the demo model
rarely draws for them), every *rejected* one its second (default red, its most frequent), same shape, place and
background (``ff_core.testing.shapes.write_preference_dataset(pair=...)``). Offline DPO trains on them
(``configs/sd3/offline_dpo_tiny.yaml`` with the overrides below) against the demo model as its reference; the script
then generates ``--seeds`` images for every colourless test prompt (each shape on each background) with the reference
and with the DPO model and reports the share whose dominant colour (``ff_core.testing.shapes.dominant_colour``) is
the chosen colour, the rejected one, another, or none. ``--opposite`` runs the harder variant instead: colour prompts,
the chosen image in the prompt's opposite hue (red -> cyan, ...), the rejected one in the prompt's own colour.

    python benchmarks/bench_dpo_preference.py [--checkpoint runs/demo/version_0/checkpoints/last.ckpt]
        [--base build/tiny-sd3] [--out runs/bench_dpo] [--pair green,red | --opposite] [--steps 100]
        [--beta 5000] [--lr 1e-4] [--lora-rank 0] [--seeds 16]

The demo checkpoint is read, never written: its transformer is saved with the base's other components as a new
diffusers folder (``OUT/reference``), the DPO run's ``pretrained_model_name_or_path``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import warnings
from collections import Counter
from pathlib import Path

import lightning as L
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from demo_checkpoint import generate  # noqa: E402  (benchmarks/ is the script's folder)

from ff_core.callbacks.samples import image_grid  # noqa: E402
from ff_core.cli.flow_cli import FlowCLI  # noqa: E402
from ff_core.data.datamodule import FlowDataModule  # noqa: E402
from ff_core.module import FlowModule  # noqa: E402
from ff_core.testing.shapes import COLOURS, dominant_colour, prompt_colour, write_preference_dataset  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OPPOSITE = 3  # --opposite: palette steps from the prompt's colour to the chosen one


def arms(prompt: str, pair: tuple[str, str] | None) -> tuple[str, str]:
    """The (chosen, rejected) colours the pairs teach for ``prompt``."""
    if pair is not None:
        return pair
    own = prompt_colour(prompt)
    return COLOURS[(COLOURS.index(own) + OPPOSITE) % len(COLOURS)], own


def reference_folder(checkpoint: Path, base: Path, out: Path) -> Path:
    """The demo's trained transformer with the base's VAE, text encoders and scheduler, as a diffusers folder."""
    with warnings.catch_warnings():  # checkpoints hold trained tensors only: the frozen rest comes from the base
        warnings.filterwarnings("ignore", message="Found keys that are in the model state dict but not in the")
        demo = FlowModule.load_from_checkpoint(checkpoint, map_location="cpu", pretrained_model_name_or_path=str(base))
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(base, out, ignore=shutil.ignore_patterns("transformer"))
    demo.adapter.transformer.save_pretrained(out / "transformer")
    return out


class StepTimer(L.Callback):
    """Wall time of the training steps alone (set-up and condition preprocessing excluded)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 0:
            self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        self.seconds = time.perf_counter() - self.start


def train(reference: Path, pairs: Path, root: Path, args) -> tuple[FlowModule, float]:
    lora = "null" if args.lora_rank == 0 else json.dumps(
        {"rank": args.lora_rank, "alpha": args.lora_rank, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]})
    shutil.rmtree(root / "dpo", ignore_errors=True)  # this script's own previous run
    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(REPO / "configs" / "sd3" / "offline_dpo_tiny.yaml"),
        "--model.pretrained_model_name_or_path", str(reference),
        "--model.objective.init_args.beta", str(args.beta),
        "--model.objective.init_args.timesteps", json.dumps({"logit_mean": args.logit_mean}),
        "--model.optimizer.init_args.lr", str(args.lr),
        "--model.lora", lora,
        "--data.datasets", json.dumps([{"name": "pairs", "dataset_dir": str(pairs)}]),
        "--data.per_device_batch_size", str(args.batch_size),
        "--trainer.max_steps", str(args.steps), "--trainer.limit_val_batches", "0",
        "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(root), "--trainer.callbacks", "[]",
        "--trainer.logger", json.dumps({"class_path": "lightning.pytorch.loggers.CSVLogger",
                                        "init_args": {"save_dir": str(root), "name": "dpo", "version": 0}}),
    ])  # fmt: skip
    timer = StepTimer()
    cli.trainer.callbacks.append(timer)
    cli.trainer.fit(cli.model, cli.datamodule)
    return cli.model, timer.seconds


def shares(samples: list[tuple[str, torch.Tensor]], pair: tuple[str, str] | None) -> Counter:
    """How many samples show the chosen colour, the rejected colour, another colour, or none."""
    out = Counter()
    for prompt, image in samples:
        got, (chosen, rejected) = dominant_colour(image), arms(prompt, pair)
        out["chosen" if got == chosen else "rejected" if got == rejected else "none" if got == "none" else "other"] += 1
    return out


def logged(root: Path) -> list[dict[str, float]]:
    """Every logged training step's ``train/*`` metrics (and ``step``)."""
    import csv

    rows = [r for r in csv.DictReader(open(root / "dpo" / "version_0" / "metrics.csv")) if r.get("train/loss")]
    return [{k.removeprefix("train/"): float(v) for k, v in r.items() if (k.startswith("train/") or k == "step") and v}
            for r in rows]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=Path("runs/demo/version_0/checkpoints/last.ckpt"))
    parser.add_argument("--base", type=Path, default=Path("build/tiny-sd3"), help="the demo's base folder")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_dpo"))
    parser.add_argument("--pairs", type=int, default=384)
    parser.add_argument("--pair", default="green,red", help="CHOSEN,REJECTED colours (prompts name no colour)")
    parser.add_argument("--opposite", action="store_true", help="colour prompts; chosen: the opposite hue")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--beta", type=float, default=5000.0)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--logit-mean", type=float, default=0.0, help="of the logit-normal noise levels")
    parser.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tuning (reference: a frozen copy)")
    parser.add_argument("--seeds", type=int, default=16)
    parser.add_argument("--sample-steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))

    reference = reference_folder(args.checkpoint, args.base, args.out / "reference")
    pair = None if args.opposite else tuple(args.pair.split(","))
    design = {"chosen_shift": OPPOSITE, "rejected_shift": 0} if pair is None else {"pair": pair}
    shutil.rmtree(args.out / "pairs", ignore_errors=True)
    pairs = write_preference_dataset(args.out / "pairs", n_train=args.pairs, n_test=12 if pair is None else 9,
                                     **design)  # fmt: skip
    prompts = (pairs / "test.txt").read_text().split("\n")[:-1]
    start = time.perf_counter()
    trained, step_seconds = train(reference, pairs, args.out, args)
    seconds = time.perf_counter() - start
    base = FlowModule("sd3-5", str(reference), adapter_kwargs={"resolution": 32})
    base.configure_model()

    rows = []
    for label, module in (("reference (demo SFT model)", base), (f"offline DPO, {args.steps} steps", trained)):
        samples = generate(module, prompts, args.seeds, args.sample_steps, encoder=base)  # the trained one's released
        counts = shares(samples, pair)
        rows.append((label, counts, sum(counts.values())))
    grid = args.out / "dpo_samples.png"  # the DPO model's first seed, one image per test prompt
    image_grid([img for _, img in samples[: len(prompts)]], [p for p, _ in samples[: len(prompts)]]).save(grid)
    steps = logged(args.out)
    saturated = next((int(r["step"]) for r in steps if r["loss"] < 1e-3), None)
    print(f"\ntraining: {seconds:.0f} s ({step_seconds:.0f} s in the {args.steps} steps of {args.batch_size} pairs); "
          f"loss {steps[0]['loss']:.4f} at step 0, below 1e-3 from step {saturated}; last logged: "
          + ", ".join(f"{k} {v:.3g}" for k, v in steps[-1].items() if k != "step"))
    print(f"samples: {grid}")
    chosen, rejected = pair or ("opposite hue", "the prompt's")
    print(f"\n| model | chosen colour ({chosen}) | rejected colour ({rejected}) | another colour | no colour "
          "| samples |\n|---|---|---|---|---|---|")
    for label, counts, n in rows:
        print(f"| {label} | " + " | ".join(f"{counts[k] / n:.1%}" for k in ("chosen", "rejected", "other", "none"))
              + f" | {n} |")
    moved = (rows[1][1]["chosen"] / rows[1][2] - rows[0][1]["chosen"] / rows[0][2]) * 100
    print(f"\nchosen colour share moved by {moved:+.1f} points")


if __name__ == "__main__":
    main()
