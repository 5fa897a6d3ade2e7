"""clap: the sinc resampler against analytic sines; the reward against ``ClapModel``'s own forward pass (its
``logits_per_audio``, transformers' documented audio-text similarity) on the same mono, resampled waveforms, with a
tiny random CLAP saved and loaded back; audio picked from audio+video samples at the batch's rate."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_reward_models import CLAP_RATE, build_tiny_clap
from torch.testing import assert_close

from ff_core.errors import ConfigError
from ff_core.objectives.rewards import Rewards
from ff_core.rewards import RewardBatch
from ff_core.rewards.clap import resample


def sine(freq: float, rate: int, seconds: float, phase: float = 0.0) -> torch.Tensor:
    t = torch.arange(round(rate * seconds), dtype=torch.float64) / rate
    return torch.sin(2 * math.pi * freq * t + phase)


@pytest.mark.parametrize(("orig", "new"), [(16000, 48000), (48000, 16000), (24000, 16000), (16000, 8000)])
def test_resample_reproduces_a_band_limited_sine(orig, new):
    """A 440 Hz sine sampled at ``orig`` is the same sine sampled at ``new`` (away from the edges, where the filter
    sees the zero padding): ``ceil(N new / orig)`` samples, error < 1e-3 of full scale."""
    x = sine(440, orig, 0.25)
    y = resample(x, orig, new)
    assert y.shape == (math.ceil(len(x) * new / orig),) and y.dtype == torch.float64
    edge = new // 100  # 10 ms
    assert_close(y[edge:-edge], sine(440, new, 0.25)[edge:len(y) - edge], atol=1e-3, rtol=0)
    # Any leading shape; float32 in, float32 out; the same rate is the identity.
    stereo = torch.stack([x, -x]).float()
    assert_close(resample(stereo, orig, new), torch.stack([y, -y]).float(), atol=1e-5, rtol=0)
    assert resample(stereo, orig, orig) is stereo


def test_resample_removes_what_the_new_rate_cannot_hold():
    """Downsampling 48 kHz -> 16 kHz: a 12 kHz tone (above the new Nyquist, 8 kHz) is filtered out, not aliased to
    4 kHz."""
    y = resample(sine(12000, 48000, 0.25), 48000, 16000)
    assert y[200:-200].abs().max() < 0.02


@pytest.fixture(scope="module")
def tiny_clap(tmp_path_factory):
    from transformers import ClapModel, ClapProcessor

    path = build_tiny_clap(tmp_path_factory.mktemp("tiny_clap"))
    return path, ClapModel.from_pretrained(path).eval(), ClapProcessor.from_pretrained(path)


def reference(model, processor, waveforms: list[torch.Tensor], prompts: list[str]) -> torch.Tensor:
    """transformers' documented usage (``ClapModel.forward`` docstring): the processor on the texts and the mono
    waveforms at the extractor's rate, then ``outputs.logits_per_audio`` (audio x text); a sample's score with its
    own prompt is the diagonal."""
    inputs = processor(text=prompts, audio=[w.numpy() for w in waveforms], sampling_rate=CLAP_RATE,
                       return_tensors="pt", padding=True)  # fmt: skip
    with torch.no_grad():
        return model(**inputs).logits_per_audio.diagonal()


def test_clap_score_matches_the_model_forward(tiny_clap):
    """Stereo 16 kHz clips of 0.5 and 0.75 s: the reward equals ``logits_per_audio / exp(logit_scale_a)`` on the same
    clips mixed to mono and resampled to 8 kHz (and the logits themselves with ``logit_scale: true``)."""
    path, model, processor = tiny_clap
    g = torch.Generator().manual_seed(0)
    clips = [torch.rand(2, 8000, generator=g) * 2 - 1, 0.3 * torch.randn(2, 12000, generator=g).clamp(-3, 3)]
    prompts = ["a dog barks", "rain on a tin roof at night"]
    batch = RewardBatch(media=[[c] for c in clips], prompts=prompts, metadata=[{}] * 2, output_types=("audio",),
                        rates=(16000,))  # fmt: skip
    mono = [resample(c.mean(0), 16000, CLAP_RATE) for c in clips]
    logits = reference(model, processor, mono, prompts)
    scale = model.logit_scale_a.exp().item()
    out = Rewards([{"name": "clap", "args": {"pretrained_model_name_or_path": str(path), "batch_size": 1}}])(batch)
    assert_close(out.total, logits / scale, atol=1e-5, rtol=0)
    assert out.total.abs().max() <= 1
    scaled = Rewards([{"name": "clap", "args": {"pretrained_model_name_or_path": str(path), "logit_scale": True,
                                                "scale": 2.0}}])(batch)  # fmt: skip
    assert_close(scaled.total, 2 * logits, atol=1e-4, rtol=0)


def test_clap_scores_the_audio_of_audio_video_samples(tiny_clap):
    """A (video, audio) sample as LTX-2 and MiniMax output it: the audio is scored at the batch's rate; without a rate
    the reward asks for ``sample_rate``; audio longer than the extractor's 1 s keeps its first second (the extractor
    would crop at random)."""
    path, model, processor = tiny_clap
    g = torch.Generator().manual_seed(1)
    wave = torch.rand(2, 3 * 16000, generator=g) * 2 - 1
    video = torch.zeros(9, 3, 8, 8, dtype=torch.uint8)
    reward = Rewards([{"name": "clap", "args": {"pretrained_model_name_or_path": str(path)}}])
    av = RewardBatch(media=[[video, wave]], prompts=["a low tone"], metadata=[{}], output_types=("video", "audio"),
                     rates=(8.0, 16000))  # fmt: skip
    expected = reference(model, processor, [resample(wave.mean(0), 16000, CLAP_RATE)[:CLAP_RATE]], ["a low tone"])
    assert_close(reward(av).total, expected / model.logit_scale_a.exp(), atol=1e-5, rtol=0)
    assert_close(reward(av).total, reward(av).total)  # deterministic
    unknown = RewardBatch(media=[[wave]], prompts=["a low tone"], metadata=[{}], output_types=("audio",))
    with pytest.raises(ValueError, match="set args.sample_rate"):
        reward(unknown)
    given = Rewards([{"name": "clap", "args": {"pretrained_model_name_or_path": str(path), "sample_rate": 16000}}])
    assert_close(given(unknown).total, reward(av).total)


def test_clap_refuses_an_adapter_without_audio_and_a_missing_folder(tmp_path, tiny_clap):
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.args: reward 'clap': pretrained_model_name_or_path"):
        Rewards([{"name": "clap", "args": {"pretrained_model_name_or_path": str(tmp_path / "nope")}}])
    reward = Rewards([{"name": "clap", "args": {"pretrained_model_name_or_path": str(tiny_clap[0])}}])
    with pytest.raises(ValueError, match="reward 'clap' scores audio but the samples hold image"):
        reward(RewardBatch(media=[[torch.zeros(3, 4, 4, dtype=torch.uint8)]], prompts=["x"], metadata=[{}]))
