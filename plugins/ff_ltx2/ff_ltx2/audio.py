"""The LTX-2 audio codec's signal side: a target's waveform aligned to the video clock, converted to the audio VAE's
channel count and rate once with PyAV, and turned into the log-mel spectrogram the audio VAE encodes.

Spec dataset-guide, "Offline V2 records": decoded audio is the file's own samples; a manifest ``sample_rate`` is a
logical clock override; "source-clock truncation, channel conversion, the single model-rate conversion, posterior
selection, and latent packing remain adapter-owned". In that order:

1. :func:`~ff_core.audio.clock_window` (shared with the other audio codecs, :mod:`ff_core.audio`): the samples
   covering ``[start, start + duration)`` on the source clock (the declared rate when the manifest gives one), where
   ``duration = num_frames / frame_rate`` is the official LTX-2 clock. A clip shorter than that by more than
   ``tolerance`` seconds is rejected, never stretched; the cut extends to ``keep`` seconds (the ``4 L`` mel hops'
   span, when longer) where the source has them.
2. :func:`~ff_core.audio.to_model_rate`: channels converted in torch, then one PyAV resampling pass to the model
   rate, then right-padded with zeros or trimmed to exactly the model's sample count.
3. :func:`log_mel`: ``torch.stft`` (Hann window, centred, reflect padding) magnitudes through a Slaney mel filter bank
   (:func:`mel_filter_bank`), ``log(clamp(mel, 1e-5))``: LTX-2's ``AudioProcessor`` (torchaudio ``MelSpectrogram``
   with ``power=1``, ``norm="slaney"``, ``mel_scale="slaney"``), without torchaudio, which does not import beside
   the pinned torch (DESIGN, engineering notes).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ff_core.audio import clock_window, to_model_rate

__all__ = ["clock_window", "log_mel", "mel_filter_bank", "to_model_rate"]


def _hz_to_mel_slaney(freq: Tensor) -> Tensor:
    """Slaney's mel scale (librosa / torchaudio ``mel_scale="slaney"``): linear below 1 kHz, logarithmic above."""
    f_sp, min_log_hz, logstep = 200.0 / 3, 1000.0, math.log(6.4) / 27.0
    mels = freq / f_sp
    min_log_mel = min_log_hz / f_sp
    return torch.where(freq >= min_log_hz, min_log_mel + torch.log(freq.clamp_min(1e-10) / min_log_hz) / logstep, mels)


def _mel_to_hz_slaney(mels: Tensor) -> Tensor:
    f_sp, min_log_hz, logstep = 200.0 / 3, 1000.0, math.log(6.4) / 27.0
    min_log_mel = min_log_hz / f_sp
    return torch.where(mels >= min_log_mel, min_log_hz * torch.exp(logstep * (mels - min_log_mel)), f_sp * mels)


def mel_filter_bank(n_freqs: int, n_mels: int, sample_rate: int, f_min: float = 0.0,
                    f_max: float | None = None) -> Tensor:  # fmt: skip
    """(n_freqs, n_mels) triangular Slaney-normalised mel filters (torchaudio ``melscale_fbanks(..., norm="slaney",
    mel_scale="slaney")``): ``stft_magnitude.T @ bank`` is the mel spectrogram."""
    f_max = sample_rate / 2 if f_max is None else f_max
    all_freqs = torch.linspace(0, sample_rate // 2, n_freqs, dtype=torch.float64)
    m_pts = torch.linspace(float(_hz_to_mel_slaney(torch.tensor(f_min, dtype=torch.float64))),
                           float(_hz_to_mel_slaney(torch.tensor(f_max, dtype=torch.float64))), n_mels + 2,
                           dtype=torch.float64)  # fmt: skip
    f_pts = _mel_to_hz_slaney(m_pts)
    f_diff = f_pts[1:] - f_pts[:-1]
    slopes = f_pts.unsqueeze(0) - all_freqs.unsqueeze(1)  # (n_freqs, n_mels + 2)
    down = -slopes[:, :-2] / f_diff[:-1]
    up = slopes[:, 2:] / f_diff[1:]
    bank = torch.clamp(torch.minimum(down, up), min=0)
    enorm = 2.0 / (f_pts[2 : n_mels + 2] - f_pts[:n_mels])  # Slaney: equal area per filter
    return (bank * enorm.unsqueeze(0)).float()


def log_mel(waveform: Tensor, *, sample_rate: int, n_fft: int, hop_length: int, n_mels: int) -> Tensor:
    """Log-mel spectrogram of ``waveform`` (..., C, N): (..., C, 1 + N // hop_length, n_mels), float32.

    ``torch.stft`` with a Hann window of ``n_fft``, centred with reflect padding, magnitude (power 1), Slaney mel
    filters from 0 Hz to Nyquist, ``log(clamp(mel, 1e-5))`` (LTX-2's ``AudioProcessor``; time before mel bins, the
    audio VAE's (channels, time, mel) input layout).
    """
    lead, n = waveform.shape[:-1], waveform.shape[-1]
    x = waveform.float().reshape(-1, n)
    window = torch.hann_window(n_fft, device=x.device)
    spec = torch.stft(x, n_fft, hop_length=hop_length, win_length=n_fft, window=window, center=True,
                      pad_mode="reflect", return_complex=True).abs()  # (B', n_fft // 2 + 1, T)
    bank = mel_filter_bank(n_fft // 2 + 1, n_mels, sample_rate).to(x.device)
    mel = torch.matmul(spec.transpose(1, 2), bank)  # (B', T, n_mels)
    return torch.log(mel.clamp_min(1e-5)).reshape(*lead, mel.shape[1], n_mels)
