"""Image rewards that need no downloaded weights: colour, brightness, JPEG compressibility.

Each scores the first image output of every sample (uint8 (3, H, W)); a video output is scored frame by frame and
averaged, so the same rewards serve video adapters.
"""

from __future__ import annotations

import io
from typing import Literal

import torch
from torch import Tensor

from ff_core.rewards.base import Reward, RewardBatch

IMAGE_OR_VIDEO = ("image", "video")


def _frames(x: Tensor) -> Tensor:
    """uint8 (3, H, W) or (T, 3, H, W) -> float (T, 3, H, W) in [0, 1]."""
    x = x.float() / 255.0
    return x.unsqueeze(0) if x.dim() == 3 else x


def _rgb(value: list[int] | tuple[int, int, int], what: str) -> Tensor:
    if len(value) != 3 or not all(0 <= int(v) <= 255 for v in value):
        raise ValueError(f"{what} must be three integers in [0, 255] (R, G, B), got {list(value)}")
    return torch.tensor([float(v) for v in value]) / 255.0


def hue_degrees(rgb: Tensor) -> Tensor:
    """Hue in degrees [0, 360) of float RGB values (..., 3) in [0, 1] (the standard hexcone formula; gray: 0)."""
    r, g, b = rgb.unbind(-1)
    mx, _ = rgb.max(-1)
    mn, _ = rgb.min(-1)
    c = (mx - mn).clamp_min(1e-12)
    hue = torch.where(mx == r, ((g - b) / c) % 6, torch.where(mx == g, (b - r) / c + 2, (r - g) / c + 4))
    return (hue * 60) % 360


class ColourReward(Reward):
    """How much of the image is a target colour, in [0, 1]; 1 is reached by an image filled with the target.

    ``measure: closeness`` is ``1 - mean |pixel - target| / 255`` over pixels and channels (L1 distance in RGB):
    smooth, every pixel counts. ``measure: hue_fraction`` is the fraction of pixels that are saturated (HSV chroma
    > 0.5 x value, value > 0.3: the shapes demo's classifier, :func:`ff_core.testing.shapes.dominant_colour`) and
    within ``hue_tolerance`` degrees of the target's hue: ignores background and brightness, counts the coloured
    area. A video is scored per frame and averaged.

    Args:
        target: target colour as (R, G, B) integers in [0, 255]; default green.
        measure: ``closeness`` or ``hue_fraction``.
        hue_tolerance: ``hue_fraction`` only: largest hue distance (degrees) counted as the target's hue.
    """

    name = "colour"
    media_types = IMAGE_OR_VIDEO

    def __init__(
        self,
        target: tuple[int, int, int] = (0, 255, 0),
        measure: Literal["closeness", "hue_fraction"] = "closeness",
        hue_tolerance: float = 30.0,
    ) -> None:
        super().__init__()
        self.target = _rgb(target, "target")
        if measure not in ("closeness", "hue_fraction"):
            raise ValueError(f"measure must be 'closeness' or 'hue_fraction', got {measure!r}")
        if not 0 < hue_tolerance <= 180:
            raise ValueError(f"hue_tolerance must be in (0, 180] degrees, got {hue_tolerance}")
        if measure == "hue_fraction" and self.target.max() - self.target.min() <= 0.5 * self.target.max():
            raise ValueError(f"target {list(target)} is not a saturated colour: hue_fraction would always be 0")
        self.measure = measure
        self.hue_tolerance = hue_tolerance

    def __call__(self, batch: RewardBatch) -> Tensor:
        return torch.stack([self.score(x.to(self.device)) for x in batch.outputs(self.media_types, self.name)])

    def score(self, image: Tensor) -> Tensor:
        """The score of one uint8 (3, H, W) image or (T, 3, H, W) video."""
        x = _frames(image)  # (T, 3, H, W)
        target = self.target.to(x.device)
        if self.measure == "closeness":
            return 1 - (x - target[:, None, None]).abs().mean()
        r, g, b = x.unbind(1)
        mx = torch.maximum(torch.maximum(r, g), b)
        mn = torch.minimum(torch.minimum(r, g), b)
        saturated = (mx - mn > 0.5 * mx) & (mx > 0.3)
        # Hues of the saturated pixels only (usually few): the rest count as misses.
        d = (hue_degrees(x.movedim(1, -1)[saturated]) - hue_degrees(target)).abs()
        near = torch.minimum(d, 360 - d) <= self.hue_tolerance
        return near.sum() / saturated.numel()


class BrightnessReward(Reward):
    """Mean brightness in [0, 1]: the mean over pixels of the Rec. 601 luma ``0.299 R + 0.587 G + 0.114 B`` / 255
    (1: a white image). With ``target`` set: ``1 - |brightness - target|``, 1 at exactly that brightness.

    Args:
        target: brightness to aim at, in [0, 1]; ``None`` rewards brightness itself.
    """

    name = "brightness"
    media_types = IMAGE_OR_VIDEO
    LUMA = (0.299, 0.587, 0.114)  # ITU-R BT.601, as PIL's convert("L")

    def __init__(self, target: float | None = None) -> None:
        super().__init__()
        if target is not None and not 0 <= target <= 1:
            raise ValueError(f"target must be in [0, 1], got {target}")
        self.target = target

    def __call__(self, batch: RewardBatch) -> Tensor:
        weights = torch.tensor(self.LUMA, device=self.device)
        values = []
        for x in batch.outputs(self.media_types, self.name):
            luma = (_frames(x.to(self.device)).movedim(1, -1) * weights).sum(-1)
            values.append(luma.mean())
        brightness = torch.stack(values)
        return brightness if self.target is None else 1 - (brightness - self.target).abs()


class JpegCompressibilityReward(Reward):
    """How well the image compresses: ``-(JPEG size in kB)`` at ``quality`` (Pillow), as in DDPO (Black et al. 2023,
    sec. 6.1, "compressibility"); higher (closer to 0) is simpler. With ``normalise``: ``1 - bytes / raw bytes``,
    in [0, 1) (the share of the 3 x H x W raw bytes saved), comparable across sizes. A video scores its mean frame.

    Args:
        quality: JPEG quality (1-95).
        normalise: report the saved share of the raw size instead of minus kilobytes.
    """

    name = "jpeg_compressibility"
    media_types = IMAGE_OR_VIDEO

    def __init__(self, quality: int = 95, normalise: bool = False) -> None:
        super().__init__()
        if not 1 <= quality <= 95:
            raise ValueError(f"quality must be in [1, 95] (Pillow's useful range), got {quality}")
        self.quality = quality
        self.normalise = normalise

    def __call__(self, batch: RewardBatch) -> Tensor:
        return torch.tensor([self.score(x) for x in batch.outputs(self.media_types, self.name)], dtype=torch.float32)

    def score(self, image: Tensor) -> float:
        frames = image.unsqueeze(0) if image.dim() == 3 else image
        sizes = [jpeg_size(f, self.quality) for f in frames]
        size = sum(sizes) / len(sizes)
        raw = frames[0].numel()
        return 1 - size / raw if self.normalise else -size / 1000


def jpeg_size(image: Tensor, quality: int) -> int:
    """Bytes of a uint8 (3, H, W) image saved as JPEG by Pillow at ``quality``."""
    from PIL import Image

    array = image.detach().to("cpu", torch.uint8).permute(1, 2, 0).contiguous().numpy()
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
    return buffer.tell()
