"""ImageReward (Xu et al. 2023): BLIP's ViT-L/16 image encoder, its BERT text encoder attending to the image
(cross-attention in every layer), and an MLP on the [CLS] state, trained on human rankings of generated images.

The reference is the ``image-reward`` package (github.com/THUDM/ImageReward, ``ImageReward/ImageReward.py``,
``ImageReward.score`` / ``inference_rank``, which flow_grpo's ``flow_grpo/imagereward_scorer.py`` calls)::

    text_input = blip.tokenizer(prompt, padding='max_length', truncation=True, max_length=35)
    image = preprocess(pil_image)            # Resize(224, BICUBIC), CenterCrop(224), ToTensor, Normalize(CLIP)
    image_embeds = blip.visual_encoder(image)
    text_output = blip.text_encoder(text_input.input_ids, attention_mask=text_input.attention_mask,
                                    encoder_hidden_states=image_embeds, encoder_attention_mask=ones)
    rewards = mlp(text_output.last_hidden_state[:, 0, :])
    rewards = (rewards - 0.16717362830052426) / 1.0333394966054072

The package is not used: it imports torchvision and ``timm==0.6.13`` (which needs torchvision; its PyPI wheels do
not import beside ff's CPU torch build) and ``fairscale``, and fetches ``bert-base-uncased`` at run time. Its BLIP
modules (``models/BLIP/vit.py``: timm's ViT with LayerNorm eps 1e-6; ``models/BLIP/med.py``: BERT with
cross-attention) are the ones transformers ported as ``BlipVisionModel`` and ``BlipTextModel`` (same qkv layout
and BERT parameter names), which run the converted checkpoint here (:func:`image_reward_to_transformers`).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from torch import Tensor

from ff_core.rewards.aesthetic import AestheticHead
from ff_core.rewards.base import RewardBatch
from ff_core.rewards.media import IMAGE_OR_VIDEO, center_crop, normalise, resize_shorter_pil, score_images, to_pil
from ff_core.rewards.models import ModelReward, from_pretrained, given_path, load_state_dict

MEAN, STD = 0.16717362830052426, 1.0333394966054072  # ImageReward.__init__: the raw rewards' statistics
MAX_LENGTH = 35  # ImageReward.score's tokenizer(max_length=35)
_VIT = {"cls_token": "embeddings.class_embedding", "pos_embed": "embeddings.position_embedding",
        "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
        "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
        "norm.weight": "post_layernorm.weight", "norm.bias": "post_layernorm.bias"}  # fmt: skip
_VIT_BLOCK = re.compile(r"blocks\.(\d+)\.(norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(weight|bias)")
_IN_BLOCK = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.qkv": "self_attn.qkv",
             "attn.proj": "self_attn.projection", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}  # fmt: skip


def image_reward_to_transformers(state_dict: dict[str, Tensor]) -> tuple[dict, dict, dict]:
    """ImageReward's state dict split into ``BlipVisionModel``'s, ``BlipTextModel``'s and the head's keys.

    ``blip.visual_encoder.*`` is renamed (timm's ViT names to transformers' BLIP ones), ``blip.text_encoder.*`` keeps
    its BERT names (``embeddings.position_ids`` buffers dropped), ``mlp.*`` is the head; ``blip.vision_proj`` /
    ``blip.text_proj`` (contrastive projections the score does not use) are left out. An unknown key inside the
    three used modules is an error naming it.
    """
    vision, text, head, unknown = {}, {}, {}, []
    for key, value in state_dict.items():
        if key.startswith("blip.visual_encoder."):
            rest = key.removeprefix("blip.visual_encoder.")
            if rest in _VIT:
                vision[_VIT[rest]] = value
            elif (match := _VIT_BLOCK.fullmatch(rest)) is not None:
                vision[f"encoder.layers.{match[1]}.{_IN_BLOCK[match[2]]}.{match[3]}"] = value
            else:
                unknown.append(key)
        elif key.startswith("blip.text_encoder."):
            if not key.endswith("position_ids"):
                text[key.removeprefix("blip.text_encoder.")] = value
        elif key.startswith("mlp."):
            head[key.removeprefix("mlp.")] = value
    if unknown:
        raise ValueError(f"not an ImageReward state dict: unknown keys {', '.join(unknown[:5])}")
    return vision, text, head


class ImageRewardReward(ModelReward):
    """ImageReward of each image and its prompt, standardised by the training rewards' mean and std (about
    N(0, 1) over its training comparisons, unbounded; higher = preferred).

    The folder holds THUDM/ImageReward's ``ImageReward.pt`` (or ``.safetensors``) and ``med_config.json``; the BERT
    tokenizer is ``bert-base-uncased``'s (``vocab.txt`` / ``tokenizer.json``, with ``[DEC]`` and ``[ENC]`` added as
    BLIP's ``init_tokenizer`` does): in the folder, or a folder named by ``tokenizer_name_or_path``. The image
    encoder's sizes are read from the checkpoint (ViT-L/16 at 224 pixels for ImageReward-v1.0; heads of 64
    channels, as BLIP's ViTs). A video scores its middle frame, or the mean over ``video_frames`` evenly spaced
    frames.

    Args:
        pretrained_model_name_or_path: local folder with ``ImageReward.pt`` and ``med_config.json``.
        tokenizer_name_or_path: folder (or hub id) of the BERT tokenizer; ``None``: the model folder.
        video_frames: frames scored per video (1: the middle one; more: evenly spaced, scores averaged).
        batch_size: images per forward pass.
        dtype: the BLIP weights' dtype (``float32``, ``bfloat16``, ``float16``); the head runs in float32.
    """

    name = "image_reward"
    media_types = IMAGE_OR_VIDEO
    module_names = ("vision", "text", "head")

    def __init__(
        self,
        pretrained_model_name_or_path: str,
        tokenizer_name_or_path: str | None = None,
        video_frames: int = 1,
        batch_size: int = 32,
        dtype: str = "float32",
    ) -> None:
        from transformers import BertTokenizer

        super().__init__(dtype, batch_size=batch_size, video_frames=video_frames)
        folder = Path(pretrained_model_name_or_path)
        try:
            weights = next((folder / f"ImageReward.{ext}" for ext in ("pt", "safetensors")
                            if (folder / f"ImageReward.{ext}").is_file()), folder / "ImageReward.pt")
            vision, text, head = image_reward_to_transformers(load_state_dict(weights))
            med_config = json.loads((folder / "med_config.json").read_text())
        except (OSError, RuntimeError, ValueError) as exc:
            raise ValueError(f"pretrained_model_name_or_path {str(folder)!r}: {exc}") from None
        key, tokenizer_path = given_path(tokenizer_name_or_path=tokenizer_name_or_path,
                                         pretrained_model_name_or_path=str(folder))
        self.tokenizer = from_pretrained(BertTokenizer, tokenizer_path, key, holds="BERT tokenizer")
        # BLIP's init_tokenizer: the decoder's [DEC] and the encoder's [ENC] (ids 30522, 30523; unused by the score).
        self.tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
        self.vision, self.text = _build(vision, text, med_config, self.dtype, str(folder))
        # ImageReward's MLP is improved-aesthetic-predictor's layer stack (ImageReward.py: "Based on ...
        # improved-aesthetic-predictor"), on the BERT's 768-dim [CLS] state.
        self.head = AestheticHead(self.text.config.hidden_size)
        try:
            self.head.load_state_dict(head)
        except RuntimeError as exc:
            raise ValueError(f"pretrained_model_name_or_path {str(folder)!r}: the MLP head: {exc}") from None
        self.freeze()
        self.image_size = int(self.vision.config.image_size)
        self.video_frames = video_frames
        self.batch_size = batch_size

    def __call__(self, batch: RewardBatch) -> Tensor:
        return score_images(batch, self.media_types, self.name, self.video_frames, self.batch_size, self._score)

    def preprocess(self, image: Tensor) -> Tensor:
        """ImageReward's ``_transform`` of a uint8 (3, H, W) image: Pillow bicubic resize of the shorter edge, centre
        crop, to [0, 1], CLIP normalisation."""
        import numpy as np

        pil = resize_shorter_pil(to_pil([image])[0], self.image_size)
        x = torch.from_numpy(np.asarray(pil, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return normalise(center_crop(x, self.image_size))

    @torch.no_grad()
    def _score(self, images: list[Tensor], prompts: list[str]) -> Tensor:
        pixels = torch.stack([self.preprocess(x) for x in images]).to(self.device, self.dtype)
        text = self.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=MAX_LENGTH,
                              return_tensors="pt").to(self.device)
        image_embeds = self.vision(pixel_values=pixels).last_hidden_state
        image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=self.device)
        out = self.text(input_ids=text["input_ids"], attention_mask=text["attention_mask"],
                        encoder_hidden_states=image_embeds, encoder_attention_mask=image_atts, is_decoder=False)
        rewards = self.head(out.last_hidden_state[:, 0, :].float()).squeeze(1)
        return (rewards - MEAN) / STD


def _build(vision: dict, text: dict, med_config: dict, dtype: torch.dtype, folder: str):
    """``BlipVisionModel`` (sizes read from the weights) and ``BlipTextModel`` (sizes from ``med_config.json``)."""
    from transformers import BlipTextConfig, BlipVisionConfig
    from transformers.models.blip.modeling_blip import BlipVisionModel
    from transformers.models.blip.modeling_blip_text import BlipTextModel

    try:
        width = vision["embeddings.class_embedding"].shape[-1]
        patch = vision["embeddings.patch_embedding.weight"].shape[-1]
        grid = math.isqrt(vision["embeddings.position_embedding"].shape[1] - 1)
        depth = len({k.split(".")[2] for k in vision if k.startswith("encoder.layers.")})
        vision_config = BlipVisionConfig(
            hidden_size=width, intermediate_size=vision["encoder.layers.0.mlp.fc1.weight"].shape[0],
            num_hidden_layers=depth, num_attention_heads=max(1, width // 64), image_size=grid * patch,
            patch_size=patch, layer_norm_eps=1e-6, hidden_act="gelu",  # vit.py: LayerNorm(eps=1e-6), nn.GELU
        )
    except KeyError as exc:
        raise ValueError(f"pretrained_model_name_or_path {folder!r}: ImageReward.pt lacks the ViT's {exc}") from None
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "max_position_embeddings", "hidden_act", "layer_norm_eps", "pad_token_id")
    # BLIP_Pretrain sets encoder_config.encoder_width = vision_width: the cross-attention reads the ViT's tokens.
    text_config = BlipTextConfig(**{k: med_config[k] for k in fields if k in med_config},
                                 encoder_hidden_size=width, is_decoder=True)  # is_decoder: build the cross-attention
    models = []
    for cls, config, state, kwargs in ((BlipVisionModel, vision_config, vision, {}),
                                       (BlipTextModel, text_config, text, {"add_pooling_layer": False})):
        try:
            model, info = cls.from_pretrained(None, config=config, state_dict=state, dtype=dtype,
                                              output_loading_info=True, **kwargs)
        except RuntimeError as exc:  # shapes that do not match
            raise ValueError(f"pretrained_model_name_or_path {folder!r}: {cls.__name__}: {exc}") from None
        wrong = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
        if wrong:
            raise ValueError(f"pretrained_model_name_or_path {folder!r}: ImageReward.pt does not fit "
                             f"{cls.__name__} ({'med_config.json' if cls is BlipTextModel else 'ViT'}): {wrong}")
        models.append(model)
    return models
