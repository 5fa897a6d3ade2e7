"""pickscore and aesthetic on a tiny random CLIPModel saved with ``save_pretrained``, against the reference scorers'
own code run on the same folder: the PickScore README's ``calc_probs`` and flow_grpo's ``PickScoreScorer`` /
``AestheticScorer`` (transcribed below, loading from the tiny folder instead of the hub)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from ff_core.errors import ConfigError
from ff_core.objectives.rewards import Rewards
from ff_core.plugins import get_reward_class
from ff_core.rewards import RewardBatch
from ff_core.testing.tiny_rewards import build_tiny_clip, write_aesthetic_head

PROMPTS = ["a red circle", "a green square on a white background", "blue " * 30]  # the last one is truncated


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return build_tiny_clip(tmp_path_factory.mktemp("pickscore"))


def images(n: int, size: tuple[int, int] = (32, 32), seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (3, *size), dtype=torch.uint8, generator=gen) for _ in range(n)]


def batch(media: list[torch.Tensor], prompts: list[str] = PROMPTS, kind: str = "image") -> RewardBatch:
    return RewardBatch(media=[[x] for x in media], prompts=prompts[:len(media)], metadata=[{}] * len(media),
                       output_types=(kind,))


def pil(x: torch.Tensor):
    from PIL import Image

    return Image.fromarray(x.permute(1, 2, 0).numpy())


def get_features(out):
    # transformers 5 returns BaseModelOutputWithPooling from get_*_features; its pooler_output is the tensor the
    # reference code (written for transformers 4) received.
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def calc_scores(processor, model, prompt, images, max_length):
    """PickScore README (github.com/yuvalkirstain/PickScore), ``calc_probs`` up to its softmax; ``max_length=77``
    there (PickScore_v1's text positions), the tiny model's 16 here."""
    image_inputs = processor(images=images, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    text_inputs = processor(text=prompt, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        image_embs = get_features(model.get_image_features(**image_inputs))
        image_embs = image_embs / torch.norm(image_embs, dim=-1, keepdim=True)
        text_embs = get_features(model.get_text_features(**text_inputs))
        text_embs = text_embs / torch.norm(text_embs, dim=-1, keepdim=True)
        scores = model.logit_scale.exp() * (text_embs @ image_embs.T)[0]
    return scores


def flow_grpo_pickscore(processor, model, prompt, images, max_length):
    """flow_grpo ``flow_grpo/pickscore_scorer.py``, ``PickScoreScorer.__call__`` (max_length as above)."""
    image_inputs = processor(images=images, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    text_inputs = processor(text=prompt, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        image_embs = get_features(model.get_image_features(**image_inputs))
        image_embs = image_embs / image_embs.norm(p=2, dim=-1, keepdim=True)
        text_embs = get_features(model.get_text_features(**text_inputs))
        text_embs = text_embs / text_embs.norm(p=2, dim=-1, keepdim=True)
        logit_scale = model.logit_scale.exp()
        scores = logit_scale * (text_embs @ image_embs.T)
        scores = scores.diag()
        # norm to 0-1
        scores = scores / 26
    return scores


def test_pickscore_matches_calc_probs_and_flow_grpo(clip_dir):
    from transformers import AutoModel, AutoProcessor

    processor = AutoProcessor.from_pretrained(clip_dir)
    model = AutoModel.from_pretrained(clip_dir).eval()
    media = images(3)
    expected = torch.stack([calc_scores(processor, model, p, [pil(x)], 16)[0] for x, p in zip(media, PROMPTS)])
    rewards = Rewards([{"name": "pickscore", "args": {"pretrained_model_name_or_path": str(clip_dir),
                                                      "batch_size": 2}}])
    out = rewards(batch(media)).total
    assert_close(out, expected, atol=1e-4, rtol=1e-5)
    assert out.abs().max() <= 100.01  # |cos| <= 1 times exp(logit_scale) = 100
    normalised = Rewards([{"name": "pickscore", "args": {"pretrained_model_name_or_path": str(clip_dir),
                                                         "processor_name_or_path": str(clip_dir),
                                                         "normalise": True}}])
    flow_grpo = flow_grpo_pickscore(processor, model, PROMPTS, [pil(x) for x in media], 16)
    assert_close(normalised(batch(media)).total, flow_grpo, atol=1e-5, rtol=1e-5)


def test_pickscore_scores_a_videos_middle_frame_or_the_mean_of_spaced_frames(clip_dir):
    from ff_core.rewards.pickscore import PickScoreReward

    reward = PickScoreReward(str(clip_dir))
    video = torch.stack(images(5, seed=3))  # (T, 3, H, W)
    per_frame = reward(batch(list(video), [PROMPTS[0]] * 5))
    assert_close(reward(batch([video], kind="video")), per_frame[2:3])  # frame T // 2
    spaced = PickScoreReward(str(clip_dir), video_frames=3)(batch([video], kind="video"))
    assert_close(spaced, per_frame[[0, 2, 4]].mean()[None])  # frames 0, 2, 4 (linspace(0, 4, 3))
    assert_close(PickScoreReward(str(clip_dir), video_frames=9)(batch([video], kind="video")), per_frame.mean()[None])


class MLP(torch.nn.Module):
    """flow_grpo ``flow_grpo/aesthetic_scorer.py`` (improved-aesthetic-predictor's ``simple_inference.py``), with the
    tiny CLIP's 8-dim embedding in place of ViT-L/14's 768."""

    def __init__(self, input_size=768):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(input_size, 1024), torch.nn.Dropout(0.2),
            torch.nn.Linear(1024, 128), torch.nn.Dropout(0.2),
            torch.nn.Linear(128, 64), torch.nn.Dropout(0.1),
            torch.nn.Linear(64, 16),
            torch.nn.Linear(16, 1),
        )  # fmt: skip

    @torch.no_grad()
    def forward(self, embed):
        return self.layers(embed)


def flow_grpo_aesthetic(clip_dir, head_path, images_nchw):
    """flow_grpo's ``AestheticScorer`` (``__init__`` from the tiny folder and head, then ``__call__``), fed a uint8
    NCHW tensor as its ``aesthetic_score`` reward function does."""
    from transformers import CLIPModel, CLIPProcessor

    clip = CLIPModel.from_pretrained(clip_dir)
    processor = CLIPProcessor.from_pretrained(clip_dir)
    mlp = MLP(clip.config.projection_dim)
    mlp.load_state_dict(torch.load(head_path))
    clip.eval(), mlp.eval()
    with torch.no_grad():
        inputs = processor(images=images_nchw, return_tensors="pt")
        inputs = {k: v.to(torch.float32) for k, v in inputs.items()}
        embed = get_features(clip.get_image_features(**inputs))
        embed = embed / torch.linalg.vector_norm(embed, dim=-1, keepdim=True)
        return mlp(embed).squeeze(1)


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_aesthetic_matches_flow_grpos_scorer(clip_dir, tmp_path, suffix):
    head = write_aesthetic_head(tmp_path / f"head{suffix}", input_size=8, seed=2)
    pth = write_aesthetic_head(tmp_path / "reference.pth", input_size=8, seed=2)
    media = images(3, size=(40, 48))  # resized and centre-cropped by the processor
    rewards = Rewards([{"name": "aesthetic", "args": {"pretrained_model_name_or_path": str(clip_dir),
                                                      "head_path": str(head), "batch_size": 2}}])
    out = rewards(batch(media)).total
    assert_close(out, flow_grpo_aesthetic(clip_dir, pth, torch.stack(media)), atol=1e-5, rtol=1e-5)
    assert out.std() > 0


def test_aesthetic_head_errors_name_the_key(clip_dir, tmp_path):
    args = {"pretrained_model_name_or_path": str(clip_dir), "head_path": str(tmp_path / "nope.pth")}
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.args: reward 'aesthetic': head_path .*nope.pth"):
        Rewards([{"name": "aesthetic", "args": args}])
    wrong = write_aesthetic_head(tmp_path / "wide.pth", input_size=16)  # a head for 16-dim embeddings
    with pytest.raises(ConfigError, match=r"(?s)head_path .*wide.pth.*size mismatch"):
        Rewards([{"name": "aesthetic", "args": {**args, "head_path": str(wrong)}}])
    with pytest.raises(ConfigError, match=r"reward 'pickscore': pretrained_model_name_or_path"):
        Rewards([{"name": "pickscore", "args": {"pretrained_model_name_or_path": str(tmp_path / "none")}}])
    with pytest.raises(ConfigError, match=r"video_frames must be >= 1"):
        Rewards([{"name": "pickscore", "args": {"pretrained_model_name_or_path": str(clip_dir), "video_frames": 0}}])


def test_the_preference_rewards_are_registered():
    from ff_core.rewards.aesthetic import AestheticReward
    from ff_core.rewards.hps import HpsReward
    from ff_core.rewards.image_reward import ImageRewardReward
    from ff_core.rewards.pickscore import PickScoreReward

    for cls in (PickScoreReward, AestheticReward, HpsReward, ImageRewardReward):
        assert get_reward_class(cls.name) is cls
        assert cls.media_types == ("image", "video")
