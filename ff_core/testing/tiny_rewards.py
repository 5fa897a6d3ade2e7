"""Tiny random reward models saved as their real checkpoints are, built offline in a second: a CLIP folder
(PickScore, the aesthetic predictor's CLIP), the aesthetic MLP head, an HPS open_clip checkpoint with its CLIP config
and tokenizer, and an ImageReward folder (``ImageReward.pt``, ``med_config.json``, a BERT tokenizer).

The CLIP folder is transformers' ``CLIPModel`` + ``CLIPProcessor`` written by ``save_pretrained``. The open_clip and
BLIP checkpoints cannot come from their own classes (open_clip and ImageReward need torchvision, which does not
import beside ff's torch): their state dicts are written key by key with the names and shapes of open_clip's
``CLIP`` (``open_clip/model.py``, ``transformer.py``) and ImageReward's ``BLIP_Pretrain`` (``models/BLIP/vit.py``,
``med.py``) and ``MLP``, random values everywhere (LayerNorm scales included), so a wrong mapping changes scores.

Example::

    from ff_core.testing.tiny_rewards import build_tiny_clip, build_tiny_hps, build_tiny_image_reward

    clip = build_tiny_clip(tmp / "clip")
    hps_folder, hps_checkpoint = build_tiny_hps(tmp / "hps")
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from ff_core.testing.tiny import WORDS, build_clip_tokenizer

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def tiny_clip_config(tokenizer, hidden_act: str = "quick_gelu", image_size: int = 16, max_length: int = 16):
    """A 1-layer CLIP (16-dim towers, 8-dim projection, ``image_size`` pixels in 8-pixel patches) for ``tokenizer``."""
    from transformers import CLIPConfig

    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    tower = dict(hidden_size=16, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 hidden_act=hidden_act)
    return CLIPConfig(text_config=dict(vocab_size=len(tokenizer), max_position_embeddings=max_length, **tower, **ids),
                      vision_config=dict(image_size=image_size, patch_size=8, **tower), projection_dim=8)


def build_tiny_clip(folder: str | Path, seed: int = 0, image_size: int = 16) -> Path:
    """A random ``CLIPModel`` and its ``CLIPProcessor`` (test CLIP tokenizer, 16-token prompts; shorter edge resized
    to ``image_size``, centre-cropped, OpenAI normalisation), saved with ``save_pretrained`` into ``folder``."""
    from transformers import CLIPImageProcessor, CLIPModel, CLIPProcessor

    folder = Path(folder)
    tokenizer = build_clip_tokenizer(max_length=16)
    torch.manual_seed(seed)
    model = CLIPModel(tiny_clip_config(tokenizer, image_size=image_size))
    with torch.no_grad():
        model.logit_scale.fill_(4.6052)  # log(100): PickScore_v1's (and CLIP's) trained temperature
    processor = CLIPProcessor(tokenizer=tokenizer, image_processor=CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
        image_mean=CLIP_MEAN, image_std=CLIP_STD))
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def write_aesthetic_head(path: str | Path, input_size: int = 8, seed: int = 0) -> Path:
    """A random improved-aesthetic-predictor MLP (keys ``layers.N.weight``) on ``input_size``-dim embeddings, saved
    as ``.safetensors`` or, for any other suffix, ``torch.save`` (the original ``.pth``)."""
    from ff_core.rewards.aesthetic import AestheticHead

    path = Path(path)
    torch.manual_seed(seed)
    head = AestheticHead(input_size)
    state = {k: v.contiguous() for k, v in head.state_dict().items()}
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path))
    else:
        torch.save(state, path)
    return path


def _randn(gen: torch.Generator, *shape: int, scale: float = 0.2, offset: float = 0.0) -> Tensor:
    return offset + scale * torch.randn(*shape, generator=gen)


def _linear(gen: torch.Generator, name: str, fan_out: int, fan_in: int, scale: float = 0.2) -> dict[str, Tensor]:
    return {f"{name}.weight": _randn(gen, fan_out, fan_in, scale=scale), f"{name}.bias": _randn(gen, fan_out)}


def _norm(gen: torch.Generator, name: str, dim: int) -> dict[str, Tensor]:
    """A LayerNorm with a random scale around 1 and a random shift."""
    return {f"{name}.weight": _randn(gen, dim, offset=1), f"{name}.bias": _randn(gen, dim)}


def _resblocks(gen: torch.Generator, prefix: str, width: int, layers: int, mlp: int) -> dict[str, Tensor]:
    """open_clip ``Transformer.resblocks`` (``ResidualAttentionBlock``: ln_1, nn.MultiheadAttention, ln_2, mlp)."""
    out = {}
    for i in range(layers):
        p = f"{prefix}transformer.resblocks.{i}."
        out |= {**_norm(gen, p + "ln_1", width), p + "attn.in_proj_weight": _randn(gen, 3 * width, width),
                p + "attn.in_proj_bias": _randn(gen, 3 * width),
                **_linear(gen, p + "attn.out_proj", width, width), **_norm(gen, p + "ln_2", width),
                **_linear(gen, p + "mlp.c_fc", mlp, width), **_linear(gen, p + "mlp.c_proj", width, mlp)}  # fmt: skip
    return out


def open_clip_state_dict(config, seed: int = 0) -> dict[str, Tensor]:
    """A random open_clip ``CLIP`` state dict (ViT image tower, text tower in the model) of ``config``'s sizes."""
    gen = torch.Generator().manual_seed(seed)
    v, t = config.vision_config, config.text_config
    w, e = v.hidden_size, config.projection_dim
    grid = v.image_size // v.patch_size
    state = {"visual.conv1.weight": _randn(gen, w, 3, v.patch_size, v.patch_size),
             "visual.class_embedding": _randn(gen, w), "visual.positional_embedding": _randn(gen, grid * grid + 1, w),
             **_norm(gen, "visual.ln_pre", w),
             **_resblocks(gen, "visual.", w, v.num_hidden_layers, v.intermediate_size),
             **_norm(gen, "visual.ln_post", w),
             "visual.proj": _randn(gen, w, e),
             "token_embedding.weight": _randn(gen, t.vocab_size, t.hidden_size),
             "positional_embedding": _randn(gen, t.max_position_embeddings, t.hidden_size),
             **_resblocks(gen, "", t.hidden_size, t.num_hidden_layers, t.intermediate_size),
             **_norm(gen, "ln_final", t.hidden_size),
             "text_projection": _randn(gen, t.hidden_size, e), "logit_scale": torch.tensor(4.6052)}  # fmt: skip
    return state


def build_tiny_hps(folder: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """A tiny HPS: ``folder`` holds a GELU CLIP config and tokenizer (as laion's CLIP-ViT-H-14 folder does), and
    ``folder/HPS_tiny.pt`` the open_clip checkpoint (``{"state_dict": ...}``, as ``HPS_v2.1_compressed.pt``)."""
    folder = Path(folder)
    tokenizer = build_clip_tokenizer(max_length=16)
    config = tiny_clip_config(tokenizer, hidden_act="gelu")
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    checkpoint = folder / "HPS_tiny.pt"
    torch.save({"state_dict": open_clip_state_dict(config, seed)}, checkpoint)
    return folder, checkpoint


def write_bert_tokenizer(folder: str | Path, words: tuple[str, ...] = WORDS) -> int:
    """An uncased WordPiece vocabulary (``vocab.txt``): BERT's special tokens, ``words``, and every letter and digit
    alone and as a ``##`` continuation, so any lower-case text tokenizes. Returns the vocabulary size."""
    letters = "abcdefghijklmnopqrstuvwxyz0123456789"
    vocab = list(dict.fromkeys([*BERT_SPECIALS, *words, *letters, *(f"##{c}" for c in letters), ".", ",", "'"]))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    config = {"do_lower_case": True, "tokenizer_class": "BertTokenizer"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return len(vocab)


def image_reward_state_dict(med_config: dict, vision_width: int = 64, image_size: int = 32, patch: int = 16,
                            seed: int = 0) -> dict[str, Tensor]:
    """A random ImageReward state dict: ``blip.visual_encoder`` (BLIP's timm ViT, one block, 64-channel heads),
    ``blip.text_encoder`` (med.py's BERT with cross-attention, sizes of ``med_config``), ``blip.vision_proj`` /
    ``text_proj`` and the ``mlp`` head."""
    gen = torch.Generator().manual_seed(seed)
    w, n = vision_width, (image_size // patch) ** 2 + 1
    p = "blip.visual_encoder."
    state = {p + "cls_token": _randn(gen, 1, 1, w), p + "pos_embed": _randn(gen, 1, n, w),
             **_linear(gen, p + "patch_embed.proj", w, 3 * patch * patch, scale=0.05), **_norm(gen, p + "norm", w)}
    state[p + "patch_embed.proj.weight"] = state[p + "patch_embed.proj.weight"].reshape(w, 3, patch, patch)
    b = p + "blocks.0."
    state |= {**_norm(gen, b + "norm1", w), **_linear(gen, b + "attn.qkv", 3 * w, w),
              **_linear(gen, b + "attn.proj", w, w), **_norm(gen, b + "norm2", w),
              **_linear(gen, b + "mlp.fc1", 4 * w, w), **_linear(gen, b + "mlp.fc2", w, 4 * w)}
    h, inter = med_config["hidden_size"], med_config["intermediate_size"]
    positions = med_config["max_position_embeddings"]
    t = "blip.text_encoder."
    state |= {t + "embeddings.word_embeddings.weight": _randn(gen, med_config["vocab_size"], h),
              t + "embeddings.position_embeddings.weight": _randn(gen, positions, h),
              **_norm(gen, t + "embeddings.LayerNorm", h),
              t + "embeddings.position_ids": torch.arange(positions)[None]}  # a persistent buffer in old transformers
    for i in range(med_config["num_hidden_layers"]):
        layer = f"{t}encoder.layer.{i}."
        for attn, kv_width in ((layer + "attention.", h), (layer + "crossattention.", w)):
            state |= {**_linear(gen, attn + "self.query", h, h), **_linear(gen, attn + "self.key", h, kv_width),
                      **_linear(gen, attn + "self.value", h, kv_width), **_linear(gen, attn + "output.dense", h, h),
                      **_norm(gen, attn + "output.LayerNorm", h)}
        state |= {**_linear(gen, layer + "intermediate.dense", inter, h),
                  **_linear(gen, layer + "output.dense", h, inter), **_norm(gen, layer + "output.LayerNorm", h)}
    state |= {**_linear(gen, "blip.vision_proj", 8, w), **_linear(gen, "blip.text_proj", 8, h)}
    sizes = (h, 1024, 128, 64, 16, 1)
    for index, (fan_in, fan_out) in zip((0, 2, 4, 6, 7), zip(sizes, sizes[1:])):
        state |= _linear(gen, f"mlp.layers.{index}", fan_out, fan_in, scale=fan_in**-0.5)
    return state


def build_tiny_image_reward(folder: str | Path, seed: int = 0) -> Path:
    """A tiny ImageReward folder: ``ImageReward.pt`` (a 64-wide 1-block ViT at 32 pixels in 16-pixel patches, a 1-layer
    32-wide BERT), ``med_config.json`` (BLIP's keys) and the BERT tokenizer (``vocab.txt`` plus [DEC] and [ENC])."""
    folder = Path(folder)
    vocab_size = write_bert_tokenizer(folder) + 2  # BLIP's init_tokenizer adds [DEC] and [ENC]
    med_config = {"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
                  "hidden_dropout_prob": 0.1, "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64,
                  "layer_norm_eps": 1e-12, "max_position_embeddings": 40, "model_type": "bert",
                  "num_attention_heads": 2, "num_hidden_layers": 1, "pad_token_id": 0, "type_vocab_size": 2,
                  "vocab_size": vocab_size, "encoder_width": 64, "add_cross_attention": True}  # fmt: skip
    (folder / "med_config.json").write_text(json.dumps(med_config, indent=2))
    torch.save(image_reward_state_dict(med_config, seed=seed), folder / "ImageReward.pt")
    return folder
