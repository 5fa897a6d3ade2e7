"""Tensor-parquet rows checked at ``ff fit`` start, from their small columns: every row, before any weight loads.

A row whose ``_dtype`` names no dtype, whose ``_shape`` is not a list of dimensions, whose byte count is not
prod(shape) x itemsize, or whose shape does not fit the adapter's latent geometry (a latent stored (H, W, C) with
the byte count of (C, H, W)) used to fail only when training drew it, hours in. :func:`check_shard_rows` reads each
file's ``_shape`` and ``_dtype`` columns once (a few bytes a row) and each value's byte length where it is located
without reading it (the file's catalogue, or its page headers; compressed values are left to ``ff data validate
--check-media``), and raises one error per bad row naming file, row and column (docs/datasets.md, "Training from
tensor-parquet shards").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ff_core.data.tensor_parquet.format import DTYPE, SHAPE, is_empty_triplet, tensor_dtype, tensor_problem
from ff_core.errors import DatasetError, raise_collected

if TYPE_CHECKING:
    from ff_core.data.tensor_parquet import TensorParquetDataset
    from ff_core.data.tensor_parquet.rows import TensorRows

MAX_ROW_PROBLEMS = 20  # per dataset: a systematically wrong column is one cause, not a million lines


@dataclass(frozen=True)
class StoredShape:
    """What an adapter expects of one tensor column's per-row shape (:meth:`~ff_core.adapter.Adapter.
    resolve_tensor_shapes`), from the checkpoint's config files.

    Attributes:
        ndim: the number of axes (``None``: any).
        sizes: axis -> its exact size (negative axes count from the end): SD3's latent channels ``{0: 16}``.
        multiples: axis -> a number its size must be a multiple of: the denoiser's patch size over H and W.
        meaning: the axes' names for messages (``"(C, H, W)"``).
    """

    ndim: int | None = None
    sizes: Mapping[int, int] = field(default_factory=dict)
    multiples: Mapping[int, int] = field(default_factory=dict)
    meaning: str = ""

    def problem(self, shape: Sequence[int]) -> str | None:
        """Why ``shape`` does not fit, or ``None``."""
        expected = f" {self.meaning}" if self.meaning else ""
        if self.ndim is not None and len(shape) != self.ndim:
            return f"shape {list(shape)} has {len(shape)} axes; the adapter expects {self.ndim}{expected}"
        for axis, size in self.sizes.items():
            if not -len(shape) <= axis < len(shape) or shape[axis] != size:
                return f"shape {list(shape)}: axis {axis} must be {size}{expected}"
        for axis, factor in self.multiples.items():
            if not -len(shape) <= axis < len(shape) or shape[axis] % factor:
                return f"shape {list(shape)}: axis {axis} must be a multiple of {factor}{expected}"
        return None


def row_problems(dataset: TensorParquetDataset, shapes: Mapping[str, StoredShape] | None = None,
                 rows: int | None = None, column_names: Mapping[str, str] | None = None) -> list[DatasetError]:
    """Every bad row of ``dataset``'s tensors (its opened columns) among its first ``rows``, from the small columns
    and the located byte lengths; at most :data:`MAX_ROW_PROBLEMS` errors, then one line counting the rest.

    Args:
        dataset: the opened shards (its ``tensor_names`` are checked).
        shapes: column -> the adapter's expected :class:`StoredShape` (a ``chosen_``/``rejected_`` column is looked
            up by its stored name, then through ``column_names``).
        rows: the rows training serves (``None``: all).
        column_names: stored column -> the name ``shapes`` uses (preference rows' ``chosen_latent`` -> ``latent``).
    """
    shapes, names = dict(shapes or {}), dict(column_names or {})
    rules = {t: shapes.get(t) or shapes.get(names.get(t, "")) for t in dataset.tensor_names}
    limit = len(dataset) if rows is None else rows
    errors: list[DatasetError] = []
    more = 0
    columns = [t + s for t in dataset.tensor_names for s in (SHAPE, DTYPE)]
    for f, path in enumerate(dataset.files):
        start = int(dataset.index.file_start[f])
        if start >= limit:
            break
        mapped = dataset._file(f)
        n = min(sum(dataset.index.group_rows[f]), limit - start)
        table = mapped.file.read(columns=columns, use_threads=False).slice(0, n)  # C++: no Python value per row
        stored = _catalogue(dataset, mapped, f)  # ff's writer stores one beside each file: the byte places
        lengths = ({t: [None if p is None else p[1] for p in places] for t, places in stored.places.items()}
                   if stored is not None else _lengths(dataset, mapped, f))
        lengths = {t: values[:n] for t, values in lengths.items()}
        if all(_all_fit(table.column(t + SHAPE), table.column(t + DTYPE), lengths.get(t), rules[t])
               for t in dataset.tensor_names):
            continue  # the usual case, decided in numpy; a file with a bad row is gone through row by row
        for problem in _file_problems(table, lengths, rules, path, start):
            if len(errors) < MAX_ROW_PROBLEMS:
                errors.append(problem)
            else:
                more += 1
    if more:
        errors.append(DatasetError(dataset.root, None, None, f"{more} more bad rows"))
    return errors


def _file_problems(table: pa.Table, lengths: Mapping[str, list[int | None]], rules: Mapping[str, StoredShape | None],
                   path, start: int) -> list[DatasetError]:
    """One error per bad (row, tensor) of one file, in row order (:func:`tensor_problem`, then the rule)."""
    out = []
    small = {c: table.column(c).to_pylist() for c in table.column_names}
    for r in range(table.num_rows):
        for t, rule in rules.items():
            shape, dtype = small[t + SHAPE][r], small[t + DTYPE][r]
            length = lengths[t][r] if t in lengths else _assumed(shape, dtype)
            if is_empty_triplet(length, shape, dtype):
                continue  # the absent placeholder: an optional column's, or refused where it is read
            problem = tensor_problem(length, shape, dtype)
            if problem is None and rule is not None:
                why = rule.problem(shape)
                problem = None if why is None else (SHAPE, why)
            if problem is not None:
                out.append(DatasetError(path, None, t + problem[0], f"row {r} (dataset row {start + r}): {problem[1]}"))
    return out


def _all_fit(shape: pa.ChunkedArray, dtype: pa.ChunkedArray, lengths: list[int | None] | None,
             rule: StoredShape | None) -> bool:
    """Whether every row of one tensor column is fine, vectorised: no null, known dtypes, dimensions >= 0, byte
    counts prod(shape) x itemsize (when known), the rule's axes and sizes. ``False`` sends the file to the row-by-row
    pass (which also accepts the absent-tensor placeholder, never accepted here)."""
    shape, dtype = shape.combine_chunks(), dtype.combine_chunks()
    if shape.null_count or dtype.null_count or len(shape) == 0:
        return len(shape) == 0
    names = pc.unique(dtype).to_pylist()
    found = [tensor_dtype(d) for d in names]
    if any(d is None for d in found):
        return False
    itemsize = np.array([d.itemsize for d in found], dtype=np.int64)[
        pc.index_in(dtype, value_set=pa.array(names)).to_numpy(zero_copy_only=False)]
    ndim = pc.list_value_length(shape).to_numpy(zero_copy_only=False)
    if (ndim == 0).any():  # a 0-d tensor or the placeholder: row by row
        return False
    flat = shape.flatten().to_numpy(zero_copy_only=False)
    if flat.dtype.kind != "i" or (flat < 0).any():
        return False
    offsets = shape.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    begins = offsets[:-1] - offsets[0]  # into flatten(), which starts at the (sliced) array's first value
    count = np.multiply.reduceat(flat, begins)
    if lengths is not None:
        if any(n is None for n in lengths) or (np.asarray(lengths, dtype=np.int64) != count * itemsize).any():
            return False
    if rule is None:
        return True
    if rule.ndim is not None and (ndim != rule.ndim).any():
        return False
    for axis, size in rule.sizes.items():
        sizes = _axis(flat, begins, ndim, axis)
        if sizes is None or (sizes != size).any():
            return False
    for axis, factor in rule.multiples.items():
        sizes = _axis(flat, begins, ndim, axis)
        if sizes is None or (sizes % factor).any():
            return False
    return True


def _axis(flat: np.ndarray, begins: np.ndarray, ndim: np.ndarray, axis: int) -> np.ndarray | None:
    """Every row's size along ``axis`` (negative: from the end); ``None`` when a row has no such axis."""
    if ((axis >= ndim) | (axis < -ndim)).any():
        return None
    return flat[begins + np.where(axis < 0, ndim + axis, axis)]


def _catalogue(dataset: TensorParquetDataset, mapped, f: int):
    """File ``f``'s stored :class:`~ff_core.data.tensor_parquet.catalogue.Catalogue` with every tensor's places, or
    ``None`` (none stored, stale, or the dataset reads without catalogues)."""
    from ff_core.data.tensor_parquet.catalogue import Catalogue

    if not dataset.catalogue:
        return None
    rows = sum(dataset.index.group_rows[f])
    for path in dataset._catalogue_paths(f):
        found = Catalogue.from_ipc(path, mapped.fingerprint, rows, [], dataset.tensor_names)
        if found is not None:
            return found
    return None


def _lengths(dataset: TensorParquetDataset, mapped, f: int) -> dict[str, list[int | None]]:
    """Per tensor, each row's ``_bytes`` length where the reader locates values without reading them (a stored
    catalogue, or the page headers of uncompressed pages); a tensor it cannot locate is left out."""
    out: dict[str, list[int | None]] = {t: [] for t in dataset.tensor_names} if dataset.direct else {}
    for g, n in enumerate(dataset.index.group_rows[f]):
        values = dataset._direct_values(mapped, f, g, n)
        for t in list(out):
            if t not in values:
                del out[t]  # compressed: its lengths need the pages decoded (validate --check-media)
                continue
            out[t] += [None if v is None else v[2] for v in values[t]]
    return out


def _assumed(shape, dtype) -> int | None:
    """The byte count a row would have if it fits its shape and dtype (its length unknown here)."""
    dt = tensor_dtype(dtype)
    if dt is None or not isinstance(shape, list) or any(not isinstance(d, int) or d < 0 for d in shape):
        return 0  # tensor_problem names the dtype or shape first
    return math.prod(shape) * dt.itemsize


def check_shard_rows(datasets: Sequence[tuple[TensorParquetDataset, int]],
                     shapes: Mapping[str, StoredShape] | None = None,
                     column_names: Mapping[str, str] | None = None) -> None:
    """:func:`row_problems` of each ``(dataset, rows served)``, raised together (``DatasetErrors``)."""
    errors: list[DatasetError] = []
    for dataset, rows in datasets:
        errors += row_problems(dataset, shapes, rows, column_names)
    raise_collected(errors)


def shard_row_name(rows: TensorRows, index: int) -> str:
    """Row ``index`` of :class:`~ff_core.data.tensor_parquet.rows.TensorRows` as ``file: row r (row group g, dataset row
    i)``, for messages."""
    k, local = rows.locate(index)
    dataset = rows.datasets[k]
    f = dataset.index.locate(local)[0]
    return f"{dataset.files[f]}: {dataset._row_place(local)}"

