"""Video and audio samples to files, TensorBoard, W&B (offline) and CSV, from tensors."""

from __future__ import annotations

import csv
import io
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageSequence

from ff_core.callbacks.media_log import (
    EvalSample,
    audio_to_wav,
    log_csv,
    log_tensorboard,
    video_to_gif,
    video_to_mp4,
    write_sample_files,
)


def palette_video(t: int = 3, h: int = 4, w: int = 6) -> torch.Tensor:
    """uint8 (T, 3, H, W) frames of a few saturated colours (GIF's 256-colour palette holds them exactly)."""
    colours = torch.tensor([[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 255], [0, 0, 0]], dtype=torch.uint8)
    pick = torch.randint(0, len(colours), (t, h, w), generator=torch.Generator().manual_seed(0))
    return colours[pick].permute(0, 3, 1, 2).contiguous()


def tone(channels: int = 2, n: int = 800, rate: int = 8000) -> torch.Tensor:
    t = torch.arange(n) / rate
    return torch.stack([0.5 * torch.sin(2 * torch.pi * 440 * (c + 1) * t) for c in range(channels)])


def test_video_to_gif_round_trips_frames_and_fps():
    video = palette_video()
    gif = Image.open(io.BytesIO(video_to_gif(video, fps=10)))
    frames = [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(gif)]
    assert len(frames) == 3
    for got, expected in zip(frames, video):
        np.testing.assert_array_equal(got, expected.permute(1, 2, 0).numpy())
    assert gif.info["duration"] == 100  # 10 fps: 100 ms a frame
    with pytest.raises(ValueError, match=r"a video is uint8 \(T, 3, H, W\)"):
        video_to_gif(video[0])


def test_audio_to_wav_is_interleaved_16_bit_pcm():
    audio = tone()
    audio[0, 0] = 1.5  # clipped to full scale
    with wave.open(io.BytesIO(audio_to_wav(audio, 8000))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (2, 2, 8000, 800)
        pcm = np.frombuffer(w.readframes(800), dtype="<i2").reshape(800, 2).T
    expected = np.round(audio.clamp(-1, 1).numpy() * 32767).astype(np.int16)
    np.testing.assert_array_equal(pcm, expected)
    assert pcm[0, 0] == 32767


def av_sample(index: int) -> EvalSample:
    return EvalSample(index, f"prompt {index}", [palette_video(), tone()], ("video", "audio"), (12.5, 8000),
                      {"loud": -6.0 - index}, -6.0 - index)


def test_video_and_audio_reach_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    log_tensorboard(writer, [av_sample(3)], None, step=7)
    writer.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "audio": 0})
    events.Reload()
    [video] = events.Images("val/sample_00003")
    assert (video.step, video.width, video.height) == (7, 6, 4)
    assert Image.open(io.BytesIO(video.encoded_image_string)).n_frames == 3
    [audio] = events.Audio("val/sample_00003_1")
    assert (audio.sample_rate, audio.length_frames, audio.content_type) == (8000, 800, "audio/wav")
    with wave.open(io.BytesIO(audio.encoded_audio_string)) as w:
        assert w.getnchannels() == 2


def test_video_and_audio_files_and_csv_rows(tmp_path):
    samples = [av_sample(0), av_sample(1)]
    paths = write_sample_files(samples, tmp_path / "files")
    assert sorted(p.name for p in paths.values()) == ["00000.gif", "00000_1.wav", "00001.gif", "00001_1.wav"]
    table = log_csv(tmp_path, samples, step=5)
    log_csv(tmp_path, samples[:1], step=6)  # a second validation appends
    rows = list(csv.DictReader(table.open()))
    expected = [(step, i, kind, f"media/val_step_{step:06d}/{i:05d}{suffix}")
                for step, indices in ((5, (0, 1)), (6, (0,))) for i in indices
                for kind, suffix in (("video", ".gif"), ("audio", "_1.wav"))]
    assert [(int(r["step"]), int(r["index"]), r["output"], r["path"]) for r in rows] == expected
    assert [float(r["reward/loud"]) for r in rows] == [-6, -6, -7, -7, -6, -6]
    assert all((tmp_path / r["path"]).stat().st_size > 0 for r in rows)


def test_media_writer_writes_video_and_audio_predictions(tmp_path):
    import json
    from types import SimpleNamespace

    from ff_core.callbacks import MediaWriter

    writer = MediaWriter(dirpath=str(tmp_path))
    writer.setup(None, None, "predict")
    prediction = {"index": [4], "prompt": ["a clip"], "media": [[palette_video(), tone()]],
                  "output_types": ("video", "audio"), "rates": (12.5, 8000), "metadata": [{}]}
    writer.write_on_batch_end(SimpleNamespace(global_rank=0), None, prediction, None, None, 0, 0)
    [line] = (tmp_path / "rank0.jsonl").read_text().splitlines()
    assert json.loads(line) == {"index": 4, "prompt": "a clip", "files": ["00004.gif", "00004_1.wav"]}
    assert Image.open(tmp_path / "00004.gif").n_frames == 3
    with wave.open(str(tmp_path / "00004_1.wav")) as w:
        assert (w.getnchannels(), w.getframerate()) == (2, 8000)


def test_wandb_logs_the_muxed_mp4_for_real(tmp_path, monkeypatch):
    """wandb itself, offline (its files under tmp_path): a (video, audio) sample written as MP4 reaches W&B as that
    one file, read back with PyAV: a video stream and the AAC soundtrack of the audio output (rate, channels,
    duration), its audio not logged again; a GIF sample keeps its WAV beside it; the rewards table. Without the disk
    files, log_wandb writes them under the run's folder first."""
    wandb = pytest.importorskip("wandb")
    import json

    import av
    from lightning.pytorch.loggers import WandbLogger

    from ff_core.callbacks.media_log import log_wandb, send_to_loggers

    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rate, fps, frames = 16000, 8.0, 9
    clip = [palette_video(t=frames, h=8, w=8), tone(2, n=round(frames / fps * rate), rate=rate)]
    samples = [EvalSample(0, "a clip", clip, ("video", "audio"), (fps, rate), {"loud": -6.0}, -6.0, "mp4"),
               EvalSample(1, "a gif", clip, ("video", "audio"), (fps, rate), {"loud": -7.0}, -7.0, "gif")]
    files = write_sample_files(samples, tmp_path / "samples")
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="ff-test", settings=wandb.Settings(
        console="off", save_code=False, x_disable_stats=True, x_disable_meta=True, x_disable_machine_info=True))
    run = logger.experiment
    try:
        assert send_to_loggers([logger], samples, Image.new("RGB", (4, 4)), step=4, paths=files) == ["wandb"]
        log_wandb(logger, samples[:1], None, step=5, prefix="test")  # no files given: written under the run
        summary = json.loads(json.dumps(dict(run.summary), default=dict))
    finally:
        run.finish()
        wandb.teardown()  # its service process ends here, not at the end of the test session
    run_dir = Path(run.dir)
    video = summary["val/sample_00000"]
    assert video["_type"] == "video-file" and video["path"].endswith(".mp4")
    logged = run_dir / video["path"]
    assert logged.read_bytes() == files[(0, 0)].read_bytes()  # the very file on disk
    with av.open(str(logged)) as container:
        assert float(container.streams.video[0].average_rate) == fps
        assert len(list(container.decode(video=0))) == frames
    with av.open(str(logged)) as container:
        sound = container.streams.audio[0]
        assert (sound.codec_context.name, sound.rate, sound.channels) == ("aac", rate, 2)
        assert float(sound.duration * sound.time_base) == pytest.approx(frames / fps, abs=1e-3)
    assert "val/sample_00000_1" not in summary  # the soundtrack is not logged twice
    assert summary["val/sample_00001"]["path"].endswith(".gif")  # a GIF is silent: its audio beside it
    assert summary["val/sample_00001_1"]["_type"] == "audio-file"
    assert summary["val/samples_table"]["_type"] == "table-file" and summary["trainer/global_step"] == 5
    test_video = run_dir / summary["test/sample_00000"]["path"]
    with av.open(str(test_video)) as container:
        assert len(container.streams.audio) == 1
    assert (run_dir.parent / "ff_samples" / "test_step_000005" / "00000.mp4").is_file()


@pytest.mark.parametrize(("fps", "size"), [(8.0, (16, 24)), (23.976, (15, 9))])  # odd sides are padded to even
def test_video_to_mp4_round_trips_frames_and_fps(fps, size):
    """H.264 through PyAV: every frame back (within the codec's loss on smooth content), at the given rate."""
    import av

    t, (h, w) = 5, size
    ramp = (torch.arange(h)[:, None] * 8 + torch.arange(w)[None, :] * 4).clamp(0, 255)
    video = torch.stack([torch.stack([(ramp + 20 * k).clamp(0, 255)] * 3) for k in range(t)]).to(torch.uint8)
    with av.open(io.BytesIO(video_to_mp4(video, fps))) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        assert abs(float(stream.average_rate) - fps) < 1e-3
    assert len(frames) == t and frames[0].shape[:2] == (h + h % 2, w + w % 2)
    decoded = torch.from_numpy(np.stack(frames))[:, :h, :w].permute(0, 3, 1, 2).float()
    assert (decoded - video.float()).abs().mean() < 4


def test_sample_files_write_videos_as_mp4_when_asked(tmp_path):
    import av

    sample = EvalSample(3, "a clip", [palette_video(t=4, h=8, w=8)], ("video",), (12.0,), video_format="mp4")
    paths = write_sample_files([sample], tmp_path)
    assert paths[(3, 0)].name == "00003.mp4"
    with av.open(str(paths[(3, 0)])) as container:
        assert container.streams.video[0].frames in (0, 4) and float(container.streams.video[0].average_rate) == 12
        assert len(list(container.decode(video=0))) == 4
    with pytest.raises(ValueError, match="video_format must be one of"):
        from ff_core.callbacks import SampleGrid

        SampleGrid(video_format="webm")


def test_an_audio_output_after_a_video_is_muxed_as_its_soundtrack(tmp_path):
    """An ordered (video, audio) sample (LTX-2, MiniMax H3): the MP4 carries the audio as an AAC track of the output's
    rate and channels, lasting as long as the video; the WAV is written as well. The tone's pitch survives: the
    decoded track's spectrum peaks at 440 Hz."""
    import av

    rate, fps, frames = 16000, 8.0, 9
    audio = tone(2, n=round(frames / fps * rate), rate=rate)
    sample = EvalSample(0, "a clip", [palette_video(t=frames, h=8, w=8), audio], ("video", "audio"), (fps, rate),
                        video_format="mp4")  # fmt: skip
    paths = write_sample_files([sample], tmp_path)
    assert sorted(p.name for p in paths.values()) == ["00000.mp4", "00000_1.wav"]
    with av.open(str(paths[(0, 0)])) as container:
        video, sound = container.streams.video[0], container.streams.audio[0]
        assert (sound.rate, sound.channels) == (rate, 2)
        assert float(sound.duration * sound.time_base) == pytest.approx(frames / fps, abs=1e-3)
        assert float(video.duration * video.time_base) == pytest.approx(frames / fps, abs=1e-3)
        pcm = np.concatenate([f.to_ndarray() for f in container.decode(sound)], axis=1)
    spectrum = np.abs(np.fft.rfft(pcm[0, 1024 : 1024 + rate // 2]))
    assert np.argmax(spectrum) * 2 == pytest.approx(440, abs=2)  # half a second: 2 Hz per bin
    with pytest.raises(ValueError, match="a soundtrack is float"):
        video_to_mp4(palette_video(), audio=torch.zeros(3, 10))
