"""``TensorParquetDataset``: map-style random access to the rows of tensor-parquet shards.

A row read touches only the row group that holds it and the requested columns of a memory-mapped file. The tensors'
``_bytes`` values are located in their pages directly (:mod:`.pages`, the footer and page headers read through the
mapping): an uncompressed value is read with ``pread`` into memory its tensor owns (one kernel copy from the page
cache), a compressed one is viewed in its page as the codec decompressed it (that copy is the only one, unless the
value is misaligned for its dtype inside the page). pyarrow decodes the small columns (scalars, ``_shape``,
``_dtype``) and any ``_bytes`` chunk the page reader does not support (a tensor then views pyarrow's decoded buffer,
as with ``direct=False``). The file pages a read touched through the mapping are unmapped after it
(:class:`_Mapped`), so the resident set stays flat however much of the dataset is read. A tensor viewing a decoded
buffer is read-only: clone before editing one in place, or pass ``copy=True``.

What a row read costs besides its copy is per-row setup, so two bounded per-process caches hold what is fixed per
file: the small columns of a whole file, decoded at once (:meth:`TensorParquetDataset._file_small`), and where each
row group's uncompressed ``_bytes`` values lie (:attr:`_Mapped.locations`), so a row read again parses no header.
For a file whose values are all uncompressed, its row catalogue (:mod:`.catalogue`: both, stored beside the file by
ff's writer or by the first reader that filled them) fills them at the file's first read in a new process: a row is
then located without parsing or decoding anything. :meth:`TensorParquetDataset.describe` returns a
row's uncompressed tensors as file ranges the caller reads where it wants them (one copy into a batch).

Files written by ff (:class:`~ff_core.data.tensor_parquet.writer.TensorParquetWriter`) hold one row per row group,
so a read decodes exactly one row. Files of other writers often hold many rows per group and Parquet cannot decode
part of a group: the last ``cached_groups`` decoded groups are kept so their other rows are served without
decoding again; visit rows group by group (:func:`~ff_core.data.tensor_parquet.shuffle.two_level_order`) to use it.

The dataset pickles without open files or caches: DataLoader workers open their own, lazily. In a worker, a row's
tensors are read (or copied) into one shared-memory buffer, so the row crosses to the main process as one segment
without torch copying it again (``shared_memory``); with ``hand_off`` a worker returns its uncompressed values as
:class:`~ff_core.data.tensor_parquet.file_tensor.FileTensor` descriptions instead, read in the main process (fresh
shared memory costs more than the read it carries: :mod:`.file_tensor`).
"""

from __future__ import annotations

import difflib
import hashlib
import mmap
import os
import weakref
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ff_core.data.tensor_parquet.catalogue import Catalogue, catalogue_paths, fingerprint, save_catalogue
from ff_core.data.tensor_parquet.file_tensor import FileTensor, allocate, file_identity, pread_full
from ff_core.data.tensor_parquet.format import (
    BYTES,
    DTYPE,
    SHAPE,
    decode_buffer,
    is_empty_triplet,
    schema_problems,
    split_schema,
    tensor_dtype,
    tensor_problem,
)
from ff_core.data.tensor_parquet.index import load_index
from ff_core.data.tensor_parquet.pages import Unsupported, Value, chunk_values
from ff_core.errors import DatasetError, raise_collected


class TensorParquetDataset(torch.utils.data.Dataset):
    """Rows of every ``*.parquet`` file below ``root`` (recursive, natural order), as dicts of scalars and tensors.

    Args:
        root: the dataset root (e.g. the folder holding ``shard000/``, ``shard001/``, ...).
        columns: the scalar and tensor names to read (tensor names without ``_bytes``/``_shape``/``_dtype``);
            ``None`` reads every column. Only these columns are decoded.
        schema: an expected schema (e.g. :data:`I2V_TRACK_SCHEMA`); the files must have its columns and types.
        cache_dir: where to cache the row index (default: beside the data, else ``~/.cache/ff/tensor_parquet``).
        cached_groups: decoded multi-row row groups kept per process (a group of one row is never kept).
        open_files: files kept open and mapped per process (one file descriptor each, for ``pread``; each keeps its
            parsed footer; its pages are unmapped after every read, so this bounds footer parsing, not memory).
        copy: return writable tensors that own their memory, never views into a decoded buffer.
        direct: locate ``_bytes`` values in their pages (:mod:`.pages`); ``False`` decodes every column through
            pyarrow (the reference the direct path is tested against; slower, same results and errors).
        shared_memory: put each row's tensors in one shared-memory buffer (what a DataLoader worker returns without
            another copy); ``None``: inside a DataLoader worker only.
        hand_off: inside a DataLoader worker, return each uncompressed tensor as a
            :class:`~ff_core.data.tensor_parquet.file_tensor.FileTensor` (which file, which bytes; checked and read
            ahead) that the main process reads with one ``pread`` (:func:`~ff_core.data.dataflow.lazy.materialize`;
            ``DataflowLoader`` does it for every batch), instead of sending the bytes through shared memory.
            Compressed values are still decoded in the worker. Outside workers: no effect (:meth:`describe` returns
            the same description in any process).
        catalogue: use and keep row catalogues (:mod:`.catalogue`): a file's small columns and ``_bytes`` places,
            written beside it by ff's writer or by the first reader that decodes its small columns whole (else in
            ``cache_dir`` or the cache folder), so a row read in a new process decodes and parses nothing but its
            tensors' bytes. ``False``: per-process caches only (as with a file whose values are compressed).

    Attributes:
        tensor_names: the tensors a row holds, in column order.
        scalar_names: the scalars a row holds, in column order.
        files: every parquet file, in index order.
        index: the :class:`~ff_core.data.tensor_parquet.index.RowIndex`.
        index_cached: whether the index came from its cache (no footer read).
        chunk_reads: ``_bytes`` column chunks read in this process, by path (``"direct"``, ``"pyarrow"``).
        small_rows: the most rows whose small columns (scalars, ``_shape``, ``_dtype``) are kept decoded per process,
            over whole files (a larger file is read group by group): see :meth:`_file_small`.
    """

    small_rows: int = 1 << 14  # about 1-2 kB of Python values a row with the card's 33 columns

    def __init__(self, root: str | os.PathLike, columns: Sequence[str] | None = None,
                 schema: pa.Schema | None = None, cache_dir: str | os.PathLike | None = None,
                 cached_groups: int = 4, open_files: int = 128, copy: bool = False, direct: bool = True,
                 shared_memory: bool | None = None, hand_off: bool = False, catalogue: bool = True) -> None:
        if cached_groups < 0 or open_files < 1:
            bad = "cached_groups must be >= 0" if cached_groups < 0 else "open_files must be >= 1"
            raise ValueError(f"TensorParquetDataset: {bad}, got {cached_groups if cached_groups < 0 else open_files}")
        self.index, self.index_cached = load_index(root, cache_dir)
        self.root = self.index.root
        self.files: tuple[Path, ...] = tuple(self.root / f for f in self.index.files)
        tensors, scalars, problems = split_schema(self.index.schema)
        first = self.files[0]
        errors = [DatasetError(first, None, col, why) for col, why in problems]
        if schema is not None:
            errors += [DatasetError(first, None, col, why) for col, why in schema_problems(self.index.schema, schema)]
        if columns is not None:
            errors += [_unknown(first, c, (*tensors, *scalars)) for c in columns if c not in (*tensors, *scalars)]
            tensors = tuple(t for t in tensors if t in columns)
            scalars = tuple(s for s in scalars if s in columns)
        raise_collected(errors)
        self.tensor_names: tuple[str, ...] = tensors
        self.scalar_names: tuple[str, ...] = scalars
        # pyarrow decodes the small columns; the _bytes ones are located in their pages unless direct is off.
        self._small_columns = [*scalars, *(t + s for t in tensors for s in (SHAPE, DTYPE))]
        self._shape_columns = [t + SHAPE for t in tensors]
        self._catalogued_tensors, self._catalogued_small = catalogued_columns(self.index.schema)
        self.cache_dir, self.catalogue = cache_dir, catalogue
        self.catalogue_loads = self.catalogue_builds = 0
        self.cached_groups, self.open_files, self.copy, self.direct = cached_groups, open_files, copy, direct
        self.shared_memory, self.hand_off = shared_memory, hand_off
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._handles: OrderedDict[int, _Mapped] = OrderedDict()
        self._groups: OrderedDict[int, _Group] = OrderedDict()
        self._shape_groups: OrderedDict[int, pa.Table] = OrderedDict()
        self._small_files: OrderedDict[int, dict[str, list[Any]]] = OrderedDict()  # file -> its small columns
        self._small_counts: dict[int, int] = {}  # file -> rows in _small_files
        self.chunk_reads: Counter[str] = Counter()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_handles", "_groups", "_shape_groups", "_small_files", "_small_counts", "_pid", "chunk_reads"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def __len__(self) -> int:
        return self.index.rows

    @property
    def group_bounds(self) -> np.ndarray:
        """Row group ``g`` (over the whole dataset) holds rows ``group_bounds[g]`` to ``group_bounds[g + 1] - 1``."""
        return self.index.group_start

    @property
    def identity(self) -> dict[str, Any]:
        """``{"rows", "sha256"}`` of the files' relative paths, sizes and row-group sizes (for resume fingerprints).

        Modification times are left out: a copy of the same shards on another node must resume alike.
        """
        key = repr([(p, s[0], g) for p, s, g in zip(self.index.files, self.index.stats, self.index.group_rows)])
        key = key.encode()
        return {"rows": len(self), "sha256": hashlib.sha256(key).hexdigest()}

    def locate(self, i: int) -> tuple[Path, int, int]:
        """``(file, row group in the file, row within the group)`` of row ``i``."""
        f, g, r, _ = self.index.locate(self._check(i))
        return self.files[f], g, r

    def __getitem__(self, i: int) -> dict[str, Any]:
        worker = torch.utils.data.get_worker_info() is not None
        return self._row(i, lazy=self.hand_off and worker, read_ahead=worker)

    def describe(self, i: int) -> dict[str, Any]:
        """Row ``i`` with every uncompressed tensor as a :class:`~ff_core.data.tensor_parquet.file_tensor.FileTensor`
        (located and checked, not read), in any process: the caller reads it once, where it wants it
        (:func:`~ff_core.data.dataflow.lazy.materialize`, or ``materialize_into`` a slice of its batch tensor), so
        a row costs one copy from the page cache instead of a read into the row's memory and a second copy into the
        batch. ``DataflowLoader`` materialises every batch it yields;
        :class:`~ff_core.data.tensor_parquet.rows.TensorRows` reads rows this way when the dataset was opened with
        ``hand_off``. Compressed values are decoded as :meth:`__getitem__` decodes them."""
        return self._row(i, lazy=True, read_ahead=torch.utils.data.get_worker_info() is not None)

    def _row(self, i: int, lazy: bool, read_ahead: bool) -> dict[str, Any]:
        i = self._check(i)
        f, g, r, gid = self.index.locate(i)
        group = self._row_group(gid, f, g)
        row: dict[str, Any] = {s: group.small[s][r] for s in self.scalar_names}
        pending: dict[str, tuple[Value, list[int], torch.dtype]] = {}
        for t in self.tensor_names:
            checked = self._checked(group, t, r, i)
            row[t] = None if checked is None else self._tensor(group, checked, pending, t)
        if pending and lazy:
            row.update(self._hand_off(group.mapped, pending, i, read_ahead))
        if pending:
            row.update(self._arena(group.mapped, pending, self._shared()))
        return row

    def shapes(self, i: int) -> dict[str, tuple[int, ...]]:
        """The shape of each tensor of row ``i``, from its ``_shape`` column only (no ``_bytes`` is read)."""
        i = self._check(i)
        f, g, r, gid = self.index.locate(i)
        table = self._shape_table(gid, f, g)
        out = {}
        for t in self.tensor_names:
            shape = _cell(table.column(t + SHAPE), r).as_py()
            if shape is None or any(d is None or d < 0 for d in shape):
                raise self._row_error(i, t + SHAPE, f"shape {shape!r}: expected a list of dimensions >= 0")
            out[t] = tuple(shape)
        return out

    def all_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        """:meth:`shapes` of every row, in index order, reading each file's ``_shape`` columns once (for size
        functions over a whole dataset: packing batchers, length buckets)."""
        out: list[dict[str, tuple[int, ...]]] = []
        for f in range(len(self.files)):
            table = self._file(f).file.read(columns=self._shape_columns, use_threads=False)
            columns = {t: table.column(t + SHAPE).to_pylist() for t in self.tensor_names}
            for r in range(table.num_rows):
                row = {t: columns[t][r] for t in self.tensor_names}
                bad = next((t for t, s in row.items() if s is None or any(d is None or d < 0 for d in s)), None)
                if bad is not None:
                    raise self._row_error(int(self.index.file_start[f]) + r, bad + SHAPE,
                                          f"shape {row[bad]!r}: expected a list of dimensions >= 0")
                out.append({t: tuple(s) for t, s in row.items()})
        return out

    def _check(self, i: int) -> int:
        n = len(self)
        i = int(i)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows of {self.root}")
        return i + n if i < 0 else i

    def _checked(self, group: _Group, name: str, r: int, i: int) -> tuple[Value, list[int], torch.dtype] | None:
        """Row ``r``'s value of tensor ``name``, its shape and dtype, checked; ``None`` for the absent placeholder."""
        value = group.values[name][r]
        length = None if value is None else value[2]
        shape, dtype = group.small[name + SHAPE][r], group.small[name + DTYPE][r]
        if is_empty_triplet(length, shape, dtype):
            return None
        problem = tensor_problem(length, shape, dtype)
        if problem is not None:
            raise self._row_error(i, name + problem[0], problem[1])
        return value, shape, tensor_dtype(dtype)

    def _tensor(self, group: _Group, checked: tuple[Value, list[int], torch.dtype],
                pending: dict[str, tuple[Value, list[int], torch.dtype]], name: str) -> torch.Tensor | None:
        """The tensor, or ``None`` with the value left in ``pending`` for :meth:`_arena`: an uncompressed value (read
        from the file), or, in a DataLoader worker, any value (so the row crosses to the main process in one piece)."""
        (buf, start, length), shape, dtype = checked
        if length and (buf is group.mapped.buffer or self._shared()):
            pending[name] = checked
            return None
        tensor = decode_buffer(buf, start, shape, str(dtype).removeprefix("torch."))
        return tensor.clone() if self.copy else tensor

    def _shared(self) -> bool:
        if self.shared_memory is None:  # as default_collate decides where to stack a batch
            return torch.utils.data.get_worker_info() is not None
        return self.shared_memory

    @staticmethod
    def _arena(mapped: _Mapped, pending: dict[str, tuple[Value, list[int], torch.dtype]],
               shared: bool) -> dict[str, torch.Tensor]:
        """The pending tensors of a row, in one buffer the row's tensors share (slots 64-byte aligned, so a view of
        any dtype is aligned): file values ``pread`` into it (one kernel copy), the others copied in.

        One buffer per row instead of one per tensor: in a DataLoader worker it is shared memory, so torch sends the
        row to the main process as one segment (one file descriptor passed, one mapping) without copying it again.
        """
        slots, total = {}, 0
        for name, ((_, _, length), _, _) in pending.items():
            slots[name] = total
            total += -(-length // 64) * 64
        arena = allocate(total, shared)
        out = {}
        for name, ((buf, start, length), shape, dtype) in pending.items():
            slot = arena[slots[name]: slots[name] + length]
            if buf is mapped.buffer:
                mapped.pread_into(slot, start)
            else:
                slot.copy_(decode_buffer(buf, start, [length], "uint8"))
            out[name] = slot.view(dtype).view(tuple(shape))
        return out

    def _hand_off(self, mapped: _Mapped, pending: dict[str, tuple[Value, list[int], torch.dtype]],
                  i: int, read_ahead: bool) -> dict[str, FileTensor]:
        """The pending values that lie uncompressed in the file, as :class:`FileTensor` descriptions the main process
        reads (removed from ``pending``); with ``read_ahead`` (in a worker) the kernel is asked to read them ahead
        meanwhile (a no-op when cached)."""
        out = {}
        for name in [n for n, (value, _, _) in pending.items() if value[0] is mapped.buffer]:
            (_, start, length), shape, dtype = pending.pop(name)
            if read_ahead and hasattr(os, "posix_fadvise"):
                try:
                    os.posix_fadvise(mapped.fd, start, length, os.POSIX_FADV_WILLNEED)
                except OSError:  # advice only: a file system may refuse it (some FUSE ones); the read still works
                    pass
            out[name] = FileTensor(str(mapped.path), mapped.identity, start, shape, dtype,
                                   f"{name}{BYTES}: {self._row_place(i)}")
        return out

    def _row_place(self, i: int) -> str:
        """Where dataset row ``i`` is in its file, for messages."""
        f, g, _, _ = self.index.locate(i)
        return f"row {i - int(self.index.file_start[f])} (row group {g}, dataset row {i})"

    def _row_error(self, i: int, column: str, reason: str) -> DatasetError:
        f = self.index.locate(i)[0]
        return DatasetError(self.files[f], None, column, f"{self._row_place(i)}: {reason}")

    def _forked(self) -> None:
        if os.getpid() != self._pid:  # forked after use: never share another process's mappings
            self._reset()

    def _row_group(self, gid: int, f: int, g: int) -> _Group:
        """Row group ``g`` of file ``f`` (``gid`` over the dataset) for a row read; cached when it has several rows."""
        self._forked()
        if gid in self._groups:
            self._groups.move_to_end(gid)
            return self._groups[gid]
        mapped = self._file(f)
        rows = self.index.group_rows[f][g]
        values = self._direct_values(mapped, f, g, rows) if self.direct else {}
        rest = [t + BYTES for t in self.tensor_names if t not in values]
        self.chunk_reads.update({"direct": len(values), "pyarrow": len(rest)})
        small = None if rest else self._file_small(mapped, f, gid, rows)
        if small is None:
            # A chunk the page reader refused is the likeliest culprit when pyarrow fails: name it.
            table = self._read(f, g, self._small_columns + rest, rest[0] if rest and self.direct else None)
            for t in self.tensor_names:
                if t not in values:
                    values[t] = _arrow_values(table.column(t + BYTES))
            small = {c: table.column(c).to_pylist() for c in self._small_columns}
        group = _Group(mapped, small, values)
        if rows > 1 and self.cached_groups > 0:
            self._groups[gid] = group
            while len(self._groups) > self.cached_groups:
                self._groups.popitem(last=False)
        return group

    def _catalogue_paths(self, f: int, writing: bool = False) -> list[Path]:
        return catalogue_paths(self.files[f], self.cache_dir, writing)

    def _load_places(self, mapped: _Mapped, f: int) -> None:
        """Fill :attr:`_Mapped.locations` for every row group of file ``f`` from its stored catalogue, if it has a
        valid one (looked for once per handle); remembered in :attr:`_Mapped.catalogue_path` for the small columns."""
        rows = self.index.group_rows[f]
        file_rows = sum(rows)
        if file_rows > EAGER_ROWS and mapped.small_reads < 1:
            return  # a large file: its catalogue is loaded on its second read (a file read once costs no more)
        mapped.catalogue_looked = True
        if file_rows > self.small_rows:
            return
        for path in self._catalogue_paths(f):
            found = Catalogue.from_ipc(path, mapped.fingerprint, file_rows, [], self.tensor_names)
            if found is not None:
                break
        else:
            return
        mapped.catalogue_path = path
        self.catalogue_loads += 1
        start = 0
        for g, n in enumerate(rows):
            mapped.locations[g] = {t: [None if p is None else (mapped.buffer, *p) for p in places[start:start + n]]
                                   for t, places in found.places.items()}
            start += n

    def _store_catalogue(self, mapped: _Mapped, f: int, table: pa.Table) -> None:
        """Store file ``f``'s catalogue (:func:`_store_catalogue`); the requested tensors' places are kept in
        :attr:`_Mapped.locations` too."""
        try:
            mapped.catalogue_path = _store_catalogue(mapped, self._catalogued_tensors, table,
                                                     self._catalogue_paths(f, writing=True), self.tensor_names)
        except (OSError, ValueError, pa.ArrowException):
            return  # only slower: the row read goes on without one
        self.catalogue_builds += mapped.catalogue_path is not None

    def _direct_values(self, mapped: _Mapped, f: int, g: int, rows: int) -> dict[str, list[Value]]:
        """Where each row's ``_bytes`` values of row group ``g`` of file ``f`` lie, for the chunks the page reader
        reads.

        Uncompressed locations are kept with the file's handle (:attr:`_Mapped.locations`): a row group read again
        (the next epoch) parses no page header; with a stored catalogue, not even the first time. Values in a
        decompressed page are not kept (that would keep the page).
        """
        if self.catalogue and not mapped.catalogue_looked:
            self._load_places(mapped, f)
        cached = mapped.locations.get(g)
        if cached is not None:
            return dict(cached)
        values: dict[str, list[Value]] = {}
        for t in self.tensor_names:
            try:
                values[t] = mapped.values(g, t + BYTES, rows)
            except Unsupported:
                continue  # decoded by pyarrow, which reads it or names what is wrong with it
        if len(values) == len(self.tensor_names) and all(
                v is None or v[0] is mapped.buffer for found in values.values() for v in found):
            mapped.locations[g] = values
        return dict(values)

    def _file_small(self, mapped: _Mapped, f: int, gid: int, rows: int) -> dict[str, list[Any]] | None:
        """The small columns of row group ``gid`` cut from its file's, decoded for the whole file at once (one pyarrow
        read per file instead of one per row group: ~25 tiny columns cost about as much to set up as to decode);
        ``None``: read the group alone.

        A file's small columns are decoded on its second row-group read while its handle is open (a file read once
        costs no more than before), only when the file has at most :attr:`small_rows` rows, and kept in an LRU of at
        most :attr:`small_rows` rows over all files. A file pyarrow cannot decode whole is read group by group, so
        the error names the damaged group and the others stay readable.
        """
        cached = self._small_files.get(f)
        if cached is None:
            file_rows = sum(self.index.group_rows[f])
            eager = file_rows <= EAGER_ROWS or mapped.small_reads >= 1
            listed = None if mapped.catalogue_path is None or not eager else Catalogue.from_ipc(
                mapped.catalogue_path, mapped.fingerprint, file_rows, self._small_columns, [])
            table = None
            if listed is not None:  # the stored catalogue: nothing to decode
                cached = listed.small
            else:
                mapped.small_reads += 1
                if mapped.small_reads < 2 or mapped.small_failed or file_rows > self.small_rows:
                    return None
                store = self.catalogue and mapped.catalogue_path is None and _uncompressed(
                    mapped, self._catalogued_tensors)
                columns = [*dict.fromkeys([*self._catalogued_small, *self._small_columns])] if store else \
                    self._small_columns
                try:
                    table = mapped.read_all(columns)
                except (OSError, pa.ArrowException):
                    mapped.small_failed = True
                    return None
                cached = {c: table.column(c).to_pylist() for c in self._small_columns}
            self._small_files[f], self._small_counts[f] = cached, file_rows
            if table is not None and store:
                self._store_catalogue(mapped, f, table.select(self._catalogued_small))
            while sum(self._small_counts.values()) > self.small_rows:
                oldest = next(iter(self._small_files))
                del self._small_files[oldest], self._small_counts[oldest]
        else:
            self._small_files.move_to_end(f)
        start = int(self.index.group_start[gid] - self.index.file_start[f])
        return {c: column[start: start + rows] for c, column in cached.items()}

    def _shape_table(self, gid: int, f: int, g: int) -> pa.Table:
        """The ``_shape`` columns of row group ``g`` of file ``f``; the last 64 multi-row groups are kept."""
        self._forked()
        if gid in self._shape_groups:
            self._shape_groups.move_to_end(gid)
            return self._shape_groups[gid]
        table = self._read(f, g, self._shape_columns)
        if table.num_rows > 1:
            self._shape_groups[gid] = table
            while len(self._shape_groups) > 64:
                self._shape_groups.popitem(last=False)
        return table

    def _read(self, f: int, g: int, columns: list[str], suspect: str | None = None) -> pa.Table:
        try:
            return self._file(f).read_row_group(g, columns)
        except (OSError, pa.ArrowException) as exc:
            raise DatasetError(self.files[f], None, suspect, f"row group {g}: cannot be read: {exc}") from None

    def _file(self, f: int) -> _Mapped:
        handles = self._handles
        if f in handles:
            handles.move_to_end(f)
            return handles[f]
        try:
            handles[f] = _Mapped(self.files[f], catalogue=self.catalogue and self.direct)
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise DatasetError(self.files[f], None, None, f"cannot open: {exc}") from None
        while len(handles) > max(1, self.open_files):
            handles.popitem(last=False)  # unmapped once the last Arrow buffer viewing it is gone
        return handles[f]


def catalogued_columns(schema: pa.Schema) -> tuple[tuple[str, ...], list[str]]:
    """The tensors and small columns a file of ``schema`` keeps in its catalogue: every tensor and small column of
    it, whichever a dataset reads (another may read others), but no binary scalar (a thumbnail would be copied
    whole; a dataset reading one decodes the file's small columns as without a catalogue)."""
    tensors, scalars, _ = split_schema(schema)
    binary = {f.name for f in schema if pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type)
              or pa.types.is_fixed_size_binary(f.type)}
    return tensors, [*(s for s in scalars if s not in binary), *(t + s for t in tensors for s in (SHAPE, DTYPE))]


def write_catalogue(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """Write the row catalogue (:mod:`.catalogue`) of one parquet file now, as a reader would on the file's second
    read (ff's writer does it for every file it publishes, so even a dataset's first epoch finds them); returns
    where, or ``None`` (a compressed value, a chunk the page reader leaves to pyarrow, a file that is not
    tensor-parquet, no writable place: readers then decode it as without a catalogue).

    Raises:
        OSError, pyarrow.ArrowException: the file cannot be opened as parquet.
    """
    mapped = _Mapped(Path(path), catalogue=True)
    if split_schema(mapped.file.schema_arrow)[2]:
        return None
    tensors, small = catalogued_columns(mapped.file.schema_arrow)
    return _store_catalogue(mapped, tensors, mapped.read_all(small), catalogue_paths(Path(path), cache_dir, True))


def _store_catalogue(mapped: _Mapped, tensors: Sequence[str], table: pa.Table, paths: Sequence[Path],
                     keep: Sequence[str] = ()) -> Path | None:
    """Store the catalogue of ``mapped``'s file: ``table`` (its catalogued small columns, decoded whole) and where
    every ``tensors`` value of every row group lies (page headers parsed, with their checks; the places of ``keep``
    also put in :attr:`_Mapped.locations`). Nothing is stored for a file with a compressed value or a chunk the page
    reader leaves to pyarrow, nor when no place in ``paths`` is writable (no catalogue is only slower)."""
    groups = [mapped.meta.row_group(g).num_rows for g in range(mapped.meta.num_row_groups)]
    if not groups or not _uncompressed(mapped, tensors):
        return None  # compressed values are decoded at each read: nothing to locate (known from the footer)
    places: dict[str, list[tuple[int, int] | None]] = {t: [] for t in tensors}
    for g, rows in enumerate(groups):
        found = {}
        for t in tensors:
            try:
                found[t] = mapped.values(g, t + BYTES, rows)
            except Unsupported:
                return None
            if any(v is not None and v[0] is not mapped.buffer for v in found[t]):
                return None  # a compressed page
            places[t] += [None if v is None else (v[1], v[2]) for v in found[t]]
        if keep:
            mapped.locations.setdefault(g, {t: found[t] for t in keep})
    return save_catalogue(paths, Catalogue({}, places).to_ipc(table, mapped.fingerprint))


def _uncompressed(mapped: _Mapped, tensors: Sequence[str]) -> bool:
    """Whether the first row group's ``_bytes`` chunks of ``tensors`` are uncompressed (a writer uses one codec)."""
    first = mapped.meta.row_group(0) if mapped.meta.num_row_groups else None
    return first is not None and all(first.column(mapped.columns[t + BYTES][0]).compression == "UNCOMPRESSED"
                                     for t in tensors if t + BYTES in mapped.columns)


@dataclass
class _Group:
    """One row group as a row read needs it: its small columns as Python lists and where each row's ``_bytes`` lie."""

    mapped: _Mapped
    small: dict[str, list[Any]]
    values: dict[str, list[Value]]


class _Mapped:
    """One parquet file memory-mapped by ff (not by pyarrow), so the pages a read touched can be unmapped again.

    Decoding and decompression copy the values they return, so afterwards the row group's file pages are only page
    cache: ``MADV_DONTNEED`` drops them from this process's resident set (the kernel keeps them cached; a file-backed
    mapping re-reads them on the next touch, never zeros). Without that, every page read stays mapped while the file
    is open and the resident set grows with the dataset. Uncompressed values are not read through the mapping at all
    but with ``pread`` into the tensor's own memory (:meth:`pread_into`): one kernel copy from the page cache,
    aligned for any dtype, and no page of the mapping touched (a value's position in its page is aligned for its
    dtype only by chance, about half the time: viewing it in place would need a copy anyway).
    """

    def __init__(self, path: Path, catalogue: bool = False) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)  # closed with this handle (the mapping keeps its own descriptor)
        self.identity = file_identity(self.fd)  # checked where a FileTensor of this file is read
        self.map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
        self.buffer = pa.py_buffer(self.map)
        self.file = pq.ParquetFile(pa.BufferReader(self.buffer))
        self.meta = self.file.metadata  # one wrapper, not one per access
        # What the file's catalogue is keyed by (:func:`~.catalogue.fingerprint`), taken as it was opened: a file
        # rewritten in place later has another change time, so nothing built from this handle is keyed to it.
        self.fingerprint = fingerprint(self.fd) if catalogue else None
        schema = self.meta.schema
        # Flat columns only (a nested one, a list, has a dotted path and is never a _bytes column): column index
        # and maximum definition level by name.
        self.columns = {schema.column(c).path: (c, schema.column(c).max_definition_level)
                        for c in range(len(schema)) if not schema.column(c).max_repetition_level}
        # Per-file caches of the reader, gone with the handle (bounded by ``open_files``); the file is mapped as it
        # was opened (an atomic rewrite makes a new file, which a new dataset indexes and opens anew).
        self.locations: dict[int, dict[str, list[Value]]] = {}  # row group -> uncompressed _bytes values' places
        self.small_reads = 0  # row groups whose small columns were read while this handle was open
        self.small_failed = False  # the small columns of the whole file could not be decoded at once
        self.catalogue_path: Path | None = None  # its valid stored row catalogue (:mod:`.catalogue`), once known
        self.catalogue_looked = False  # a stored catalogue was looked for

    def read_all(self, columns: list[str]) -> pa.Table:
        """``columns`` of every row group of the file, read with ``pread`` rather than through the mapping: as fast,
        and faulting in every group's small chunks (with their neighbours) would raise the peak resident set by
        about 0.5 MB a group until unmapped. Read through this handle's descriptor, never the path: the file mapped
        and the file read must be the same one even if another was renamed over the path since (Linux
        ``/proc/self/fd``; elsewhere an ``OSError``, and the caller reads group by group through the mapping).

        Raises:
            OSError: no ``/proc/self/fd``.
        """
        same_file = f"/proc/self/fd/{self.fd}"
        if not os.path.exists(same_file):
            raise OSError(f"{same_file}: not available")
        file = pq.ParquetFile(same_file, metadata=self.meta, memory_map=False)
        return file.read_row_groups(range(self.meta.num_row_groups), columns=columns, use_threads=False)

    def read_row_group(self, g: int, columns: list[str]) -> pa.Table:
        table = self.file.read_row_group(g, columns=columns, use_threads=False)
        self.release(*_byte_range(self.meta.row_group(g)))
        return table

    def values(self, g: int, column: str, rows: int) -> list[Value]:
        """Where each row's value of ``column`` lies in row group ``g`` (:func:`~.pages.chunk_values`)."""
        if column not in self.columns:
            raise Unsupported(f"{column}: not a flat column")
        c, max_def = self.columns[column]
        chunk = self.meta.row_group(g).column(c)
        found = chunk_values(self.buffer, chunk, max_def, rows)
        self.release(*_chunk_range(chunk))  # the pages its headers and its codec touched
        return found

    def pread_into(self, out: torch.Tensor, start: int) -> None:
        """Fill the uint8 tensor ``out`` with the file's bytes from ``start``."""
        got = pread_full(self.fd, memoryview(out.numpy()), start)
        if got != out.numel():  # the file shrank since its footer was read
            raise DatasetError(self.path, None, None, f"bytes {start}..{start + out.numel()}: only {got} could be read")

    def release(self, start: int, end: int) -> None:
        """Drop the file pages of bytes ``start`` to ``end`` from the resident set (they stay in the page cache).

        A fault on one page maps the page-cache pages around it too (Linux ``fault_around_bytes``, 64 KiB by
        default, aligned): the range is widened by that much, else reading a header (one page) would leave its
        neighbours mapped and the resident set would grow with the files read.
        """
        start = max(0, start - _FAULT_AROUND)
        start -= start % mmap.PAGESIZE
        end = min(end + _FAULT_AROUND, len(self.map))
        if hasattr(self.map, "madvise") and end > start:
            self.map.madvise(mmap.MADV_DONTNEED, start, end - start)


_FAULT_AROUND = 1 << 16  # Linux's default fault_around_bytes (see _Mapped.release)
EAGER_ROWS = 1024  # a file of at most this many rows takes its stored catalogue at its first read; larger at its second


def _byte_range(group: pq.RowGroupMetaData) -> tuple[int, int]:
    """The file bytes holding a row group's column chunks."""
    # Writers lay a group's column chunks out in column order (Arrow's does): its first and last chunks bound it.
    # Were they out of order, some touched pages would stay mapped until the file is closed; nothing reads wrong.
    if not group.num_columns:
        return 0, 0
    return _chunk_range(group.column(0))[0], _chunk_range(group.column(group.num_columns - 1))[1]


def _chunk_range(chunk: pq.ColumnChunkMetaData) -> tuple[int, int]:
    """The file bytes of one column chunk (its dictionary page, when it has one, comes first)."""
    first = chunk.data_page_offset
    if chunk.has_dictionary_page and 0 < chunk.dictionary_page_offset < first:
        first = chunk.dictionary_page_offset
    return first, first + chunk.total_compressed_size


def _arrow_values(column: pa.ChunkedArray) -> list[Value]:
    """Where each row's value of a decoded binary column lies in pyarrow's buffers (``None`` for a null)."""
    out: list[Value] = []
    for arr in column.chunks:
        width = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
        offsets = np.frombuffer(arr.buffers()[1], dtype=width)[arr.offset: arr.offset + len(arr) + 1].tolist()
        data = arr.buffers()[2]
        valid = arr.is_valid().to_pylist() if arr.null_count else [True] * len(arr)
        out += [(data, a, b - a) if ok else None for ok, a, b in zip(valid, offsets, offsets[1:])]
    return out


def _cell_array(column: pa.ChunkedArray, r: int) -> tuple[pa.Array, int]:
    """The chunk holding row ``r`` of ``column`` and the row's index in it."""
    for chunk in column.chunks:
        if r < len(chunk):
            return chunk, r
        r -= len(chunk)
    raise IndexError(r)


def _cell(column: pa.ChunkedArray, r: int) -> pa.Scalar:
    chunk, j = _cell_array(column, r)
    return chunk[j]


def _unknown(path: Path, name: str, known: Sequence[str]) -> DatasetError:
    near = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else f"; columns: {', '.join(known)}"
    return DatasetError(path, None, "columns", f"unknown column {name!r}{hint}")
