"""The LTX-2 audio codec (ff_ltx2.audio and LTX2T2AVAdapter.target_mel / encode_output): clock alignment (durations,
trimming, padding, the manifest's logical sample rate), the one PyAV conversion, and the log-mel spectrogram against
hand computations (Slaney filter areas, a numpy DFT of one frame)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from ff_ltx2.audio import clock_window, log_mel, mel_filter_bank, to_model_rate
from ltx2_geometry import ADAPTER_KWARGS, AUDIO_LATENTS, FPS, FRAMES, SIZE

from ff_core.adapter import ConditionInput
from ff_core.data.media.decode import DecodedAudio


def tone(freq: float, seconds: float, rate: int, channels: int = 1) -> torch.Tensor:
    t = torch.arange(int(round(seconds * rate)), dtype=torch.float64) / rate
    return (0.3 * torch.sin(2 * math.pi * freq * t)).float().repeat(channels, 1)


def peak_hz(x: torch.Tensor, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(x[0].double().numpy()))
    return float(np.argmax(spectrum) * rate / len(x[0]))


# -- the clock window ------------------------------------------------------------------------------------------
def test_clock_window_trims_to_the_clip_clock():
    ramp = torch.arange(1000, dtype=torch.float32)[None]  # sample k holds k: the cut reads back from its values
    cut = clock_window(ramp, 100.0, start=0.25, duration=1.125, tolerance=0.0, what="t")
    assert cut.shape == (1, 112) and cut[0, 0] == 25 and cut[0, -1] == 25 + 111  # round(1.125 * 100) samples


def test_a_clip_shorter_than_the_clock_is_rejected_not_stretched():
    with pytest.raises(ValueError, match=r"media\[3\]\[1\]: the audio covers 1\.000 s .* needs 1\.125 s"):
        clock_window(torch.zeros(1, 100), 100.0, start=0.0, duration=1.125, tolerance=0.05, what="media[3][1]")
    # Within the tolerance (rounding of the source's length): accepted as it is, padded at the model rate.
    assert clock_window(torch.zeros(1, 110), 100.0, 0.0, 1.125, tolerance=0.05, what="t").shape == (1, 110)


def test_one_conversion_to_the_model_rate_and_channels():
    x = tone(1000.0, 1.0, 22050)  # mono, 22.05 kHz
    y = to_model_rate(x, 22050, 16000, 2, 16000)
    assert y.shape == (2, 16000) and y.dtype == torch.float32
    torch.testing.assert_close(y[0], y[1])  # mono duplicated
    assert peak_hz(y, 16000) == pytest.approx(1000.0, abs=1.0)
    # A declared (logical) clock of half the file's rate plays the same samples twice as slow: a 500 Hz tone, an
    # octave lower (the FFT peak of 2 s at 16 kHz: 0.5 Hz bins).
    slow = to_model_rate(x, 11025, 16000, 2, 32000)
    assert peak_hz(slow, 16000) == pytest.approx(500.0, abs=1.0)
    assert peak_hz(slow, 16000) == pytest.approx(peak_hz(y, 16000) / 2, abs=1.0)
    # Stereo at the model rate already: untouched; right-padded with silence to the asked length.
    z = to_model_rate(tone(440.0, 0.5, 16000, 2), 16000, 16000, 2, 9000)
    torch.testing.assert_close(z[:, :8000], tone(440.0, 0.5, 16000, 2))
    assert (z[:, 8000:] == 0).all()


def test_channel_conversion_keeps_the_amplitude():
    """Mono to stereo duplicates the signal (each channel keeps the 0.3 amplitude; ffmpeg's mixing matrix would give
    0.3 / sqrt(2)); stereo to mono is the mean of the channels (ffmpeg: (L + R) / sqrt(2)); with and without a rate
    change."""
    mono = tone(1000.0, 1.0, 16000)
    for rate in (16000, 22050):
        y = to_model_rate(tone(1000.0, 1.0, rate), rate, 16000, 2, 16000)
        torch.testing.assert_close(y[0], y[1])
        # Away from the resampler's filter edges the peak amplitude is the input's.
        assert float(y[:, 1000:-1000].abs().max()) == pytest.approx(0.3, abs=0.01)
    torch.testing.assert_close(to_model_rate(mono, 16000, 16000, 2, 16000), mono.repeat(2, 1), rtol=0, atol=0)
    left, right = tone(1000.0, 1.0, 16000), 0.5 * tone(440.0, 1.0, 16000)
    stereo = torch.cat([left, right])
    torch.testing.assert_close(to_model_rate(stereo, 16000, 16000, 1, 16000), (left + right) / 2, rtol=0, atol=1e-7)
    down = to_model_rate(torch.cat([tone(1000.0, 1.0, 22050), tone(1000.0, 1.0, 22050)]), 22050, 16000, 1, 16000)
    assert float(down[:, 1000:-1000].abs().max()) == pytest.approx(0.3, abs=0.01)


# -- the mel spectrogram -------------------------------------------------------------------------------------------
def test_slaney_filters_have_unit_area_and_peak_at_their_centres():
    """Slaney normalisation: triangle ``i`` spans ``f[i]..f[i+2]`` with height ``2 / (f[i+2] - f[i])``, area 1 (Hz)."""
    rate, n_fft, n_mels = 16000, 1024, 16
    bank = mel_filter_bank(n_fft // 2 + 1, n_mels, rate)
    assert bank.shape == (n_fft // 2 + 1, n_mels) and (bank >= 0).all()
    df = rate / n_fft
    torch.testing.assert_close(bank.sum(0) * df, torch.ones(n_mels), rtol=0.1, atol=0)
    # Centre of filter i: mel^-1 of the (i + 1)-th of n_mels + 2 points evenly spaced on the Slaney mel scale.
    top = 1000 / (200 / 3) + math.log(8000 / 1000) / (math.log(6.4) / 27)  # 8 kHz in Slaney mels
    for i in range(n_mels):
        m = top * (i + 1) / (n_mels + 1)
        hz = m * 200 / 3 if m < 15 else 1000 * math.exp((math.log(6.4) / 27) * (m - 15))
        assert abs(int(bank[:, i].argmax()) * df - hz) <= df


def test_log_mel_is_the_stft_of_each_frame_through_the_filters():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4000, generator=g) * 0.1
    n_fft, hop, n_mels, rate = 256, 160, 16, 16000
    mel = log_mel(x, sample_rate=rate, n_fft=n_fft, hop_length=hop, n_mels=n_mels)
    assert mel.shape == (2, 1 + 4000 // hop, n_mels)
    padded = np.pad(x.double().numpy(), ((0, 0), (n_fft // 2, n_fft // 2)), mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)  # periodic Hann (torch.hann_window)
    bank = mel_filter_bank(n_fft // 2 + 1, n_mels, rate).double().numpy()
    for c, t in ((0, 0), (1, 7), (0, 25)):
        frame = padded[c, t * hop : t * hop + n_fft] * window
        expected = np.log(np.maximum(np.abs(np.fft.rfft(frame)) @ bank, 1e-5))
        np.testing.assert_allclose(mel[c, t].double().numpy(), expected, rtol=1e-4, atol=1e-4)


# -- the adapter's target codec ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapter(tiny_ltx2):
    from ff_ltx2 import LTX2T2AVAdapter

    return LTX2T2AVAdapter.from_pretrained(tiny_ltx2("t2av"), **ADAPTER_KWARGS)


def test_target_mel_is_aligned_to_the_audio_latents(adapter):
    """A 1.5 s 22.05 kHz mono WAV becomes 4 L mel frames of the stereo 16 kHz clip clock, L the pipeline's
    ``audio_num_frames``; a low and a high tone peak in different mel bins."""
    low = adapter.target_mel(DecodedAudio(tone(220.0, 1.5, 22050), 22050), 0.0, "low")
    high = adapter.target_mel(DecodedAudio(tone(880.0, 1.5, 22050), 22050), 0.0, "high")
    assert low.shape == high.shape == (2, 4 * AUDIO_LATENTS, 16)
    assert int(low.mean((0, 1)).argmax()) < int(high.mean((0, 1)).argmax())
    # The manifest's sample_rate is a clock: 0.75 s of samples declared at half their rate cover the 1.125 s clip.
    declared = DecodedAudio(tone(220.0, 0.75, 22050), 22050, declared_sample_rate=11025.0)
    assert adapter.target_mel(declared, 0.0, "declared").shape == low.shape


def test_audio_shorter_than_the_clip_is_right_padded_with_silence(adapter, tiny_ltx2):
    """Flow-Factory's ``prepare_ltx2_target_audio`` (transcribed: cut the source to the clip's duration, convert it,
    right-pad it with zeros onto the model's sample count, never reject it): 0.5 s of a 16 kHz stereo tone for the
    1.125 s clip gives the log-mel of that tone followed by zeros up to the ``4 L`` mel hops (17,920 samples), built by
    hand here, and encodes as that hand-padded waveform does. ``audio_tolerance`` (seconds) brings back the old
    rejection."""
    from ff_ltx2 import LTX2T2AVAdapter

    short = tone(220.0, 0.5, 16000, 2)
    samples = 4 * AUDIO_LATENTS * 160
    padded = torch.cat([short, torch.zeros(2, samples - short.shape[1])], dim=1)  # by hand: silence after 0.5 s
    expected = log_mel(padded, sample_rate=16000, n_fft=1024, hop_length=160, n_mels=16)[:, : 4 * AUDIO_LATENTS]
    torch.testing.assert_close(adapter.target_mel(short, 0.0, "short"), expected, rtol=0, atol=0)
    # Resampled from 22.05 kHz too: 0.5 s of tone, then nothing but silence.
    x = adapter.target_mel(DecodedAudio(tone(220.0, 0.5, 22050), 22050), 0.0, "resampled")
    assert x.shape == expected.shape and torch.allclose(x[:, 60:], torch.tensor(math.log(1e-5)))
    condition = adapter.prepare_condition(torch.utils.data.default_collate(adapter.preprocess([ConditionInput("a")])))
    g = torch.Generator().manual_seed(0)
    video = torch.randint(0, 256, (FRAMES, 3, SIZE, SIZE), dtype=torch.uint8, generator=g)
    ours = adapter.encode_output([[video, short]], condition).components["audio"]
    hand = adapter.encode_output([[video, padded]], condition).components["audio"]
    torch.testing.assert_close(ours, hand, rtol=0, atol=0)
    strict = LTX2T2AVAdapter.from_pretrained(tiny_ltx2("t2av"), **ADAPTER_KWARGS, audio_tolerance=0.05)
    with pytest.raises(ValueError, match=r"media\[0\]\[1\]: the audio covers 0\.500 s .* needs 1\.125 s"):
        strict.target_mel(short, 0.0, "media[0][1]")


def test_audio_past_the_clip_clock_is_kept_not_padded(tiny_ltx2):
    """9 frames at 6 fps: a 1.5 s clip, L = round(37.5) = 38 latent frames, 4 L hops = 24,320 samples at 16 kHz,
    past the clip's 24,000. A longer source fills them with its own audio (the mel of its first 24,320 samples, by
    hand), not with 320 samples of silence; a source of exactly the clip's duration is still accepted (padded)."""
    from ff_ltx2 import LTX2T2AVAdapter

    adapter = LTX2T2AVAdapter.from_pretrained(tiny_ltx2("t2av"), **{**ADAPTER_KWARGS, "frame_rate": 6.0})
    assert adapter.audio_latent_frames == 38 and 4 * 38 * 160 > 1.5 * 16000
    source = tone(220.0, 2.0, 16000, 2)
    got = adapter.target_mel(source, 0.0, "long")
    expected = log_mel(source[:, : 4 * 38 * 160], sample_rate=16000, n_fft=adapter.mel_n_fft, hop_length=160,
                       n_mels=16)[:, : 4 * 38]  # fmt: skip
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert adapter.target_mel(source[:, :24000], 0.0, "exact").shape == got.shape
    # Resampled from 22.05 kHz: the cut covers the 4 L hops, so the model-rate waveform ends in the tone, not silence.
    keep = 4 * 38 * 160 / 16000
    window = clock_window(tone(220.0, 2.0, 22050), 22050, 0.0, 1.5, tolerance=0.05, what="t", keep=keep)
    x = to_model_rate(window, 22050, 16000, 2, 4 * 38 * 160)
    assert float(x[:, -40:].abs().max()) > 0.1


def test_encode_output_takes_both_posterior_modes_or_samples_seeded_by_the_generator(adapter, tiny_ltx2):
    """Default (``target_posterior="mode"``, ltx-trainer / Flow-Factory): both streams are the posteriors' modes, the
    same whatever the generator; ``target_posterior="sample"``: samples drawn from the generator, video first."""
    from ff_ltx2 import LTX2T2AVAdapter

    sampling = LTX2T2AVAdapter.from_pretrained(tiny_ltx2("t2av"), **ADAPTER_KWARGS, target_posterior="sample")
    condition = adapter.prepare_condition(torch.utils.data.default_collate(adapter.preprocess([ConditionInput("a")])))
    g = torch.Generator().manual_seed(0)
    video = torch.randint(0, 256, (FRAMES, 3, SIZE, SIZE), dtype=torch.uint8, generator=g)
    media = [[video, tone(220.0, FRAMES / FPS, 16000, 2)]]

    def run(seed, who=sampling):
        return who.encode_output(media, condition, generator=torch.Generator().manual_seed(seed))

    a, b, c = run(0), run(0), run(1)
    assert list(a.components) == ["video", "audio"]
    assert a.components["video"].shape == (1, 4, (FRAMES - 1) // 2 + 1, SIZE // 8, SIZE // 8)
    assert a.components["audio"].shape == (1, 2, AUDIO_LATENTS, 4)
    mode0, mode1 = run(0, adapter), run(1, adapter)
    for name in a.components:
        torch.testing.assert_close(a.components[name], b.components[name], rtol=0, atol=0)
        assert not torch.equal(a.components[name], c.components[name])
        torch.testing.assert_close(mode0.components[name], mode1.components[name], rtol=0, atol=0)
        assert not torch.equal(mode0.components[name], a.components[name])
    with pytest.raises(ValueError, match=r"media\[0\]: ltx2_t2av trains on exact \(video, audio\) pairs"):
        adapter.encode_output([[video]], condition)


def test_the_audio_cut_follows_the_clip_clock_when_the_clip_starts_after_0(adapter, tmp_path):
    """One clock for both streams (docs/ltx2.md, "The codec"): a clip starting 0.25 s into its clock, from a video
    declared at twice its file rate (16 fps for an 8 fps file: the clip's 0.25 s is the file's 0.5 s) and an audio
    declared at twice its file rate (16 kHz for 8 kHz), both streams starting after 0 in their files (PyAV
    ``start_time`` 0.5 s and 0.25 s). The cut starts at sample ``0.25 * 16000 = 4000`` of the audio stream, by hand;
    the file's seconds (the video window's 0.5 s) would start it at 8000."""
    import av

    from ff_core.contracts import MediaGeometry, MediaType
    from ff_core.data.media.geometry import decode_target
    from ff_core.data.records.base import MediaItem
    from ff_core.testing.clips import write_offset_streams

    noise = np.random.default_rng(0).integers(-20000, 20000, 32000).astype(np.int16)  # 2 s at 16 kHz on the clock
    video_file, audio_file = write_offset_streams(tmp_path, SIZE, 8, 24, 8000, noise)
    for path, kind in ((video_file, "video"), (audio_file, "audio")):
        with av.open(str(path)) as container:
            assert getattr(container.streams, kind)[0].start_time not in (None, 0)
    clip = MediaGeometry(SIZE, SIZE, num_frames=FRAMES, fps=FPS, start=0.25)
    video = decode_target(MediaItem(MediaType.VIDEO, video_file, fps=16.0), clip)
    audio = decode_target(MediaItem(MediaType.AUDIO, audio_file, sample_rate=16000.0), None)
    assert video.window[0] == pytest.approx(0.5) and float(video.timestamps[0]) == pytest.approx(0.25)
    _, [start] = adapter._videos([[video, audio]])
    got = adapter.target_mel(audio, start, "media[0][1]")
    samples = 4 * AUDIO_LATENTS * 160  # the 4 L mel hops at the VAE's 16 kHz, inside the clip's 18,000 samples
    expected = torch.from_numpy(noise[4000 : 4000 + samples].astype(np.float32) / 32768.0)[None].repeat(2, 1)
    expected = log_mel(expected, sample_rate=16000, n_fft=adapter.mel_n_fft, hop_length=160, n_mels=16)
    torch.testing.assert_close(got, expected[:, : 4 * AUDIO_LATENTS], rtol=0, atol=0)
