"""The condition prefix of MiniMax H3 FL2VA and Ref2VA: packed layout, one realisation per batch, per-row timesteps.

MiniMax H3 denoises one packed sequence (diffusers ``modular_pipelines/minimax_h3``)::

    [text | keyframe conditions | target audio | target video]                      t2va / fl2va
    [text | reference blocks (per reference: soundtrack rows, then video rows) | target audio | target video]  ref2va

The transformer takes the video rows (condition rows first, then the target's) and the audio rows (reference
soundtracks first) as two tensors, with the layout (``position_ids``, ``token_tags``, the three index tensors) and a
per-row timestep. Spec dataset-guide, "How Ref2VA references affect training": the references are immutable condition
prefixes; fresh target states are created separately; "after each forward pass, condition-row predictions are
discarded and only target rows are stepped"; reference rows "do not contribute policy log-probability degrees of
freedom". So ff's latent state holds the target rows only and the prefix lives in the prepared condition:

* :func:`realise_prefix` is the pipeline's ``MiniMaxH3PrepareConditionLatentsStep``: every visual condition latent is
  noised to ``t = 0.999`` (``keyframe_noise_aug``) with its own draw, in packed order, and patchified. It runs once
  per batch in ``prepare_condition``, so both DPO arms and the policy / reference forwards see the same tensor
  ("Conditioned workflows realize one official prefix per batch"). Reference soundtracks are clean (``t = 1``).
* :func:`row_timesteps` is ``MiniMaxH3SetTimestepsStep.build_row_timesteps``: condition video rows at
  ``max(t_video, 0.999)``, reference audio rows at 1, target rows at their own ``t = 1 - sigma``.
* the layouts are the pipeline's own ``build_packed_sequence`` (keyframe anchors) and ``build_ref2va_packed_sequence``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

#: Modality tags of the packed sequence (diffusers ``MINIMAX_H3_*_TAG``: they index the transformer's AdaLN table).
VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2
#: The ``t`` a visual condition is held at (``MiniMaxH3ModularPipeline.keyframe_noise_aug``): just short of clean.
NOISE_AUG = 0.999
#: The ``t`` of a reference soundtrack's rows: clean (``MiniMaxH3SetTimestepsStep``: ``condition_audio_timestep=1.0``).
AUDIO_CONDITION_T = 1.0
#: Keyframe anchors as cached integers (a condition cache stores tensors only), in the pipeline's vocabulary.
ANCHOR_CODES = {"first": 0, "last": 1}

LAYOUT_KEYS = ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices",
               "num_condition_video_rows", "num_condition_audio_rows")  # fmt: skip


@dataclass(frozen=True)
class Geometry:
    """The generated target's latent geometry (what every layout of a run is built for).

    Attributes:
        num_latent_frames: video latent frames (``5 n + 2`` for ``17 n + 5`` frames).
        latent_height: video latent height.
        latent_width: video latent width.
        num_audio_latents: audio latents per stereo channel.
        patch_size: the transformer's ``(t, h, w)`` patch.
        audio_channels: stereo, packed channel-major (2).
    """

    num_latent_frames: int
    latent_height: int
    latent_width: int
    num_audio_latents: int
    patch_size: tuple[int, int, int]
    audio_channels: int = 2


def layout_dict(values: Sequence[Tensor | int]) -> dict[str, Tensor]:
    """The pipeline's layout tuple as cacheable tensors keyed by :data:`LAYOUT_KEYS` (row counts as 0-d int64)."""
    out = {}
    for key, value in zip(LAYOUT_KEYS, values):
        out[key] = value if isinstance(value, Tensor) else torch.tensor(int(value), dtype=torch.int64)
    return out


def keyframe_layout(text_token_tags: Tensor, geometry: Geometry, anchors: Sequence[str]) -> dict[str, Tensor]:
    """``[text | keyframe conditions | target audio | target video]``: ``MiniMaxH3PrepareLayoutStep``'s layout.

    Args:
        text_token_tags: (L,) modality tag of each text row (a keyframe's vision block is tagged video).
        geometry: the target's latent geometry.
        anchors: one ``"first"`` / ``"last"`` per keyframe, in packed order (empty: T2VA).
    """
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    g = geometry
    return layout_dict(MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        text_token_tags, g.num_latent_frames, g.latent_height, g.latent_width, g.num_audio_latents, g.patch_size,
        g.audio_channels, AUDIO_TAG, VIDEO_TAG, tuple(anchors)))  # fmt: skip


@dataclass(frozen=True)
class _Kind:
    """What ``build_ref2va_packed_sequence`` reads of a reference: its modality and whether it carries sound."""

    kind: str
    has_audio: bool


def ref2va_layout(
    text_token_tags: Tensor,
    geometry: Geometry,
    kinds: Sequence[str],
    has_audio: Sequence[bool],
    condition_latents: Sequence[Tensor],
    audio_condition_rows: Sequence[Tensor],
) -> dict[str, Tensor]:
    """``[text | reference blocks | target audio | target video]``: ``MiniMaxH3Ref2VAPrepareLayoutStep``'s layout.

    Args:
        text_token_tags: (L,) modality tag of each text row.
        geometry: the target's latent geometry.
        kinds: each reference's type in packed (record) order.
        has_audio: per reference, whether it contributes soundtrack rows (audio, or a video with a soundtrack).
        condition_latents: per image / video reference, its (1, C, f, h, w) latent (the geometry is read off it).
        audio_condition_rows: per audio-bearing reference, its (rows, C_audio) soundtrack rows.
    """
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3Ref2VAPrepareLayoutStep

    g = geometry
    refs = [_Kind(k, bool(a)) for k, a in zip(kinds, has_audio)]
    return layout_dict(MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
        text_token_tags, refs, list(condition_latents), list(audio_condition_rows), g.num_latent_frames,
        g.latent_height, g.latent_width, g.num_audio_latents, g.patch_size, g.audio_channels, AUDIO_TAG,
        VIDEO_TAG))  # fmt: skip


def patchify(latents: Tensor, patch_size: tuple[int, int, int]) -> Tensor:
    """(B, C, f, h, w) video latents -> (B * rows, C * prod(patch)) rows, frame-major (the pipeline's packing)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

    return patchify_video_latents(latents, patch_size)


def realise_prefix(
    condition_latents: Sequence[Tensor],
    patch_size: tuple[int, int, int],
    scheduler: Any,
    generator: torch.Generator | None = None,
) -> Tensor:
    """The noised, packed video condition rows of one sample (``MiniMaxH3PrepareConditionLatentsStep``).

    One standard-normal draw per condition, in packed order, each of its latent's shape (so the same ``generator``
    state gives the pipeline's rows), then the scheduler's ``scale_noise`` at ``t = 0.999`` (``t z + (1 - t) noise``
    in float32, as the pipeline computes it) and patchify.

    Args:
        condition_latents: the normalised float32 condition latents, each (1, C, f, h, w), in packed order.
        patch_size: the transformer's ``(t, h, w)`` patch.
        scheduler: the video ``MiniMaxH3Scheduler`` (its ``scale_noise``).
        generator: draws the noise (``None``: the global generator), on its own device.
    """
    from diffusers.utils.torch_utils import randn_tensor

    if not condition_latents:
        raise ValueError("realise_prefix: no condition latents (T2VA has no prefix)")
    rows = []
    for z in condition_latents:
        z = z.float()
        # diffusers' randn_tensor, as the pipeline draws: on the generator's device (a CPU generator for a CUDA
        # latent draws on the CPU and moves), so one seeded CPU stream gives the same prefix on any device.
        noise = randn_tensor(tuple(z.shape), generator=generator, device=z.device, dtype=torch.float32)
        rows.append(patchify(scheduler.scale_noise(z, NOISE_AUG, noise), patch_size))
    return torch.cat(rows)


def row_timesteps(layout: dict[str, Tensor], t_video: float, t_audio: float) -> tuple[Tensor, Tensor]:
    """The transformer's ``(timestep, timestep_indices)`` for one forward: target rows at ``t = 1 - sigma`` of their
    stream, condition video rows at ``max(t_video, 0.999)``, reference soundtrack rows at 1
    (``MiniMaxH3SetTimestepsStep.build_row_timesteps``, which the pipeline calls with exactly these).

    Args:
        layout: a layout dict (:func:`keyframe_layout`, :func:`ref2va_layout`).
        t_video: the target video rows' ``t`` (H3's convention: 1 is clean).
        t_audio: the target audio rows' ``t``.
    """
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

    return MiniMaxH3SetTimestepsStep.build_row_timesteps(
        layout["video_indices"].cpu(), layout["audio_indices"].cpu(), int(layout["num_condition_video_rows"]),
        int(layout["num_condition_audio_rows"]), int(layout["text_indices"].numel()), float(t_video), float(t_audio),
        max(float(t_video), NOISE_AUG), AUDIO_CONDITION_T)  # fmt: skip


__all__ = [
    "ANCHOR_CODES",
    "AUDIO_CONDITION_T",
    "Geometry",
    "LAYOUT_KEYS",
    "NOISE_AUG",
    "keyframe_layout",
    "layout_dict",
    "patchify",
    "realise_prefix",
    "ref2va_layout",
    "row_timesteps",
]
