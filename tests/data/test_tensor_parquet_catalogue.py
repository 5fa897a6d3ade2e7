"""Row catalogues (``ff_core.data.tensor_parquet.catalogue``): a file's small columns and ``_bytes`` places, built by
one reader and used by the next process instead of decoding and parsing the file again.

Rows served from a catalogue are compared with pyarrow's decoding of the same files (``direct=False``), errors
included; a stale, damaged or foreign catalogue must never be used.
"""

from __future__ import annotations

import os
import random
import shutil
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_tensor_parquet_pages import WRITE_OPTIONS, _write_files, assert_same_rows, read, rows_of_every_dtype

from ff_core.data.tensor_parquet import TensorParquetDataset, TensorParquetWriter, encode_tensor, reader, tensor_schema
from ff_core.data.tensor_parquet.catalogue import CATALOGUE_DIR, Catalogue, catalogue_paths, fingerprint


def rows_with_a_bad_shape() -> list[dict]:
    """Every dtype, nulls, the empty placeholder, and a row whose ``_shape`` does not match its bytes."""
    rows = rows_of_every_dtype(nulls=True)
    rows[4]["int16_shape"] = [999]
    return rows


def counting(monkeypatch) -> Counter:
    """Counts what a row read decodes or parses: page headers (``chunk_values``) and pyarrow reads of a file."""
    seen: Counter = Counter()
    for name in ("chunk_values",):
        original = getattr(reader, name)
        monkeypatch.setattr(reader, name, lambda *a, _o=original, _n=name: seen.update([_n]) or _o(*a))
    for name in ("read_all", "read_row_group"):
        original = getattr(reader._Mapped, name)
        monkeypatch.setattr(reader._Mapped, name,
                            lambda self, *a, _o=original, _n=name: seen.update([_n]) or _o(self, *a))
    return seen


@pytest.mark.parametrize("per_group, options", [(1, "plain"), (1, "v2-plain"), (2, "plain"), (2, "small-pages-v2")])
def test_a_new_dataset_reads_every_row_from_the_stored_catalogues(tmp_path, monkeypatch, per_group, options):
    rows = rows_with_a_bad_shape()  # 9 rows: 3 files of 3
    _write_files(tmp_path, rows, 3, per_group, **WRITE_OPTIONS[options])
    assert_same_rows(TensorParquetDataset(tmp_path), TensorParquetDataset(tmp_path, direct=False), rows)  # builds
    assert len(list((tmp_path / "part" / CATALOGUE_DIR).iterdir())) == 3
    for columns in (None, ["id", "int16", "float32", "bfloat16"]):
        fresh = TensorParquetDataset(tmp_path, columns=columns)
        order = list(range(len(rows)))
        random.Random(len(order)).shuffle(order)
        seen = counting(monkeypatch)
        got = {i: read(fresh, i) for i in order}
        assert not seen  # no header parsed, no small column decoded, nothing read by pyarrow
        monkeypatch.undo()
        assert fresh.catalogue_loads == 3 and not fresh.catalogue_builds
        expected = TensorParquetDataset(tmp_path, columns=columns, direct=False)
        for i in order:
            a, b = got[i], read(expected, i)
            if isinstance(b, str):  # the null values and the bad shape: the same message
                assert a == b, i
                continue
            assert a.keys() == b.keys()
            for name, value in b.items():
                assert (torch.equal(a[name], value) and a[name].dtype == value.dtype) if isinstance(
                    value, torch.Tensor) else a[name] == value, (i, name)


def test_file_ranges_from_a_catalogue_read_the_stored_tensors(tmp_path):
    rows = rows_of_every_dtype()
    _write_files(tmp_path, rows, 9, 1, **WRITE_OPTIONS["plain"])
    builder = TensorParquetDataset(tmp_path)
    for i in range(2):
        builder[i]  # built on the second read
    fresh, arrow = TensorParquetDataset(tmp_path), TensorParquetDataset(tmp_path, direct=False)
    for i in range(len(rows)):
        described, expected = fresh.describe(i), arrow[i]
        for name, value in expected.items():
            if isinstance(value, torch.Tensor) and value.numel():
                assert torch.equal(described[name].materialize(), value), (i, name)
    assert fresh.catalogue_loads == 1 and builder.catalogue_builds == 1


def test_stale_damaged_or_foreign_catalogues_are_never_used(tmp_path):
    rows = rows_of_every_dtype()
    paths = _write_files(tmp_path, rows, 3, 1, **WRITE_OPTIONS["plain"])
    assert_same_rows(TensorParquetDataset(tmp_path), TensorParquetDataset(tmp_path, direct=False), rows)
    where = [catalogue_paths(path)[0] for path in paths]
    # Stale (its file rewritten in place), foreign (another file's, of the same row count), damaged (truncated).
    rows = [{**r, "id": r["id"] + "!"} for r in rows[:3]] + rows[3:]
    _write_files(tmp_path, rows[:3], 3, 1, **WRITE_OPTIONS["plain"])
    shutil.copy(where[2], where[1])
    where[2].write_bytes(where[2].read_bytes()[:100])
    fresh = TensorParquetDataset(tmp_path)
    assert_same_rows(fresh, TensorParquetDataset(tmp_path, direct=False), rows)
    for k, path in enumerate(paths):  # each built again, for the file as it is
        with open(path, "rb") as f:
            key = fingerprint(f.fileno())
        found = Catalogue.from_ipc(where[k], key, 3, fresh._catalogued_small, fresh._catalogued_tensors)
        assert found is not None and found.small["id"] == [r["id"] for r in rows[3 * k: 3 * k + 3]]
        assert Catalogue.from_ipc(where[k], key, 4, fresh._catalogued_small, fresh._catalogued_tensors) is None


def test_catalogues_go_to_cache_dir_and_compressed_files_get_none(tmp_path):
    rows = rows_of_every_dtype()
    _write_files(tmp_path / "plain", rows, 9, 1, **WRITE_OPTIONS["plain"])
    _write_files(tmp_path / "snappy", rows, 9, 1, **WRITE_OPTIONS["dictionary-snappy"])
    for name in ("plain", "snappy"):
        ds = TensorParquetDataset(tmp_path / name, cache_dir=tmp_path / "cache")
        for i in range(len(rows)):
            ds[i]
        assert not (tmp_path / name / "part" / CATALOGUE_DIR).exists()
    stored = list((tmp_path / "cache").rglob("*.arrow"))
    assert stored == [catalogue_paths(tmp_path / "plain" / "part" / "f0.parquet", tmp_path / "cache", writing=True)[0]]
    again = TensorParquetDataset(tmp_path / "plain", cache_dir=tmp_path / "cache")
    assert again[3]["id"] == "3" and again.catalogue_loads == 1
    assert TensorParquetDataset(tmp_path / "plain", catalogue=False)[3]["id"] == "3"


def test_a_catalogue_round_trips_nulls_and_rejects_places_outside_the_file(tmp_path):
    table = pa.table({"id": ["a", "b"], "x_shape": [[2], None], "x_dtype": ["int8", None]})
    good = Catalogue({c: table.column(c).to_pylist() for c in table.column_names}, {"x": [(4, 2), None]})
    (tmp_path / "c.arrow").write_bytes(good.to_ipc(table, "100 5 abc"))
    back = Catalogue.from_ipc(tmp_path / "c.arrow", "100 5 abc", 2, ["id", "x_shape", "x_dtype"], ["x"])
    assert back == good
    assert Catalogue.from_ipc(tmp_path / "c.arrow", "100 5 abd", 2, ["id"], ["x"]) is None  # another footer
    assert Catalogue.from_ipc(tmp_path / "c.arrow", "100 5 abc", 2, ["id", "y_shape"], ["x"]) is None  # no column
    outside = Catalogue(good.small, {"x": [(99, 2), None]})  # past the file's 100 bytes
    (tmp_path / "d.arrow").write_bytes(outside.to_ipc(table, "100 5 abc"))
    assert Catalogue.from_ipc(tmp_path / "d.arrow", "100 5 abc", 2, ["id"], ["x"]) is None


def test_a_rewrite_the_footer_cannot_tell_apart_is_not_read_through_the_old_catalogue(tmp_path):
    """Statistics leave a long caption out of the footer and a shape's order too: a file renamed over with another
    caption of the same length and shape (3, 2) instead of (2, 3), given the old modification time, has the old
    footer's digest; the inode and change time still tell it apart."""
    schema = tensor_schema({"caption": pa.string()}, ["x"])

    def write(caption: str, shape: tuple[int, int], catalogue: bool) -> None:
        with TensorParquetWriter(tmp_path, schema, rows_per_file=2, catalogue=catalogue) as writer:
            for _ in range(2):
                writer.write({"caption": caption, "x": torch.arange(6.0).reshape(shape)})

    write("a" * 5000, (2, 3), catalogue=True)
    builder = TensorParquetDataset(tmp_path)
    assert builder[0]["caption"] == "a" * 5000 and builder[1]["x"].shape == (2, 3) and builder.catalogue_loads == 1
    path = builder.files[0]
    before = path.stat()
    path.unlink()
    write("b" * 5000, (3, 2), catalogue=False)  # another tool rewrote it: the old catalogue stays beside it
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size
    fresh = TensorParquetDataset(tmp_path)
    assert fresh.index_cached  # the row index cannot tell either (nor needs to: same row groups)
    assert [fresh[i]["caption"][:1] for i in range(2)] == ["b", "b"] and fresh[1]["x"].shape == (3, 2)
    assert fresh.catalogue_loads == 0


def test_catalogued_caches_stay_bounded_and_binary_scalars_stay_out(tmp_path):
    rows = [{"id": str(i), "thumb": bytes([i]) * 1000, **encode_tensor(torch.full((2,), float(i)), "x")}
            for i in range(9)]
    schema = tensor_schema({"id": pa.string(), "thumb": pa.binary()}, ["x"])
    for k in range(3):
        (tmp_path / "p").mkdir(exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows[3 * k: 3 * k + 3], schema=schema), tmp_path / "p" / f"f{k}.parquet",
                       row_group_size=1, compression="none", use_dictionary=False)
    builder = TensorParquetDataset(tmp_path)
    for i in range(9):
        builder[i]
    assert builder.catalogue_builds == 3
    stored = pa.ipc.open_file(pa.memory_map(str(next((tmp_path / "p" / CATALOGUE_DIR).iterdir())))).read_all()
    assert "thumb" not in stored.column_names and "id" in stored.column_names
    lean = TensorParquetDataset(tmp_path, columns=["id", "x"])
    lean.small_rows = 6  # two files' small columns at most
    for epoch in range(2):
        for i in random.Random(epoch).sample(range(9), 9):
            assert lean[i]["id"] == str(i) and torch.equal(lean[i]["x"], torch.full((2,), float(i)))
            assert sum(lean._small_counts.values()) <= 6
    assert lean.catalogue_loads == 3
    full = TensorParquetDataset(tmp_path)  # reads the binary scalar: decoded by pyarrow, places from the catalogue
    assert [full[i]["thumb"] for i in range(9)] == [r["thumb"] for r in rows] and full.catalogue_loads == 3


def test_catalogue_failures_never_fail_a_read_and_large_files_wait_for_a_second_read(tmp_path, monkeypatch):
    rows = rows_of_every_dtype()
    _write_files(tmp_path, rows, 3, 1, **WRITE_OPTIONS["plain"])
    arrow = TensorParquetDataset(tmp_path, direct=False)

    def refuse(*_):
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(reader, "save_catalogue", refuse)
        failing = TensorParquetDataset(tmp_path)
        assert_same_rows(failing, arrow, rows)
        assert not failing.catalogue_builds and not (tmp_path / "part" / CATALOGUE_DIR).exists()
    assert_same_rows(TensorParquetDataset(tmp_path), arrow, rows)  # builds them
    monkeypatch.setattr(reader, "EAGER_ROWS", 2)  # these 3-row files count as large now
    lazy = TensorParquetDataset(tmp_path)
    lazy[0]
    assert lazy.catalogue_loads == 0  # a file read once costs what it did without catalogues
    lazy[1], lazy[2]
    assert lazy.catalogue_loads == 1 and torch.equal(lazy[2]["int16"], arrow[2]["int16"])


def test_a_catalogue_with_columns_of_the_wrong_type_is_ignored(tmp_path):
    table = pa.table({"id": ["a"], "x_bytes.offset": ["4"], "x_bytes.length": ["2"]},
                     metadata={b"ff.catalogue": b"1 1 100 5 abc"})
    with pa.ipc.new_file(str(tmp_path / "c.arrow"), table.schema) as writer:
        writer.write_table(table)
    assert Catalogue.from_ipc(tmp_path / "c.arrow", "100 5 abc", 1, ["id"], ["x"]) is None
