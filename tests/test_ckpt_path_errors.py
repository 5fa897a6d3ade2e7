"""`ff fit --ckpt_path` mistakes end with one line naming the path, exit status 2, no traceback (issue 24, item 11).

Real `ff fit` subprocesses on the tiny SD3 recipe. The checkpoint is a real one, written by a 2-step run; the broken
ones are made from it as a killed copy leaves them (cut short, empty), and the folders are the real ones beside it
(the checkpoints folder, the `.lora` export). Before the fix each ended in a traceback from `torch.load` (`EOFError`,
`OSError: Invalid argument`, `IsADirectoryError`, `FileNotFoundError`), and a resume onto changed records in a
`ValueError` traceback raised from inside Lightning's loop restore.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "sd3" / "sft_tiny.yaml"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
    [str(REPO), str(REPO / "plugins" / "ff_sd3"), os.environ.get("PYTHONPATH", "")])}


def ff_fit(tiny_sd3: Path, data: Path, root: Path, max_steps: int, *extra: str) -> subprocess.CompletedProcess:
    callbacks = [{"class_path": "ff_core.callbacks.FlowCheckpoint",
                  "init_args": {"every_n_train_steps": 2, "save_last": True, "dirpath": str(root / "ckpt")}}]
    cmd = [sys.executable, "-m", "ff_core.cli", "fit", "--config", str(RECIPE),
           "--model.pretrained_model_name_or_path", str(tiny_sd3),
           "--data.datasets", json.dumps([{"name": "shapes", "dataset_dir": str(data)}]),
           "--data.per_device_batch_size", "2", "--trainer.max_steps", str(max_steps),
           "--trainer.default_root_dir", str(root), "--trainer.logger", "false",
           "--trainer.enable_progress_bar", "false", "--trainer.callbacks", json.dumps(callbacks), *extra]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def trained(tiny_sd3, shapes_dir, tmp_path_factory):
    """(dataset copy, run root) of a 2-step run: root/ckpt holds epoch=0-step=2.ckpt, last.ckpt and their .lora."""
    base = tmp_path_factory.mktemp("ckpt_errors")
    data = base / "data"
    shutil.copytree(shapes_dir, data)
    result = ff_fit(tiny_sd3, data, base / "run", 2)
    assert result.returncode == 0, result.stderr[-3000:]
    return data, base / "run"


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr.splitlines()[-1]


@pytest.mark.parametrize("case", ["missing", "empty", "truncated", "checkpoints folder", "lora folder"])
def test_a_broken_ckpt_path_is_one_line(trained, tiny_sd3, tmp_path, case):
    data, run = trained
    last = run / "ckpt" / "last.ckpt"
    if case == "missing":
        path, reason = tmp_path / "last.ckpt", "no such file"
    elif case == "empty":
        path = tmp_path / "last.ckpt"
        path.write_bytes(b"")
        reason = ("is empty (0 bytes): the run that wrote it was probably stopped while saving; resume from an "
                  "earlier checkpoint")
    elif case == "truncated":  # what a copy-in-place killed half-way leaves: the start of the real file
        path = tmp_path / "last.ckpt"
        whole = last.read_bytes()
        path.write_bytes(whole[: len(whole) // 2])
        reason = (f"is truncated or damaged ({len(whole) // 2} bytes, no complete zip directory at its end): the run "
                  "that wrote it was probably stopped while saving; resume from an earlier checkpoint")
    elif case == "checkpoints folder":
        path = run / "ckpt"
        reason = (f"is a folder, not a checkpoint file; pass one of the checkpoints in it (epoch=0-step=2.ckpt, "
                  f"last.ckpt), e.g. {path / 'last.ckpt'}")
    else:
        path = run / "ckpt" / "last.lora"
        reason = ("is a folder, not a checkpoint file; it is the LoRA export of a checkpoint (no optimiser or data "
                  f"state): pass the checkpoint beside it, {last}")
    result = ff_fit(tiny_sd3, data, tmp_path / "resumed", 4, "--ckpt_path", str(path))
    assert one_line_error(result) == f"ff fit: ckpt_path: {path}: {reason}"
    assert not (tmp_path / "resumed").exists()  # refused before anything was written


def test_a_resume_onto_changed_data_is_one_line(trained, tiny_sd3, tmp_path):
    """The records changed since the checkpoint (a row removed): the data-order fingerprint differs (the dataflow's
    own check, ff_core.data.dataflow.state.check_state); `ff fit` says so in one line naming the checkpoint."""
    data, run = trained
    changed = tmp_path / "data"
    shutil.copytree(data, changed)
    lines = (changed / "train.jsonl").read_text().splitlines()
    (changed / "train.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    ckpt = run / "ckpt" / "last.ckpt"
    result = ff_fit(tiny_sd3, changed, tmp_path / "resumed", 4, "--ckpt_path", str(ckpt))
    assert one_line_error(result) == (
        f"ff fit: ckpt_path: {ckpt}: the checkpoint was saved for a different data order: fingerprint field "
        "'distributor.length' is 24 in the checkpoint but 23 in this loader; resuming would repeat or skip samples")
