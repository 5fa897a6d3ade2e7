"""Values a DataLoader worker describes and the main process reads: the seam that keeps large rows off the
worker-to-main-process channel.

A tensor a worker returns crosses to the main process in shared memory: torch copies it into a fresh segment (unless
it is in one already), whose pages the kernel allocates and zeroes, and the main process maps and faults them in
again when it touches them. For a tensor that is already a byte range of a page-cached file (an uncompressed
tensor-parquet value) that costs more than reading it (benchmarks/RESULTS.md, "Tensor-parquet shards", run H). A
worker can instead return a :class:`LazyValue`: a small picklable description (which file, which bytes, which shape)
that the main process turns into the tensor with one read, into memory it owns.

Every batch :class:`~ff_core.data.dataflow.DataflowLoader` yields passes through :func:`materialize` in the main
process (dicts, lists and tuples are walked; every :class:`LazyValue` is replaced by what it describes), so
processors, batchers and collators may return lazy values and the training step never sees one. A collator stacks
lazy values with :func:`stack` (each read straight into its slice of the batch tensor: no second copy), and a step
that needs the values themselves in a worker calls :func:`materialize` there (same result, the old cost). Tensors
are allocated by :func:`host_empty`, from memory Arrow's allocator keeps for the next batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch


class LazyValue:
    """A value described in a worker and read in the process that calls :meth:`materialize`.

    Subclasses are small and picklable (they cross the worker's queue), have the ``shape`` and ``dtype`` of the tensor
    they describe, and implement :meth:`materialize_into`; :meth:`materialize` allocates (:func:`host_empty`) and
    calls it.
    """

    shape: torch.Size
    dtype: torch.dtype
    pinned: bool = False  # materialise into page-locked memory (:meth:`pin_memory`)

    def materialize(self) -> torch.Tensor:
        """The tensor, in memory it owns (writable; page-locked once :meth:`pin_memory` was called, else from
        :func:`host_empty`)."""
        if self.pinned:
            out = torch.empty(self.shape, dtype=self.dtype, pin_memory=True)
        else:
            out = host_empty(self.shape, self.dtype)
        self.materialize_into(out)
        return out

    def pin_memory(self, device: Any = None) -> LazyValue:
        """Ask for page-locked memory where this value is read. A ``DataLoader(pin_memory=True)`` pins each batch
        before :func:`materialize` reads it (torch calls ``pin_memory()`` on any object that has one), so the read
        itself must allocate pinned memory."""
        self.pinned = True
        return self

    def materialize_into(self, out: torch.Tensor) -> None:
        """Write the tensor into ``out`` (contiguous, of ``shape`` and ``dtype``)."""
        raise NotImplementedError

    def padded(self, length: int) -> LazyValue:
        """This value zero-padded on axis 0 to ``length`` entries (``length >= shape[0]``)."""
        return LazyPadded(self, length)


class LazyPadded(LazyValue):
    """A lazy value zero-padded on axis 0 (:meth:`LazyValue.padded`).

    Args:
        value: the value.
        length: entries on axis 0 after padding, at least the value's.
    """

    def __init__(self, value: LazyValue, length: int) -> None:
        if not value.shape or length < value.shape[0]:
            raise ValueError(f"LazyPadded: cannot pad shape {tuple(value.shape)} to {length} entries on axis 0")
        self.value, self.shape, self.dtype = value, torch.Size((length, *value.shape[1:])), value.dtype
        self.pinned = value.pinned

    def materialize_into(self, out: torch.Tensor) -> None:
        n = self.value.shape[0]
        self.value.materialize_into(out[:n])
        out[n:].zero_()


class LazyStack(LazyValue):
    """``torch.stack(values)`` of tensors and lazy values, read into one batch tensor in :meth:`materialize`.

    Args:
        values: tensors or :class:`LazyValue` of one shape and dtype.
    """

    def __init__(self, values: Sequence[torch.Tensor | LazyValue]) -> None:
        if not values:
            raise ValueError("LazyStack: cannot stack no value")
        shapes = {tuple(v.shape) for v in values}
        dtypes = {v.dtype for v in values}
        if len(shapes) > 1 or len(dtypes) > 1:  # what torch.stack would refuse
            raise ValueError(f"LazyStack: values of one shape and dtype expected, found shapes {sorted(shapes)} and "
                             f"dtypes {sorted(map(str, dtypes))}")
        self.values = list(values)
        self.shape = torch.Size((len(values), *values[0].shape))
        self.dtype = values[0].dtype

    def materialize_into(self, out: torch.Tensor) -> None:
        for slot, value in zip(out, self.values):
            if isinstance(value, LazyValue):
                value.materialize_into(slot)
            else:
                slot.copy_(value)


def stack(values: Sequence[torch.Tensor | LazyValue]) -> torch.Tensor | LazyValue:
    """``torch.stack(values)``, or a :class:`LazyStack` when any value is lazy (read where it is materialised).
    CPU tensors of one dtype are stacked into :func:`host_empty` memory; values of several dtypes (or shapes) are
    stacked as ``torch.stack`` stacks them, lazy ones read first (it promotes dtypes, or names the shapes)."""
    values = list(values)
    uniform = len({v.dtype for v in values}) == 1 and len({tuple(v.shape) for v in values}) == 1
    if any(isinstance(v, LazyValue) for v in values):
        return LazyStack(values) if uniform else torch.stack([materialize(v) for v in values])
    if not uniform or values[0].device.type != "cpu":
        return torch.stack(values)
    return torch.stack(values, out=host_empty((len(values), *values[0].shape), values[0].dtype))


def host_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor from Arrow's allocator (mimalloc or jemalloc), which keeps freed memory for the
    next batch. ``torch.empty`` takes a large buffer from the C allocator, which maps fresh pages for each one
    (above 32 MB always): the kernel zeroes and faults in every page again, ~0.5 ms a MB, more than the copy that
    fills it.

    The tensor views a fixed buffer: its storage is not resizable (``resize_`` to more elements, or an ``out=``
    of another size, raises); allocate anew (or ``clone()``) for another shape."""
    import pyarrow as pa  # ff_core's dependency, imported where rows are read only

    shape = torch.Size(shape)
    nbytes = shape.numel() * dtype.itemsize
    if not nbytes:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(memoryview(pa.allocate_buffer(nbytes)), dtype=torch.uint8).view(dtype).view(shape)


def materialize(obj: Any) -> Any:
    """``obj`` with every :class:`LazyValue` in it (in dicts, lists and tuples, recursively) read; other values are
    returned as they are (containers holding no lazy value are not copied)."""
    if isinstance(obj, LazyValue):
        return obj.materialize()
    if isinstance(obj, dict):
        changed = {k: new for k, v in obj.items() if (new := materialize(v)) is not v}
        if not changed:
            return obj
        out = copy.copy(obj)  # keeps the mapping's type (and its other entries)
        out.update(changed)
        return out
    if isinstance(obj, (list, tuple)):
        done = [materialize(v) for v in obj]
        if all(a is b for a, b in zip(done, obj)):
            return obj
        return type(obj)(*done) if hasattr(obj, "_fields") else type(obj)(done)  # a namedtuple takes fields
    return obj


_RELEASE: list[Callable[[], None]] = []


def on_release(fn: Callable[[], None]) -> None:
    """Register ``fn`` to let go of what a kind of lazy value keeps in this process between reads (the open files
    :class:`~ff_core.data.tensor_parquet.FileTensor` reads through), called by :func:`release`."""
    _RELEASE.append(fn)


def release() -> None:
    """Let go of what lazy values keep between reads (:func:`on_release`); the next read opens what it needs again.
    :class:`~ff_core.data.dataflow.DataflowLoader` calls it when an iteration ends (exhausted, or abandoned)."""
    for fn in _RELEASE:
        fn()
