"""Video targets decoded as fixed clips (MediaGeometry num_frames / fps / start): which source frames land on the
grid, that only the window is decoded, and that short clips are rejected, never stretched. Files are H.264 MP4s
written here whose frame ``k`` is the solid grey level ``8 * k``, with a keyframe every 4 frames."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ff_core.contracts import MediaGeometry, MediaType
from ff_core.data.media.decode import clip_source_frames, decode_clip
from ff_core.data.media.geometry import decode_target
from ff_core.data.records import MediaItem
from ff_core.errors import DatasetError
from ff_core.testing.clips import write_grey_mp4

STEP = 8  # grey level of frame k: STEP * k


def source_of(frames: torch.Tensor) -> list[int]:
    """Which source frame each decoded frame is, read back from its grey level (H.264 is lossy by a few levels)."""
    return [round(v / STEP) for v in frames.float().mean(dim=(1, 2, 3)).tolist()]


@pytest.fixture(scope="module")
def mp4(tmp_path_factory) -> Path:
    return write_grey_mp4(tmp_path_factory.mktemp("clips") / "grey.mp4", frames=30, fps=24)


@pytest.mark.parametrize(
    ("num_frames", "fps", "start", "clock", "expected"),
    [
        (5, 12.0, 0.0, 24.0, [0, 2, 4, 6, 8]),  # half rate: every other frame
        (5, 16.0, 0.0, 24.0, [0, 2, 3, 4, 6]),  # t_k = k/16 -> 1.5 k: np.rint, a half-frame tie to the even frame
        (5, 48.0, 0.0, 24.0, [0, 0, 1, 2, 2]),  # double rate: frames repeat (ties 0.5 -> 0, 1.5 -> 2: even)
        (3, 10.0, 0.25, 24.0, [6, 8, 11]),  # t = 0.25, 0.35, 0.45 -> 6, 8.4, 10.8
        (4, None, 0.5, 24.0, [12, 13, 14, 15]),  # the clip's own rate
        (3, 6.0, 0.0, 12.0, [0, 2, 4]),  # a declared 12 fps clock on any file
    ],
)
def test_grid_takes_the_nearest_frame(num_frames, fps, start, clock, expected):
    assert clip_source_frames(num_frames, fps, start, clock) == expected


@pytest.mark.parametrize(
    ("num_frames", "fps", "start", "clock", "expected"),
    [
        (5, 16.0, 0.0, 24.0, [0, 1, 3, 4, 6]),  # floor(1.5 k): the frame at or before (ff before issue 23)
        (3, 10.0, 0.25, 24.0, [6, 8, 10]),
    ],
)
def test_floor_rule_keeps_the_frame_at_or_before(num_frames, fps, start, clock, expected):
    assert clip_source_frames(num_frames, fps, start, clock, "floor") == expected


def test_clip_decodes_the_grid_frames_and_only_the_window(mp4):
    # t_k = 0.5 + k/16 at 24 fps: 12 + 1.5 k, to the nearest frame (np.rint: half-frame ties to the even one)
    clip = decode_clip(mp4, num_frames=5, fps=16.0, start=0.5)
    assert clip.frames.shape == (5, 16, 16, 3) and clip.frames.dtype == torch.uint8
    assert source_of(clip.frames) == [12, 14, 15, 16, 18] == clip.source_frames.tolist()
    assert clip.fps == 16.0 and clip.timestamps.tolist() == pytest.approx([0.5 + k / 16 for k in range(5)])
    # Seeks to the keyframe at 12 and stops after 18: 7 frames, not the file's 30 (a few more if the seek lands on
    # an earlier keyframe).
    assert 7 <= clip.frames_decoded <= 7 + 4, clip.frames_decoded
    whole = decode_clip(mp4, num_frames=30)
    assert whole.frames_decoded == 30 and source_of(whole.frames) == list(range(30))
    assert clip.window == pytest.approx((0.5, 0.5 + 5 / 16))


def test_declared_fps_is_the_clip_clock(mp4):
    # Declared 12 fps: frame i is at i / 12 s, so 6 fps takes every other frame and 1 s starts at frame 12.
    clip = decode_clip(mp4, num_frames=3, fps=6.0, start=1.0, declared_fps=12.0)
    assert source_of(clip.frames) == [12, 14, 16]
    assert clip.window == pytest.approx((0.5, 0.75))  # file seconds: frames 12..17 at 24 fps


@pytest.mark.parametrize(("num_frames", "fps", "start"), [(21, 16.0, 0.0), (5, 24.0, 1.1)])
def test_too_short_clips_are_rejected_not_stretched(mp4, num_frames, fps, start):
    with pytest.raises(DatasetError) as err:
        decode_clip(mp4, num_frames=num_frames, fps=fps, start=start, referenced_by=(Path("train.jsonl"), 3),
                    field="target")
    message = str(err.value)
    assert "train.jsonl" in message and ":3" in message and "target" in message and str(mp4) in message
    assert "too short" in message and "30 frames (1.250 s)" in message and "never stretched" in message


def test_decode_target_fits_the_clip_to_the_frame(mp4, tmp_path):
    item = MediaItem(MediaType.VIDEO, mp4, origin="target")
    geometry = MediaGeometry(8, 12, num_frames=3, fps=8.0)
    video = decode_target(item, geometry)
    assert video.frames.shape == (3, 8, 12, 3)
    assert source_of(video.frames) == [0, 3, 6]
    assert video.audio is None  # the file has no audio stream
    image = decode_target(MediaItem(MediaType.VIDEO, mp4, origin="target"), MediaGeometry(8, 12))
    assert image.frames.shape == (30, 8, 12, 3)  # no frame count: the whole file, fitted


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"num_frames": 0}, "num_frames"), ({"num_frames": 5, "fps": 0}, "fps"), ({"fps": 8.0}, "needs num_frames"),
     ({"num_frames": 5, "start": -1.0}, "start"), ({"num_frames": 5, "frame_rule": "linear"}, "frame_rule")],
)
def test_geometry_rejects_bad_clip_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MediaGeometry(8, 8, **kwargs)
