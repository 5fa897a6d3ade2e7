"""Waveform alignment shared by the audio codecs of audio+video adapters (LTX-2, MiniMax H3): a target's audio cut to
the video clip's clock, then converted to the audio VAE's channel count and rate once with PyAV.

Spec dataset-guide, "Offline V2 records": decoded audio is the file's own samples; a manifest ``sample_rate`` is a
logical clock override; "source-clock truncation, channel conversion, the single model-rate conversion, posterior
selection, and latent packing remain adapter-owned". The first three are the same for every family, in that order:

1. :func:`clock_window`: the samples covering ``[start, start + duration)`` on the source clock (the declared rate
   when the manifest gives one). A clip shorter than that by more than ``tolerance`` seconds is rejected, never
   stretched (LTX-2); a family that right-pads short audio (MiniMax H3) passes ``math.inf``.
2. :func:`to_model_rate`: channels converted in torch (mono duplicated to stereo, N averaged to mono; ffmpeg's
   mixing matrix would rescale them), then one PyAV ``AudioResampler`` pass from the clock rate to the model rate
   (same layout in and out), then right-padded with zeros or trimmed to exactly the model's sample count (the
   resampler's rounding and filter delay move the count by a few samples).

torchaudio does not import beside the pinned torch (DESIGN, engineering notes): PyAV does the resampling.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor


def clip_clock_start(video: Any) -> float:
    """The first second of a decoded target video on its clip's clock: the grid time of its first frame
    (``DecodedVideo.timestamps[0]`` of a clip from :func:`~ff_core.data.media.decode.decode_clip`: official seconds at
    the declared ``fps``, counted from the video stream's first timestamp); 0 for a video decoded whole or a tensor. Its
    audio is cut from the same instant of the audio's clock (``clip_clock_start(video) - audio_clock_offset(audio)``,
    :func:`clock_window`), never from the video file's seconds (``DecodedVideo.window``), which differ from the clock
    when the manifest declares another ``fps``."""
    if getattr(video, "window", None) is None:
        return 0.0
    return float(video.timestamps[0])


def audio_clock_offset(audio: Any) -> float:
    """When the decoded waveform's first sample plays, on the audio's clock: ``DecodedAudio.start`` is in the file's
    seconds (from the audio stream's first timestamp), i.e. sample ``start * sample_rate``, which plays at
    ``start * sample_rate / clock_rate`` on a declared ``sample_rate``; 0 for a tensor."""
    start = float(getattr(audio, "start", 0.0) or 0.0)
    if not start:
        return 0.0
    return start * float(audio.sample_rate) / float(audio.clock_rate)


def audio_on_clock(audio: Any, model_rate: float, what: str) -> tuple[Tensor, float, float]:
    """A target audio as ``(waveform (C, N), clock rate, offset)``: a ``DecodedAudio`` on its declared clock
    (``clock_rate``, the manifest's ``sample_rate``) with its first sample's time on that clock
    (:func:`audio_clock_offset`); a float (C, N) tensor is taken as already at ``model_rate``, from 0. Anything else is
    a ``ValueError`` naming ``what``."""
    waveform = getattr(audio, "waveform", None)
    if waveform is not None:
        return waveform, float(audio.clock_rate), audio_clock_offset(audio)
    if not (isinstance(audio, Tensor) and audio.ndim == 2 and audio.is_floating_point()):
        raise ValueError(f"{what}: expected audio (DecodedAudio or float (C, N) tensor), got {type(audio).__name__}")
    return audio, float(model_rate), 0.0


def clock_window(waveform: Tensor, clock_rate: float, start: float, duration: float, *, tolerance: float,
                 what: str, keep: float | None = None) -> Tensor:  # fmt: skip
    """The samples of ``waveform`` (C, N) covering ``[start, start + keep)`` seconds of its clock (as far as the
    source goes), after checking that it covers ``[start, start + duration)``.

    Args:
        waveform: float (channels, samples), the file's own samples.
        clock_rate: the rate they are played at (the manifest's ``sample_rate`` when declared, else the file's).
        start: first second, on the audio's clock (:func:`clip_clock_start` of the video minus
            :func:`audio_clock_offset` of the decoded audio).
        duration: seconds to keep (``num_frames / frame_rate``).
        tolerance: how many seconds short of ``duration`` are still accepted (padded later with silence): rounding
            of the source's length, never a stretch. ``math.inf``: any length (a codec that right-pads, MiniMax H3).
        what: names the target in the error.
        keep: seconds to cut, ``>= duration`` (``None``: ``duration``): the model's sample count may run past the
            clip's clock (``4 L`` mel hops with ``L`` rounded up); audio the source has there is kept rather than
            padded with silence, and a source ending earlier is not an error.
    """
    first = max(int(round(start * clock_rate)), 0)
    count = int(round(duration * clock_rate))
    have = waveform.shape[-1] - first
    if have < count - tolerance * clock_rate:
        raise ValueError(f"{what}: the audio covers {max(have, 0) / clock_rate:.3f} s from {start:.3f} s at its clock "
                         f"rate {clock_rate:g} Hz, the clip needs {duration:.3f} s (num_frames / frame_rate); a clip "
                         "shorter than the video clock is rejected, never stretched")  # fmt: skip
    return waveform[:, first : first + max(count, int(round((keep or 0.0) * clock_rate)))]


def to_model_rate(waveform: Tensor, clock_rate: float, rate: int, channels: int, samples: int) -> Tensor:
    """``waveform`` (C, N) played at ``clock_rate``, converted to ``channels`` channels (1 or 2) and once with PyAV to
    ``rate`` Hz, then right-padded with zeros or trimmed to exactly ``samples``; float32 (channels, samples).

    Channels are converted here, not by the resampler: ffmpeg's mixing matrix scales mono to stereo by 1/sqrt(2)
    per channel and stereo to mono by 1/sqrt(2) of the sum, which would change the target's loudness. Mono is
    duplicated to stereo; stereo is averaged to mono; more than two channels are averaged to mono (and duplicated
    for a stereo VAE); PyAV then only changes the rate, with the same
    layout in and out.
    """
    import av

    if channels not in (1, 2):
        raise ValueError(f"the audio VAE takes 1 or 2 channels, its config says {channels}")
    x = waveform.detach().float().cpu()
    if x.shape[0] > channels:  # stereo to mono, or more than two channels: their mean
        x = x.mean(0, keepdim=True)
    if x.shape[0] < channels:  # mono to stereo: the same signal on both channels
        x = x.repeat(channels, 1)
    layout = {1: "mono", 2: "stereo"}[channels]
    in_rate = int(round(clock_rate))
    if in_rate == rate:
        out = x
    else:
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(x.numpy()), format="fltp", layout=layout)
        frame.sample_rate = in_rate
        resampler = av.AudioResampler(format="fltp", layout=layout, rate=rate)
        parts = [f.to_ndarray() for f in resampler.resample(frame)] + [f.to_ndarray() for f in resampler.resample(None)]
        out = torch.from_numpy(np.concatenate(parts, axis=1)) if parts else x.new_zeros(channels, 0)
    out = out[:, :samples]
    return torch.nn.functional.pad(out, (0, samples - out.shape[1])).contiguous()
