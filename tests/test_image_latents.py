"""ff_core.image_latents against a hand computation on a tiny random ``AutoencoderKL`` (saved and loaded back) and
against diffusers' ``VaeImageProcessor``."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKL
from diffusers.image_processor import VaeImageProcessor

from ff_core.image_latents import decode_images, encode_images, pixels_to_signed, stack_image_targets
from ff_core.testing.tiny import build_tiny_image_vae


@pytest.fixture(scope="module")
def vae(tmp_path_factory):
    path = tmp_path_factory.mktemp("vae")
    build_tiny_image_vae(seed=0, image_size=16, latent_channels=4, block_out_channels=(8, 8),
                         shift_factor=0.3, scaling_factor=1.7).save_pretrained(path)  # fmt: skip
    return AutoencoderKL.from_pretrained(path).eval()


def _images(n: int = 2, size: int = 16) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, 256, (3, size, size), generator=g, dtype=torch.uint8)] for _ in range(n)]


def test_encode_matches_hand_computation(vae):
    media = _images()
    z = encode_images(vae, stack_image_targets(media), torch.Generator().manual_seed(5))
    x = torch.stack([m[0] for m in media]).float() / 255 * 2 - 1  # VaeImageProcessor.normalize of [0, 1]
    with torch.no_grad():
        raw = vae.encode(x).latent_dist.sample(generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(z, (raw - 0.3) * 1.7)
    # float targets in [0, 1] give the same latents as their uint8 originals
    floats = [[m[0].float() / 255] for m in media]
    torch.testing.assert_close(encode_images(vae, stack_image_targets(floats), torch.Generator().manual_seed(5)), z)


def test_decode_matches_vae_image_processor(vae):
    z = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    out = decode_images(vae, z)
    with torch.no_grad():
        pixels = vae.decode(z / 1.7 + 0.3, return_dict=False)[0]
    ref = VaeImageProcessor(do_resize=False).postprocess(pixels, output_type="np")  # (B, H, W, 3) in [0, 1]
    ref = torch.from_numpy((ref * 255).round()).permute(0, 3, 1, 2)
    assert [len(o) for o in out] == [1, 1] and out[0][0].dtype == torch.uint8 and out[0][0].shape == (3, 16, 16)
    assert (torch.stack([o[0] for o in out]).float() - ref).abs().max() <= 1  # float rounding of numpy vs torch


def test_pixels_to_signed_ranges():
    x = torch.tensor([0, 255], dtype=torch.uint8)
    assert pixels_to_signed(x).tolist() == [-1.0, 1.0]
    assert pixels_to_signed(torch.tensor([0.0, 1.0])).tolist() == [-1.0, 1.0]


def test_stack_rejects_bad_targets():
    with pytest.raises(ValueError, match=r"media\[1\]: expected one image tensor \(3, H, W\)"):
        stack_image_targets([[torch.zeros(3, 4, 4)], [torch.zeros(4, 4)]])
    with pytest.raises(ValueError, match=r"media\[0\]: expected one image"):
        stack_image_targets([[torch.zeros(3, 4, 4), torch.zeros(3, 4, 4)]])
    with pytest.raises(ValueError, match="images of one batch must share a size"):
        stack_image_targets([[torch.zeros(3, 4, 4)], [torch.zeros(3, 8, 4)]])
