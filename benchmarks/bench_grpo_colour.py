"""Toy Flow-GRPO benchmark: does GRPO raise a colour reward of the demo model's samples, and at what overhead?

The demo's tiny SD3 (SFT on the shapes dataset, ``scripts/demo.sh``; trained here first when the checkpoint is
missing) draws, for prompts that name no colour ("a circle on a white background"), a spread of colours, green
rarely. GRPO (``configs/sd3/grpo_tiny.yaml`` with the overrides below) then trains it on those 9 prompts with a
colour reward: the share of the image's coloured (saturated) pixels whose hue is green, built on the rewards
package's ``colour`` reward (``measure: hue_fraction`` divided by the saturated fraction): 1 for any image whose
coloured pixels are all green, whatever its background, a maximum a green shape reaches. Every ``--eval-every``
steps the script samples ``--seeds`` images per prompt with the deterministic ODE sampler (the evaluation sampler)
and records their mean reward and the share whose dominant colour (``ff_core.testing.shapes.dominant_colour``) is
green. Goal (issue 11): the mean evaluation reward closes at least half of the gap between its start and 1.

It also measures framework overhead: every ``--bare-every`` steps, the wall time of that GRPO iteration in Lightning's
loop (from the previous step's end: loader, rollout, rewards, advantages, replay, optimiser step, logging) against the
same batch's compute done bare right after it (a loop of transformer calls and Euler/noise updates for the rollout,
the VAE decode, one forward/backward per stored transition, the optimiser step; weights restored after), so both run
under the same load of the shared cores.

    python benchmarks/bench_grpo_colour.py [--checkpoint runs/demo/version_0/checkpoints/last.ckpt]
        [--base build/tiny-sd3] [--out runs/bench_grpo] [--steps 200] [--eval-every 25] [--seeds 8]
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_dpo_preference import reference_folder  # noqa: E402  (benchmarks/ is the script's folder)

from ff_core.adapter import LatentState  # noqa: E402
from ff_core.callbacks.samples import LossCurve, image_grid  # noqa: E402
from ff_core.cli.flow_cli import FlowCLI  # noqa: E402
from ff_core.data.datamodule import FlowDataModule  # noqa: E402
from ff_core.module import FlowModule  # noqa: E402
from ff_core.objectives.grpo import slice_batch  # noqa: E402
from ff_core.rewards.base import RewardBatch  # noqa: E402
from ff_core.rewards.image import ColourReward, _frames  # noqa: E402
from ff_core.testing.shapes import dominant_colour, write_prompt_dataset  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


class ColourShareReward(ColourReward):
    """The share of the coloured (saturated) pixels within ``hue_tolerance`` of ``target``'s hue, in [0, 1]; 0 for
    an image with no coloured pixel. The ``colour`` reward's ``hue_fraction`` divided by the saturated fraction."""

    name = "colour_share"

    def __init__(self, target: tuple[int, int, int] = (0, 255, 0), hue_tolerance: float = 30.0) -> None:
        super().__init__(target=target, measure="hue_fraction", hue_tolerance=hue_tolerance)

    def score(self, image: torch.Tensor) -> torch.Tensor:
        x = _frames(image).movedim(1, -1)  # float in [0, 1]
        mx, mn = x.max(-1).values, x.min(-1).values
        saturated = ((mx - mn > 0.5 * mx) & (mx > 0.3)).float().mean()
        return super().score(image) / saturated if saturated > 0 else saturated


class Probe(L.Callback):
    """Evaluation reward every ``every`` steps (ODE samples of every prompt), GRPO iteration wall times."""

    def __init__(self, prompts: list[str], every: int, seeds: int, steps: int, reward: ColourShareReward,
                 bare_every: int = 5) -> None:  # fmt: skip
        self.prompts, self.every, self.seeds, self.steps, self.reward = prompts, every, seeds, steps, reward
        self.bare_every = bare_every
        self.paired: list[tuple[float, float]] = []  # (GRPO iteration in the loop, bare compute right after), s
        self.evals: list[tuple[int, float, float]] = []
        self.train: list[tuple[int, float]] = []
        self.iteration_seconds: list[float] = []

    def samples(self, trainer: L.Trainer, module: FlowModule, seeds: int) -> list[tuple[str, torch.Tensor]]:
        """ODE samples of every evaluation prompt for seeds ``0 .. seeds-1`` (conditions from the data module's
        cache: the text encoders are released once it is built)."""
        adapter, out = module.adapter, []
        was = adapter.training
        adapter.eval()
        with torch.no_grad():
            for batch in trainer.datamodule.val_dataloader():
                condition = adapter.prepare_condition(batch["condition"])
                for seed in range(seeds):
                    generator = torch.Generator().manual_seed(seed)
                    state = adapter.sample(condition, num_steps=self.steps, generator=generator)
                    out += [(p, media[0]) for p, media in zip(batch["prompt"], adapter.decode(state))]
        adapter.train(was)
        return out

    def evaluate(self, trainer: L.Trainer, module: FlowModule, step: int) -> None:
        samples = self.samples(trainer, module, self.seeds)
        scores = self.reward(RewardBatch([[img] for _, img in samples], [p for p, _ in samples],
                                         [{} for _ in samples]))  # fmt: skip
        green = sum(dominant_colour(img) == "green" for _, img in samples) / len(samples)
        self.evals.append((step, float(scores.mean()), green))
        print(f"step {step}: eval reward {scores.mean():.3f}, green {green:.1%}", flush=True)

    def on_train_start(self, trainer, pl_module) -> None:
        self.evaluate(trainer, pl_module, 0)
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.iteration_seconds.append(time.perf_counter() - self.start)
        # the same batch's bare compute, under the same load
        if self.bare_every and trainer.global_step % self.bare_every == 0:
            bare = bare_iteration(pl_module, batch, torch.Generator().manual_seed(trainer.global_step))
            self.paired.append((self.iteration_seconds[-1], bare))
        self.train.append((trainer.global_step, float(trainer.callback_metrics["train/reward_mean"])))
        if trainer.global_step % self.every == 0:
            self.evaluate(trainer, pl_module, trainer.global_step)
        self.start = time.perf_counter()  # an iteration: from here to the next batch end, loader and loop included


def demo_checkpoint(path: Path) -> Path:
    """The demo's checkpoint, trained now (``configs/demo/sd3_shapes.yaml``) when it does not exist."""
    if path.exists():
        return path
    print(f"{path} missing: training the demo model (configs/demo/sd3_shapes.yaml, a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "ff_core.cli", "fit", "--config", "configs/demo/sd3_shapes.yaml"],
                   check=True, cwd=REPO)  # fmt: skip
    found = sorted((REPO / "runs" / "demo").glob("version_*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
    return found[-1]


def train(reference: Path, prompts: Path, args, probe: Probe) -> FlowCLI:
    lora = "null" if args.lora_rank == 0 else json.dumps(
        {"rank": args.lora_rank, "alpha": args.lora_rank, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]})
    reward = [{"name": "bench_grpo_colour:ColourShareReward", "label": "green_share"}]
    shutil.rmtree(args.out / "grpo", ignore_errors=True)  # this script's own previous run
    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(REPO / "configs" / "sd3" / "grpo_tiny.yaml"),
        "--model.pretrained_model_name_or_path", str(reference),
        "--model.objective.init_args.rewards", json.dumps(reward),
        "--model.objective.init_args.group_size", str(args.group_size),
        "--model.objective.init_args.prompts_per_step", str(args.prompts_per_step),
        "--model.objective.init_args.micro_batch_size", str(args.group_size * args.prompts_per_step // 2),
        "--model.objective.init_args.num_steps", str(args.sample_steps),
        "--model.objective.init_args.sampler", json.dumps({"kind": "flow_sde", "eta": args.eta,
                                                           "window": [0, args.sample_steps - 2]}),
        "--model.objective.init_args.kl_beta", str(args.kl_beta),
        "--model.objective.init_args.kl_scale", args.kl_scale,
        "--model.optimizer.init_args.lr", str(args.lr),
        "--model.lora", lora,
        "--data.datasets", json.dumps([{"name": "prompts", "dataset_dir": str(prompts)}]),
        "--trainer.max_steps", str(args.steps), "--trainer.limit_val_batches", "0",
        "--trainer.enable_progress_bar", "false", "--trainer.callbacks", "[]",
        "--trainer.default_root_dir", str(args.out),
        "--trainer.logger", json.dumps({"class_path": "lightning.pytorch.loggers.CSVLogger",
                                        "init_args": {"save_dir": str(args.out), "name": "grpo", "version": 0}}),
    ])  # fmt: skip
    cli.trainer.callbacks.append(probe)
    cli.trainer.fit(cli.model, cli.datamodule)
    return cli


def bare_iteration(module: FlowModule, batch: dict, generator: torch.Generator) -> float:
    """The compute one GRPO iteration must do, without the framework: seconds for one rollout of the batch in the
    objective's micro-batches (transformer calls + Euler / noise updates), the VAE decode, one forward/backward per
    stored transition, and the optimiser step. The weights and the optimiser state are restored afterwards (outside
    the timing), so it can run between training steps."""
    objective = module.objective
    adapter, optimizer = module.adapter, module.optimizers().optimizer
    params = [p for p in module.parameters() if p.requires_grad]
    saved_params, saved_state = [p.detach().clone() for p in params], copy.deepcopy(optimizer.state_dict())
    was = adapter.training
    adapter.eval()
    n, size = len(batch["prompt"]), objective.micro_batch_size
    sde = objective.sampler.candidate_steps(objective.num_steps)
    sigmas = adapter.sampling_sigmas(objective.num_steps).tolist()
    start = time.perf_counter()
    stored = []
    with torch.no_grad():
        for i in range(0, n, size):
            cond = adapter.prepare_condition(slice_batch(batch["condition"], slice(i, i + size)))
            x = adapter.initial_noise(cond, generator)
            for step, (s, s_next) in enumerate(zip(sigmas[:-1], sigmas[1:])):
                v = adapter.velocity(x, torch.full((x.batch_size,), s), cond).components["latent"]
                lat = x.components["latent"]
                if step in sde:
                    stored.append((x, s, cond))
                    lat = lat + 0.1 * torch.randn(lat.shape, generator=generator)
                x = LatentState({"latent": lat + (s_next - s) * v})
            adapter.decode(x)
    for x, s, cond in stored:
        v = adapter.velocity(x, torch.full((x.batch_size,), s), cond).components["latent"]
        (v.float() ** 2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        for p, saved in zip(params, saved_params):
            p.copy_(saved)
    optimizer.load_state_dict(saved_state)
    adapter.train(was)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=Path("runs/demo/version_0/checkpoints/last.ckpt"))
    parser.add_argument("--base", type=Path, default=Path("build/tiny-sd3"), help="the demo's base folder")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_grpo"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--sample-steps", type=int, default=10)
    parser.add_argument("--eta", type=float, default=0.7)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--kl-beta", type=float, default=0.0)
    parser.add_argument("--kl-scale", default="flow_grpo", choices=["flow_grpo", "exact_gaussian"],
                        help="kl_on: mean's divisor (RESULTS.md's KL run: exact_gaussian, ff's scale before issue 23)")
    parser.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tuning")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bare-every", type=int, default=5, help="steps between overhead measurements")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # 2 threads on 2 shared cores run 10x slower under load than 1
    sys.path.insert(0, str(Path(__file__).parent))  # the reward's dotted path

    reference = reference_folder(demo_checkpoint(args.checkpoint), args.base, args.out / "reference")
    prompts_dir = write_prompt_dataset(args.out / "prompts")
    prompts = (prompts_dir / "test.txt").read_text().split("\n")[:-1]
    probe = Probe(prompts, args.eval_every, args.seeds, args.sample_steps, ColourShareReward(), args.bare_every)
    start = time.perf_counter()
    cli = train(reference, prompts_dir, args, probe)
    seconds = time.perf_counter() - start
    if probe.evals[-1][0] != args.steps:
        probe.evaluate(cli.trainer, cli.model, args.steps)

    curve = LossCurve(smoothing=10)
    curve.history = probe.train
    image = curve.plot(title="GRPO training reward (raw, moving average)")
    image.save(args.out / "reward_curve.png")
    samples = probe.samples(cli.trainer, cli.model, 1)
    image_grid([img for _, img in samples], [p for p, _ in samples]).save(args.out / "grpo_samples.png")
    r0, r1 = probe.evals[0][1], probe.evals[-1][1]
    closed = (r1 - r0) / (1 - r0)
    print(f"\ntraining: {seconds:.0f} s for {args.steps} iterations of {args.prompts_per_step} prompts x "
          f"{args.group_size} samples; curve {args.out / 'reward_curve.png'}, samples {args.out / 'grpo_samples.png'}")
    print("\n| step | eval reward (green share) | dominant colour green |\n|---|---|---|")
    for step, r, g in probe.evals:
        print(f"| {step} | {r:.3f} | {g:.1%} |")
    print(f"\ngap to the maximum closed: {closed:.1%} (goal >= 50 %)")
    with open(args.out / "evals.csv", "w", newline="") as f:
        csv.writer(f).writerows([("step", "eval_reward", "green_share"), *probe.evals])
    if len(probe.paired) < 2:
        return
    ratios = [grpo / bare for grpo, bare in probe.paired[1:]]  # the first pays one-off warm-up
    grpo_s, bare_s = (statistics.median(x) for x in zip(*probe.paired[1:]))
    print(f"GRPO iteration in Lightning's loop {grpo_s * 1000:.0f} ms, bare compute of the same batch right after "
          f"{bare_s * 1000:.0f} ms (medians of {len(ratios)} pairs): ratio median {statistics.median(ratios):.3f}, "
          f"quartiles {statistics.quantiles(ratios, n=4)[0]:.3f} / {statistics.quantiles(ratios, n=4)[2]:.3f}")


if __name__ == "__main__":
    main()
