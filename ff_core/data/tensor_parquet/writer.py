"""``TensorParquetWriter``: rows of scalars and tensors to ``ROOT/worker_<k>/data_chunk_<i>.parquet`` files.

Each file holds ``rows_per_file`` rows, one per row group, so a reader decodes exactly the row it asks for (the
reference writer puts a whole chunk file in one group and a per-row reader then decodes all of it each time). A file
is written as a hidden temporary beside its final name and published by a hard link that refuses to replace an
existing file, so readers (which skip hidden files) never see half a file and nothing already there is overwritten.
``close`` publishes the trailing partial chunk.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ff_core.data.tensor_parquet.format import BYTES, encode_tensor, split_schema
from ff_core.data.tensor_parquet.reader import write_catalogue


class TensorParquetWriter:
    """Writes rows to parquet files with one row per row group (a context manager; ``close`` on exit).

    Args:
        root: the folder to write ``worker_<worker>/data_chunk_<i>.parquet`` into (e.g. ``shard000/
            combined_parquet_dataset``).
        schema: the files' schema (:data:`I2V_TRACK_SCHEMA`, or :func:`tensor_schema` for any other layout).
        rows_per_file: rows per file (the last file may hold fewer).
        worker: the worker folder number (parallel writers use different ones).
        compression: a Parquet codec (``"zstd"``, ``"snappy"``, ...) or ``None`` for none; latents rarely compress,
            and uncompressed pages are read fastest.
        catalogue: write each uncompressed file's row catalogue beside it once published
            (:func:`~ff_core.data.tensor_parquet.reader.write_catalogue`), so readers locate its rows without
            decoding or parsing from their first read on (best effort: a failure leaves readers to build it).
    """

    def __init__(self, root: str | os.PathLike, schema: pa.Schema, rows_per_file: int = 64, worker: int = 0,
                 compression: str | None = None, catalogue: bool = True) -> None:
        if rows_per_file < 1:
            raise ValueError(f"rows_per_file must be >= 1, got {rows_per_file}")
        tensors, _, problems = split_schema(schema)
        if problems:
            raise ValueError(f"schema: {problems[0][0]}: {problems[0][1]}")
        self.folder = Path(root).expanduser() / f"worker_{worker}"
        self.schema, self.rows_per_file, self.compression = schema, rows_per_file, compression or "none"
        self.catalogue = catalogue
        self.tensor_names = set(tensors)
        self.paths: list[Path] = []
        self._writer: pq.ParquetWriter | None = None
        self._tmp: Path | None = None
        self._rows_in_file = 0
        self._closed = False
        existing = sorted(self.folder.glob("data_chunk_*.parquet")) if self.folder.is_dir() else []
        if existing:
            raise FileExistsError(f"{existing[0]}: already exists; write to an empty folder or another worker number")

    def write(self, row: dict[str, Any]) -> None:
        """Append one row: scalars by column name, tensors (``torch.Tensor``) by tensor name, or their triplets.

        Raises:
            ValueError: a column of the schema is missing from ``row`` or ``row`` has one the schema lacks.
        """
        if self._closed:
            raise ValueError("TensorParquetWriter: write after close")
        values: dict[str, Any] = {}
        for key, value in row.items():
            if isinstance(value, torch.Tensor) and key in self.tensor_names:
                values.update(encode_tensor(value, key))
            else:
                values[key] = value
        missing = [n for n in self.schema.names if n not in values]
        extra = [k for k in values if k not in self.schema.names]
        if missing or extra:
            what = f"missing {missing}" if missing else f"not in the schema: {extra}"
            raise ValueError(f"TensorParquetWriter row {self._count()}: columns {what}")
        try:
            table = pa.Table.from_pydict({n: [values[n]] for n in self.schema.names}, schema=self.schema)
        except (pa.ArrowException, TypeError, ValueError) as exc:
            raise ValueError(f"TensorParquetWriter row {self._count()}: {exc}") from None
        self._open().write_table(table)  # one call, one row group
        self._rows_in_file += 1
        if self._rows_in_file == self.rows_per_file:
            self._publish()

    def close(self) -> list[Path]:
        """Publish the trailing partial file; return every file written, in order."""
        if not self._closed:
            self._publish()
            self._closed = True
        return list(self.paths)

    def abort(self) -> None:
        """Drop the file being written (the published ones stay)."""
        if self._writer is not None:
            try:
                self._writer.close()
            except (OSError, pa.ArrowException):
                pass  # a full disk fails the final flush again: the file is dropped all the same
            self._writer = None
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
            self._tmp = None
        self._closed = True

    def __enter__(self) -> TensorParquetWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _count(self) -> int:
        return len(self.paths) * self.rows_per_file + self._rows_in_file

    def _open(self) -> pq.ParquetWriter:
        if self._writer is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._tmp = self.folder / f".data_chunk_{len(self.paths)}.parquet.{uuid.uuid4().hex[:8]}.tmp"
            # Statistics of megabyte binaries are useless (and truncated anyway); dictionaries of them are costly.
            stats = [n for n in self.schema.names if not n.endswith(BYTES)]
            self._writer = pq.ParquetWriter(self._tmp, self.schema, compression=self.compression,
                                            use_dictionary=False, write_statistics=stats)
        return self._writer

    def _publish(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        self._writer = None
        with open(self._tmp, "rb") as f:
            os.fsync(f.fileno())
        final = self.folder / f"data_chunk_{len(self.paths)}.parquet"
        try:
            os.link(self._tmp, final)  # unlike rename, fails rather than replace a file that appeared meanwhile
            self._tmp.unlink()
        except FileExistsError:
            raise FileExistsError(f"{final}: appeared while writing; not replaced (kept {self._tmp})") from None
        except OSError:  # a filesystem without hard links: check, then rename (a narrow race, but still atomic)
            if final.exists():
                raise FileExistsError(f"{final}: appeared while writing; not replaced (kept {self._tmp})") from None
            os.replace(self._tmp, final)
        self._tmp = None
        self.paths.append(final)
        if self.catalogue and self.compression == "none":
            try:
                write_catalogue(final)
            except (OSError, pa.ArrowException):
                pass  # only slower: readers build it on a file's second read
        self._rows_in_file = 0
