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
