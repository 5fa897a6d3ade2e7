"""A record's condition side decoded for ``adapter.preprocess``: its prompts and condition media in record order,
each bound to its contract slot. The condition cache builds from it (:mod:`ff_core.data.cache.store`), and so does
training without a cache."""

from __future__ import annotations

from ff_core.contracts import ConditionInput, PipelineIOContract
from ff_core.data.media.decode import decode_media
from ff_core.data.records import Record
from ff_core.data.records.validation import bind_slots
from ff_core.errors import DatasetError, raise_collected

#: The declared per-item fields :func:`condition_input` passes on beside the decoded media, when a record sets them.
DECLARED_KEYS = ("fps", "sample_rate", "audio_path")


def condition_input(record: Record, contract: PipelineIOContract) -> ConditionInput:
    """The input side of one record for ``adapter.preprocess``: its prompts and its decoded condition media.

    Media keep record order (``inputs``, or legacy Ref2VA ``references``), each ``{"type", "data", "path", "slot"?}``
    plus the record's declared ``fps`` / ``sample_rate`` / ``audio_path`` where it wrote them (see
    :class:`~ff_core.adapter.ConditionInput`). ``slot`` is the binding contract validation resolves
    (:func:`~ff_core.data.records.validation.bind_slots`): an unslotted item that fills a declared slot carries that
    name.

    Args:
        record: a record already checked against ``contract``.
        contract: the adapter's IO contract.
    """
    items = (*record.inputs, *record.references)
    slot_of: dict[int, str] = {}
    if contract.slots:
        bound, problems = bind_slots(record.inputs, contract)
        raise_collected([DatasetError(record.source, record.line, field, reason) for field, reason in problems])
        slot_of = {id(item): name for name, item in bound.items()}
    media = []
    for item in items:
        entry = {"type": item.type.value, "data": decode_media(item, referenced_by=record.where), "path": item.path}
        if id(item) in slot_of:
            entry["slot"] = slot_of[id(item)]
        # The record's own words, for an adapter that keeps them (H3 Ref2VA's reference_manifest): decoding reports
        # the file's clocks beside the declared ones but not which file a soundtrack came from.
        entry.update({k: v for k in DECLARED_KEYS if (v := getattr(item, k)) is not None})
        media.append(entry)
    return ConditionInput(record.prompt, record.negative_prompt, media)
