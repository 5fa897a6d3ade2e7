"""CLIP score: how well each image matches its prompt, by a CLIP model loaded from a local folder (or hub id).

Hessel et al. 2021 (CLIPScore, eq. 1): ``w * max(cos(E_image, E_text), 0)`` with ``w = 2.5``; ff reports the cosine
similarity times ``scale`` (default 1, no clipping), the quantity Flow-GRPO-style recipes optimise, and the
paper's figure with ``scale: 2.5, clip_negative: true``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ff_core.rewards.base import RewardBatch
from ff_core.rewards.media import IMAGE_OR_VIDEO, score_in_batches, to_pil
from ff_core.rewards.models import ModelReward, from_pretrained


class ClipScoreReward(ModelReward):
    """Cosine similarity of CLIP's image and text embeddings of each sample and its prompt, times ``scale``.

    The model folder holds a ``CLIPModel`` and its processor (image processor + tokenizer), as
    ``save_pretrained`` writes them; prompts longer than the tokenizer's ``model_max_length`` are truncated. A video
    scores its middle frame.

    Args:
        pretrained_model_name_or_path: local folder (or hub id) of the CLIP model and processor.
        scale: multiplies the cosine similarity (CLIPScore uses 2.5).
        clip_negative: clamp negative similarities to 0 (as CLIPScore does).
        batch_size: images per forward pass.
        dtype: weights' dtype (``float32``, ``bfloat16``, ``float16``).
    """

    name = "clip_score"
    media_types = IMAGE_OR_VIDEO

    def __init__(
        self,
        pretrained_model_name_or_path: str,
        scale: float = 1.0,
        clip_negative: bool = False,
        batch_size: int = 32,
        dtype: str = "float32",
    ) -> None:
        from transformers import CLIPModel, CLIPProcessor

        super().__init__(dtype, batch_size=batch_size)
        self.model = from_pretrained(CLIPModel, pretrained_model_name_or_path, dtype=self.dtype)
        self.processor = from_pretrained(CLIPProcessor, pretrained_model_name_or_path)
        self.freeze()
        self.scale = scale
        self.clip_negative = clip_negative
        self.batch_size = batch_size

    def __call__(self, batch: RewardBatch) -> Tensor:
        images = [x if x.dim() == 3 else x[len(x) // 2] for x in batch.outputs(self.media_types, self.name)]
        out = score_in_batches(self._score, images, batch.prompts, self.batch_size)
        return out.clamp_min(0) * self.scale if self.clip_negative else out * self.scale

    @torch.no_grad()
    def _score(self, images: list[Tensor], prompts: list[str]) -> Tensor:
        # The processor resizes, crops and normalises as the model was trained; PIL images leave no doubt about the
        # channel axis (a 3 x 3 x W array would be ambiguous).
        inputs = self.processor(
            text=list(prompts), images=to_pil(images), return_tensors="pt",
            padding=True, truncation=True,
        ).to(self.device)
        out = self.model(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"),
                         pixel_values=inputs["pixel_values"].to(self.dtype))
        # CLIPModel returns L2-normalised embeddings: their dot product is the cosine similarity.
        return (out.image_embeds * out.text_embeds).sum(-1)
