"""image_reward on a tiny random ImageReward checkpoint (written key by key, ``ff_core.testing.tiny_rewards``), against
a transcription of the code the ``image-reward`` package runs (github.com/THUDM/ImageReward, ``ImageReward/``):
``ImageReward.score`` and ``_transform`` (``ImageReward.py``), BLIP's ViT (``models/BLIP/vit.py``: ``Attention``,
``Block``, ``VisionTransformer.forward``) and its BERT in ``mode='multimodal'`` (``models/BLIP/med.py``:
``BertEmbeddings``, ``BertSelfAttention``, ``BertSelfOutput``, ``BertLayer``, the -10000 padding mask). The package
does not import here (torchvision, timm, fairscale)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch.testing import assert_close

from ff_core.errors import ConfigError
from ff_core.objectives.rewards import Rewards
from ff_core.rewards import RewardBatch
from ff_core.rewards.image_reward import ImageRewardReward
from ff_core.testing.tiny_rewards import CLIP_MEAN, CLIP_STD, build_tiny_image_reward

PROMPTS = ["a red circle", "a green square on a white background", "blue " * 40]  # the last one is truncated


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_image_reward(tmp_path_factory.mktemp("image_reward"), seed=5)


def vit(sd, image, heads):
    """``VisionTransformer.forward``: patch_embed (conv with bias), cls token, pos_embed, blocks (pre-norm, LayerNorm
    eps 1e-6, GELU MLP), final norm; all tokens returned."""
    p = "blip.visual_encoder."
    w = sd[p + "patch_embed.proj.weight"]
    x = F.conv2d(image, w, sd[p + "patch_embed.proj.bias"], stride=w.shape[-1]).flatten(2).transpose(1, 2)
    x = torch.cat((sd[p + "cls_token"].expand(x.shape[0], -1, -1), x), dim=1)
    x = x + sd[p + "pos_embed"][:, :x.size(1), :]
    B, N, C = x.shape

    def norm(name, x):
        return F.layer_norm(x, (C,), sd[name + ".weight"], sd[name + ".bias"], eps=1e-6)

    i = 0
    while f"{p}blocks.{i}.norm1.weight" in sd:
        b = f"{p}blocks.{i}."
        qkv = F.linear(norm(b + "norm1", x), sd[b + "attn.qkv.weight"], sd[b + "attn.qkv.bias"])
        qkv = qkv.reshape(B, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = ((q @ k.transpose(-2, -1)) * (C // heads) ** -0.5).softmax(dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(B, N, C)
        x = x + F.linear(out, sd[b + "attn.proj.weight"], sd[b + "attn.proj.bias"])
        h = F.gelu(F.linear(norm(b + "norm2", x), sd[b + "mlp.fc1.weight"], sd[b + "mlp.fc1.bias"]))
        x = x + F.linear(h, sd[b + "mlp.fc2.weight"], sd[b + "mlp.fc2.bias"])
        i += 1
    return norm(p + "norm", x)


def bert_multimodal(sd, cfg, input_ids, attention_mask, encoder_hidden_states):
    """med.py ``BertModel.forward(mode='multimodal')``, not a decoder: embeddings (word + absolute position, LayerNorm),
    then per layer self-attention with the ``(1 - mask) * -10000`` padding mask, cross-attention to the image tokens
    (all attended: an all-ones mask inverts to 0), and the GELU feed-forward; post-norm residuals (BertSelfOutput,
    BertOutput)."""
    t = "blip.text_encoder."
    heads, eps = cfg["num_attention_heads"], cfg["layer_norm_eps"]

    def linear(name, x):
        return F.linear(x, sd[name + ".weight"], sd[name + ".bias"])

    def layer_norm(name, x):
        return F.layer_norm(x, x.shape[-1:], sd[name + ".weight"], sd[name + ".bias"], eps=eps)

    def attention(prefix, hidden, context, mask):
        def split(x):  # transpose_for_scores
            return x.view(*x.shape[:-1], heads, x.shape[-1] // heads).permute(0, 2, 1, 3)

        q, k, v = split(linear(prefix + "self.query", hidden)), split(linear(prefix + "self.key", context)), \
            split(linear(prefix + "self.value", context))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask
        ctx = (scores.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(hidden.shape)
        return layer_norm(prefix + "output.LayerNorm", linear(prefix + "output.dense", ctx) + hidden)

    L = input_ids.shape[1]
    x = sd[t + "embeddings.word_embeddings.weight"][input_ids] + sd[t + "embeddings.position_embeddings.weight"][:L]
    x = layer_norm(t + "embeddings.LayerNorm", x)
    mask = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0
    encoder_mask = (1.0 - torch.ones(encoder_hidden_states.shape[:2])[:, None, None, :]) * -10000.0
    for i in range(cfg["num_hidden_layers"]):
        layer = f"{t}encoder.layer.{i}."
        a = attention(layer + "attention.", x, x, mask)
        a = attention(layer + "crossattention.", a, encoder_hidden_states, encoder_mask)
        h = F.gelu(linear(layer + "intermediate.dense", a))
        x = layer_norm(layer + "output.LayerNorm", linear(layer + "output.dense", h) + a)
    return x


def transform(image_uint8, n_px):
    """``_transform(n_px)``: Resize(n_px, BICUBIC) and CenterCrop(n_px) on the PIL image (torchvision: Pillow's
    ``resize`` to the shorter edge, long edge ``int(n_px * long / short)``; crop offsets ``int(round(d / 2.0))``),
    RGB, ToTensor, Normalize(CLIP mean / std)."""
    pil = Image.fromarray(image_uint8.permute(1, 2, 0).numpy())
    w, h = pil.size
    short, long = (w, h) if w <= h else (h, w)
    new_w, new_h = (n_px, int(n_px * long / short)) if w <= h else (int(n_px * long / short), n_px)
    if (new_w, new_h) != (w, h):
        pil = pil.resize((new_w, new_h), Image.BICUBIC)
    top, left = int(round((new_h - n_px) / 2.0)), int(round((new_w - n_px) / 2.0))
    pil = pil.crop((left, top, left + n_px, top + n_px)).convert("RGB")
    x = torch.from_numpy(np.array(pil, dtype=np.float32) / 255).permute(2, 0, 1)
    return (x - torch.tensor(CLIP_MEAN)[:, None, None]) / torch.tensor(CLIP_STD)[:, None, None]


def image_reward_score(folder, prompt, image_uint8):
    """``ImageReward.score(prompt, image)`` with ``blip.tokenizer`` = BLIP's ``init_tokenizer`` on the folder's
    vocabulary and the ``mlp`` (improved-aesthetic-predictor's layer stack) on the [CLS] state."""
    import json

    from transformers import BertTokenizer

    sd = torch.load(folder / "ImageReward.pt")
    cfg = json.loads((folder / "med_config.json").read_text())
    tokenizer = BertTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    text_input = tokenizer(prompt, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    n_px = int(math.isqrt(sd["blip.visual_encoder.pos_embed"].shape[1] - 1)) * 16
    image = transform(image_uint8, n_px)[None]
    with torch.no_grad():
        image_embeds = vit(sd, image, heads=sd["blip.visual_encoder.cls_token"].shape[-1] // 64)
        text_output = bert_multimodal(sd, cfg, text_input.input_ids, text_input.attention_mask, image_embeds)
        x = text_output[:, 0, :].float()
        for i in (0, 2, 4, 6, 7):  # Linear, Dropout (identity in eval), ...
            x = F.linear(x, sd[f"mlp.layers.{i}.weight"], sd[f"mlp.layers.{i}.bias"])
        return ((x - 0.16717362830052426) / 1.0333394966054072)[0, 0]


def images(sizes, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (3, *hw), dtype=torch.uint8, generator=gen) for hw in sizes]


def batch(media, prompts, kind="image"):
    return RewardBatch(media=[[x] for x in media], prompts=list(prompts), metadata=[{}] * len(media),
                       output_types=(kind,))


# (35, 32) and (32, 39) crop 3 and 7 rows / columns: offsets round(1.5) = 2 and round(3.5) = 4, not the floor.
@pytest.mark.parametrize("sizes", [[(32, 32)] * 3, [(48, 40), (35, 32), (32, 39)]], ids=["as-is", "resized"])
def test_image_reward_matches_the_packages_scoring(folder, sizes):
    media = images(sizes)
    rewards = Rewards([{"name": "image_reward", "args": {"pretrained_model_name_or_path": str(folder),
                                                         "batch_size": 2}}])
    out = rewards(batch(media, PROMPTS)).total
    expected = torch.stack([image_reward_score(folder, p, x) for x, p in zip(media, PROMPTS)])
    assert_close(out, expected, atol=1e-5, rtol=0)  # the ViT's LayerNorm eps 1e-5 instead of 1e-6 is off by 7e-5
    assert out.std() > 0.01


def test_image_reward_scores_video_frames(folder):
    video = torch.stack(images([(32, 32)] * 4, seed=7))
    reward = ImageRewardReward(str(folder), tokenizer_name_or_path=str(folder), video_frames=2)
    per_frame = reward(batch(list(video), [PROMPTS[0]] * 4))
    assert_close(reward(batch([video], PROMPTS[:1], kind="video")), per_frame[[0, 3]].mean()[None])


def test_image_reward_errors_name_the_key(folder, tmp_path):
    with pytest.raises(ConfigError, match=r"reward 'image_reward': pretrained_model_name_or_path .*ImageReward.pt"):
        Rewards([{"name": "image_reward", "args": {"pretrained_model_name_or_path": str(tmp_path)}}])
    with pytest.raises(ConfigError, match=r"tokenizer_name_or_path .* holds no BERT tokenizer"):
        Rewards([{"name": "image_reward", "args": {"pretrained_model_name_or_path": str(folder),
                                                   "tokenizer_name_or_path": str(tmp_path / "none")}}])
