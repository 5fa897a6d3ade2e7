"""``--ckpt_path`` checked before anything loads: one line naming the path instead of a loader's traceback.

A checkpoint Lightning writes (``torch.save``) is a zip archive whose directory sits at its end; a run killed while a
checkpoint was copied in place leaves a file cut short (no end-of-directory record) or empty, and the loader then
fails deep inside ``torch.load`` (``EOFError``, ``OSError: Invalid argument``). A folder is a checkpoint only when it
is a sharded one, recognised as Lightning does: an FSDP/FSDP2 folder (Lightning's ``meta.pt``, or
``torch.distributed.checkpoint``'s ``.metadata``, inside; ``lightning.fabric.strategies.fsdp._is_sharded_checkpoint``)
or a DeepSpeed folder (a ``checkpoint/`` folder inside;
``lightning.fabric.strategies.deepspeed._is_deepspeed_checkpoint``); any other folder is named as such, with the
checkpoint files in it, or, for a ``.lora`` export, the ``.ckpt`` beside it.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

from ff_core.errors import ConfigError

# Lightning's ckpt_path keywords (Trainer.fit docs: "last", "best", "hpc", "registry[:...]"): resolved by Lightning.
_KEYWORDS = ("last", "best", "hpc")
# A sharded checkpoint folder holds one of these files: torch.distributed.checkpoint's index, and Lightning's own
# metadata file (lightning.fabric.utilities.load._METADATA_FILENAME, checked by fsdp._is_sharded_checkpoint).
_SHARDED_METADATA = (".metadata", "meta.pt")
_DEEPSPEED_FOLDER = "checkpoint"  # lightning.fabric.strategies.deepspeed._is_deepspeed_checkpoint


def check_ckpt_path(ckpt_path: str | os.PathLike | None) -> None:
    """Refuse a ``ckpt_path`` that cannot be a checkpoint, with a ``ConfigError("ckpt_path", ...)``.

    Lightning's keywords (``last``, ``best``, ``hpc``, ``registry...``) and remote URLs (``s3://...``) pass unchecked.

    Args:
        ckpt_path: the ``--ckpt_path`` value of ``ff fit|validate|test|predict`` (``None``: nothing to check).
    """
    if ckpt_path is None:
        return
    text = os.fspath(ckpt_path)
    if text in _KEYWORDS or text.startswith("registry") or "://" in text:
        return
    path = Path(text)
    if not path.exists():
        raise ConfigError("ckpt_path", f"{text}: no such file")
    if path.is_dir():
        if any((path / name).is_file() for name in _SHARDED_METADATA):
            return  # a sharded (FSDP/FSDP2) checkpoint folder
        if (path / _DEEPSPEED_FOLDER).is_dir():
            return  # a DeepSpeed checkpoint folder (``checkpoint/`` and ``latest``)
        raise ConfigError("ckpt_path", f"{text}: is a folder, not a checkpoint file; {_folder_hint(path)}")
    size = path.stat().st_size
    if size == 0:
        raise ConfigError("ckpt_path", f"{text}: is empty (0 bytes): the run that wrote it was probably stopped while "
                                       "saving; resume from an earlier checkpoint")  # fmt: skip
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04":
        raise ConfigError("ckpt_path", f"{text}: is not a checkpoint (a Lightning checkpoint is a torch.save zip "
                                       f"archive; this file starts with {magic!r})")  # fmt: skip
    try:
        with zipfile.ZipFile(path) as archive:  # reads the directory at the end only
            archive.namelist()
    except (zipfile.BadZipFile, OSError):
        raise ConfigError("ckpt_path", f"{text}: is truncated or damaged ({size} bytes, no complete zip directory at "
                                       "its end): the run that wrote it was probably stopped while saving; resume "
                                       "from an earlier checkpoint") from None  # fmt: skip


def _folder_hint(path: Path) -> str:
    if path.suffix == ".lora":
        beside = path.with_suffix(".ckpt")
        return (f"it is the LoRA export of a checkpoint (no optimiser or data state): pass the checkpoint beside it"
                f"{f', {beside}' if beside.exists() else ''}")
    files = [p for p in path.iterdir() if p.suffix == ".ckpt"]
    if not files:
        return ("it holds no .ckpt file, and it is no sharded checkpoint folder (FSDP: a meta.pt or .metadata file "
                "inside; DeepSpeed: a checkpoint/ folder inside)")
    found = sorted(p.name for p in files)
    best = "last.ckpt" if "last.ckpt" in found else max(files, key=lambda p: p.stat().st_mtime).name
    shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
    return f"pass one of the checkpoints in it ({shown}), e.g. {path / best}"
