"""Target geometry: decoded target media brought to the frame an adapter encodes, in the loader workers.

An adapter says at which geometry it encodes each output (:meth:`ff_core.adapter.Adapter.output_geometry`, one
:class:`MediaGeometry` or ``None`` per output of its contract, in order); :class:`~ff_core.data.processors.
RecordProcessor` fits every decoded target to it before collation, so no batch ever holds mixed sizes.

Fitting follows diffusers' training scripts (examples/dreambooth/train_dreambooth_lora_sd3.py,
examples/text_to_image/train_text_to_image.py): ``transforms.Resize(resolution, BILINEAR)`` of the shorter side,
then ``transforms.CenterCrop(resolution)``. A non-square frame generalises the same rule: scale (keeping the aspect
ratio) until the image covers the frame, then crop the centre. Cropping is always central (the scripts' default
``RandomCrop`` and ``random_flip`` would make a sample depend on more than its record, and resume inexact).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from ff_core.data.media import DecodedAudio, DecodedVideo


@dataclass(frozen=True)
class MediaGeometry:
    """The frame one output is encoded at (picklable: it travels to the loader workers).

    Spatial only so far; video families will add their frame count and clock here (resampled in the workers too).

    Attributes:
        height: pixel rows of an image, or of each video frame.
        width: pixel columns.
    """

    height: int
    width: int

    def __post_init__(self) -> None:
        for key in ("height", "width"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MediaGeometry.{key} must be an integer >= 1, got {value!r}")


def resized_size(height: int, width: int, geometry: MediaGeometry) -> tuple[int, int]:
    """``(height, width)`` after the aspect-keeping resize that makes an image cover ``geometry``.

    For a square frame this is torchvision's ``Resize(size)`` of the shorter side
    (``torchvision.transforms.functional._compute_resized_output_size``: the longer side is
    ``int(size * long / short)``, truncated), so the result matches diffusers' scripts pixel for pixel.
    """
    th, tw = geometry.height, geometry.width
    if th * width >= tw * height:  # the height binds: scaling it to th makes the width cover tw
        return th, int(th * width / height)
    return int(tw * height / width), tw


def center_crop_box(height: int, width: int, geometry: MediaGeometry) -> tuple[int, int, int, int]:
    """Pillow's ``(left, top, right, bottom)`` of the central ``geometry`` crop, as torchvision's ``center_crop``
    computes it: ``top = int(round((height - crop_height) / 2.0))`` (Python's round: half to even)."""
    top = int(round((height - geometry.height) / 2.0))
    left = int(round((width - geometry.width) / 2.0))
    return left, top, left + geometry.width, top + geometry.height


def fit_pil(image: Image.Image, geometry: MediaGeometry) -> Image.Image:
    """Bilinear aspect-keeping resize to cover ``geometry``, then the centre crop (upscales small images too)."""
    height, width = resized_size(image.height, image.width, geometry)
    if (height, width) != (image.height, image.width):
        image = image.resize((width, height), Image.BILINEAR)
    if (height, width) == (geometry.height, geometry.width):
        return image
    return image.crop(center_crop_box(height, width, geometry))


def fit_image(image: torch.Tensor, geometry: MediaGeometry) -> torch.Tensor:
    """Fit a ``uint8`` (3, H, W) image (what :func:`~ff_core.data.media.decode_image` returns) to ``geometry``."""
    if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"fit_image expects a uint8 (3, H, W) image, got {image.dtype} {tuple(image.shape)}")
    if tuple(image.shape[1:]) == (geometry.height, geometry.width):
        return image
    fitted = fit_pil(Image.fromarray(image.permute(1, 2, 0).numpy()), geometry)
    return torch.from_numpy(np.asarray(fitted).copy()).permute(2, 0, 1).contiguous()


def fit_frames(frames: torch.Tensor, geometry: MediaGeometry) -> torch.Tensor:
    """Fit ``uint8`` (F, H, W, 3) video frames to ``geometry``, frame by frame."""
    if tuple(frames.shape[1:3]) == (geometry.height, geometry.width):
        return frames
    return torch.from_numpy(np.stack([np.asarray(fit_pil(Image.fromarray(f), geometry)) for f in frames.numpy()]))


def fit_media(media: Any, geometry: MediaGeometry | None) -> Any:
    """One decoded target (image tensor or :class:`DecodedVideo`) fitted to ``geometry``; ``None`` keeps it."""
    if geometry is None:
        return media
    if isinstance(media, DecodedVideo):
        return dataclasses.replace(media, frames=fit_frames(media.frames, geometry))
    if isinstance(media, DecodedAudio):
        raise ValueError(f"{geometry} describes a picture; an audio output takes no MediaGeometry")
    return fit_image(media, geometry)
