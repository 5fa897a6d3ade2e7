"""The fit-start row check (issue 24, item 9) on shards written by ff's writer: every bad row found, with the row
named, whether the file's rows are decided in numpy (the usual case) or row by row; rows past ``max_dataset_size``
are not read."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from ff_core.data.tensor_parquet import TensorParquetDataset, TensorParquetWriter, tensor_schema
from ff_core.data.tensor_parquet.checks import StoredShape, row_problems
from ff_core.data.tensor_parquet.format import encode_tensor

RULE = {"latent": StoredShape(3, {0: 4}, {1: 2, 2: 2}), "text": StoredShape(2, {-1: 8})}


def write(root, bad: dict[int, dict], rows: int = 20, catalogue: bool = True):
    """``rows`` rows, 6 per file, text embeddings of lengths 1..5 (ragged), latents (4, 2r, 2): row ``i`` in ``bad``
    has those triplet values overridden."""
    schema = tensor_schema({"id": pa.string()}, ["latent", "text"])
    with TensorParquetWriter(root, schema, rows_per_file=6, catalogue=catalogue) as writer:
        for i in range(rows):
            row = {"id": str(i), **encode_tensor(torch.zeros(4, 2 * (i % 3 + 1), 2), "latent"),
                   **encode_tensor(torch.zeros(i % 5 + 1, 8), "text")}
            writer.write({**row, **bad.get(i, {})})
    return TensorParquetDataset(root, catalogue=catalogue)


@pytest.mark.parametrize("catalogue", [True, False])
def test_only_the_bad_rows_are_named(tmp_path, catalogue):
    bad = {
        8: {"latent_shape": [2, 6, 4]},  # (4, 6, 2) stored as (2, 6, 4): the right byte count, C != 4
        13: {"text_dtype": "float16"},  # half the bytes 1*8*4 holds
        14: {"latent_dtype": "f32"},  # no such dtype
        19: {"latent_shape": [4, 3, 2]},  # byte count wrong (3 != 2 * (19 % 3 + 1) = 4)
    }
    dataset = write(tmp_path / "s", bad, catalogue=catalogue)
    found = [(str(e.path).rsplit("/", 1)[1], e.field, e.reason.split(":")[0]) for e in row_problems(dataset, RULE)]
    assert found == [
        ("data_chunk_1.parquet", "latent_shape", "row 2 (dataset row 8)"),
        ("data_chunk_2.parquet", "text_bytes", "row 1 (dataset row 13)"),
        ("data_chunk_2.parquet", "latent_dtype", "row 2 (dataset row 14)"),
        ("data_chunk_3.parquet", "latent_bytes", "row 1 (dataset row 19)"),
    ]
    assert row_problems(dataset, RULE, rows=8) == []  # the first bad row is row 8: rows 0..7 only
    assert [e.field for e in row_problems(dataset, None)] == ["text_bytes", "latent_dtype", "latent_bytes"]


def test_good_ragged_rows_and_placeholders_pass(tmp_path):
    dataset = write(tmp_path / "s", {5: {"text_bytes": b"", "text_shape": [], "text_dtype": ""}})
    assert row_problems(dataset, RULE) == []  # the absent-tensor placeholder is not a bad row
    assert row_problems(dataset, {"latent": StoredShape(3, {0: 4}, {1: 4})})[0].reason.startswith(
        "row 0 (dataset row 0): shape [4, 2, 2]: axis 1 must be a multiple of 4")
