"""ff's dataflow roles for training records: record table → sample processor → batch collator.

The condition side (prompts and decoded condition media, :func:`~ff_core.data.media.conditions.condition_input`) is
preprocessed once in the main process (``adapter.preprocess``) and held in :class:`ConditionedRecords`; the supervision
side (a demonstration's ``target``, a preference's ``chosen`` and ``rejected``) is decoded by :class:`RecordProcessor`
inside the loader's workers, on every access, fitted to the adapter's output geometry and never cached (spec
dataset-guide: "Condition cache and target lifecycle"). A resumed run never calls the processor for the records it skips
(docs/dataflow.md, "Resume").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ff_core.contracts import MediaGeometry
from ff_core.data.cache.collation import check_rules, collate_conditions
from ff_core.data.dataflow import BatchCollator, GroupedItem, RawItemProcessor
from ff_core.data.dataflow.loader import BAD_SAMPLES_KEY
from ff_core.data.media.conditions import condition_input as condition_input  # re-exported: its home before
from ff_core.data.media.geometry import decode_target
from ff_core.data.records import CANDIDATE_FIELDS, Record
from ff_core.errors import DatasetError


@dataclass(frozen=True)
class ConditionedRecord:
    """One raw item of the training order: a record, its position in the split and its preprocessed condition.

    Attributes:
        index: position of the record in the data module's concatenated split (stable for one dataset config).
        record: the validated record (target media are paths, not pixels).
        condition: CPU tensors from ``adapter.preprocess``.
    """

    index: int
    record: Record
    condition: dict[str, torch.Tensor]


class ConditionedRecords:
    """Map-style table of records and their preprocessed conditions (what ``MapDistributor`` shuffles).

    Args:
        records: the split's records, in data-module order.
        conditions: one preprocessed condition per record.
    """

    def __init__(self, records: list[Record], conditions: list[dict[str, torch.Tensor]]) -> None:
        if len(records) != len(conditions):
            raise ValueError(f"ConditionedRecords: {len(records)} records but {len(conditions)} conditions")
        self.records, self.conditions = records, conditions

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> ConditionedRecord:
        return ConditionedRecord(index, self.records[index], self.conditions[index])


def candidate_keys(supervision: str | None) -> tuple[str, ...]:
    """The batch keys of a supervision's candidates, in ``Record.candidates`` order: ``("target",)`` for a
    demonstration, ``("chosen", "rejected")`` for a preference; a generation row (``None``) keeps an empty ``target``.
    """
    return tuple(f.rsplit(".", 1)[1] for f in CANDIDATE_FIELDS.get(supervision or "", ("supervision.target",)))


#: Every candidate key a batch may carry.
CANDIDATE_KEYS: tuple[str, ...] = tuple(dict.fromkeys(k for s in CANDIDATE_FIELDS for k in candidate_keys(s)))


class RecordProcessor(RawItemProcessor):
    """Decode every candidate a record's supervision carries beside its preprocessed condition: a demonstration's
    ``target``, a preference's ``chosen`` and ``rejected`` (see :func:`candidate_keys`).

    Runs inside DataLoader workers; candidates are decoded fresh on every access, fitted to ``geometry`` (a video
    output with a frame count: only its clip's window decoded, on its frame grid; so a batch never mixes sizes, and
    both arms of a preference pair share one latent shape) and never cached. A candidate that cannot be decoded (a
    truncated PNG or MP4, a header-only WAV: a :class:`~ff_core.errors.DatasetError` naming ``file:line: field``)
    does not raise in the worker: the sample carries the error under ``"bad_sample"`` and no candidates, and
    :class:`SampleCollator` lists it under ``bad_samples`` for the loader's policy (``data.bad_samples``).

    Args:
        geometry: per output, in the contract's output order, the geometry its decoded target is fitted to
            (``adapter.output_geometry()``); ``None`` or a missing entry keeps the target as decoded.
        buckets: mixed-geometry training (:mod:`ff_core.data.media.buckets`): the bucket geometries; a record's first
            output is fitted to its bucket's instead, and the sample carries ``"bucket"`` (for ``BucketBatcher``).
        assignment: with ``buckets``: each record's bucket, by record index (``ConditionedRecord.index``).
    """

    def __init__(
        self,
        geometry: Sequence[MediaGeometry | None] = (),
        buckets: Sequence[MediaGeometry] | None = None,
        assignment: Sequence[int] | None = None,
    ) -> None:
        if (buckets is None) != (assignment is None):
            raise ValueError("RecordProcessor: buckets and assignment go together")
        self.geometry = tuple(geometry)
        self.buckets = tuple(buckets) if buckets is not None else None
        self.assignment = tuple(assignment) if assignment is not None else None

    def process(self, item: ConditionedRecord | GroupedItem) -> dict[str, Any]:
        if isinstance(item, GroupedItem):  # a GRPO (prompt, sample) pair: the row, tagged with its group id
            return {**self.process(item.item), "group": item.group}
        record = item.record
        sample = {"index": item.index, "prompt": record.prompt, "condition": item.condition,
                  "metadata": record.metadata}
        bucket = self.assignment[item.index] if self.assignment is not None else None
        if bucket is not None:
            sample["bucket"] = bucket
        candidates = record.candidates or ((),)  # a generation row: an empty target
        try:
            decoded = {key: [decode_target(m, self._geometry(i, bucket), referenced_by=record.where)
                             for i, m in enumerate(candidate)]
                       for key, candidate in zip(candidate_keys(record.supervision), candidates)}  # fmt: skip
        except DatasetError as exc:  # carried to the main process as data: see DataflowLoader's bad_samples
            return sample | {"bad_sample": exc}
        return sample | decoded

    def _geometry(self, output: int, bucket: int | None = None) -> MediaGeometry | None:
        if bucket is not None and output == 0:
            return self.buckets[bucket]
        return self.geometry[output] if output < len(self.geometry) else None


class SampleCollator(BatchCollator):
    """The batch format objectives and adapters consume.

    ``index``: tensor of record indices; ``prompt``: list of str; ``condition``: collated key by key by the adapter's
    ``condition_collation`` (:func:`~ff_core.data.cache.collation.collate_conditions`: stacked by default, or
    padded with a ``<key>_mask``, or kept as a list); ``target`` (demonstrations), or ``chosen`` and ``rejected``
    (preferences): per-sample lists of decoded media, in the contract's output order (sizes may differ between
    samples); ``metadata``: each record's reward metadata (a legacy row's extra columns, a V2 record's
    ``metadata``), as Flow-Factory hands every sample's non-model columns to its rewards; ``group`` (GRPO batches
    only): each sample's prompt-group id, a tensor.

    Samples that carry a ``"bad_sample"`` error (:class:`RecordProcessor`) are left out of the batch and their errors
    listed under ``bad_samples`` (a batch of bad samples only is that key alone), for the loader to raise or skip.

    Args:
        condition_collation: the adapter's ``condition_collation`` (condition key -> ``stack`` | ``pad`` | ``list``).
    """

    def __init__(self, condition_collation: Mapping[str, str] | None = None) -> None:
        self.condition_collation = dict(condition_collation or {})
        check_rules(self.condition_collation, "SampleCollator")

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        bad = [s["bad_sample"] for s in samples if "bad_sample" in s]
        if bad:
            good = [s for s in samples if "bad_sample" not in s]
            return {**(self.collate(good) if good else {}), BAD_SAMPLES_KEY: bad}
        keys = [k for k in CANDIDATE_KEYS if k in samples[0]]
        for s in samples[1:]:
            found = [k for k in CANDIDATE_KEYS if k in s]
            if found != keys:  # training sources are homogeneous (spec: "Preference supervision")
                raise ValueError(f"a batch mixes supervision types: record {samples[0]['index']} carries {keys}, "
                                 f"record {s['index']} {found}")
        batch = {
            "index": torch.tensor([s["index"] for s in samples]),
            "prompt": [s["prompt"] for s in samples],
            "condition": collate_conditions([s["condition"] for s in samples], self.condition_collation,
                                            [s["index"] for s in samples]),
            "metadata": [s["metadata"] for s in samples],
        }
        if "group" in samples[0]:
            batch["group"] = torch.tensor([s["group"] for s in samples])
        return batch | {k: [s[k] for s in samples] for k in keys}


def process_and_collate(
    items: list[ConditionedRecord], condition_collation: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``collate_fn`` of a plain ``DataLoader`` over :class:`ConditionedRecords` (the validation loader; bind
    ``condition_collation`` with ``functools.partial``).

    Args:
        items: the raw items of one batch.
        condition_collation: the adapter's ``condition_collation``.
    """
    processor = RecordProcessor()
    batch = SampleCollator(condition_collation).collate([processor.process(item) for item in items])
    bad = batch.pop(BAD_SAMPLES_KEY, None)
    if bad:  # evaluation has no skip policy: the file is named, as before
        raise bad[0]
    return batch
