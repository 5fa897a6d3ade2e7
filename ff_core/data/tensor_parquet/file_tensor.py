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
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence

import torch

from ff_core.data.dataflow.lazy import LazyValue, host_empty
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
        if out.numel() * out.element_size() != self.nbytes or not out.is_contiguous():
            raise ValueError(f"FileTensor.materialize_into: {self.nbytes} contiguous bytes expected, got a tensor of "
                             f"shape {tuple(out.shape)} and dtype {out.dtype}")
        if not self.nbytes:
            return
        fd = _FILES.get(self.path, self.identity, self.where)
        view = memoryview(out.view(-1).view(torch.uint8).numpy())
        got = os.preadv(fd, [view], self.offset)
        if got != self.nbytes:  # cannot happen while the identity holds (same size); kept as the reader's check
            raise DatasetError(self.path, None, None, f"{self.where}: bytes {self.offset}..{self.offset + self.nbytes}:"
                                                      f" only {got} could be read")


class _Files:
    """File descriptors of the files :class:`FileTensor` values were read from, per process (LRU, ``most`` open).

    A held file serves a value while it still has the identity the worker recorded (checked with ``fstat`` at every
    read: a file rewritten in place fails), even if another file was renamed over its path since: it holds the very
    bytes the worker located.
    """

    most = 64

    def __init__(self) -> None:
        self.open: OrderedDict[str, int] = OrderedDict()

    def get(self, path: str, identity: Identity, where: str) -> int:
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


def allocate(nbytes: int, shared: bool) -> torch.Tensor:
    """``nbytes`` of uint8: ``shared`` memory (torch sends it from a DataLoader worker without a copy), else
    :func:`~ff_core.data.dataflow.lazy.host_empty` memory (kept by Arrow's allocator for the next row)."""
    if shared:
        new_shared = getattr(torch.UntypedStorage, "_new_shared", None)  # what default_collate allocates with
        if new_shared is not None:
            return torch.empty(0, dtype=torch.uint8).set_(new_shared(nbytes))
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()
    return host_empty((nbytes,), torch.uint8)
