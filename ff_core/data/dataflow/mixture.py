"""MixtureDistributor: several sources merged into one stream by ratio (spec §3 "Mix multiple datasets").

Beyond the spec, a mixture of resumable sources is itself resumable: the source of global position i is drawn
from a generator seeded by ``(seed, i // BLOCK)``, so the mixed order depends only on the seed; its cursor state is
the position plus each source's own cursor state, and skipping n positions costs a ``bincount``, not n reads.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ff_core.seeding import derive_seed

from .base import Cursor, DataDistributor, IndexedDistributor

BLOCK = 1024  # positions drawn per generator call; part of the order, so changing it changes every mixture


class _MixtureCursor(Cursor):
    def __init__(self, mix: MixtureDistributor, position: int, subs: list[Cursor]) -> None:
        self.mix, self.position, self.subs = mix, position, subs

    def skip(self, n: int) -> None:
        counts = torch.zeros(len(self.subs), dtype=torch.long)
        p, end = self.position, self.position + n
        while p < end:
            block, offset = divmod(p, BLOCK)
            stop = min(BLOCK, offset + end - p)
            counts += torch.bincount(self.mix.block(block)[offset:stop], minlength=len(self.subs))
            p += stop - offset
        for sub, c in zip(self.subs, counts.tolist()):
            if c:
                sub.skip(c)
        self.position = end

    def take(self) -> tuple[Any, Any]:
        block, offset = divmod(self.position, BLOCK)
        k = int(self.mix.block(block)[offset])
        address, item = self.subs[k].take()
        self.position += 1
        return [self.mix.names[k], address], item

    def state(self) -> dict[str, Any]:
        return {"position": self.position, "sources": {n: s.state() for n, s in zip(self.mix.names, self.subs)}}


class MixtureDistributor(IndexedDistributor):
    """Ratio-weighted, seeded merge of several distributors into one stream (spec §2 table).

    Resumable when every source is (e.g. ``MapDistributor`` or a nested mixture of them); with a streaming source
    it falls back to a per-(rank, worker) seeded draw over the sources' own streams and ends when the drawn
    source runs out.

    Args:
        sources: ``{name: (distributor, ratio)}`` with ``ratio > 0``.
        seed: Seed of the source draw.
        samples_per_epoch: Length of one epoch of the mixed order; default the sum of the sources' epoch lengths.
    """

    def __init__(
        self,
        sources: Mapping[str, tuple[DataDistributor, float]],
        seed: int = 0,
        samples_per_epoch: int | None = None,
    ) -> None:
        if not sources:
            raise ValueError("MixtureDistributor: sources is empty")
        self.names = list(sources)
        self.sources = [sources[n][0] for n in self.names]
        self.ratios = [float(sources[n][1]) for n in self.names]
        for n, d, r in zip(self.names, self.sources, self.ratios):
            if not isinstance(d, DataDistributor):
                raise ValueError(f"MixtureDistributor: sources[{n!r}][0] must be a DataDistributor, found "
                                 f"{type(d).__name__}")
            if not r > 0:
                raise ValueError(f"MixtureDistributor: sources[{n!r}] ratio must be > 0, found {r}")
        self.seed, self.samples_per_epoch = seed, samples_per_epoch
        self.resumable = all(d.resumable for d in self.sources)
        self._probs = torch.tensor(self.ratios, dtype=torch.float64) / sum(self.ratios)
        self._blocks: dict[int, torch.Tensor] = {}

    @property
    def epoch_length(self) -> int:
        if self.samples_per_epoch is not None:
            return self.samples_per_epoch
        if not self.resumable:
            raise ValueError("MixtureDistributor: give samples_per_epoch when a source is not map-style")
        return sum(d.epoch_length for d in self.sources)  # type: ignore[attr-defined]

    def block(self, index: int) -> torch.Tensor:
        """Source indices of global positions ``[index·BLOCK, (index+1)·BLOCK)``.

        Args:
            index: Block number.
        """
        if index not in self._blocks:
            if len(self._blocks) >= 4:
                self._blocks.pop(min(self._blocks))
            g = torch.Generator().manual_seed(derive_seed(self.seed, index))
            self._blocks[index] = torch.multinomial(self._probs, BLOCK, replacement=True, generator=g)
        return self._blocks[index]

    def cursor(self, state: Mapping[str, Any] | None = None) -> Cursor:
        self._require_resumable()
        sub_states = (state or {}).get("sources", {})
        subs = [d.cursor(sub_states.get(n)) for n, d in zip(self.names, self.sources)]  # type: ignore[attr-defined]
        return _MixtureCursor(self, int(state["position"]) if state else 0, subs)

    def fetch(self, address: Any) -> Any:
        self._require_resumable()
        name, sub_address = address
        return self.sources[self.names.index(name)].fetch(sub_address)  # type: ignore[attr-defined]

    def stream(self, dp_rank: int, dp_world_size: int, worker_id: int, num_workers: int) -> Iterator[Any]:
        if self.resumable:
            yield from super().stream(dp_rank, dp_world_size, worker_id, num_workers)
            return
        rng = random.Random(derive_seed(self.seed, dp_rank, worker_id))
        streams = [iter(d.stream(dp_rank, dp_world_size, worker_id, num_workers)) for d in self.sources]
        while True:
            k = rng.choices(range(len(streams)), weights=self.ratios)[0]
            try:
                yield next(streams[k])
            except StopIteration:
                return

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": "MixtureDistributor", "seed": self.seed, "block": BLOCK,
                "sources": {n: {"ratio": r, **d.fingerprint()}
                            for n, d, r in zip(self.names, self.sources, self.ratios)}}

    def _require_resumable(self) -> None:
        if not self.resumable:
            bad = [n for n, d in zip(self.names, self.sources) if not d.resumable]
            raise ValueError(f"MixtureDistributor: sources {bad} are not resumable, so the mixture has no cursor")
