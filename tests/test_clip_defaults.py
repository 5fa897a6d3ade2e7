"""A video family's default clip, declared once (``Adapter.clip_defaults``, a ``ClipDefaults``) and read by
``from_pretrained``'s defaults, ``Adapter.resolve_clip`` and the base's ``check_adapter_kwargs`` /
``resolve_output_geometry`` (docs/plugins.md, "Target geometry")."""

from __future__ import annotations

import os
from typing import Any, ClassVar

import pytest

from ff_core.adapter import Adapter
from ff_core.contracts import AUDIO_OUT, IMAGE_OUT, VIDEO_OUT, ClipDefaults, MediaGeometry, PipelineIOContract
from ff_core.errors import ConfigError
from ff_core.pretrained import check_adapter_kwargs, resolve_output_geometry

CLIP = ClipDefaults(height=64, width=96, num_frames=9, fps=12.0, fps_key="frame_rate")


class ClipAdapter(Adapter):
    """Class level only (nothing here loads): a video + audio family declaring its clip once."""

    name: ClassVar[str] = "clip-test"
    io_contract: ClassVar[PipelineIOContract] = PipelineIOContract(outputs=(VIDEO_OUT, AUDIO_OUT))
    clip_defaults: ClassVar[ClipDefaults] = CLIP

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *, height: int = CLIP.height,
                        width: int = CLIP.width, num_frames: int = CLIP.num_frames, frame_rate: float = CLIP.fps,
                        dtype: str = "float32") -> ClipAdapter:  # fmt: skip
        raise NotImplementedError


def test_the_declaration_is_every_default():
    """No ``adapter_kwargs``: the declared clip; given ones win, the rate under its own argument name."""
    assert ClipAdapter.resolve_clip(None) == MediaGeometry(64, 96, num_frames=9, fps=12.0)
    kwargs = {"height": 32, "num_frames": 17, "frame_rate": 24, "dtype": "bfloat16"}
    assert ClipAdapter.resolve_clip(kwargs) == MediaGeometry(32, 96, num_frames=17, fps=24.0)
    assert ClipAdapter.resolve_clip({"height": None}).height == 64  # None: the default
    # The base's resolve_output_geometry: the clip for the video output, nothing checked for the audio.
    assert resolve_output_geometry(ClipAdapter, None, kwargs) == (MediaGeometry(32, 96, num_frames=17, fps=24.0), None)
    assert CLIP.arguments() == {"height": 64, "width": 96, "num_frames": 9, "frame_rate": 12.0}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"height": 0}, r"model\.adapter_kwargs\.height: must be an integer >= 1, got 0"),
    ({"width": "wide"}, r"model\.adapter_kwargs\.width: must be an integer >= 1, got 'wide'"),
    ({"num_frames": 8.5}, r"model\.adapter_kwargs\.num_frames: must be an integer >= 1, got 8\.5"),
    ({"frame_rate": 0}, r"model\.adapter_kwargs\.frame_rate: must be a number > 0, got 0"),
    ({"frame_rate": True}, r"model\.adapter_kwargs\.frame_rate: must be a number > 0, got True"),
])  # fmt: skip
def test_a_bad_clip_value_is_refused_before_weights_load(kwargs, message):
    """Through ``ff_core.pretrained.check_adapter_kwargs`` (what ``ff fit`` and ``ff data validate --model`` call): the
    base's ``check_adapter_kwargs`` checks the clip, one line naming the key."""
    with pytest.raises(ConfigError, match="^" + message + "$") as info:
        check_adapter_kwargs(ClipAdapter, None, kwargs)
    assert len(str(info.value).splitlines()) == 1


def test_from_pretrained_defaults_must_be_the_declared_ones():
    """A subclass that changes ``clip_defaults`` but inherits ``from_pretrained`` would load one clip and check another:
    refused by name."""

    class Drifted(ClipAdapter):
        clip_defaults: ClassVar[ClipDefaults] = ClipDefaults(height=128, width=96, num_frames=9, fps=12.0,
                                                             fps_key="frame_rate")  # fmt: skip

    with pytest.raises(TypeError, match=r"Drifted\.from_pretrained's default height=64 is not its clip_defaults' 128"):
        Drifted.resolve_clip({})


def test_without_a_declaration_nothing_changes():
    class Image(Adapter):
        name: ClassVar[str] = "image-test"
        io_contract: ClassVar[PipelineIOContract] = PipelineIOContract(outputs=(IMAGE_OUT,))

        @classmethod
        def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any) -> Image:
            raise NotImplementedError

    assert Image.resolve_output_geometry(None, {"height": 0}) is None
    Image.check_adapter_kwargs(None, {"height": 0})  # not a clip: the base checks nothing
    with pytest.raises(TypeError, match="Image declares no clip_defaults"):
        Image.resolve_clip({})


@pytest.mark.parametrize(("field", "value", "message"), [
    ("height", 0, r"ClipDefaults\.height must be an integer >= 1, got 0"),
    ("num_frames", 2.5, r"ClipDefaults\.num_frames must be an integer >= 1, got 2\.5"),
    ("fps", 0.0, r"ClipDefaults\.fps must be a number > 0, got 0\.0"),
])  # fmt: skip
def test_a_bad_declaration_fails_where_it_is_written(field, value, message):
    with pytest.raises(ValueError, match=message):
        ClipDefaults(**{"height": 8, "width": 8, "num_frames": 1, "fps": 1.0, field: value})


def family_adapters() -> list[tuple[str, Any, MediaGeometry]]:
    """Every shipped video family's adapters with the clip their ``from_pretrained`` defaulted to before the
    declaration (480x832, 81 frames at 16 fps; LTX-2 512x768, 121 at 24; MiniMax H3 768x1344, 124 at 24)."""
    from ff_ltx2.adapter import LTX2T2AVAdapter
    from ff_ltx2.i2av import LTX2I2AVAdapter
    from ff_minimax.adapter import MiniMaxH3T2VAAdapter
    from ff_minimax.fl2va import MiniMaxH3FL2VAAdapter
    from ff_minimax.ref2va import MiniMaxH3Ref2VAAdapter
    from ff_wan import WanI2VAdapter, WanT2VAdapter

    wan = MediaGeometry(480, 832, num_frames=81, fps=16.0)
    ltx2 = MediaGeometry(512, 768, num_frames=121, fps=24.0)
    h3 = MediaGeometry(768, 1344, num_frames=124, fps=24.0)
    return [(WanT2VAdapter, wan), (WanI2VAdapter, wan), (LTX2T2AVAdapter, ltx2), (LTX2I2AVAdapter, ltx2),
            (MiniMaxH3T2VAAdapter, h3), (MiniMaxH3FL2VAAdapter, h3), (MiniMaxH3Ref2VAAdapter, h3)]  # fmt: skip


def test_the_families_declare_the_clips_they_loaded_before():
    """The shipped families read one declaration, whose values are the defaults their ``from_pretrained`` had (so
    no recipe changes); ``resolve_clip`` also checks each ``from_pretrained``'s own defaults against it (Ref2VA has
    its own signature). LTX-2 and MiniMax H3 check their targets' headers against it (H3 on its ``fps_filter`` grid);
    Wan keeps checking its clips when they are decoded."""
    import dataclasses

    for cls, clip in family_adapters():
        assert cls.resolve_clip(None) == clip, cls.__name__
        geometry = cls.resolve_output_geometry(None, None)
        if cls.__name__.startswith("Wan"):
            assert geometry is None
        elif cls.__name__.startswith("LTX2"):
            assert geometry[0] == clip and geometry[1].seconds == pytest.approx(121 / 24)
        else:
            assert geometry == (dataclasses.replace(clip, frame_rule="fps_filter"), None)
