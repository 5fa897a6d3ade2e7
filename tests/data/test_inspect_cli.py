"""``ff data inspect`` on the example datasets and on tiny generated media of varied sizes, lengths and rates."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from data_helpers import make_media, write_lines

from ff_core.cli.data import main


def run(*argv) -> tuple[int, str]:
    out = io.StringIO()
    code = main(["inspect", *(str(a) for a in argv)], out=out)
    return code, out.getvalue()


def demonstration(prompt: str, target: list[dict], inputs: list[dict] | None = None, **metadata) -> dict:
    record = {"schema_version": 2, "input": {"prompt": prompt, "media": inputs or []},
              "supervision": {"type": "demonstration", "target": {"media": target}}}
    return {**record, "metadata": metadata} if metadata else record


@pytest.fixture
def varied(tmp_path) -> Path:
    """SFT records whose media differ in every header field ``inspect`` summarises.

    Images of width x height 48x32 and 64x20; videos of 12 frames at 24 fps (0.5 s, 48x32) and of 24 frames at
    12 fps (2 s, 24x16, no soundtrack); WAVs of 0.25 s at 8 kHz stereo and 0.5 s at 16 kHz mono. Row 3 repeats
    row 1's files: references count three times, distinct files twice.
    """
    d = tmp_path / "varied"
    make_media.write_png(d / "in" / "a.png", size=(32, 48))
    make_media.write_png(d / "in" / "b.png", size=(20, 64))
    make_media.write_mp4(d / "out" / "a.mp4", frames=12, fps=24, size=(32, 48))
    make_media.write_mp4(d / "out" / "b.mp4", frames=24, fps=12, size=(16, 24), audio_rate=None)
    make_media.write_wav(d / "out" / "a.wav", seconds=0.25, rate=8000, channels=2)
    make_media.write_wav(d / "out" / "b.wav", seconds=0.5, rate=16000, channels=1)
    write_lines(d / "train.jsonl", [
        demonstration("one", [{"type": "video", "path": "out/a.mp4", "fps": 24},
                              {"type": "audio", "path": "out/a.wav", "sample_rate": 8000}],
                      [{"type": "image", "path": "in/a.png", "slot": "first_frame"}], license="cc-by", seed=1),
        demonstration("two", [{"type": "video", "path": "out/b.mp4", "fps": 12},
                              {"type": "audio", "path": "out/b.wav", "sample_rate": 16000}],
                      [{"type": "image", "path": "in/b.png"}, {"type": "image", "path": "in/a.png"}], license="cc0"),
        demonstration("three", [{"type": "video", "path": "out/a.mp4", "fps": 24},
                                {"type": "audio", "path": "out/a.wav", "sample_rate": 8000}]),
    ])
    write_lines(d / "test.txt", ["a prompt", "another prompt"])
    return d


def test_ranges_over_distinct_files(varied):
    code, out = run(varied)
    assert code == 0, out
    assert out.splitlines() == [
        f"{varied}",
        "  train.jsonl: 3 rows; formats: v2 demonstration 3",
        "    metadata: license 2, seed 1",
        "    media: input image 3; target video 3, audio 3",
        "    image: 2 distinct files, width 48..64 px, height 20..32 px",
        "    video: 2 distinct files, width 24..48 px, height 16..32 px, 0.50..2.00 s, 12..24 fps",
        "    audio: 2 distinct files, 0.25..0.50 s, 8000..16000 Hz, 1..2 channels",
        "  test.txt: 2 rows; formats: txt 2",
        "    metadata: none",
        "    media: none",
    ]


def test_json_for_scripts(varied):
    code, out = run(varied, "--json", "--split", "train")
    assert code == 0, out
    assert json.loads(out) == {
        "dataset_dir": str(varied),
        "splits": [{
            "split": "train",
            "file": str(varied / "train.jsonl"),
            "rows": 3,
            "formats": {"v2 demonstration": 3},
            "metadata": {"license": 2, "seed": 1},
            "media": {"input": {"image": 3}, "target": {"video": 3, "audio": 3}},
            "files": {
                "image": {"count": 2, "width": [48, 64], "height": [20, 32]},
                "video": {"count": 2, "width": [24, 48], "height": [16, 32], "seconds": [0.5, 2.0],
                          "fps": [12.0, 24.0]},
                "audio": {"count": 2, "seconds": [0.25, 0.5], "sample_rate": [8000, 16000], "channels": [1, 2]},
            },
        }],
        "errors": [],
    }


def test_examples_roles_and_formats(examples):
    """Preference roles, Ref2VA references (a video's separate soundtrack counts as audio), legacy rows."""
    d = examples / "h3_ref2va_dpo"
    code, out = run(d)
    assert code == 0, out
    assert out.splitlines() == [
        f"{d}",
        "  train.jsonl: 1 row; formats: v2 preference 1",
        "    metadata: none",
        "    media: input image 1, audio 1; chosen video 1, audio 1; rejected video 1, audio 1",
        "    image: 1 distinct file, 48x32 px",
        "    video: 2 distinct files, 48x32 px, 0.50 s, 24 fps",
        "    audio: 3 distinct files, 0.50 s, 16000..32000 Hz, 1 channel",
        "  test.jsonl: 2 rows; formats: legacy jsonl 2",
        "    metadata: none",
        "    media: references image 1, video 2, audio 2",
        "    image: 1 distinct file, 48x32 px",
        "    video: 1 distinct file, 48x32 px, 0.50 s, 24 fps",
        "    audio: 1 distinct file, 0.50 s, 16000 Hz, 1 channel",
    ]
    code, out = run(examples / "sd3_dpo", "--split", "train")
    assert out.splitlines()[1:4] == ["  train.jsonl: 2 rows; formats: v2 preference 2", "    metadata: annotator 1",
                                     "    media: chosen image 2; rejected image 2"]
    code, out = run(examples / "t2i_prompts")
    assert [line for line in out.splitlines() if "formats" in line] == [
        "  train.txt: 2 rows; formats: txt 2", "  test.jsonl: 2 rows; formats: legacy jsonl 2"]


def test_dataset_level_errors_as_validate_prints_them(tmp_path):
    missing = tmp_path / "nowhere"
    code, out = run(missing)
    assert code == 2
    assert out.splitlines() == [
        f"{missing}",
        f"{missing}: dataset_dir: dataset 'nowhere': folder does not exist",
        f"ff data inspect: 1 problem(s) in {missing}",
    ]
    (tmp_path / "empty").mkdir()
    code, out = run(tmp_path / "empty", "--json")
    assert code == 2
    reason = "dataset 'empty': no training split (neither train.jsonl nor train.txt exists)"
    assert json.loads(out) == {"dataset_dir": str(tmp_path / "empty"), "splits": [], "errors": [{
        "path": str(tmp_path / "empty"), "line": None, "field": None, "reason": reason,
        "message": f"{tmp_path / 'empty'}: {reason}",
    }]}


def test_row_and_media_errors_keep_the_rest_of_the_report(varied):
    (varied / "out" / "b.wav").unlink()
    (varied / "in" / "b.png").write_bytes(b"not a png")
    (varied / "test.txt").unlink()
    write_lines(varied / "test.jsonl", [{"prompt": "fine"}, {"prompt": 3}])
    code, out = run(varied)
    assert code == 2
    assert out.splitlines() == [
        f"{varied}",
        "  train.jsonl: 3 rows; formats: v2 demonstration 3",
        "    metadata: license 2, seed 1",
        "    media: input image 3; target video 3, audio 3",
        "    image: 1 distinct file, 48x32 px",
        "    video: 2 distinct files, width 24..48 px, height 16..32 px, 0.50..2.00 s, 12..24 fps",
        "    audio: 1 distinct file, 0.25 s, 8000 Hz, 2 channels",
        # As `ff data validate`: the problems that stopped a split being read, then those of its media files.
        f"{varied}/test.jsonl:2: prompt: expected a string, found a number (3)",
        f"{varied}/train.jsonl:2: input.media[0].path: {varied}/in/b.png: cannot read image header: "
        f"cannot identify image file '{varied}/in/b.png'",
        f"{varied}/train.jsonl:2: supervision.target.media[1].path: {varied}/out/b.wav: file not found",
        f"ff data inspect: 3 problem(s) in {varied}",
    ]
