"""HPS v2 / v2.1 (Wu et al. 2023, "Human Preference Score v2"): open_clip's ViT-H-14 fine-tuned on HPD v2 preferences.

The reference is the ``hpsv2`` package's ``hpsv2/img_score.py`` (github.com/tgxs002/HPSv2)::

    model, _, preprocess_val = create_model_and_transforms('ViT-H-14', 'laion2B-s32B-b79K', precision='amp', ...)
    model.load_state_dict(torch.load(cp)['state_dict'])        # HPS_v2_compressed.pt / HPS_v2.1_compressed.pt
    image = preprocess_val(pil_image)                          # ToTensor, Resize(224, bicubic), CenterCrop(224),
                                                               # Normalize(OpenAI CLIP mean / std)
    outputs = model(image, tokenizer([prompt]))                # L2-normalised image and text features
    hps_score = torch.diagonal(outputs["image_features"] @ outputs["text_features"].T)

``hpsv2`` and ``open_clip_torch`` are not used: both need torchvision, whose PyPI wheels do not import beside ff's
CPU torch build (``operator torchvision::nms does not exist``), and ``hpsv2`` pins ``pytest==7.2.0`` and
``protobuf<4``. open_clip's ViT-H-14 is the architecture of transformers' ``CLIPModel`` (pre-norm blocks with GELU,
class-token pooling after ``ln_post``, text pooled at the end-of-text token after ``ln_final``, bias-free
projections), so the checkpoint is converted key by key (:func:`open_clip_to_transformers`) and run by
``CLIPModel``; the preprocessing is ``preprocess_val`` on the tensor (:mod:`ff_core.rewards.media`). Prompts go
through the folder's Hugging Face CLIP tokenizer: the same BPE vocabulary and 77-token truncation as open_clip's
``SimpleTokenizer``, which in addition runs ``ftfy.fix_text`` and HTML unescaping (the same tokens for plain
prompts).
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from ff_core.rewards.base import RewardBatch
from ff_core.rewards.media import IMAGE_OR_VIDEO, center_crop, normalise, resize_shorter_tensor, score_images
from ff_core.rewards.models import ModelReward, from_pretrained, load_state_dict, projected

_TOP_LEVEL = {
    "logit_scale": "logit_scale",
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "ln_final.weight": "text_model.final_layer_norm.weight",
    "ln_final.bias": "text_model.final_layer_norm.bias",
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",
    "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
    "visual.ln_post.weight": "vision_model.post_layernorm.weight",
    "visual.ln_post.bias": "vision_model.post_layernorm.bias",
}
_TRANSPOSED = {"text_projection": "text_projection.weight", "visual.proj": "visual_projection.weight"}
_BLOCK = re.compile(r"(visual\.)?transformer\.resblocks\.(\d+)\.(.+)")
_IN_BLOCK = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2",
             "attn.out_proj": "self_attn.out_proj"}  # fmt: skip


def open_clip_to_transformers(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """An open_clip ``CLIP`` state dict (ViT image tower, the text tower in the model itself: ViT-B/L/H/g) as
    transformers' ``CLIPModel`` names it.

    ``x @ proj`` projections become ``Linear`` weights (transposed); ``nn.MultiheadAttention``'s packed
    ``in_proj_weight`` / ``in_proj_bias`` split into ``q_proj``, ``k_proj``, ``v_proj`` (that order: its
    ``_in_projection_packed``). A ``module.`` prefix (a DDP checkpoint) is dropped; any other key is an error naming it.
    """
    out: dict[str, Tensor] = {}
    unknown = []
    for key, value in state_dict.items():
        key = key.removeprefix("module.")
        if key in _TOP_LEVEL:
            out[_TOP_LEVEL[key]] = value
        elif key in _TRANSPOSED:
            out[_TRANSPOSED[key]] = value.t().contiguous()
        elif (match := _BLOCK.fullmatch(key)) is not None:
            tower = "vision_model" if match[1] else "text_model"
            prefix, rest = f"{tower}.encoder.layers.{match[2]}.", match[3]
            if rest in ("attn.in_proj_weight", "attn.in_proj_bias"):
                kind = rest.rsplit("_", 1)[1]
                for name, part in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3)):
                    out[f"{prefix}self_attn.{name}.{kind}"] = part.contiguous()
                continue
            module, _, param = rest.rpartition(".")
            if module not in _IN_BLOCK:
                unknown.append(key)
                continue
            out[f"{prefix}{_IN_BLOCK[module]}.{param}"] = value
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"not an open_clip ViT CLIP state dict: unknown keys {', '.join(unknown[:5])}"
                         + (f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else ""))
    return out


class HpsReward(ModelReward):
    """HPS v2 / v2.1 of each image and its prompt: the cosine similarity of the HPS model's image and text features,
    in [-1, 1] (generated images score about 0.2 to 0.35).

    ``pretrained_model_name_or_path`` is a transformers CLIP ViT-H-14 folder (``config.json`` and tokenizer, e.g.
    ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``, the model HPS was fine-tuned from) and ``checkpoint`` the HPS open_clip
    checkpoint (``HPS_v2.1_compressed.pt`` or ``HPS_v2_compressed.pt`` from ``xswu/HPSv2``; its ``state_dict``),
    converted on load. Without ``checkpoint`` the folder's weights are taken as they are: an HPS model already
    converted to ``CLIPModel`` (e.g. ``adams-story/HPSv2-hf``, HPS v2.0). A video scores its middle frame, or the mean
    over ``video_frames`` evenly spaced frames.

    Args:
        pretrained_model_name_or_path: CLIP ViT-H-14 folder (or hub id): config and tokenizer (and the weights when
            ``checkpoint`` is ``None``).
        checkpoint: the HPS open_clip checkpoint (``.pt``, or ``.safetensors`` of the same keys); ``None``: the
            folder's ``CLIPModel`` weights.
        video_frames: frames scored per video (1: the middle one; more: evenly spaced, scores averaged).
        batch_size: images per forward pass.
        dtype: weights' dtype (``float32``, ``bfloat16``, ``float16``; hpsv2 runs fp16 autocast on CUDA).
    """

    name = "hps"
    media_types = IMAGE_OR_VIDEO

    def __init__(
        self,
        pretrained_model_name_or_path: str,
        checkpoint: str | None = None,
        video_frames: int = 1,
        batch_size: int = 32,
        dtype: str = "float32",
    ) -> None:
        from transformers import AutoTokenizer, CLIPConfig, CLIPModel

        super().__init__(dtype, batch_size=batch_size, video_frames=video_frames)
        path = pretrained_model_name_or_path
        config = from_pretrained(CLIPConfig, path)
        self.tokenizer = from_pretrained(AutoTokenizer, path)
        if checkpoint is None:
            self.model = from_pretrained(CLIPModel, path, dtype=self.dtype)
        else:
            self.model = _load_converted(config, checkpoint, self.dtype, path)
        self.freeze()
        self.image_size = int(config.vision_config.image_size)
        self.max_length = int(config.text_config.max_position_embeddings)
        self.video_frames = video_frames
        self.batch_size = batch_size

    def __call__(self, batch: RewardBatch) -> Tensor:
        return score_images(batch, self.media_types, self.name, self.video_frames, self.batch_size, self._score)

    def preprocess(self, image: Tensor) -> Tensor:
        """hpsv2's ``preprocess_val`` of a uint8 (3, H, W) image: to [0, 1], shorter edge to the model's size
        (bicubic, antialiased), centre crop, OpenAI CLIP normalisation."""
        x = resize_shorter_tensor(image.float() / 255.0, self.image_size)
        return normalise(center_crop(x, self.image_size))

    @torch.no_grad()
    def _score(self, images: list[Tensor], prompts: list[str]) -> Tensor:
        pixels = torch.stack([self.preprocess(x.to(self.device)) for x in images]).to(self.dtype)
        text = self.tokenizer(list(prompts), padding=True, truncation=True, max_length=self.max_length,
                              return_tensors="pt").to(self.device)
        image_features = projected(self.model.get_image_features(pixel_values=pixels)).float()
        text_features = projected(self.model.get_text_features(**text)).float()
        image_features = torch.nn.functional.normalize(image_features, dim=-1)
        text_features = torch.nn.functional.normalize(text_features, dim=-1)
        return (image_features * text_features).sum(-1)  # the diagonal of image_features @ text_features.T


def _load_converted(config, checkpoint: str, dtype: torch.dtype, folder: str):
    """``CLIPModel`` of ``config`` with the converted open_clip ``checkpoint``; errors name the argument at fault."""
    from transformers import CLIPModel

    for tower in ("text_config", "vision_config"):
        act = getattr(config, tower).hidden_act
        if act != "gelu":  # open_clip's ViT-H-14 (hence HPS) uses nn.GELU; OpenAI's CLIPs use QuickGELU
            raise ValueError(f"pretrained_model_name_or_path {folder!r}: {tower}.hidden_act is {act!r}; HPS's "
                             "open_clip ViT-H-14 uses 'gelu' (is this the laion CLIP-ViT-H-14 config?)")
    try:
        state = load_state_dict(checkpoint)
        state = open_clip_to_transformers(state.get("state_dict", state))
    except (OSError, RuntimeError, ValueError) as exc:
        raise ValueError(f"checkpoint {checkpoint!r}: {exc}") from None
    try:
        model, info = CLIPModel.from_pretrained(None, config=config, state_dict=state, dtype=dtype,
                                                output_loading_info=True)
    except RuntimeError as exc:  # shapes that do not match the config
        raise ValueError(f"checkpoint {checkpoint!r} does not fit the config of {folder!r}: {exc}") from None
    wrong = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    if wrong or info.get("error_msgs"):
        raise ValueError(f"checkpoint {checkpoint!r} does not fit the config of {folder!r}: "
                         f"{wrong or info['error_msgs']}")
    return model
