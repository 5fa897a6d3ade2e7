"""Row and record parsing: a table of malformed legacy, Ref2VA and V2 rows, each rejected with its line and field;
every valid example of the spec accepted and normalised.

Each malformed row is written as line 2 of a split file between two valid rows, so the test also checks that the
error names the right line and that the neighbours are not blamed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from data_helpers import write_lines

from ff_core.contracts import MediaType
from ff_core.data.records import MediaItem, Record, parse_legacy_row, parse_v2_media, parse_v2_record
from ff_core.data.records.sources import DatasetConfig, load_split
from ff_core.errors import DatasetError, DatasetErrors

IMG = {"type": "image", "path": "references/style.png"}
VID = {"type": "video", "path": "references/motion.mp4", "fps": 12.0}
AUD = {"type": "audio", "path": "references/ambience.wav", "sample_rate": 16000}
TARGET = {"media": [{"type": "image", "path": "targets/t.png"}]}


def legacy(**row) -> dict:
    return {"prompt": "A hill at sunset.", **row}


def ref(*entries, **row) -> dict:
    return {"prompt": "Use the references in order.", "references": list(entries), **row}


def demo(media=(), target=TARGET, **top) -> dict:
    record = {"schema_version": 2, "input": {"prompt": "Restyle.", "media": list(media)},
              "supervision": {"type": "demonstration", "target": target}, "metadata": {}}
    record.update(top)
    return record


def pref(chosen=TARGET, rejected=TARGET, **top) -> dict:
    record = {"schema_version": 2, "input": {"prompt": "A poster.", "media": []},
              "supervision": {"type": "preference", "chosen": chosen, "rejected": rejected}}
    record.update(top)
    return record


def without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


def media(**item) -> dict:
    return {"media": [item]}


# (case id, form, bad row (dict, or a raw line), field, reason fragment).
# form: legacy / ref2va -> an evaluation split (legacy rows); sft / offline-dpo -> a V2 training split.
MALFORMED = [
    # --- legacy generation rows ---------------------------------------------------------------------------
    ("legacy-array", "legacy", [1, 2], None, "expected a JSON object"),
    ("legacy-string", "legacy", '"just a prompt"', None, "expected a JSON object"),
    ("legacy-no-prompt", "legacy", {"image": "a.png"}, "prompt", "required key is missing"),
    ("legacy-prompt-number", "legacy", {"prompt": 3}, "prompt", "expected a string"),
    ("legacy-prompt-null", "legacy", {"prompt": None}, "prompt", "expected a string"),
    ("legacy-prompt-blank", "legacy", {"prompt": "   "}, "prompt", "must not be empty"),
    ("legacy-promt-for-prompt", "legacy", {"promt": "typo", "tag": "x"}, "prompt",
     "required key is missing (is 'promt' a misspelling of it?)"),
    ("legacy-column-and-metadata-key", "legacy", legacy(tag="color_attr", metadata={"tag": "count"}), "tag",
     "given both as a column and inside metadata; keep one"),
    ("legacy-negative-number", "legacy", legacy(negative_prompt=1), "negative_prompt", "expected a string"),
    ("legacy-image-and-images", "legacy", legacy(image="a.png", images=["b.png"]), "images", "not both"),
    ("legacy-images-number", "legacy", legacy(images=3), "images", "expected a path or an array of paths, found a"),
    ("legacy-images-string-empty", "legacy", legacy(images=" "), "images", "must not be empty"),
    ("legacy-images-empty", "legacy", legacy(images=[]), "images", "at least one path"),
    ("legacy-images-item-number", "legacy", legacy(images=["a.png", 7]), "images[1]", "expected a string"),
    ("legacy-images-item-empty", "legacy", legacy(images=[""]), "images[0]", "must not be empty"),
    ("legacy-image-null", "legacy", legacy(image=None), "image", "expected a string"),
    ("legacy-video-and-videos", "legacy", legacy(video="a.mp4", videos=["b.mp4"]), "videos", "not both"),
    ("legacy-videos-object", "legacy", legacy(videos={"a": 1}), "videos", "expected a path or an array of paths"),
    ("legacy-audios-number", "legacy", legacy(audios=3), "audios", "expected a path or an array of paths"),
    ("legacy-audio-empty", "legacy", legacy(audio=""), "audio", "must not be empty"),
    ("legacy-metadata-list", "legacy", legacy(metadata=[1]), "metadata", "expected a JSON object"),
    ("legacy-v2-record-in-eval", "legacy", demo(), "schema_version", "V2 records are offline training records"),
    ("legacy-invalid-json", "legacy", '{"prompt": "x",}', None, "invalid JSON"),
    ("legacy-unclosed", "legacy", '{"prompt": "x"', None, "invalid JSON"),
    ("legacy-duplicate-key", "legacy", '{"prompt": "a", "prompt": "b"}', "prompt", "duplicate key"),
    # --- MiniMax H3 Ref2VA references -------------------------------------------------------------------
    ("ref-not-array", "ref2va", legacy(references=IMG), "references", "expected an array"),
    ("ref-empty", "ref2va", ref(), "references", "at least one reference"),
    ("ref-entry-string", "ref2va", ref("a.png"), "references[0]", "expected a reference object"),
    ("ref-no-type", "ref2va", ref({"path": "a.png"}), "references[0].type", "required key is missing"),
    ("ref-unknown-type", "ref2va", ref({"type": "text", "path": "a"}), "references[0].type", "unknown media type"),
    ("ref-type-number", "ref2va", ref({"type": 1, "path": "a"}), "references[0].type", "unknown media type"),
    ("ref-kind-not-type", "ref2va", ref({"kind": "image", "path": "a"}), "references[0].type", "required"),
    ("ref-no-path", "ref2va", ref({"type": "image"}), "references[0].path", "required key is missing"),
    ("ref-empty-path", "ref2va", ref({**IMG, "path": ""}), "references[0].path", "must not be empty"),
    ("ref-path-number", "ref2va", ref({**IMG, "path": 5}), "references[0].path", "expected a string"),
    ("ref-image-fps", "ref2va", ref({**IMG, "fps": 24}), "references[0].fps", "unknown key"),
    ("ref-image-slot", "ref2va", ref({**IMG, "slot": "first_frame"}), "references[0].slot", "unknown key"),
    ("ref-audio-fps", "ref2va", ref(IMG, {**AUD, "fps": 24}), "references[1].fps", "unknown key"),
    ("ref-audio-audio-path", "ref2va", ref(IMG, {**AUD, "audio_path": "x.wav"}), "references[1].audio_path",
     "unknown key"),
    ("ref-video-rate-no-audio-path", "ref2va", ref({**VID, "sample_rate": 16000}), "references[0].sample_rate",
     "requires audio_path"),
    ("ref-fps-zero", "ref2va", ref({**VID, "fps": 0}), "references[0].fps", "finite positive"),
    ("ref-fps-negative", "ref2va", ref({**VID, "fps": -12}), "references[0].fps", "finite positive"),
    ("ref-fps-nan", "ref2va", '{"prompt": "p", "references": [{"type": "video", "path": "m.mp4", "fps": NaN}]}',
     "references[0].fps", "finite positive"),
    ("ref-fps-infinity", "ref2va",
     '{"prompt": "p", "references": [{"type": "video", "path": "m.mp4", "fps": Infinity}]}',
     "references[0].fps", "finite positive"),
    ("ref-fps-string", "ref2va", ref({**VID, "fps": "12"}), "references[0].fps", "expected a number"),
    ("ref-fps-bool", "ref2va", ref({**VID, "fps": True}), "references[0].fps", "expected a number"),
    ("ref-audio-rate-negative", "ref2va", ref(IMG, {**AUD, "sample_rate": -1}), "references[1].sample_rate",
     "finite positive"),
    ("ref-audio-path-empty", "ref2va", ref({**VID, "audio_path": ""}), "references[0].audio_path", "must not be empty"),
    ("ref-audio-path-number", "ref2va", ref({**VID, "audio_path": 3}), "references[0].audio_path", "expected a string"),
    ("ref-video-unknown-key", "ref2va", ref({**VID, "start": 1.0}), "references[0].start", "unknown key"),
    ("ref-third-entry", "ref2va", ref(IMG, VID, {"type": "audio", "path": ""}), "references[2].path", "empty"),
    ("ref-with-images-column", "ref2va", ref(IMG, images=["a.png"]), "references", "not both"),
    ("ref-thirteen", "ref2va", ref(*[IMG] * 13), "references", "needs 1-12 references, found 13"),
    ("ref-audio-only", "ref2va", ref(AUD, AUD), "references",
     "needs at least one image or video reference (found only audio, audio)"),
    # --- strict V2 records ----------------------------------------------------------------------------------
    ("v2-legacy-row", "sft", {"prompt": "A hill."}, "schema_version", "strict V2 records"),
    ("v2-not-object", "sft", [demo()], None, "expected a JSON object"),
    ("v2-version-string", "sft", demo(schema_version="2"), "schema_version", "must be the integer 2"),
    ("v2-version-float", "sft", demo(schema_version=2.0), "schema_version", "must be the integer 2"),
    ("v2-version-one", "sft", demo(schema_version=1), "schema_version", "must be the integer 2"),
    ("v2-version-bool", "sft", demo(schema_version=True), "schema_version", "must be the integer 2"),
    ("v2-unknown-top-key", "sft", demo(extra=1), "extra", "unknown key"),
    ("v2-unknown-top-keys", "sft", demo(extra=1, prompt="p"), None,
     "unknown keys 'extra', 'prompt' (allowed here: input, metadata, schema_version, supervision)"),
    ("v2-no-input", "sft", without(demo(), "input"), "input", "required key is missing"),
    ("v2-no-supervision", "sft", without(demo(), "supervision"), "supervision", "required key is missing"),
    ("v2-input-string", "sft", demo(input="x"), "input", "expected a JSON object"),
    ("v2-no-prompt", "sft", demo(input={"media": []}), "input.prompt", "required key is missing"),
    ("v2-prompt-null", "sft", demo(input={"prompt": None}), "input.prompt", "expected a string, found null"),
    ("v2-negative-prompt-number", "sft", demo(input={"prompt": "p", "negative_prompt": 3}),
     "input.negative_prompt", "expected a string, found a number (3)"),
    ("v2-input-unknown-keys", "sft", demo(input={"prompt": "p", "negative": "n", "image": "a.png"}), "input",
     "unknown keys 'image', 'negative' (allowed here: media, negative_prompt, prompt)"),
    ("v2-media-not-array", "sft", demo(input={"prompt": "p", "media": {}}), "input.media", "expected an array"),
    ("v2-media-item-string", "sft", demo(["a.png"]), "input.media[0]", "expected a media object"),
    ("v2-media-no-type", "sft", demo([{"path": "a.png"}]), "input.media[0].type", "required key is missing"),
    ("v2-media-bad-type", "sft", demo([{"type": "mask", "path": "a"}]), "input.media[0].type", "unknown media type"),
    ("v2-kind-discriminator", "sft", demo([{"kind": "image", "path": "a"}]), "input.media[0].type", "required"),
    ("v2-image-fps", "sft", demo([{"type": "image", "path": "a.png", "fps": 24}]), "input.media[0].fps",
     "unknown key (allowed here: path, slot, type)"),
    ("v2-image-two-unknown", "sft", demo([{"type": "image", "path": "a.png", "fps": 24, "size": 2}]),
     "input.media[0]", "unknown keys 'fps', 'size' (allowed here: path, slot, type)"),
    ("v2-output-video-unknown", "sft", demo(target=media(type="video", path="t.mp4", rate=24)),
     "supervision.target.media[0].rate", "unknown key (allowed here: fps, path, type)"),
    ("v2-video-sample-rate", "sft", demo([{"type": "video", "path": "a.mp4", "sample_rate": 16000}]),
     "input.media[0].sample_rate", "unknown key"),
    ("v2-video-audio-path", "sft", demo([{"type": "video", "path": "a.mp4", "audio_path": "a.wav"}]),
     "input.media[0].audio_path", "unknown key"),
    ("v2-audio-fps", "sft", demo([{"type": "audio", "path": "a.wav", "fps": 24}]), "input.media[0].fps",
     "unknown key"),
    ("v2-empty-path", "sft", demo([IMG, {"type": "image", "path": " "}]), "input.media[1].path", "must not be empty"),
    ("v2-path-null", "sft", demo([{"type": "image", "path": None}]), "input.media[0].path", "expected a string"),
    ("v2-empty-slot", "sft", demo([{**IMG, "slot": ""}]), "input.media[0].slot", "must not be empty"),
    ("v2-slot-number", "sft", demo([{**IMG, "slot": 0}]), "input.media[0].slot", "expected a string"),
    ("v2-input-video-fps-nan", "sft",
     json.dumps(demo([{"type": "video", "path": "a.mp4", "fps": 1.0}])).replace("1.0", "NaN"),
     "input.media[0].fps", "finite positive"),
    ("v2-supervision-list", "sft", demo(supervision=[]), "supervision", "expected a JSON object"),
    ("v2-supervision-no-type", "sft", demo(supervision={"target": TARGET}), "supervision.type", "required"),
    ("v2-supervision-bad-type", "sft", demo(supervision={"type": "ranking"}), "supervision.type",
     "'demonstration' or 'preference'"),
    ("v2-demo-no-target", "sft", demo(supervision={"type": "demonstration"}), "supervision.target",
     "required key is missing"),
    ("v2-demo-with-chosen", "sft", demo(supervision={"type": "demonstration", "target": TARGET, "chosen": TARGET}),
     "supervision.chosen", "unknown key"),
    ("v2-target-list", "sft", demo(target=[]), "supervision.target", "expected a JSON object"),
    ("v2-target-no-media", "sft", demo(target={}), "supervision.target.media", "required key is missing"),
    ("v2-target-empty-media", "sft", demo(target={"media": []}), "supervision.target.media", "at least one"),
    ("v2-target-extra-key", "sft", demo(target={**TARGET, "fps": 24}), "supervision.target.fps", "unknown key"),
    ("v2-output-slot", "sft", demo(target=media(type="image", path="t.png", slot="first_frame")),
     "supervision.target.media[0].slot", "outputs take no slot"),
    ("v2-output-fps-infinity", "sft",
     json.dumps(demo(target=media(type="video", path="t.mp4", fps=2.5))).replace("2.5", "Infinity"),
     "supervision.target.media[0].fps", "finite positive"),
    ("v2-output-fps-negative", "sft", demo(target=media(type="video", path="t.mp4", fps=-24)),
     "supervision.target.media[0].fps", "finite positive"),
    ("v2-output-rate-zero", "sft", demo(target=media(type="audio", path="t.wav", sample_rate=0)),
     "supervision.target.media[0].sample_rate", "must be a positive integer, found 0"),
    ("v2-rate-float", "sft", demo(target=media(type="audio", path="t.wav", sample_rate=16000.0)),
     "supervision.target.media[0].sample_rate", "expected an integer, found a number (16000.0)"),
    ("v2-rate-bool", "sft", demo([{"type": "audio", "path": "a.wav", "sample_rate": True}]),
     "input.media[0].sample_rate", "expected an integer, found a boolean"),
    ("v2-metadata-nan", "sft", json.dumps(demo(metadata={"score": 0.5})).replace("0.5", "NaN"), "metadata.score",
     "must be finite JSON (NaN and Infinity are not JSON), found nan"),
    ("v2-metadata-nested-infinity", "sft",
     json.dumps(demo(metadata={"a": {"b": [1, 0.5]}})).replace("0.5", "-Infinity"), "metadata.a.b[1]",
     "must be finite JSON (NaN and Infinity are not JSON), found -inf"),
    ("v2-metadata-string", "sft", demo(metadata="note"), "metadata", "expected a JSON object"),
    ("v2-sft-given-preference", "sft", pref(), "supervision.type", "needs 'demonstration'"),
    ("v2-dpo-given-demonstration", "offline-dpo", demo(), "supervision.type", "needs 'preference'"),
    ("v2-pref-no-rejected", "offline-dpo", pref(supervision={"type": "preference", "chosen": TARGET}),
     "supervision.rejected", "required key is missing"),
    ("v2-pref-target-key", "offline-dpo",
     pref(supervision={"type": "preference", "chosen": TARGET, "rejected": TARGET, "target": TARGET}),
     "supervision.target", "unknown key"),
    ("v2-pref-rejected-empty", "offline-dpo", pref(rejected={"media": []}), "supervision.rejected.media",
     "at least one"),
    ("v2-pref-chosen-bad-type", "offline-dpo", pref(chosen=media(type="img", path="c.png")),
     "supervision.chosen.media[0].type", "unknown media type"),
    ("v2-invalid-json", "sft", '{"schema_version": 2, ', None, "invalid JSON"),
    ("v2-blank-line", "offline-dpo", "", None, "blank line"),
    ("v2-duplicate-key", "sft", '{"schema_version": 2, "schema_version": 2}', "schema_version", "duplicate key"),
]
VALID_FOR = {"legacy": legacy(), "ref2va": ref(IMG), "sft": demo(), "offline-dpo": pref()}


def _load(tmp_path: Path, form: str, rows: list) -> list[Record]:
    cfg = DatasetConfig(name="t", dataset_dir=str(tmp_path), eval={})
    if form in ("legacy", "ref2va"):
        write_lines(tmp_path / "train.txt", ["a prompt"])
        write_lines(tmp_path / "test.jsonl", rows)
        return load_split(cfg, "test", "sft")
    write_lines(tmp_path / "train.jsonl", rows)
    return load_split(cfg, "train", form)


def test_corpus_is_large_and_ids_unique():
    assert len(MALFORMED) >= 60
    assert len({case[0] for case in MALFORMED}) == len(MALFORMED)


@pytest.mark.parametrize("case, form, row, field, reason", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_row_rejected_with_line_and_field(tmp_path, case, form, row, field, reason):
    valid = VALID_FOR[form]
    with pytest.raises(DatasetErrors) as info:
        _load(tmp_path, form, [valid, row, valid])
    errors = info.value.errors
    assert [(e.line, e.field) for e in errors] == [(2, field)], info.value.format()
    assert reason in errors[0].reason
    assert str(errors[0]).startswith(f"{errors[0].path}:2:")


@pytest.mark.parametrize("form", ["legacy", "ref2va", "sft", "offline-dpo"])
def test_every_error_of_a_file_is_collected(tmp_path, form):
    cases = [c for c in MALFORMED if c[1] == form and "blank" not in c[0]]
    rows = [VALID_FOR[form]] + [c[2] for c in cases]
    with pytest.raises(DatasetErrors) as info:
        _load(tmp_path, form, rows)
    assert [(e.line, e.field) for e in info.value.errors] == [(i + 2, c[3]) for i, c in enumerate(cases)]


def test_error_message_shape(tmp_path):
    path = write_lines(tmp_path / "test.jsonl", [legacy(), legacy(images=[""])])
    with pytest.raises(DatasetErrors) as info:
        _load(tmp_path, "legacy", [legacy(), legacy(images=[""])])
    assert info.value.format() == f"{path}:2: images[0]: must not be empty"
    assert isinstance(info.value, ValueError) and isinstance(info.value, DatasetError)


@pytest.mark.parametrize("text, line", [("", 1), ("\n\n", 1), ("  \n\t\n", 1)])
def test_empty_and_blank_only_files(tmp_path, text, line):
    (tmp_path / "train.txt").write_text("p\n")
    (tmp_path / "test.jsonl").write_text(text)
    with pytest.raises(DatasetErrors) as info:
        load_split(DatasetConfig(name="t", dataset_dir=str(tmp_path)), "test", None)
    assert info.value.errors[0].line == line


def test_legacy_jsonl_blank_lines_skipped_but_counted(tmp_path):
    """Flow-Factory reads legacy JSONL with HF datasets' JSON builder (pyarrow), which skips blank and
    whitespace-only lines; a V2 manifest keeps them an error (v2-blank-line above)."""
    (tmp_path / "train.txt").write_text("p\n")
    (tmp_path / "test.jsonl").write_text('{"prompt": "a"}\n\n  \t\n{"prompt": "b", "images": 3}\n')
    with pytest.raises(DatasetErrors) as info:
        load_split(DatasetConfig(name="t", dataset_dir=str(tmp_path), eval={}), "test", "grpo")
    assert info.value.format() == (f"{tmp_path}/test.jsonl:4: images: expected a path or an array of paths, "
                                   "found a number (3)")
    (tmp_path / "test.jsonl").write_text('{"prompt": "a"}\n\n  \t\n{"prompt": "b"}\n')
    records = load_split(DatasetConfig(name="t", dataset_dir=str(tmp_path), eval={}), "test", "grpo")
    assert [(r.line, r.prompt) for r in records] == [(1, "a"), (4, "b")]


def test_txt_prompts_blank_lines_skipped_but_counted(tmp_path):
    """Flow-Factory reads ``[line.strip() for line in f if line.strip()]``; the lines still count for messages."""
    (tmp_path / "train.txt").write_text("A hill at sunset.\n\n   \n  An astronaut.  \n\n")
    records = load_split(DatasetConfig(name="t", dataset_dir=str(tmp_path)), "train", "grpo")
    assert [(r.line, r.prompt) for r in records] == [(1, "A hill at sunset."), (4, "An astronaut.")]
    (tmp_path / "train.txt").write_text("A hill at sunset.\r\n  An astronaut.  \r\n")
    records = load_split(DatasetConfig(name="t", dataset_dir=str(tmp_path)), "train", "grpo")
    assert [(r.line, r.prompt) for r in records] == [(1, "A hill at sunset."), (2, "An astronaut.")]


def test_not_utf8(tmp_path):
    (tmp_path / "train.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(DatasetError, match="not UTF-8"):
        load_split(DatasetConfig(name="t", dataset_dir=str(tmp_path)), "train", "grpo")


# --- every valid example of the spec ---------------------------------------------------------------------------
SPEC_V2 = [
    '{"schema_version":2,"input":{"prompt":"Restyle the source as a watercolor.","media":[{"type":"image","path":"conditions/source.png"}]},"supervision":{"type":"demonstration","target":{"media":[{"type":"image","path":"targets/watercolor.png"}]}},"metadata":{"license":"example"}}',  # noqa: E501
    '{"schema_version":2,"input":{"prompt":"A clean typographic poster.","media":[]},"supervision":{"type":"preference","chosen":{"media":[{"type":"image","path":"pairs/chosen.png"}]},"rejected":{"media":[{"type":"image","path":"pairs/rejected.png"}]}},"metadata":{"annotator":"example"}}',  # noqa: E501
    '{"schema_version":2,"input":{"prompt":"A paper boat crosses the pond.","media":[{"type":"image","path":"conditions/first.png","slot":"first_frame"}]},"supervision":{"type":"demonstration","target":{"media":[{"type":"video","path":"targets/first-only.mp4","fps":24.0}]}},"metadata":{}}',  # noqa: E501
    '{"schema_version":2,"input":{"prompt":"Interpolate the changing sky.","media":[{"type":"image","path":"conditions/first.png","slot":"first_frame"},{"type":"image","path":"conditions/last.png","slot":"last_frame"}]},"supervision":{"type":"preference","chosen":{"media":[{"type":"video","path":"pairs/chosen.mp4","fps":24.0}]},"rejected":{"media":[{"type":"video","path":"pairs/rejected.mp4","fps":24.0}]}},"metadata":{}}',  # noqa: E501
    '{"schema_version":2,"input":{"prompt":"Ocean waves beneath an aurora.","media":[]},"supervision":{"type":"demonstration","target":{"media":[{"type":"video","path":"targets/aurora.mp4","fps":24.0},{"type":"audio","path":"targets/aurora.wav","sample_rate":32000}]}},"metadata":{}}',  # noqa: E501
    '{"schema_version":2,"input":{"prompt":"Ocean waves beneath an aurora.","media":[]},"supervision":{"type":"preference","chosen":{"media":[{"type":"video","path":"pairs/chosen.mp4","fps":24.0},{"type":"audio","path":"pairs/chosen.wav","sample_rate":32000}]},"rejected":{"media":[{"type":"video","path":"pairs/rejected.mp4","fps":24.0},{"type":"audio","path":"pairs/rejected.wav","sample_rate":32000}]}},"metadata":{}}',  # noqa: E501
    '{"schema_version":2,"input":{"prompt":"Reveal the scene before this ending.","media":[{"type":"image","path":"conditions/end.png","slot":"last_frame"}]},"supervision":{"type":"demonstration","target":{"media":[{"type":"video","path":"targets/story.mp4","fps":24.0},{"type":"audio","path":"targets/story.wav","sample_rate":32000}]}},"metadata":{}}',  # noqa: E501
]
SPEC_V2_MEDIA = [
    '{"type":"image","path":"images/source.png"}',
    '{"type":"image","path":"images/end.png","slot":"last_frame"}',
    '{"type":"video","path":"videos/clip.mp4","fps":24.0}',
    '{"type":"audio","path":"audios/clip.wav","sample_rate":48000}',
]
SPEC_LEGACY_JSONL = [
    '{"prompt":"A hill at sunset."}',
    '{"prompt":"An astronaut riding a horse on Mars."}',
    '{"prompt":"Restyle this scene as a watercolor.","image":"input.png"}',
    '{"prompt":"Combine these visual references.","images":["first.png","second.png"]}',
    '{"prompt":"Restyle this motion.","video":"input.mp4"}',
    '{"prompt":"Use both motion references.","videos":["motion-a.mp4","motion-b.mp4"]}',
    '{"prompt":"Generate visuals matching this sound.","audio":"sound.wav"}',
    '{"prompt":"Use these sound references.","audios":["voice.wav","ambience.wav"]}',
    '{"prompt":"Combine these images together.","images":["first.png","second.png"]}',
    '{"prompt":"Combine these images together.","images":["style.png","subject.png","layout.png"]}',
    '{"prompt":"A small paper windmill turns beside a quiet stream with synchronized birdsong."}',
    '{"prompt":"Animate this scene with matching sound.","images":["images/first.png"]}',
    '{"prompt":"Interpolate between these scenes.","images":["images/first.png","images/last.png"]}',
    '{"prompt":"Create a coherent scene using the references in order.","references":[{"type":"image","path":"references/style.png"},{"type":"video","path":"references/motion.mp4","fps":12.0},{"type":"audio","path":"references/ambience.wav","sample_rate":16000}]}',  # noqa: E501
]


@pytest.mark.parametrize("line", SPEC_V2)
def test_spec_v2_examples_accepted(line, tmp_path):
    record = parse_v2_record(json.loads(line), tmp_path / "train.jsonl", 1, tmp_path)
    raw = json.loads(line)
    assert record.schema == "v2" and record.supervision == raw["supervision"]["type"]
    assert record.prompt == raw["input"]["prompt"]
    assert [m.path for m in record.inputs] == [tmp_path / m["path"] for m in raw["input"]["media"]]
    assert [m.slot for m in record.inputs] == [m.get("slot") for m in raw["input"]["media"]]
    assert record.metadata == raw["metadata"]
    keys = ("target",) if record.supervision == "demonstration" else ("chosen", "rejected")
    assert [[(m.type.value, m.path.name, m.fps, m.sample_rate) for m in c] for c in record.candidates] == [
        [(m["type"], Path(m["path"]).name, m.get("fps"), m.get("sample_rate")) for m in raw["supervision"][k]["media"]]
        for k in keys
    ]


@pytest.mark.parametrize("line", SPEC_V2_MEDIA)
def test_spec_v2_media_objects_accepted(line, tmp_path):
    from ff_core.data.records import FieldReader

    item = parse_v2_media(FieldReader(tmp_path, 1), json.loads(line), "input.media[0]", tmp_path, is_input=True)
    assert item.type is MediaType(json.loads(line)["type"]) and item.path.parent.parent == tmp_path


def test_spec_legacy_examples_accepted(tmp_path):
    (tmp_path / "train.txt").write_text("A hill at sunset.\nAn astronaut riding a horse on Mars.\n")
    write_lines(tmp_path / "test.jsonl", SPEC_LEGACY_JSONL)
    cfg = DatasetConfig(name="t", dataset_dir=str(tmp_path), eval={})
    assert [r.prompt for r in load_split(cfg, "train", "grpo")] == ["A hill at sunset.",
                                                                     "An astronaut riding a horse on Mars."]
    records = load_split(cfg, "test", "offline-dpo")
    assert len(records) == len(SPEC_LEGACY_JSONL) and all(r.schema == "legacy" for r in records)


def test_legacy_normalisation_and_resolution(tmp_path):
    dirs = {MediaType.IMAGE: tmp_path / "img", MediaType.VIDEO: tmp_path / "vid", MediaType.AUDIO: Path("/abs/aud")}
    row = {"prompt": "p", "image": "a.png", "videos": ["b.mp4", "/abs/c.mp4"], "audio": "d.wav",
           "negative_prompt": "", "metadata": {"answer": 42}}
    r = parse_legacy_row(row, tmp_path / "test.jsonl", 3, dirs)
    assert r.inputs == (
        MediaItem(MediaType.IMAGE, tmp_path / "img" / "a.png"),
        MediaItem(MediaType.VIDEO, tmp_path / "vid" / "b.mp4"),
        MediaItem(MediaType.VIDEO, Path("/abs/c.mp4")),
        MediaItem(MediaType.AUDIO, Path("/abs/aud/d.wav")),
    )
    assert [m.origin for m in r.inputs] == ["image", "videos[0]", "videos[1]", "audio"]
    assert r.negative_prompt == "" and r.metadata == {"answer": 42} and r.line == 3


def test_fl2va_image_order_preserved_never_sorted_or_deduplicated(tmp_path):
    dirs = {t: tmp_path for t in MediaType}
    r = parse_legacy_row({"prompt": "p", "images": ["z.png", "a.png", "z.png"]}, tmp_path / "t.jsonl", 1, dirs)
    assert [m.path.name for m in r.inputs] == ["z.png", "a.png", "z.png"]


def test_references_resolved_against_dataset_dir_in_order(tmp_path):
    dirs = {t: tmp_path / "elsewhere" for t in MediaType}
    row = ref(AUD, {**VID, "audio_path": "references/track.wav", "sample_rate": 22050}, IMG,
              {"type": "image", "path": "/abs/x.png"})
    r = parse_legacy_row(row, tmp_path / "test.jsonl", 1, dirs, root=tmp_path / "root")
    assert [m.type.value for m in r.references] == ["audio", "video", "image", "image"]
    assert r.references[0].path == tmp_path / "root" / "references/ambience.wav"
    assert r.references[1].audio_path == tmp_path / "root" / "references/track.wav"
    assert (r.references[1].fps, r.references[1].sample_rate) == (12.0, 22050.0)
    assert r.references[3].path == Path("/abs/x.png") and r.inputs == ()


def test_v2_paths_resolve_against_dataset_dir_absolute_kept(tmp_path):
    rec = demo([{"type": "image", "path": "/abs/a.png"}], target=media(type="image", path="t/b.png"))
    r = parse_v2_record(rec, tmp_path / "train.jsonl", 1, tmp_path / "root")
    assert r.inputs[0].path == Path("/abs/a.png")
    assert r.candidates[0][0].path == tmp_path / "root" / "t/b.png"
    assert [o for o, _ in r.media()] == ["input.media[0]", "supervision.target.media[0]"]


def test_v2_metadata_is_free_json_and_not_an_input(tmp_path):
    meta = {"nested": {"list": [1, None, "x"]}, "score": 0.5}
    r = parse_v2_record(demo(metadata=meta), tmp_path / "train.jsonl", 1, tmp_path)
    assert r.metadata == meta and r.inputs == ()


# --- Flow-Factory parity: reward metadata, forgiving columns, V2 types ----------------------------------------------
def test_extra_columns_are_reward_metadata(tmp_path):
    """Spec: datasets carry "prompts, and optional reward metadata"; Flow-Factory keeps every column it does not
    preprocess as the sample's metadata. Known columns never reach it; a ``metadata`` object merges in."""
    dirs = {t: tmp_path for t in MediaType}
    row = {"tag": "color_attr", "include": [{"class": "bench", "count": 1, "color": "blue"}], "exclude": [],
           "prompt": "a photo of a blue bench", "negative_prompt": "", "images": ["a.png"],
           "metadata": {"answer": "OCR"}}
    r = parse_legacy_row(row, tmp_path / "test.jsonl", 1, dirs)
    assert r.metadata == {"answer": "OCR", "tag": "color_attr", "exclude": [],
                          "include": [{"class": "bench", "count": 1, "color": "blue"}]}
    assert r.prompt == "a photo of a blue bench" and [m.path.name for m in r.inputs] == ["a.png"]


def test_plural_column_given_as_one_string_is_a_one_element_list(tmp_path):
    """Flow-Factory: ``if isinstance(paths, str): paths = [paths]``; the column is named as the user wrote it."""
    dirs = {t: tmp_path / f"{t}s" for t in MediaType}
    r = parse_legacy_row(legacy(images="subject.png", audios="a.wav"), tmp_path / "test.jsonl", 1, dirs)
    assert [(m.type.value, m.path, m.origin) for m in r.inputs] == [
        ("image", tmp_path / "images/subject.png", "images"), ("audio", tmp_path / "audios/a.wav", "audios")]
    assert r.inputs[0].field_of("path") == "images" and r.inputs[0].file_fields() == [
        (tmp_path / "images/subject.png", "images")]


def test_v2_negative_prompt_and_empty_prompt(tmp_path):
    """Flow-Factory's V2 ``InputSpec``: ``prompt: str`` (empty allowed), ``negative_prompt: str | None``."""
    r = parse_v2_record(demo(input={"prompt": "", "negative_prompt": "blurry"}), tmp_path / "train.jsonl", 1, tmp_path)
    assert (r.prompt, r.negative_prompt, r.field_path("negative_prompt")) == ("", "blurry", "input.negative_prompt")
    r = parse_v2_record(demo(input={"prompt": "p", "negative_prompt": None}), tmp_path / "train.jsonl", 1, tmp_path)
    assert r.negative_prompt is None
    r = parse_v2_record(demo(target=media(type="audio", path="t.wav", sample_rate=16000)), tmp_path / "t.jsonl", 1,
                        tmp_path)
    assert r.candidates[0][0].sample_rate == 16000


def test_paths_are_normalised(tmp_path):
    """Flow-Factory's V2 loader ``os.path.normpath`` s every media path; ff does so for every format, so a message
    names each file one way."""
    r = parse_v2_record(demo([{"type": "image", "path": "./c/../c/./a.png"}]), tmp_path / "train.jsonl", 1,
                        tmp_path / "root" / ".." / "root")
    assert r.inputs[0].path == tmp_path / "root" / "c" / "a.png"
    dirs = {t: tmp_path / "img" for t in MediaType}
    r = parse_legacy_row(legacy(image="x/../b.png"), tmp_path / "test.jsonl", 1, dirs)
    assert r.inputs[0].path == tmp_path / "img" / "b.png"
    r = parse_legacy_row(ref({**IMG, "path": "refs//./s.png"}), tmp_path / "test.jsonl", 1, dirs, root=tmp_path)
    assert r.references[0].path == tmp_path / "refs" / "s.png"
