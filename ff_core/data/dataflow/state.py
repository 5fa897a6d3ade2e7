"""Resume state: a plain dict with an order fingerprint, checked on load (STYLE 13; spec §5 without env vars).

Layout of a ``DataflowLoader`` state (``format`` ``ff.dataflow/1``)::

    {"format", "mode": "global" | "stream" | "epoch" | "none", "fingerprint": {...},
     "step": batches delivered per rank so far, "epoch", "epoch_step",
     "cursor": global-order cursor state after the last delivered global batch   (mode "global"),
     "origin", "streams": {"rank/stream": {"cursor", "pending"}}                 (mode "stream"),
     "dropped": samples dropped by the batcher on delivered batches}

Mode "global" is the same on every rank, so rank 0's copy (all Lightning saves) restores every rank, under any
world size or worker count. Mode "epoch" needs only ``epoch`` and ``epoch_step`` (each rank's DistributedSampler
indices follow from them): the same on every rank too, under the same world size. Mode "stream" holds every
rank's streams; :func:`merge_rank_states` builds it from the per-rank states (``DataflowLoader.state_dict``
gathers them over the data-parallel group).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from ff_core.errors import ResumeError

FORMAT = "ff.dataflow/1"
JOINT_FORMAT = "ff.dataflow.joint/1"


def _first_difference(saved: Any, expected: Any, path: str) -> tuple[str, Any, Any] | None:
    if isinstance(saved, Mapping) and isinstance(expected, Mapping):
        for key in sorted(set(saved) | set(expected), key=str):
            sub = f"{path}.{key}" if path else str(key)
            if key not in saved or key not in expected:
                return sub, saved.get(key, "<absent>"), expected.get(key, "<absent>")
            diff = _first_difference(saved[key], expected[key], sub)
            if diff:
                return diff
        return None
    if isinstance(saved, (list, tuple)) and isinstance(expected, (list, tuple)):
        saved, expected = list(saved), list(expected)
    return None if saved == expected else (path, saved, expected)


def check_state(state: Mapping[str, Any], fmt: str, fingerprint: Mapping[str, Any], owner: str) -> None:
    """Refuse a state saved for a different order; the message names the differing field.

    Args:
        state: The saved state dict.
        fmt: Expected ``format`` value.
        fingerprint: This loader's fingerprint.
        owner: Name used in the message (e.g. ``"DataflowLoader('train')"``).
    """
    if not isinstance(state, Mapping) or state.get("format") != fmt:
        found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
        raise ResumeError(f"{owner}.load_state_dict: expected a state with format={fmt!r}, found {found!r}")
    diff = _first_difference(state.get("fingerprint", {}), fingerprint, "")
    if diff:
        field, saved, expected = diff
        raise ResumeError(f"{owner}.load_state_dict: the checkpoint was saved for a different data order: "
                          f"fingerprint field {field!r} is {saved!r} in the checkpoint but {expected!r} in this "
                          f"loader{_records_hint(field)}; resuming would repeat or skip samples")


def _records_hint(field: str) -> str:
    """What a difference in the records' identity (``distributor.records.<dataset>.<rows|sha256>``) means."""
    parts = field.split(".")
    if "records" not in parts or parts.index("records") + 1 >= len(parts):
        return ""
    dataset = parts[parts.index("records") + 1]
    if parts[-1] == "rows":
        return f" (dataset {dataset!r} has a different number of training rows than when the checkpoint was written)"
    return (f" (the training records of dataset {dataset!r} changed since the checkpoint was written: a row edited, "
            "added, removed or moved, or a prompt, condition, target, chosen or rejected media file replaced in "
            "place)")


def merge_rank_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Combine every data-parallel rank's state (mode "stream") into one that restores all of them.

    Args:
        states: One state per rank, e.g. from ``DataflowLoader.local_state_dict`` on each rank.
    """
    if not states:
        raise ValueError("merge_rank_states: no states given")
    merged = copy.deepcopy(dict(states[0]))
    for rank, state in enumerate(states[1:], start=1):
        for key in ("fingerprint", "step", "epoch", "mode"):
            if state.get(key) != merged.get(key):
                raise ValueError(f"merge_rank_states: rank {rank} has {key}={state.get(key)!r} but rank 0 has "
                                 f"{merged.get(key)!r}; the states were not taken at the same step")
        if merged.get("streams") is not None:
            merged["streams"].update(copy.deepcopy(state.get("streams") or {}))
        merged["dropped"] = merged.get("dropped", 0) + state.get("dropped", 0)
    return merged


class StateHistory:
    """Snapshots of a loader's state per delivered batch, so that the state of the batch the *model* consumed can
    be saved even when a consumer (Lightning's fetcher) runs ahead of it.

    Args:
        limit: Most snapshots kept; older ones are dropped.
    """

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self.snapshots: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self.committed: dict[str, Any] | None = None

    def record(self, seq: int, state: Mapping[str, Any]) -> None:
        """Remember ``state`` as the state after delivered batch ``seq``.

        Args:
            seq: Delivered-batch sequence number.
            state: The loader state right after that batch.
        """
        self.snapshots[seq] = copy.deepcopy(dict(state))
        while len(self.snapshots) > self.limit:
            self.snapshots.popitem(last=False)

    def commit(self, seq: int) -> None:
        """Mark batch ``seq`` as consumed: it becomes the saved position.

        Args:
            seq: A sequence number stamped on a delivered batch.
        """
        if seq not in self.snapshots:
            raise KeyError(f"StateHistory.commit: batch {seq} is not among the last {self.limit} delivered batches")
        self.committed = self.snapshots[seq]
        for old in [s for s in self.snapshots if s < seq]:
            del self.snapshots[old]
