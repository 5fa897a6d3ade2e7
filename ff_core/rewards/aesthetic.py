"""LAION aesthetic score: an MLP on CLIP ViT-L/14's L2-normalised image embedding, trained to predict the 1-10
ratings of SAC, LAION-Logos and AVA (christophschuhmann/improved-aesthetic-predictor, ``simple_inference.py``).

Flow-GRPO's scorer (github.com/yifan123/flow_grpo, ``flow_grpo/aesthetic_scorer.py``, "Based on
improved-aesthetic-predictor/simple_inference.py") is the reference::

    embed = clip.get_image_features(**processor(images=images))     # openai/clip-vit-large-patch14
    embed = embed / torch.linalg.vector_norm(embed, dim=-1, keepdim=True)
    score = MLP(embed).squeeze(1)                                   # sac+logos+ava1-l14-linearMSE.pth

with the MLP ``Linear(768, 1024), Dropout(0.2), Linear(1024, 128), Dropout(0.2), Linear(128, 64), Dropout(0.1),
Linear(64, 16), Linear(16, 1)`` (no activations: the trained head is one affine map, kept layer by layer so the
checkpoint's ``layers.N.weight`` keys load as they are).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ff_core.rewards.base import RewardBatch
from ff_core.rewards.media import IMAGE_OR_VIDEO, score_images, to_pil
from ff_core.rewards.models import ModelReward, from_pretrained, load_state_dict, projected


class AestheticHead(nn.Module):
    """improved-aesthetic-predictor's MLP (its ``simple_inference.py``; flow_grpo's ``MLP``), on ``input_size``-dim
    embeddings (768 for ViT-L/14). Dropout is inactive in eval mode."""

    def __init__(self, input_size: int = 768) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024), nn.Dropout(0.2),
            nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )  # fmt: skip

    def forward(self, embed: Tensor) -> Tensor:
        return self.layers(embed)


class AestheticReward(ModelReward):
    """LAION aesthetic predictor: ``MLP(E_image / ||E_image||)`` with CLIP ViT-L/14's image embedding; about 1 to 10,
    unbounded (the head is linear), higher = more aesthetic; the prompt is not used.

    The CLIP folder holds a ``CLIPModel`` and its processor (``openai/clip-vit-large-patch14``, as ``save_pretrained``
    writes them); the head is the predictor's state dict (``sac+logos+ava1-l14-linearMSE.pth``, keys
    ``layers.{0,2,4,6,7}.{weight,bias}``), as ``.pth`` or ``.safetensors``. The CLIP runs in ``dtype``, the head in
    float32. A video scores its middle frame, or the mean over ``video_frames`` evenly spaced frames.

    Args:
        pretrained_model_name_or_path: local folder (or hub id) of the CLIP ViT-L/14 model and processor.
        head_path: the MLP head's weights (``.pth`` / ``.pt`` / ``.safetensors``).
        video_frames: frames scored per video (1: the middle one; more: evenly spaced, scores averaged).
        batch_size: images per forward pass.
        dtype: the CLIP weights' dtype (``float32``, ``bfloat16``, ``float16``).
    """

    name = "aesthetic"
    media_types = IMAGE_OR_VIDEO
    module_names = ("model", "head")

    def __init__(
        self,
        pretrained_model_name_or_path: str,
        head_path: str,
        video_frames: int = 1,
        batch_size: int = 32,
        dtype: str = "float32",
    ) -> None:
        from transformers import CLIPModel, CLIPProcessor

        super().__init__(dtype, batch_size=batch_size, video_frames=video_frames)
        self.model = from_pretrained(CLIPModel, pretrained_model_name_or_path, dtype=self.dtype)
        self.processor = from_pretrained(CLIPProcessor, pretrained_model_name_or_path)
        self.head = AestheticHead(self.model.config.projection_dim)
        try:
            self.head.load_state_dict(load_state_dict(head_path))
        except (OSError, RuntimeError, ValueError) as exc:  # no file, not tensors, or not the head's keys / shapes
            raise ValueError(f"head_path {head_path!r}: {exc}") from None
        self.freeze()
        self.video_frames = video_frames
        self.batch_size = batch_size

    def __call__(self, batch: RewardBatch) -> Tensor:
        return score_images(batch, self.media_types, self.name, self.video_frames, self.batch_size, self._score)

    @torch.no_grad()
    def _score(self, images: list[Tensor], prompts: list[str]) -> Tensor:
        inputs = self.processor(images=to_pil(images), return_tensors="pt")
        pixels = inputs["pixel_values"].to(self.device, self.dtype)
        embed = projected(self.model.get_image_features(pixel_values=pixels)).float()
        embed = embed / torch.linalg.vector_norm(embed, dim=-1, keepdim=True)
        return self.head(embed).squeeze(1)
