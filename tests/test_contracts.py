"""The contract vocabulary expresses every row of the spec's offline support table, as data."""

import pytest

from ff_core.contracts import (
    AUDIO_OUT,
    IMAGE_OUT,
    MediaType,
    NegativePrompt,
    OutputSpec,
    PipelineIOContract,
    ReferenceSpec,
    SlotSpec,
)
from ff_core.testing.contracts import SUPPORT_TABLE


def test_image_output_row():
    c = SUPPORT_TABLE["sd3-5"]
    assert c.output_types == (MediaType.IMAGE,)
    assert c.uses_cfg and c.max_batch_size is None and not c.accepts_input_media
    assert c.describe() == "prompt -> image; CFG"


def test_video_output_requires_fps():
    c = SUPPORT_TABLE["wan2_t2v"]
    assert c.outputs == (OutputSpec(MediaType.VIDEO, requires_fps=True),)
    assert c.describe() == "prompt -> video(fps); CFG"


@pytest.mark.parametrize(
    "name, required, optional",
    [
        ("wan2_i2v-ti2v", {"first_frame"}, set()),
        ("wan2_i2v-2.1", {"first_frame"}, set()),
        ("wan2_i2v-flf2v", {"first_frame", "last_frame"}, set()),
        ("wan2_i2v-a14b", {"first_frame"}, {"last_frame"}),
    ],
)
def test_wan_i2v_slot_variants(name, required, optional):
    c = SUPPORT_TABLE[name]
    assert {s.name for s in c.slots if s.required} == required
    assert {s.name for s in c.slots if not s.required} == optional
    assert all(s.type is MediaType.IMAGE for s in c.slots)
    assert c.max_batch_size == 1


@pytest.mark.parametrize("name", ["ltx2_t2av", "ltx2_i2av", "minimax-h3-t2va", "minimax-h3-fl2va", "minimax-h3-ref2va"])
def test_ordered_video_then_audio_with_rates(name):
    c = SUPPORT_TABLE[name]
    assert c.output_types == (MediaType.VIDEO, MediaType.AUDIO)
    assert c.outputs[0].requires_fps and c.outputs[1].requires_sample_rate


def test_h3_single_sample_no_cfg_and_references():
    fl2va, ref2va = SUPPORT_TABLE["minimax-h3-fl2va"], SUPPORT_TABLE["minimax-h3-ref2va"]
    for c in (SUPPORT_TABLE["minimax-h3-t2va"], fl2va, ref2va):
        assert c.max_batch_size == 1 and c.negative_prompt is NegativePrompt.REJECTED and not c.uses_cfg
    assert fl2va.min_bound_slots == 1 and not any(s.required for s in fl2va.slots)
    r = ref2va.references
    assert (r.min_count, r.max_count) == (1, 12)
    assert r.requires_one_of == {MediaType.IMAGE, MediaType.VIDEO} and MediaType.AUDIO in r.types
    assert ref2va.describe() == (
        "prompt + references[1-12]:audio|image|video -> video(fps) + audio(sample_rate); B<=1, no CFG"
    )


def test_reference_caps_per_type():
    """ReferenceSpec.max_per_type caps one type's entries beside the total (H3 Ref2VA: 9 images, 3 videos, 3 audio,
    the modular pipeline's limits); a type it does not name is capped by the total alone."""
    spec = ReferenceSpec(max_count=12, requires_one_of=frozenset({MediaType.IMAGE}),
                         max_per_type=((MediaType.IMAGE, 2), (MediaType.AUDIO, 1)))
    i, v, a = MediaType.IMAGE, MediaType.VIDEO, MediaType.AUDIO
    assert spec.count_problem([i, i, a, v, v, v]) is None
    assert spec.count_problem([i, i, i]) == "takes at most 2 image reference(s), found 3"
    assert spec.count_problem([i, a, a]) == "takes at most 1 audio reference(s), found 2"
    assert spec.count_problem([a]) == "needs at least one image reference (found only audio)"
    contract = PipelineIOContract(outputs=(IMAGE_OUT,), references=spec)
    assert contract.describe() == "prompt + references[1-12, image<=2, audio<=1]:audio|image|video -> image; CFG"


def test_sensenova_grouped_images_keep_order():
    c = SUPPORT_TABLE["sensenova"]
    assert c.grouped.type is MediaType.IMAGE and c.grouped.min_count == 0 and c.grouped.max_count is None


def test_contracts_are_plain_hashable_data():
    assert SUPPORT_TABLE["ltx2_t2av"] == PipelineIOContract(outputs=(OutputSpec("video", True), AUDIO_OUT))
    assert len(set(SUPPORT_TABLE.values())) < len(SUPPORT_TABLE)  # equal rows compare equal


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: PipelineIOContract(outputs=()), "at least one output"),
        (lambda: OutputSpec(MediaType.IMAGE, requires_fps=True), "requires_fps only applies to video"),
        (lambda: OutputSpec(MediaType.VIDEO, requires_sample_rate=True), "requires_sample_rate only applies"),
        (lambda: PipelineIOContract(outputs=(IMAGE_OUT,), slots=(SlotSpec("a", "image"), SlotSpec("a", "image"))),
         "duplicate slot"),
        (lambda: PipelineIOContract(outputs=(IMAGE_OUT,), slots=(SlotSpec("a", "image"),),
                                    references=ReferenceSpec()), "at most one input form"),
        (lambda: PipelineIOContract(outputs=(IMAGE_OUT,), min_bound_slots=1), "min_bound_slots"),
        (lambda: PipelineIOContract(outputs=(IMAGE_OUT,), max_batch_size=0), "max_batch_size"),
        (lambda: ReferenceSpec(min_count=3, max_count=2), "min_count <= max_count"),
        (lambda: ReferenceSpec(max_per_type=(("image", 2), ("image", 3))), "one non-negative cap per type"),
        (lambda: ReferenceSpec(max_per_type=(("audio", -1),)), "one non-negative cap per type"),
        (lambda: SlotSpec("x", "pointcloud"), "pointcloud"),
    ],
)
def test_invalid_contracts_are_rejected(build, message):
    with pytest.raises(ValueError, match=message):
        build()
