"""The H3 target codec by hand (spec "H3 audio"): the audio cut from the clip's start, converted to stereo at the audio
VAE's rate, trimmed or right-padded to exactly the aligned latent duration (``L * hop`` samples); the latent geometry
of a ``17 n + 5``-frame clip."""

from __future__ import annotations

import math

import pytest
import torch
from ff_minimax import MiniMaxH3T2VAAdapter
from ff_minimax.testing import TINY_FRAMES, TINY_SIZE

from ff_core.data.media.decode import DecodedAudio


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


def test_the_audio_cut_follows_the_clip_clock_when_the_streams_start_after_0(adapter, tmp_path):
    """One clock for both streams, as ff-ltx2's (:mod:`ff_core.audio`): a clip starting 0.25 s into its clock (a
    ``data.buckets`` start) from a video declared at a quarter of its file rate (6 fps for a 24 fps file: the clip's
    0.25 s is the file's second frame, 1/24 s) and an audio declared at twice its file rate (8 kHz for 4 kHz, the VAE's
    rate: no resampling), both streams starting after 0 in their files (PyAV ``start_time`` 0.5 s and 0.25 s). The
    cut starts at sample ``0.25 * 8000 = 2000`` of the audio stream, by hand; the video window's file seconds (what
    the adapter cut from before) would start it at sample 333."""
    import av
    import numpy as np

    from ff_core.contracts import MediaGeometry, MediaType
    from ff_core.data.media.geometry import decode_target
    from ff_core.data.records.base import MediaItem
    from ff_core.testing.clips import write_offset_streams

    noise = np.random.default_rng(0).integers(-20000, 20000, 48000).astype(np.int16)  # 6 s at 8 kHz on the clock
    video_file, audio_file = write_offset_streams(tmp_path, TINY_SIZE, 24, 36, 4000, noise)
    for path, kind in ((video_file, "video"), (audio_file, "audio")):
        with av.open(str(path)) as container:
            assert getattr(container.streams, kind)[0].start_time not in (None, 0)
    clip = MediaGeometry(TINY_SIZE, TINY_SIZE, num_frames=TINY_FRAMES, fps=24.0, start=0.25)
    video = decode_target(MediaItem(MediaType.VIDEO, video_file, fps=6.0), clip)
    audio = decode_target(MediaItem(MediaType.AUDIO, audio_file, sample_rate=8000.0), None)
    assert video.window[0] < 0.1 and float(video.timestamps[0]) == pytest.approx(0.25)
    _, start = adapter._video(video, 0)
    got = adapter.target_waveform(audio, start, "media[0][1]")
    expected = torch.from_numpy(noise[2000 : 2000 + adapter.audio_samples].astype(np.float32) / 32768.0)
    torch.testing.assert_close(got, expected[None].repeat(2, 1), rtol=0, atol=0)


def test_target_video_is_the_posterior_mode_unless_sample_is_asked(adapter, tiny_minimax):
    """Default ``target_posterior="mode"`` (Flow-Factory's ``encode_h3_target_video``): the video latents are
    ``(vae.encode(x).latent_dist.mode() - latents_mean) / latents_std`` of the ImageNet-normalised pixels, whatever the
    generator; ``"sample"`` draws from the generator (two seeds differ). The audio takes its mean either way. An
    unknown value is a ConfigError naming the key before any weight loads."""
    from ff_core.adapter import ConditionInput
    from ff_core.errors import ConfigError
    from ff_core.pretrained import check_adapter_kwargs

    condition = adapter.prepare_condition(torch.utils.data.default_collate(adapter.preprocess([ConditionInput("a")])))
    g = torch.Generator().manual_seed(0)
    video = torch.randint(0, 256, (TINY_FRAMES, 3, TINY_SIZE, TINY_SIZE), dtype=torch.uint8, generator=g)
    media = [[video, tone(440.0, 3.0, 8000, channels=2)]]
    mode = adapter.encode_output(media, condition, generator=torch.Generator().manual_seed(1))
    x = (video.permute(1, 0, 2, 3)[None].float() / 255 - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1, 1)) / (
        torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1, 1))  # the H3 VAE's ImageNet pixel convention, by hand
    cfg = adapter.vae.config
    by_hand = (adapter.vae.encode(x).latent_dist.mode() - torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)) / (
        torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1))
    torch.testing.assert_close(mode.components["video"], by_hand, rtol=1e-5, atol=1e-5)
    sampling = MiniMaxH3T2VAAdapter.from_pretrained(tiny_minimax("t2va"), height=TINY_SIZE, width=TINY_SIZE,
                                                    num_frames=TINY_FRAMES, target_posterior="sample")  # fmt: skip
    a, b = (sampling.encode_output(media, condition, generator=torch.Generator().manual_seed(s)) for s in (0, 1))
    assert not torch.equal(a.components["video"], b.components["video"])
    assert not torch.equal(a.components["video"], mode.components["video"])
    torch.testing.assert_close(a.components["audio"], mode.components["audio"], rtol=0, atol=0)
    with pytest.raises(ConfigError, match=r"model\.adapter_kwargs\.target_posterior: must be one of mode, sample"):
        check_adapter_kwargs(MiniMaxH3T2VAAdapter, None, {"target_posterior": "mean"})


def test_target_frames_are_put_on_the_grid_as_ffmpegs_fps_filter_does(adapter, tmp_path):
    """H3's released SFT data flow decodes its target clips through ffmpeg's ``fps`` filter, so the adapter's clip
    geometry asks for that rule (``frame_rule: fps_filter``; the other families take the nearest source frame), from the
    loaded adapter and from its config-only geometry alike, and a ``data.buckets`` entry that names no rule takes it.
    Reference: a real ``fps=24`` filter graph (:func:`ff_core.testing.clips.fps_filter_frames`) over a 60-fps clip
    whose frame ``k`` is the grey level ``3 k``; the training path's decode (:func:`decode_target` on the adapter's
    geometry) must give the same source frames. At 60 -> 24 fps ffmpeg's slots show frames 1, 3, 6, 8, ... where the
    nearest rule takes 0, 2, 5, 8, ...: the test fails under any other rule. The grey levels wrap after frame 85 (the
    clip has 316), so the first 32 grid frames (source frames up to 78) are compared by index."""
    import numpy as np

    from ff_core.contracts import MediaType
    from ff_core.data.media.buckets import Bucket
    from ff_core.data.media.geometry import decode_target
    from ff_core.data.records.base import MediaItem
    from ff_core.testing.clips import fps_filter_frames, write_grey_mp4

    step, compared = 3, 32
    frames = math.ceil(TINY_FRAMES * 60 / 24) + 6
    path = write_grey_mp4(tmp_path / "c60.mp4", frames=frames, fps=60, size=(TINY_SIZE, TINY_SIZE), step=step)
    geometry = adapter.output_geometry()[0]
    config_only = type(adapter).resolve_output_geometry(None, {"num_frames": 124, "height": 32, "width": 32})[0]
    assert geometry.frame_rule == config_only.frame_rule == "fps_filter"
    reference = [round(float(f.mean()) / step) for f in fps_filter_frames(path, 24)][:TINY_FRAMES]
    clip = decode_target(MediaItem(MediaType.VIDEO, path), geometry)
    got = [round(float(np.asarray(f, dtype=np.float64).mean()) / step) for f in clip.frames]
    assert len(got) == TINY_FRAMES and len(reference) == TINY_FRAMES
    assert got[:compared] == reference[:compared] and max(reference[:compared]) * step < 256
    assert got[:4] == [1, 3, 6, 8]  # not the nearest frames (0, 2, 5, 8)
    bucket = Bucket.from_config({"height": 32, "width": 32, "num_frames": 124, "fps": 24.0}, "data.buckets[0]")
    assert bucket.adopt_frame_rule("fps_filter").geometry.frame_rule == "fps_filter"
    own = Bucket.from_config({"height": 32, "width": 32, "frame_rule": "floor"}, "data.buckets[1]")
    assert own.adopt_frame_rule("fps_filter").geometry.frame_rule == "floor"
