"""A full disk while ff writes derived data (condition caches, tensor-parquet shards): one line, not a traceback.

Python and pyarrow report it as an ``OSError`` whose ``errno`` is ``ENOSPC`` (no space left), ``EDQUOT`` (quota)
or ``EFBIG`` (larger than the file system or the process's ``RLIMIT_FSIZE`` allows); pyarrow's carries no file
name, so the writer names the file it was writing. The callers remove what they had written before raising
(:func:`ff_core.data.cache.store.open_or_build`, :func:`ff_core.cli.preprocess_latents.write_latent_shards`), so a rerun
with space starts clean.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from ff_core.errors import DatasetError

DISK_FULL = {errno.ENOSPC: "no space left on device", errno.EFBIG: "file too large (file system or RLIMIT_FSIZE "
             "limit)", getattr(errno, "EDQUOT", -1): "disk quota exceeded"}  # fmt: skip


class DiskFullError(DatasetError):
    """No room to write derived data. ``str(err)`` is ``path: reason`` (``ff fit`` prints it as one line, exit 2).

    Args:
        path: the file being written (or its folder).
        reason: what failed, what was removed and what to do.
    """

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        super().__init__(path, None, None, reason)

    def __reduce__(self):
        return (DiskFullError, (self.path, self.reason))


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in DISK_FULL


def disk_full_error(exc: OSError, path: str | os.PathLike, writing: str, removed: str) -> DiskFullError:
    """The one-line error for ``exc`` (an :func:`is_disk_full` error) met while writing ``writing`` at ``path``.

    Args:
        exc: the ``OSError``.
        path: the file being written when it was raised, or its folder (``exc.filename`` wins when set).
        writing: what was being written (``the condition cache shapes/train``).
        removed: what was removed, for the message (``the partial build folder``).
    """
    where = Path(exc.filename) if isinstance(exc.filename, str) else Path(path)
    free = _free(where)
    return DiskFullError(where, f"{DISK_FULL[exc.errno]} while writing {writing}{free}; {removed} was removed, "
                                "nothing was published: free space (or write elsewhere) and rerun")  # fmt: skip


def _free(path: Path) -> str:
    for folder in (path, *path.parents):
        try:
            return f" ({shutil.disk_usage(folder).free} bytes free there)"
        except OSError:
            continue
    return ""
