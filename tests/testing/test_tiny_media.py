"""The tiny video and audio builders of ff_core.testing.tiny (a Wan video VAE, an Oobleck audio VAE, each saved,
loaded back and optionally trained and cached), the audio+video and preference-pair datasets, and ``train_vae`` at any
number of steps."""

import numpy as np
import pytest
import torch

from ff_core.contracts import AUDIO_OUT, IMAGE_OUT, VIDEO_OUT, PipelineIOContract
from ff_core.data.media.decode import decode_media
from ff_core.data.records.sources import DatasetConfig, load_split
from ff_core.data.records.validation import check_records
from ff_core.testing import tiny
from ff_core.testing.tiny import (
    OUTPUT_KINDS,
    PITCHES,
    build_tiny_audio_vae,
    build_tiny_image_vae,
    build_tiny_video_vae,
    train_vae,
    write_tiny_dataset,
)

CONTRACTS = {"image": (IMAGE_OUT,), "video": (VIDEO_OUT,), "audio": (AUDIO_OUT,), "video+audio": (VIDEO_OUT, AUDIO_OUT)}


def records(root, trainer):
    return load_split(DatasetConfig(name="tiny", dataset_dir=str(root)), "train", trainer)


def pitch(waveform: torch.Tensor, rate: int) -> str:
    """The :data:`PITCHES` word of a tone's strongest frequency (its FFT peak)."""
    spectrum = np.abs(np.fft.rfft(waveform.mean(0).numpy()))
    hz = np.fft.rfftfreq(waveform.shape[-1], 1 / rate)[spectrum.argmax()]
    return min(PITCHES, key=lambda word: abs(PITCHES[word] - hz))


@pytest.mark.parametrize("steps", range(1, 13))
def test_train_vae_runs_any_number_of_steps(steps):
    """OneCycleLR divides by each phase's length: with a 10 % warm-up, fewer than 11 steps left one empty
    (ZeroDivisionError); every count trains and moves the weights now."""
    vae = build_tiny_image_vae(seed=0, image_size=8, block_out_channels=(8, 8))
    before = [p.detach().clone() for p in vae.parameters()]
    images = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1
    loss = train_vae(vae, images, steps=steps, batch_size=2, lr=1e-3, kl_weight=1e-6, seed=0)
    assert np.isfinite(loss) and not vae.training
    assert any(not torch.equal(a, b) for a, b in zip(before, vae.parameters()))


def test_train_vae_refuses_no_steps():
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        train_vae(build_tiny_image_vae(image_size=8, block_out_channels=(8, 8)), torch.zeros(1, 3, 8, 8), steps=0,
                  batch_size=1, lr=1e-3, kl_weight=0.0, seed=0)  # fmt: skip


def test_video_vae_has_wans_layout_and_a_normalisation_to_catch(tmp_path):
    from diffusers import AutoencoderKLWan

    vae = build_tiny_video_vae(seed=3)
    mean, std = vae.config.latents_mean, vae.config.latents_std
    assert len(mean) == len(std) == 4 and any(abs(m) > 0.01 for m in mean) and any(abs(s - 1) > 0.05 for s in std)
    assert (vae.config.scale_factor_temporal, vae.config.scale_factor_spatial) == (4, 8)
    assert build_tiny_video_vae(seed=3).config.latents_mean == mean  # drawn from the seed
    vae.save_pretrained(tmp_path / "vae")
    loaded = AutoencoderKLWan.from_pretrained(tmp_path / "vae")
    assert loaded.config.latents_std == std
    x = torch.rand(1, 3, 5, 32, 32) * 2 - 1  # 5 frames: (5 - 1) / 4 + 1 = 2 latent frames
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mode()
        assert z.shape == (1, 4, 2, 4, 4) and torch.equal(z, loaded.encode(x).latent_dist.mode())
    given = build_tiny_video_vae(z_dim=2, latents_mean=[0.5, -0.5], latents_std=[2.0, 0.5])
    assert (given.config.latents_mean, given.config.latents_std) == ([0.5, -0.5], [2.0, 0.5])
    with pytest.raises(ValueError, match="need 2 values"):
        build_tiny_video_vae(z_dim=2, latents_mean=[0.0])


def test_trained_video_vae_fits_its_statistics_and_is_built_once(tmp_path, monkeypatch):
    videos = write_tiny_dataset(tmp_path / "clips", "video", n=2) / "videos"
    kwargs = dict(seed=1, train_dir=videos, steps=1, batch_size=2, cache_dir=tmp_path / "cache")
    a = build_tiny_video_vae(**kwargs)
    assert a.config.latents_mean != build_tiny_video_vae(seed=1).config.latents_mean  # fitted to the clips
    clips = tiny.load_clips(videos, 5, 32)
    assert clips.shape == (2, 3, 5, 32, 32) and -1 <= clips.min() and clips.max() <= 1
    torch.manual_seed(0)
    with torch.no_grad():
        z = a.encode(clips).latent_dist.sample()
    mean = torch.tensor(a.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(a.config.latents_std).view(1, -1, 1, 1, 1)
    normalised = ((z - mean) / std).transpose(0, 1).flatten(1)  # (C, everything else): per channel
    torch.testing.assert_close(normalised.mean(1), torch.zeros(4), atol=1e-4, rtol=0)
    torch.testing.assert_close(normalised.std(1), torch.ones(4), atol=1e-4, rtol=0)
    tiny._VAE_CACHE.clear()  # a new session: loaded back from the folder, not trained again
    monkeypatch.setattr(tiny, "train_vae", lambda *a, **k: pytest.fail("the cached video VAE was trained again"))
    b = build_tiny_video_vae(**kwargs)
    assert b is not a and all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    assert b.config.latents_mean == a.config.latents_mean


def test_audio_vae_shapes_and_a_trained_cached_copy(tmp_path, monkeypatch):
    """Oobleck: samples / prod(downsampling_ratios) latent frames; ``weight_norm`` modules, which ``copy.deepcopy``
    refuses once they ran: the cache hands out copies all the same."""
    vae = build_tiny_audio_vae(seed=2, sample_rate=8000, latent_channels=4, downsampling_ratios=(2, 4, 8))
    with torch.no_grad():
        posterior = vae.encode(torch.rand(2, 1, 640) * 2 - 1).latent_dist
        assert posterior.mode().shape == (2, 4, 10)
        assert vae.decode(posterior.mode()).sample.shape == (2, 1, 640)
    tones = write_tiny_dataset(tmp_path / "tones", "audio", n=2) / "audio"
    waves = tiny.load_waveforms(tones, 8000, 1, 4000)  # 16 kHz files, resampled once
    assert waves.shape == (2, 1, 4000) and pitch(waves[0], 8000) == "low"
    kwargs = dict(seed=2, train_dir=tones, steps=2, batch_size=2, cache_dir=tmp_path / "cache")
    a = build_tiny_audio_vae(**kwargs)
    b = build_tiny_audio_vae(**kwargs)  # from memory: a copy after the trained one ran forwards
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    assert not all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), vae.state_dict().values()))
    tiny._VAE_CACHE.clear()
    monkeypatch.setattr(tiny, "train_vae", lambda *a, **k: pytest.fail("the cached audio VAE was trained again"))
    c = build_tiny_audio_vae(**kwargs)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), c.state_dict().values()))


def test_audio_video_pairs_are_v2_records_of_an_av_contract(tmp_path):
    """Each target is the ordered (video with fps, audio with sample_rate) pair an LTX-2-like contract requires; the
    WAV lasts exactly the clip and sounds the pitch its caption names."""
    root = write_tiny_dataset(tmp_path / "av", "video+audio", n=3)
    found = records(root, "sft")
    check_records(found, PipelineIOContract(outputs=CONTRACTS["video+audio"]))
    for record in found:
        ((video, audio),) = record.candidates
        assert (video.fps, audio.sample_rate) == (8.0, 16000)
        clip, sound = decode_media(video), decode_media(audio)
        assert clip.frames.shape == (9, 32, 32, 3)
        assert sound.waveform.shape[-1] == round(9 / 8.0 * 16000)
        assert pitch(sound.waveform, 16000) in record.prompt and record.metadata["pitch"] in record.prompt


@pytest.mark.parametrize("kind", OUTPUT_KINDS)
def test_preference_pairs_differ_in_what_the_caption_names(kind, tmp_path):
    """Offline-DPO records of every output kind: chosen as the caption says, rejected not (another colour, the other
    direction of motion, another pitch), otherwise alike; valid for the contract of that kind."""
    from ff_core.testing.moving_shapes import motion_direction, prompt_motion
    from ff_core.testing.shapes import dominant_colour, prompt_colour

    root = write_tiny_dataset(tmp_path / kind, kind, n=4, supervision="preference")
    found = records(root, "offline-dpo")
    assert len(found) == 4 and {r.supervision for r in found} == {"preference"}
    check_records(found, PipelineIOContract(outputs=CONTRACTS[kind]))
    for record in found:
        chosen, rejected = ([decode_media(m) for m in arm] for arm in record.candidates)
        if kind == "image":
            assert dominant_colour(chosen[0]) == prompt_colour(record.prompt) != dominant_colour(rejected[0])
        if kind == "video":
            wanted = prompt_motion(record.prompt)[1]
            assert motion_direction(chosen[0].frames) == wanted != motion_direction(rejected[0].frames)
        if kind in ("audio", "video+audio"):
            sound, other = chosen[-1], rejected[-1]
            assert pitch(sound.waveform, sound.sample_rate) in record.prompt
            assert pitch(other.waveform, other.sample_rate) not in record.prompt
        if kind == "video+audio":
            assert torch.equal(chosen[0].frames, rejected[0].frames)  # the same square: only the sound differs


def test_unknown_kind_or_supervision_is_refused(tmp_path):
    with pytest.raises(ValueError, match="kind must be one of"):
        write_tiny_dataset(tmp_path / "x", "audio+video")
    with pytest.raises(ValueError, match="supervision must be one of"):
        write_tiny_dataset(tmp_path / "x", "video", supervision="grpo")
    assert not (tmp_path / "x").exists()


def test_the_dataset_cli_writes_a_kind(tmp_path, capsys):
    tiny.main([str(tmp_path / "av"), "--kind", "video+audio", "--n", "2", "--supervision", "preference"])
    assert "wrote 2 video+audio preference records" in capsys.readouterr().out
    assert len(records(tmp_path / "av", "offline-dpo")) == 2
