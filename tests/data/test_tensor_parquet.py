"""TensorParquetDataset / Writer: round trips of every dtype and variable shapes, the card's layout and 33-column
schema, corrupt triplets, the footer index and its cache, row-group-only reads, workers, and the two-level order.

The reference decoder is the card's own loading recipe (``pq.read_table`` + ``torch.frombuffer(bytearray(...))``).
"""

from __future__ import annotations

import os
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tensor_parquet_helpers import TRACK_SHAPES, card_decode, track_row, write_card_layout, write_reference_layout

from ff_core.data.tensor_parquet import (
    I2V_SCHEMA,
    I2V_TRACK_SCHEMA,
    T2V_SCHEMA,
    TENSOR_DTYPES,
    TensorParquetDataset,
    TensorParquetWriter,
    encode_tensor,
    reader,
    tensor_schema,
    two_level_order,
)
from ff_core.data.tensor_parquet.catalogue import CATALOGUE_DIR
from ff_core.data.tensor_parquet.inspect import inspect_tensor_parquet
from ff_core.errors import DatasetError

ID = {"id": pa.string()}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe), dtype and shape included."""
    return a.dtype == b.dtype and a.shape == b.shape and encode_tensor(a) == encode_tensor(b)


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 1e3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def test_schemas_match_the_card():
    assert len(I2V_TRACK_SCHEMA) == 33
    scalars = ["id", "file_name", "caption", "media_type", "width", "height", "num_frames", "duration_sec", "fps"]
    tensors = ["vae_latent", "text_embedding", "clip_feature", "first_frame_latent", "track_points",
               "track_visibility", "object_ids", "track_weights"]
    assert sorted(I2V_TRACK_SCHEMA.names) == sorted(scalars + [t + s for t in tensors for s in
                                                               ("_bytes", "_shape", "_dtype")])
    assert I2V_TRACK_SCHEMA.field("vae_latent_shape").type == pa.list_(pa.int64())
    assert set(T2V_SCHEMA.names) < set(I2V_SCHEMA.names) < set(I2V_TRACK_SCHEMA.names)


def test_encode_tensor_is_the_raw_buffer():
    t = torch.tensor([[1.0, -2.0]], dtype=torch.bfloat16)
    enc = encode_tensor(t, "x")
    # bfloat16 1.0 = 0x3F80, -2.0 = 0xC000, little endian.
    assert enc == {"x_bytes": b"\x80\x3f\x00\xc0", "x_shape": [1, 2], "x_dtype": "bfloat16"}
    assert encode_tensor(t)["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="complex64"):
        encode_tensor(torch.zeros(2, dtype=torch.complex64), "x")


@pytest.mark.parametrize("dtype_name", list(TENSOR_DTYPES))
def test_round_trip_every_dtype_and_variable_shapes(tmp_path, dtype_name):
    dtype = TENSOR_DTYPES[dtype_name]
    shapes = [(3, 4), (1, 4), (0, 4), (), (2, 3, 5), (7,)]  # per-row shapes differ, even in rank; empty and 0-dim
    rows = [sample(dtype, s, i) for i, s in enumerate(shapes)]
    with TensorParquetWriter(tmp_path, tensor_schema(ID, ["x"]), rows_per_file=4) as w:
        for i, t in enumerate(rows):
            w.write({"id": str(i), "x": t})
    ds = TensorParquetDataset(tmp_path)
    assert len(ds) == len(rows)
    reference = [r for f in ds.files for r in pq.read_table(f).to_pylist()]  # the card's recipe
    for i, t in enumerate(rows):
        got = ds[i]["x"]
        assert same(got, t), (i, got, t)
        if t.numel():  # the card's recipe cannot decode an empty tensor (torch.frombuffer refuses 0 bytes)
            assert same(got, card_decode(reference[i], "x"))
        assert ds.shapes(i) == {"x": tuple(t.shape)}


def test_card_layout_track_schema(tmp_path):
    rows = write_card_layout(tmp_path, [5, 4])  # shard000 (5 rows), shard001 (4 rows), 2 workers, 3 rows a file
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.parquet"))
    assert files[0] == "shard000/combined_parquet_dataset/worker_0/data_chunk_0.parquet"
    assert "shard001/combined_parquet_dataset/worker_1/data_chunk_0.parquet" in files
    ds = TensorParquetDataset(tmp_path, schema=I2V_TRACK_SCHEMA)
    assert len(ds) == 9 and len(ds.files) == 4
    assert set(ds.tensor_names) == {*TRACK_SHAPES, "text_embedding"} and len(ds.scalar_names) == 9
    for i, expected in enumerate(rows):
        got = ds[i]
        for name, value in expected.items():
            assert same(got[name], value) if isinstance(value, torch.Tensor) else got[name] == value, (i, name)
    assert ds[0]["vae_latent"].dtype == torch.bfloat16 and ds[0]["object_ids"].dtype == torch.float32
    assert [ds.shapes(i)["text_embedding"] for i in range(4)] == [tuple(r["text_embedding"].shape) for r in rows[:4]]
    assert ds.all_shapes() == [{n: tuple(v.shape) for n, v in r.items() if isinstance(v, torch.Tensor)} for r in rows]
    # Every file is one row per row group.
    assert all(pq.ParquetFile(f).metadata.num_row_groups == pq.ParquetFile(f).metadata.num_rows for f in ds.files)


def test_columns_read_only_those(tmp_path):
    write_card_layout(tmp_path, [4])
    ds = TensorParquetDataset(tmp_path, columns=["vae_latent", "caption"])
    assert ds.tensor_names == ("vae_latent",) and ds.scalar_names == ("caption",)
    assert set(ds[1]) == {"vae_latent", "caption"}
    assert set(ds.shapes(1)) == {"vae_latent"}
    with pytest.raises(DatasetError, match=r"columns: unknown column 'vae_latents'; did you mean 'vae_latent'\?"):
        TensorParquetDataset(tmp_path, columns=["vae_latents"])


def test_schema_validation_names_the_missing_column(tmp_path):
    with TensorParquetWriter(tmp_path, T2V_SCHEMA) as w:
        w.write({n: v for n, v in track_row(0).items() if n in {f.name for f in T2V_SCHEMA} | {"vae_latent",
                                                                                             "text_embedding"}})
    TensorParquetDataset(tmp_path, schema=T2V_SCHEMA)
    with pytest.raises(DatasetError) as err:
        TensorParquetDataset(tmp_path, schema=I2V_SCHEMA)
    assert "data_chunk_0.parquet: clip_feature_bytes: missing column (expected binary)" in str(err.value)


def _one_file(tmp_path, rows: list[dict], schema: pa.Schema | None = None, per_group: int = 1):
    table = pa.Table.from_pylist(rows, schema=schema)
    return write_reference_layout(tmp_path / "part" / "f.parquet", table, per_group)


@pytest.mark.parametrize("corrupt, column, reason", [
    ({"x_bytes": b"\x00" * 6}, "x_bytes", "6 bytes, expected prod([2]) x 4 (float32) = 8"),
    ({"x_dtype": "bf16"}, "x_dtype", "unknown dtype 'bf16'"),
    ({"x_shape": None}, "x_shape", "null value"),
    ({"x_bytes": None}, "x_bytes", "null value"),
    ({"x_shape": [2, -1]}, "x_shape", "shape [2, -1] is not a list of non-negative integers"),
    ({"x_dtype": ""}, "x_dtype", "unknown dtype ''"),  # an empty dtype with bytes is no placeholder
])
def test_corrupt_rows_name_file_row_and_column(tmp_path, corrupt, column, reason):
    good = {"id": "a", **encode_tensor(torch.ones(2), "x")}
    path = _one_file(tmp_path, [good, good, {**good, **corrupt}], tensor_schema(ID, ["x"]))
    ds = TensorParquetDataset(tmp_path)
    assert same(ds[1]["x"], torch.ones(2))  # the corrupt row does not spoil its neighbours
    with pytest.raises(DatasetError) as err:
        ds[2]
    assert str(err.value).startswith(f"{path}: {column}: row 2 (row group 2, dataset row 2): ")
    assert reason in str(err.value)


@pytest.mark.parametrize("spelling", ["torch.bfloat16", "bfloat16"])
def test_dtype_spellings_of_other_writers(tmp_path, spelling):
    """``str(tensor.dtype)`` writes ``torch.bfloat16``; torch's aliases (``half``) name dtypes too: all decode alike."""
    t = sample(torch.bfloat16, (3, 2), 0)
    half = sample(torch.float16, (4,), 1)
    row = {"id": "a", **encode_tensor(t, "x"), "x_dtype": spelling, **encode_tensor(half, "h"), "h_dtype": "half"}
    _one_file(tmp_path, [row], tensor_schema(ID, ["x", "h"]))
    got = TensorParquetDataset(tmp_path)[0]
    assert same(got["x"], t) and same(got["h"], half)
    report, problems = inspect_tensor_parquet(tmp_path, check_bytes=True)
    assert problems == []


def test_the_absent_tensor_placeholder_reads_as_none(tmp_path):
    """Some preprocessing scripts write ``(b"", [], "")`` for a tensor they lack: a read gives ``None``, inspect counts
    it, and neither is an error (training refuses it where it needs the tensor: tests/data/test_tensor_rows.py)."""
    good = {"id": "a", **encode_tensor(torch.ones(2), "x")}
    empty = {"id": "b", "x_bytes": b"", "x_shape": [], "x_dtype": ""}
    _one_file(tmp_path, [good, empty, good], tensor_schema(ID, ["x"]))
    ds = TensorParquetDataset(tmp_path)
    assert ds[1]["x"] is None and same(ds[2]["x"], torch.ones(2))
    report, problems = inspect_tensor_parquet(tmp_path, check_bytes=True)
    assert problems == [] and report.tensors["x"].empty == 1
    assert any("tensor x: float32 [2] (empty in 1 rows)" in line for line in report.format())


def test_missing_triplet_column_is_a_schema_error(tmp_path):
    path = _one_file(tmp_path, [{"id": "a", "x_bytes": b"\x00" * 8, "x_dtype": "float32"}])
    with pytest.raises(DatasetError) as err:
        TensorParquetDataset(tmp_path)
    assert str(err.value) == f"{path}: x_shape: tensor 'x' has x_bytes but no x_shape column"
    _one_file(tmp_path, [{"id": "a", "x_shape": [2], "x_dtype": "float32"}])
    with pytest.raises(DatasetError, match="x_bytes: tensor 'x' has x_shape but no x_bytes column"):
        TensorParquetDataset(tmp_path)


def test_files_must_share_the_first_files_columns(tmp_path):
    write_card_layout(tmp_path, [2], workers=1)
    odd = tmp_path / "shard001" / "f.parquet"
    odd.parent.mkdir()
    _one_file(tmp_path, [{"id": "a", **encode_tensor(torch.ones(2), "vae_latent")}])
    os.replace(tmp_path / "part" / "f.parquet", odd)
    with pytest.raises(DatasetError) as err:
        TensorParquetDataset(tmp_path)
    assert f"{odd}: caption: missing column (expected string), as in shard000/" in str(err.value)


def test_empty_or_missing_root(tmp_path):
    with pytest.raises(DatasetError, match="no \\*.parquet file below it"):
        TensorParquetDataset(tmp_path)
    with pytest.raises(DatasetError, match="not a directory"):
        TensorParquetDataset(tmp_path / "nope")


def test_reference_layout_several_rows_per_group(tmp_path):
    rows = [{"id": str(i), **encode_tensor(sample(torch.float16, (i + 1, 3), i), "x")} for i in range(10)]
    _one_file(tmp_path, rows, tensor_schema(ID, ["x"]), per_group=4)
    ds = TensorParquetDataset(tmp_path, cached_groups=1)
    assert ds.group_bounds.tolist() == [0, 4, 8, 10]
    assert ds.locate(5)[1:] == (1, 1)
    for i in (9, 0, 5, 4):
        assert same(ds[i]["x"], card_decode(rows[i], "x"))


class Spy:
    """Records every ``ParquetFile.read_row_group(group, columns)`` call (pyarrow's, not ff's code), and in
    ``file_reads`` the columns of every ``ParquetFile.read_row_groups`` (the reader's whole-file reads)."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[int, tuple[str, ...]]] = []
        self.file_reads: list[tuple[str, ...]] = []
        original, original_read = pq.ParquetFile.read_row_group, pq.ParquetFile.read_row_groups

        def spy(pf, i, columns=None, **kw):
            self.calls.append((i, tuple(columns)))
            return original(pf, i, columns=columns, **kw)

        def spy_read(pf, groups, columns=None, **kw):
            self.file_reads.append(tuple(columns))
            return original_read(pf, groups, columns=columns, **kw)

        monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
        monkeypatch.setattr(pq.ParquetFile, "read_row_groups", spy_read)


def test_a_read_touches_one_row_group_and_the_requested_columns(tmp_path, monkeypatch):
    write_card_layout(tmp_path, [6], workers=1, rows_per_file=6)
    ds = TensorParquetDataset(tmp_path, columns=["id", "text_embedding"], catalogue=False)  # (with: nothing decoded)
    spy = Spy(monkeypatch)
    direct = []  # the _bytes chunks read from their pages: (file offset of the chunk, column)
    original = reader.chunk_values
    monkeypatch.setattr(reader, "chunk_values", lambda file, chunk, *a: direct.append(
        (chunk.data_page_offset, chunk.path_in_schema)) or original(file, chunk, *a))
    ds[4]
    assert spy.calls == [(4, ("id", "text_embedding_shape", "text_embedding_dtype"))]
    group = pq.ParquetFile(ds.files[0]).metadata.row_group(4)
    chunk = next(group.column(c) for c in range(group.num_columns)
                 if group.column(c).path_in_schema == "text_embedding_bytes")
    assert direct == [(chunk.data_page_offset, "text_embedding_bytes")]
    spy.calls.clear()
    ds.shapes(3)
    assert spy.calls == [(3, ("text_embedding_shape",))]  # no _bytes column is read for shapes


def test_shapes_never_read_bytes(tmp_path):
    # Every row's bytes are wrong, yet shapes (for the packing batchers) read fine: they come from _shape only.
    rows = [{"id": str(i), "x_bytes": b"", "x_shape": [i, 2], "x_dtype": "float32"} for i in range(1, 4)]
    _one_file(tmp_path, rows, tensor_schema(ID, ["x"]))
    ds = TensorParquetDataset(tmp_path)
    assert [ds.shapes(i)["x"] for i in range(3)] == [(1, 2), (2, 2), (3, 2)]
    assert ds.all_shapes() == [ds.shapes(i) for i in range(3)]
    with pytest.raises(DatasetError, match="x_bytes: row 0 .*0 bytes, expected"):
        ds[0]


def test_decoded_groups_are_reused(tmp_path, monkeypatch):
    rows = [{"id": str(i), **encode_tensor(torch.full((2,), float(i)), "x")} for i in range(12)]
    _one_file(tmp_path, rows, tensor_schema(ID, ["x"]), per_group=4)
    ds = TensorParquetDataset(tmp_path, cached_groups=2)
    spy = Spy(monkeypatch)
    order = two_level_order(ds.group_bounds, seed=3, epoch=0, window=2)
    assert [float(ds[int(i)]["x"][0]) for i in order] == [float(i) for i in order]
    # Each group decoded once per epoch: the first alone, the others' small columns with the whole file's (one read
    # on the file's second group), their _bytes from their pages.
    assert [g for g, _ in spy.calls] == [int(order[0]) // 4] and spy.file_reads == [("id", "x_shape", "x_dtype")]


def test_two_level_order():
    bounds = [0, 4, 8, 10, 13, 20]
    a = two_level_order(bounds, seed=1, epoch=0, window=2)
    assert sorted(a.tolist()) == list(range(20))
    assert torch.equal(a, two_level_order(bounds, seed=1, epoch=0, window=2))
    assert not torch.equal(a, two_level_order(bounds, seed=1, epoch=1, window=2))
    group_of = {r: g for g in range(5) for r in range(bounds[g], bounds[g + 1])}
    sizes = [bounds[g + 1] - bounds[g] for g in range(5)]
    # Cut the order into windows: each holds every row of at most two groups, and nothing else.
    k, windows = 0, []
    while k < 20:
        groups, end = set(), k
        while True:
            groups.add(group_of[int(a[end])])
            end += 1
            assert len(groups) <= 2, (k, end, groups)
            if end - k == sum(sizes[g] for g in groups) and (len(groups) == 2 or end == 20):
                break
        windows.append(groups)
        k = end
    assert len(windows) == 3 and sorted(g for w in windows for g in w) == [0, 1, 2, 3, 4]


def test_index_is_cached_and_invalidated(tmp_path):
    write_card_layout(tmp_path, [3], workers=1)
    first = TensorParquetDataset(tmp_path)
    assert not first.index_cached and (tmp_path / ".ff_tensor_parquet_index.json").is_file()
    assert TensorParquetDataset(tmp_path).index_cached
    write_card_layout(tmp_path / "more", [2], workers=1)  # a new file below the root
    again = TensorParquetDataset(tmp_path)
    assert not again.index_cached and len(again) == 5
    f = again.files[0]
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # touched: rebuilt
    assert not TensorParquetDataset(tmp_path).index_cached


def test_index_falls_back_to_the_cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "data"
    write_card_layout(root, [2], workers=1)
    (root / ".ff_tensor_parquet_index.json").mkdir()  # the folder cannot take the index (as if read-only)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    TensorParquetDataset(root)
    assert TensorParquetDataset(root).index_cached
    assert len(list((tmp_path / "xdg" / "ff" / "tensor_parquet").glob("data-*.json"))) == 1
    TensorParquetDataset(root, cache_dir=tmp_path / "c")
    assert len(list((tmp_path / "c").glob("*.json"))) == 1


def test_views_and_copies(tmp_path):
    write_card_layout(tmp_path, [2], workers=1)
    view = TensorParquetDataset(tmp_path)[0]["vae_latent"]
    owned = TensorParquetDataset(tmp_path, copy=True)[0]["vae_latent"]
    assert same(view, owned)
    owned.add_(1)  # a copy is writable without touching the reader's buffers
    assert same(TensorParquetDataset(tmp_path, copy=True)[0]["vae_latent"], view)


def test_pickles_and_serves_dataloader_workers(tmp_path):
    rows = write_card_layout(tmp_path, [4, 3])
    ds = TensorParquetDataset(tmp_path, columns=["id", "vae_latent", "text_embedding"])
    ds[0]  # opened files and caches must not travel
    clone = pickle.loads(pickle.dumps(ds))
    assert clone[3]["id"] == rows[3]["id"]
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, shuffle=False)
    got = list(loader)
    assert [r["id"] for r in got] == [r["id"] for r in rows]
    assert all(same(g["text_embedding"], r["text_embedding"]) for g, r in zip(got, rows))


def test_negative_and_out_of_range_indices(tmp_path):
    rows = write_card_layout(tmp_path, [3], workers=1)
    ds = TensorParquetDataset(tmp_path)
    assert ds[-1]["id"] == rows[-1]["id"]
    with pytest.raises(IndexError, match="row 3 out of range for 3 rows"):
        ds[3]


def _rss_file_kib() -> int:
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    return int(status["RssFile"].split()[0])


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_resident_set_stays_flat(tmp_path):
    # 24 rows of 1 MiB: reading them all must not leave their file pages mapped in this process (they would
    # be 24 MiB of RssFile, growing with the dataset; ff unmaps each row group's pages after decoding it).
    with TensorParquetWriter(tmp_path, tensor_schema(ID, ["x"]), rows_per_file=8) as w:
        for i in range(24):
            w.write({"id": str(i), "x": torch.full((256, 1024), float(i))})
    ds = TensorParquetDataset(tmp_path)
    ds[0]
    before = _rss_file_kib()
    for i in range(24):
        assert float(ds[i]["x"][0, 0]) == i
    assert _rss_file_kib() - before < 4 * 1024


def test_discovery_order_and_hidden_files(tmp_path):
    for n in (10, 2, 1):
        _one_file(tmp_path, [{"id": str(n), **encode_tensor(torch.ones(1), "x")}])
        os.replace(tmp_path / "part" / "f.parquet", tmp_path / "part" / f"data_chunk_{n}.parquet")
    (tmp_path / "part" / ".data_chunk_3.parquet.1234.tmp").write_bytes(b"half a file")  # a writer's temporary
    (tmp_path / "part" / ".data_chunk_4.parquet").write_bytes(b"hidden")
    ds = TensorParquetDataset(tmp_path)
    assert [ds[i]["id"] for i in range(len(ds))] == ["1", "2", "10"]  # natural order, hidden files skipped


def test_a_damaged_index_cache_is_rebuilt(tmp_path):
    write_card_layout(tmp_path, [2], workers=1)
    TensorParquetDataset(tmp_path)
    (tmp_path / ".ff_tensor_parquet_index.json").write_text("{not json")
    ds = TensorParquetDataset(tmp_path)
    assert not ds.index_cached and len(ds) == 2
    assert TensorParquetDataset(tmp_path).index_cached


def test_identity_ignores_mtimes_but_not_content(tmp_path):
    write_card_layout(tmp_path / "a", [3], workers=1)
    first = TensorParquetDataset(tmp_path / "a").identity
    f = next((tmp_path / "a").rglob("*.parquet"))
    os.utime(f, ns=(0, 10 ** 18))  # a copy on another node: same bytes, other mtime
    assert TensorParquetDataset(tmp_path / "a").identity == first
    write_card_layout(tmp_path / "a" / "more", [1], workers=1)
    assert TensorParquetDataset(tmp_path / "a").identity["rows"] == 4


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="cached_groups must be >= 0, got -1"):
        TensorParquetDataset(tmp_path, cached_groups=-1)
    with pytest.raises(ValueError, match="open_files must be >= 1, got 0"):
        TensorParquetDataset(tmp_path, open_files=0)


@pytest.mark.parametrize("catalogue", [False, True])
def test_per_file_caches_follow_a_rewritten_file(tmp_path, catalogue):
    """A file rewritten atomically (ff's writer replaces a chunk by renaming a new file over it): a dataset opened
    after it reads the new rows (new index, new caches); one opened before keeps reading the old file it mapped,
    small columns and tensors alike, never a mix, whether its caches were filled before the rename or after (the
    new file has the old one's exact layout, so a read by path with the old footer would not fail: it would mix).
    With row catalogues the new file is given the old one's size and modification time too (a rewrite within the
    file system's clock tick): only the footer tells them apart, and the old file's stored catalogue is not used."""
    def write(k: int) -> None:
        with TensorParquetWriter(tmp_path, tensor_schema(ID, ["x"]), rows_per_file=4, catalogue=False) as writer:
            for i in range(4):  # (catalogues: built by the readers here)
                writer.write({"id": f"v{k}-{i}", "x": torch.full((2,), float(10 * k + i))})  # same layout

    write(0)
    old, cached = (TensorParquetDataset(tmp_path, catalogue=catalogue) for _ in range(2))
    assert old[0]["id"] == "v0-0"  # the file opened; its small columns not decoded whole yet
    assert [cached[i]["id"] for i in range(4)] == [f"v0-{i}" for i in range(4)]
    assert cached._small_files and len(cached._handles[0].locations) == 4  # every cache filled
    assert cached.catalogue_builds == catalogue and len(list(tmp_path.glob(f"*/{CATALOGUE_DIR}/*"))) == catalogue
    before = old.files[0].stat()
    old.files[0].unlink()
    write(1)
    assert old.files[0].stat().st_size == before.st_size
    if catalogue:
        os.utime(old.files[0], ns=(before.st_atime_ns, before.st_mtime_ns))
    new = TensorParquetDataset(tmp_path, catalogue=catalogue)
    assert new.index_cached == catalogue  # same sizes and times: the row index cannot tell (nor needs to: same groups)
    for i in range(4):
        assert new[i]["id"] == f"v1-{i}" and torch.equal(new[i]["x"], torch.full((2,), float(10 + i)))
        for ds in (old, cached):  # old decodes the whole file's small columns now: from the file it opened
            assert ds[i]["id"] == f"v0-{i}" and torch.equal(ds[i]["x"], torch.full((2,), float(i)))
