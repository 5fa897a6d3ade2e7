"""Records checked against the selected adapter's IO contract, before any weights load.

Spec: dataset-guide, "Demonstration supervision": the offline loader validates each record's exact output
sequence, rates, input cardinality and batch capability before preprocessing or training; "Offline V2
records": an explicitly slotted item reserves that slot, unslotted items fill the remaining slots in
declaration order, and duplicate, unknown and wrong-media-type slots fail. Format rules (keys, types, rates)
are checked earlier, by the parsers in :mod:`ff_core.data.records`; this module holds every rule that depends
on which adapter was chosen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ff_core.contracts import MediaType, NegativePrompt, PipelineIOContract
from ff_core.data.records.base import CANDIDATE_FIELDS, MediaItem, Record
from ff_core.errors import ContractError, DatasetError, DatasetWarning, raise_collected

Problem = tuple[str, str]
"""``(field, reason)`` of one contract violation inside a record."""


def check_batch_size(
    contract: PipelineIOContract,
    adapter_name: str,
    per_device_batch_size: int,
    *,
    preprocessing_batch_size: int | None = None,
    eval_batch_size: int | None = None,
) -> None:
    """Batch capability, e.g. MiniMax H3 runs with B=1 only (spec: "MiniMax H3 datasets").

    Args:
        contract: the adapter's contract.
        adapter_name: for the message.
        per_device_batch_size: ``data.per_device_batch_size``.
        preprocessing_batch_size: ``data.preprocessing_batch_size``, checked too when given.
        eval_batch_size: ``data.eval_batch_size``, checked too when given.
    """
    limit = contract.max_batch_size
    if limit is None:
        return
    sizes = {
        "per_device_batch_size": per_device_batch_size,
        "preprocessing_batch_size": preprocessing_batch_size,
        "eval_batch_size": eval_batch_size,
    }
    problems = [
        f"data.{key}={value}, but adapter {adapter_name!r} supports at most {limit} sample(s) per batch"
        for key, value in sizes.items()
        if value is not None and value > limit
    ]
    if problems:
        raise ContractError("\n".join(problems))


def bind_slots(items: Sequence[MediaItem], contract: PipelineIOContract) -> tuple[dict[str, MediaItem], list[Problem]]:
    """Bind condition items to the contract's slots.

    An explicitly slotted item reserves its slot; unslotted items then fill the remaining slots in
    declaration order (spec: "Offline V2 records"). Legacy rows have no ``slot`` key, so their ``images``
    fill the slots positionally (H3 FL2VA: one image is the first frame, two are first then last).

    Returns:
        ``(slot name -> item, problems)``; the bindings are in declaration order.
    """
    names = ", ".join(s.name for s in contract.slots) or "none"
    bound: dict[str, MediaItem] = {}
    problems: list[Problem] = []
    for item in (m for m in items if m.slot is not None):
        spec = contract.slot(item.slot)
        field = f"{item.origin}.slot"
        if spec is None:
            problems.append((field, f"unknown slot {item.slot!r} (this adapter's slots: {names})"))
        elif item.slot in bound:
            problems.append((field, f"duplicate slot {item.slot!r}: already bound by {bound[item.slot].origin}"))
        elif spec.type is not item.type:
            problems.append((field, f"slot {item.slot!r} takes {_a(spec.type)}, found {_a(item.type)}"))
        else:
            bound[item.slot] = item
    free = [s for s in contract.slots if s.name not in bound]
    unslotted = [m for m in items if m.slot is None]
    for item in unslotted:
        if not free:
            problems.append((
                item.origin,
                f"{len(items)} condition item(s), but this adapter takes at most {len(contract.slots)} ({names})",
            ))
            break
        spec = free.pop(0)
        if spec.type is not item.type:
            reason = f"fills slot {spec.name!r}, which takes {_a(spec.type)}, found {_a(item.type)}"
            problems.append((item.origin, reason))
        else:
            bound[spec.name] = item
    return {s.name: bound[s.name] for s in contract.slots if s.name in bound}, problems


def _slot_problems(record: Record, contract: PipelineIOContract) -> list[Problem]:
    bound, problems = bind_slots(record.inputs, contract)
    if problems:
        return problems
    field = record.input_field
    for spec in contract.slots:
        if spec.required and spec.name not in bound:
            problems.append((field, f"required slot {spec.name!r} ({spec.type}) is not bound"))
    if not problems and len(bound) < contract.min_bound_slots:
        names = ", ".join(s.name for s in contract.slots)
        problems.append((field, f"bind at least {contract.min_bound_slots} of the slots {names}; found {len(bound)}"))
    return problems


def _reference_problems(record: Record, contract: PipelineIOContract) -> list[Problem]:
    spec = contract.references
    assert spec is not None
    if record.schema == "legacy" and record.inputs:
        return [(_column(record.inputs[0]), "this adapter takes an ordered 'references' array, not media columns")]
    items = record.inputs if record.schema == "v2" else record.references
    field = "input.media" if record.schema == "v2" else "references"
    problems = [(f"{m.origin}.slot", "this adapter has no slots: references bind by list order")
                for m in items if m.slot]
    allowed = ", ".join(sorted(t.value for t in spec.types))
    problems += [(f"{m.origin}.type", f"{m.type} is not a reference type here ({allowed})")
                 for m in items if m.type not in spec.types]
    if spec.max_image_aspect is not None:
        problems += [p for m in items if m.type is MediaType.IMAGE for p in _aspect_problems(m, spec.max_image_aspect)]
    count = spec.count_problem([m.type for m in items])
    return problems + ([(field, count)] if count else [])


def _aspect_problems(item: MediaItem, most: float) -> list[Problem]:
    """An image reference outside ``1:most``..``most:1`` (``ReferenceSpec.max_image_aspect``), read from the file's
    header (Pillow decodes no pixels to report the size); an unreadable file is left to decoding, which names it."""
    from PIL import Image

    try:
        with Image.open(item.path) as image:
            width, height = image.size
    except (OSError, Image.DecompressionBombError):  # decoding names the file and the problem
        return []
    if width <= most * height and height <= most * width:
        return []
    return [(item.field_of("path") or f"{item.origin}.path",
             f"{item.path}: a {width}x{height} image; reference images must lie within 1:{most:g} and {most:g}:1 "
             "(crop or pad it)")]  # fmt: skip


def _group_problems(record: Record, contract: PipelineIOContract) -> list[Problem]:
    spec = contract.grouped
    assert spec is not None
    items = record.inputs
    problems = [(f"{m.origin}.slot", "this adapter has no slots: grouped inputs bind by list order")
                for m in items if m.slot]
    problems += [(m.origin, f"this adapter takes {spec.type} inputs only, found {_a(m.type)}")
                 for m in items if m.type is not spec.type]
    hi = spec.max_count
    if len(items) < spec.min_count or (hi is not None and len(items) > hi):
        want = f"{spec.min_count}-{hi}" if hi is not None else f"at least {spec.min_count}"
        field = "input.media" if record.schema == "v2" else f"{spec.type}s"
        problems.append((field, f"needs {want} {spec.type}(s), found {len(items)}"))
    return problems


def _input_problems(record: Record, contract: PipelineIOContract) -> list[Problem]:
    # A legacy row's references with an adapter that takes none are metadata, not input (record_warnings).
    if contract.references is not None:
        return _reference_problems(record, contract)
    if contract.slots:
        return _slot_problems(record, contract)
    if contract.grouped is not None:
        return _group_problems(record, contract)
    if record.inputs:
        field = "input.media" if record.schema == "v2" else _column(record.inputs[0])
        return [(field, f"this adapter takes no condition media (prompt only), found {_types(record.inputs)}")]
    return []


def _output_problems(record: Record, contract: PipelineIOContract) -> list[Problem]:
    problems: list[Problem] = []
    expected = contract.output_types
    for candidate, field in zip(record.candidates, CANDIDATE_FIELDS.get(record.supervision or "", ())):
        found = tuple(m.type for m in candidate)
        if found != expected:
            want = ", ".join(t.value for t in expected)
            problems.append((f"{field}.media", f"expected outputs ({want}) in this order, found ({_types(candidate)})"))
            continue
        for i, (item, spec) in enumerate(zip(candidate, contract.outputs)):
            if spec.requires_fps and item.fps is None:
                problems.append((f"{field}.media[{i}].fps", "required by this adapter's video output"))
            if spec.requires_sample_rate and item.sample_rate is None:
                problems.append((f"{field}.media[{i}].sample_rate", "required by this adapter's audio output"))
    return problems


def record_errors(record: Record, contract: PipelineIOContract) -> list[DatasetError]:
    """Every way ``record`` violates ``contract`` (empty when it conforms)."""
    problems: list[Problem] = []
    if record.negative_prompt is not None and contract.negative_prompt is NegativePrompt.REJECTED:
        # The same CFG policy for the legacy column and V2 input.negative_prompt (a null one is absent).
        field = record.field_path("negative_prompt")
        problems.append((field, f"this adapter has no classifier-free guidance; remove {field}"))
    if contract.prompt_required and not record.prompt.strip():
        problems.append((record.field_path("prompt"), "this adapter needs a prompt"))
    problems += _input_problems(record, contract)
    problems += _output_problems(record, contract)
    return [DatasetError(record.source, record.line, f, reason) for f, reason in problems]


def record_warnings(record: Record, contract: PipelineIOContract, adapter_name: str) -> list[DatasetWarning]:
    """What :func:`conform` will keep as metadata rather than refuse: a legacy row's ``references`` when the
    adapter takes no ordered references (Flow-Factory passes only the columns a pipeline preprocesses and packs
    every other one into the sample's metadata).

    Args:
        record: a record of any schema.
        contract: the adapter's contract.
        adapter_name: for the message.
    """
    if not record.references or contract.references is not None:
        return []
    reason = f"kept as metadata, not a model input: adapter {adapter_name!r} takes no ordered references"
    return [DatasetWarning(record.source, record.line, "references", reason)]


def conform(record: Record, contract: PipelineIOContract) -> Record:
    """``record`` as the adapter will see it: references the adapter does not consume move to
    ``metadata["references"]`` (type and resolved paths, in order); anything else is returned unchanged.

    Args:
        record: a record that passed :func:`record_errors`.
        contract: the adapter's contract.
    """
    if not record.references or contract.references is not None:
        return record
    metadata = {**record.metadata, "references": [_as_json(m) for m in record.references]}
    return dataclasses.replace(record, references=(), metadata=metadata)


def check_records(records: Sequence[Record], contract: PipelineIOContract) -> None:
    """Raise :class:`~ff_core.errors.DatasetErrors` listing every contract violation of every record."""
    raise_collected([e for r in records for e in record_errors(r, contract)])


def _as_json(item: MediaItem) -> dict[str, Any]:
    out: dict[str, Any] = {"type": item.type.value, "path": str(item.path)}
    optional = {"fps": item.fps, "audio_path": item.audio_path and str(item.audio_path),
                "sample_rate": item.sample_rate}
    return out | {k: v for k, v in optional.items() if v is not None}


def _column(item: MediaItem) -> str:
    return item.origin.split("[", 1)[0]


def _a(mtype: MediaType) -> str:
    return f"{'an' if mtype.value[0] in 'aeiou' else 'a'} {mtype.value}"


def _types(items: Sequence[MediaItem]) -> str:
    return ", ".join(m.type.value for m in items) or "nothing"
