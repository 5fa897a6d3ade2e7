"""TensorParquetWriter: file layout, one row per row group, the trailing partial chunk, compression, atomicity,
refusing to overwrite, and clear errors for rows that do not fit the schema."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ff_core.data.tensor_parquet import TensorParquetDataset, TensorParquetWriter, reader, tensor_schema
from ff_core.data.tensor_parquet.catalogue import CATALOGUE_DIR

SCHEMA = tensor_schema({"id": pa.string(), "n": pa.int64()}, ["x"])


def rows(n: int) -> list[dict]:
    return [{"id": f"r{i}", "n": i, "x": torch.arange(i + 1, dtype=torch.float32)} for i in range(n)]


def test_files_groups_and_trailing_chunk(tmp_path):
    with TensorParquetWriter(tmp_path / "out", SCHEMA, rows_per_file=3, worker=2) as w:
        for row in rows(7):
            w.write(row)
    folder = tmp_path / "out" / "worker_2"
    assert w.paths == [folder / f"data_chunk_{i}.parquet" for i in range(3)]
    assert sorted(p.name for p in folder.iterdir()) == [CATALOGUE_DIR] + [f"data_chunk_{i}.parquet" for i in range(3)]
    assert sorted(p.name for p in (folder / CATALOGUE_DIR).iterdir()) == [f"{p.name}.arrow" for p in w.paths]  # no temp
    metas = [pq.read_metadata(p) for p in w.paths]
    assert [(m.num_rows, m.num_row_groups) for m in metas] == [(3, 3), (3, 3), (1, 1)]
    assert pq.read_schema(w.paths[0]).equals(SCHEMA)
    assert [r["n"] for r in pq.read_table(folder).to_pylist()] == list(range(7))


def test_readers_find_the_catalogues_the_writer_wrote(tmp_path, monkeypatch):
    """Each published file's row catalogue is written beside it: a dataset opened at any root above it locates its
    rows from the first read on, decoding no small column and parsing no page header."""
    with TensorParquetWriter(tmp_path / "shard000" / "combined", SCHEMA, rows_per_file=3) as w:
        for row in rows(7):
            w.write(row)
    monkeypatch.setattr(reader, "chunk_values", None)  # any page header parsed, or small column decoded, fails
    monkeypatch.setattr(reader._Mapped, "read_all", None)
    monkeypatch.setattr(reader._Mapped, "read_row_group", None)
    for root in (tmp_path, tmp_path / "shard000" / "combined" / "worker_0"):
        ds = TensorParquetDataset(root)
        got = [ds[i] for i in range(7)]
        assert [r["n"] for r in got] == list(range(7)) and ds.catalogue_loads == 3 and not ds.catalogue_builds
        assert all(torch.equal(r["x"], torch.arange(i + 1, dtype=torch.float32)) for i, r in enumerate(got))


def test_compression_round_trip(tmp_path):
    with TensorParquetWriter(tmp_path, SCHEMA, compression="zstd") as w:
        for row in rows(3):
            w.write(row)
    assert pq.read_metadata(w.paths[0]).row_group(0).column(2).compression == "ZSTD"
    ds = TensorParquetDataset(tmp_path)
    assert torch.equal(ds[2]["x"], torch.arange(3, dtype=torch.float32))


def test_a_failure_publishes_nothing_partial(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with TensorParquetWriter(tmp_path, SCHEMA, rows_per_file=2) as w:
            for row in rows(3):
                w.write(row)
            raise RuntimeError("boom")
    # The complete first file stays; the half-written second one is dropped, temporaries included.
    assert sorted(p.name for p in (tmp_path / "worker_0").iterdir()) == [CATALOGUE_DIR, "data_chunk_0.parquet"]
    assert [p.name for p in (tmp_path / "worker_0" / CATALOGUE_DIR).iterdir()] == ["data_chunk_0.parquet.arrow"]


def test_refuses_to_overwrite(tmp_path):
    with TensorParquetWriter(tmp_path, SCHEMA) as w:
        w.write(rows(1)[0])
    before = w.paths[0].read_bytes()
    with pytest.raises(FileExistsError, match="worker_0/data_chunk_0.parquet: already exists"):
        TensorParquetWriter(tmp_path, SCHEMA)
    TensorParquetWriter(tmp_path, SCHEMA, worker=1).close()  # another worker folder is fine
    assert w.paths[0].read_bytes() == before


def test_rows_that_do_not_fit(tmp_path):
    w = TensorParquetWriter(tmp_path, SCHEMA)
    with pytest.raises(ValueError, match=r"row 0: columns missing \['n'\]"):
        w.write({"id": "a", "x": torch.ones(1)})
    with pytest.raises(ValueError, match=r"row 0: columns not in the schema: \['y'\]"):
        w.write({"id": "a", "n": 1, "x": torch.ones(1), "y": 2})
    with pytest.raises(ValueError, match="row 0: "):
        w.write({"id": "a", "n": "not an int", "x": torch.ones(1)})
    w.abort()
    with pytest.raises(ValueError, match="schema: y_shape: tensor 'y' has y_bytes but no y_shape column"):
        TensorParquetWriter(tmp_path, pa.schema([pa.field("y_bytes", pa.binary()), pa.field("y_dtype", pa.string())]))


def test_a_chunk_that_appears_meanwhile_is_not_replaced(tmp_path):
    w = TensorParquetWriter(tmp_path, SCHEMA, rows_per_file=1)
    (tmp_path / "worker_0").mkdir()
    (tmp_path / "worker_0" / "data_chunk_0.parquet").write_bytes(b"someone else's")
    with pytest.raises(FileExistsError, match="data_chunk_0.parquet: appeared while writing; not replaced"):
        w.write(rows(1)[0])
    assert (tmp_path / "worker_0" / "data_chunk_0.parquet").read_bytes() == b"someone else's"
