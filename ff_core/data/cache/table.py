"""Arrow IPC files of preprocessed conditions: one row per record, written in record batches, read memory-mapped.

Each tensor key ``k`` of ``adapter.preprocess``'s output is a triplet of columns, as in tensor-parquet shards (spec
tensor-parquet-dataset-card): ``k_bytes`` (the raw buffer, row-major), ``k_shape`` (list of int64) and ``k_dtype``
(torch's name: ``float32``, ``bfloat16``, ...; numpy has no bfloat16, so bytes go through torch both ways). Beside
them every row carries ``condition_id`` (the SHA-256 of its record's input side, checked on every read) and ``index``
(its row number in the cache).

Reads are zero-copy: an IPC file is memory-mapped (``mmap``, wrapped by pyarrow without a copy) and
``torch.frombuffer`` wraps the bytes of a row in place, so a rank touches only the pages of the rows it reads and
never holds the dataset in RAM. The mapping is read-only: a consumer that writes into a condition tensor must clone
it first (the collator's ``torch.stack`` already copies).
"""

from __future__ import annotations

import bisect
import mmap
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import torch

from ff_core.data.cache.digest import block_digests, check_block
from ff_core.data.tensor_parquet.format import tensor_dtype

ID_COLUMN, INDEX_COLUMN = "condition_id", "index"
ID_BYTES = 32  # a SHA-256 digest
TRIM_BYTES = 8 << 20  # a reader drops its mapped pages after serving this many bytes (the kernel maps ~2-3x that)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = tensor_dtype(name)  # one dtype vocabulary for every tensor-triplet table (tensor-parquet shards too)
    if dtype is None:
        raise ValueError(f"condition cache: unknown tensor dtype {name!r}")
    return dtype


def row_schema(row: dict[str, torch.Tensor]) -> pa.Schema:
    """The schema of a cache whose rows look like ``row`` (one preprocessed condition)."""
    fields = [pa.field(ID_COLUMN, pa.binary(ID_BYTES)), pa.field(INDEX_COLUMN, pa.int64())]
    for key, value in row.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"adapter.preprocess returned {key!r} as {type(value).__name__}; the condition cache "
                            "stores tensors only")
        fields += [pa.field(f"{key}_bytes", pa.large_binary()), pa.field(f"{key}_shape", pa.list_(pa.int64())),
                   pa.field(f"{key}_dtype", pa.string())]  # fmt: skip
    return pa.schema(fields)


def tensor_keys(schema: pa.Schema) -> list[str]:
    return [name.removesuffix("_bytes") for name in schema.names if name.endswith("_bytes")]


class PartWriter:
    """Writes one IPC file of condition rows, a record batch per :meth:`write` call.

    Args:
        path: the file to create (inside the build folder; never a published cache).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.rows = 0
        self._sink: pa.OSFile | None = None
        self._writer: pa.ipc.RecordBatchFileWriter | None = None
        self._keys: list[str] = []
        self._schema: pa.Schema | None = None
        self.batch_ends: list[int] = []  # file offset after each record batch: the digest blocks' boundaries
        self.blocks: list[list] = []  # [[end, sha256], ...] once closed (ff_core.data.cache.digest)

    def write(self, ids: Sequence[bytes], rows: Sequence[dict[str, torch.Tensor]], first_index: int) -> None:
        """Append rows ``first_index, first_index + 1, ...`` with their condition ids.

        Args:
            ids: the rows' condition ids (32-byte digests).
            rows: the rows' preprocessed conditions (CPU tensors).
            first_index: cache row number of ``rows[0]``.
        """
        if self._writer is None:
            self._schema = row_schema(rows[0])
            self._keys = tensor_keys(self._schema)
            self._sink = pa.OSFile(str(self.path), "wb")
            self._writer = pa.ipc.new_file(self._sink, self._schema)
        columns: dict[str, pa.Array | list] = {ID_COLUMN: list(ids),
                                               INDEX_COLUMN: list(range(first_index, first_index + len(rows)))}
        for i, row in enumerate(rows):
            if list(row) != self._keys:
                raise ValueError(f"adapter.preprocess: row {first_index + i} has keys {sorted(row)}, the first row "
                                 f"{sorted(self._keys)}; every condition must have the same tensors")
        for key in self._keys:
            tensors = [row[key].detach().cpu() for row in rows]
            columns[f"{key}_bytes"] = _binary_column([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])
            columns[f"{key}_shape"] = [list(t.shape) for t in tensors]
            columns[f"{key}_dtype"] = [dtype_name(t.dtype) for t in tensors]
        self._writer.write_batch(pa.record_batch(columns, schema=self._schema))
        self.batch_ends.append(self._sink.tell())
        self.rows += len(rows)

    def close(self) -> list[list]:
        """Finish the file (footer), flush it to disk, so a published cache survives a crash, and return its blocks'
        ``[end, sha256]`` (:func:`~ff_core.data.cache.digest.block_digests`; ``[]`` when nothing was written)."""
        if self._writer is None:
            return []
        self._writer.close()
        self._sink.close()
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.blocks = block_digests(self.path, self.batch_ends)
        return self.blocks

    def abort(self) -> None:
        """Close the file without finishing it (a failed build; the caller removes the build folder)."""
        for closing in (self._writer, self._sink):
            try:
                if closing is not None:
                    closing.close()
            except (OSError, pa.ArrowException):
                pass  # a full disk fails the flush again
        self._writer = self._sink = None


def _binary_column(values: list[torch.Tensor]) -> pa.Array:
    """A ``large_binary`` array of the given byte tensors, built from one data buffer and its offsets."""
    sizes = torch.tensor([0] + [v.numel() for v in values], dtype=torch.int64)
    data = torch.cat(values) if values else torch.empty(0, dtype=torch.uint8)
    buffers = [None, pa.py_buffer(sizes.cumsum(0).numpy()), pa.py_buffer(data.numpy())]
    return pa.Array.from_buffers(pa.large_binary(), len(values), buffers)


class CachedConditions(Sequence):
    """The rows of a published condition cache as a lazy sequence of ``{key: tensor}`` (what ``ConditionedRecords``
    pairs with its records).

    Picklable and fork-safe: the memory maps are (re)opened by path in each process on first access, so loader
    workers read the files themselves instead of receiving tensors. Pages a process has read stay in the kernel's
    page cache (shared by every rank of the node) but are dropped from its own mappings every
    :data:`TRIM_BYTES` served (``madvise(MADV_DONTNEED)``; a tensor still in use faults its pages back in from the
    page cache), so a rank's resident set stays flat however large the cache is.

    Args:
        folder: the published cache folder.
        parts: ``(file name, rows)`` or ``(file name, rows, blocks)`` of its IPC files, in row order; ``blocks``
            (the manifest's ``[end, sha256]`` list) switches on the content checks of :mod:`ff_core.data.cache.digest`:
            footer and first record batch when a process opens the part, every other record batch before its first
            row is read in that process.
        expected_ids: the concatenated 32-byte condition ids the rows must carry, in order (checked on read).
    """

    def __init__(self, folder: Path, parts: Sequence[tuple], expected_ids: bytes) -> None:
        self.folder, self.parts = Path(folder), [(str(p[0]), int(p[1])) for p in parts]
        self.blocks: list[list | None] = [p[2] if len(p) > 2 else None for p in parts]
        self._starts = [0]
        for _, rows in self.parts:
            self._starts.append(self._starts[-1] + rows)
        if len(expected_ids) != ID_BYTES * len(self):
            raise ValueError(f"condition cache {self.folder}: {len(self)} rows but {len(expected_ids) // ID_BYTES} ids")
        self.expected_ids = expected_ids
        self._readers: list[pa.ipc.RecordBatchFileReader] | None = None
        self._maps: list[mmap.mmap] = []
        self._per_batch: list[int] = []
        self._checked: list[set[int]] = []
        self._served = 0
        self._pid: int | None = None

    def __len__(self) -> int:
        return self._starts[-1]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_readers": None, "_maps": [], "_per_batch": [], "_checked": [], "_served": 0,
                "_pid": None}

    def _open(self) -> list[pa.ipc.RecordBatchFileReader]:
        # A forked worker inherits the parent's maps; reopening per process keeps pyarrow's state process-local.
        if self._readers is None or self._pid != os.getpid():
            self._maps, self._readers, self._checked = [], [], []
            for part, (name, _) in enumerate(self.parts):
                with open(self.folder / name, "rb") as f:
                    self._maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
                self._checked.append(set())
                if self.blocks[part] is not None:  # before Arrow parses them: the footer, the schema, batch 0
                    self._check(part, -1)
                    self._check(part, 0)
                self._readers.append(pa.ipc.open_file(pa.BufferReader(pa.py_buffer(self._maps[-1]))))
            # Every batch but the last holds the same number of rows (the writer's chunk size).
            self._per_batch = [r.get_batch(0).num_rows for r in self._readers]
            self._pid = os.getpid()
        return self._readers

    def _locate(self, index: int) -> tuple[pa.RecordBatch, int]:
        part = bisect.bisect_right(self._starts, index) - 1
        reader, local = self._open()[part], index - self._starts[part]
        per_batch = self._per_batch[part]
        if self.blocks[part] is not None and local // per_batch not in self._checked[part]:
            self._check(part, local // per_batch)
        return reader.get_batch(local // per_batch), local % per_batch

    def _check(self, part: int, block: int) -> None:
        """Check one digest block of a part (once per process); its pages count towards the next trim."""
        blocks = self.blocks[part]
        if block >= 0 and block >= len(blocks) - 1:  # more batches than the manifest lists
            raise RuntimeError(f"condition cache {self.folder / self.parts[part][0]}: record batch {block} is not in "
                               "its manifest")  # fmt: skip
        per_batch = self._per_batch[part] if self._per_batch else None
        if block < 0:
            rows = "the footer"
        elif per_batch is None:
            rows = "the header and first record batch"
        else:
            first = self._starts[part] + block * per_batch
            rows = f"rows {first}-{min(first + per_batch, self._starts[part + 1]) - 1}"
        path = self.folder / self.parts[part][0]
        self._served += check_block(memoryview(self._maps[part]), blocks, block, path, rows)
        self._checked[part].add(block % len(blocks))

    def _trim(self, served: int) -> None:
        self._served += served
        if self._served >= TRIM_BYTES and hasattr(mmap, "MADV_DONTNEED"):
            for mapping in self._maps:
                mapping.madvise(mmap.MADV_DONTNEED)
            self._served = 0

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"condition cache row {index} out of range ({len(self)} rows)")
        batch, row = self._locate(index)
        found = batch.column(ID_COLUMN)[row].as_py()
        expected = self.expected_ids[index * ID_BYTES : (index + 1) * ID_BYTES]
        if found != expected or batch.column(INDEX_COLUMN)[row].as_py() != index:
            raise RuntimeError(
                f"condition cache {self.folder}: row {index} holds condition {found.hex()[:16]}…, its record "
                f"{expected.hex()[:16]}…: the cache does not belong to these records (rebuild with "
                "data.force_reprocess: true)"
            )
        row_tensors = {key: _tensor(batch, key, row) for key in tensor_keys(batch.schema)}
        self._trim(sum(t.nbytes for t in row_tensors.values()))
        return row_tensors


def _value(column: pa.Array, row: int) -> pa.Buffer:
    """Row ``row`` of a ``large_binary`` column as a slice of its data buffer: zero-copy (a scalar's ``as_buffer``
    copies)."""
    _, offsets, data = column.buffers()
    start, stop = memoryview(offsets).cast("q")[column.offset + row : column.offset + row + 2]
    return data.slice(start, stop - start)


def _tensor(batch: pa.RecordBatch, key: str, row: int) -> torch.Tensor:
    data = _value(batch.column(f"{key}_bytes"), row)
    shape = batch.column(f"{key}_shape")[row].as_py()
    dtype = parse_dtype(batch.column(f"{key}_dtype")[row].as_py())
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(data) == 0:
        return torch.empty(shape, dtype=dtype)
    if data.address % itemsize:  # the values of one column are unaligned only if it mixes dtypes: copy those
        return torch.frombuffer(bytearray(data.to_pybytes()), dtype=dtype).reshape(shape)
    with warnings.catch_warnings():  # the mapping is read-only on purpose (see the module docstring)
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(memoryview(data), dtype=dtype).reshape(shape)
