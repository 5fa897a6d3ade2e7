"""FL2VA keyframe slots and Ref2VA references, end to end from a dataset folder to what ``preprocess`` receives.

Rows are written to real JSONL files and read by ff's loader (``load_split``), checked against the plugin's contracts
(what ``ff data validate --model`` and ``ff fit`` setup run before any weights load), and turned into
``ConditionInput`` by the data module's own ``condition_input`` with real decoded PNG / MP4 / WAV files. Every error
names the file, the line and the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from ff_minimax.keyframes import FL2VA_CONTRACT, keyframes
from ff_minimax.references import (
    REF2VA_CONTRACT,
    canonical_manifest,
    manifest_tensor,
    manifest_text,
    reference_manifest,
)
from PIL import Image

from ff_core.callbacks.media_log import audio_to_wav
from ff_core.data.cache.identity import input_identity
from ff_core.data.media.conditions import condition_input
from ff_core.data.records.sources import DatasetConfig, load_split
from ff_core.data.records.validation import record_errors
from ff_core.errors import DatasetErrors
from ff_core.testing.clips import write_grey_mp4
from ff_core.testing.contracts import SUPPORT_TABLE

VA = [{"type": "video", "path": "t.mp4", "fps": 24.0}, {"type": "audio", "path": "t.wav", "sample_rate": 32000}]


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dataset folder with distinguishable images (a.png is red, b.png green, c.png blue), a clip and a tone."""
    root = tmp_path_factory.mktemp("h3_inputs")
    for name, rgb in (("a", (255, 0, 0)), ("b", (0, 255, 0)), ("c", (0, 0, 255))):
        for folder in (root, root / "images"):
            folder.mkdir(exist_ok=True)
            Image.new("RGB", (24, 16), rgb).save(folder / f"{name}.png")
    write_grey_mp4(root / "refs" / "m.mp4", 6, 12)
    tone = torch.from_numpy(np.sin(np.linspace(0, 200, 1600, dtype=np.float32)))[None]
    (root / "refs" / "s.wav").write_bytes(audio_to_wav(tone, 16000))
    return root


def _records(root: Path, rows: list[dict], name: str, *, v2: bool = False):
    """``rows`` as the split file of the dataset folder ``root`` (``train.jsonl`` V2 for sft, else the legacy
    ``test.jsonl``), read by ff's loader; legacy images resolve against ``image_dir = root`` as the spec's FL2VA
    fixture does. ``name`` names the dataset entry."""
    (root / ("train.jsonl" if v2 else "test.jsonl")).write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DatasetConfig(name=name, dataset_dir=str(root), image_dir=str(root), eval={})
    return load_split(cfg, "train" if v2 else "test", "sft" if v2 else None)


def _v2(media: list[dict], prompt: str = "p") -> dict:
    return {"schema_version": 2, "input": {"prompt": prompt, "media": media},
            "supervision": {"type": "demonstration", "target": {"media": VA}}}


def _problems(records, contract) -> list[str]:
    return [str(e) for r in records for e in record_errors(r, contract)]


# -- contracts ---------------------------------------------------------------------------------------------------------
def test_contracts_match_the_support_table_row():
    """The plugin's contracts are the spec's rows; Ref2VA adds only the pipeline's per-type caps."""
    assert FL2VA_CONTRACT == SUPPORT_TABLE["minimax-h3-fl2va"]
    table = SUPPORT_TABLE["minimax-h3-ref2va"].references
    ours = REF2VA_CONTRACT.references
    assert (ours.types, ours.min_count, ours.max_count, ours.requires_one_of) == (
        table.types, table.min_count, table.max_count, table.requires_one_of)
    assert dict(ours.max_per_type) == {"image": 9, "video": 3, "audio": 3}
    assert REF2VA_CONTRACT.max_batch_size == 1 and not REF2VA_CONTRACT.uses_cfg


# -- FL2VA ------------------------------------------------------------------------------------------------------------
def test_fl2va_legacy_images_bind_first_then_last_in_written_order(media: Path):
    """One image is the first frame; two are first then last, in the order written (never sorted by name, never
    deduplicated: the same file twice is a first and a last frame)."""
    rows = [{"prompt": "one", "images": ["c.png"]}, {"prompt": "two", "images": ["c.png", "a.png"]},
            {"prompt": "single", "image": "b.png"}, {"prompt": "same", "images": ["b.png", "b.png"]}]
    records = _records(media, rows, "fl_ok")
    assert _problems(records, FL2VA_CONTRACT) == []
    got = [keyframes(condition_input(r, FL2VA_CONTRACT), i) for i, r in enumerate(records)]
    assert [[a for a, _ in k] for k in got] == [["first"], ["first", "last"], ["first"], ["first", "last"]]
    # c.png (blue) is the first frame of row 2 although "a" sorts before "c".
    first, last = got[1][0][1], got[1][1][1]
    assert first[:, 0, 0].tolist() == [0, 0, 255] and last[:, 0, 0].tolist() == [255, 0, 0]


@pytest.mark.parametrize("row, field, reason", [
    ({"prompt": "p", "images": ["a.png", "b.png", "c.png"]}, "images[2]", "takes at most 2"),
    ({"prompt": "p"}, "images", "bind at least 1 of the slots first_frame, last_frame"),
    ({"prompt": "p", "videos": ["refs/m.mp4"]}, "videos[0]", "takes an image"),
    ({"prompt": "p", "images": ["a.png"], "negative_prompt": "blurry"}, "negative_prompt", "classifier-free"),
    ({"prompt": "p", "references": [{"type": "image", "path": "a.png"}]}, "references", "bind at least 1"),
])
def test_fl2va_legacy_errors_name_file_line_field(media: Path, row, field, reason):
    records = _records(media, [{"prompt": "fine", "images": ["a.png"]}, row], "fl_bad")
    problems = _problems(records, FL2VA_CONTRACT)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{media / 'test.jsonl'}:2: {field}: ") and reason in problems[0]


def test_fl2va_v2_slots_first_last_both_and_unslotted(media: Path):
    """V2: explicit slots express last-only; unslotted images fill first_frame then last_frame."""
    img = lambda p, s=None: {"type": "image", "path": p, **({"slot": s} if s else {})}  # noqa: E731
    rows = [_v2([img("a.png", "last_frame")]), _v2([img("a.png", "first_frame")]),
            _v2([img("b.png", "last_frame"), img("a.png", "first_frame")]), _v2([img("a.png"), img("b.png")]),
            _v2([img("b.png", "last_frame"), img("a.png")])]
    records = _records(media, rows, "fl_v2", v2=True)
    assert _problems(records, FL2VA_CONTRACT) == []
    got = [keyframes(condition_input(r, FL2VA_CONTRACT), i) for i, r in enumerate(records)]
    assert [[a for a, _ in k] for k in got] == [["last"], ["first"], ["first", "last"], ["first", "last"],
                                               ["first", "last"]]
    # Record 3 wrote last_frame first: the packed order is still first (a.png, red) then last (b.png, green).
    assert got[2][0][1][:, 0, 0].tolist() == [255, 0, 0] and got[2][1][1][:, 0, 0].tolist() == [0, 255, 0]
    # Record 5: the explicit last_frame reserves its slot, the unslotted a.png takes first_frame.
    assert got[4][0][1][:, 0, 0].tolist() == [255, 0, 0]


@pytest.mark.parametrize("items, field, reason", [
    ([], "input.media", "bind at least 1"),
    ([{"type": "image", "path": "a.png", "slot": "middle"}], "input.media[0].slot", "unknown slot 'middle'"),
    ([{"type": "image", "path": "a.png", "slot": "last_frame"}, {"type": "image", "path": "b.png", "slot":
      "last_frame"}], "input.media[1].slot", "duplicate slot 'last_frame'"),
    ([{"type": "video", "path": "refs/m.mp4", "slot": "first_frame"}], "input.media[0].slot", "takes an image"),
    ([{"type": "image", "path": "a.png"}] * 3, "input.media[2]", "takes at most 2"),
])
def test_fl2va_v2_errors_name_file_line_field(media: Path, items, field, reason):
    records = _records(media, [_v2([{"type": "image", "path": "a.png"}]), _v2(items)], "fl_v2_bad", v2=True)
    problems = _problems(records, FL2VA_CONTRACT)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{media / 'train.jsonl'}:2: {field}: ") and reason in problems[0]


def test_fl2va_keyframes_refuse_unbound_input():
    """A hand-built input whose image carries no slot is refused, never packed at a guessed position."""
    image = torch.zeros(3, 4, 4, dtype=torch.uint8)
    from ff_core.adapter import ConditionInput

    with pytest.raises(ValueError, match=r"inputs\[0\].media\[0\]: slot None"):
        keyframes(ConditionInput("p", None, [{"type": "image", "data": image, "path": "x.png"}]), 0)
    with pytest.raises(ValueError, match="bound twice"):
        keyframes(ConditionInput("p", None, [{"type": "image", "data": image, "slot": "first_frame"}] * 2), 0)
    with pytest.raises(ValueError, match="needs a first_frame or a last_frame"):
        keyframes(ConditionInput("p", None, []), 0)


# -- Ref2VA -----------------------------------------------------------------------------------------------------------
IMG, VID, AUD = ({"type": "image", "path": "a.png"}, {"type": "video", "path": "refs/m.mp4", "fps": 12},
                 {"type": "audio", "path": "refs/s.wav", "sample_rate": 16000})


@pytest.mark.parametrize("refs, reason", [
    ([IMG] * 13, "needs 1-12 references, found 13"),
    ([IMG] * 10, "at most 9 image reference(s), found 10"),
    ([VID] * 4, "at most 3 video reference(s), found 4"),
    ([IMG, AUD, AUD, AUD, AUD], "at most 3 audio reference(s), found 4"),
])
def test_ref2va_counts_rejected_with_line_legacy_and_v2(media: Path, refs, reason):
    rows = [{"prompt": "ok", "references": [IMG]}, {"prompt": "p", "references": refs}]
    try:  # the row parser refuses what breaks any adapter's references (13), the contract the per-type caps
        problems = _problems(_records(media, rows, "r_bad"), REF2VA_CONTRACT)
    except DatasetErrors as exc:
        problems = [str(e) for e in exc.errors]
    assert len(problems) == 1 and problems[0].startswith(f"{media / 'test.jsonl'}:2: references: ")
    assert reason in problems[0]
    v2 = _records(media, [_v2([IMG]), _v2(refs)], "r_bad_v2", v2=True)
    problems = _problems(v2, REF2VA_CONTRACT)
    assert len(problems) == 1 and problems[0].startswith(f"{media / 'train.jsonl'}:2: input.media: ")
    assert reason in problems[0]


def test_ref2va_audio_only_and_empty_rejected(media: Path):
    with pytest.raises(DatasetErrors, match=r"test.jsonl:1: references: needs at least one image or video"):
        _records(media, [{"prompt": "p", "references": [AUD]}], "r_audio")
    with pytest.raises(DatasetErrors, match=r"test.jsonl:1: references: must hold at least one reference"):
        _records(media, [{"prompt": "p", "references": []}], "r_empty")
    v2 = _records(media, [_v2([AUD])], "r_audio_v2", v2=True)
    assert _problems(v2, REF2VA_CONTRACT) == [
        f"{media / 'train.jsonl'}:1: input.media: needs at least one image or video reference (found only audio)"]


def test_ref2va_limits_at_the_edge_accepted(media: Path):
    refs = [IMG] * 8 + [VID] * 3 + [AUD]  # 12 in all, every per-type cap respected
    records = _records(media, [{"prompt": "p", "references": refs}], "r_edge")
    assert _problems(records, REF2VA_CONTRACT) == []


def test_ref2va_image_aspect_outside_1_4_to_4_1_rejected_from_the_header(media: Path):
    """The setup step's "A reference image must be within 1:4 and 4:1" (``width > 4 height or height > 4 width``),
    from each image's header before any weights load, naming the file, line and field; exactly 4:1 and 1:4 pass."""
    for name, size in (("wide.png", (81, 20)), ("tall.png", (8, 40)), ("edge_w.png", (80, 20)),
                       ("edge_h.png", (10, 40))):
        Image.new("RGB", size, (255, 0, 0)).save(media / name)
    rows = [{"prompt": "p", "references": [{"type": "image", "path": n}]}
            for n in ("edge_w.png", "wide.png", "edge_h.png")]
    assert _problems(_records(media, rows, "r_aspect"), REF2VA_CONTRACT) == [
        f"{media / 'test.jsonl'}:2: references[0].path: {media / 'wide.png'}: a 81x20 image; reference images must "
        "lie within 1:4 and 4:1 (crop or pad it)"]
    v2 = _records(media, [_v2([IMG, {"type": "image", "path": "tall.png"}])], "r_aspect_v2", v2=True)
    assert _problems(v2, REF2VA_CONTRACT) == [
        f"{media / 'train.jsonl'}:1: input.media[1].path: {media / 'tall.png'}: a 8x40 image; reference images must "
        "lie within 1:4 and 4:1 (crop or pad it)"]


def test_ref2va_paths_resolve_against_dataset_dir_and_order_is_kept(media: Path):
    """references[*].path and audio_path are dataset_dir-relative (not image_dir / audio_dir); duplicates and order
    survive into what preprocess receives and into the manifest."""
    refs = [AUD, {"type": "video", "path": "refs/m.mp4", "audio_path": "refs/s.wav", "sample_rate": 16000}, IMG, IMG]
    (record,) = _records(media, [{"prompt": "p", "references": refs}], "r_order")
    assert _problems([record], REF2VA_CONTRACT) == []
    item = condition_input(record, REF2VA_CONTRACT)
    assert [m["type"] for m in item.media] == ["audio", "video", "image", "image"]
    assert [m["path"] for m in item.media] == [media / "refs/s.wav", media / "refs/m.mp4", media / "a.png",
                                                media / "a.png"]
    assert item.media[1]["audio_path"] == media / "refs/s.wav" and item.media[1]["data"].audio is not None
    manifest = json.loads(reference_manifest(item.media))
    assert manifest == [
        {"type": "audio", "path": str(media / "refs/s.wav"), "sample_rate": 16000.0},
        {"type": "video", "path": str(media / "refs/m.mp4"), "audio_path": str(media / "refs/s.wav"),
         "sample_rate": 16000.0},
        {"type": "image", "path": str(media / "a.png")},
        {"type": "image", "path": str(media / "a.png")},
    ]


def test_reference_manifest_is_canonical_and_stable(media: Path):
    """Re-serialising the manifest (parsed, keys reordered, indented, 12 for 12.0) gives the same bytes; the
    tensor the cache stores round-trips; a reordered list is a different manifest and a different cache row id."""
    refs = [IMG, VID, AUD]
    (record,) = _records(media, [{"prompt": "p", "references": refs}], "r_manifest")
    item = condition_input(record, REF2VA_CONTRACT)
    manifest = reference_manifest(item.media)
    assert canonical_manifest(manifest) == manifest
    shuffled = [dict(reversed(list(e.items()))) for e in json.loads(manifest)]
    shuffled[1]["fps"] = 12  # an int spelling of the same rate
    assert canonical_manifest(json.dumps(shuffled, indent=2)) == manifest
    assert manifest == ('[{"path":"%s","type":"image"},{"fps":12.0,"path":"%s","type":"video"},'
                        '{"path":"%s","sample_rate":16000.0,"type":"audio"}]'
                        % (media / "a.png", media / "refs/m.mp4", media / "refs/s.wav"))
    stored = manifest_tensor(manifest)
    assert stored.dtype == torch.uint8 and manifest_text(stored) == manifest == manifest_text(stored[None])

    (swapped,) = _records(media, [{"prompt": "p", "references": [VID, IMG, AUD]}], "r_swapped")
    assert reference_manifest(condition_input(swapped, REF2VA_CONTRACT).media) != manifest
    assert input_identity(swapped) != input_identity(record)
    with pytest.raises(ValueError, match="unknown key"):
        canonical_manifest('[{"type": "image", "path": "a.png", "slot": "first_frame"}]')


def test_ref2va_v2_media_keep_order_into_preprocess(media: Path):
    (record,) = _records(media, [_v2([AUD | {"sample_rate": 16000}, IMG, {"type": "video", "path": "refs/m.mp4"}])],
                         "r_v2", v2=True)
    assert _problems([record], REF2VA_CONTRACT) == []
    item = condition_input(record, REF2VA_CONTRACT)
    assert [m["type"] for m in item.media] == ["audio", "image", "video"] and all("slot" not in m for m in item.media)
    assert json.loads(reference_manifest(item.media))[0] == {"type": "audio", "path": str(media / "refs/s.wav"),
                                                             "sample_rate": 16000.0}
