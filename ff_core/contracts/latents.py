"""What adapters and the rest of ff exchange in memory: latent states, prepared conditions, condition inputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

Condition = dict[str, Any]
"""A prepared condition: adapter-owned tensors for one batch (prompt embeddings, condition latents, ...)."""


@dataclass
class ConditionInput:
    """The input side of one sample, before preprocessing.

    Attributes:
        prompt: the text prompt.
        negative_prompt: CFG negative prompt (only for contracts that accept one).
        media: decoded condition media in record order (V2 ``input.media``; legacy ``image(s)`` / ``video(s)`` /
            ``audio(s)`` columns or Ref2VA ``references``), each ``{"type", "data", "path", "slot"?}``: ``type`` is
            ``"image"``, ``"video"`` or ``"audio"``; ``data`` what :func:`ff_core.data.media.decode.decode_media`
            returns (image: ``uint8`` (3, H, W) tensor at the file's size; ``DecodedVideo``; ``DecodedAudio``); ``path``
            the file; ``slot`` the contract slot the item binds to, whether written in the record or filled in
            declaration order (absent for references and grouped inputs, which bind by list order); ``fps``,
            ``sample_rate`` and ``audio_path`` the record's declared overrides and a video's separate soundtrack file,
            present only where the record wrote them.
    """

    prompt: str
    negative_prompt: str | None = None
    media: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class LatentState:
    """Ordered named latent components, batch-first (``latent``, or ``video`` then ``audio``).

    Each component is the latent as the family's codec gives it, normalised (``(z - shift_factor) * scaling_factor``)
    and **unpacked**: images (B, C, h, w), videos (B, C, f, h, w). Noise, masks, losses and Euler steps act on it
    element by element and :meth:`Adapter.decode` inverts :meth:`Adapter.encode_output`; a denoiser that takes packed
    tokens (FLUX.1's 2 x 2 patches) packs inside :meth:`Adapter.velocity` and unpacks its prediction there.

    Attributes:
        components: name -> tensor of shape (B, ...); insertion order is the pipeline's output order.
        masks: optional name -> {0,1} tensor broadcastable to the component; 1 marks elements that are
            generated (trained), 0 elements pinned by a condition (e.g. an I2AV first-frame latent).
    """

    components: dict[str, Tensor]
    masks: dict[str, Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return next(iter(self.components.values())).shape[0]

    def map(self, fn: Callable[[Tensor], Tensor]) -> LatentState:
        return LatentState({k: fn(v) for k, v in self.components.items()}, dict(self.masks))

    def zip_map(self, other: LatentState, fn: Callable[[Tensor, Tensor], Tensor]) -> LatentState:
        if list(self.components) != list(other.components):
            raise ValueError(f"latent components differ: {list(self.components)} vs {list(other.components)}")
        return LatentState({k: fn(v, other.components[k]) for k, v in self.components.items()}, dict(self.masks))

    def randn_like(self, generator: torch.Generator | None = None) -> LatentState:
        return self.map(lambda t: torch.randn(t.shape, generator=generator, device=t.device, dtype=t.dtype))
