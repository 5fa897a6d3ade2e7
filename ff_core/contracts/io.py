"""The IO contract vocabulary: what a pipeline accepts as input media and what it emits.

A :class:`PipelineIOContract` is plain data, readable without loading any weights, so datasets can be
validated against the selected adapter before a GPU is touched (spec: dataset-guide, "Offline model
support"). The vocabulary covers every row of that table:

* image output (SD3.5, FLUX, Qwen-Image, ...)                      ``outputs=(OutputSpec(IMAGE),)``
* video output with a required fps (Wan T2V)                        ``OutputSpec(VIDEO, requires_fps=True)``
* checkpoint-specific input slots (Wan I2V ``first_frame`` / ``last_frame``, LTX-2 I2AV, H3 FL2VA)
                                                                    ``slots=(SlotSpec(...), ...)``
* ordered (video, audio) outputs with fps and sample_rate (LTX-2, MiniMax H3)
* globally ordered heterogeneous references (H3 Ref2VA)             ``references=ReferenceSpec(...)``
* grouped same-type inputs with within-type order (SenseNova I2I)   ``grouped=GroupSpec(...)``
* single-sample batches and no classifier-free guidance (H3)        ``max_batch_size=1, negative_prompt=REJECTED``
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class MediaType(str, enum.Enum):
    """The only public media discriminator (the ``type`` key of every media object)."""

    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"

    def __str__(self) -> str:  # "image", not "MediaType.IMAGE", in messages
        return self.value


class NegativePrompt(str, enum.Enum):
    """Whether a pipeline consumes ``negative_prompt`` (only pipelines with classifier-free guidance do)."""

    ALLOWED = "allowed"
    REJECTED = "rejected"


@dataclass(frozen=True)
class OutputSpec:
    """One element of the ordered output sequence of a pipeline.

    Attributes:
        type: media type of this output.
        requires_fps: every supervision item at this position must carry a finite positive ``fps``.
        requires_sample_rate: every supervision item at this position must carry ``sample_rate``.
    """

    type: MediaType
    requires_fps: bool = False
    requires_sample_rate: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "type", MediaType(self.type))
        if self.requires_fps and self.type is not MediaType.VIDEO:
            raise ValueError(f"requires_fps only applies to video outputs, got {self.type}")
        if self.requires_sample_rate and self.type is not MediaType.AUDIO:
            raise ValueError(f"requires_sample_rate only applies to audio outputs, got {self.type}")

    def describe(self) -> str:
        rates = [r for r, on in (("fps", self.requires_fps), ("sample_rate", self.requires_sample_rate)) if on]
        return f"{self.type}({', '.join(rates)})" if rates else str(self.type)


@dataclass(frozen=True)
class SlotSpec:
    """A named semantic input binding, e.g. Wan I2V ``first_frame``.

    An explicitly slotted input item reserves its slot; unslotted items fill the remaining slots in
    declaration order (spec: "Offline V2 records").

    Attributes:
        name: slot name written in records as ``"slot": name``.
        type: media type the slot accepts.
        required: whether every record must bind this slot.
    """

    name: str
    type: MediaType
    required: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "type", MediaType(self.type))
        if not self.name:
            raise ValueError("a slot needs a non-empty name")


@dataclass(frozen=True)
class ReferenceSpec:
    """A globally ordered list of heterogeneous references (MiniMax H3 Ref2VA).

    Attributes:
        types: media types allowed in the list.
        min_count: fewest entries.
        max_count: most entries.
        requires_one_of: at least one entry must have one of these types (H3: an image or a video).
        max_per_type: ``(type, most)`` pairs capping the entries of one type (H3: 9 images, 3 videos, 3 audio clips,
            the limits diffusers' ``MiniMaxH3Ref2VASetupStep`` enforces), so a list the pipeline would refuse is
            refused before any weights load; a type not named is capped by ``max_count`` alone.
        max_image_aspect: image references must lie within ``1:N`` and ``N:1`` (H3: 4, the setup step's "within 1:4
            and 4:1"), checked from each image's header by :mod:`ff_core.data.records.validation` before any weights
            load; ``None``: any aspect.
    """

    types: frozenset[MediaType] = frozenset(MediaType)
    min_count: int = 1
    max_count: int = 12
    requires_one_of: frozenset[MediaType] = frozenset()
    max_per_type: tuple[tuple[MediaType, int], ...] = ()
    max_image_aspect: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "types", frozenset(MediaType(t) for t in self.types))
        if self.max_image_aspect is not None and not self.max_image_aspect >= 1:
            raise ValueError(f"max_image_aspect must be >= 1 (N of 1:N..N:1), got {self.max_image_aspect!r}")
        object.__setattr__(self, "requires_one_of", frozenset(MediaType(t) for t in self.requires_one_of))
        object.__setattr__(self, "max_per_type", tuple((MediaType(t), int(n)) for t, n in self.max_per_type))
        if not 0 <= self.min_count <= self.max_count:
            raise ValueError(f"need 0 <= min_count <= max_count, got {self.min_count}..{self.max_count}")
        kinds = [t for t, _ in self.max_per_type]
        if len(set(kinds)) != len(kinds) or any(n < 0 for _, n in self.max_per_type):
            raise ValueError(f"max_per_type needs one non-negative cap per type, got {self.max_per_type}")

    def count_problem(self, types: Sequence[MediaType]) -> str | None:
        """Why an ordered reference list of these types breaks the count or the image-or-video rule, or ``None``.

        Args:
            types: the type of each reference, in list order.
        """
        if not self.min_count <= len(types) <= self.max_count:
            return f"needs {self.min_count}-{self.max_count} references, found {len(types)}"
        if self.requires_one_of and not any(t in self.requires_one_of for t in types):
            need = " or ".join(sorted(t.value for t in self.requires_one_of))
            return f"needs at least one {need} reference (found only {', '.join(t.value for t in types)})"
        for mtype, most in self.max_per_type:
            found = sum(t is mtype for t in types)
            if found > most:
                return f"takes at most {most} {mtype} reference(s), found {found}"
        return None


@dataclass(frozen=True)
class GroupSpec:
    """A list of same-type inputs whose order is kept within the type (SenseNova I2I, image edit models).

    Attributes:
        type: media type of every entry.
        min_count: fewest entries.
        max_count: most entries (``None``: unbounded).
    """

    type: MediaType
    min_count: int = 1
    max_count: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "type", MediaType(self.type))
        if self.min_count < 0 or (self.max_count is not None and self.max_count < self.min_count):
            raise ValueError(f"invalid count range {self.min_count}..{self.max_count}")


@dataclass(frozen=True)
class PipelineIOContract:
    """What one pipeline (adapter) accepts and emits. Exactly one input form may be declared.

    Attributes:
        outputs: the exact ordered output sequence, e.g. ``(video(fps), audio(sample_rate))``.
        slots: semantic input slots; an input item binds to one of them.
        min_bound_slots: fewest slots a record must bind in total (H3 FL2VA: 1 of first/last).
        references: ordered heterogeneous references instead of slots.
        grouped: a same-type ordered input group instead of slots.
        negative_prompt: whether ``negative_prompt`` is consumed (rejected when there is no CFG).
        max_batch_size: largest per-device batch the pipeline supports (``None``: any; H3: 1).
        prompt_required: whether every row must carry a non-empty prompt.
    """

    outputs: tuple[OutputSpec, ...]
    slots: tuple[SlotSpec, ...] = ()
    min_bound_slots: int = 0
    references: ReferenceSpec | None = None
    grouped: GroupSpec | None = None
    negative_prompt: NegativePrompt = NegativePrompt.ALLOWED
    max_batch_size: int | None = None
    prompt_required: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "slots", tuple(self.slots))
        object.__setattr__(self, "negative_prompt", NegativePrompt(self.negative_prompt))
        if not self.outputs:
            raise ValueError("a pipeline contract needs at least one output")
        names = [s.name for s in self.slots]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate slot names in {names}")
        forms = sum([bool(self.slots), self.references is not None, self.grouped is not None])
        if forms > 1:
            raise ValueError("declare at most one input form: slots, references or grouped")
        if not 0 <= self.min_bound_slots <= len(self.slots):
            raise ValueError(f"min_bound_slots={self.min_bound_slots} does not fit {len(self.slots)} slots")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")

    # -- derived views ---------------------------------------------------------------------------
    @property
    def output_types(self) -> tuple[MediaType, ...]:
        return tuple(o.type for o in self.outputs)

    @property
    def uses_cfg(self) -> bool:
        return self.negative_prompt is NegativePrompt.ALLOWED

    @property
    def accepts_input_media(self) -> bool:
        return bool(self.slots) or self.references is not None or self.grouped is not None

    def slot(self, name: str) -> SlotSpec | None:
        return next((s for s in self.slots if s.name == name), None)

    def describe(self) -> str:
        """One line for ``ff plugins``: inputs -> outputs; batch and CFG limits."""
        inputs = ["prompt"]
        for s in self.slots:
            inputs.append(f"{s.name}:{s.type}" + ("" if s.required else "?"))
        if self.min_bound_slots > sum(s.required for s in self.slots):
            inputs.append(f"(>= {self.min_bound_slots} slots)")
        if self.references is not None:
            r = self.references
            types = "|".join(sorted(t.value for t in r.types))
            caps = "".join(f", {t}<={n}" for t, n in r.max_per_type)
            inputs.append(f"references[{r.min_count}-{r.max_count}{caps}]:{types}")
        if self.grouped is not None:
            g = self.grouped
            hi = "" if g.max_count is None else g.max_count
            inputs.append(f"{g.type}s[{g.min_count}-{hi}]")
        notes = []
        if self.max_batch_size is not None:
            notes.append(f"B<={self.max_batch_size}")
        notes.append("CFG" if self.uses_cfg else "no CFG")
        outputs = " + ".join(o.describe() for o in self.outputs)
        return f"{' + '.join(inputs)} -> {outputs}; {', '.join(notes)}"


# Ready-made output specs for the common cases.
IMAGE_OUT = OutputSpec(MediaType.IMAGE)
VIDEO_OUT = OutputSpec(MediaType.VIDEO, requires_fps=True)
AUDIO_OUT = OutputSpec(MediaType.AUDIO, requires_sample_rate=True)

__all__ = [
    "AUDIO_OUT",
    "GroupSpec",
    "IMAGE_OUT",
    "MediaType",
    "NegativePrompt",
    "OutputSpec",
    "PipelineIOContract",
    "ReferenceSpec",
    "SlotSpec",
    "VIDEO_OUT",
]
