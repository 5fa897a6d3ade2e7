"""Contract validation before weights load, against every row of the spec's "Offline model support" table.

Records are built through the real parsers, so the field names in the expected errors are the ones a user sees.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ff_core.contracts import MediaType
from ff_core.data.records import Record, parse_legacy_row, parse_v2_record
from ff_core.data.records.validation import (
    bind_slots,
    check_batch_size,
    check_records,
    conform,
    record_errors,
    record_warnings,
)
from ff_core.errors import ContractError, DatasetErrors
from ff_core.testing.contracts import SUPPORT_TABLE

ROOT = Path("/data/set")
IMG_OUT = [{"type": "image", "path": "t.png"}]
VID_OUT = [{"type": "video", "path": "t.mp4", "fps": 24.0}]
AUD_OUT = [{"type": "audio", "path": "t.wav", "sample_rate": 32000}]
VA_OUT = VID_OUT + AUD_OUT


def img(slot: str | None = None, path: str = "c.png") -> dict:
    return {"type": "image", "path": path, **({"slot": slot} if slot else {})}


VIDEO_IN = {"type": "video", "path": "m.mp4", "fps": 12.0}
AUDIO_IN = {"type": "audio", "path": "a.wav", "sample_rate": 16000}


def v2(inputs=(), outputs=IMG_OUT, rejected=None, **given) -> Record:
    """A V2 record: demonstration of ``outputs``, or preference ``outputs`` vs ``rejected``; ``given`` adds to
    (or replaces) ``input`` keys."""
    if rejected is None:
        sup = {"type": "demonstration", "target": {"media": list(outputs)}}
    else:
        sup = {"type": "preference", "chosen": {"media": list(outputs)}, "rejected": {"media": list(rejected)}}
    rec = {"schema_version": 2, "input": {"prompt": "p", "media": list(inputs), **given}, "supervision": sup}
    return parse_v2_record(rec, ROOT / "train.jsonl", 7, ROOT)


def leg(**row) -> Record:
    """A legacy generation row."""
    return parse_legacy_row({"prompt": "p", **row}, ROOT / "test.jsonl", 7, {t: ROOT / f"{t}s" for t in MediaType})


IMAGE_ROWS = ["sd3-5", "flux1", "flux2", "flux2-klein", "qwen-image", "z-image", "bagel"]
REFS = [img(path="r.png"), VIDEO_IN, AUDIO_IN]

# (contract, record, expected [(field, reason fragment)]; [] = accepted)
CASES: list[tuple[str, Record, list[tuple[str, str]]]] = [
    *[(name, v2(), []) for name in IMAGE_ROWS],
    *[(name, leg(negative_prompt="blurry"), []) for name in IMAGE_ROWS],
    ("sd3-5", v2(rejected=IMG_OUT), []),
    ("sd3-5", v2(outputs=VID_OUT), [("supervision.target.media", "expected outputs (image)")]),
    ("sd3-5", v2(outputs=IMG_OUT + IMG_OUT), [("supervision.target.media", "found (image, image)")]),
    ("sd3-5", v2(rejected=AUD_OUT), [("supervision.rejected.media", "found (audio)")]),
    ("sd3-5", v2([img()]), [("input.media", "takes no condition media")]),
    ("sd3-5", leg(images=["a.png"]), [("images", "takes no condition media")]),
    ("sd3-5", leg(video="a.mp4"), [("video", "takes no condition media")]),
    ("sd3-5", leg(references=REFS), []),  # kept as metadata, with a warning (test_references_kept_as_metadata)
    ("sd3-5", v2(negative_prompt="blurry"), []),
    ("sd3-5", v2(negative_prompt=None), []),
    ("sd3-5", v2(prompt=""), [("input.prompt", "this adapter needs a prompt")]),
    ("sd3-5", leg(clue=70, puzzle="4090"), []),
    ("flux1-kontext", v2([img()]), []),
    ("flux1-kontext", leg(image="a.png"), []),
    ("flux1-kontext", leg(images=["a.png", "b.png"]), [("images", "needs 1-1 image(s), found 2")]),
    ("flux1-kontext", leg(), [("images", "needs 1-1 image(s), found 0")]),
    ("flux1-kontext", v2([img(slot="first_frame")]), [("input.media[0].slot", "has no slots")]),
    ("qwen-image-edit-plus", leg(images=["a.png", "b.png", "c.png"]), []),
    ("qwen-image-edit-plus", leg(images=["a", "b", "c", "d"]), [("images", "needs 1-3 image(s), found 4")]),
    ("sensenova", leg(), []),
    ("sensenova", leg(images=["style.png", "subject.png", "layout.png"]), []),
    ("sensenova", v2([VIDEO_IN]), [("input.media[0]", "takes image inputs only")]),
    ("sensenova", leg(audio="a.wav"), [("audio", "takes image inputs only")]),
    ("wan2_t2v", v2(outputs=VID_OUT), []),
    ("wan2_t2v", v2(outputs=[{"type": "video", "path": "t.mp4"}]), [("supervision.target.media[0].fps", "required")]),
    ("wan2_t2v", v2(outputs=VID_OUT, rejected=IMG_OUT), [("supervision.rejected.media", "expected outputs (video)")]),
    ("wan2_i2v-ti2v", v2([img("first_frame")], VID_OUT), []),
    ("wan2_i2v-ti2v", leg(image="first.png"), []),
    ("wan2_i2v-ti2v", v2([img(), img()], VID_OUT), [("input.media[1]", "takes at most 1 (first_frame)")]),
    ("wan2_i2v-ti2v", v2([], VID_OUT), [("input.media", "required slot 'first_frame'")]),
    ("wan2_i2v-2.1", v2([img()], VID_OUT), []),
    ("wan2_i2v-2.1", v2([{**VIDEO_IN, "slot": "first_frame"}], VID_OUT),
     [("input.media[0].slot", "takes an image, found a video")]),
    ("wan2_i2v-2.1", v2([VIDEO_IN], VID_OUT), [("input.media[0]", "fills slot 'first_frame', which takes an image")]),
    ("wan2_i2v-2.1", v2([img("last_frame")], VID_OUT), [("input.media[0].slot", "unknown slot 'last_frame'")]),
    ("wan2_i2v-flf2v", v2([img("first_frame"), img("last_frame")], VID_OUT, rejected=VID_OUT), []),
    ("wan2_i2v-flf2v", v2([img(), img()], VID_OUT), []),
    ("wan2_i2v-flf2v", v2([img("first_frame")], VID_OUT), [("input.media", "required slot 'last_frame'")]),
    ("wan2_i2v-flf2v", v2([img("first_frame"), img("first_frame")], VID_OUT),
     [("input.media[1].slot", "duplicate slot 'first_frame'")]),
    ("wan2_i2v-a14b", v2([img()], VID_OUT), []),
    ("wan2_i2v-a14b", v2([img("last_frame"), img()], VID_OUT), []),
    ("wan2_i2v-a14b", v2([img("last_frame")], VID_OUT), [("input.media", "required slot 'first_frame'")]),
    ("wan2_i2v-a14b", v2([img(), img(), img()], VID_OUT), [("input.media[2]", "takes at most 2")]),
    ("ltx2_t2av", v2(outputs=VA_OUT), []),
    ("ltx2_t2av", v2(outputs=VA_OUT, rejected=VA_OUT), []),
    ("ltx2_t2av", v2(outputs=AUD_OUT + VID_OUT), [("supervision.target.media", "(video, audio) in this order")]),
    ("ltx2_t2av", v2(outputs=VID_OUT), [("supervision.target.media", "found (video)")]),
    ("ltx2_t2av", v2(outputs=VID_OUT + [{"type": "audio", "path": "t.wav"}]),
     [("supervision.target.media[1].sample_rate", "required")]),
    ("ltx2_t2av", v2(outputs=VA_OUT, rejected=[{"type": "video", "path": "r.mp4"}] + AUD_OUT),
     [("supervision.rejected.media[0].fps", "required")]),
    ("ltx2_i2av", v2([img("first_frame")], VA_OUT), []),
    ("ltx2_i2av", v2([], VA_OUT), [("input.media", "required slot 'first_frame'")]),
    ("ltx2_i2av", v2([img("last_frame")], VA_OUT), [("input.media[0].slot", "unknown slot")]),
    ("minimax-h3-t2va", v2(outputs=VA_OUT), []),
    ("minimax-h3-t2va", leg(), []),
    ("minimax-h3-t2va", leg(negative_prompt="blurry"), [("negative_prompt", "no classifier-free guidance")]),
    ("minimax-h3-t2va", leg(negative_prompt=""), [("negative_prompt", "no classifier-free guidance")]),
    ("minimax-h3-t2va", leg(images=["a.png"]), [("images", "takes no condition media")]),
    ("minimax-h3-t2va", leg(references=REFS), []),
    ("minimax-h3-t2va", v2(outputs=VA_OUT, negative_prompt="blurry"),
     [("input.negative_prompt", "no classifier-free guidance; remove input.negative_prompt")]),
    ("minimax-h3-t2va", v2(outputs=VA_OUT, negative_prompt=""), [("input.negative_prompt", "classifier-free")]),
    ("minimax-h3-t2va", v2(outputs=VA_OUT, negative_prompt=None), []),
    ("minimax-h3-t2va", v2(outputs=IMG_OUT), [("supervision.target.media", "expected outputs (video, audio)")]),
    ("minimax-h3-fl2va", leg(images=["images/first.png"]), []),
    ("minimax-h3-fl2va", leg(images=["images/first.png", "images/last.png"]), []),
    ("minimax-h3-fl2va", v2([img("last_frame")], VA_OUT), []),
    ("minimax-h3-fl2va", v2([img("first_frame"), img("last_frame")], VA_OUT, rejected=VA_OUT), []),
    ("minimax-h3-fl2va", leg(images=["a.png", "b.png", "c.png"]), [("images[2]", "takes at most 2")]),
    ("minimax-h3-fl2va", leg(), [("images", "bind at least 1 of the slots first_frame, last_frame")]),
    ("minimax-h3-fl2va", v2([], VA_OUT), [("input.media", "bind at least 1")]),
    ("minimax-h3-fl2va", leg(videos=["a.mp4"]), [("videos[0]", "which takes an image")]),
    ("minimax-h3-fl2va", leg(image="a.png", negative_prompt="x"), [("negative_prompt", "classifier-free")]),
    ("minimax-h3-ref2va", leg(references=REFS), []),
    ("minimax-h3-ref2va", leg(references=[VIDEO_IN]), []),
    ("minimax-h3-ref2va", leg(references=[img()] * 12), []),
    ("minimax-h3-ref2va", v2(REFS, VA_OUT, rejected=VA_OUT), []),
    ("minimax-h3-ref2va", leg(), [("references", "found 0")]),
    ("minimax-h3-ref2va", leg(images=["a.png"]), [("images", "ordered 'references' array")]),
    ("minimax-h3-ref2va", v2([AUDIO_IN], VA_OUT), [("input.media", "at least one image or video")]),
    ("minimax-h3-ref2va", v2([img("first_frame")], VA_OUT), [("input.media[0].slot", "has no slots")]),
    ("minimax-h3-ref2va", v2([img()] * 13, VA_OUT), [("input.media", "found 13")]),
    ("minimax-h3-ref2va", v2(REFS, VID_OUT), [("supervision.target.media", "found (video)")]),
]


def test_every_support_table_row_has_accepted_and_rejected_cases():
    accepted = {name for name, _, want in CASES if not want}
    assert accepted == set(SUPPORT_TABLE)
    rejected = {name for name, _, want in CASES if want}
    assert len([c for c in CASES if c[2]]) >= 40
    assert rejected >= {"sd3-5", "wan2_t2v", "ltx2_t2av", "ltx2_i2av", "minimax-h3-t2va", "minimax-h3-fl2va",
                        "minimax-h3-ref2va", "wan2_i2v-flf2v", "wan2_i2v-a14b", "flux1-kontext", "sensenova"}


@pytest.mark.parametrize("name, record, want", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_record_against_contract(name, record, want):
    errors = record_errors(record, SUPPORT_TABLE[name])
    assert [e.field for e in errors] == [f for f, _ in want], [e.format() for e in errors]
    for error, (_, fragment) in zip(errors, want):
        assert fragment in error.reason and error.line == 7


def test_check_records_collects_every_record(tmp_path):
    records = [v2(outputs=VID_OUT), v2(), v2([img()])]
    with pytest.raises(DatasetErrors) as info:
        check_records(records, SUPPORT_TABLE["sd3-5"])
    assert [e.field for e in info.value.errors] == ["supervision.target.media", "input.media"]


def test_slot_binding_explicit_reserves_unslotted_fill_in_declaration_order():
    # a14b: first_frame (required) + last_frame (optional). The explicit first_frame is the second item.
    record = v2([img(path="x.png"), img("first_frame", path="y.png")], VID_OUT)
    bound, problems = bind_slots(record.inputs, SUPPORT_TABLE["wan2_i2v-a14b"])
    assert problems == []
    assert [(k, v.path.name) for k, v in bound.items()] == [("first_frame", "y.png"), ("last_frame", "x.png")]
    # FL2VA legacy: one image is the first frame, two are first then last (never sorted).
    bound, _ = bind_slots(leg(images=["z.png", "a.png"]).inputs, SUPPORT_TABLE["minimax-h3-fl2va"])
    assert [(k, v.path.name) for k, v in bound.items()] == [("first_frame", "z.png"), ("last_frame", "a.png")]


@pytest.mark.parametrize("name", sorted(SUPPORT_TABLE))
def test_batch_capability(name):
    contract = SUPPORT_TABLE[name]
    check_batch_size(contract, name, 1, preprocessing_batch_size=1, eval_batch_size=1)
    if contract.max_batch_size is None:
        check_batch_size(contract, name, 64, preprocessing_batch_size=8)
        return
    with pytest.raises(ContractError, match=rf"data.per_device_batch_size=2, but adapter '{name}' supports at most 1"):
        check_batch_size(contract, name, 2)
    with pytest.raises(ContractError, match="data.preprocessing_batch_size=8"):
        check_batch_size(contract, name, 1, preprocessing_batch_size=8)


def test_references_kept_as_metadata_for_an_adapter_without_references():
    """Flow-Factory hands a pipeline only the columns it preprocesses; the rest is sample metadata. So a row's
    references are metadata for an adapter that takes none: a warning, not an error, and never a model input."""
    record = leg(references=[img(path="r.png"), {**VIDEO_IN, "audio_path": "s.wav", "sample_rate": 16000}],
                 tag="style")
    (warning,) = record_warnings(record, SUPPORT_TABLE["sd3-5"], "sd3-5")
    assert warning.format() == ("/data/set/test.jsonl:7: warning: references: kept as metadata, not a model input: "
                                "adapter 'sd3-5' takes no ordered references")
    seen = conform(record, SUPPORT_TABLE["sd3-5"])
    assert seen.references == () and seen.inputs == ()
    assert seen.metadata == {"tag": "style", "references": [
        {"type": "image", "path": "/data/set/r.png"},
        {"type": "video", "path": "/data/set/m.mp4", "fps": 12.0, "audio_path": "/data/set/s.wav",
         "sample_rate": 16000.0}]}
    ref2va = SUPPORT_TABLE["minimax-h3-ref2va"]
    assert record_warnings(record, ref2va, "minimax-h3-ref2va") == [] and conform(record, ref2va) is record
