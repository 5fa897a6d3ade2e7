"""Dataset folders and splits (spec: "Directory and split layout"), the data.datasets entries, and the errors."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from data_helpers import write_lines

from ff_core.contracts import MediaType
from ff_core.data.records.sources import DatasetConfig, SplitConfig, check_dataset_configs, detect_schema, load_split
from ff_core.errors import DatasetError, DatasetErrors, DatasetWarning

DEMO = {"schema_version": 2, "input": {"prompt": "p", "media": [{"type": "image", "path": "c/a.png"}]},
        "supervision": {"type": "demonstration", "target": {"media": [{"type": "image", "path": "t/a.png"}]}}}
PREF = {"schema_version": 2, "input": {"prompt": "p", "media": []},
        "supervision": {"type": "preference", "chosen": {"media": [{"type": "image", "path": "c.png"}]},
                        "rejected": {"media": [{"type": "image", "path": "r.png"}]}}}


def cfg(root: Path, **kw) -> DatasetConfig:
    return DatasetConfig(name="ds", dataset_dir=str(root), **kw)


def test_train_split_required(tmp_path):
    write_lines(tmp_path / "test.txt", ["a prompt"])
    with pytest.raises(DatasetErrors) as info:
        load_split(cfg(tmp_path), "train", "grpo")
    reason = "dataset 'ds': no training split (neither train.jsonl nor train.txt exists)"
    assert str(info.value) == f"{tmp_path}: {reason}"  # a folder-level problem has no line, and prints none


def test_missing_folder_and_both_formats(tmp_path):
    with pytest.raises(DatasetError) as info:
        load_split(cfg(tmp_path / "nope"), "train", "sft")
    assert str(info.value) == f"{tmp_path}/nope: dataset_dir: dataset 'ds': folder does not exist"
    (tmp_path / "file").write_text("x")
    with pytest.raises(DatasetError) as info:
        load_split(cfg(tmp_path / "file"), "test", "sft")
    assert str(info.value) == f"{tmp_path}/file: dataset_dir: dataset 'ds': is not a folder"
    write_lines(tmp_path / "train.txt", ["a"])
    write_lines(tmp_path / "train.jsonl", [{"prompt": "a"}])
    with pytest.raises(DatasetError, match="both train.jsonl and train.txt exist"):
        load_split(cfg(tmp_path), "train", "grpo")


def test_test_split_optional(tmp_path):
    write_lines(tmp_path / "train.txt", ["a"])
    assert load_split(cfg(tmp_path, eval={}), "test", "grpo") == []


def test_v2_train_beside_legacy_prompt_only_test(tmp_path):
    write_lines(tmp_path / "train.jsonl", [DEMO, DEMO])
    write_lines(tmp_path / "test.jsonl", [{"prompt": "evaluate me"}])
    train = load_split(cfg(tmp_path), "train", "sft")
    test = load_split(cfg(tmp_path, eval={}), "test", "sft")
    assert [r.schema for r in train] == ["v2", "v2"] and train[0].supervision == "demonstration"
    assert [(r.schema, r.prompt, r.supervision) for r in test] == [("legacy", "evaluate me", None)]


def test_media_dir_defaults_and_overrides(tmp_path):
    row = {"prompt": "p", "image": "a.png", "video": "b.mp4", "audio": "c.wav"}
    write_lines(tmp_path / "train.jsonl", [row])
    default = load_split(cfg(tmp_path), "train", "grpo")[0]
    assert [m.path for m in default.inputs] == [tmp_path / "images/a.png", tmp_path / "videos/b.mp4",
                                                tmp_path / "audios/c.wav"]
    over = cfg(tmp_path, image_dir=str(tmp_path), video_dir="/shared/videos", audio_dir="/shared/audio")
    assert [m.path for m in load_split(over, "train", "grpo")[0].inputs] == [
        tmp_path / "a.png", Path("/shared/videos/b.mp4"), Path("/shared/audio/c.wav")]
    assert over.media_dir("image") == tmp_path and cfg(tmp_path).media_dir(MediaType.AUDIO) == tmp_path / "audios"


def test_dataset_and_media_dirs_are_normalised(tmp_path):
    write_lines(tmp_path / "train.jsonl", [{"prompt": "p", "image": "a.png"}, {"prompt": "p", "images": 3}])
    c = cfg(tmp_path / "x" / ".." / ".", audio_dir=f"{tmp_path}/y/../z")
    assert c.root == tmp_path and c.media_dir("audio") == tmp_path / "z"
    with pytest.raises(DatasetErrors) as info:
        load_split(c, "train", "grpo")
    assert str(info.value) == (f"{tmp_path}/train.jsonl:2: images: expected a path or an array of paths, "
                               "found a number (3)")


def test_v2_paths_ignore_media_dir_overrides(tmp_path):
    write_lines(tmp_path / "train.jsonl", [DEMO])
    record = load_split(cfg(tmp_path, image_dir="/elsewhere"), "train", "sft")[0]
    assert record.inputs[0].path == tmp_path / "c/a.png" and record.candidates[0][0].path == tmp_path / "t/a.png"


def test_max_dataset_size(tmp_path):
    write_lines(tmp_path / "train.txt", ["a", "b", "c"])
    write_lines(tmp_path / "test.txt", ["x", "y"])
    c = cfg(tmp_path, train={"max_dataset_size": 2}, eval={"max_dataset_size": 1})
    assert [r.prompt for r in load_split(c, "train", "grpo")] == ["a", "b"]
    assert [r.prompt for r in load_split(c, "test", "grpo")] == ["x"]


def test_trainer_decides_the_training_format(tmp_path):
    write_lines(tmp_path / "train.jsonl", [DEMO])
    with pytest.raises(DatasetErrors, match="schema_version: a strict V2 record in a generation split"):
        load_split(cfg(tmp_path), "train", "grpo")
    (tmp_path / "train.jsonl").unlink()
    write_lines(tmp_path / "train.txt", ["a prompt"])
    with pytest.raises(DatasetErrors, match="trainer 'sft' needs strict V2 records in train.jsonl"):
        load_split(cfg(tmp_path), "train", "sft")


def test_detected_format_and_homogeneous_supervision(tmp_path):
    write_lines(tmp_path / "train.jsonl", [PREF, PREF])
    assert detect_schema(tmp_path / "train.jsonl") == "v2"
    assert [r.supervision for r in load_split(cfg(tmp_path), "train", None)] == ["preference"] * 2
    write_lines(tmp_path / "train.jsonl", [PREF, DEMO, PREF, DEMO])
    with pytest.raises(DatasetErrors) as info:
        load_split(cfg(tmp_path), "train", None)
    assert [(e.line, e.field) for e in info.value.errors] == [(2, "supervision.type"), (4, "supervision.type")]
    assert "mixed supervision: line 1 has 'preference' records, found 'demonstration'" in info.value.errors[0].reason
    with pytest.raises(DatasetErrors) as info:
        load_split(cfg(tmp_path), "train", "sft")
    assert [e.line for e in info.value.errors] == [1, 3]


def test_format_and_supervision_errors_reported_together_in_line_order(tmp_path):
    write_lines(tmp_path / "train.jsonl", [PREF, {**DEMO, "extra": 1}, DEMO])
    with pytest.raises(DatasetErrors) as info:
        load_split(cfg(tmp_path), "train", "sft")
    assert [(e.line, e.field) for e in info.value.errors] == [(1, "supervision.type"), (2, "extra")]


def test_dataset_config_entries():
    c = DatasetConfig(name="example", dataset_dir="~/dataset/example", train={"weight": 1, "max_dataset_size": 1024},
                      eval={})
    assert c.train == SplitConfig(1, 1024) and c.eval == SplitConfig()
    assert c.root == Path("~/dataset/example").expanduser() and c.media_dir("video") == c.root / "videos"
    with pytest.raises(ValueError, match="weight must be a number > 0"):
        SplitConfig(weight=0)
    with pytest.raises(ValueError, match="max_dataset_size must be an integer >= 1"):
        SplitConfig(max_dataset_size=0)
    with pytest.raises(ValueError, match="dataset_dir must be a non-empty string"):
        DatasetConfig(name="x", dataset_dir="")
    with pytest.raises(ValueError, match="train: .*unexpected keyword"):
        DatasetConfig(name="x", dataset_dir="d", train={"wieght": 1})


def test_check_dataset_configs_names_the_key():
    a = DatasetConfig(name="a", dataset_dir="d", train=SplitConfig(weight=2))
    b = DatasetConfig(name="a", dataset_dir="e")
    check_dataset_configs([a], "grpo")
    with pytest.raises(ValueError) as info:
        check_dataset_configs([a, b], "offline-dpo")
    assert str(info.value).splitlines() == [
        "data.datasets[0].train.weight: offline trainer 'offline-dpo' needs weight 1, found 2",
        "data.datasets[1].name: 'a' is already used by data.datasets[0]",
    ]


def test_errors_format_flatten_and_pickle():
    one = DatasetError("t.jsonl", 3, "input.prompt", "must not be empty")
    file_level = DatasetError("t.jsonl", None, None, "file is empty")
    many = DatasetErrors([one, DatasetErrors([file_level])])
    assert str(one) == "t.jsonl:3: input.prompt: must not be empty" and str(file_level) == "t.jsonl: file is empty"
    assert many.errors == [one, file_level] and (many.path, many.line, many.field) == ("t.jsonl", 3, "input.prompt")
    assert str(many).splitlines() == ["2 dataset errors:", str(one), str(file_level)]
    assert str(pickle.loads(pickle.dumps(many))) == str(many) and one.errors == [one]
    with pytest.raises(ValueError):
        DatasetErrors([])


def test_warning_format_and_pickle():
    warning = DatasetWarning("t.jsonl", 2, "references", "kept as metadata")
    assert str(warning) == warning.format() == "t.jsonl:2: warning: references: kept as metadata"
    assert DatasetWarning("t.jsonl", None, None, "x").format() == "t.jsonl: warning: x"
    assert str(pickle.loads(pickle.dumps(warning))) == str(warning)
