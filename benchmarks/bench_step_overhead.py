"""Per-step overhead of ``ff fit`` against a hand-written training loop over the same adapter, loss and data.

Run: ``python benchmarks/bench_step_overhead.py [--steps 200] [--warmup 20] [--chunk 10] [--rounds 3]`` from a
checkout where ``scripts/setup.sh`` built ``build/`` (the demo's inputs). Prints a markdown table.

Each round is one ``ff fit --config configs/demo/sd3_shapes.yaml`` process (the demo: a tiny SD3 transformer, full
fine-tuning, AdamW, batches of 16 32x32 images with the VAE encode and the cached text conditions; no validation,
no checkpoint in the timed window) with :class:`StepClock` added to the recipe's callbacks. Inside that one process
the two sides take turns, ``chunk`` steps each, so that whatever else the machine does hits both alike:

* ``ff``: Lightning's loop as a user runs it (progress bar, CSV logger, the recipe's callbacks, ff's per-step work:
  the noise generator, the non-finite guard, the preemption check, ``self.log``). A step is timed from one
  ``on_train_batch_start`` to the next, less the hand chunk run in between, so it holds the data loading, forward,
  backward, optimiser step and every hook.
* ``hand``: after every ``chunk`` Lightning steps (in ``on_train_batch_end``), ``chunk`` steps of a plain loop over
  the same loader (its own iterator): ``objective.training_loss(adapter, batch, generator)``, ``backward``,
  ``optimizer.step()``, ``zero_grad``, on the same weights and optimiser; timed from one iteration to the next.

A side's figure is its median step time over ``steps`` steps after ``warmup`` (bursts of load hit single steps; the
median ignores them); a round's ratio is ff's median over hand's. The last row is the best of the rounds: the
lowest ff median over the lowest hand median.
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
    """Times Lightning's steps and, every ``chunk`` of them, runs and times ``chunk`` hand-written steps; stops the
    run once each side has ``steps`` and writes ``{"ff": [...], "hand": [...]}`` (seconds per step) to ``out``."""

    def __init__(self, out: str, steps: int, chunk: int = 10) -> None:
        self.out, self.steps, self.chunk = Path(out), steps, chunk
        self.times: dict[str, list[float]] = {"ff": [], "hand": []}
        self.last: float | None = None
        self.excluded = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        self.loader = trainer.train_dataloader
        self.batches = iter(self.loader)
        self.generator = torch.Generator().manual_seed(0)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        if self.last is not None:
            self.times["ff"].append(now - self.last - self.excluded)
        self.last, self.excluded = now, 0.0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if (batch_idx + 1) % self.chunk:
            return
        began = time.perf_counter()
        self.hand_steps(pl_module, trainer.optimizers[0])
        self.excluded = time.perf_counter() - began
        if min(len(t) for t in self.times.values()) >= self.steps:
            self.out.write_text(json.dumps(self.times))
            trainer.should_stop = True

    def hand_steps(self, pl_module, optimizer: torch.optim.Optimizer) -> None:
        objective, adapter = pl_module.objective, pl_module.adapter
        last = time.perf_counter()
        for _ in range(self.chunk):
            batch = next(self.batches, None)
            if batch is None:  # the epoch's end: the loader's next epoch, as Lightning's loop starts it
                self.batches = iter(self.loader)
                batch = next(self.batches)
            loss = objective.training_loss(adapter, batch, self.generator).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            now = time.perf_counter()
            self.times["hand"].append(now - last)
            last = now


def run_round(steps: int, chunk: int, root: Path) -> dict[str, list[float]]:
    """One ``ff fit`` process with both sides taking turns; each side's step times (seconds)."""
    out = root / "times.json"
    out.unlink(missing_ok=True)
    clock = {"class_path": "bench_step_overhead.StepClock",
             "init_args": {"out": str(out), "steps": steps, "chunk": chunk}}
    cmd = [sys.executable, "-m", "ff_core.cli", "fit", "--config", "configs/demo/sd3_shapes.yaml",
           "--trainer.max_steps", str(2 * steps + 2 * chunk), "--trainer.limit_val_batches", "0",
           "--trainer.default_root_dir", str(root / "run"),
           "--trainer.logger.init_args.save_dir", str(root / "run"),
           "--trainer.callbacks+", json.dumps(clock)]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO / "benchmarks"), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per side and round")
    parser.add_argument("--warmup", type=int, default=20, help="steps of each side before the timed ones")
    parser.add_argument("--chunk", type=int, default=10, help="steps per turn")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not (REPO / "build" / "tiny-sd3" / "model_index.json").exists():
        sys.exit("bench_step_overhead: build/tiny-sd3 missing; run scripts/setup.sh first")
    medians: dict[str, list[float]] = {"ff": [], "hand": []}
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        for _ in range(args.rounds):
            times = run_round(args.warmup + args.steps, args.chunk, Path(tmp))
            for side in medians:
                medians[side].append(statistics.median(times[side][args.warmup : args.warmup + args.steps]))
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
          f"{args.steps} steps per side after {args.warmup}, turns of {args.chunk}, load after {load:.2f}\n")
    print("| round | ff fit ms/step | hand loop ms/step | ratio |")
    print("|---|---|---|---|")
    for i, (ff, hand) in enumerate(zip(medians["ff"], medians["hand"]), 1):
        print(f"| {i} | {ff * 1e3:.1f} | {hand * 1e3:.1f} | {ff / hand:.3f} |")
    best_ff, best_hand = min(medians["ff"]), min(medians["hand"])
    print(f"| best | {best_ff * 1e3:.1f} | {best_hand * 1e3:.1f} | **{best_ff / best_hand:.3f}** |")


if __name__ == "__main__":
    main()
