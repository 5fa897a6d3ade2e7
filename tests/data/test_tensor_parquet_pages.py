"""The reader's direct page path (``ff_core.data.tensor_parquet.pages``) against pyarrow's decoding of the same files.

Every file is read twice, ``direct=True`` and ``direct=False`` (every column decoded by pyarrow), and must give the
same rows bit for bit, or the same error, on every dtype, per-row shapes, nulls, every codec pyarrow writes, both
data page versions, dictionary and plain encodings, one and several values per page, one and several rows per row
group. ``chunk_reads`` shows which path served each ``_bytes`` chunk: the supported layouts must not fall back.
"""

from __future__ import annotations

import random
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tensor_parquet_helpers import card_decode

from ff_core.data.tensor_parquet import TENSOR_DTYPES, TensorParquetDataset, encode_tensor, reader, tensor_schema
from ff_core.data.tensor_parquet.pages import Unsupported, hybrid
from ff_core.errors import DatasetError

SHAPES = [(3, 4), (1, 4), (0, 4), (), (2, 3, 5), (7,), (3, 4), (5, 1), (2, 2, 2)]


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 1e3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def rows_of_every_dtype(nulls: bool = False) -> list[dict]:
    """One tensor column per dtype, shapes varying per row; rows 3 and 6 repeat row 0 (dictionary hits);
    with ``nulls``, some ``_bytes`` are null (an error when read) and one row holds the absent-tensor placeholder."""
    rows = []
    for i, shape in enumerate(SHAPES):
        row = {"id": str(i)}
        for k, (name, dtype) in enumerate(TENSOR_DTYPES.items()):
            seed = 0 if i in (3, 6) else i * 100 + k
            row.update(encode_tensor(sample(dtype, SHAPES[0] if i in (3, 6) else shape, seed), name))
        rows.append(row)
    if nulls:
        rows[2]["float32_bytes"] = None
        rows[5]["int8_bytes"] = None
        rows[7].update({"bool_bytes": b"", "bool_shape": [], "bool_dtype": ""})
    return rows


def both(root) -> tuple[TensorParquetDataset, TensorParquetDataset]:
    return TensorParquetDataset(root, direct=True), TensorParquetDataset(root, direct=False)


def read(ds: TensorParquetDataset, i: int) -> dict | str:
    try:
        return ds[i]
    except DatasetError as exc:
        return f"error: {exc}"


def assert_same_rows(direct: TensorParquetDataset, arrow: TensorParquetDataset, rows: list[dict]) -> None:
    for i in range(len(rows)):
        a, b = read(direct, i), read(arrow, i)
        if isinstance(b, str):
            assert a == b, i
            continue
        assert not isinstance(a, str), (i, a)
        assert a.keys() == b.keys()
        for name, value in b.items():
            got = a[name]
            if not isinstance(value, torch.Tensor):
                assert got == value, (i, name)
                continue
            assert got.dtype == value.dtype and got.shape == value.shape, (i, name)
            assert encode_tensor(got) == encode_tensor(value), (i, name)  # bitwise, NaN-safe
            if value.numel():  # and the card's own decoding of the stored triplet
                assert encode_tensor(got) == encode_tensor(card_decode(rows[i], name)), (i, name)


WRITE_OPTIONS = {
    "plain": dict(compression="none", use_dictionary=False),
    "dictionary-snappy": dict(compression="snappy"),  # pq.write_table's defaults: the reference writer's files
    "zstd": dict(compression="zstd", use_dictionary=False),
    "gzip": dict(compression="gzip"),
    "brotli": dict(compression="brotli", use_dictionary=False),
    "lz4": dict(compression="lz4"),
    "v2-snappy": dict(compression="snappy", data_page_version="2.0"),
    "v2-plain": dict(compression="none", data_page_version="2.0", use_dictionary=False),
    # A page per value or two, and dictionaries that overflow into PLAIN pages within one chunk.
    "small-pages": dict(compression="snappy", data_page_size=64, dictionary_pagesize_limit=128, write_batch_size=1),
    "small-pages-v2": dict(compression="none", data_page_size=64, data_page_version="2.0", write_batch_size=2),
}


@pytest.mark.parametrize("rows_per_group", [1, 4])
@pytest.mark.parametrize("options", list(WRITE_OPTIONS))
def test_direct_reads_equal_pyarrow(tmp_path, options, rows_per_group):
    rows = rows_of_every_dtype(nulls=True)
    schema = tensor_schema({"id": pa.string()}, list(TENSOR_DTYPES))
    path = tmp_path / "part" / "f.parquet"
    path.parent.mkdir()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=rows_per_group,
                   **WRITE_OPTIONS[options])
    direct, arrow = both(tmp_path)
    assert_same_rows(direct, arrow, rows)
    if options in ("brotli", "lz4"):  # no stated uncompressed size to check a page against: left to pyarrow
        assert direct.chunk_reads["direct"] == 0
    else:
        assert direct.chunk_reads["pyarrow"] == 0 and direct.chunk_reads["direct"] > 0
    assert arrow.chunk_reads["direct"] == 0
    assert read(direct, 2) == f"error: {path}: float32_bytes: row 2 (row group {2 // rows_per_group}, " \
                              f"dataset row 2): null value"
    assert direct[7]["bool"] is None


def test_required_and_large_binary_columns(tmp_path):
    """Non-nullable columns (no definition levels) and large_binary (64-bit offsets in Arrow; BYTE_ARRAY on disk)."""
    fields = [pa.field("id", pa.string()), pa.field("x_bytes", pa.large_binary(), nullable=False),
              pa.field("x_shape", pa.list_(pa.int64())), pa.field("x_dtype", pa.string())]
    rows = [{"id": str(i), **encode_tensor(sample(torch.bfloat16, (i, 3), i), "x")} for i in range(6)]
    path = tmp_path / "f.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema(fields)), path, row_group_size=4)
    direct, arrow = both(tmp_path)
    assert_same_rows(direct, arrow, rows)
    assert direct.chunk_reads == {"direct": 2, "pyarrow": 0}


def test_unsupported_encodings_fall_back_to_pyarrow(tmp_path):
    rows = [{"id": str(i), **encode_tensor(sample(torch.float16, (i + 1, 2), i), "x"),
             **encode_tensor(sample(torch.int32, (2, i), i), "y")} for i in range(5)]
    path = tmp_path / "f.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=tensor_schema({"id": pa.string()}, ["x", "y"])), path,
                   row_group_size=2, use_dictionary=False, column_encoding={"x_bytes": "DELTA_LENGTH_BYTE_ARRAY"})
    direct, arrow = both(tmp_path)
    assert_same_rows(direct, arrow, rows)
    assert direct.chunk_reads == {"direct": 3, "pyarrow": 3}  # y from its pages, x through pyarrow, in 3 groups


def _value_offsets(path) -> list[int]:
    """File offsets of every x_bytes value (after its 4-byte length) of a one-column-per-group uncompressed file."""
    ds = TensorParquetDataset(path.parent)
    ds[0]
    mapped = ds._handles[0]
    meta = mapped.file.metadata
    return [mapped.values(g, "x_bytes", 1)[0][1] for g in range(meta.num_row_groups)]


def test_damaged_pages_give_the_same_error_as_pyarrow(tmp_path):
    rows = [{"id": str(i), **encode_tensor(torch.arange(6, dtype=torch.float32) + i, "x")} for i in range(3)]
    path = tmp_path / "f.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=tensor_schema({"id": pa.string()}, ["x"])), path,
                   row_group_size=1, use_dictionary=False, compression="none")
    at = _value_offsets(path)[1]
    data = bytearray(path.read_bytes())
    data[at - 4: at] = (10 ** 6).to_bytes(4, "little")  # row 1's value claims a megabyte: past its page
    path.write_bytes(bytes(data))
    direct, arrow = both(tmp_path)
    for i in (0, 2):  # the damage spoils no other row
        assert encode_tensor(direct[i]["x"]) == encode_tensor(arrow[i]["x"]) == encode_tensor(card_decode(rows[i], "x"))
    # The page reader refuses the chunk and pyarrow names the damage; the error also names the column refused.
    expected = read(arrow, 1)
    assert expected.startswith(f"error: {path}: row group 1: cannot be read: "), expected
    assert read(direct, 1) == expected.replace(f"{path}: ", f"{path}: x_bytes: ", 1)
    assert direct.chunk_reads["pyarrow"] == 1


def test_hybrid_decoding():
    # Parquet spec, "Run Length Encoding / Bit-Packing Hybrid": header varint, LSB 0 = run of (header >> 1)
    # repeats of a ceil(width / 8)-byte value, LSB 1 = (header >> 1) groups of 8 bit-packed values, LSB first.
    run = bytes([5 << 1, 3])  # five 3s
    packed = bytes([(1 << 1) | 1, 0b10001000, 0b11000110, 0b11111010])  # 0..7 at width 3, spec's example
    assert hybrid(memoryview(run + packed), 3, 12) == [3] * 5 + [0, 1, 2, 3, 4, 5, 6]
    assert hybrid(memoryview(bytes([(1 << 1) | 1, 0b00000101])), 1, 3) == [1, 0, 1]
    with pytest.raises(Unsupported):
        hybrid(memoryview(bytes([(2 << 1) | 1, 0xFF])), 1, 16)  # two groups announced, one byte given
    with pytest.raises(Unsupported):
        hybrid(memoryview(bytes([2 << 1])), 1, 2)  # a run whose value byte is missing (it used to read as 0)
    with pytest.raises(Unsupported):
        hybrid(memoryview(bytes([0, 1])), 1, 2)  # a run of no values: would never end


@pytest.mark.parametrize("compression", ["none", "snappy"])
def test_a_worker_sends_each_row_as_one_shared_buffer(tmp_path, compression):
    """In a DataLoader worker a row's tensors are read into one shared-memory buffer: the main process receives one
    segment per row (not one per tensor) and the same values as a main-process read."""
    rows = rows_of_every_dtype()
    path = tmp_path / "f.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=tensor_schema({"id": pa.string()}, list(TENSOR_DTYPES))), path,
                   row_group_size=2, compression=compression)
    ds = TensorParquetDataset(tmp_path)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    for i, row in enumerate(loader):
        tensors = [t for t in row.values() if isinstance(t, torch.Tensor) and t.numel()]
        if tensors:  # row 2 holds empty tensors only
            assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1, i
            assert tensors[0].untyped_storage().is_shared()
        expected = ds[i]
        assert all(encode_tensor(row[k]) == encode_tensor(v) for k, v in expected.items()
                   if isinstance(v, torch.Tensor)), i
    # The same layout on demand in the main process; never otherwise.
    assert ds[0]["float32"].untyped_storage().is_shared() is False
    shared = TensorParquetDataset(tmp_path, shared_memory=True)[0]
    assert len({t.untyped_storage().data_ptr() for t in shared.values() if isinstance(t, torch.Tensor)}) == 1
    assert shared["float32"].untyped_storage().is_shared()


@pytest.mark.parametrize("seed", range(4))
def test_damaged_bytes_anywhere_in_a_chunk_read_as_pyarrow_reads_them(tmp_path, seed):
    """One to three bytes of ``_bytes`` chunks (page headers, levels, lengths, indices or data) overwritten at random,
    in files written with random codecs, page versions, encodings, page and group sizes, and nulls: a row pyarrow
    reads, the page reader reads the same; a row pyarrow refuses, the page reader refuses too, naming the file, or
    reads exactly as written (damage in a header field ff does not need, which pyarrow's strict Thrift decoder
    refuses). Never a different value. (This fuzzing found three faults, all fixed: a codec's error escaping as an
    OSError instead of falling back to pyarrow; a damaged uncompressed size accepted, which pyarrow.decompress pads
    with zeros; an RLE run whose value lay past its data read as 0.)"""
    rng = random.Random(seed)
    schema = tensor_schema({"id": pa.string()}, ["x", "y"])
    outcomes = Counter()
    for trial in range(40):
        rows = [{"id": str(i), **encode_tensor(torch.arange(6 + i % 3, dtype=torch.float32) * (i + 1), "x"),
                 **encode_tensor(torch.arange(4, dtype=torch.int16) + i, "y")} for i in range(6)]
        if rng.random() < 0.3:
            rows[rng.randrange(6)]["x_bytes"] = None
        if rng.random() < 0.3:
            rows[rng.randrange(6)] = {**rows[0], "id": "again"}  # a repeated value: a dictionary hit
        options = dict(compression=rng.choice(["none", "snappy", "gzip", "zstd"]), use_dictionary=rng.random() < 0.5,
                       data_page_version=rng.choice(["1.0", "2.0"]), row_group_size=rng.choice([1, 2, 4, 6]))
        if rng.random() < 0.3:
            options.update(data_page_size=rng.choice([16, 64]), write_batch_size=1)
        root = tmp_path / str(trial)
        root.mkdir()
        path = root / "f.parquet"
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, **options)
        meta = pq.ParquetFile(path).metadata
        data = bytearray(path.read_bytes())
        for _ in range(rng.choice([1, 1, 2, 3])):
            chunk = meta.row_group(rng.randrange(meta.num_row_groups)).column(rng.choice([1, 4]))  # x or y _bytes
            start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
            data[start + rng.randrange(chunk.total_compressed_size)] = rng.randrange(256)
        path.write_bytes(bytes(data))
        direct, arrow = both(root)
        for i, row in enumerate(rows):
            a, b = read(direct, i), read(arrow, i)
            if not isinstance(b, str):
                assert not isinstance(a, str) and a.keys() == b.keys(), (trial, i, options, a)
                assert all(encode_tensor(v) == encode_tensor(a[k]) for k, v in b.items()
                           if isinstance(v, torch.Tensor)), (trial, i, options)
                outcomes["read"] += 1
            elif isinstance(a, str):
                assert a.startswith(f"error: {path}: "), (trial, i, a)
                outcomes["error"] += 1
            else:
                for name in ("x", "y"):
                    assert encode_tensor(a[name]) == {k[2:]: v for k, v in row.items() if k.startswith(name + "_")}, \
                        (trial, i, options)
                outcomes["pyarrow only refused"] += 1
    assert outcomes["error"] and outcomes["read"]  # both kinds of damage were met


def _write_files(root, rows: list[dict], per_file: int, per_group: int, **options) -> list:
    schema = tensor_schema({"id": pa.string()}, list(TENSOR_DTYPES))
    paths = []
    for k in range(0, len(rows), per_file):
        path = root / "part" / f"f{k // per_file}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows[k: k + per_file], schema=schema), path, row_group_size=per_group,
                       **options)
        paths.append(path)
    return paths


@pytest.mark.parametrize("per_group, options", [(1, "plain"), (1, "v2-plain"), (2, "dictionary-snappy")])
def test_per_file_caches_serve_the_same_rows_as_pyarrow_and_stay_bounded(tmp_path, monkeypatch, per_group, options):
    """Several epochs in shuffled orders over three files: the per-file small-column cache (here bounded to 6 rows,
    so files are evicted and decoded again) and the per-handle page locations give pyarrow's rows every time; an
    epoch after the first parses no page header of an uncompressed chunk. (Row catalogues off: they replace both
    caches for uncompressed files, ``test_tensor_parquet_catalogue.py``.)"""
    rows = rows_of_every_dtype(nulls=True)  # 9 rows: 3 files of 3 rows
    _write_files(tmp_path, rows, 3, per_group, **WRITE_OPTIONS[options])
    direct, arrow = TensorParquetDataset(tmp_path, catalogue=False), TensorParquetDataset(tmp_path, direct=False)
    direct.small_rows = 6
    parsed = Counter()
    original = reader.chunk_values
    monkeypatch.setattr(reader, "chunk_values",
                        lambda *a: parsed.update([(id(a[0]), a[1].data_page_offset)]) or original(*a))
    for epoch in range(3):
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(epoch)).tolist()
        for i in order:
            assert_same_rows_at(direct, arrow, rows, i)
        assert sum(direct._small_counts.values()) <= direct.small_rows and len(direct._small_files) <= 2
        if epoch == 0:
            first = sum(parsed.values())
    assert direct._small_files  # the cache was used
    compressed = options == "dictionary-snappy"
    # Values in a decompressed page are not kept (that would keep the page): such chunks are parsed again.
    assert (sum(parsed.values()) > first) if compressed else (sum(parsed.values()) == first == len(parsed))
    assert direct.chunk_reads["pyarrow"] == 0


def assert_same_rows_at(direct: TensorParquetDataset, arrow: TensorParquetDataset, rows: list[dict], i: int) -> None:
    a, b = read(direct, i), read(arrow, i)
    if isinstance(b, str) or isinstance(a, str):
        assert a == b, i
        return
    assert a.keys() == b.keys() and all(
        encode_tensor(a[k]) == encode_tensor(v) if isinstance(v, torch.Tensor) else a[k] == v for k, v in b.items())


def test_a_small_column_pyarrow_cannot_decode_is_named_by_its_row_group(tmp_path):
    """Damage in one row group's small column: the whole-file decode fails, the reader falls back to reading group
    by group, so the other rows still read and the damaged group's error is pyarrow's, as with ``direct=False``."""
    rows = [{"id": f"row{i}", **encode_tensor(torch.arange(6, dtype=torch.float32) + i, "x")} for i in range(4)]
    path = tmp_path / "f.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=tensor_schema({"id": pa.string()}, ["x"])), path,
                   row_group_size=1, use_dictionary=False, compression="none")
    chunk = pq.ParquetFile(path).metadata.row_group(2).column(0)  # row 2's id
    assert chunk.path_in_schema == "id"
    data = bytearray(path.read_bytes())
    data[chunk.data_page_offset: chunk.data_page_offset + chunk.total_compressed_size] = b"\xff" * (
        chunk.total_compressed_size)
    path.write_bytes(bytes(data))
    direct, arrow = both(tmp_path)
    for i in (0, 1, 3, 2):  # row 1 is the file's second group read: the whole-file decode is tried there
        assert_same_rows_at(direct, arrow, rows, i)
    assert [direct[i]["id"] for i in (0, 1, 3)] == ["row0", "row1", "row3"]
    assert read(direct, 2).startswith(f"error: {path}: row group 2: cannot be read: ")
    assert direct._handles[0].small_failed and not direct._small_files
