"""JointDataflowLoader: interleave heterogeneous pipelines by ratio (spec §3 "Interleave heterogeneous pipelines").

The inner loader of joint step t is drawn from ``derive_seed(seed, t)`` alone, so every rank picks the same one
at the same step (each rank's batch then has the same structure) and a resumed run continues the same choices.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator, Mapping
from typing import Any

from ff_core.seeding import derive_seed

from .loader import DataflowLoader
from .state import JOINT_FORMAT, StateHistory, check_state

RESERVED_NAMES = frozenset({"global_id"})


class JointDataflowLoader:
    """Each step yields one batch from one inner :class:`DataflowLoader`, chosen by ratio; batches are dicts
    tagged with ``"dataset_name"``.

    Args:
        dataloaders: ``{name: {"dataloader": DataflowLoader, "ratio": r}}`` with ``r > 0``; ``"global_id"`` is
            reserved.
        seed: Seed of the per-step choice.
        steps_per_epoch: Batches per ``iter()``; default the sum of the inner loaders' lengths. An inner loader
            whose epoch ends is restarted on its next epoch transparently.
        stamp_key: As for ``DataflowLoader`` (:meth:`commit` then pins the saved position).
    """

    def __init__(self, dataloaders: Mapping[str, Mapping[str, Any]], seed: int = 0,
                 steps_per_epoch: int | None = None, stamp_key: str | None = None) -> None:
        if not dataloaders:
            raise ValueError("JointDataflowLoader: dataloaders is empty")
        for name, entry in dataloaders.items():
            where = f"JointDataflowLoader: dataloaders[{name!r}]"
            if name in RESERVED_NAMES:
                raise ValueError(f"{where}: {name!r} is reserved by the checkpoint state; choose another name")
            if not isinstance(entry.get("dataloader"), DataflowLoader):
                raise ValueError(f"{where}.dataloader must be a DataflowLoader, found "
                                 f"{type(entry.get('dataloader')).__name__}")
            if not float(entry.get("ratio", 0)) > 0:
                raise ValueError(f"{where}.ratio must be > 0, found {entry.get('ratio')!r}")
        self.names = list(dataloaders)
        self.loaders = [dataloaders[n]["dataloader"] for n in self.names]
        self.ratios = [float(dataloaders[n]["ratio"]) for n in self.names]
        self.seed, self.steps_per_epoch, self.stamp_key = seed, steps_per_epoch, stamp_key
        self._step, self._epoch_step = 0, 0
        self._history = StateHistory()

    def choice(self, step: int) -> str:
        """Name of the inner loader that serves joint step ``step`` (a function of ``(seed, step)`` only).

        Args:
            step: Joint step index since the start of training.
        """
        return random.Random(derive_seed(self.seed, step)).choices(self.names, weights=self.ratios)[0]

    def __len__(self) -> int:
        total = self.steps_per_epoch or sum(len(dl) for dl in self.loaders)
        return total - self._epoch_step

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # Fresh inner iterators per epoch: each restarts from its own delivered position, so batches its workers
        # prefetched for the previous epoch are neither lost nor repeated.
        if len(self) <= 0:  # the previous epoch was consumed to its last batch
            self._epoch_step = 0
        remaining = len(self)
        iterators: dict[str, Iterator[Any]] = {}
        for _ in range(remaining):
            name = self.choice(self._step)
            batch = self._next(iterators, name)
            if not isinstance(batch, dict):
                raise TypeError(f"JointDataflowLoader: loader {name!r} must yield dict batches to be tagged, "
                                f"found {type(batch).__name__}")
            batch["dataset_name"] = name
            self._step += 1
            self._epoch_step += 1
            if self.stamp_key is not None:
                batch[self.stamp_key] = self._step
                self._history.record(self._step, self._live_state())
            yield batch
        self._epoch_step = 0

    def _next(self, iterators: dict[str, Iterator[Any]], name: str) -> Any:
        loader = self.loaders[self.names.index(name)]
        for _attempt in range(2):
            if name not in iterators:
                iterators[name] = iter(loader)
            try:
                return next(iterators[name])
            except StopIteration:
                del iterators[name]  # that loader's epoch ended: start its next one
        raise RuntimeError(f"JointDataflowLoader: loader {name!r} yields no batch in a whole epoch")

    def commit(self, seq: int) -> None:
        """Mark the batch stamped ``seq`` as consumed (see ``DataflowLoader.commit``).

        Args:
            seq: The value found under ``stamp_key``.
        """
        self._history.commit(seq)

    def fingerprint(self) -> dict[str, Any]:
        """Names, ratios and seed: what fixes the per-step choice."""
        return {"seed": self.seed, "ratios": dict(zip(self.names, self.ratios))}

    def _live_state(self) -> dict[str, Any]:
        return {"format": JOINT_FORMAT, "step": self._step, "epoch_step": self._epoch_step,
                "loaders": {n: dl.local_state_dict() for n, dl in zip(self.names, self.loaders)}}

    def state_dict(self) -> dict[str, Any]:
        """Joint step and every inner loader's state (inner ``state_dict`` gathers ranks where it must)."""
        if self.stamp_key is not None and self._history.committed:
            state = copy.deepcopy(self._history.committed)
            state["loaders"] = {n: dl.globalize(state["loaders"][n]) for n, dl in zip(self.names, self.loaders)}
        else:
            state = {"format": JOINT_FORMAT, "step": self._step, "epoch_step": self._epoch_step,
                     "loaders": {n: dl.state_dict() for n, dl in zip(self.names, self.loaders)}}
        state["fingerprint"] = self.fingerprint()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Args:
        state: From :meth:`state_dict`; a mismatch names the field.
        """
        check_state(state, JOINT_FORMAT, self.fingerprint(), "JointDataflowLoader")
        self._step, self._epoch_step = int(state["step"]), int(state["epoch_step"])
        for name, loader in zip(self.names, self.loaders):
            loader.load_state_dict(state["loaders"][name])
