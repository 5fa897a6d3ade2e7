"""The H3 target codec by hand (spec "H3 audio"): the audio cut from the clip's start, converted to stereo at the audio
VAE's rate, trimmed or right-padded to exactly the aligned latent duration (``L * hop`` samples); the latent geometry
of a ``17 n + 5``-frame clip."""

from __future__ import annotations

import math

import pytest
import torch
from ff_minimax import MiniMaxH3T2VAAdapter
from ff_minimax.testing import TINY_FRAMES, TINY_SIZE

from ff_core.data.media import DecodedAudio


@pytest.fixture(scope="module")
def adapter(tiny_minimax):
    return MiniMaxH3T2VAAdapter.from_pretrained(tiny_minimax("t2va"), height=TINY_SIZE, width=TINY_SIZE,
                                                num_frames=TINY_FRAMES)  # fmt: skip


def tone(hz: float, seconds: float, rate: int, channels: int = 1) -> torch.Tensor:
    t = torch.arange(int(round(seconds * rate))) / rate
    return (0.3 * torch.sin(2 * math.pi * hz * t)).repeat(channels, 1)


def peak_hz(x: torch.Tensor, rate: int) -> float:
    spectrum = torch.fft.rfft(x[0].double()).abs()
    return float(spectrum.argmax()) * rate / x.shape[-1]


def test_geometry_of_the_smallest_clip(adapter):
    """124 frames: (124 - 5) / 17 * 5 + 2 = 37 latent frames; round(124 / 24 * 40) = 207 audio latents per stereo
    channel, each of hop 200 samples at 8 kHz."""
    assert adapter.num_latent_frames == 37 and adapter.num_audio_latents == 207
    assert adapter.audio_samples == 207 * 200 and adapter.audio_rate == 8000
    assert adapter.latent_shapes(1) == ((1, 4, 37, 4, 4), (1, 2, 4, 207))


def test_audio_is_trimmed_to_the_aligned_duration_as_stereo_at_the_vae_rate(adapter):
    source = tone(440.0, 7.0, 11025)  # mono, 11.025 kHz, longer than the clip
    out = adapter.target_waveform(DecodedAudio(source, 11025, 11025.0), 0.0, "t")
    assert out.shape == (2, adapter.audio_samples) and out.dtype == torch.float32
    torch.testing.assert_close(out[0], out[1])  # mono duplicated, not rescaled by a mixing matrix
    assert peak_hz(out, 8000) == pytest.approx(440.0, abs=0.5)
    assert float(out.abs().max()) == pytest.approx(0.3, abs=0.02)


def test_short_audio_is_right_padded_with_silence(adapter):
    """A 3 s source (shorter than the clip's 5.175 s): H3 pads instead of rejecting it."""
    out = adapter.target_waveform(tone(440.0, 3.0, 8000, channels=2), 0.0, "t")
    assert out.shape == (2, adapter.audio_samples)
    torch.testing.assert_close(out[:, :24000], tone(440.0, 3.0, 8000, channels=2))  # at the VAE's rate: untouched
    assert (out[:, 24000:] == 0).all()


def test_audio_is_cut_from_the_clip_start_on_its_own_clock(adapter):
    """The video window starts 1 s into the file: the audio from the same instant (a ramp tells where the cut is)."""
    ramp = torch.arange(8 * 8000, dtype=torch.float32)[None].repeat(2, 1) / 1e5
    out = adapter.target_waveform(DecodedAudio(ramp, 8000, 8000.0), 1.0, "t")
    assert float(out[0, 0] * 1e5) == pytest.approx(8000.0) and out.shape[-1] == adapter.audio_samples
