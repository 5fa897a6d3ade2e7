"""The moving-shapes video demo dataset and its scorer: records, determinism, MP4s that decode as written, a scorer
exact on the dataset and at 0 % on the clips played backwards, and `ff data validate` accepting the folder."""

from __future__ import annotations

import hashlib
import json
import random

import pytest
import torch

from ff_core.cli.data import main as data_main
from ff_core.data.media.decode import decode_video
from ff_core.rewards import RewardBatch
from ff_core.testing.moving_shapes import (
    DIRECTIONS,
    MotionSpec,
    PromptMotionReward,
    centroid_track,
    clip_colour,
    draw_clip,
    main,
    motion_accuracy,
    motion_direction,
    prompt_motion,
    write_moving_shapes_dataset,
)
from ff_core.testing.shapes import COLOURS

N_TRAIN = 24


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_moving_shapes_dataset(tmp_path_factory.mktemp("moving"), n_train=N_TRAIN, n_test=12, seed=0)


def _records(root):
    return [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines()]


def _clips(root):
    """Each record's (prompt, decoded uint8 clip (T, 3, H, W) as the video adapters decode it)."""
    out = []
    for rec in _records(root):
        video = decode_video(root / rec["supervision"]["target"]["media"][0]["path"])
        out.append((rec["input"]["prompt"], video.frames.permute(0, 3, 1, 2)))
    return out


def _digest(root) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(root).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def test_records_are_v2_demonstrations_with_fps_and_balanced_captions(dataset):
    records = _records(dataset)
    assert len(records) == N_TRAIN
    first = records[0]
    meta = first["metadata"]
    assert first == {
        "schema_version": 2,
        "input": {"prompt": f"a red {meta['shape']} moving left", "media": []},
        "supervision": {"type": "demonstration",
                        "target": {"media": [{"type": "video", "path": "videos/00000.mp4", "fps": 8.0}]}},
        "metadata": {"colour": "red", "shape": meta["shape"], "direction": "left", "background": "black"},
    }  # fmt: skip
    pairs = [(r["metadata"]["colour"], r["metadata"]["direction"]) for r in records]
    assert sorted(set(pairs)) == sorted((c, d) for c in COLOURS for d in DIRECTIONS)
    assert all(pairs.count(p) == N_TRAIN // 12 for p in set(pairs))  # every (colour, direction) equally often
    test = (dataset / "test.txt").read_text().splitlines()
    assert [prompt_motion(p) for p in test] == [(c, d) for c in COLOURS for d in DIRECTIONS]


def test_mp4s_decode_to_the_written_frames_rate_and_size(dataset):
    video = decode_video(dataset / "videos" / "00003.mp4")
    assert video.frames.shape == (9, 32, 32, 3) and video.frames.dtype == torch.uint8
    assert video.fps == 8.0
    torch.testing.assert_close(video.timestamps, torch.arange(9, dtype=torch.float64) / 8)


def test_deterministic_per_seed(tmp_path, dataset):
    again = write_moving_shapes_dataset(tmp_path / "again", n_train=N_TRAIN, n_test=12, seed=0)
    assert _digest(again) == _digest(dataset)
    other = write_moving_shapes_dataset(tmp_path / "other", n_train=N_TRAIN, n_test=12, seed=1)
    assert (other / "train.jsonl").read_text() != (dataset / "train.jsonl").read_text()


def test_scorer_is_exact_on_the_decoded_dataset(dataset):
    prompts, clips = zip(*[(p, c) for p, c in _clips(dataset)])
    score = motion_accuracy(clips, prompts)
    assert (score.n, score.direction, score.colour, score.both) == (N_TRAIN, 1.0, 1.0, 1.0)
    assert score.confusion == {("left", "left"): N_TRAIN // 2, ("right", "right"): N_TRAIN // 2}


def test_scorer_reads_reversed_clips_as_the_other_direction(dataset):
    prompts, clips = zip(*[(p, c.flip(0)) for p, c in _clips(dataset)])
    score = motion_accuracy(clips, prompts)
    assert score.direction == 0.0 and score.both == 0.0
    assert score.colour == 1.0  # playing a clip backwards keeps its colour
    assert score.confusion == {("left", "right"): N_TRAIN // 2, ("right", "left"): N_TRAIN // 2}


def test_centroid_slope_by_hand():
    """A 2-pixel-wide red bar at x = 1, 3, 5 over three frames of a black 8x4 canvas: centroids 1.5, 3.5, 5.5, a
    slope of +2 px/frame (travel 4 px = half the width): "right"; backwards "left"; standing still "none"."""
    clip = torch.zeros(3, 3, 4, 8, dtype=torch.uint8)
    for t, x in enumerate((1, 3, 5)):
        clip[t, 0, :, x : x + 2] = 255
    times, xs = centroid_track(clip)
    torch.testing.assert_close(xs, torch.tensor([1.5, 3.5, 5.5]))
    torch.testing.assert_close(times, torch.tensor([0.0, 1.0, 2.0]))
    assert motion_direction(clip) == "right" and motion_direction(clip.flip(0)) == "left"
    assert motion_direction(clip[:1].expand(3, -1, -1, -1)) == "none"
    assert motion_direction(torch.zeros_like(clip)) == "none"  # no saturated pixel at all
    assert clip_colour(clip) == "red" and clip_colour(torch.zeros_like(clip)) == "none"


def test_drawn_clip_travels_a_third_of_the_free_width():
    for seed in range(20):
        for direction in DIRECTIONS:
            frames = draw_clip(MotionSpec("blue", "triangle", direction), 9, 32, 32, random.Random(seed))
            _, xs = centroid_track(torch.from_numpy(frames))
            travel = float(xs[-1] - xs[0])
            assert (travel > 0) == (direction == "right") and abs(travel) > 32 * 0.1


def test_prompt_motion_and_reward():
    assert prompt_motion("A Cyan circle moving RIGHT") == ("cyan", "right")
    assert prompt_motion("a circle") == ("none", "none")
    frames = torch.from_numpy(draw_clip(MotionSpec("green", "square", "right"), 9, 32, 32, random.Random(0)))
    clip = frames.permute(0, 3, 1, 2)
    batch = RewardBatch(media=[[clip], [clip], [clip.flip(0)]], metadata=[{}] * 3, output_types=("video",),
                        prompts=["a green square moving right", "a red square moving right", "a green square moving right"])  # noqa: E501
    torch.testing.assert_close(PromptMotionReward()(batch), torch.tensor([1.0, 1.0, 0.0]))
    torch.testing.assert_close(PromptMotionReward(colour=True)(batch), torch.tensor([1.0, 0.0, 0.0]))


def test_ff_data_validate_accepts_the_folder(dataset, capsys):
    assert data_main(["validate", str(dataset), "--check-media"]) == 0
    out = capsys.readouterr().out
    assert f"{N_TRAIN} rows, demonstration" in out and f"video {N_TRAIN}" in out


def test_cli_writes_the_requested_geometry(tmp_path, capsys):
    main([str(tmp_path / "ds"), "--n-train", "2", "--n-test", "2", "--width", "48", "--height", "16", "--frames", "5",
          "--fps", "4", "--backgrounds", "white,gray"])
    video = decode_video(tmp_path / "ds" / "videos" / "00001.mp4")
    assert video.frames.shape == (5, 16, 48, 3) and video.fps == 4.0
    assert "wrote 2 training clips" in capsys.readouterr().out
    with pytest.raises(ValueError, match="backgrounds"):
        write_moving_shapes_dataset(tmp_path / "bad", n_train=1, backgrounds=("purple",))
