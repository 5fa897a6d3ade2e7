"""MiniMax H3 FL2VA keyframes: the slot contract and the packed order of the keyframes a record binds.

Spec dataset-guide, "FL2VA: minimax-h3-fl2va": a legacy row's ordered ``images`` list holds one image (the first
frame) or two (the first frame followed by the last frame); any other count is invalid and the order is never sorted,
deduplicated or inferred from file names. Strict V2 records bind the generic slots ``first_frame`` / ``last_frame``,
which also express the last-only form a legacy row cannot. :data:`FL2VA_CONTRACT` states this as two optional image
slots of which at least one is bound; :func:`ff_core.data.records.validation.bind_slots` binds a legacy row's images to
them positionally (first, then last) and reports every violation with the record's file, line and field before any
weights load; :func:`ff_core.data.media.conditions.condition_input` hands each bound image to ``preprocess`` with its
slot.

diffusers' modular pipeline (``MiniMaxH3ResizeStep``) takes ``image`` (first) and ``last_image`` (last) and packs the
keyframes present in that order, each with an anchor (``"first"`` / ``"last"``) that places its conditioning block at
the first or the last latent frame on the rotary clock; :func:`keyframes` gives the same packed order.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ff_core.adapter import ConditionInput
from ff_core.contracts import MediaType, PipelineIOContract, SlotSpec
from ff_minimax.rules import AV_OUTPUTS, H3_CONTRACT_LIMITS

FIRST_FRAME, LAST_FRAME = "first_frame", "last_frame"
#: Slot -> the pipeline's keyframe anchor, in packed order (``image`` then ``last_image``).
ANCHORS: dict[str, str] = {FIRST_FRAME: "first", LAST_FRAME: "last"}

FL2VA_CONTRACT = PipelineIOContract(
    outputs=AV_OUTPUTS,
    slots=(SlotSpec(FIRST_FRAME, MediaType.IMAGE, required=False),
           SlotSpec(LAST_FRAME, MediaType.IMAGE, required=False)),
    min_bound_slots=1,
    **H3_CONTRACT_LIMITS,  # B = 1, no CFG (ff_minimax.rules)
)
"""``minimax-h3-fl2va``: first-only, last-only or first-plus-last keyframes + prompt ->
(video(fps), audio(sample_rate)); B=1, no CFG."""


def keyframes(item: ConditionInput, index: int, adapter: str = "minimax-h3-fl2va") -> list[tuple[str, Tensor]]:
    """The keyframes of one sample as ``(anchor, image)`` pairs in the pipeline's packed order (first, then last).

    The data module has already bound every image to its slot (:func:`~ff_core.data.media.conditions.condition_input`);
    this re-checks what reaches ``preprocess`` from elsewhere (a hand-built :class:`ConditionInput`), so that an
    unslotted or doubly bound image can never be packed at a guessed position.

    Args:
        item: one sample's condition input; each media entry an ``image`` with ``slot`` ``first_frame`` or
            ``last_frame``.
        index: the sample's position, for messages (``inputs[0].media[1]``).
        adapter: the adapter's name, for messages.
    """
    bound: dict[str, Any] = {}
    for k, media in enumerate(item.media):
        where = f"inputs[{index}].media[{k}]"
        if media.get("type") != MediaType.IMAGE.value:
            raise ValueError(f"{where}: {adapter} takes keyframe images only, got {media.get('type')!r}")
        slot = media.get("slot")
        if slot not in ANCHORS:
            raise ValueError(f"{where}: slot {slot!r} is not one of {list(ANCHORS)} (the data module binds a legacy "
                             "row's images positionally: one is first_frame, two are first_frame then last_frame)")
        if slot in bound:
            raise ValueError(f"{where}: slot {slot!r} bound twice")
        bound[slot] = media["data"]
    if not bound:
        raise ValueError(f"inputs[{index}]: {adapter} needs a first_frame or a last_frame keyframe (or both)")
    return [(ANCHORS[slot], bound[slot]) for slot in ANCHORS if slot in bound]


__all__ = ["ANCHORS", "FIRST_FRAME", "FL2VA_CONTRACT", "LAST_FRAME", "keyframes"]
