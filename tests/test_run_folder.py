"""Two `ff fit` never share a run folder (issue 24, item 6), and a killed run leaves none locked.

Real `ff fit` subprocesses on the tiny SD3 recipe. A run is held at the start of training by :class:`Hold` (a
callback that waits for a file), so the second run starts while the first is alive, at a known moment:

* a folder the user named (``logger: false``: the run folder is ``default_root_dir``) is refused with one line naming
  the running process; once the first run is SIGKILLed, a new run in that folder trains (the kernel released the
  lock). Before the fix the second run trained into the same folder: one config, one ``last.ckpt``, one sample log.
* two runs started together with the default logger (Lightning numbers ``version_N`` by listing folders, so both may
  compute ``version_0``) each get their own ``version_N``, holding only their own files and sample log lines.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L

from ff_core.callbacks import read_sample_log

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "sd3" / "sft_tiny.yaml"
LOCK_NAME = ".ff-run.lock"  # docs/scaling.md, "Two runs, one folder"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
    [str(REPO), str(REPO / "plugins" / "ff_sd3"), os.environ.get("PYTHONPATH", "")])}


class Hold(L.Callback):
    """At the start of training, write ``<dirpath>/held`` and wait (up to 120 s) until ``<dirpath>/release`` exists.

    Args:
        dirpath: folder of the two marker files.
    """

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (self.dirpath / "held").write_text(str(os.getpid()))
        deadline = time.monotonic() + 120
        while not (self.dirpath / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def ff_fit(tiny_sd3: Path, shapes_dir: Path, root: Path, log: Path, *extra: str, hold: Path | None = None,
           logger: bool = False) -> subprocess.Popen:  # fmt: skip
    callbacks = [{"class_path": "ff_core.callbacks.FlowCheckpoint", "init_args": {"save_last": True}},
                 {"class_path": "ff_core.callbacks.SampleLog"}]
    if hold is not None:
        callbacks.append({"class_path": "tests.test_run_folder.Hold", "init_args": {"dirpath": str(hold)}})
    cmd = [sys.executable, "-m", "ff_core.cli", "fit", "--config", str(RECIPE),
           "--model.pretrained_model_name_or_path", str(tiny_sd3),
           "--data.datasets", json.dumps([{"name": "shapes", "dataset_dir": str(shapes_dir)}]),
           "--data.per_device_batch_size", "2", "--trainer.max_steps", "2", "--trainer.default_root_dir", str(root),
           "--trainer.enable_progress_bar", "false", "--trainer.callbacks", json.dumps(callbacks),
           *([] if logger else ["--trainer.logger", "false"]), *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait(proc: subprocess.Popen, log: Path, rc: int = 0) -> str:
    try:
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == rc, text[-3000:]
    return text


def test_a_named_folder_in_use_is_refused_and_freed_when_its_run_is_killed(tiny_sd3, shapes_dir, tmp_path):
    root, marks = tmp_path / "run", tmp_path / "marks"
    marks.mkdir()
    first = ff_fit(tiny_sd3, shapes_dir, root, tmp_path / "first.log", hold=marks)
    try:
        deadline = time.monotonic() + 240
        while not (marks / "held").exists():
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first run never started training"
            time.sleep(0.05)
        second = ff_fit(tiny_sd3, shapes_dir, root, tmp_path / "second.log")
        text = wait(second, tmp_path / "second.log", rc=2)
        assert "Traceback" not in text
        last = text.splitlines()[-1]
        prefix = (f"ff fit: trainer.default_root_dir: {root} is the run folder of another ff fit that is still "
                  f"running (pid {first.pid} on ")
        assert last.startswith(prefix) and last.endswith("): give this run its own folder or wait for that one to "
                                                         "end"), last
        assert not (root / "sample_log").exists()  # the second run wrote nothing into the first one's folder
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # a crash: the lock file stays, its lock goes with the process
        first.wait()
    assert (root / LOCK_NAME).is_file()
    third = ff_fit(tiny_sd3, shapes_dir, root, tmp_path / "third.log")
    wait(third, tmp_path / "third.log")
    assert [r["step"] for r in read_sample_log(root / "sample_log" / "rank0.jsonl")] == [1, 2]


def test_runs_started_together_get_their_own_version_folders(tiny_sd3, shapes_dir, tmp_path):
    root = tmp_path / "runs"
    procs = [ff_fit(tiny_sd3, shapes_dir, root, tmp_path / f"{i}.log", logger=True) for i in range(2)]
    for i, proc in enumerate(procs):
        wait(proc, tmp_path / f"{i}.log")
    versions = sorted(p for p in (root / "lightning_logs").iterdir())
    assert [p.name for p in versions] == ["version_0", "version_1"]
    for folder in versions:  # each run's own config, checkpoint and sample log, with only its own lines
        assert (folder / "config.yaml").is_file() and (folder / "checkpoints" / "last.ckpt").is_file()
        assert [r["step"] for r in read_sample_log(folder / "sample_log" / "rank0.jsonl")] == [1, 2]
        pid = json.loads((folder / LOCK_NAME).read_text())["pid"]
        assert pid in {p.pid for p in procs}
    assert len({json.loads((f / LOCK_NAME).read_text())["pid"] for f in versions}) == 2
