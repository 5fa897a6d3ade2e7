"""``TensorParquetDataset``: map-style random access to the rows of tensor-parquet shards.

A row read decodes only the requested columns of the row group that holds it (``ParquetFile.read_row_group`` over a
memory-mapped file) and views each tensor inside the decoded Arrow buffer with ``torch.frombuffer``: Parquet
decoding is the only copy. The file pages a read touched are unmapped after decoding (:class:`_Mapped`), so the
resident set stays flat however much of the dataset is read. Returned tensors are views of the decoded buffer:
clone before editing one in place, or pass ``copy=True``.

Files written by ff (:class:`~ff_core.data.tensor_parquet.writer.TensorParquetWriter`) hold one row per row group,
so a read decodes exactly one row. Files of other writers often hold many rows per group and Parquet cannot decode
part of a group: the last ``cached_groups`` decoded groups are kept so their other rows are served without
decoding again; visit rows group by group (:func:`~ff_core.data.tensor_parquet.shuffle.two_level_order`) to use it.

The dataset pickles without open files or caches: DataLoader workers open their own, lazily.
"""

from __future__ import annotations

import difflib
import hashlib
import mmap
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ff_core.data.tensor_parquet.format import (
    BYTES,
    DTYPE,
    SHAPE,
    decode_buffer,
    is_empty_triplet,
    schema_problems,
    split_schema,
    tensor_problem,
)
from ff_core.data.tensor_parquet.index import load_index
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
        open_files: files kept mapped per process (each keeps its parsed footer; its pages are unmapped after
            every read, so this bounds footer parsing, not memory).
        copy: return writable tensors that own their memory instead of views into the decoded buffer.

    Attributes:
        tensor_names: the tensors a row holds, in column order.
        scalar_names: the scalars a row holds, in column order.
        files: every parquet file, in index order.
        index: the :class:`~ff_core.data.tensor_parquet.index.RowIndex`.
        index_cached: whether the index came from its cache (no footer read).
    """

    def __init__(self, root: str | os.PathLike, columns: Sequence[str] | None = None,
                 schema: pa.Schema | None = None, cache_dir: str | os.PathLike | None = None,
                 cached_groups: int = 4, open_files: int = 128, copy: bool = False) -> None:
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
        self._columns = [*scalars, *(t + s for t in tensors for s in (BYTES, SHAPE, DTYPE))]
        self._shape_columns = [t + SHAPE for t in tensors]
        self.cached_groups, self.open_files, self.copy = cached_groups, open_files, copy
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._handles: OrderedDict[int, _Mapped] = OrderedDict()
        self._groups: OrderedDict[int, pa.Table] = OrderedDict()
        self._shape_groups: OrderedDict[int, pa.Table] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_handles", "_groups", "_shape_groups", "_pid"):
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
        i = self._check(i)
        f, g, r, gid = self.index.locate(i)
        table = self._group(gid, f, g, self._columns, self._groups, self.cached_groups)
        row: dict[str, Any] = {s: _cell(table.column(s), r).as_py() for s in self.scalar_names}
        for t in self.tensor_names:
            row[t] = self._tensor(table, t, r, i)
        return row

    def shapes(self, i: int) -> dict[str, tuple[int, ...]]:
        """The shape of each tensor of row ``i``, from its ``_shape`` column only (no ``_bytes`` is read)."""
        i = self._check(i)
        f, g, r, gid = self.index.locate(i)
        table = self._group(gid, f, g, self._shape_columns, self._shape_groups, 64)
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

    def _tensor(self, table: pa.Table, name: str, r: int, i: int) -> torch.Tensor | None:
        arr, j = _cell_array(table.column(name + BYTES), r)
        valid = arr.null_count == 0 or arr[j].is_valid
        shape = _cell(table.column(name + SHAPE), r).as_py()
        dtype = _cell(table.column(name + DTYPE), r).as_py()
        start = end = 0
        if valid:
            width = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
            offsets = np.frombuffer(arr.buffers()[1], dtype=width)
            start, end = int(offsets[arr.offset + j]), int(offsets[arr.offset + j + 1])
        if valid and is_empty_triplet(end - start, shape, dtype):  # an absent tensor's placeholder
            return None
        problem = tensor_problem(end - start if valid else None, shape, dtype)
        if problem is not None:
            raise self._row_error(i, name + problem[0], problem[1])
        tensor = decode_buffer(arr.buffers()[2], start, shape, dtype)
        return tensor.clone() if self.copy else tensor

    def _row_error(self, i: int, column: str, reason: str) -> DatasetError:
        f, g, r, _ = self.index.locate(i)
        in_file = i - int(self.index.file_start[f])
        return DatasetError(self.files[f], None, column, f"row {in_file} (row group {g}, dataset row {i}): {reason}")

    def _group(self, gid: int, f: int, g: int, columns: list[str], cache: OrderedDict, keep: int) -> pa.Table:
        """Row group ``g`` of file ``f`` (``gid`` over the dataset), decoded for ``columns``, cached when useful."""
        if os.getpid() != self._pid:  # forked after use: never share another process's mappings
            self._reset()
            cache = self._shape_groups if columns is self._shape_columns else self._groups
        if gid in cache:
            cache.move_to_end(gid)
            return cache[gid]
        try:
            table = self._file(f).read_row_group(g, columns)
        except (OSError, pa.ArrowException) as exc:
            raise DatasetError(self.files[f], None, None, f"row group {g}: cannot be read: {exc}") from None
        if table.num_rows > 1 and keep > 0:
            cache[gid] = table
            while len(cache) > keep:
                cache.popitem(last=False)
        return table

    def _file(self, f: int) -> _Mapped:
        handles = self._handles
        if f in handles:
            handles.move_to_end(f)
            return handles[f]
        try:
            handles[f] = _Mapped(self.files[f])
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise DatasetError(self.files[f], None, None, f"cannot open: {exc}") from None
        while len(handles) > max(1, self.open_files):
            handles.popitem(last=False)  # unmapped once the last Arrow buffer viewing it is gone
        return handles[f]


class _Mapped:
    """One parquet file memory-mapped by ff (not by pyarrow), so the pages a read touched can be unmapped again.

    Parquet decoding copies every value it returns, so after ``read_row_group`` the row group's file pages are
    only page cache: ``MADV_DONTNEED`` drops them from this process's resident set (the kernel keeps them cached;
    a file-backed mapping re-reads them on the next touch, never zeros). Without that, every page read stays
    mapped while the file is open and the resident set grows with the dataset.
    """

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as fh:
            self.map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self.file = pq.ParquetFile(pa.BufferReader(pa.py_buffer(self.map)))

    def read_row_group(self, g: int, columns: list[str]) -> pa.Table:
        table = self.file.read_row_group(g, columns=columns, use_threads=False)
        start, end = _byte_range(self.file.metadata.row_group(g))
        start -= start % mmap.PAGESIZE
        if hasattr(self.map, "madvise") and end > start:
            self.map.madvise(mmap.MADV_DONTNEED, start, min(end, len(self.map)) - start)
        return table


def _byte_range(group: pq.RowGroupMetaData) -> tuple[int, int]:
    """The file bytes holding a row group's column chunks."""
    start, end = None, 0
    for c in range(group.num_columns):
        chunk = group.column(c)
        first = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
        start = first if start is None else min(start, first)
        end = max(end, first + chunk.total_compressed_size)
    return start or 0, end


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
