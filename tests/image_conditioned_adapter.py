"""A toy image-conditioned adapter for the tests, reached by dotted path (``image_conditioned_adapter:...``).

SD3 with two image slots, ``reference`` (required) and ``style`` (optional). ``preprocess`` encodes each bound
condition image as its mean colour (``reference_colour``, ``style_colour``; ``-1`` when the slot is empty) beside the
prompt embeddings, so a test can tell which file reached which record's condition tensors.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from ff_sd3.adapter import SD3Adapter
from torch import Tensor

from ff_core.adapter import ConditionInput
from ff_core.contracts import IMAGE_OUT, MediaType, PipelineIOContract, SlotSpec

SLOTS = ("reference", "style")


class ImageConditionedSD3(SD3Adapter):
    name: ClassVar[str] = "test-image-conditioned-sd3"
    io_contract: ClassVar[PipelineIOContract] = PipelineIOContract(
        outputs=(IMAGE_OUT,),
        slots=(SlotSpec("reference", MediaType.IMAGE), SlotSpec("style", MediaType.IMAGE, required=False)),
    )

    @torch.no_grad()
    def preprocess(self, inputs: list[ConditionInput]) -> list[dict[str, Tensor]]:
        rows = super().preprocess([ConditionInput(item.prompt, item.negative_prompt) for item in inputs])
        for i, (row, item) in enumerate(zip(rows, inputs)):
            by_slot = {m.get("slot"): m for m in item.media}
            if "reference" not in by_slot or set(by_slot) - set(SLOTS):
                raise ValueError(f"inputs[{i}]: expected media bound to {SLOTS}, got slots {sorted(map(str, by_slot))}")
            for slot in SLOTS:
                image = by_slot[slot]["data"] if slot in by_slot else None
                row[f"{slot}_colour"] = image.float().mean((1, 2)) if image is not None else torch.full((3,), -1.0)
        return rows
