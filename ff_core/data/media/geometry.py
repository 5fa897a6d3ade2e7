"""Target geometry: decoded target media brought to the frame an adapter encodes, in the loader workers.

An adapter says at which geometry it encodes each output (:meth:`ff_core.adapter.Adapter.output_geometry`, one
:class:`MediaGeometry` or ``None`` per output of its contract, in order); :class:`~ff_core.data.samples.
RecordProcessor` fits every decoded target to it before collation, so no batch ever holds mixed sizes.

Fitting follows diffusers' training scripts (examples/dreambooth/train_dreambooth_lora_sd3.py,
examples/text_to_image/train_text_to_image.py): ``transforms.Resize(resolution, BILINEAR)`` of the shorter side,
then ``transforms.CenterCrop(resolution)``. A non-square frame generalises the same rule: scale (keeping the aspect
ratio) until the image covers the frame, then crop the centre. Cropping is always central (the scripts' default
``RandomCrop`` and ``random_flip`` would make a sample depend on more than its record, and resume inexact).

Condition images (an I2V first frame, a keyframe) are another matter: the family pipelines put them on the canvas
themselves, and the model was trained on what they give. :func:`fit_condition_image` does it their way by default,
``stretch``: ``VaeImageProcessor.preprocess(image, height, width)`` with its default ``resize_mode``, i.e. PIL's
``image.resize((width, height), resample)`` whatever the aspect ratio (``WanImageToVideoPipeline``: LANCZOS,
``LTX2ImageToVideoPipeline``: BILINEAR, MiniMax H3's first keyframe: LANCZOS); ``cover`` keeps the target rule above
(ff's rule for condition images before issue 23).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from ff_core.contracts import AudioSpan as AudioSpan  # re-exported: its home before ff_core.contracts
from ff_core.contracts import MediaGeometry as MediaGeometry  # re-exported: as AudioSpan
from ff_core.contracts import MediaType
from ff_core.data.media.decode import (
    DecodedAudio,
    DecodedVideo,
    Where,
    decode_audio,
    decode_clip,
    decode_media,
)
from ff_core.data.records.base import MediaItem


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
    """Fit a ``uint8`` (3, H, W) image (what :func:`~ff_core.data.media.decode.decode_image` returns) to
    ``geometry``."""
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


ConditionResize = Literal["stretch", "cover"]
#: How a condition image is put on the canvas: ``stretch`` (the family pipelines) or ``cover`` (the target rule).
CONDITION_RESIZES = ("stretch", "cover")
#: PIL filters by the names diffusers' ``VaeImageProcessor`` config uses (``resample``; image_processor.py,
#: ``PIL_INTERPOLATION``).
RESAMPLE = {"nearest": Image.Resampling.NEAREST, "bilinear": Image.Resampling.BILINEAR,
            "bicubic": Image.Resampling.BICUBIC, "lanczos": Image.Resampling.LANCZOS}  # fmt: skip


def fit_condition_pil(
    image: Image.Image, geometry: MediaGeometry, resize: ConditionResize = "stretch", resample: str = "lanczos"
) -> Image.Image:
    """A condition image on the ``geometry`` canvas: ``stretch`` is ``VaeImageProcessor.resize(image, height, width)``
    (``resize_mode="default"``: ``image.resize((width, height), resample)``, aspect ratio not kept); ``cover`` is
    :func:`fit_pil` (bilinear cover + centre crop, ``resample`` unused). An image already at the canvas is kept.

    Args:
        image: an RGB PIL image at its file's size.
        geometry: the canvas (``height``, ``width``).
        resize: ``stretch`` or ``cover``.
        resample: the stretch's PIL filter by diffusers' name (``lanczos``, ``bilinear``, ``bicubic``, ``nearest``).
    """
    if resize not in CONDITION_RESIZES:
        raise ValueError(f"condition_resize must be one of {CONDITION_RESIZES}, got {resize!r}")
    if resample not in RESAMPLE:
        raise ValueError(f"condition resample must be one of {sorted(RESAMPLE)}, got {resample!r}")
    if image.size == (geometry.width, geometry.height):
        return image
    if resize == "cover":
        return fit_pil(image, geometry)
    return image.resize((geometry.width, geometry.height), RESAMPLE[resample])


def fit_condition_image(
    image: torch.Tensor, geometry: MediaGeometry, resize: ConditionResize = "stretch", resample: str = "lanczos"
) -> torch.Tensor:
    """A ``uint8`` (3, H, W) condition image on the canvas (:func:`fit_condition_pil`).

    Args:
        image: ``uint8`` (3, H, W), as :func:`~ff_core.data.media.decode.decode_image` returns.
        geometry: the canvas.
        resize: ``stretch`` (the pipelines) or ``cover`` (the target rule).
        resample: the stretch's PIL filter (the family pipeline's ``video_processor.config.resample``).
    """
    if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"fit_condition_image expects a uint8 (3, H, W) image, got {image.dtype} {tuple(image.shape)}")
    pil = Image.fromarray(np.ascontiguousarray(image.permute(1, 2, 0).numpy()))
    fitted = fit_condition_pil(pil, geometry, resize, resample)
    if fitted is pil:
        return image
    return torch.from_numpy(np.asarray(fitted).copy()).permute(2, 0, 1).contiguous()


def decode_target(item: MediaItem, geometry: MediaGeometry | None, *, referenced_by: Where = None) -> Any:
    """Decode one target item as its output's ``geometry`` asks, then fit it (:func:`fit_media`).

    A video item under a clip geometry (``num_frames`` set) is decoded by
    :func:`~ff_core.data.media.decode.decode_clip`: only its window, on the geometry's frame grid (too short: an error,
    never stretched). Its soundtrack (a separate ``audio_path``, else the embedded stream, if any) is cut to the same
    window of the file. Anything else is decoded whole (:func:`~ff_core.data.media.decode.decode_media`).

    Args:
        item: the target media item.
        geometry: its output's geometry (``None``: as decoded).
        referenced_by: ``(source, line)`` of the record, for error messages.
    """
    if geometry is None or not geometry.is_clip or item.type is not MediaType.VIDEO:
        return fit_media(decode_media(item, referenced_by=referenced_by), geometry)
    field = item.field_of("path")
    clip = decode_clip(item.path, num_frames=geometry.num_frames, fps=geometry.fps, start=geometry.start,
                       declared_fps=item.fps, rule=geometry.frame_rule, referenced_by=referenced_by, field=field)
    begin, end = clip.window
    if item.audio_path is not None:
        audio = decode_audio(item.audio_path, start=begin, end=end, declared_sample_rate=item.sample_rate,
                             referenced_by=referenced_by, field=item.field_of("audio_path") or field)
    else:
        audio = decode_audio(item.path, start=begin, end=end, referenced_by=referenced_by, field=field, required=False)
    return fit_media(dataclasses.replace(clip, audio=audio), geometry)
