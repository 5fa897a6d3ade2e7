"""Preemption under real 2-process DDP (issue 24, item 13): SIGTERM saves a resumable checkpoint, the resume is exact.

Three runs of the real console entry (`python -m ff_core.cli fit`, tiny SD3 recipe, `--trainer.strategy ddp
--trainer.devices 2` on gloo, run as tests/test_ddp_resume.py does: a subprocess without launcher variables, rank 1
Lightning's child in the same process group):

* U, uninterrupted: MAX_STEPS steps;
* A: towards a far-away max_steps; once both ranks logged step 2, SIGTERM goes to the whole process group, both ranks
  and their loader workers (one each), as SLURM signals every process of a job. Checkpoints are set every 100 steps,
  so any checkpoint A leaves is the preemption's own;
* B: A resumed with `--ckpt_path` to MAX_STEPS.

A must exit with 143 and one line naming its checkpoint; the checkpoint is the step both ranks last logged (the ranks
stopped in step); A's batches up to it followed by B's are U's, per rank (ids, epoch, noise); B's final weights (the
trained LoRA in `last.ckpt` and the exported `last.lora`) equal U's exactly. Before the fix A hung (measured: over 3
minutes, no checkpoint): Lightning's handler broadcasts from inside the signal handler, on both ranks, pairing with
whatever collective the other rank was in; and a loader worker dies of SIGTERM (torch's worker handler), failing the
main process's next fetch.
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

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from ff_core.callbacks import read_sample_log

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "sd3" / "sft_tiny.yaml"
LAUNCHER_VARS = ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RANK", "GROUP_RANK")
SIGNAL_AT, MAX_STEPS = 2, 6


class Pace(L.Callback):
    """Sleep after every training batch, so a signal sent once step 2 is logged lands well before MAX_STEPS.

    Args:
        seconds: the pause.
    """

    def __init__(self, seconds: float = 0.3) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        time.sleep(self.seconds)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ff_fit(tiny_sd3: Path, shapes_dir: Path, root: Path, max_steps: int, *extra: str, pace: bool = False
           ) -> subprocess.Popen:
    callbacks = [
        {"class_path": "ff_core.callbacks.FlowCheckpoint",
         "init_args": {"every_n_train_steps": 100, "save_last": True, "dirpath": str(root / "ckpt")}},
        {"class_path": "ff_core.callbacks.SampleLog", "init_args": {"dirpath": str(root / "ids")}},
        *([{"class_path": "tests.test_preemption.Pace"}] if pace else []),
    ]
    cmd = [
        sys.executable, "-m", "ff_core.cli", "fit", "--config", str(RECIPE),
        "--model.pretrained_model_name_or_path", str(tiny_sd3),
        "--data.datasets", json.dumps([{"name": "shapes", "dataset_dir": str(shapes_dir)}]),
        "--data.per_device_batch_size", "2", "--data.num_workers", "1",
        "--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
        "--trainer.max_steps", str(max_steps), "--trainer.limit_val_batches", "0",
        "--trainer.default_root_dir", str(root), "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.callbacks", json.dumps(callbacks), *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(HF_HUB_OFFLINE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "plugins" / "ff_sd3"), env.get("PYTHONPATH", "")]))
    log = (root / "ff_fit.log").open("w")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, root: Path, rc: int = 0, timeout: float = 300) -> str:
    try:
        code = proc.wait(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # rank 1 too, if it outlived rank 0
        except ProcessLookupError:
            pass
    text = (root / "ff_fit.log").read_text()
    assert code == rc, text[-4000:]
    return text


def rows(root: Path, rank: int, max_step: int | None = None) -> list[dict]:
    return read_sample_log(root / "ids" / f"rank{rank}.jsonl", max_step)


def logged_step(root: Path, rank: int) -> int:
    """The last step a rank logged so far (-1 before its first line; a line being written is not counted)."""
    try:
        return max((r["step"] for r in rows(root, rank)), default=-1)
    except (OSError, ValueError):
        return -1


@pytest.fixture(scope="module")
def runs(tiny_sd3, shapes_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("preempt")
    uninterrupted, preempted, resumed = base / "U", base / "A", base / "B"
    for root in (uninterrupted, preempted, resumed):
        root.mkdir()
    finish(ff_fit(tiny_sd3, shapes_dir, uninterrupted, MAX_STEPS), uninterrupted)

    proc = ff_fit(tiny_sd3, shapes_dir, preempted, 1000, pace=True)
    start = time.monotonic()
    while min(logged_step(preempted, r) for r in (0, 1)) < SIGNAL_AT:
        assert proc.poll() is None, (preempted / "ff_fit.log").read_text()[-4000:]
        assert time.monotonic() - start < 300, "step 2 never logged"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)  # every process of the job, as SLURM does
    log = finish(proc, preempted, rc=143, timeout=120)

    [ckpt] = (preempted / "ckpt").glob("epoch=*.ckpt")  # the preemption's checkpoint (beside last.ckpt)
    step = torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"]
    finish(ff_fit(tiny_sd3, shapes_dir, resumed, MAX_STEPS, "--ckpt_path", str(preempted / "ckpt" / "last.ckpt")),
           resumed)
    return uninterrupted, preempted, resumed, log, step


def test_sigterm_saves_a_checkpoint_at_the_step_every_rank_stopped_at(runs):
    _, preempted, _, log, step = runs
    last = preempted / "ckpt" / "last.ckpt"
    assert log.splitlines()[-1] == (f"ff fit: stopped by SIGTERM after step {step}; saved {last}: resume with "
                                    f"--ckpt_path {last}")
    assert "Traceback" not in log
    assert SIGNAL_AT <= step < MAX_STEPS
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == step
    assert (preempted / "ckpt" / "last.lora" / "pytorch_lora_weights.safetensors").is_file()
    for rank in (0, 1):  # no rank trained past the checkpoint, none stopped before it
        assert rows(preempted, rank)[-1]["step"] == step


@pytest.mark.parametrize("rank", [0, 1])
def test_the_resumed_run_consumes_exactly_the_uninterrupted_samples(runs, rank):
    uninterrupted, preempted, resumed, _, step = runs
    expected = rows(uninterrupted, rank)
    assert [r["step"] for r in expected] == list(range(1, MAX_STEPS + 1))
    assert [r["step"] for r in rows(resumed, rank)] == list(range(step + 1, MAX_STEPS + 1))
    assert rows(preempted, rank, step) + rows(resumed, rank) == expected


def test_the_resumed_run_ends_with_the_uninterrupted_weights(runs):
    uninterrupted, _, resumed, _, _ = runs
    want = torch.load(uninterrupted / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    got = torch.load(resumed / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert got["global_step"] == want["global_step"] == MAX_STEPS
    assert set(got["state_dict"]) == set(want["state_dict"]) and want["state_dict"]
    for key, value in want["state_dict"].items():
        assert torch.equal(got["state_dict"][key], value), key
    lora = "last.lora/pytorch_lora_weights.safetensors"
    want_lora, got_lora = load_file(uninterrupted / "ckpt" / lora), load_file(resumed / "ckpt" / lora)
    assert set(got_lora) == set(want_lora)
    assert all(torch.equal(got_lora[k], v) for k, v in want_lora.items())
