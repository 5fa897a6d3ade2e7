"""Every row of the spec's "Offline model support" table, written as PipelineIOContract data.

Tests use these to check that validation handles every family, including those whose model code lives in
plugins not installed here. Plugin authors can compare their adapter's contract with the matching row.
"""

from __future__ import annotations

from ff_core.contracts import (
    AUDIO_OUT,
    IMAGE_OUT,
    VIDEO_OUT,
    GroupSpec,
    MediaType,
    NegativePrompt,
    PipelineIOContract,
    ReferenceSpec,
    SlotSpec,
)

FIRST = SlotSpec("first_frame", MediaType.IMAGE)
LAST = SlotSpec("last_frame", MediaType.IMAGE)
FIRST_OPT = SlotSpec("first_frame", MediaType.IMAGE, required=False)
LAST_OPT = SlotSpec("last_frame", MediaType.IMAGE, required=False)
VIDEO_AUDIO = (VIDEO_OUT, AUDIO_OUT)
H3 = {"max_batch_size": 1, "negative_prompt": NegativePrompt.REJECTED}

SUPPORT_TABLE: dict[str, PipelineIOContract] = {
    # Image-output codecs.
    **{name: PipelineIOContract(outputs=(IMAGE_OUT,)) for name in (
        "sd3-5", "flux1", "flux2", "flux2-klein", "qwen-image", "z-image", "bagel")},
    "flux1-kontext": PipelineIOContract(outputs=(IMAGE_OUT,), grouped=GroupSpec(MediaType.IMAGE, 1, 1)),
    "qwen-image-edit-plus": PipelineIOContract(outputs=(IMAGE_OUT,), grouped=GroupSpec(MediaType.IMAGE, 1, 3)),
    # SenseNova: prompt-only T2I or the grouped `images` input with within-type order.
    "sensenova": PipelineIOContract(outputs=(IMAGE_OUT,), grouped=GroupSpec(MediaType.IMAGE, 0, None)),
    # Wan: video targets require fps; I2V slot cardinality is checkpoint-specific, offline B=1.
    "wan2_t2v": PipelineIOContract(outputs=(VIDEO_OUT,)),
    "wan2_i2v-ti2v": PipelineIOContract(outputs=(VIDEO_OUT,), slots=(FIRST,), max_batch_size=1),
    "wan2_i2v-2.1": PipelineIOContract(outputs=(VIDEO_OUT,), slots=(FIRST,), max_batch_size=1),
    "wan2_i2v-flf2v": PipelineIOContract(outputs=(VIDEO_OUT,), slots=(FIRST, LAST), max_batch_size=1),
    "wan2_i2v-a14b": PipelineIOContract(outputs=(VIDEO_OUT,), slots=(FIRST, LAST_OPT), max_batch_size=1),
    # LTX-2: exact ordered (video, audio) pairs; I2AV binds first_frame.
    "ltx2_t2av": PipelineIOContract(outputs=VIDEO_AUDIO),
    "ltx2_i2av": PipelineIOContract(outputs=VIDEO_AUDIO, slots=(FIRST,)),
    # MiniMax H3: (video, audio), B=1, no CFG.
    "minimax-h3-t2va": PipelineIOContract(outputs=VIDEO_AUDIO, **H3),
    "minimax-h3-fl2va": PipelineIOContract(outputs=VIDEO_AUDIO, slots=(FIRST_OPT, LAST_OPT), min_bound_slots=1, **H3),
    "minimax-h3-ref2va": PipelineIOContract(
        outputs=VIDEO_AUDIO,
        references=ReferenceSpec(
            types=frozenset(MediaType), min_count=1, max_count=12,
            requires_one_of=frozenset({MediaType.IMAGE, MediaType.VIDEO}),
        ),
        **H3,
    ),
}
