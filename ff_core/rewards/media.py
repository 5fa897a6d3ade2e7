"""What the model-based rewards share about media: frames picked from videos, batched scoring (averaged back per
sample for frames), PIL conversion, and the resize / centre-crop transforms of the reference scorers. Loading the
models is :mod:`ff_core.rewards.models`.

The reference scorers preprocess with torchvision, which does not import beside every torch build (ff does not
depend on it); :func:`resize_shorter_tensor`, :func:`resize_shorter_pil` and :func:`center_crop` are its
``Resize(size)`` (shorter edge to ``size``) and ``CenterCrop(size)`` for the two inputs the scorers give it, written
from torchvision 0.28's ``transforms/functional.py`` (``_compute_resized_output_size``, ``resize``,
``center_crop``) and ``transforms/_functional_tensor.py`` (``resize``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ff_core.rewards.base import RewardBatch

IMAGE_OR_VIDEO = ("image", "video")
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # CLIP (Radford et al. 2021)'s normalisation, which
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)  # open_clip, BLIP and ImageReward reuse


def frame_indices(num_frames: int, video_frames: int) -> list[int]:
    """The frames of a ``num_frames``-frame video that are scored: the middle one (``T // 2``) when
    ``video_frames`` is 1, else ``min(video_frames, T)`` evenly spaced ones, first and last included."""
    if video_frames == 1 or num_frames == 1:
        return [num_frames // 2]
    k = min(video_frames, num_frames)
    return torch.linspace(0, num_frames - 1, k).round().long().tolist()


def score_in_batches(score: Callable[[list, list[str]], Tensor], items: list, prompts: list[str],
                     batch_size: int) -> Tensor:
    """``score(items, prompts)`` on ``batch_size`` items at a time, concatenated as float ((n,) scores, on the device
    ``score`` returns them on; an empty float32 tensor on the CPU for no items)."""
    scores = [score(items[i:i + batch_size], prompts[i:i + batch_size]) for i in range(0, len(items), batch_size)]
    return torch.cat(scores).float() if scores else torch.zeros(0)


def score_images(
    batch: RewardBatch,
    media_types: Sequence[str],
    reward: str,
    video_frames: int,
    batch_size: int,
    score: Callable[[list[Tensor], list[str]], Tensor],
) -> Tensor:
    """Per sample, the mean of ``score`` over its image (or its video's :func:`frame_indices` frames), each frame
    scored with the sample's prompt, ``batch_size`` frames per call; float32 (B,) on the CPU.

    Args:
        score: ``(images uint8 (3, H, W), prompts) -> (n,)`` scores.
    """
    images: list[Tensor] = []
    owner: list[int] = []
    for i, x in enumerate(batch.outputs(media_types, reward)):
        frames = [x] if x.dim() == 3 else [x[t] for t in frame_indices(len(x), video_frames)]
        images += frames
        owner += [i] * len(frames)
    prompts = [batch.prompts[i] for i in owner]
    flat = score_in_batches(score, images, prompts, batch_size).cpu()
    index = torch.tensor(owner, dtype=torch.long)
    total = torch.zeros(len(batch)).index_add_(0, index, flat)
    return total / torch.bincount(index, minlength=len(batch)).clamp_min(1)


def to_pil(images: list[Tensor]) -> list:
    """uint8 (3, H, W) tensors -> RGB PIL images (no doubt about the channel axis, as a 3 x 3 x W array leaves)."""
    from PIL import Image

    return [Image.fromarray(x.detach().to("cpu", torch.uint8).permute(1, 2, 0).numpy()) for x in images]


def resized_shape(height: int, width: int, size: int) -> tuple[int, int]:
    """torchvision's ``_compute_resized_output_size`` for an int size: the shorter edge becomes ``size``, the longer
    ``int(size * long / short)`` (truncated)."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def resize_shorter_tensor(x: Tensor, size: int) -> Tensor:
    """torchvision ``Resize(size, BICUBIC)`` of a float (C, H, W) tensor: ``interpolate(bicubic,
    align_corners=False, antialias=True)`` (antialias is torchvision's default since 0.17), unchanged at the size."""
    shape = resized_shape(x.shape[-2], x.shape[-1], size)
    if tuple(x.shape[-2:]) == shape:
        return x
    return torch.nn.functional.interpolate(x[None], size=shape, mode="bicubic", align_corners=False,
                                           antialias=True)[0]


def resize_shorter_pil(image, size: int):
    """torchvision ``Resize(size, BICUBIC)`` of a PIL image: Pillow's bicubic resize (always antialiased)."""
    from PIL import Image

    height, width = resized_shape(image.height, image.width, size)
    if (image.height, image.width) == (height, width):
        return image
    return image.resize((width, height), Image.BICUBIC)


def center_crop(x: Tensor, size: int) -> Tensor:
    """torchvision ``CenterCrop(size)`` of a (C, H, W) tensor no smaller than ``size``: offsets
    ``int(round((H - size) / 2))`` (Python's round: half to even)."""
    top = int(round((x.shape[-2] - size) / 2.0))
    left = int(round((x.shape[-1] - size) / 2.0))
    return x[..., top:top + size, left:left + size]


def normalise(x: Tensor, mean: Sequence[float] = OPENAI_CLIP_MEAN, std: Sequence[float] = OPENAI_CLIP_STD) -> Tensor:
    """``(x - mean) / std`` per channel of (..., 3, H, W) in [0, 1] (torchvision's ``Normalize``)."""
    mean_t = torch.tensor(mean, dtype=x.dtype, device=x.device)[:, None, None]
    std_t = torch.tensor(std, dtype=x.dtype, device=x.device)[:, None, None]
    return (x - mean_t) / std_t
