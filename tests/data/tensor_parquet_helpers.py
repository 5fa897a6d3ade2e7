"""Tiny tensor-parquet datasets for tests: card-shaped rows (small dimensions) and the card's loading recipe."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ff_core.data.tensor_parquet import I2V_TRACK_SCHEMA, TensorParquetWriter

# The card's tensors at toy size: (C, T, H, W) latents, L x D text embedding (L varies), 5 frames x 6 tracks.
TRACK_SHAPES = {"vae_latent": (4, 2, 3, 5), "first_frame_latent": (4, 2, 3, 5), "clip_feature": (3, 8),
                "track_points": (5, 6, 2), "track_visibility": (5, 6), "object_ids": (6,), "track_weights": (6,)}
FLOAT32 = ("object_ids", "track_weights")  # the card keeps these float32, the rest bfloat16


def track_row(i: int, seed: int = 0) -> dict:
    """Row ``i`` of the card's 33-column layout: scalars plus tensors (text length 2 + i % 4)."""
    g = torch.Generator().manual_seed(seed * 1000 + i)
    row = {"id": f"clip{i:04d}", "file_name": f"clip{i:04d}.mp4", "caption": f"caption {i}", "media_type": "video",
           "width": 160, "height": 90, "num_frames": 5, "duration_sec": 5 / 24, "fps": 24.0}
    for name, shape in TRACK_SHAPES.items():
        dtype = torch.float32 if name in FLOAT32 else torch.bfloat16
        row[name] = torch.randn(shape, generator=g).to(dtype)
    row["text_embedding"] = torch.randn(2 + i % 4, 8, generator=g).to(torch.bfloat16)
    return row


def write_card_layout(root: Path, rows_per_shard: list[int], rows_per_file: int = 3, workers: int = 2) -> list[dict]:
    """``root/shardNNN/combined_parquet_dataset/worker_k/data_chunk_i.parquet`` exactly as the card lays it out.

    Rows are spread round-robin over ``workers`` writers per shard. Returns the rows in the reader's order
    (shard, worker, chunk, row).
    """
    ordered, i = [], 0
    for s, n in enumerate(rows_per_shard):
        base = root / f"shard{s:03d}" / "combined_parquet_dataset"
        per_worker: list[list[dict]] = [[] for _ in range(workers)]
        for k in range(n):
            per_worker[k % workers].append(track_row(i))
            i += 1
        for w, rows in enumerate(per_worker):
            with TensorParquetWriter(base, I2V_TRACK_SCHEMA, rows_per_file=rows_per_file, worker=w) as writer:
                for row in rows:
                    writer.write(row)
            ordered += rows
    return ordered


def card_decode(row: dict, name: str) -> torch.Tensor:
    """The card's loading recipe, verbatim but for the dtype map: the independent reference decoder."""
    strs = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "float64": torch.float64, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32,
            "int64": torch.int64, "uint8": torch.uint8, "bool": torch.bool,
            "float8_e4m3fn": torch.float8_e4m3fn}
    dt = strs[row[f"{name}_dtype"]]
    return torch.frombuffer(bytearray(row[f"{name}_bytes"]), dtype=dt).reshape(row[f"{name}_shape"])


def write_reference_layout(path: Path, table: pa.Table, rows_per_group: int) -> Path:
    """A file as the reference writer makes it: several rows per row group, pyarrow defaults otherwise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=rows_per_group)
    return path
