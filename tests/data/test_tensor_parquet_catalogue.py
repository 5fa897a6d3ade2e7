"""Row catalogues (``ff_core.data.tensor_parquet.catalogue``): a file's small columns and ``_bytes`` places, built by
one reader and used by the next process instead of decoding and parsing the file again.

Rows served from a catalogue are compared with pyarrow's decoding of the same files (``direct=False``), errors
included; a stale, damaged or foreign catalogue must never be used.
"""

from __future__ import annotations

import random
import shutil
from collections import Counter

import pyarrow as pa
import pytest
import torch
from test_tensor_parquet_pages import WRITE_OPTIONS, _write_files, assert_same_rows, read, rows_of_every_dtype

from ff_core.data.tensor_parquet import TensorParquetDataset, reader
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
    assert len(list((tmp_path / CATALOGUE_DIR).iterdir())) == 3
    for columns in (None, ["id", "int16", "float32", "bfloat16"]):
        fresh = TensorParquetDataset(tmp_path, columns=columns)
        order = list(range(len(rows)))
        random.Random(len(order)).shuffle(order)
        seen = counting(monkeypatch)
        got = {i: read(fresh, i) for i in order}
        assert not seen  # no header parsed, no small column decoded, nothing read by pyarrow
        monkeypatch.undo()
        assert fresh.chunk_reads == Counter({"catalogue": len(fresh.tensor_names) * len(rows)})  # every read
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
    assert fresh.chunk_reads == Counter({"catalogue": len(fresh.tensor_names) * len(rows)})


def test_stale_damaged_or_foreign_catalogues_are_never_used(tmp_path):
    rows = rows_of_every_dtype()
    paths = _write_files(tmp_path, rows, 3, 1, **WRITE_OPTIONS["plain"])
    assert_same_rows(TensorParquetDataset(tmp_path), TensorParquetDataset(tmp_path, direct=False), rows)
    ds = TensorParquetDataset(tmp_path)
    where = [catalogue_paths(ds.root, rel, None)[0] for rel in ds.index.files]
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
        assert not (tmp_path / name / CATALOGUE_DIR).exists()
    stored = list((tmp_path / "cache").rglob("*.arrow"))
    assert len(stored) == 1 and stored[0].parent.name.startswith("plain-")
    again = TensorParquetDataset(tmp_path / "plain", cache_dir=tmp_path / "cache")
    assert again[3]["id"] == "3" and again.chunk_reads["catalogue"] == len(again.tensor_names)
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
