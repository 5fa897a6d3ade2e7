"""Per-step overhead of ``ff fit`` against a hand-written training loop over the same adapter, loss and data.

Run: ``python benchmarks/bench_step_overhead.py [--steps 150] [--warmup 20] [--rounds 3]`` from a checkout where
``scripts/setup.sh`` built ``build/`` (the demo's inputs). Prints a markdown table.

Both sides are ``ff fit --config configs/demo/sd3_shapes.yaml`` processes (the demo: a tiny SD3 transformer, full
fine-tuning, AdamW, batches of 16 32x32 images with the VAE encode and the cached text conditions; no validation,
no checkpoint in the timed window), with :class:`StepClock` added to the recipe's callbacks:

* ``ff``: Lightning's loop as a user runs it (progress bar, CSV logger, the recipe's callbacks, ff's per-step work:
  the noise generator, the non-finite guard, the preemption check, ``self.log``); a step is timed from one
  ``on_train_batch_start`` to the next, so it holds the data loading, forward, backward, optimiser step and every hook.
* ``hand``: in ``on_train_start`` (everything set up by the same process: weights, condition cache, optimiser,
  loader), a plain loop over the same loader: ``objective.training_loss(adapter, batch, generator)``, ``backward``,
  ``optimizer.step()``, ``zero_grad``; timed from one loop iteration to the next. The run then stops.

Each round runs ``ff`` then ``hand`` (alternating, so drift hits both); a side's figure is its median step time over
``steps`` steps after ``warmup`` (bursts of other load on the machine hit single steps; the median ignores them).
The ratio is best ``ff`` over best ``hand`` (best of the rounds), with every round's own ratio beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

REPO = Path(__file__).resolve().parents[1]


class StepClock(L.Callback):
    """Times training steps (``side: ff``) or runs and times the hand-written loop (``side: hand``); writes the
    step start times (seconds) to ``out`` as JSON."""

    def __init__(self, side: str, out: str, steps: int) -> None:
        self.side, self.out, self.steps = side, Path(out), steps
        self.starts: list[float] = []

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        if self.side != "hand":
            return
        trainer.model.train()  # what FlowModule.on_train_start does (callbacks' hooks run before the module's)
        objective, adapter = pl_module.objective, pl_module.adapter
        optimizer = trainer.optimizers[0]
        loader = trainer.train_dataloader
        batches = iter(loader)
        for step in range(self.steps):
            self.starts.append(time.perf_counter())
            batch = next(batches, None)
            if batch is None:  # the epoch's end: the loader's next epoch, as Lightning's loop starts it
                batches = iter(loader)
                batch = next(batches)
            generator = torch.Generator().manual_seed(step)
            loss = objective.training_loss(adapter, batch, generator).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        self.starts.append(time.perf_counter())
        self.save()
        trainer.should_stop = True

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        if self.side == "ff" and len(self.starts) <= self.steps:
            self.starts.append(time.perf_counter())
            if len(self.starts) == self.steps + 1:
                self.save()

    def save(self) -> None:
        self.out.write_text(json.dumps(self.starts))


def run_side(side: str, steps: int, root: Path) -> list[float]:
    """One ``ff fit`` process of ``side``; the step times (seconds) it measured."""
    out = root / f"{side}.json"
    out.unlink(missing_ok=True)
    clock = {"class_path": "bench_step_overhead.StepClock",
             "init_args": {"side": side, "out": str(out), "steps": steps}}
    cmd = [sys.executable, "-m", "ff_core.cli", "fit", "--config", "configs/demo/sd3_shapes.yaml",
           "--trainer.max_steps", str(steps + 1), "--trainer.limit_val_batches", "0",
           "--trainer.default_root_dir", str(root / side),
           "--trainer.logger.init_args.save_dir", str(root / side),
           "--trainer.callbacks+", json.dumps(clock)]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO / "benchmarks"), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    starts = json.loads(out.read_text())
    return [b - a for a, b in zip(starts[:-1], starts[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150, help="timed steps per side and round")
    parser.add_argument("--warmup", type=int, default=20, help="steps before the timed ones")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not (REPO / "build" / "tiny-sd3" / "model_index.json").exists():
        sys.exit("bench_step_overhead: build/tiny-sd3 missing; run scripts/setup.sh first")
    medians: dict[str, list[float]] = {"ff": [], "hand": []}
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        for _ in range(args.rounds):
            for side in ("ff", "hand"):
                times = run_side(side, args.warmup + args.steps, Path(tmp))[args.warmup :]
                medians[side].append(statistics.median(times))
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, {args.steps} steps after "
          f"{args.warmup}, load after {load:.2f}\n")  # fmt: skip
    print("| round | ff fit ms/step | hand loop ms/step | ratio |")
    print("|---|---|---|---|")
    for i, (ff, hand) in enumerate(zip(medians["ff"], medians["hand"]), 1):
        print(f"| {i} | {ff * 1e3:.1f} | {hand * 1e3:.1f} | {ff / hand:.3f} |")
    best_ff, best_hand = min(medians["ff"]), min(medians["hand"])
    print(f"| best | {best_ff * 1e3:.1f} | {best_hand * 1e3:.1f} | **{best_ff / best_hand:.3f}** |")


if __name__ == "__main__":
    main()
