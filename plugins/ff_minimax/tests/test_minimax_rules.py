"""The spec's clip rules (:mod:`ff_minimax.rules`) by hand: 24 fps, 5-15 s, ``num_frames`` rounded up to 17 n + 5."""

from __future__ import annotations

import pytest
from ff_minimax.rules import aligned_num_frames, check_clip


@pytest.mark.parametrize(("requested", "aligned"), [(1, 5), (5, 5), (6, 22), (120, 124), (121, 124), (124, 124),
                                                     (125, 141), (345, 345), (346, 362)])  # fmt: skip
def test_frame_counts_round_up_to_17n_plus_5(requested, aligned):
    assert aligned_num_frames(requested) == aligned and aligned % 17 == 5 and aligned >= requested


def test_124_is_the_smallest_valid_clip_and_345_the_largest():
    assert check_clip(124, 16, 16) == 124 and check_clip(120, 16, 16) == 124  # 5 s rounds up to 124 (5.17 s)
    assert check_clip(345, 16, 16) == 345  # 14.375 s
    with pytest.raises(ValueError, match=r"num_frames: 107 frames, rounded up to 107 .* last 4\.458 s"):
        check_clip(107, 16, 16)  # 17 * 6 + 5 = 107: 4.46 s, too short
    with pytest.raises(ValueError, match=r"num_frames: 346 frames, rounded up to 362 .* last 15\.083 s"):
        check_clip(346, 16, 16)
    with pytest.raises(ValueError, match="num_frames must be a positive integer"):
        check_clip(0, 16, 16)


def test_the_canvas_must_be_a_multiple_of_the_vae_and_patch():
    check_clip(124, 768, 1344, 32)
    with pytest.raises(ValueError, match=r"model\.adapter_kwargs\.width: must be a multiple of 32 .* got 1350"):
        check_clip(124, 768, 1350, 32)


def test_a_bucket_is_compared_with_the_rounded_clip():
    """``num_frames: 120`` trains at 124 frames (17 n + 5): a 124-frame bucket is that clip, a 120-frame one is not."""
    from ff_minimax.adapter import MiniMaxH3T2VAAdapter

    from ff_core.contracts import MediaGeometry

    kwargs = {"height": 16, "width": 16, "num_frames": 120}
    MiniMaxH3T2VAAdapter.check_bucket(None, kwargs, MediaGeometry(16, 16, num_frames=124, fps=24.0))
    with pytest.raises(ValueError, match="124 frames at 24 fps, got 16x16, 120 frames"):
        MiniMaxH3T2VAAdapter.check_bucket(None, kwargs, MediaGeometry(16, 16, num_frames=120, fps=24.0))
