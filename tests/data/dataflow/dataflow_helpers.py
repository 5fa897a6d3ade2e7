"""Shared helpers for the dataflow tests: one process plays every rank and every worker."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ff_core.data.dataflow import DataflowLoader, DataParallelCoords, IdentityProcessor, RawItemProcessor


class SimulatedWorkersLoader(DataflowLoader):
    """A DataflowLoader whose ``num_workers`` streams run in-process, visited round-robin like the DataLoader
    visits its workers (a worker that is exhausted is skipped)."""

    def _worker_batches(self) -> Iterator[tuple[dict[str, Any], Any]]:
        gens = [self._stream.iterate(w) for w in range(self.num_streams)]
        live = list(range(len(gens)))
        k = 0
        while live:
            w = live[k % len(live)]
            try:
                item = next(gens[w])
            except StopIteration:
                live.remove(w)
                continue
            yield item
            k += 1


class CountingProcessor(RawItemProcessor):
    """Identity, counting calls (to prove a resume does not process skipped items)."""

    def __init__(self) -> None:
        self.calls = 0

    def process(self, item: Any) -> dict[str, Any]:
        self.calls += 1
        return item


def make_loaders(distributor_fn, world_size: int, num_workers: int, **kwargs) -> list[SimulatedWorkersLoader]:
    """One loader per rank, each with its own distributor instance (as separate processes would have)."""
    kwargs.setdefault("processor", IdentityProcessor())
    return [
        SimulatedWorkersLoader(distributor_fn(), num_workers=num_workers, coords=DataParallelCoords(r, world_size),
                               **kwargs)
        for r in range(world_size)
    ]


def ids(batch: Any) -> list[int]:
    """Sample ids of a collated batch (tensor from default_collate, or list)."""
    value = batch["id"]
    return value.tolist() if hasattr(value, "tolist") else list(value)


def lockstep(loaders: list[DataflowLoader], steps: int | None = None) -> list[list[list[int]]]:
    """Iterate every rank's loader one step at a time (as DDP does); per step, per rank, the batch's ids."""
    its = [iter(dl) for dl in loaders]
    out: list[list[list[int]]] = []
    while steps is None or len(out) < steps:
        try:
            out.append([ids(next(it)) for it in its])
        except StopIteration:
            break
    return out


def records(n: int, **extra) -> list[dict[str, Any]]:
    return [{"id": i, **extra} for i in range(n)]


def run_steps(loaders: list[DataflowLoader], total: int) -> list[list[list[int]]]:
    """``total`` lockstep steps across as many epochs (``iter()`` calls) as needed."""
    out: list[list[list[int]]] = []
    while len(out) < total:
        before = len(out)
        its = [iter(dl) for dl in loaders]
        while len(out) < total:
            try:
                out.append([ids(next(it)) for it in its])
            except StopIteration:
                break
        if len(out) == before:
            raise AssertionError("an epoch yielded no batch")
    return out


def flatten_global(steps: list[list[list[int]]]) -> list[int]:
    """Concatenate (step, rank) batches: mode "global" makes this the distributor's order."""
    return [i for step in steps for batch in step for i in batch]
