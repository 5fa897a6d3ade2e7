"""One run per run folder: ``ff fit`` holds an exclusive lock on its run folder for as long as it runs.

The run folder is where Lightning writes the run (``Trainer.log_dir``'s rule): the logger's ``version_N`` folder for
a TensorBoard or CSV logger, the logger's ``save_dir`` for another, ``trainer.default_root_dir`` without one. Two
``ff fit`` started at once with the same ``default_root_dir`` both compute ``version_0`` (Lightning numbers versions
by listing the folders that exist) and ff overwrites ``config.yaml`` (``save_config_kwargs={"overwrite": True}``, so
that a resumed run can reuse its folder), so they used to share one folder: one config, one ``last.ckpt``, one sample
log with both runs' lines.

Global rank 0 takes an ``flock`` on ``<run folder>/.ff-run.lock`` before Lightning starts, and keeps the file open:
the kernel drops the lock when the process ends however it ends (``kill -9`` included), so a crashed run never leaves
a folder locked. When the lock is held by a live run:

* a folder the logger numbers itself (``version: null``, the default) is skipped for the next number: each run gets
  its own ``version_N``; a folder that is free but already holds another run's files is skipped the same way;
* a folder the user named (``logger: false``, or a fixed ``version``) is refused with one line naming the running
  process: reusing such a folder on purpose (a resume into it) works once the other run has ended.

A checkpoint callback's explicit ``dirpath`` outside the run folder is locked too (refused when held). Filesystems
without ``flock`` (some Lustre mounts) get a warning and no lock.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import warnings
from pathlib import Path
from typing import IO

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from ff_core.errors import ConfigError

LOCK_NAME = ".ff-run.lock"


class RunFolderLock:
    """The locks one ``ff fit`` holds (global rank 0); :meth:`release` closes them (the process's end does too)."""

    def __init__(self) -> None:
        self.files: list[IO[str]] = []
        self.folders: list[Path] = []

    def release(self) -> None:
        for f in self.files:
            f.close()
        self.files.clear()


def claim_run_folder(trainer: L.Trainer) -> RunFolderLock:
    """Lock the trainer's run folder (and explicit checkpoint folders) for this run; pick a fresh ``version_N``
    when the logger numbers folders itself. Only global rank 0 locks; other ranks get an empty lock.

    Args:
        trainer: the run's trainer, before ``fit`` (its logger's version is fixed here when it was automatic).

    Raises:
        ConfigError: a folder the user named is the run folder of another ``ff fit`` that is still running.
    """
    held = RunFolderLock()
    if trainer.global_rank != 0:
        return held
    logger = trainer.loggers[0] if trainer.loggers else None
    numbered = isinstance(logger, (TensorBoardLogger, CSVLogger))
    auto = numbered and logger._version is None  # Lightning picks the next free version_N
    while True:
        folder = _run_folder(trainer, logger, numbered)
        lock = _try_lock(folder)
        if lock is None and not auto:
            key = "trainer.logger" if logger is not None else "trainer.default_root_dir"
            raise ConfigError(key, f"{folder} is the run folder of another ff fit that is still running "
                                   f"({_holder(folder)}): give this run its own folder or wait for that one to "
                                   "end")  # fmt: skip
        if lock is False or (lock is not None and (not auto or _fresh(folder))):
            break
        if lock is not None:
            lock.close()  # free, but another run's files are in it: Lightning would have numbered past it
        logger._version = int(logger.version) + 1
    if lock is not False:
        held.files.append(lock)
    held.folders.append(folder)
    for callback in trainer.checkpoint_callbacks:
        dirpath = getattr(callback, "dirpath", None) if isinstance(callback, ModelCheckpoint) else None
        if dirpath is None or "://" in str(dirpath) or _inside(Path(dirpath), held.folders):
            continue
        lock = _try_lock(Path(dirpath))
        if lock is None:
            held.release()
            raise ConfigError("trainer.callbacks", f"checkpoint dirpath {dirpath} is in use by another ff fit that "
                                                   f"is still running ({_holder(Path(dirpath))}): give this run its "
                                                   "own folder or wait for that one to end")  # fmt: skip
        if lock is not False:
            held.files.append(lock)
        held.folders.append(Path(dirpath))
    return held


def _run_folder(trainer: L.Trainer, logger: object, numbered: bool) -> Path:
    """``Trainer.log_dir`` without its broadcast (no process group exists yet)."""
    if logger is None:
        return Path(trainer.default_root_dir)
    if numbered:
        return Path(logger.log_dir)
    return Path(logger.save_dir or trainer.default_root_dir)


def _try_lock(folder: Path) -> IO[str] | None | bool:
    """The open, locked lock file; ``None`` when another process holds it; ``False`` when the filesystem has no
    ``flock`` (warned)."""
    folder.mkdir(parents=True, exist_ok=True)
    f = open(folder / LOCK_NAME, "a+")  # noqa: SIM115 - held open for the run's lifetime
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        f.close()
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        warnings.warn(f"{folder}: cannot lock the run folder ({exc}); two runs given this folder would share it",
                      stacklevel=2)
        return False
    f.seek(0)
    f.truncate()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started,
                        "argv": sys.argv}) + "\n")  # fmt: skip
    f.flush()
    return f


def _holder(folder: Path) -> str:
    """Who holds ``folder``'s lock, from what it wrote into the lock file."""
    try:
        info = json.loads((folder / LOCK_NAME).read_text().splitlines()[0])
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, IndexError, KeyError):
        return "holder unknown"


def _fresh(folder: Path) -> bool:
    return all(p.name == LOCK_NAME for p in folder.iterdir())


def _inside(path: Path, folders: list[Path]) -> bool:
    path = path.resolve()
    return any(path == f.resolve() or f.resolve() in path.parents for f in folders)
