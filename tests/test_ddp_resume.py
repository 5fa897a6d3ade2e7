"""Exact resume under real 2-process DDP through `ff fit` (issue 4 acceptance).

Three runs of the real console entry (`python -m ff_core.cli fit --config configs/sd3/sft_tiny.yaml ...`) with
`--trainer.strategy ddp --trainer.devices 2` on gloo, each logging the record ids every rank consumed
(`ff_core.callbacks.SampleLog`):

* U, uninterrupted: 10 steps (24 records, 2 ranks x 2 per step: 6 steps an epoch, so it crosses an epoch);
* A: SIGKILLed (whole process group) once its step-2 checkpoint is complete, mid-epoch and mid-run;
* B: A resumed from that checkpoint with `--ckpt_path`, to step 10.

Per rank, A's batches up to step 2 followed by B's batches equal U's — same ids, same order, same epoch numbers,
and the same training noise (the logged sigmas and noise-generator seeds) — so their union is U's and nothing is
repeated or skipped; and the two ranks draw different noise at every step. DDP is never run inside pytest
(Lightning would re-execute the pytest command for rank 1): each run is a subprocess whose env lacks the launcher
variables, and Lightning destroys its process group at exit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ff_core.callbacks import read_sample_log

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "sd3" / "sft_tiny.yaml"
LAUNCHER_VARS = ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RANK", "GROUP_RANK")
KILL_AT, MAX_STEPS = 2, 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ff_fit(tiny_sd3: Path, shapes_dir: Path, root: Path, max_steps: int, *extra: str, grid: bool = False,
           devices: int = 2) -> subprocess.Popen:
    """Start `ff fit` under 2-process DDP in its own process group; its rank 1 is Lightning's child of it.
    ``grid``: also validate once at the end (6 prompts, 2 per batch, sharded over the ranks) into a SampleGrid.
    ``devices=1``: one process, no DDP."""
    dataset = {"name": "shapes", "dataset_dir": str(shapes_dir), **({"eval": {}} if grid else {})}
    if grid:
        # A CSVLogger writing into the run folder itself (name and version empty): the recipe's eval rewards, reduced
        # across the ranks, land in root/metrics.csv while every other file stays where logger=false puts it.
        csv_logger = {"class_path": "lightning.pytorch.loggers.CSVLogger",
                      "init_args": {"save_dir": str(root), "name": "", "version": ""}}
        extra = (*extra, "--trainer.val_check_interval", str(max_steps), "--data.eval_batch_size", "2",
                 "--model.sampling.num_steps", "2", "--trainer.logger", json.dumps(csv_logger))
    callbacks = [
        {"class_path": "ff_core.callbacks.FlowCheckpoint",
         "init_args": {"every_n_train_steps": 2, "save_top_k": -1, "dirpath": str(root / "ckpt")}},
        {"class_path": "ff_core.callbacks.SampleLog", "init_args": {"dirpath": str(root / "ids")}},
        {"class_path": "ff_core.callbacks.LossCurve"},  # writes from rank 0 only; its folder is resolved by all
        *([{"class_path": "ff_core.callbacks.SampleGrid"}] if grid else []),
    ]
    cmd = [
        sys.executable, "-m", "ff_core.cli", "fit", "--config", str(RECIPE),
        "--model.pretrained_model_name_or_path", str(tiny_sd3),
        "--data.datasets", json.dumps([dataset]),
        "--data.per_device_batch_size", "2",
        "--trainer.strategy", "ddp" if devices > 1 else "auto", "--trainer.devices", str(devices),
        "--trainer.accelerator", "cpu",
        "--trainer.max_steps", str(max_steps),
        "--trainer.default_root_dir", str(root), "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        # The recipe's callbacks are replaced: checkpoints every 2 steps, the id log, the loss curve (no validation).
        "--trainer.callbacks", json.dumps(callbacks),
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(HF_HUB_OFFLINE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    log = (root / "ff_fit.log").open("w")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, root: Path, timeout: float = 300) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert rc == 0, (root / "ff_fit.log").read_text()[-4000:]


def rows(root: Path, rank: int, max_step: int | None = None) -> list[dict]:
    return read_sample_log(root / "ids" / f"rank{rank}.jsonl", max_step)


@pytest.fixture(scope="module")
def runs(tiny_sd3, shapes_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("ddp")
    uninterrupted, killed, resumed = base / "U", base / "A", base / "B"
    for root in (uninterrupted, killed, resumed):
        root.mkdir()
    timings = {}

    start = time.monotonic()
    finish(ff_fit(tiny_sd3, shapes_dir, uninterrupted, MAX_STEPS, grid=True), uninterrupted)
    timings["uninterrupted"] = time.monotonic() - start

    # A runs towards a far-away max_steps and is SIGKILLed once its step-2 checkpoint is complete (FlowCheckpoint
    # exports the .lora folder first, then renames the whole .ckpt file into place), whatever step it has reached.
    start = time.monotonic()
    proc = ff_fit(tiny_sd3, shapes_dir, killed, 1000)
    ckpt = None
    while ckpt is None:
        assert proc.poll() is None, (killed / "ff_fit.log").read_text()[-4000:]
        assert time.monotonic() - start < 300, "no step-2 checkpoint within 300 s"
        done = [p for p in (killed / "ckpt").glob(f"*step={KILL_AT}.ckpt") if p.with_suffix(".lora").is_dir()]
        ckpt = done[0] if done else None
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    timings["killed"] = time.monotonic() - start

    start = time.monotonic()
    finish(ff_fit(tiny_sd3, shapes_dir, resumed, MAX_STEPS, "--ckpt_path", str(ckpt)), resumed)
    timings["resumed"] = time.monotonic() - start
    print(f"DDP run timings (s): {timings}; killed run got to step {rows(killed, 0)[-1]['step']}")
    return uninterrupted, killed, resumed


def epoch_zero(*parts: list[dict]) -> list[int]:
    return [i for part in parts for r in part if r["epoch"] == 0 for i in r["ids"]]


def test_a_run_killed_on_two_processes_resumes_on_one(runs, tiny_sd3, shapes_dir, tmp_path):
    """A (2 ranks, killed after its step-2 checkpoint: 8 of the 24 records of epoch 0 consumed) resumed on one
    process: the rest of epoch 0 (16 records, 8 steps of 2) serves every record the two ranks had not, each once;
    Lightning's epoch ends with it (step 10), and step 11 begins epoch 1."""
    _, killed, _ = runs
    [ckpt] = (killed / "ckpt").glob(f"*step={KILL_AT}.ckpt")
    finish(ff_fit(tiny_sd3, shapes_dir, tmp_path, KILL_AT + 9, "--ckpt_path", str(ckpt), devices=1), tmp_path)
    before = [rows(killed, rank, KILL_AT) for rank in (0, 1)]
    after = rows(tmp_path, 0)
    assert [r["step"] for r in after] == list(range(KILL_AT + 1, KILL_AT + 10))
    assert [r["epoch"] for r in after] == [0] * 8 + [1]
    assert sorted(epoch_zero(*before, after)) == list(range(24))


def test_a_run_on_one_process_resumes_on_two(tiny_sd3, shapes_dir, tmp_path):
    """One process to its step-4 checkpoint (8 records of epoch 0), resumed under 2-process DDP: the 16 others dealt
    over the two ranks (4 steps of 2 each), every record of epoch 0 once; then epoch 1 on two ranks."""
    single, both = tmp_path / "single", tmp_path / "both"
    single.mkdir(), both.mkdir()
    finish(ff_fit(tiny_sd3, shapes_dir, single, 4, devices=1), single)
    [ckpt] = (single / "ckpt").glob("*step=4.ckpt")
    finish(ff_fit(tiny_sd3, shapes_dir, both, 9, "--ckpt_path", str(ckpt)), both)
    after = [rows(both, rank) for rank in (0, 1)]
    for rank in (0, 1):
        assert [(r["step"], r["epoch"]) for r in after[rank]] == [(s, 0) for s in range(5, 9)] + [(9, 1)]
    assert sorted(epoch_zero(rows(single, 0), *after)) == list(range(24))


@pytest.mark.parametrize("rank", [0, 1])
def test_killed_and_resumed_ddp_run_consumes_exactly_the_uninterrupted_samples(runs, rank):
    uninterrupted, killed, resumed = runs
    expected = rows(uninterrupted, rank)
    assert [r["step"] for r in expected] == list(range(1, MAX_STEPS + 1))
    before_kill, after_resume = rows(killed, rank, KILL_AT), rows(resumed, rank)
    assert [r["step"] for r in after_resume] == list(range(KILL_AT + 1, MAX_STEPS + 1))
    # Same ids in the same order, the same epoch numbers (Lightning's epoch stays aligned with the data's), and the
    # same noise: every row also holds the sigmas drawn and the seed of the noise generator.
    assert all({"sigma", "noise_seed"} <= set(r) for r in expected + before_kill + after_resume)
    assert before_kill + after_resume == expected
    consumed = [i for r in before_kill + after_resume for i in r["ids"]]
    assert sorted(consumed) == sorted(i for r in expected for i in r["ids"])


def test_ranks_draw_different_noise_at_every_step(runs):
    """seed_everything seeds both ranks alike; the noise generator is seeded per data-parallel rank too."""
    for root in runs:  # A was killed: compare the steps both of its ranks logged
        rank0, rank1 = ({r["step"]: r for r in rows(root, rank)} for rank in (0, 1))
        steps = sorted(rank0.keys() & rank1.keys())
        assert len(steps) >= KILL_AT
        for step in steps:
            assert rank0[step]["noise_seed"] != rank1[step]["noise_seed"], step
            assert rank0[step]["sigma"] != rank1[step]["sigma"], step
        assert len({r["noise_seed"] for r in [*rank0.values(), *rank1.values()]}) == len(rank0) + len(rank1)


def test_ranks_split_each_epoch_disjointly_and_completely(runs):
    uninterrupted, _, _ = runs
    epoch0 = [i for rank in (0, 1) for r in rows(uninterrupted, rank) if r["epoch"] == 0 for i in r["ids"]]
    assert sorted(epoch0) == list(range(24))


def test_rank_zero_writes_the_loss_curve_under_ddp(runs):
    uninterrupted, _, _ = runs
    lines = (uninterrupted / "loss.csv").read_text().splitlines()
    assert lines[0] == "step,loss" and len(lines) == MAX_STEPS + 1


def test_sample_grid_gathers_every_rank_under_ddp(runs):
    """Each rank generated a shard of the 6 evaluation prompts; rank 0's grid holds all of them, once, in order."""
    uninterrupted, _, _ = runs
    grid = uninterrupted / "samples" / f"step_{MAX_STEPS:06d}.json"
    rows = json.loads(grid.read_text())
    assert [row["index"] for row in rows] == list(range(6))
    assert grid.with_suffix(".png").stat().st_size > 0
    # The recipe's eval rewards: each rank scored its 3 samples; the logged means (sync_dist) are those of all 6.
    import csv

    [val] = [r for r in csv.DictReader((uninterrupted / "metrics.csv").open()) if r.get("val/reward")]
    for label in ("prompt_colour", "green"):
        mean = sum(row["rewards"][label] for row in rows) / 6
        assert float(val[f"val/reward/{label}"]) == pytest.approx(mean, abs=1e-6)
