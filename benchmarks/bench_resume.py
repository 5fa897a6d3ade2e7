"""Resume time-to-first-batch at position 10 vs 10^6: fast-forward is index arithmetic, never decoding.

Run: ``python benchmarks/bench_resume.py [--workers 0] [--repeats 3]``. Prints a markdown table.

Each source has 2·10^6 items whose processing costs ~0.2 ms (a stand-in for decoding); resuming by replaying the
skipped samples would take ~200 s at position 10^6. Times are from ``load_state_dict`` to the first batch in hand,
best of ``--repeats``, including the first-epoch permutation (torch.randperm of 2·10^6) and worker start-up.
"""

from __future__ import annotations

import argparse
import time

from ff_core.data.dataflow import (
    DataflowLoader,
    ListBatchCollator,
    MapDistributor,
    MixtureDistributor,
    PoolPackingBatcher,
    RawItemProcessor,
)

LENGTH = 2_000_000


class Lazy:
    """A 2·10^6-item dataset: items are made on access."""

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, i: int) -> dict:
        return {"id": i}


class SlowProcessor(RawItemProcessor):
    """~0.2 ms of work per item, like a small decode."""

    def process(self, item: dict) -> dict:
        end = time.perf_counter() + 2e-4
        while time.perf_counter() < end:
            pass
        return {"id": item["id"], "input_ids": [0] * (1 + item["id"] % 50)}


def build(kind: str, workers: int) -> DataflowLoader:
    if kind == "mixture":
        sources = {"a": (MapDistributor(Lazy(), seed=1), 3.0), "b": (MapDistributor(Lazy(), seed=2), 1.0)}
        dist = MixtureDistributor(sources)
    else:
        dist = MapDistributor(Lazy(), seed=0)
    if kind == "map + pool packing":
        return DataflowLoader(dist, SlowProcessor(), PoolPackingBatcher(64, 16, 4), ListBatchCollator(),
                              num_workers=workers, steps_per_epoch=1000)
    return DataflowLoader(dist, SlowProcessor(), batch_size=8, num_workers=workers, collator=ListBatchCollator())


def time_to_first_batch(kind: str, position: int, workers: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        loader = build(kind, workers)
        state = loader.state_dict()
        if loader.mode == "global":
            state["cursor"] = loader.distributor.cursor().state() | {"position": position}
            if kind == "mixture":  # a real mixture state: the cursor after `position` items
                cursor = loader.distributor.cursor()
                cursor.skip(position)
                state["cursor"] = cursor.state()
        else:
            state["streams"] = {"0/0": {"cursor": {"position": position}, "pending": []}}
        start = time.perf_counter()
        loader.load_state_dict(state)
        next(iter(loader))
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"num_workers={args.workers}; best of {args.repeats}")
    print("| source | position 10 | position 10^6 | ratio |")
    print("|---|---|---|---|")
    for kind in ("map", "mixture", "map + pool packing"):
        near = time_to_first_batch(kind, 10, args.workers, args.repeats)
        far = time_to_first_batch(kind, 1_000_000, args.workers, args.repeats)
        print(f"| {kind} | {near * 1e3:.1f} ms | {far * 1e3:.1f} ms | {far / near:.2f} |")


if __name__ == "__main__":
    main()
