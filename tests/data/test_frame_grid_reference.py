"""Which source frames land on a clip's frame grid, against independent references (issue 23, item 2):

* ffmpeg's ``fps`` filter (MiniMax H3's official decode) run by PyAV as a real filter graph, ``buffer -> [trim ->
  setpts ->] fps=24 -> buffersink``, over a real H.264 clip whose frame ``k`` is the grey level ``STEP * k``;
* the "nearest source frame" rule as ``np.rint`` of the grid time in source frames, transcribed.

At 30 -> 24 fps ffmpeg and the nearest frame agree except at exact half-frame ties, where ffmpeg (``round=near``,
half away from zero) takes the later frame and ``np.rint`` the even one; ff's ``nearest`` takes the later one. At
60 -> 24 fps they part: ffmpeg's slot shows the *last* of the source frames that round into it (1, 3, 6, 8, ...),
the nearest rule the one closest to the grid time (0, 2/3 tie, 5, 8, ...); ff offers both (``fps_filter`` and
``nearest``) and the old ``floor``.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from ff_core.data.media.decode import clip_source_frames, decode_clip
from ff_core.testing.clips import fps_filter_frames, write_grey_mp4

STEP, FRAMES, GRID = 5, 48, 24  # grey level of frame k: 5 k (48 frames, up to 235); the grid: 24 fps


def index_of(image: np.ndarray) -> int:
    return round(float(image.mean()) / STEP)


@pytest.fixture(scope="module", params=[30, 60])
def clip(request, tmp_path_factory) -> tuple[Path, int]:
    fps = request.param
    return write_grey_mp4(tmp_path_factory.mktemp("grid") / f"c{fps}.mp4", frames=FRAMES, fps=fps, step=STEP), fps


def ffmpeg_fps(path: Path, fps: int, start: float) -> list[int]:
    """The source index of every frame ffmpeg's ``fps`` filter outputs (:func:`ff_core.testing.clips.fps_filter_frames`,
    a real filter graph), ``start`` seconds cut off first."""
    return [index_of(frame) for frame in fps_filter_frames(path, fps, start)]


def rint_frames(n: int, start: float, clock: int) -> list[int]:
    """The nearest source frame as ``np.rint`` of the grid time in source frames (half to even)."""
    return [int(np.rint((start + k / GRID) * clock)) for k in range(n)]


def is_half(k: int, start: Fraction, clock: int) -> bool:
    x = (start + Fraction(k, GRID)) * clock
    return x - (x.numerator // x.denominator) == Fraction(1, 2)


@pytest.mark.parametrize("start", [0.0, 0.5])
def test_fps_filter_rule_is_ffmpegs_fps_filter(clip, start):
    path, clock = clip
    n = 16 if start == 0 else 6
    reference = ffmpeg_fps(path, GRID, start)[:n]
    decoded = decode_clip(path, num_frames=n, fps=float(GRID), start=start, rule="fps_filter")
    assert [index_of(f) for f in decoded.frames.numpy()] == decoded.source_frames.tolist() == reference
    assert clip_source_frames(n, float(GRID), start, float(clock), "fps_filter") == reference


@pytest.mark.parametrize("start", [0.0, 0.5])
def test_nearest_rule_is_rint(clip, start):
    """``nearest`` is ``np.rint`` of the grid position, ties to the even frame (Flow-Factory's LTX-2 codec,
    ``np.rint(arange(n) * src_fps / frame_rate)``, transcribed with the start offset); the decoded frames carry
    those indices."""
    path, clock = clip
    n = 16 if start == 0 else 6
    decoded = decode_clip(path, num_frames=n, fps=float(GRID), start=start)  # the default rule: nearest
    ours = decoded.source_frames.tolist()
    assert [index_of(f) for f in decoded.frames.numpy()] == ours == rint_frames(n, start, clock)
    if start == 0:
        assert ours == [int(i) for i in np.rint(np.arange(n) * clock / GRID)]  # Flow-Factory's expression


def test_where_ffmpeg_and_the_nearest_frame_part(clip):
    """30 -> 24: ffmpeg equals the nearest frame except at the half-frame ties whose earlier frame is even (grid
    frames 2, 10: ffmpeg rounds half away from zero, rint to even); 60 -> 24: ffmpeg takes the last frame rounding
    into each slot, ``ceil((k + 1/2) * 60/24) - 1``, one or two frames after the nearest."""
    path, clock = clip
    reference = ffmpeg_fps(path, GRID, 0.0)[:16]
    nearest = clip_source_frames(16, float(GRID), 0.0, float(clock))
    if clock == 30:
        ties = [k for k in range(16) if is_half(k, Fraction(0), clock)]
        assert ties == [2, 6, 10, 14]
        assert [k for k in range(16) if reference[k] != nearest[k]] == [2, 10]
        assert all(reference[k] == nearest[k] + 1 for k in (2, 10))
    else:
        assert reference[:6] == [1, 3, 6, 8, 11, 13] and nearest[:6] == [0, 2, 5, 8, 10, 12]


def test_fps_filter_rule_upsampling_24_to_30(tmp_path):
    """A grid faster than the clip: ffmpeg repeats frames where each source frame's own slot says (24 -> 30 fps:
    grid frame 2 still shows source frame 1, whose successor rounds to slot 3), one frame off the nearest there."""
    path = write_grey_mp4(tmp_path / "c24.mp4", frames=FRAMES, fps=24, step=STEP)
    reference = ffmpeg_fps(path, 30, 0.0)[:20]
    ours = clip_source_frames(20, 30.0, 0.0, 24.0, "fps_filter")
    assert ours == reference and reference[:4] == [0, 1, 1, 2]
    assert clip_source_frames(4, 30.0, 0.0, 24.0) == [0, 1, 2, 2]
