"""hps on a tiny random open_clip checkpoint (written key by key, ``ff_core.testing.tiny_rewards``), against a
transcription of the code ``hpsv2`` runs: open_clip's ``CLIP.encode_image`` / ``encode_text`` with its
``ResidualAttentionBlock`` (torch's own ``nn.MultiheadAttention`` on the packed weights), ``hpsv2/img_score.py``'s
score and ``preprocess_val`` (torchvision's tensor ``Resize`` / ``CenterCrop``, transcribed from torchvision 0.28).
Neither package imports here (both need torchvision)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from ff_core.errors import ConfigError
from ff_core.objectives.rewards import Rewards
from ff_core.rewards import RewardBatch
from ff_core.rewards.hps import HpsReward, open_clip_to_transformers
from ff_core.testing.tiny_rewards import CLIP_MEAN, CLIP_STD, build_tiny_hps

PROMPTS = ["a red circle", "a green square on a white background", "blue " * 30]  # the last one is truncated


@pytest.fixture(scope="module")
def hps(tmp_path_factory):
    return build_tiny_hps(tmp_path_factory.mktemp("hps"), seed=3)


# --- open_clip (hpsv2/src/open_clip/transformer.py, model.py), for a state dict `sd` and its head counts ---------


def resblock(sd, p, x, heads, attn_mask=None):
    """``ResidualAttentionBlock.forward`` (LND): x + attn(ln_1(x)); x + mlp(ln_2(x)), mlp = c_fc, GELU, c_proj."""
    width = x.shape[-1]
    attn = nn.MultiheadAttention(width, heads)
    attn.load_state_dict({"in_proj_weight": sd[p + "attn.in_proj_weight"], "in_proj_bias": sd[p + "attn.in_proj_bias"],
                          "out_proj.weight": sd[p + "attn.out_proj.weight"],
                          "out_proj.bias": sd[p + "attn.out_proj.bias"]})  # fmt: skip
    ln_1 = F.layer_norm(x, (width,), sd[p + "ln_1.weight"], sd[p + "ln_1.bias"])
    x = x + attn(ln_1, ln_1, ln_1, need_weights=False, attn_mask=attn_mask)[0]
    h = F.layer_norm(x, (width,), sd[p + "ln_2.weight"], sd[p + "ln_2.bias"])
    h = F.linear(F.gelu(F.linear(h, sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"])),
                 sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"])
    return x + h


def encode_image(sd, image, heads, layers):
    """``VisionTransformer.forward`` (conv1 patches, class token, positional embedding, ln_pre, transformer, ln_post on
    the class token, ``@ proj``), then ``CLIP.encode_image(normalize=True)``."""
    x = F.conv2d(image, sd["visual.conv1.weight"], stride=sd["visual.conv1.weight"].shape[-1])
    x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
    cls = sd["visual.class_embedding"] + torch.zeros(x.shape[0], 1, x.shape[-1])
    x = torch.cat([cls, x], dim=1) + sd["visual.positional_embedding"]
    x = F.layer_norm(x, x.shape[-1:], sd["visual.ln_pre.weight"], sd["visual.ln_pre.bias"])
    x = x.permute(1, 0, 2)  # NLD -> LND
    for i in range(layers):
        x = resblock(sd, f"visual.transformer.resblocks.{i}.", x, heads)
    x = x.permute(1, 0, 2)
    pooled = F.layer_norm(x[:, 0], x.shape[-1:], sd["visual.ln_post.weight"], sd["visual.ln_post.bias"])
    return F.normalize(pooled @ sd["visual.proj"], dim=-1)


def encode_text(sd, text, heads, layers):
    """``CLIP.encode_text(normalize=True)``: causal mask (``build_attention_mask``: -inf above the diagonal), ln_final,
    the end-of-text token's state (``text.argmax(dim=-1)``: the highest id) ``@ text_projection``."""
    x = sd["token_embedding.weight"][text] + sd["positional_embedding"]
    n = text.shape[1]
    mask = torch.empty(n, n).fill_(float("-inf")).triu_(1)
    x = x.permute(1, 0, 2)
    for i in range(layers):
        x = resblock(sd, f"transformer.resblocks.{i}.", x, heads, attn_mask=mask)
    x = x.permute(1, 0, 2)
    x = F.layer_norm(x, x.shape[-1:], sd["ln_final.weight"], sd["ln_final.bias"])
    x = x[torch.arange(x.shape[0]), text.argmax(dim=-1)] @ sd["text_projection"]
    return F.normalize(x, dim=-1)


def tokenize(tokenizer, texts, context_length):
    """open_clip ``tokenizer.tokenize``: [sot] + tokens + [eot], truncated to the context with eot kept last,
    zero-padded (here with the test BPE vocabulary)."""
    sot, eot = tokenizer.bos_token_id, tokenizer.eos_token_id
    result = torch.zeros(len(texts), context_length, dtype=torch.long)
    for i, text in enumerate(texts):
        tokens = [sot] + tokenizer(text, add_special_tokens=False)["input_ids"] + [eot]
        if len(tokens) > context_length:
            tokens = tokens[:context_length]  # Truncate
            tokens[-1] = eot
        result[i, :len(tokens)] = torch.tensor(tokens)
    return result


def preprocess_val(image_uint8, image_size):
    """hpsv2 ``image_transform(is_train=False)``: ToTensor, Resize(image_size, BICUBIC), CenterCrop, Normalize. The
    Resize of a tensor is torchvision's ``_compute_resized_output_size`` + ``_functional_tensor.resize``
    (``interpolate(bicubic, align_corners=False, antialias=True)``); CenterCrop's offsets ``int(round(d / 2.0))``."""
    img = image_uint8.float() / 255  # ToTensor
    h, w = img.shape[-2:]
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = image_size, int(image_size * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    if [h, w] != [new_h, new_w]:
        img = F.interpolate(img[None], size=[new_h, new_w], mode="bicubic", align_corners=False, antialias=True)[0]
    top, left = int(round((new_h - image_size) / 2.0)), int(round((new_w - image_size) / 2.0))
    img = img[:, top:top + image_size, left:left + image_size]
    return (img - torch.tensor(CLIP_MEAN)[:, None, None]) / torch.tensor(CLIP_STD)[:, None, None]


def hpsv2_score(sd, config, tokenizer, image_uint8, prompt):
    """``hpsv2/img_score.py`` ``score``: ``image_features @ text_features.T``, its diagonal."""
    v, t = config.vision_config, config.text_config
    image = preprocess_val(image_uint8, v.image_size)[None]
    text = tokenize(tokenizer, [prompt], t.max_position_embeddings)
    with torch.no_grad():
        image_features = encode_image(sd, image, v.num_attention_heads, v.num_hidden_layers)
        text_features = encode_text(sd, text, t.num_attention_heads, t.num_hidden_layers)
        return torch.diagonal(image_features @ text_features.T)[0]


def reference(hps, media, prompts):
    from transformers import AutoTokenizer, CLIPConfig

    folder, checkpoint = hps
    sd = torch.load(checkpoint)["state_dict"]
    config, tokenizer = CLIPConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    return torch.stack([hpsv2_score(sd, config, tokenizer, x, p) for x, p in zip(media, prompts)])


def images(sizes, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (3, *hw), dtype=torch.uint8, generator=gen) for hw in sizes]


def batch(media, prompts):
    return RewardBatch(media=[[x] for x in media], prompts=list(prompts), metadata=[{}] * len(media))


# (19, 16) and (16, 23) crop 3 and 7 rows / columns: offsets round(1.5) = 2 and round(3.5) = 4, not the floor.
@pytest.mark.parametrize("sizes", [[(16, 16)] * 3, [(32, 32)] * 3, [(21, 30), (19, 16), (16, 23)]],
                         ids=["as-is", "resized", "resized-and-cropped"])
def test_hps_matches_hpsv2s_open_clip_scoring(hps, sizes):
    folder, checkpoint = hps
    media = images(sizes)
    rewards = Rewards([{"name": "hps", "args": {"pretrained_model_name_or_path": str(folder),
                                                "checkpoint": str(checkpoint), "batch_size": 2}}])
    out = rewards(batch(media, PROMPTS)).total
    assert_close(out, reference(hps, media, PROMPTS), atol=2e-5, rtol=1e-5)
    assert out.abs().max() <= 1 and out.std() > 0


def test_a_converted_folder_scores_the_same(hps, tmp_path):
    """Without ``checkpoint`` the folder's CLIPModel is the HPS model (converted once, saved with save_pretrained)."""
    from transformers import AutoTokenizer, CLIPConfig, CLIPModel

    folder, checkpoint = hps
    config = CLIPConfig.from_pretrained(folder)
    state = open_clip_to_transformers(torch.load(checkpoint)["state_dict"])
    CLIPModel.from_pretrained(None, config=config, state_dict=state).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(folder).save_pretrained(tmp_path)
    media = images([(32, 32)] * 2)
    out = HpsReward(str(tmp_path))(batch(media, PROMPTS[:2]))
    assert_close(out, HpsReward(str(folder), str(checkpoint))(batch(media, PROMPTS[:2])), atol=1e-6, rtol=0)


def test_conversion_splits_the_packed_attention_and_transposes_projections():
    w = torch.arange(12.0).reshape(6, 2)
    out = open_clip_to_transformers({"module.visual.transformer.resblocks.3.attn.in_proj_weight": w,
                                     "text_projection": torch.ones(4, 2)})  # fmt: skip
    assert_close(out["vision_model.encoder.layers.3.self_attn.q_proj.weight"], w[:2])
    assert_close(out["vision_model.encoder.layers.3.self_attn.v_proj.weight"], w[4:])
    assert out["text_projection.weight"].shape == (2, 4)
    with pytest.raises(ValueError, match="unknown keys visual.attn_pool.q"):
        open_clip_to_transformers({"visual.attn_pool.q": w})


def test_hps_errors_name_the_key(hps, tmp_path):
    from transformers import CLIPConfig

    folder, checkpoint = hps
    with pytest.raises(ConfigError, match=r"reward 'hps': checkpoint .*nope.pt"):
        Rewards([{"name": "hps", "args": {"pretrained_model_name_or_path": str(folder),
                                          "checkpoint": str(tmp_path / "nope.pt")}}])
    config = CLIPConfig.from_pretrained(folder)
    config.text_config.hidden_act = "quick_gelu"  # an OpenAI CLIP config
    config.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"text_config.hidden_act is 'quick_gelu'"):
        Rewards([{"name": "hps", "args": {"pretrained_model_name_or_path": str(tmp_path),
                                          "checkpoint": str(checkpoint)}}])
    assert math.isfinite(HpsReward(str(folder), str(checkpoint))(batch(images([(16, 16)]), ["a"])).item())
