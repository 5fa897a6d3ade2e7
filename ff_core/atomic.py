"""Atomic publication of files and folders: a reader sees the old version or the new one, never half of one."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def replace_dir(src: Path, dst: Path) -> None:
    """Publish directory ``src`` at ``dst``; an existing ``dst`` is swapped out by rename, then removed."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to a temporary file beside ``path``, fsync it, then rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.chmod(fd, 0o666 & ~_umask())  # mkstemp creates 0600; a published file is an ordinary one (shared roots)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    """The process's umask (reading it means setting it: restored at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
