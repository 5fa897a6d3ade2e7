"""Atomic publication of files and folders: a reader sees the old version or the new one, never half of one.

Every temporary lies in the destination's own folder, named ``.NAME.XXXXXXXX`` beside ``NAME``, so the final rename
never crosses a filesystem: ``os.replace`` there is one atomic ``rename(2)``, where a move across filesystems (what
``shutil.move`` does when ``$TMPDIR`` is elsewhere) copies in place and a kill mid-copy leaves a truncated file.
Content is fsynced before it is renamed, and the folder after (POSIX ``rename(2)``, ``fsync(2)``).

A folder that exists already is swapped for the new one in one ``renameat2(2)`` with ``RENAME_EXCHANGE`` (Linux 3.15;
ext4, xfs, btrfs, tmpfs...): ``NAME`` is the old folder or the new one at every instant, and the old one is left at
the temporary's name, removed next. Where the filesystem cannot exchange (NFS, macOS), it is two renames with the old
folder parked at ``.NAME.old``; a kill between them leaves ``NAME`` missing until :func:`recover_dir` (run by the
next :func:`replace_dir` of that folder and by the writers' start) renames ``.NAME.old`` back.
:func:`remove_leftovers` removes the hidden temporaries a killed writer left (one writer per output).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

_AT_FDCWD = -100  # <fcntl.h>
_RENAME_EXCHANGE = 2  # <linux/fs.h>


def replace_dir(src: Path, dst: Path, *, fsync: bool = True) -> None:
    """Publish directory ``src`` at ``dst`` (``src`` must lie in ``dst``'s folder); an existing ``dst`` is exchanged
    for it atomically where the filesystem can (see the module docstring), then removed.

    Args:
        src: the new folder, complete.
        dst: where to publish it.
        fsync: flush ``src``'s files and folders to disk before publishing (a crash never publishes empty files).
    """
    src, dst = Path(src), Path(dst)
    if dst.is_symlink():  # publish at the link's target: an exchange would swap the link itself for the folder
        dst = dst.resolve()
    recover_dir(dst)
    if fsync:
        _fsync_tree(src)
    if not dst.exists():
        os.replace(src, dst)
        _fsync_dir(dst.parent)
        return
    try:
        _exchange(src, dst)  # dst is the new folder now, src the old one
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        old = _parked(dst)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(src, dst)  # a kill before this line: recover_dir(dst) puts `old` back
        _fsync_dir(dst.parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    _fsync_dir(dst.parent)
    shutil.rmtree(src, ignore_errors=True)


def recover_dir(dst: Path) -> bool:
    """Finish what an interrupted two-rename :func:`replace_dir` left: with ``dst`` missing and its old version parked
    at ``.NAME.old``, rename that back (the new version was never published); with both present, remove the parked one.

    Returns whether ``dst`` was restored.

    Args:
        dst: the published folder.
    """
    dst = Path(dst)
    old = _parked(dst)
    if not old.is_dir():
        return False
    if dst.exists():
        shutil.rmtree(old, ignore_errors=True)
        return False
    os.replace(old, dst)
    _fsync_dir(dst.parent)
    return True


TEMP_SUFFIX = r"[a-z0-9_]{8}"
"""The random part ``tempfile.mkstemp``/``mkdtemp`` append to a prefix (``tempfile._RandomNameSequence``: 8 of
``a-z0-9_``): with the prefix ``.NAME.`` this module (and ``Adapter.save_loras``) uses, a temporary is exactly
``.NAME.`` plus this."""


def is_leftover(name: str, target: str) -> bool:
    """Whether ``name`` is one of the hidden names a writer of ``target`` creates: ``.TARGET.XXXXXXXX`` (a temporary)
    or ``.TARGET.old`` (a parked folder). A user's ``.TARGET.bak`` or ``.TARGET.mynotes`` is not.

    Args:
        name: a file name beside ``target``.
        target: the published file's or folder's name.
    """
    return re.fullmatch(re.escape(f".{target}.") + f"(?:{TEMP_SUFFIX}|old)", name) is not None


def remove_leftovers(path: Path) -> list[Path]:
    """Remove the hidden temporaries of ``path`` (``.NAME.XXXXXXXX`` and ``.NAME.old`` beside it, nothing else) that a
    killed writer left, after :func:`recover_dir`. Call it only where no other process writes ``path`` at the same
    time.

    Returns what was removed.

    Args:
        path: a file or folder published with this module.
    """
    path = Path(path)
    recover_dir(path)
    removed = []
    for entry in path.parent.glob(f".{glob.escape(path.name)}.*"):
        if not is_leftover(entry.name, path.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


@contextlib.contextmanager
def open_atomic(path: str | os.PathLike) -> Iterator[IO[bytes]]:
    """A binary file to write ``path``'s new content into: a temporary beside ``path``, fsynced and renamed over it
    when the block ends, removed if the block raises.

    Args:
        path: the file to publish (its folder is created).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.chmod(fd, 0o666 & ~_umask())  # mkstemp creates 0600; a published file is an ordinary one (shared roots)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to a temporary file beside ``path``, fsync it, then rename it over ``path``."""
    with open_atomic(path) as f:
        f.write(data)
    return Path(path)


def _parked(dst: Path) -> Path:
    return dst.with_name(f".{dst.name}.old")


def _exchange(src: Path, dst: Path) -> None:
    """``renameat2(src, dst, RENAME_EXCHANGE)``: both paths stay, their contents swap, in one step."""
    if not sys.platform.startswith("linux"):
        raise OSError(errno.ENOSYS, "renameat2 is Linux-only")
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)  # glibc 2.28+
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "libc has no renameat2")
    if renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(src), None, str(dst))


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(folder))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a platform where folders cannot be opened (Windows): nothing to flush
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    """The process's umask (reading it means setting it: restored at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
