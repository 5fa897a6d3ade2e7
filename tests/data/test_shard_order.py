"""Two-level training orders for shards with many rows per row group (``data.row_group_window``): complete epochs,
rows of a window from a window of groups, each group decoded once per epoch, exact resume."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ff_core.data.dataflow import DataflowLoader, DataParallelCoords
from ff_core.data.datamodule import FlowDataModule
from ff_core.data.records.sources import DatasetConfig
from ff_core.data.tensor_parquet import encode_tensor, tensor_schema, two_level_order
from ff_core.data.tensor_parquet.order import GroupedMapDistributor, GroupedSamplerDistributor
from ff_core.data.tensor_parquet.rows import (
    TensorColumns,
    TensorRowCollator,
    TensorRowProcessor,
    TensorRows,
    open_shards,
)

COLUMNS = TensorColumns(condition=("embeds",), latents=("latent",), prompt=None)


def write_reference_layout(path, first: int, rows: int, group_rows: int) -> None:
    """One file as the reference writer lays it out: ``group_rows`` rows per row group (one pyarrow table)."""
    cells = [{**encode_tensor(torch.full((2,), float(i)), "embeds"), **encode_tensor(torch.full((3,), float(i)),
                                                                                      "latent")}
             for i in range(first, first + rows)]
    schema = tensor_schema({}, ["embeds", "latent"])
    table = pa.Table.from_pylist(cells, schema=schema)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=group_rows)


@pytest.fixture
def grouped_rows(tmp_path):
    """Two roots: 20 rows in groups of 5 (two files), and 7 rows in groups of 4 served up to 6 rows."""
    write_reference_layout(tmp_path / "a" / "worker_0" / "data_chunk_0.parquet", 0, 10, 5)
    write_reference_layout(tmp_path / "a" / "worker_0" / "data_chunk_1.parquet", 10, 10, 5)
    write_reference_layout(tmp_path / "b" / "worker_0" / "data_chunk_0.parquet", 20, 7, 4)
    configs = [DatasetConfig(name="a", tensor_parquet_dir=str(tmp_path / "a")),
               DatasetConfig(name="b", tensor_parquet_dir=str(tmp_path / "b"), train={"max_dataset_size": 6})]
    sources = open_shards(configs, COLUMNS, "test", cached_groups=2)
    return TensorRows([s.dataset for s in sources], [s.rows for s in sources])


def test_group_bounds_concatenate_the_datasets_and_stop_at_their_sizes(grouped_rows):
    assert grouped_rows.group_bounds.tolist() == [0, 5, 10, 15, 20, 24, 26]
    assert grouped_rows.max_group_rows() == 5


def groups_of(rows, order):
    bounds = rows.group_bounds.tolist()
    return [max(g for g, b in enumerate(bounds) if b <= i) for i in order]


@pytest.mark.parametrize("world_size", [1, 3])
def test_grouped_epochs_traverse_every_row_and_keep_windows_together(grouped_rows, world_size):
    """Rank blocks of the reader's two-level order, padded like DistributedSampler: complete, equal per rank, and each
    group's rows within one window's span (a uniform permutation scatters them over the whole epoch)."""
    dist = GroupedSamplerDistributor(grouped_rows, window=2, seed=4)
    ranks = [dist.rank_indices(1, r, world_size) for r in range(world_size)]
    expected = two_level_order(grouped_rows.group_bounds, 4, 1, 2).tolist()
    per_rank = -(-26 // world_size)
    padded = (expected * 2)[: per_rank * world_size]
    assert ranks == [padded[r * per_rank : (r + 1) * per_rank] for r in range(world_size)]
    order = [i for r in ranks for i in r][:26]
    assert sorted(order) == list(range(26))
    groups = groups_of(grouped_rows, order)
    spans = [max(k for k, g in enumerate(groups) if g == h) - min(k for k, g in enumerate(groups) if g == h)
             for h in set(groups)]
    assert max(spans) < 10  # two groups of at most 5 rows per window
    assert dist.rank_indices(2, 0, 1) != expected  # reshuffled every epoch


def test_each_group_is_decoded_once_per_epoch(grouped_rows, monkeypatch):
    """With window 2 and readers keeping 2 decoded groups, one epoch decodes each of the 6 groups exactly once: in
    each of the 3 files, the first group read alone, the other's small columns with the whole file's (the reader
    decodes a file's small columns at once on its second group), its _bytes from their pages."""
    calls, file_reads = [], []
    original, original_read = pq.ParquetFile.read_row_group, pq.ParquetFile.read_row_groups
    monkeypatch.setattr(pq.ParquetFile, "read_row_group",
                        lambda self, i, *a, **k: calls.append(i) or original(self, i, *a, **k))
    monkeypatch.setattr(pq.ParquetFile, "read_row_groups",
                        lambda self, *a, **k: file_reads.append(1) or original_read(self, *a, **k))
    dl = DataflowLoader(GroupedSamplerDistributor(grouped_rows, window=2, seed=1),
                        TensorRowProcessor(grouped_rows, COLUMNS), collator=TensorRowCollator(), batch_size=4,
                        coords=DataParallelCoords(0, 1))
    seen = [i for batch in dl for i in batch["index"].tolist()]
    assert sorted(seen) == list(range(26)) and len(calls) == 3 and len(file_reads) == 3
    for batch in dl:  # row i's latent holds i: the cached groups serve the right rows
        for i, value in zip(batch["index"].tolist(), batch["latents"]["latent"]):
            assert torch.equal(value, torch.full((3,), float(i)))


@pytest.mark.parametrize("grouped", [GroupedSamplerDistributor, GroupedMapDistributor])
def test_grouped_orders_resume_exactly(grouped_rows, grouped):
    def loader():
        return DataflowLoader(grouped(grouped_rows, window=2, seed=9, name="train"),
                              TensorRowProcessor(grouped_rows, COLUMNS), collator=TensorRowCollator(),
                              batch_size=3, coords=DataParallelCoords(0, 1))

    def take(dl, n):
        out = []
        while len(out) < n:
            for batch in dl:
                out.append(batch["index"].tolist())
                if len(out) == n:
                    break
        return out

    full = take(loader(), 14)
    first = loader()
    assert take(first, 4) == full[:4]
    resumed = loader()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert take(resumed, 10) == full[4:]
    assert resumed.fingerprint()["distributor"]["window"] == 2


@pytest.mark.parametrize(("world", "new_world"), [(2, 1), (1, 3), (3, 2)])
def test_grouped_epoch_resumed_on_another_world_size_serves_the_rest_once(grouped_rows, world, new_world):
    """Killed after 2 batches of 3 on ``world`` ranks, resumed on ``new_world``: the rest of the epoch is the two-level
    order less each rank's consumed prefix, in contiguous blocks again (hand reference below); the next epoch is the
    ordinary one of the new world size."""
    def loaders(w):
        return [DataflowLoader(GroupedSamplerDistributor(grouped_rows, window=2, seed=9, name="train"),
                               TensorRowProcessor(grouped_rows, COLUMNS), collator=TensorRowCollator(),
                               batch_size=3, coords=DataParallelCoords(r, w)) for r in range(w)]  # fmt: skip

    first = loaders(world)
    its = [iter(dl) for dl in first]
    consumed = [[i for _ in range(2) for i in next(it)["index"].tolist()] for it in its]
    state = json.loads(json.dumps(first[0].state_dict()))
    order = two_level_order(grouped_rows.group_bounds, 9, 0, 2).tolist()
    per_rank = -(-26 // world)
    taken = {p for r in range(world) for p in range(r * per_rank, r * per_rank + 6) if p < 26}
    assert sorted(i for c in consumed for i in c) == sorted(order[p] for p in taken)
    rest = [order[p] for p in range(26) if p not in taken]
    per_new = -(-len(rest) // new_world)
    padded = (rest * 2)[: per_new * new_world]
    resumed = loaders(new_world)
    for rank, dl in enumerate(resumed):
        dl.load_state_dict(state)
        assert [i for b in dl for i in b["index"].tolist()] == padded[rank * per_new : (rank + 1) * per_new]
        assert [i for b in dl for i in b["index"].tolist()] == dl.distributor.rank_indices(1, rank, new_world)


def test_row_group_window_is_checked():
    roots = [DatasetConfig(name="a", tensor_parquet_dir="a")]
    with pytest.raises(ValueError, match="row_group_window must be an integer >= 1"):
        FlowDataModule(roots, row_group_window=0)
    with pytest.raises(ValueError, match="row_group_window must be an integer >= 1"):
        GroupedMapDistributor(TensorRows([list(range(3))]), window=True)


def test_the_shard_order_benchmark_runs(monkeypatch, capsys):
    """benchmarks/bench_shard_order.py on a few tiny rows: both orders serve the epoch; the grouped one decodes each
    of its 4 groups once."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_shard_order.py"
    spec = importlib.util.spec_from_file_location("bench_shard_order", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", ["bench", "--rows", "32", "--group-rows", "8", "--row-mb", "0.01", "--window",
                                      "2"])
    bench.main()
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| `row_group_window")]
    assert table and table[0].split("|")[3].strip() == "4"
