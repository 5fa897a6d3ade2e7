"""audio_loudness against hand-computed levels; clip_score with a tiny random CLIP saved to disk, against the same
model's embeddings computed by hand (preprocessing, pooling at the end token, projection, cosine)."""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image
from torch.testing import assert_close

from ff_core.errors import ConfigError
from ff_core.objectives.rewards import Rewards
from ff_core.rewards import RewardBatch
from ff_core.rewards.audio import AudioLoudnessReward, rms_dbfs

MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's normalisation (CLIP paper's preprocessing)
STD = (0.26862954, 0.26130258, 0.27577711)


def audio_batch(*waves) -> RewardBatch:
    return RewardBatch(media=[[w] for w in waves], prompts=[""] * len(waves), metadata=[{}] * len(waves),
                       output_types=("audio",), rates=(16000,))


def test_rms_dbfs_by_hand():
    # Constant 0.5 on 2 channels: RMS 0.5 -> 20 log10 0.5 = -6.0206 dB. Full-scale sine: RMS 1/sqrt 2 -> -3.0103.
    t = torch.arange(16000) / 16000
    sine = torch.sin(2 * math.pi * 440 * t)[None]
    assert_close(rms_dbfs(torch.full((2, 100), 0.5)), torch.tensor(20 * math.log10(0.5)))
    assert_close(rms_dbfs(sine), torch.tensor(-10 * math.log10(2)), atol=1e-3, rtol=0)
    assert rms_dbfs(torch.zeros(1, 10)).item() == -100.0
    # Two channels, one silent: mean square halves -> 3.01 dB quieter.
    assert_close(rms_dbfs(torch.stack([sine[0], torch.zeros(16000)])), torch.tensor(-10 * math.log10(4)),
                 atol=1e-3, rtol=0)


def test_audio_loudness_reward():
    waves = (torch.full((1, 8), 0.1), torch.full((2, 8), -1.0))
    assert_close(AudioLoudnessReward()(audio_batch(*waves)), torch.tensor([-20.0, 0.0]))
    assert_close(AudioLoudnessReward(target_db=-14)(audio_batch(*waves)), torch.tensor([-6.0, -14.0]))
    # Picks the audio output of a (video, audio) sample.
    av = RewardBatch(media=[[torch.zeros(2, 3, 4, 4, dtype=torch.uint8), waves[0]]], prompts=[""], metadata=[{}],
                     output_types=("video", "audio"), rates=(24.0, 16000))
    assert_close(AudioLoudnessReward()(av), torch.tensor([-20.0]))
    with pytest.raises(ValueError, match="target_db must be in"):
        AudioLoudnessReward(target_db=3)
    with pytest.raises(ValueError, match="reward 'audio_loudness' scores audio but the samples hold image"):
        AudioLoudnessReward()(RewardBatch(media=[[torch.zeros(3, 2, 2)]], prompts=[""], metadata=[{}]))


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A random 1-layer CLIPModel (16 x 16 images, 8-dim projection) with the ff-sd3 test tokenizer, saved."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from ff_core.testing.tiny import build_clip_tokenizer

    tokenizer = build_clip_tokenizer(max_length=16)
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16, **ids),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8),
        projection_dim=8,
    )
    torch.manual_seed(0)
    model = CLIPModel(config)
    processor = CLIPProcessor(tokenizer=tokenizer, image_processor=CLIPImageProcessor(
        size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}, image_mean=MEAN, image_std=STD))
    path = tmp_path_factory.mktemp("tiny_clip")
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path, model.eval(), tokenizer


def by_hand(model, tokenizer, image: torch.Tensor, prompt: str, size: int = 16) -> float:
    """CLIP's cosine similarity computed from the model's parts: PIL bicubic resize to ``size``, scale to [0, 1],
    normalise by the CLIP mean/std; text pooled at its end-of-text token; both projected and L2-normalised."""
    pil = Image.fromarray(image.permute(1, 2, 0).numpy())
    if pil.size != (size, size):
        pil = pil.resize((size, size), Image.BICUBIC)
    x = torch.tensor(list(pil.getdata()), dtype=torch.float32).reshape(size, size, 3).permute(2, 0, 1) / 255
    x = (x - torch.tensor(MEAN)[:, None, None]) / torch.tensor(STD)[:, None, None]
    with torch.no_grad():
        vision = model.vision_model(pixel_values=x[None]).pooler_output
        image_embed = torch.nn.functional.normalize(model.visual_projection(vision), dim=-1)
        ids = tokenizer(prompt, truncation=True)["input_ids"]
        hidden = model.text_model(input_ids=torch.tensor([ids])).last_hidden_state  # after the final layer norm
        text = model.text_projection(hidden[0, ids.index(tokenizer.eos_token_id)])
        text_embed = torch.nn.functional.normalize(text, dim=-1)
    return float(image_embed[0] @ text_embed)


def test_clip_score_matches_the_model_by_hand(tiny_clip):
    path, model, tokenizer = tiny_clip
    gen = torch.Generator().manual_seed(1)
    images = [torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8, generator=gen) for _ in range(3)]
    prompts = ["a red circle", "a green square on a white background", "blue " * 30]  # the last one is truncated
    rewards = Rewards([{"name": "clip_score", "args": {"pretrained_model_name_or_path": str(path), "batch_size": 2}}])
    out = rewards(RewardBatch(media=[[x] for x in images], prompts=prompts, metadata=[{}] * 3)).total
    expected = torch.tensor([by_hand(model, tokenizer, x, p) for x, p in zip(images, prompts)])
    assert_close(out, expected, atol=1e-5, rtol=0)
    assert out.abs().max() <= 1
    # CLIPScore's form: 2.5 * max(cos, 0).
    scaled = Rewards([{"name": "clip_score", "args": {"pretrained_model_name_or_path": str(path), "scale": 2.5,
                                                      "clip_negative": True}}])
    out = scaled(RewardBatch(media=[[x] for x in images], prompts=prompts, metadata=[{}] * 3)).total
    assert_close(out, 2.5 * expected.clamp_min(0), atol=1e-5, rtol=0)


def test_clip_score_resizes_larger_images_like_pil(tiny_clip):
    path, model, tokenizer = tiny_clip
    image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    reward = Rewards([{"name": "clip_score", "args": {"pretrained_model_name_or_path": str(path)}}])
    out = reward(RewardBatch(media=[[image]], prompts=["a photo"], metadata=[{}])).total
    assert abs(out.item() - by_hand(model, tokenizer, image, "a photo")) < 2e-2  # PIL rounds to uint8 after resizing


def test_clip_score_path_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.args: reward 'clip_score': pretrained_model_name_or_path"):
        Rewards([{"name": "clip_score", "args": {"pretrained_model_name_or_path": str(tmp_path / "nope")}}])
