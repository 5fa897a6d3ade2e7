"""MiniMax H3's rules, shared by its three workflows (T2VA, FL2VA, Ref2VA) and checked before any weight loads.

Spec dataset-guide, "MiniMax H3 datasets" and the support table row ``minimax-h3-*``:

* **B = 1** for preprocessing, training and evaluation; **no CFG** (``guidance_scale`` 1.0, no negative prompts):
  :data:`H3_CONTRACT_LIMITS` puts both in every H3 contract, so ff-core enforces them where it enforces every
  contract (``ff data validate --model``, ``FlowDataModule.setup``: the batch sizes and each record's
  ``negative_prompt``, named by file and line; ``FlowModule.setup``: ``guidance_scale``).
* **5-15 s at 24 fps**, ``num_frames`` rounded up to ``17 n + 5`` (the video VAE's chunking: 17-frame clips keeping
  5 latent frames), so 124 is the smallest explicit count: :func:`aligned_num_frames` and :func:`check_clip`, run by
  every adapter's ``from_pretrained`` on its arguments before loading a component.
* every candidate an exact ordered **(video, audio)** pair with ``fps`` and ``sample_rate``: :data:`AV_OUTPUTS`, the
  contract's outputs (ff-core reports a record that lists them in another order or misses one, by file and line).

The constants are the modular pipeline's (``diffusers.modular_pipelines.minimax_h3.modular_pipeline``: ``fps``,
``min_duration``, ``max_duration``, ``align_num_frames``), restated here because they must be readable without
building a pipeline.
"""

from __future__ import annotations

from typing import Any

from ff_core.contracts import AUDIO_OUT, VIDEO_OUT, NegativePrompt
from ff_core.errors import ConfigError

KEY = "model.adapter_kwargs"

FPS = 24
"""MiniMax H3 generates (and trains) at a fixed 24 fps; every target video is sampled onto this grid."""
FRAME_RULE = "fps_filter"
"""How a target clip's frames are put on the 24-fps grid: as ffmpeg's ``fps`` filter does (H3's released SFT data flow
decodes through it; :func:`ff_core.data.media.decode.clip_source_frames`), not the nearest-frame rule of the other
families."""
MIN_SECONDS, MAX_SECONDS = 5.0, 15.0
"""The durations H3 generates, in seconds (``MiniMaxH3ModularPipeline.min_duration`` / ``max_duration``)."""
FRAMES_PER_CHUNK, LATENTS_PER_CHUNK = 17, 5
"""The video VAE's ``clip_length`` and ``tokens_chunk_size``: an aligned clip has ``17 n + 5`` frames."""

AV_OUTPUTS = (VIDEO_OUT, AUDIO_OUT)
"""Every H3 candidate: an exact ordered (video with fps, audio with sample_rate) pair (spec support table)."""
H3_CONTRACT_LIMITS: dict[str, Any] = {"max_batch_size": 1, "negative_prompt": NegativePrompt.REJECTED}
"""B = 1 everywhere and no classifier-free guidance: keyword arguments of every H3 ``PipelineIOContract``."""


def aligned_num_frames(num_frames: int, frames_per_chunk: int = FRAMES_PER_CHUNK,
                       latents_per_chunk: int = LATENTS_PER_CHUNK) -> int:  # fmt: skip
    """``num_frames`` rounded up to the next ``frames_per_chunk * n + latents_per_chunk`` (``17 n + 5``): the frame
    counts the video VAE encodes (the pipeline's ``align_num_frames``). 120 (5 s) becomes 124.

    Args:
        num_frames: the requested frame count, >= 1.
        frames_per_chunk: the VAE's ``clip_length``.
        latents_per_chunk: the VAE's ``tokens_chunk_size``.
    """
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1:
        raise ValueError(f"num_frames must be a positive integer, got {num_frames!r}")
    return num_frames + (latents_per_chunk - num_frames) % frames_per_chunk


def check_clip(num_frames: int, height: int, width: int, canvas_multiple: int | None = None) -> int:
    """The aligned frame count of an H3 clip, after checking the clip against the spec's rules; a
    :class:`~ff_core.errors.ConfigError` (a ``ValueError``) naming the ``model.adapter_kwargs`` key otherwise.

    ``num_frames`` is rounded up to ``17 n + 5`` (:func:`aligned_num_frames`); the rounded clip must last 5-15 s at
    24 fps (so 124 is the smallest aligned count, 345 the largest). ``height`` / ``width`` must be positive multiples of
    ``canvas_multiple`` (the VAE's spatial compression times the transformer's patch) when it is known.

    Args:
        num_frames: ``model.adapter_kwargs.num_frames``.
        height: ``model.adapter_kwargs.height``.
        width: ``model.adapter_kwargs.width``.
        canvas_multiple: what the canvas sides must be multiples of (``None``: not checked yet).
    """
    try:
        aligned = aligned_num_frames(num_frames)
    except ValueError as exc:
        raise ConfigError(f"{KEY}.num_frames", str(exc)) from None
    seconds = aligned / FPS
    if not MIN_SECONDS <= seconds <= MAX_SECONDS:
        raise ConfigError(f"{KEY}.num_frames", f"{num_frames} frames, rounded up to {aligned} "
                          f"(17 n + 5), last {seconds:.3f} s at {FPS} fps; MiniMax H3 takes {MIN_SECONDS:g}-"
                          f"{MAX_SECONDS:g} s, i.e. 124 to 345 frames after rounding")  # fmt: skip
    for key, value in (("height", height), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{KEY}.{key}", f"must be a positive integer, got {value!r}")
        if canvas_multiple is not None and value % canvas_multiple:
            raise ConfigError(f"{KEY}.{key}", f"must be a multiple of {canvas_multiple} (the video VAE's "
                              f"spatial compression x the transformer's patch), got {value}")  # fmt: skip
    return aligned
