"""``model.vae_tiling`` / ``model.vae_slicing`` (ff_core/vae_memory.py) on Wan's VAE, loaded as a user's checkpoint is.

* ``FlowModule.configure_model`` switches diffusers' tiling (with the recipe's arguments) and slicing on the
  adapter's VAE before anything encodes.
* Smooth 128x128, 9-frame clips encoded and decoded with 96-pixel tiles (stride 64) against the untiled VAE, as
  diffusers' pipeline tests of VAE tiling do: the reconstructions agree within their tolerance (``test_vae_tiling``'s
  ``expected_diff_max`` 0.2 on pixels in [0, 1]) and the tiles really split the clip (the latents differ); slicing
  gives the untiled result exactly.
* Bad settings are refused naming the key: a wrong type before weights load, an argument the VAE does not take.
"""

from __future__ import annotations

import pytest
import torch

from ff_core.errors import ConfigError
from ff_core.module import FlowModule

GEOMETRY = {"height": 128, "width": 128, "num_frames": 9, "fps": 8}
TILES = {"tile_sample_min_height": 96, "tile_sample_min_width": 96, "tile_sample_stride_height": 64,
         "tile_sample_stride_width": 64}  # diffusers' pipeline tests of VAE tiling: 128 px, 96-pixel tiles, stride 64


def module(tiny_wan, **kwargs) -> FlowModule:
    m = FlowModule("wan2_t2v", str(tiny_wan("t2v")), adapter_kwargs=GEOMETRY, **kwargs)
    m.configure_model()
    return m


def smooth_clip() -> torch.Tensor:
    """Two 9-frame 128x128 clips of drifting colour gradients in [-1, 1] (what video looks like to a VAE; white noise
    is not)."""
    t, y, x = torch.meshgrid(torch.arange(9.0), torch.linspace(0, 1, 128), torch.linspace(0, 1, 128), indexing="ij")
    channels = [torch.sin(3 * x + 0.3 * t), torch.cos(2 * y - 0.2 * t), torch.sin(2 * (x + y) + 0.1 * t)]
    one = torch.stack(channels)  # (3, 9, 128, 128)
    return torch.stack([one, one.flip(-1)])


def reconstruct(vae, clip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        latents = vae.encode(clip).latent_dist.mode()
        return latents, vae.decode(latents).sample


def test_tiling_and_slicing_are_switched_on_and_keep_the_reconstruction(tiny_wan):
    tiled = module(tiny_wan, vae_tiling=TILES, vae_slicing=True).adapter.vae
    assert tiled.use_tiling and tiled.use_slicing and tiled.tile_sample_min_height == 96
    whole = module(tiny_wan).adapter.vae
    assert not whole.use_tiling and not whole.use_slicing
    clip = smooth_clip()
    z_whole, x_whole = reconstruct(whole, clip)
    tiled.use_tiling = False  # slicing alone: the same result, sample by sample
    z_sliced, x_sliced = reconstruct(tiled, clip)
    torch.testing.assert_close(z_sliced, z_whole)
    tiled.use_tiling = True
    z_tiled, x_tiled = reconstruct(tiled, clip)
    assert z_tiled.shape == z_whole.shape and not torch.equal(z_tiled, z_whole)  # the tiles did split the clip
    assert ((x_tiled - x_whole).abs() / 2).max() < 0.2  # pixels in [0, 1]: diffusers' tiling tolerance


def test_bad_settings_are_refused_naming_the_key(tiny_wan):
    with pytest.raises(ConfigError, match="model.vae_tiling"):
        FlowModule("wan2_t2v", str(tiny_wan("t2v")), adapter_kwargs=GEOMETRY, vae_tiling="yes")
    with pytest.raises(ConfigError, match=r"model.vae_tiling.*AutoencoderKLWan.enable_tiling"):
        module(tiny_wan, vae_tiling={"tile_height": 32})
