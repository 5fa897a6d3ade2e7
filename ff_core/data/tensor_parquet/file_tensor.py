""":class:`FileTensor`: an uncompressed ``_bytes`` value as a DataLoader worker hands it to the main process.

A 10 MB row a worker returns as tensors crosses in fresh shared memory: the kernel allocates and zeroes its pages,
the main process faults them in again, and with workers the loader delivered rows 3-10x slower than reading them in
the main process (benchmarks/RESULTS.md, "Tensor-parquet shards", runs D-H). An uncompressed value is already a byte
range of a page-cached file, so a worker (``TensorParquetDataset(hand_off=True)``) locates it, checks it, asks the
kernel to read it ahead (``posix_fadvise(WILLNEED)``) and returns this description instead; the main process reads
it with one ``pread`` into memory it owns (:meth:`materialize`, or straight into its slice of a batch tensor:
:meth:`materialize_into`) -- the copy a main-process read makes, with the locating and checking done elsewhere.

The worker records the file's identity (device, inode, size, modification time); the reading process checks it, so
a file replaced between the two reads is an error naming it, never another file's bytes.

The reading process keeps the files it read from open (:class:`_Files`, a few dozen at most), for the next value of
the same file; threads share them under a lock, a forked child closes its inherited copies, and they are closed when
a :class:`~ff_core.data.dataflow.DataflowLoader` iteration ends (:func:`~ff_core.data.dataflow.lazy.release`).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from ff_core.data.dataflow.lazy import LazyValue, host_empty, on_release
from ff_core.errors import DatasetError

Identity = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns


def file_identity(fd: int) -> Identity:
    """What must not change between locating a value and reading it: the open file's device, inode, size, mtime."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class FileTensor(LazyValue):
    """Bytes ``offset`` to ``offset + nbytes`` of ``path``: a C-order tensor of ``shape`` and ``dtype``.

    Args:
        path: the file.
        identity: :func:`file_identity` of the file when the value was located.
        offset: where the value's bytes start.
        shape: the tensor's shape (``nbytes`` is ``prod(shape) x itemsize``, checked by the worker against the file).
        dtype: the tensor's dtype.
        where: the row and column, for errors (``"row 5 (row group 5, dataset row 1029): vae_latent_bytes"``).
    """

    def __init__(self, path: str, identity: Identity, offset: int, shape: Sequence[int], dtype: torch.dtype,
                 where: str = "") -> None:
        self.path, self.identity, self.offset, self.where = path, identity, offset, where
        self.shape, self.dtype = torch.Size(shape), dtype

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"FileTensor({self.path!r}, offset={self.offset}, shape={tuple(self.shape)}, dtype={self.dtype})"

    def materialize_into(self, out: torch.Tensor) -> None:
        if out.dtype != self.dtype or out.shape != self.shape or not out.is_contiguous():
            raise ValueError(f"FileTensor.materialize_into: a contiguous tensor of shape {tuple(self.shape)} and dtype "
                             f"{self.dtype} expected, got shape {tuple(out.shape)} and dtype {out.dtype}"
                             f"{'' if out.is_contiguous() else ' (not contiguous)'}")
        if not self.nbytes:
            return
        view = memoryview(out.view(-1).view(torch.uint8).numpy())
        got = _FILES.read_into(self.path, self.identity, self.where, view, self.offset)
        if got != self.nbytes:  # cannot happen while the identity holds (same size); kept as the reader's check
            raise DatasetError(self.path, None, None, f"{self.where}: bytes {self.offset}..{self.offset + self.nbytes}:"
                                                      f" only {got} could be read")


def pread_full(fd: int, view: memoryview, offset: int) -> int:
    """Read the file's bytes from ``offset`` into ``view`` (1-D bytes) with ``pread``, again after a short read (a
    signal, a network or FUSE file system may return fewer bytes than asked), until it is full or the file ends;
    returns the bytes read."""
    done, size = 0, len(view)
    while done < size:
        got = os.preadv(fd, [view[done:]], offset + done)
        if not got:  # end of file
            break
        done += got
    return done


class _Files:
    """File descriptors of the files :class:`FileTensor` values were read from, per process (LRU, ``most`` open).

    A held file serves a value while it still has the identity the worker recorded (checked with ``fstat`` at every
    read: a file rewritten in place fails), even if another file was renamed over its path since: it holds the very
    bytes the worker located. One lock covers looking a descriptor up and reading through it: another thread could
    otherwise close it (evicting it, or :meth:`close`) mid-read, and the number be reused for another file.
    """

    most = 64

    def __init__(self) -> None:
        self.open: OrderedDict[str, int] = OrderedDict()
        self.lock = threading.Lock()

    def read_into(self, path: str, identity: Identity, where: str, view: memoryview, offset: int) -> int:
        """:func:`pread_full` from the held (or newly opened) file of ``path`` with ``identity``."""
        with self.lock:
            return pread_full(self.get(path, identity, where), view, offset)

    def close(self) -> None:
        """Close every held file (the next read opens it again)."""
        with self.lock:
            self._close_all()

    def after_fork(self) -> None:
        """In a forked child: close the descriptors it inherited (its own copies) under a fresh lock (the parent's
        may have been held by another thread at the fork)."""
        self.lock = threading.Lock()
        self._close_all()

    def _close_all(self) -> None:
        while self.open:
            os.close(self.open.popitem()[1])

    def get(self, path: str, identity: Identity, where: str) -> int:
        """The descriptor of ``path`` with ``identity``; call with :attr:`lock` held."""
        fd = self.open.get(path)
        if fd is not None and file_identity(fd) == identity:
            self.open.move_to_end(path)
            return fd
        if fd is not None:  # another file than the value's (the path was reused), or this one changed: look again
            os.close(self.open.pop(path))
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise DatasetError(path, None, None, f"{where}: cannot be opened to read a value a DataLoader worker "
                                                 f"located in it: {exc}") from None
        found = file_identity(fd)
        if found != identity:
            os.close(fd)
            raise DatasetError(path, None, None, f"{where}: the file changed after a DataLoader worker located the "
                                                 f"value (size, mtime {identity[2:]} then, {found[2:]} now; a new "
                                                 "file renamed over it, or rewritten in place): replace shard files "
                                                 "only between runs")
        self.open[path] = fd
        while len(self.open) > self.most:
            os.close(self.open.popitem(last=False)[1])
        return fd


_FILES = _Files()


def _close_files() -> None:
    _FILES.close()


def _after_fork() -> None:
    _FILES.after_fork()


on_release(_close_files)  # a DataflowLoader iteration ended
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def allocate(nbytes: int, shared: bool) -> torch.Tensor:
    """``nbytes`` of uint8: ``shared`` memory (torch sends it from a DataLoader worker without a copy), else
    :func:`~ff_core.data.dataflow.lazy.host_empty` memory (kept by Arrow's allocator for the next row)."""
    if shared:
        new_shared = getattr(torch.UntypedStorage, "_new_shared", None)  # what default_collate allocates with
        if new_shared is not None:
            return torch.empty(0, dtype=torch.uint8).set_(new_shared(nbytes))
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()
    return host_empty((nbytes,), torch.uint8)
