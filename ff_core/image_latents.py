"""Image targets to and from ``AutoencoderKL`` latents: the family-neutral half of ``encode_output`` / ``decode``.

Families whose VAE is an ``AutoencoderKL`` normalised by ``(z - shift_factor) * scaling_factor`` (SD3, FLUX.1, the
``ff plugins new`` template) share these steps, done as diffusers' pipelines and training scripts do them:

* pixels: ``uint8`` in [0, 255] or float in [0, 1] -> float in [-1, 1] (``VaeImageProcessor.preprocess``), and back
  to ``uint8`` as ``VaeImageProcessor.postprocess`` (clamp, ``round(x * 255)``): :func:`pixels_to_signed`,
  :func:`signed_to_uint8` (video families use them too);
* latents: a posterior sample (``latent_dist.sample(generator)``, as the training scripts take it), normalised by the
  VAE config's ``shift_factor`` (absent or ``None``: 0) and ``scaling_factor``; decoding inverts it.

Per-family maths (prompt encoding, packing, another latent normalisation such as Wan's ``latents_mean`` /
``latents_std``) stays in the plugin.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def pixels_to_signed(x: Tensor) -> Tensor:
    """``uint8`` pixels in [0, 255] or float ones in [0, 1] as float32 in [-1, 1]."""
    return x.float() / 127.5 - 1 if x.dtype == torch.uint8 else x.float() * 2 - 1


def signed_to_uint8(x: Tensor) -> Tensor:
    """Decoded pixels in [-1, 1] as ``uint8`` on the CPU: [-1, 1] -> [0, 1] -> ``round(x * 255)``."""
    return ((x.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def stack_image_targets(media: list[list[Tensor]]) -> Tensor:
    """One batch (B, 3, H, W) of the per-sample targets ``media``: exactly one (3, H, W) image per sample, all of
    one size (else a ``ValueError`` naming the sample), dtype and device as given."""
    images = []
    for i, outputs in enumerate(media):
        if len(outputs) != 1 or outputs[0].ndim != 3 or outputs[0].shape[0] != 3:
            shapes = [tuple(t.shape) for t in outputs]
            raise ValueError(f"media[{i}]: expected one image tensor (3, H, W), got shapes {shapes}")
        images.append(outputs[0])
    if len({tuple(t.shape) for t in images}) > 1:
        raise ValueError(f"images of one batch must share a size, got {sorted({tuple(t.shape) for t in images})} "
                         "(the training loader fits targets to output_geometry(); fit others the same way)")
    return torch.stack(images)


def _shift(vae: Any) -> float:
    return getattr(vae.config, "shift_factor", None) or 0.0


@torch.no_grad()
def encode_images(vae: Any, images: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Normalised latents ``(z - shift_factor) * scaling_factor`` of ``images`` (B, 3, H, W; ``uint8`` or float in
    [0, 1]), ``z`` a posterior sample of ``vae`` drawn from ``generator``, in the VAE's dtype and on its device."""
    x = pixels_to_signed(images.to(vae.device))
    z = vae.encode(x.to(vae.dtype)).latent_dist.sample(generator=generator)
    return (z - _shift(vae)) * vae.config.scaling_factor


@torch.no_grad()
def decode_images(vae: Any, latents: Tensor) -> list[list[Tensor]]:
    """Per sample one ``uint8`` (3, H, W) image on the CPU: ``latents / scaling_factor + shift_factor`` decoded by
    ``vae`` (the inverse of :func:`encode_images`), post-processed as :func:`signed_to_uint8`."""
    z = latents.to(vae.dtype) / vae.config.scaling_factor + _shift(vae)
    images = signed_to_uint8(vae.decode(z, return_dict=False)[0])
    return [[img] for img in images]
