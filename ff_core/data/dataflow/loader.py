"""DataflowLoader: a ``torch.utils.data.DataLoader`` that wires the four roles (spec §1–2) and resumes exactly.

Every batch is :func:`~ff_core.data.dataflow.lazy.materialize` d in the main process before it is yielded: a worker's
roles may return :class:`~ff_core.data.dataflow.lazy.LazyValue` descriptions (a tensor-parquet row's uncompressed
tensors: which file, which bytes) that are read here instead of crossing in shared memory.

Resume modes (chosen at construction, see docs/dataflow.md):

* ``"global"`` — resumable source + fixed-size batches: the state is one position in the global order, identical on
  every rank; a run may resume under a different world size, worker count or batch size.
* ``"stream"`` — resumable source + a packing batcher: per-(rank, stream) cursors plus the batcher's pending samples;
  exact under the same world size and worker count (both are in the fingerprint).
* ``"epoch"`` — a :class:`SamplerDistributor`: every epoch is one complete traversal sharded by torch's
  ``DistributedSampler`` (the offline trainers' epochs); the state is (epoch, batches delivered in it), the same on
  every rank; exact under the same batch size (in the fingerprint) and any worker count. Under another world size
  the rest of the interrupted epoch (the order less each rank's consumed prefix) is dealt over the new ranks, padded
  as ``DistributedSampler`` pads, and the next epochs are ``DistributedSampler`` epochs of the new size: every
  sample of the epoch is served once across the two runs, besides the padding repeats of each layout.
* ``"none"`` — streaming source, or ``resumable=False``: a resumed run restarts the source.

Bad samples (issue 24): a processor that cannot build a sample (a truncated image) marks it instead of raising in the
worker (whose exception would reach the main process as a ``RuntimeError`` wrapping a worker traceback); the collator
lists the marked ones under :data:`BAD_SAMPLES_KEY` and forms the batch without them. The main process then, when the
batch is delivered (the step that draws the row, whatever the worker count), either raises the first one's own
one-line error (``bad_samples="error"``) or counts and reports them and yields the smaller batch (``"skip"``): the
number of batches per rank, their order and the resume position are those of a run without bad samples.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import signal
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch.utils.data import DataLoader

from .base import BatchCollator, DataDistributor, RawItemProcessor, SampleBatcher
from .batchers import SimpleBatcher
from .collators import DefaultBatchCollator
from .coords import DataParallelCoords
from .distributors import SamplerDistributor
from .lazy import materialize, release
from .pipeline import DataflowStream, Plan
from .state import FORMAT, StateHistory, check_state, merge_rank_states

log = logging.getLogger(__name__)

BAD_SAMPLES_KEY = "bad_samples"
"""Batch key (a dict batch) under which a collator lists the errors of the samples it left out."""
BAD_SAMPLE_POLICIES = ("error", "skip")


def _passthrough(item: Any) -> Any:
    return item


class DataflowLoader(DataLoader):
    """distribute → process → batch → collate, sharded by data-parallel rank × worker, resumable (spec §1).

    Args:
        distributor: Source of raw items (``MapDistributor``, ``MixtureDistributor``, ``IterableDistributor``, …).
        processor: Raw item → sample dict.
        batcher: Samples → groups; give this or ``batch_size``, not both.
        collator: Group → batch; default ``DefaultBatchCollator()``.
        batch_size: Sugar for ``SimpleBatcher(batch_size)`` + ``DefaultBatchCollator()``.
        num_workers: DataLoader worker processes (each runs its own stream).
        coords: Data-parallel coordinates; default :meth:`DataParallelCoords.detect` at iteration time.
        parallel_dims: Passed to ``DataParallelCoords.detect`` when ``coords`` is not given (FSDP+TP layouts).
        steps_per_epoch: Batches per rank per ``iter()``; default: the rest of the source's epoch (mode
            "global") or until the source ends (other modes; required under DDP with packing batchers so every
            rank yields the same count).
        resumable: ``None``: resume whenever the source allows; ``False``: never (streams restart);
            ``True``: like ``None`` but fail if the source is not resumable.
        stamp_key: When set, every batch (a dict) carries its delivery number under this key; call
            :meth:`commit` with it once the model consumed the batch and ``state_dict`` returns that position.
        pin_memory: As for DataLoader.
        prefetch_factor: As for DataLoader (workers only).
        persistent_workers: Must stay ``False``: workers are forked per ``iter()`` from the current position.
        timeout: As for DataLoader.
        multiprocessing_context: As for DataLoader; roles must be picklable under ``spawn``.
        worker_init_fn: As for DataLoader.
        bad_samples: what a delivered batch listing bad samples (:data:`BAD_SAMPLES_KEY`) does: ``"error"`` raises
            the first one's error (a :class:`~ff_core.errors.DatasetError` names ``file:line: field: reason``);
            ``"skip"`` yields the batch without them, counts them (``skipped_samples``, kept in the resume state)
            and passes them to ``on_bad_samples``. A batch with no sample left raises either way.
        on_bad_samples: called as ``on_bad_samples(errors, step)`` with the skipped samples' errors and the delivery
            number of their batch (``"skip"`` only).
    """

    def __init__(
        self,
        distributor: DataDistributor,
        processor: RawItemProcessor,
        batcher: SampleBatcher | None = None,
        collator: BatchCollator | None = None,
        batch_size: int | None = None,
        num_workers: int = 0,
        *,
        coords: DataParallelCoords | None = None,
        parallel_dims: Any = None,
        steps_per_epoch: int | None = None,
        resumable: bool | None = None,
        stamp_key: str | None = None,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        timeout: float = 0,
        multiprocessing_context: Any = None,
        worker_init_fn: Any = None,
        bad_samples: str = "error",
        on_bad_samples: Callable[[list[Any], int], None] | None = None,
    ) -> None:
        if bad_samples not in BAD_SAMPLE_POLICIES:
            raise ValueError(f"DataflowLoader: bad_samples must be one of {BAD_SAMPLE_POLICIES}, found {bad_samples!r}")
        if (batcher is None) == (batch_size is None):
            raise ValueError("DataflowLoader: provide either a batcher= or a batch_size= (exactly one), found "
                             f"batcher={type(batcher).__name__ if batcher else None}, batch_size={batch_size}")
        if persistent_workers:
            raise ValueError("DataflowLoader: persistent_workers=True is not supported: workers are started per "
                             "iter() so that they begin at the loader's current resume position")
        if steps_per_epoch is not None and steps_per_epoch < 1:
            raise ValueError(f"DataflowLoader: steps_per_epoch must be >= 1, found {steps_per_epoch}")
        batcher = SimpleBatcher(batch_size) if batcher is None else batcher  # type: ignore[arg-type]
        self.mode = self._resume_mode(distributor, batcher, resumable)
        if self.mode == "epoch" and steps_per_epoch is not None:
            raise ValueError("DataflowLoader: steps_per_epoch cannot be set over a SamplerDistributor: its epoch is "
                             f"one complete traversal, found steps_per_epoch={steps_per_epoch}")
        self.distributor, self.processor, self.batcher = distributor, processor, batcher
        self.collator = collator or DefaultBatchCollator()
        self.coords, self.parallel_dims = coords, parallel_dims
        self.steps_per_epoch, self.stamp_key = steps_per_epoch, stamp_key
        self.dropped_samples = 0
        self.bad_samples, self.on_bad_samples, self.skipped_samples = bad_samples, on_bad_samples, 0
        self._stream = DataflowStream(distributor, processor, batcher, self.collator)
        self._state: dict[str, Any] = {"format": FORMAT, "mode": self.mode, "step": 0, "epoch": 0,
                                       "epoch_step": 0, "cursor": None, "origin": 0, "streams": {}, "dropped": 0,
                                       "skipped": 0, "segments": []}
        self._history = StateHistory()
        super().__init__(self._stream, batch_size=None, collate_fn=_passthrough, num_workers=num_workers,
                         pin_memory=pin_memory, timeout=timeout,
                         worker_init_fn=functools.partial(_init_worker, worker_init_fn),
                         multiprocessing_context=multiprocessing_context, prefetch_factor=prefetch_factor)

    @staticmethod
    def _resume_mode(distributor: DataDistributor, batcher: SampleBatcher, resumable: bool | None) -> str:
        if isinstance(distributor, SamplerDistributor):
            if resumable is False:
                raise ValueError("DataflowLoader: a SamplerDistributor always resumes; resumable=False is refused")
            if batcher.fixed_batch_size is None or getattr(batcher, "drop_last", False):
                raise ValueError(f"DataflowLoader: a SamplerDistributor is batched in order with a final partial batch "
                                 f"(DataLoader semantics); use batch_size= or SimpleBatcher(drop_last=False), found "
                                 f"{type(batcher).__name__}")
            return "epoch"
        if resumable is False or (not distributor.resumable and resumable is None):
            return "none"
        if not distributor.resumable:
            raise ValueError(f"DataflowLoader: resumable=True but {type(distributor).__name__} cannot fast-forward "
                             "(it has no cursor); use a MapDistributor or pass resumable=None/False")
        if not batcher.resumable:
            raise ValueError(
                f"DataflowLoader: {type(batcher).__name__} over a resumable {type(distributor).__name__} cannot "
                "resume safely: it does not declare the SampleBatcher resume contract (its pulled-but-unbatched "
                "samples cannot be recorded, so a resume would skip or repeat them). Use SimpleBatcher, "
                "PoolPackingBatcher or SequentialPackingBatcher, implement the contract and set resumable = True "
                "on the batcher, or pass resumable=False to the loader")
        return "global" if batcher.fixed_batch_size else "stream"

    # -- coordinates ---------------------------------------------------------------------------------------------
    def resolve_coords(self) -> DataParallelCoords:
        """The data-parallel coordinates in use: the injected ones, else detected now."""
        return self.coords if self.coords is not None else DataParallelCoords.detect(self.parallel_dims)

    @property
    def num_streams(self) -> int:
        """Streams per rank: one per worker, or one in the main process."""
        return max(1, self.num_workers)

    # -- iteration -----------------------------------------------------------------------------------------------
    def _plan(self) -> Plan:
        c, st = self.resolve_coords(), self._state
        plan = Plan(self.mode, c.rank, c.world_size, self.num_streams, None, st["step"], epoch=st["epoch"])
        if self.steps_per_epoch is not None:
            plan.steps = self.steps_per_epoch - st["epoch_step"]
        if self.mode == "global":
            plan.cursor = st["cursor"]
            if self.steps_per_epoch is None:
                pos = int((st["cursor"] or {}).get("position", 0))
                length = self.distributor.epoch_length  # type: ignore[attr-defined]
                per_step = c.world_size * self.batcher.fixed_batch_size  # type: ignore[operator]
                # Epoch boundaries are soft: the last step of an epoch runs into the next epoch's order, so every
                # batch is full and every rank yields the same count (spec §6's padding is not needed).
                plan.steps = math.ceil(((pos // length + 1) * length - pos) / per_step)
        elif self.mode == "stream":
            plan.origin, plan.streams = st["origin"], st["streams"]
        elif self.mode == "epoch":
            B, segments = self.batcher.fixed_batch_size, self._segments()
            if segments:  # resumed onto another world size: the rest of the epoch, laid out over this one
                rest = len(self.distributor.remaining_order(st["epoch"], segments))  # type: ignore[attr-defined]
                per_epoch = math.ceil(math.ceil(rest / c.world_size) / B)  # type: ignore[operator]
            else:
                per_epoch = self.distributor.batches_per_epoch(c.world_size, B)  # type: ignore[attr-defined]
            plan.segments = segments
            plan.epoch_step = st["epoch_step"] - sum(s["batches"] for s in st["segments"])
            plan.steps = per_epoch - plan.epoch_step
        return plan

    def _segments(self) -> tuple[tuple[int, int], ...]:
        """Mode "epoch": the current epoch's earlier layouts as ``(W, samples each rank took)``."""
        B = self.batcher.fixed_batch_size
        return tuple((s["world"], s["batches"] * B) for s in self._state["segments"])  # type: ignore[operator]

    @property
    def epoch_step(self) -> int:
        """Batches of the current loader epoch already delivered (restored by ``load_state_dict``)."""
        return int(self._state["epoch_step"])

    def __len__(self) -> int:
        steps = self._plan().steps
        if steps is None:
            raise TypeError(f"DataflowLoader in resume mode {self.mode!r} has no length: set steps_per_epoch")
        return steps

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        plan = self._plan()
        self._stream.plan = plan
        delivered = 0
        try:
            for stamp, batch in self._worker_batches():
                batch = materialize(batch)  # values a worker only described are read here, in the main process
                bad = batch.pop(BAD_SAMPLES_KEY, None) if isinstance(batch, dict) else None
                if bad and (self.bad_samples == "error" or not batch):
                    raise self._bad_error(bad, empty=not batch)
                delivered += 1
                self._record(stamp, plan, last=plan.steps is not None and delivered == plan.steps)
                if bad:
                    self._skip(bad)
                if self.stamp_key is not None:
                    batch[self.stamp_key] = self._state["step"]
                yield batch
        finally:  # exhausted or abandoned: close the files the lazy values were read from
            release()
        if plan.steps is None:  # the source ended: the epoch is over
            self._state["epoch"] += 1
            self._state["epoch_step"] = 0

    def _worker_batches(self) -> Iterator[tuple[dict[str, Any], Any]]:
        # The DataLoader machinery: workers (or the main process) running DataflowStream, visited round-robin.
        return super().__iter__()

    def _record(self, stamp: Mapping[str, Any], plan: Plan, last: bool) -> None:
        st = self._state
        st["step"] += 1
        st["epoch_step"] += 1
        st["dropped"] += stamp["dropped"]
        self.dropped_samples += stamp["dropped"]
        if self.mode == "global":
            st["cursor"] = stamp["cursor"]
        elif self.mode == "stream":
            st["streams"][stamp["stream"]] = {"cursor": stamp["cursor"], "pending": stamp["pending"]}
        if last:
            st["epoch"] += 1
            st["epoch_step"] = 0
            st["segments"] = []
        if self.stamp_key is not None:
            self._history.record(st["step"], st)

    def _bad_error(self, bad: list[Any], empty: bool) -> Exception:
        """The error to raise for a delivered batch's bad samples: the first one's own (its one line); under
        ``"skip"`` a batch none of whose samples is left is also said to be why (on the log, before it)."""
        if empty and self.bad_samples == "skip":
            log.error("every sample of this batch is bad (%d of them): bad_samples='skip' keeps the number of batches, "
                      "so it cannot leave the whole batch out", len(bad))
        return bad[0]

    def _skip(self, bad: list[Any]) -> None:
        self._state["skipped"] += len(bad)
        self.skipped_samples += len(bad)
        if self.stamp_key is not None:  # the committed history holds the count as of each delivery
            self._history.record(self._state["step"], self._state)
        if self.on_bad_samples is not None:
            self.on_bad_samples(list(bad), self._state["step"])

    def commit(self, seq: int) -> None:
        """Mark the batch stamped ``seq`` (under ``stamp_key``) as consumed; ``state_dict`` then returns the position
        right after it, whatever the consumer has prefetched since.

        Args:
            seq: The value found under ``stamp_key`` in a delivered batch.
        """
        self._history.commit(seq)

    # -- state ---------------------------------------------------------------------------------------------------
    def fingerprint(self) -> dict[str, Any]:
        """What a saved state must match to be loaded here (STYLE 13)."""
        fp: dict[str, Any] = {"mode": self.mode, "distributor": self.distributor.fingerprint()}
        if self.mode == "stream":
            c = self.resolve_coords()
            fp.update(batcher=self.batcher.fingerprint(), dp_world_size=c.world_size, num_workers=self.num_streams)
        elif self.mode == "epoch":  # the world size is in the state: another one re-deals the epoch's rest
            fp.update(batcher=self.batcher.fingerprint())
        return fp

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's state (in mode "stream" only its own streams); see :func:`merge_rank_states`."""
        base = self._history.committed if self.stamp_key is not None and self._history.committed else self._state
        state = copy.deepcopy(base)
        state["fingerprint"] = self.fingerprint()
        if self.mode == "epoch":
            state["world"] = self.resolve_coords().world_size
        if self.mode == "stream":
            rank = self.resolve_coords().rank
            state["streams"] = {k: v for k, v in state["streams"].items() if k.split("/")[0] == str(rank)}
        return state

    def state_dict(self) -> dict[str, Any]:
        """A state from which every rank resumes (a collective over the DP group in mode "stream")."""
        return self.globalize(self.local_state_dict())

    def globalize(self, local: dict[str, Any]) -> dict[str, Any]:
        """Turn this rank's state into one that restores every rank (gathers over the DP group in mode "stream").

        Args:
            local: From :meth:`local_state_dict`.
        """
        coords = self.resolve_coords()
        if self.mode != "stream" or coords.world_size == 1:
            return local
        return merge_rank_states(coords.all_gather(local))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``; raises ``ValueError`` naming the field when it belongs to another order.

        Args:
            state: From :meth:`state_dict` (of any rank in mode "global").
        """
        if self.mode == "none" or state.get("mode") == "none":
            log.warning("DataflowLoader: the source is not resumable (mode 'none'); restarting it from the start")
            return
        state = copy.deepcopy(dict(state))
        if self.mode == "epoch" and isinstance(state.get("fingerprint"), Mapping):
            # States written before the world size left the fingerprint (ff.dataflow/1 all the same) hold it there.
            saved_world = state["fingerprint"].pop("dp_world_size", None)
            state.setdefault("world", saved_world)
        check_state(state, FORMAT, self.fingerprint(), "DataflowLoader")
        self._state = state
        self._state.pop("fingerprint", None)
        if self.mode == "epoch":
            self._reshard(self._state.pop("world", None))
        self.dropped_samples = self._state.get("dropped", 0)
        self._state.setdefault("skipped", 0)  # a state saved before bad samples were counted
        self.skipped_samples = self._state["skipped"]
        self._history = StateHistory()

    def _reshard(self, saved_world: int | None) -> None:
        """Mode "epoch": a state saved under ``saved_world`` ranks, loaded under another number, keeps the samples
        the epoch served so far (recorded as a segment) and deals the rest over this world size."""
        st, world = self._state, self.resolve_coords().world_size
        st.setdefault("segments", [])
        if saved_world is None or saved_world == world:
            return
        done = st["epoch_step"] - sum(s["batches"] for s in st["segments"])
        if done:
            st["segments"].append({"world": int(saved_world), "batches": done})
        log.info("DataflowLoader: resuming epoch %d, step %d of it, on %d data-parallel ranks (saved on %d): the "
                 "epoch's remaining samples are dealt over the new ranks", st["epoch"], st["epoch_step"], world,
                 saved_world)


def _init_worker(user_init: Any, worker_id: int) -> None:
    """Workers ignore SIGTERM: a scheduler signals every process of a job (SLURM), and torch's worker handler would
    kill the worker, failing the main process's next fetch; the main process decides (ff_core.preemption), and its
    workers end with it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if user_init is not None:
        user_init(worker_id)
