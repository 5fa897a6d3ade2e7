"""The row index of a tensor-parquet root: every parquet file below it and its row groups, from the footers only.

Building it reads each file's footer (``pq.read_metadata``), never a data page. It is cached as JSON keyed by
``(path, size, mtime_ns)`` of every file, so a reopened dataset only walks the folder and stats its files; any
added, removed, grown or touched file rebuilds it. The cache lives beside the data (``ROOT/.ff_tensor_parquet_index
.json``) when the folder is writable, else (or when ``cache_dir`` is given) in ``cache_dir`` under a name derived
from the root's absolute path, written atomically either way (:func:`ff_core.atomic.write_bytes_atomic`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ff_core.atomic import write_bytes_atomic
from ff_core.data.tensor_parquet.format import schema_problems
from ff_core.errors import DatasetError, raise_collected

INDEX_NAME = ".ff_tensor_parquet_index.json"
INDEX_VERSION = 1


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/ff/tensor_parquet`` (default ``~/.cache/ff/tensor_parquet``): read-only roots' index."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ff" / "tensor_parquet"


def _natural(rel: str) -> list:
    # data_chunk_2 before data_chunk_10, shard009 before shard010: the order the writers wrote them in.
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", rel)]


def discover(root: Path) -> list[tuple[str, int, int]]:
    """``(path relative to root, size, mtime_ns)`` of every ``*.parquet`` file below ``root``, naturally sorted.

    Hidden files and folders (a writer's ``.data_chunk_0.parquet.tmp``, ``.git``) are skipped.
    """
    found = []
    for path in parquet_files(root):
        st = os.stat(path)
        found.append((os.path.relpath(path, root), st.st_size, st.st_mtime_ns))
    found.sort(key=lambda x: _natural(x[0]))
    return found


def parquet_files(root: Path) -> Iterator[str]:
    """The path of every ``*.parquet`` file below ``root``, in walk order, skipping hidden files and folders."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        yield from (os.path.join(dirpath, f) for f in filenames if f.endswith(".parquet") and not f.startswith("."))


@dataclass
class RowIndex:
    """Where every row of a root lives.

    Attributes:
        root: the dataset root (absolute).
        files: file paths relative to ``root``, in index order.
        stats: ``(size, mtime_ns)`` of each file when indexed (the cache key).
        group_rows: rows per row group, per file.
        schema: the first file's Arrow schema (every file is checked against it by the dataset).
    """

    root: Path
    files: list[str]
    stats: list[tuple[int, int]]
    group_rows: list[list[int]]
    schema: pa.Schema

    def __post_init__(self) -> None:
        sizes = [n for groups in self.group_rows for n in groups]
        # Row-group g of the whole dataset covers rows group_start[g] .. group_start[g + 1] - 1.
        self.group_start = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        self.group_file = np.repeat(np.arange(len(self.files), dtype=np.int64), [len(g) for g in self.group_rows])
        self.group_in_file = np.concatenate([np.arange(len(g), dtype=np.int64) for g in self.group_rows] or [[]])
        self.group_in_file = self.group_in_file.astype(np.int64)
        # First dataset row of each file, to name a row by its number inside its file in messages.
        self.file_start = self.group_start[np.searchsorted(self.group_file, np.arange(len(self.files)))]

    @property
    def rows(self) -> int:
        return int(self.group_start[-1])

    def locate(self, i: int) -> tuple[int, int, int, int]:
        """``(file number, row group in file, row within group, global group number)`` of row ``i``."""
        g = int(np.searchsorted(self.group_start, i, side="right")) - 1
        return int(self.group_file[g]), int(self.group_in_file[g]), i - int(self.group_start[g]), g

    def to_json(self) -> dict:
        return {"version": INDEX_VERSION, "root": str(self.root),
                "files": [{"path": p, "size": s, "mtime_ns": m, "group_rows": g}
                          for p, (s, m), g in zip(self.files, self.stats, self.group_rows)],
                "schema": base64.b64encode(self.schema.serialize().to_pybytes()).decode()}

    @classmethod
    def from_json(cls, root: Path, data: dict) -> RowIndex:
        files = data["files"]
        schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(data["schema"])))
        return cls(root, [f["path"] for f in files], [(f["size"], f["mtime_ns"]) for f in files],
                   [f["group_rows"] for f in files], schema)


def index_paths(root: Path, cache_dir: str | os.PathLike | None) -> list[Path]:
    """Where the index may be cached, in the order tried: ``cache_dir`` if given, else beside the data, then the
    default cache folder."""
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:16]
    named = f"{root.name or 'root'}-{digest}.json"
    if cache_dir is not None:
        return [Path(cache_dir).expanduser() / named]
    return [root / INDEX_NAME, default_cache_dir() / named]


def load_index(root: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> tuple[RowIndex, bool]:
    """The root's row index, from its cache when every file's ``(path, size, mtime_ns)`` still matches.

    Returns:
        the index, and whether it came from the cache.

    Raises:
        DatasetError: the root does not exist or holds no parquet file; a footer cannot be read.
    """
    root = Path(root).expanduser().resolve()
    if not root.is_dir():
        raise DatasetError(root, None, None, "tensor-parquet root: not a directory")
    found = discover(root)
    if not found:
        raise DatasetError(root, None, None, "tensor-parquet root: no *.parquet file below it")
    key = [[p, s, m] for p, s, m in found]
    paths = index_paths(root, cache_dir)
    for path in paths:
        cached = _read_cached(path, root, key)
        if cached is not None:
            return cached, True
    index = build_index(root, found)
    payload = json.dumps(index.to_json()).encode()
    for path in paths:
        try:
            write_bytes_atomic(path, payload)
            break
        except OSError:
            continue  # a read-only dataset folder: try the next place; no cache at all is only slower
    return index, False


def _read_cached(path: Path, root: Path, key: list) -> RowIndex | None:
    try:
        data = json.loads(path.read_text())
        if data.get("version") != INDEX_VERSION or data.get("root") != str(root):
            return None
        if [[f["path"], f["size"], f["mtime_ns"]] for f in data["files"]] != key:
            return None
        return RowIndex.from_json(root, data)
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowException):
        return None  # absent, stale or damaged: rebuild


def build_index(root: Path, found: list[tuple[str, int, int]]) -> RowIndex:
    """Read every footer (no data page) and record its row groups' sizes."""
    group_rows, schema, errors = [], None, []
    for rel, _, _ in found:
        try:
            meta = pq.read_metadata(root / rel)
            file_schema = meta.schema.to_arrow_schema()
        except (OSError, pa.ArrowException) as exc:
            errors.append(DatasetError(root / rel, None, None, f"cannot read the parquet footer: {exc}"))
            continue
        group_rows.append([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        if schema is None:
            schema = file_schema
        else:  # every file must have the first one's columns: a row read must not fail halfway through an epoch
            errors += [DatasetError(root / rel, None, col, f"{why}, as in {found[0][0]}")
                       for col, why in schema_problems(file_schema, schema)]
    raise_collected(errors)
    return RowIndex(root, [f[0] for f in found], [(f[1], f[2]) for f in found], group_rows, schema)
