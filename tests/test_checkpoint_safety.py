"""What a save or a resume may touch (issue 24 review): a resume never writes a LoRA folder beside a checkpoint it
does not own, a full disk is one line, the start removes only ff's own temporaries, a symlinked folder is published
at its target. Real files, real tmpfs mounts, the callback and functions called directly.
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn

from ff_core.atomic import remove_leftovers, replace_dir
from ff_core.callbacks.checkpoint import EXPORT_KEY, AtomicCheckpointIO, FlowCheckpoint, lora_dir_for
from ff_core.data import preprocess_latents
from ff_core.errors import DatasetError


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 256 KiB tmpfs (root only; skipped elsewhere), unmounted afterwards (as tests/data/test_cache_integrity.py)."""
    folder = Path(tempfile.mkdtemp(prefix="ff-small-disk-"))
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)], capture_output=True)
    if mount.returncode:
        folder.rmdir()
        pytest.skip(f"cannot mount a small tmpfs here: {mount.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)
        folder.rmdir()


def remount_read_only(folder: Path) -> None:
    done = subprocess.run(["mount", "-o", "remount,ro", str(folder)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot remount read-only here: {done.stderr.decode().strip()}")


def resume(tmp_path: Path, ckpt: Path, record: dict) -> FlowCheckpoint:
    """FlowCheckpoint's resume hooks on a real Trainer resuming ``ckpt`` (a module whose LoRA export would fail)."""
    trainer = L.Trainer(default_root_dir=tmp_path / "run", logger=False, enable_progress_bar=False)
    trainer.state.fn = TrainerFn.FITTING
    trainer.ckpt_path = str(ckpt)
    callback = FlowCheckpoint(dirpath=tmp_path / "run" / "checkpoints")
    module = SimpleNamespace(lora=object(), adapter=object())  # an export attempt raises (no LoRA layers to gather)
    callback.on_load_checkpoint(trainer, module, {EXPORT_KEY: record})
    callback.on_train_start(trainer, module)
    return callback


def test_resume_from_a_read_only_checkpoint_without_lora_folder_writes_nothing(tmp_path, small_disk, caplog):
    """A `last.ckpt` copied alone into a read-only folder: no `.lora` beside it. Resuming writes nothing there (main
    exported one beside the source: PermissionError/EROFS traceback) and warns once."""
    ckpt = small_disk / "last.ckpt"
    torch.save({EXPORT_KEY: {"step": 4, "id": "a" * 32}}, ckpt)
    remount_read_only(small_disk)
    with caplog.at_level(logging.WARNING, logger="ff_core.callbacks.checkpoint"):
        resume(tmp_path, ckpt, {"step": 4, "id": "a" * 32})
    assert sorted(p.name for p in small_disk.iterdir()) == ["last.ckpt"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no LoRA export beside the checkpoint" in warnings[0], warnings


def test_resume_with_a_mismatched_lora_folder_in_a_read_only_folder_leaves_it(tmp_path, small_disk, caplog):
    """The folder exists with another save's export but cannot be written: one warning, nothing written."""
    ckpt = small_disk / "last.ckpt"
    ckpt.write_bytes(b"x")
    folder = lora_dir_for(ckpt)
    folder.mkdir()
    (folder / "ff_export.json").write_text('{"step": 6, "id": "b", "checkpoint": "last.ckpt"}')
    remount_read_only(small_disk)
    with caplog.at_level(logging.WARNING, logger="ff_core.callbacks.checkpoint"):
        resume(tmp_path, ckpt, {"step": 4, "id": "a"})
    assert (folder / "ff_export.json").read_text().startswith('{"step": 6')
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not writable" in warnings[0], warnings


def test_resume_from_a_remote_checkpoint_creates_no_local_folder(tmp_path, caplog, monkeypatch):
    """`--ckpt_path s3://bucket/last.ckpt`: main resolved it as a local path and created `./s3:/bucket/...`."""
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="ff_core.callbacks.checkpoint"):
        resume(tmp_path, "s3://bucket/run/last.ckpt", {"step": 4, "id": "a"})
    assert not (tmp_path / "s3:").exists()


def test_a_full_disk_while_saving_a_checkpoint_is_one_error_and_keeps_the_old_file(small_disk):
    """A checkpoint larger than the disk: one DatasetError naming the file and the OS's reason, no temporary left,
    the previous `last.ckpt` and another file there intact."""
    path = small_disk / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 2}, path)
    (small_disk / "notes.txt").write_text("mine")
    before = path.read_bytes()
    with pytest.raises(DatasetError) as caught:
        io.save_checkpoint({"global_step": 4, "w": torch.zeros(200_000)}, path)  # 800 KB on a 256 KiB disk
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and "no space left" in message, message
    assert sorted(p.name for p in small_disk.iterdir()) == ["last.ckpt", "notes.txt"]
    assert path.read_bytes() == before and torch.load(path, weights_only=False)["global_step"] == 2
    assert (small_disk / "notes.txt").read_text() == "mine"


def test_the_start_removes_only_ff_temporaries(tmp_path):
    """A user's `.best.ckpt.bak` and `.ROOT.mynotes` survive both starts (FlowCheckpoint.setup and `ff data
    preprocess-latents`); temporaries named as mkstemp/mkdtemp name them (prefix `.NAME.`) and `.NAME.old` go."""
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    (ckpts / "best.ckpt").write_bytes(b"ckpt")
    (ckpts / ".best.ckpt.bak").write_bytes(b"the user's copy")
    fd, ckpt_tmp = tempfile.mkstemp(prefix=".last.ckpt.", dir=ckpts)
    os.close(fd)
    lora_tmp = tempfile.mkdtemp(prefix=".last.lora.", dir=ckpts)
    (ckpts / ".last.lora.old").mkdir()
    trainer = L.Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False)
    FlowCheckpoint(dirpath=ckpts).setup(trainer, SimpleNamespace(), "fit")
    assert sorted(p.name for p in ckpts.iterdir()) == [".best.ckpt.bak", "best.ckpt", "last.lora"]
    assert not Path(ckpt_tmp).exists() and not Path(lora_tmp).exists()

    root = tmp_path / "latents"
    root.mkdir()
    (root / "a.parquet").write_bytes(b"rows")
    (tmp_path / ".latents.mynotes").write_text("notes")
    shard_tmp = tempfile.mkdtemp(prefix=".latents.", dir=tmp_path)
    out = open(os.devnull, "w")
    assert preprocess_latents.main(["--output", str(root)], out=out) != 0  # not empty, no --overwrite
    assert (tmp_path / ".latents.mynotes").read_text() == "notes" and not Path(shard_tmp).exists()
    assert remove_leftovers(root) == [] and (tmp_path / ".latents.mynotes").exists()


def test_replace_dir_publishes_at_a_symlinks_target(tmp_path):
    """ROOT is a link to data/v1: the new content lands in data/v1 and ROOT stays the link (main exchanged the link
    itself: ROOT became a plain folder and data/v1 kept the old content)."""
    target = tmp_path / "data" / "v1"
    target.mkdir(parents=True)
    (target / "old.parquet").write_bytes(b"old")
    root = tmp_path / "ROOT"
    root.symlink_to(target)
    src = Path(tempfile.mkdtemp(prefix=".v1.", dir=target.parent))
    (src / "new.parquet").write_bytes(b"new")
    replace_dir(src, root)
    assert root.is_symlink() and root.resolve() == target.resolve()
    assert sorted(p.name for p in target.iterdir()) == ["new.parquet"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["v1"]


def test_the_reexport_decision_is_rank_zeros_broadcast(tmp_path, monkeypatch):
    """Every rank follows rank 0's decision (one `strategy.broadcast(src=0)` before any collective), so ranks that
    read `ff_export.json` differently cannot split between the export's barrier and training. Here rank 0 sees a
    real mismatch and the broadcast carries its folder; a rank told `None` exports nothing."""
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(b"x")
    folder = lora_dir_for(ckpt)
    folder.mkdir()
    (folder / "ff_export.json").write_text('{"step": 6, "id": "b", "checkpoint": "last.ckpt"}')
    calls = []
    trainer = L.Trainer(default_root_dir=tmp_path / "run", logger=False, enable_progress_bar=False)
    trainer.state.fn = TrainerFn.FITTING
    trainer.ckpt_path = str(ckpt)
    written = []
    callback = FlowCheckpoint(dirpath=tmp_path / "run" / "checkpoints")
    monkeypatch.setattr(callback, "_write_lora", lambda trainer, folder, *a: written.append(folder))

    def broadcast(obj, src=0):
        calls.append((obj, src))
        return None  # what another rank 0 decided

    monkeypatch.setattr(trainer.strategy, "broadcast", broadcast)
    module = SimpleNamespace(lora=object(), adapter=object())
    callback.on_load_checkpoint(trainer, module, {EXPORT_KEY: {"step": 4, "id": "a"}})
    callback.on_train_start(trainer, module)
    assert calls == [(str(folder.resolve()), 0)] and written == []


def test_a_full_disk_while_exporting_the_lora_is_one_error_and_keeps_the_old_export(tiny_sd3, small_disk):
    """The LoRA export of a real tiny SD3 module onto a disk filled up after a first export: one DatasetError naming
    the folder and the OS's reason, no hidden folder left, the previous `last.lora` whole."""
    from ff_core.lora import LoRAConfig
    from ff_core.module import FlowModule

    module = FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32}, lora=LoRAConfig(rank=2, alpha=2.0))
    module.configure_model()
    trainer = L.Trainer(default_root_dir=small_disk, logger=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    callback = FlowCheckpoint(dirpath=small_disk)
    folder = small_disk / "last.lora"
    callback._write_lora(trainer, folder, {"step": 2, "id": "a"}, "last.ckpt")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with open(small_disk / "filler", "wb", buffering=0) as f:  # leave (almost) no room
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    with pytest.raises(DatasetError) as caught:
        callback._write_lora(trainer, folder, {"step": 4, "id": "b"}, "last.ckpt")
    message = str(caught.value)
    assert "\n" not in message and str(folder) in message and "no space left" in message, message
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "last.lora"]
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
