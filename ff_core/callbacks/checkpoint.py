"""Lightning checkpoints plus, when training a LoRA, a diffusers-loadable LoRA folder beside each one.

``epoch=0-step=20.ckpt`` gets ``epoch=0-step=20.lora/pytorch_lora_weights.safetensors``, loadable with the
family's diffusers pipeline (``pipe.load_lora_weights(folder)``) at the trained scale ``alpha / rank``: the file's
``lora_adapter_metadata`` holds the peft config the run applied. An adapter with several trained networks
(``Adapter.denoisers()``) gets one file per network in the same folder (``Adapter.lora_file``: Wan2.2's second expert
is ``pytorch_lora_weights_transformer_2.safetensors``).

What a kill leaves (docs/scaling.md, "Checkpoints and LoRA exports"):

* **A checkpoint file is never half written**: :class:`AtomicCheckpointIO` writes it to a temporary beside it, fsyncs
  and renames it (:func:`ff_core.atomic.open_atomic`), where Lightning's writer goes through ``$TMPDIR`` and
  ``shutil.move``, which copies in place across filesystems. The LoRA folder is published by one atomic exchange
  (:func:`ff_core.atomic.replace_dir`).
* **A pair is checked**: the LoRA is exported first, then the checkpoint, each recording the same export (step and a
  random id: ``ff_export.json`` in the folder, :data:`EXPORT_KEY` in the checkpoint). A kill between the two leaves the
  folder one save ahead: resuming from the checkpoint re-exports its LoRA; ``ff predict|validate|test`` refuse the
  mismatched pair with one line naming both steps (:func:`check_lora_export`).
* **Leftovers are removed** when a run starts: hidden temporaries of checkpoints and exports, and an interrupted
  folder swap is recovered (:func:`ff_core.atomic.remove_leftovers`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from ff_core.atomic import TEMP_SUFFIX, open_atomic, remove_leftovers
from ff_core.disk_full import disk_full_error, is_disk_full
from ff_core.errors import ConfigError
from ff_core.lora import lora_configs, lora_state_dicts
from ff_core.plugins import takes_argument
from ff_core.sharding import summoned

log = logging.getLogger(__name__)

EXPORT_KEY = "ff_lora_export"
"""The checkpoint entry naming the LoRA export written with it: ``{"step": int, "id": str}``."""
EXPORT_FILE = "ff_export.json"
"""The file in a LoRA folder naming its export, as :data:`EXPORT_KEY` does (plus the checkpoint's file name)."""


def lora_dir_for(checkpoint_path: str | Path) -> Path:
    path = Path(checkpoint_path)
    return path.with_name(path.stem + ".lora")


def read_export(folder: Path) -> dict[str, Any] | None:
    """The export record of a LoRA folder, ``None`` for a folder without one (missing, or written before ff recorded
    them)."""
    try:
        return json.loads((Path(folder) / EXPORT_FILE).read_text())
    except (OSError, ValueError):
        return None


def check_lora_export(checkpoint_path: str | Path | None, checkpoint: dict[str, Any]) -> None:
    """Refuse a checkpoint whose LoRA folder beside it holds another save's export (a run killed between the two
    writes): ``ConfigError`` on ``ckpt_path`` naming both steps. A checkpoint without a record or without a folder
    (never exported, removed, or written before records) passes. A sharded folder checkpoint is checked alike.

    Args:
        checkpoint_path: the loaded file (``trainer.ckpt_path``).
        checkpoint: its content.
    """
    record = checkpoint.get(EXPORT_KEY)
    if checkpoint_path is None or record is None or not Path(checkpoint_path).exists():
        return
    folder = lora_dir_for(Path(checkpoint_path).resolve())  # `last.ckpt` may link to the step's file (save_last="link")
    exported = read_export(folder)
    if folder.is_dir() and (exported is None or exported.get("id") != record["id"]):
        found = f"step {exported['step']}" if exported else "no export record"
        raise ConfigError("ckpt_path", f"{checkpoint_path} holds step {record['step']} but the LoRA folder {folder} "
                          f"beside it holds {found} (a run stopped between the two writes): resume from the "
                          f"checkpoint (ff fit --ckpt_path) to export its LoRA again, or remove {folder}")  # fmt: skip


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` writing a local checkpoint through a temporary file beside it, fsynced and
    renamed over it (:func:`ff_core.atomic.open_atomic`): a kill leaves the old file or the new one. Remote paths
    (``s3://``...) keep Lightning's writer. :class:`FlowCheckpoint` installs it in place of the default one; name it
    in ``trainer.plugins`` to use it without that callback."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        try:
            with open_atomic(path) as f:  # removes its temporary if this raises: the previous file stays
                torch.save(checkpoint, f)
        except Exception as exc:
            full = _disk_full_cause(exc)
            if full is None:
                raise
            raise disk_full_error(full, path, f"the checkpoint {path}", "its temporary file") from None


def _disk_full_cause(exc: BaseException) -> OSError | None:
    """The disk-full ``OSError`` (:func:`ff_core.disk_full.is_disk_full`) behind ``exc``, if any: torch's zip
    writer may wrap the file's ``OSError`` in a ``RuntimeError``; safetensors' Rust writer raises a
    ``SafetensorError`` whose message ends ``(os error 28)`` (Rust's ``io::Error`` display)."""
    seen: BaseException | None = exc
    while seen is not None:
        if is_disk_full(seen):
            return seen  # type: ignore[return-value]
        code = re.search(r"\(os error (\d+)\)", str(seen))
        if code and is_disk_full(OSError(int(code.group(1)), "")):
            return OSError(int(code.group(1)), os.strerror(int(code.group(1))))
        seen = seen.__cause__ or seen.__context__
    return None


class FlowCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that also exports the LoRA of a FlowModule trained with ``model.lora``, writes every file
    atomically and keeps each checkpoint and its export in step (see the module docstring).

    Accepts every argument of :class:`lightning.pytorch.callbacks.ModelCheckpoint`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._export: dict[str, Any] | None = None  # the record of the export being paired with a checkpoint
        self._reexport: tuple[str, dict[str, Any]] | None = None  # the resumed checkpoint and its export record

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default; a user's plugin stays
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if stage == "fit" and trainer.is_global_zero and self.dirpath and Path(self.dirpath).is_dir():
            # `.NAME.XXXXXXXX` (a temporary) or `.NAME.old` (a parked folder) of a checkpoint or an export
            # exactly (ff_core.atomic.is_leftover): a user's `.best.ckpt.bak` stays
            pattern = rf"\.(.+\.(?:ckpt|lora))\.(?:{TEMP_SUFFIX}|old)"
            hidden = (re.fullmatch(pattern, e.name) for e in Path(self.dirpath).iterdir())
            for name in sorted({m.group(1) for m in hidden if m}):
                for removed in remove_leftovers(Path(self.dirpath) / name):
                    log.info("removed %s (left by an interrupted save)", removed)
        trainer.strategy.barrier("ff_checkpoint_leftovers")

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        module = trainer.lightning_module
        if getattr(module, "lora", None) is None or module.adapter is None:
            return super()._save_checkpoint(trainer, filepath)
        record = {"step": trainer.global_step, "id": uuid.uuid4().hex}
        self._write_lora(trainer, lora_dir_for(filepath), record, Path(filepath).name)  # the export first, then
        self._export = record  # the checkpoint recording it (on_save_checkpoint)
        try:
            super()._save_checkpoint(trainer, filepath)
        finally:
            self._export = None

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self._export is not None:
            checkpoint[EXPORT_KEY] = dict(self._export)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        record, path = checkpoint.get(EXPORT_KEY), trainer.ckpt_path
        if record is None or path is None or trainer.state.fn != "fit":
            return
        self._reexport = (str(path), {**record, "checkpoint": Path(path).name})  # decided in on_train_start

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Resuming from a checkpoint whose LoRA folder beside it holds another save (a kill between the two
        writes): export its LoRA again there, from the weights just restored. Rank 0 decides
        (:meth:`_reexport_folder`) and every rank follows, so all or none enter the export's collectives."""
        if self._reexport is None:
            return
        (path, record), self._reexport = self._reexport, None
        if getattr(pl_module, "lora", None) is None or pl_module.adapter is None:
            return
        folder = self._reexport_folder(path, record) if trainer.is_global_zero else None
        folder = trainer.strategy.broadcast(folder, src=0)
        if folder is not None:
            self._write_lora(trainer, Path(folder), record, record["checkpoint"])

    @staticmethod
    def _reexport_folder(path: str, record: dict[str, Any]) -> str | None:
        """Where to export the resumed checkpoint's LoRA again: its folder when that exists with another export, is
        local and writable; else ``None`` (one warning where the folder is missing or cannot be written: the run's
        own next save publishes a matched pair in its own folder).

        Args:
            path: the resumed checkpoint (``trainer.ckpt_path``).
            record: its :data:`EXPORT_KEY` entry.
        """
        if "://" in path:
            log.warning("%s: a remote checkpoint; its LoRA export is not checked nor written beside it", path)
            return None
        folder = lora_dir_for(Path(path).resolve())  # `last.ckpt` may link to the step's file
        if not folder.is_dir():
            log.warning("%s: no LoRA export beside the checkpoint; none written there (the run's next save exports "
                        "one beside its own checkpoint)", folder)  # fmt: skip
            return None
        found = read_export(folder)
        if found is not None and found.get("id") == record["id"]:
            return None
        held = f"step {found['step']}" if found else "no export record"
        if not os.access(folder.parent, os.W_OK | os.X_OK):
            log.warning("%s: the LoRA export beside the checkpoint holds %s, not step %d, and its folder is not "
                        "writable: left as is", folder, held, record["step"])  # fmt: skip
            return None
        log.warning("%s: the LoRA export beside the checkpoint holds %s, not step %d: exported again",
                    folder, held, record["step"])
        return str(folder)

    def _write_lora(self, trainer: L.Trainer, folder: Path, record: dict[str, Any], checkpoint_name: str) -> None:
        module = trainer.lightning_module
        with summoned(trainer.strategy.model):  # FSDP1: full parameters; FSDP2's shards are gathered per tensor
            states = lora_state_dicts(module.adapter)  # every rank takes part in the gathering
        if trainer.is_global_zero:  # one file per trained network (Adapter.lora_file)
            meta = json.dumps({"step": record["step"], "id": record["id"], "checkpoint": checkpoint_name}).encode()
            configs = lora_configs(module.adapter)
            try:  # save_loras removes its hidden folder if this raises: the previous export stays
                if takes_argument(module.adapter.save_loras, "extra_files"):
                    module.adapter.save_loras(folder, states, configs, extra_files={EXPORT_FILE: meta})
                else:  # an override written before extra_files: the record follows its folder (read as unfinished
                    module.adapter.save_loras(folder, states, configs)  # until it is there)
                    with open_atomic(folder / EXPORT_FILE) as f:
                        f.write(meta)
            except Exception as exc:
                full = _disk_full_cause(exc)
                if full is None:
                    raise
                raise disk_full_error(full, folder, f"the LoRA export {folder}",
                                      "its hidden temporary folder") from None
        trainer.strategy.barrier("ff_lora_export")

    def _remove_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        super()._remove_checkpoint(trainer, filepath)
        if trainer.is_global_zero:
            shutil.rmtree(lora_dir_for(filepath), ignore_errors=True)
