"""``ff data inspect`` / ``validate`` on a tensor-parquet root: files, rows, row groups, columns, and problems.

The report comes from the footers (files, row groups, on-disk sizes) and the small ``_shape`` / ``_dtype`` columns
(dtypes, per-dimension shape ranges, tensor bytes per row). Problems are schema ones (incomplete triplets, a file
without the first file's columns, columns an expected schema lacks) and row ones (null parts, unknown dtypes,
negative dimensions). With ``check_bytes`` every ``_bytes`` value is read, one row group at a time, and its length
checked against prod(shape) x itemsize, and every floating-point tensor checked for NaN and infinity (one NaN latent
poisons a training run's weights at the step that draws it): that reads the whole dataset, so it is opt-in
(``--check-media``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ff_core.data.tensor_parquet.format import (
    BYTES,
    DTYPE,
    SHAPE,
    is_empty_triplet,
    schema_problems,
    split_schema,
    tensor_dtype,
    tensor_problem,
)
from ff_core.data.tensor_parquet.index import RowIndex, discover, load_index, parquet_files
from ff_core.errors import DatasetError

MAX_ROW_PROBLEMS = 20  # per file and column: a systematically broken column is one line of cause, not a million


def is_tensor_parquet_root(path: str | os.PathLike) -> bool:
    """A folder without a dataset folder's split files (``train.jsonl`` / ``train.txt``) and with parquet below."""
    path = Path(path).expanduser()
    if not path.is_dir() or any((path / f"train.{ext}").exists() for ext in ("jsonl", "txt")):
        return False
    return any(True for _ in parquet_files(path))


@dataclass
class TensorStats:
    """One tensor column over all rows: dtypes seen and the range of each dimension (or of ranks, when they vary)."""

    dtypes: set = field(default_factory=set)
    ranks: set = field(default_factory=set)
    low: list[int] = field(default_factory=list)
    high: list[int] = field(default_factory=list)
    empty: int = 0
    """rows holding the absent-tensor placeholder ``(b"", [], "")``"""

    def add(self, shape: list[int], dtype: str) -> None:
        self.dtypes.add(dtype)
        self.ranks.add(len(shape))
        if not self.low:
            self.low, self.high = list(shape), list(shape)
        elif len(shape) == len(self.low):
            self.low = [min(a, b) for a, b in zip(self.low, shape)]
            self.high = [max(a, b) for a, b in zip(self.high, shape)]

    def shape_text(self) -> str:
        if len(self.ranks) > 1:
            return f"rank {min(self.ranks)}..{max(self.ranks)}"
        return "[" + ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in zip(self.low, self.high)) + "]"


@dataclass
class TensorParquetReport:
    """What ``ff data inspect`` reports on a tensor-parquet root.

    Attributes:
        root: the root.
        files: parquet files (relative paths, index order).
        rows: rows in all files.
        row_groups: row groups in all files; ``group_rows``: the fewest and most rows in one.
        disk_bytes: the files' total size.
        scalars: scalar columns and their Arrow types.
        tensors: per tensor, dtypes and shape ranges.
        tensor_bytes: the fewest and most tensor payload bytes (sum of prod(shape) x itemsize) in one row.
    """

    root: Path
    files: list[str] = field(default_factory=list)
    rows: int = 0
    row_groups: int = 0
    group_rows: tuple[int, int] = (0, 0)
    disk_bytes: int = 0
    scalars: dict[str, str] = field(default_factory=dict)
    tensors: dict[str, TensorStats] = field(default_factory=dict)
    tensor_bytes: tuple[int, int] = (0, 0)

    def format(self) -> list[str]:
        low, high = self.group_rows
        per_group = f"{low} row" if low == high == 1 else f"{low} rows" if low == high else f"{low}..{high} rows"
        lines = [f"tensor-parquet: {len(self.files)} file(s), {self.rows} rows, {self.row_groups} row groups "
                 f"({per_group} each), {_size(self.disk_bytes)} on disk"]
        if self.files:
            lines.append(f"  files: {self.files[0]}" + (f" .. {self.files[-1]}" if len(self.files) > 1 else ""))
        if self.rows:
            lo, hi = self.tensor_bytes
            lines.append(f"  tensor bytes per row: {_size(lo)}" + ("" if lo == hi else f"..{_size(hi)}")
                         + f"; on disk {_size(self.disk_bytes / self.rows)} per row")
        lines.append("  scalars: " + (", ".join(f"{k} {v}" for k, v in self.scalars.items()) or "none"))
        lines += [f"  tensor {name}: {'/'.join(sorted(s.dtypes)) or '-'} {s.shape_text()}"
                  + (f" (empty in {s.empty} rows)" if s.empty else "") for name, s in self.tensors.items()]
        return lines

    def to_json(self) -> dict[str, Any]:
        return {"root": str(self.root), "files": self.files, "rows": self.rows, "row_groups": self.row_groups,
                "group_rows": list(self.group_rows), "disk_bytes": self.disk_bytes, "scalars": self.scalars,
                "tensors": {n: {"dtypes": sorted(s.dtypes), "shape_min": s.low, "shape_max": s.high,
                                "ranks": sorted(s.ranks), "empty_rows": s.empty} for n, s in self.tensors.items()},
                "tensor_bytes": list(self.tensor_bytes)}


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""  # pragma: no cover


def inspect_tensor_parquet(root: str | os.PathLike, schema: pa.Schema | None = None, check_bytes: bool = False,
                           cache_dir: str | os.PathLike | None = None
                           ) -> tuple[TensorParquetReport, list[DatasetError]]:
    """Describe a root and list its problems (nothing raised for a bad dataset).

    Args:
        root: the tensor-parquet root.
        schema: an expected schema the files must have (columns and types).
        check_bytes: read every ``_bytes`` value and check its length (reads the whole dataset).
        cache_dir: where the row index is cached (as :class:`TensorParquetDataset`).
    """
    report = TensorParquetReport(Path(root).expanduser().resolve())
    try:
        index, _ = load_index(root, cache_dir)
    except DatasetError as exc:
        report.files = [f[0] for f in discover(report.root)] if report.root.is_dir() else []
        return report, exc.errors
    _footer_figures(report, index)
    tensors, scalars, problems = split_schema(index.schema)
    first = index.root / index.files[0]
    errors = [DatasetError(first, None, col, why) for col, why in problems]
    if schema is not None:
        errors += [DatasetError(first, None, col, why) for col, why in schema_problems(index.schema, schema)]
    report.scalars = {s: str(index.schema.field(s).type) for s in scalars}
    complete = [t for t in tensors if not any(col.startswith(t + "_") for col, _ in problems)]
    report.tensors = {t: TensorStats() for t in complete}
    lo, hi = math.inf, 0
    for f, rel in enumerate(index.files):
        for payload in _file_rows(index.root / rel, complete, report, errors, check_bytes, int(index.file_start[f])):
            lo, hi = min(lo, payload), max(hi, payload)
    report.tensor_bytes = (0 if lo == math.inf else int(lo), hi)
    return report, errors


def _footer_figures(report: TensorParquetReport, index: RowIndex) -> None:
    sizes = [n for groups in index.group_rows for n in groups]
    report.files, report.rows, report.row_groups = list(index.files), index.rows, len(sizes)
    report.group_rows = (min(sizes), max(sizes)) if sizes else (0, 0)
    report.disk_bytes = sum(s for s, _ in index.stats)


def _file_rows(path: Path, tensors: list[str], report: TensorParquetReport, errors: list[DatasetError],
               check_bytes: bool, first_row: int):
    """Check each row of one file; yield each row's tensor payload bytes."""
    pf = pq.ParquetFile(path)  # read, not mapped: --check-media reads every byte, which must not stay resident
    small = pf.read(columns=[t + s for t in tensors for s in (SHAPE, DTYPE)], use_threads=False)
    shapes = {t: small.column(t + SHAPE).to_pylist() for t in tensors}
    dtypes = {t: small.column(t + DTYPE).to_pylist() for t in tensors}
    lengths = {t: _lengths(pf, t + BYTES, shapes[t], dtypes[t]) if check_bytes else None for t in tensors}
    counts: dict[str, int] = {}
    for r in range(small.num_rows):
        payload = 0
        for t in tensors:
            shape, dtype = shapes[t][r], dtypes[t][r]
            ok_shape = isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
            dt = tensor_dtype(dtype)
            expected = math.prod(shape) * dt.itemsize if ok_shape and dt is not None else 0
            found = lengths[t][r] if lengths[t] is not None else expected  # unchecked: assume it fits
            if is_empty_triplet(found if lengths[t] is not None else 0, shape, dtype):  # an absent tensor
                report.tensors[t].empty += 1
                continue
            problem = tensor_problem(found, shape, dtype)
            if problem is None and isinstance(found, NonFinite):
                problem = (BYTES, f"{found.count} non-finite value(s) (NaN or infinity) among {math.prod(shape)}: "
                                  "training on this row would make the loss NaN")
            if problem is None:
                report.tensors[t].add(shape, dtype)
                payload += expected
                continue
            column = t + problem[0]
            counts[column] = counts.get(column, 0) + 1
            if counts[column] <= MAX_ROW_PROBLEMS:
                errors.append(DatasetError(path, None, column, f"row {r} (dataset row {first_row + r}): {problem[1]}"))
        yield payload
    errors += [DatasetError(path, None, col, f"{n - MAX_ROW_PROBLEMS} more rows with problems in this column")
               for col, n in counts.items() if n > MAX_ROW_PROBLEMS]


class NonFinite(int):
    """A value's byte length (an ``int``) that also says how many of its elements are NaN or infinite."""

    count: int = 0


def _lengths(pf: pq.ParquetFile, column: str, shapes: list[Any] | None = None,
             dtypes: list[Any] | None = None) -> list[int | None]:
    """Byte length of every value of a binary column, one row group in memory at a time; with the rows' shapes and
    dtypes, a floating-point value of the right length holding NaN or infinity comes back as :class:`NonFinite`."""
    out: list[int | None] = []
    row = 0
    for g in range(pf.metadata.num_row_groups):
        values = pf.read_row_group(g, columns=[column], use_threads=False).column(0)
        lengths = pc.binary_length(values).to_pylist()
        if shapes is not None and dtypes is not None:
            lengths = [_finite_checked(values, r, n, shapes[row + r], dtypes[row + r]) for r, n in enumerate(lengths)]
        out += lengths
        row += len(lengths)
    return out


def _finite_checked(values: pa.ChunkedArray, r: int, length: int | None, shape: Any, dtype: Any) -> int | None:
    """``length``, or a :class:`NonFinite` of it when the value decodes to a floating tensor with non-finite
    elements (a value that does not fit its shape and dtype is left to :func:`tensor_problem`)."""
    dt = tensor_dtype(dtype)
    if length is None or dt is None or not dt.is_floating_point or tensor_problem(length, shape, dtype) is not None:
        return length
    import torch

    # A writable, aligned copy (--check-media reads every byte anyway); torch, not numpy: bfloat16 too.
    tensor = torch.frombuffer(bytearray(values[r].as_buffer()), dtype=dt) if length else torch.empty(0)
    bad = int((~torch.isfinite(tensor)).sum())
    if not bad:
        return length
    found = NonFinite(length)
    found.count = bad
    return found
