"""The frozen VAE within memory on long clips: diffusers' tiling and slicing (docs/scaling.md, "Memory").

The VAE encodes every training target (unless training from tensor-parquet shards) and decodes every evaluation
sample, in fp32, whole: an 81-frame 720p Wan clip or a 121-frame LTX-2 clip holds gigabytes of activations in one
encode. diffusers' autoencoders split the work themselves: ``enable_tiling(**kwargs)`` encodes and decodes
overlapping spatial (and, for some, temporal) tiles and blends them, ``enable_slicing()`` one sample of a batch at a
time. ``model.vae_tiling`` / ``model.vae_slicing`` switch them on for the adapter's ``vae`` component (the image or
video VAE; an audio VAE is left alone) as soon as the checkpoint loads, so every encode and decode ff runs through
the adapter uses them. Tiling changes the result slightly near tile seams (diffusers' own tests allow 0.2 on pixels
in [0, 1]); slicing changes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ff_core.errors import ConfigError

if TYPE_CHECKING:
    from ff_core.adapter import Adapter

TILING_KEY, SLICING_KEY = "model.vae_tiling", "model.vae_slicing"


def check_vae_memory(tiling: bool | dict[str, Any], slicing: bool) -> None:
    """Refuse, before weights load, a value of the wrong type (``tiling``: true, false or the keyword arguments of
    the VAE's ``enable_tiling``)."""
    if not isinstance(tiling, (bool, dict)):
        raise ConfigError(TILING_KEY, f"{tiling!r}: true, false or a mapping of enable_tiling's arguments "
                          "(tile_sample_min_height, tile_sample_stride_height, ...)")  # fmt: skip
    if not isinstance(slicing, bool):
        raise ConfigError(SLICING_KEY, f"{slicing!r}: true or false")


def apply_vae_memory(adapter: Adapter, tiling: bool | dict[str, Any], slicing: bool) -> None:
    """Switch on tiling (with ``tiling``'s arguments when it is a mapping) and slicing on ``adapter``'s ``vae``;
    refused, naming the key and the VAE's class, when it has no such method or takes no such argument."""
    if not tiling and not slicing:
        return
    vae = getattr(adapter, "vae", None)
    if vae is None:
        raise ConfigError(TILING_KEY if tiling else SLICING_KEY, f"{adapter.name} has no `vae` component to tile")
    name = type(vae).__name__
    if tiling:
        if not hasattr(vae, "enable_tiling"):
            raise ConfigError(TILING_KEY, f"{adapter.name}'s VAE ({name}) has no enable_tiling")
        try:
            vae.enable_tiling(**(tiling if isinstance(tiling, dict) else {}))
        except TypeError as exc:
            raise ConfigError(TILING_KEY, f"{name}.enable_tiling: {exc}") from None
    if slicing:
        if not hasattr(vae, "enable_slicing"):
            raise ConfigError(SLICING_KEY, f"{adapter.name}'s VAE ({name}) has no enable_slicing")
        vae.enable_slicing()
