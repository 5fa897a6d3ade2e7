"""One training epoch over reference-layout shards (many rows per row group): uniform row order vs
``data.row_group_window`` (two-level order), through the training loader's own roles.

Run: ``python benchmarks/bench_shard_order.py [--rows 512] [--group-rows 16] [--row-mb 1] [--window 4]``. Writes
shards the way the card's reference writer lays them out (``--group-rows`` rows per row group, one group per file,
rows of ``--row-mb`` MB: a ``latent`` tensor plus a small ``prompt_embeds``) into a temporary folder, then reads one
epoch in the main process (batches of 8) through ``SamplerDistributor`` (uniform permutation) and
``GroupedSamplerDistributor`` (groups shuffled, rows shuffled within windows of ``--window`` groups), each reader
keeping ``--window`` decoded groups. Prints rows per second and the number of row-group decodes (counted on
``ParquetFile.read_row_group``), and removes the folder.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ff_core.data.dataflow import DataflowLoader, DataParallelCoords, SamplerDistributor
from ff_core.data.records.sources import DatasetConfig
from ff_core.data.tensor_parquet import encode_tensor, tensor_schema
from ff_core.data.tensor_parquet.order import GroupedSamplerDistributor
from ff_core.data.tensor_parquet.rows import (
    TensorColumns,
    TensorRowCollator,
    TensorRowProcessor,
    TensorRows,
    open_shards,
)

COLUMNS = TensorColumns(condition=("prompt_embeds",), latents=("latent",), prompt=None)


def write_reference_shards(root: Path, rows: int, group_rows: int, row_mb: float) -> None:
    """``rows`` rows, ``group_rows`` per row group and per file (the reference writer's whole-file groups)."""
    numel = int(row_mb * 2**20 / 4)
    schema = tensor_schema({}, ["prompt_embeds", "latent"])
    for f, start in enumerate(range(0, rows, group_rows)):
        cells = [{**encode_tensor(torch.full((16, 8), float(i)), "prompt_embeds"),
                  **encode_tensor(torch.full((numel,), float(i)), "latent")}
                 for i in range(start, min(rows, start + group_rows))]
        path = root / "shard000" / "combined_parquet_dataset" / "worker_0" / f"data_chunk_{f}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(cells, schema=schema), path, row_group_size=group_rows)


def epoch(rows: TensorRows, distributor, batch_size: int = 8) -> tuple[float, int]:
    """Seconds for one epoch and the row groups decoded during it."""
    calls = []
    original = pq.ParquetFile.read_row_group

    def counted(self, i, *args, **kwargs):
        calls.append(i)
        return original(self, i, *args, **kwargs)

    pq.ParquetFile.read_row_group = counted
    try:
        loader = DataflowLoader(distributor, TensorRowProcessor(rows, COLUMNS), collator=TensorRowCollator(),
                                batch_size=batch_size, coords=DataParallelCoords(0, 1))
        start = time.perf_counter()
        served = sum(len(batch["index"]) for batch in loader)
        seconds = time.perf_counter() - start
    finally:
        pq.ParquetFile.read_row_group = original
    assert served == len(rows)
    return seconds, len(calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--group-rows", type=int, default=16)
    parser.add_argument("--row-mb", type=float, default=1.0)
    parser.add_argument("--window", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench-shard-order-"))
    try:
        write_reference_shards(root, args.rows, args.group_rows, args.row_mb)
        config = DatasetConfig(name="ref", tensor_parquet_dir=str(root))
        results = {}
        for name in ("uniform", "row_group_window"):
            # A fresh reader per variant (no decoded group carried over), keeping `window` decoded groups.
            rows = TensorRows([open_shards([config], COLUMNS, "bench", cached_groups=args.window)[0].dataset])
            dist = (SamplerDistributor(rows, seed=0) if name == "uniform"
                    else GroupedSamplerDistributor(rows, window=args.window, seed=0))
            results[name] = epoch(rows, dist)
        groups = -(-args.rows // args.group_rows)
        print(f"\n{args.rows} rows of {args.row_mb:g} MB, {args.group_rows} rows per row group ({groups} groups), "
              f"readers keeping {args.window} decoded groups, batches of 8, main process\n")
        print("| order | rows/s | row-group decodes per epoch | GB decoded |")
        print("|---|---|---|---|")
        group_gb = args.group_rows * args.row_mb / 1024
        for name, (seconds, decodes) in results.items():
            label = "uniform permutation" if name == "uniform" else f"`row_group_window: {args.window}`"
            print(f"| {label} | {args.rows / seconds:.0f} | {decodes} | {decodes * group_gb:.1f} |")
        print(f"\nspeed-up: {results['uniform'][0] / results['row_group_window'][0]:.1f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
