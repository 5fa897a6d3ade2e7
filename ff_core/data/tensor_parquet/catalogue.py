"""A file's row catalogue: what its rows hold besides their tensor bytes, kept on disk for the next process.

Reading a row of a one-row-per-group file costs, besides the copy of its tensors, two per-file setups that every
new process pays again: decoding the file's small columns (scalars, ``_shape``, ``_dtype``: pyarrow spends ~30 µs
a column chunk, ~0.3-0.6 ms a row with the card's 25) and parsing the page header in front of each ``_bytes`` value
(~0.3 ms a row). Together they cost as much as the copy itself (benchmarks/RESULTS.md, "Tensor-parquet shards",
run K), and DataLoader workers are new processes every epoch. The reader keeps both in bounded per-process caches
(:class:`~ff_core.data.tensor_parquet.TensorParquetDataset`: a file's small columns decoded whole on its second
read, each row group's value places); a catalogue is those caches stored for the next process, for one file:

* its small columns (binary scalars left out: a dataset reading one decodes the file as before), as pyarrow
  decoded them;
* for every tensor, where its ``_bytes`` value lies in the file (offset, length; null for a null value).

A reader writes it when it decodes a file's small columns whole (with the page headers of every row group, and
their checks), and ff's writer for every file it publishes (:func:`~ff_core.data.tensor_parquet.reader.
write_catalogue`), only for files whose every ``_bytes`` value is an uncompressed range of the file (ff's writer's
default), as an Arrow IPC file keyed by the parquet file's :func:`fingerprint` (size, modification time, inode,
change time, footer digest): beside the file (``FOLDER/.ff_tensor_parquet_rows/NAME.arrow``, so a dataset opened at
any root finds it) when the folder is writable, else in the cache folder, written atomically. A new reader fills
its caches from it instead of decoding and parsing; a catalogue whose fingerprint or row count differs from the
file's, that lacks a column, or that cannot be read is ignored (and written again). Its values are checked at every
read as a page-parsed value is (byte length against ``_shape`` x ``_dtype``). A copy of the shards elsewhere
(another inode) builds its own.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from ff_core.atomic import write_bytes_atomic
from ff_core.data.tensor_parquet.format import BYTES
from ff_core.data.tensor_parquet.index import default_cache_dir

CATALOGUE_DIR = ".ff_tensor_parquet_rows"
CATALOGUE_VERSION = "1"
OFFSET, LENGTH = ".offset", ".length"  # suffixes of a tensor's location columns (after ``<name>_bytes``)
_KEY = b"ff.catalogue"  # schema metadata: "version rows fingerprint"


def fingerprint(fd: int) -> str:
    """``"size mtime_ns inode ctime_ns sha256-of-footer"`` of an open parquet file (its last 8 bytes give the footer's
    length). A file renamed over another is a new inode; one rewritten in place has a new ``ctime`` (which, unlike
    ``mtime``, no copy tool or ``touch`` can set back); the footer digest tells apart what a reused inode number
    within one clock tick would not.

    Raises:
        OSError: the file cannot be read, or is too short to be parquet.
    """
    st = os.fstat(fd)
    tail = os.pread(fd, 8, max(0, st.st_size - 8))
    length = int.from_bytes(tail[:4], "little") if len(tail) == 8 else -1
    if not 0 <= length <= st.st_size - 12:
        raise OSError(f"not a parquet file ({st.st_size} bytes, footer of {length})")
    footer = os.pread(fd, length, st.st_size - 8 - length)
    return f"{st.st_size} {st.st_mtime_ns} {st.st_ino} {st.st_ctime_ns} {hashlib.sha256(footer).hexdigest()}"


@dataclass
class Catalogue:
    """The small columns and ``_bytes`` locations of every row of one file.

    Attributes:
        small: small column name -> one Python value per row of the file.
        places: tensor name -> one ``(offset, length)`` per row (``None`` for a null ``_bytes``).
    """

    small: dict[str, list[Any]]
    places: dict[str, list[tuple[int, int] | None]]

    def to_ipc(self, table: pa.Table, key: str) -> bytes:
        """The catalogue as Arrow IPC bytes: ``table`` (the file's small columns as decoded) and the locations."""
        for name, places in self.places.items():
            table = table.append_column(name + BYTES + OFFSET, pa.array([p and p[0] for p in places], pa.int64()))
            table = table.append_column(name + BYTES + LENGTH, pa.array([p and p[1] for p in places], pa.int64()))
        table = table.replace_schema_metadata({_KEY: f"{CATALOGUE_VERSION} {table.num_rows} {key}".encode()})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        return sink.getvalue().to_pybytes()

    @classmethod
    def from_ipc(cls, path: Path, key: str, rows: int, small: Sequence[str],
                 tensors: Sequence[str]) -> Catalogue | None:
        """The catalogue stored at ``path`` for the file of :func:`fingerprint` ``key`` with ``rows`` rows, holding
        ``small`` columns and ``tensors``' locations; ``None`` when absent, stale, incomplete or unreadable (a
        catalogue is never trusted over building it again)."""
        size = int(key.split()[0])
        try:
            with pa.memory_map(str(path)) as source:
                table = pa.ipc.open_file(source).read_all()
            meta = table.schema.metadata or {}
            if meta.get(_KEY) != f"{CATALOGUE_VERSION} {rows} {key}".encode() or table.num_rows != rows:
                return None
            out = cls({c: table.column(c).to_pylist() for c in small}, {})
            for t in tensors:
                offsets = table.column(t + BYTES + OFFSET).to_pylist()
                lengths = table.column(t + BYTES + LENGTH).to_pylist()
                if any((o is None) != (n is None) or (o is not None and (o < 0 or n < 0 or o + n > size))
                       for o, n in zip(offsets, lengths)):
                    return None
                out.places[t] = [None if o is None else (o, n) for o, n in zip(offsets, lengths)]
            return out
        except (OSError, KeyError, TypeError, ValueError, pa.ArrowException):
            return None


def catalogue_paths(path: Path, cache_dir: str | os.PathLike | None = None, writing: bool = False) -> list[Path]:
    """Where the catalogue of parquet file ``path`` may be, in the order looked in: beside it
    (``FOLDER/.ff_tensor_parquet_rows/NAME.arrow``: found whatever root a dataset is opened at; where ff's writer puts
    it), then in the cache folder (``cache_dir``, else ``~/.cache/ff/tensor_parquet``) under a name derived from
    the file's absolute path. ``writing``: where to write, in the order tried: ``cache_dir`` only when given (as
    for the row index), else beside the file, then the default cache folder."""
    path = Path(path).absolute()
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:16]
    cached = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    beside = path.parent / CATALOGUE_DIR / f"{path.name}.arrow"
    elsewhere = cached / "rows" / f"{path.stem}-{digest}.arrow"
    if writing and cache_dir is not None:
        return [elsewhere]
    return [beside, elsewhere]


def save_catalogue(paths: Sequence[Path], data: bytes) -> Path | None:
    """Write ``data`` atomically to the first writable place of ``paths``; ``None`` when none is (no catalogue is
    only slower)."""
    for path in paths:
        try:
            return write_bytes_atomic(path, data)
        except OSError:
            continue
    return None
