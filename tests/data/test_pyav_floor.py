"""The spec's PyAV floor (dataset-guide, "Offline V2 records": "Video targets require PyAV 17 or newer"): decoding a
video under an older PyAV is one clear error naming the installed version; images and audio are not affected."""

from __future__ import annotations

import av
import numpy as np
import pytest
from PIL import Image

from ff_core.contracts import MediaType
from ff_core.data.media.decode import (
    MIN_PYAV_FOR_VIDEO,
    check_media,
    decode_clip,
    decode_image,
    decode_video,
    require_pyav,
)
from ff_core.data.records import MediaItem
from ff_core.testing.clips import write_grey_mp4


@pytest.fixture
def mp4(tmp_path):
    return write_grey_mp4(tmp_path / "clip.mp4", frames=4, fps=8)


def test_the_floor_is_17():
    assert MIN_PYAV_FOR_VIDEO == (17, 0)
    require_pyav()  # the installed PyAV passes


@pytest.mark.parametrize("old", ["16.1.0", "14.4.0", "9.2"])
@pytest.mark.parametrize("decode", [lambda p: decode_clip(p, num_frames=2, fps=4.0), decode_video,
                                    lambda p: check_media(MediaItem(MediaType.VIDEO, p))])
def test_an_older_pyav_is_refused_naming_its_version(monkeypatch, mp4, old, decode):
    monkeypatch.setattr(av, "__version__", old)  # the version the check reads; the decoder is untouched
    with pytest.raises(RuntimeError) as err:
        decode(mp4)
    assert str(err.value) == (f"decoding video needs PyAV >= 17.0, but PyAV {old} is installed; "
                              "upgrade it: pip install 'av>=17.0'")


@pytest.mark.parametrize("new", ["17.0.0", "17.0.0rc1", "18.1.0"])
def test_17_and_newer_decode(monkeypatch, mp4, new):
    monkeypatch.setattr(av, "__version__", new)
    assert decode_clip(mp4, num_frames=2, fps=4.0).frames.shape[0] == 2


def test_images_do_not_need_the_video_floor(monkeypatch, tmp_path):
    monkeypatch.setattr(av, "__version__", "14.0.0")
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "a.png")
    assert decode_image(tmp_path / "a.png").shape == (3, 4, 4)
