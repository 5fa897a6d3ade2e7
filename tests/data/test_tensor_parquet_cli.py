"""``ff data inspect`` / ``validate`` on tensor-parquet roots: the report, and exit status 2 on schema and row
problems, each naming file, row and column."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tensor_parquet_helpers import track_row, write_card_layout

from ff_core.cli.data import main
from ff_core.data.tensor_parquet import T2V_SCHEMA, TensorParquetWriter, encode_tensor, tensor_schema


def run(*argv) -> tuple[int, str]:
    out = io.StringIO()
    code = main([str(a) for a in argv], out=out)
    return code, out.getvalue()


def test_inspect_card_layout(tmp_path):
    write_card_layout(tmp_path, [5, 4])
    code, out = run("inspect", tmp_path)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == str(tmp_path)
    assert lines[1].startswith("  tensor-parquet: 4 file(s), 9 rows, 9 row groups (1 row each), ")
    assert lines[2] == ("    files: shard000/combined_parquet_dataset/worker_0/data_chunk_0.parquet .. "
                        "shard001/combined_parquet_dataset/worker_1/data_chunk_0.parquet")
    # Payload of row 0 (text length 2) and of the longest text (5): 2 * 120 + 24 + 60 + 30 (bf16) + 12 (f32) ...
    fixed = 2 * (2 * 120 + 24 + 60 + 30) + 4 * (6 + 6)
    assert lines[3].startswith(f"    tensor bytes per row: {fixed + 2 * 2 * 8} B..{fixed + 2 * 5 * 8} B; ")
    assert "    tensor text_embedding: bfloat16 [2..5, 8]" in lines
    assert "    tensor object_ids: float32 [6]" in lines
    assert "width int64" in out and "duration_sec double" in out
    code, out = run("inspect", tmp_path, "--json")
    report = json.loads(out)
    assert report["rows"] == 9 and report["errors"] == []
    assert report["tensors"]["text_embedding"] == {"dtypes": ["bfloat16"], "shape_min": [2, 8],
                                                   "shape_max": [5, 8], "ranks": [2], "empty_rows": 0}


def test_validate_ok_and_against_a_card_schema(tmp_path):
    write_card_layout(tmp_path, [3])
    code, out = run("validate", tmp_path, "--schema", "i2v_track", "--check-media")
    assert code == 0, out
    assert out.splitlines()[0] == f"{tmp_path}: OK (tensor-parquet, schema i2v_track)"
    t2v = tmp_path / "t2v"
    with TensorParquetWriter(t2v, T2V_SCHEMA) as w:
        w.write({n: v for n, v in track_row(0).items() if n in T2V_SCHEMA.names or n in ("vae_latent",
                                                                                       "text_embedding")})
    code, out = run("validate", t2v, "--schema", "i2v")
    assert code == 2
    assert f"{t2v}/worker_0/data_chunk_0.parquet: clip_feature_bytes: missing column (expected binary)" in out


def test_validate_names_file_row_and_column(tmp_path):
    good = {"id": "a", **encode_tensor(torch.ones(2, 3), "x")}
    rows = [good, {**good, "x_dtype": "bf16"}, {**good, "x_shape": None}, {**good, "x_bytes": b"\x00" * 5}]
    path = tmp_path / "w" / "f.parquet"
    path.parent.mkdir()
    pq.write_table(pa.Table.from_pylist(rows, schema=tensor_schema({"id": pa.string()}, ["x"])), path)
    code, out = run("validate", tmp_path)
    assert code == 2
    assert out.splitlines() == [
        f"{path}: x_dtype: row 1 (dataset row 1): unknown dtype 'bf16'; expected one of float32, bfloat16, "
        "float16, float64, int8, int16, int32, int64, uint8, bool, float8_e4m3fn",
        f"{path}: x_shape: row 2 (dataset row 2): null value",
        f"ff data validate: 2 problem(s) in {tmp_path}",
    ]
    code, out = run("validate", tmp_path, "--check-media")  # reads the bytes too: row 3's length is wrong
    assert code == 2
    assert f"{path}: x_bytes: row 3 (dataset row 3): 5 bytes, expected prod([2, 3]) x 4 (float32) = 24" in out
    code, out = run("inspect", tmp_path)
    assert code == 2 and "tensor x: float32 [2, 3]" in out and "x_dtype: row 1" in out


def test_validate_missing_triplet_part_and_unreadable_file(tmp_path):
    path = tmp_path / "f.parquet"
    pq.write_table(pa.table({"id": ["a"], "x_bytes": [b"\x00" * 4], "x_dtype": ["float32"]}), path)
    (tmp_path / "g.parquet").write_bytes(b"not parquet")
    code, out = run("validate", tmp_path)
    assert code == 2
    assert f"{tmp_path}/g.parquet: cannot read the parquet footer" in out
    (tmp_path / "g.parquet").unlink()
    code, out = run("validate", tmp_path)
    assert code == 2 and f"{path}: x_shape: tensor 'x' has x_bytes but no x_shape column" in out


def test_a_dataset_folder_is_not_taken_for_a_parquet_root(tmp_path):
    (tmp_path / "train.txt").write_text("a prompt\n")
    pq.write_table(pa.table({"id": ["a"]}), tmp_path / "stray.parquet")
    code, out = run("inspect", tmp_path)
    assert code == 0 and "tensor-parquet" not in out and "train.txt: 1 row" in out
