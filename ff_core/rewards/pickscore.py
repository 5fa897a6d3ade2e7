"""PickScore (Kirstain et al. 2023, "Pick-a-Pic"): a CLIP-H fine-tuned on human preferences between generated images.

The score is CLIP's temperature-scaled cosine similarity, as the PickScore README's ``calc_probs``
(github.com/yuvalkirstain/PickScore) computes it before its softmax over candidate images::

    image_embs = model.get_image_features(**image_inputs);  image_embs /= ||image_embs||
    text_embs  = model.get_text_features(**text_inputs);    text_embs  /= ||text_embs||
    scores     = model.logit_scale.exp() * (text_embs @ image_embs.T)

Flow-GRPO's scorer (github.com/yifan123/flow_grpo, ``flow_grpo/pickscore_scorer.py``) takes the diagonal of that
matrix (each image with its own prompt) and divides it by 26 ("norm to 0-1"), the value its ``pickscore`` recipes
(``config/grpo.py``) train on; ``normalise: true`` gives that form.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ff_core.rewards.base import RewardBatch
from ff_core.rewards.media import IMAGE_OR_VIDEO, score_images, to_pil
from ff_core.rewards.models import ModelReward, from_pretrained, given_path, projected

FLOW_GRPO_DIVISOR = 26.0
"""flow_grpo's ``scores / 26``: generated images' PickScores lie around 20 to 23 (Flow-GRPO's tables), so /26 brings
them near [0.8, 0.9]."""


class PickScoreReward(ModelReward):
    """PickScore of each image and its prompt: ``logit_scale.exp() * cos(E_image, E_text)`` (divided by 26 with
    ``normalise``), in ``[-s, s]`` for ``s = logit_scale.exp()``; higher = preferred.

    The model folder holds a ``CLIPModel`` (``yuvalkirstain/PickScore_v1``); its processor (image processor +
    tokenizer) is the CLIP-H one the PickScore README loads from ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``: a folder of
    it (``processor_name_or_path``), or the model folder when the processor was saved there. Prompts are truncated to
    the text encoder's 77 positions, as ``calc_probs`` does. A video scores its middle frame, or the mean over
    ``video_frames`` evenly spaced frames.

    Args:
        pretrained_model_name_or_path: local folder (or hub id) of the PickScore ``CLIPModel``.
        processor_name_or_path: folder (or hub id) of the CLIP processor; ``None``: the model folder.
        normalise: divide by 26 as flow_grpo does (its recipes' scale); default ``False``: the raw PickScore the
            paper and Flow-GRPO's tables report.
        video_frames: frames scored per video (1: the middle one; more: evenly spaced, scores averaged).
        batch_size: images per forward pass.
        dtype: weights' dtype (``float32``, ``bfloat16``, ``float16``).
    """

    name = "pickscore"
    media_types = IMAGE_OR_VIDEO

    def __init__(
        self,
        pretrained_model_name_or_path: str,
        processor_name_or_path: str | None = None,
        normalise: bool = False,
        video_frames: int = 1,
        batch_size: int = 32,
        dtype: str = "float32",
    ) -> None:
        from transformers import AutoProcessor, CLIPModel

        super().__init__(dtype, batch_size=batch_size, video_frames=video_frames)
        self.model = from_pretrained(CLIPModel, pretrained_model_name_or_path, dtype=self.dtype)
        key, processor_path = given_path(processor_name_or_path=processor_name_or_path,
                                         pretrained_model_name_or_path=pretrained_model_name_or_path)
        self.processor = from_pretrained(AutoProcessor, processor_path, key, holds="CLIP processor")
        self.freeze()
        # calc_probs' max_length=77: PickScore_v1's text positions (a smaller test model has fewer).
        self.max_length = int(self.model.config.text_config.max_position_embeddings)
        self.normalise = normalise
        self.video_frames = video_frames
        self.batch_size = batch_size

    def __call__(self, batch: RewardBatch) -> Tensor:
        scores = score_images(batch, self.media_types, self.name, self.video_frames, self.batch_size, self._score)
        return scores / FLOW_GRPO_DIVISOR if self.normalise else scores

    @torch.no_grad()
    def _score(self, images: list[Tensor], prompts: list[str]) -> Tensor:
        image_inputs = self.processor(images=to_pil(images), return_tensors="pt").to(self.device)
        text_inputs = self.processor(text=list(prompts), padding=True, truncation=True, max_length=self.max_length,
                                     return_tensors="pt").to(self.device)
        image_embs = self.model.get_image_features(pixel_values=image_inputs["pixel_values"].to(self.dtype))
        text_embs = self.model.get_text_features(**text_inputs)
        image_embs = projected(image_embs)
        text_embs = projected(text_embs)
        cos = (torch.nn.functional.normalize(image_embs.float(), dim=-1)
               * torch.nn.functional.normalize(text_embs.float(), dim=-1)).sum(-1)
        # The diagonal of calc_probs' matrix: each image against its own prompt.
        return self.model.logit_scale.float().exp() * cos
