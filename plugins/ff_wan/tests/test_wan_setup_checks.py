"""What ``ff fit`` refuses before any Wan weight loads: ``data.buckets`` geometries wan2_i2v's condition latents
cannot fit (they are encoded once, at ``adapter_kwargs``' canvas and frame count)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ff_wan import WanI2VAdapter, WanT2VAdapter
from ff_wan.testing import write_moving_squares
from wan_geometry import ADAPTER_KWARGS, FPS, FRAMES, SIZE

from ff_core.contracts import MediaGeometry
from ff_core.errors import ConfigError
from ff_core.testing.recipes import fit_tiny

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "wan"


@pytest.fixture
def no_weights(monkeypatch):
    """Any weight load (every component comes through ``_components``) fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("weights loaded before the configuration was checked")

    for cls in (WanT2VAdapter, WanI2VAdapter):
        monkeypatch.setattr(cls, "_components", classmethod(refuse))


@pytest.mark.parametrize(("other", "got"), [
    ({"height": 64}, r"got 64x32, 9 frames"),
    ({"width": 16}, r"got 32x16, 9 frames"),
    ({"num_frames": 5}, r"got 32x32, 5 frames"),
])  # fmt: skip
def test_an_i2v_bucket_of_another_canvas_or_length_fails_before_weights_load(tiny_wan, tmp_path, other, got,
                                                                             no_weights):  # fmt: skip
    """Wan2.1 I2V: the channel condition ``[mask, latents of first, zeros...]`` covers every latent frame of the
    canvas, so a bucket with another size or frame count would crash at the first forward (the condition latent
    (4 + z, 3, 4, 4) against targets of another shape). The same geometry passes (bucket 0); the other is refused
    naming ``data.buckets[1]``, in one line."""
    squares = write_moving_squares(tmp_path / "squares", 2, i2v=True)
    same = {"height": SIZE, "width": SIZE, "num_frames": FRAMES, "fps": FPS}
    WanI2VAdapter.check_bucket(tiny_wan("i2v"), ADAPTER_KWARGS, MediaGeometry(**same))
    message = (r"^data\.buckets\[1\]: wan2_i2v encodes its condition image\(s\) once, at model\.adapter_kwargs' "
               r"32x32, 9 frames, so it trains on that geometry only, " + got + r"; leave data\.buckets unset")
    with pytest.raises(ConfigError, match=message) as info:
        fit_tiny(CONFIGS / "i2v_sft_tiny.yaml", tiny_wan("i2v"), [{"name": "sq", "dataset_dir": str(squares)}],
                 tmp_path / "run", "--data.buckets", json.dumps([same, {**same, **other}]))  # fmt: skip
    assert len(str(info.value).splitlines()) == 1


def test_bucket_fps_and_start_change_nothing_the_condition_holds(tiny_wan):
    same = {"height": SIZE, "width": SIZE, "num_frames": FRAMES}
    WanI2VAdapter.check_bucket(tiny_wan("i2v"), ADAPTER_KWARGS, MediaGeometry(**same, fps=16.0, start=0.25))


def test_ti2v_buckets_may_change_the_frame_count_but_not_the_canvas(tiny_wan):
    """Wan2.2 TI2V pins the first latent frame to the image's latent (1 frame): any clip length fits it."""
    WanI2VAdapter.check_bucket(tiny_wan("ti2v"), ADAPTER_KWARGS, MediaGeometry(SIZE, SIZE, num_frames=5, fps=FPS))
    with pytest.raises(ValueError, match=r"at model\.adapter_kwargs' 32x32, so it trains on that geometry only, "
                                         r"got 64x64;"):  # fmt: skip
        WanI2VAdapter.check_bucket(tiny_wan("ti2v"), ADAPTER_KWARGS, MediaGeometry(64, 64, num_frames=FRAMES))


def test_without_adapter_kwargs_the_defaults_are_the_geometry():
    """No checkpoint known: the class default (Wan2.1 I2V) at ``from_pretrained``'s 480x832, 81 frames."""
    WanI2VAdapter.check_bucket(None, None, MediaGeometry(480, 832, num_frames=81, fps=16.0))
    with pytest.raises(ValueError, match=r"480x832, 81 frames, .* got 480x832, 49 frames"):
        WanI2VAdapter.check_bucket(None, None, MediaGeometry(480, 832, num_frames=49, fps=16.0))


@pytest.mark.parametrize("variant", ["t2v", "i2v"])
def test_stored_shapes_fit_what_the_diffusers_components_produce(tiny_wan, variant):
    """``resolve_tensor_shapes`` (what ``ff fit`` checks every shard row against, issue 24 item 9), from config files
    only, against the tensors diffusers' own components produce: ``AutoencoderKLWan.encode`` of a 5-frame clip (a
    card row's ``vae_latent`` is its latent without the batch axis) and the UMT5 encoder's hidden states (a
    ``text_embedding``). The same bytes in another geometry (channels last, or frames first) are refused."""
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import UMT5EncoderModel

    folder = tiny_wan(variant)
    shapes = WanT2VAdapter.resolve_tensor_shapes(str(folder)) if variant == "t2v" else \
        WanI2VAdapter.resolve_tensor_shapes(str(folder))
    vae = AutoencoderKLWan.from_pretrained(folder, subfolder="vae").eval()
    with torch.no_grad():
        latent = vae.encode(torch.rand(1, 3, 5, 32, 32) * 2 - 1).latent_dist.mode()[0]  # (C, T, H, W)
        text = UMT5EncoderModel.from_pretrained(folder, subfolder="text_encoder")(
            torch.tensor([[1, 2, 3]])).last_hidden_state[0]  # (L, D)
    rule = shapes["vae_latent"]
    assert rule.problem(list(latent.shape)) is None
    assert rule.problem([*latent.shape[1:], latent.shape[0]]) is not None  # channels last
    assert rule.problem([latent.shape[1], latent.shape[0], *latent.shape[2:]]) is not None  # frames first
    assert shapes["text_embedding"].problem(list(text.shape)) is None
    assert shapes["text_embedding"].problem([text.shape[1], text.shape[0]]) is not None
    assert WanT2VAdapter.resolve_tensor_shapes(None) == {}  # no checkpoint: nothing to check against
