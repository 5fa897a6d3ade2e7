"""Media decoders on files written by the fixtures (PNG, H.264 MP4 with an AAC track, PCM WAV), corrupt ones
included. Every failure names the referencing record (``source:line``), the field and the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ff_core.contracts import MediaType
from ff_core.data.media.decode import (
    DecodedAudio,
    DecodedVideo,
    MediaHeader,
    check_files_exist,
    check_media,
    decode_audio,
    decode_image,
    decode_media,
    decode_video,
    missing_files,
    probe_media,
)
from ff_core.data.records import MediaItem, Record
from ff_core.errors import DatasetError, DatasetErrors

SRC = (Path("data/train.jsonl"), 4)


def assert_close(found: torch.Tensor, expected: torch.Tensor, atol: float = 1e-7) -> None:
    # torch.testing.assert_close costs ~3 s on its first call here (lazy imports); this is enough for these checks
    assert found.shape == expected.shape, (found.shape, expected.shape)
    assert (found.double() - expected.double()).abs().max().item() <= atol, (found, expected)


def test_image_rgb_uint8(media_files):
    image = decode_image(media_files["png"])
    assert image.dtype == torch.uint8 and image.shape == (3, 8, 12)
    assert image[:, 0, 0].tolist() == [10, 20, 30]


def test_image_modes_convert_to_rgb(tmp_path):
    from PIL import Image

    Image.new("RGBA", (4, 2), (1, 2, 3, 4)).save(tmp_path / "a.png")
    Image.new("L", (4, 2), 9).save(tmp_path / "g.png")
    assert decode_image(tmp_path / "a.png")[:, 0, 0].tolist() == [1, 2, 3]
    assert decode_image(tmp_path / "g.png").shape == (3, 2, 4)


def test_video_frames_fps_timestamps(media_files):
    video = decode_video(media_files["mp4"], declared_fps=25.0)
    assert isinstance(video, DecodedVideo)
    assert video.frames.dtype == torch.uint8 and video.frames.shape == (12, 16, 24, 3)
    assert video.fps == pytest.approx(24.0) and video.declared_fps == 25.0 and video.clock_fps == 25.0
    assert_close(video.timestamps, torch.arange(12, dtype=torch.float64) / 24)
    # frame i was written as the grey value 10 * i (H.264 is lossy: allow a small error)
    means = video.frames.float().mean(dim=(1, 2, 3))
    assert_close(means, torch.arange(12).float() * 10, atol=3.0)
    assert video.audio is None  # decode_video is frames only; decode_media adds the soundtrack


def test_video_time_window(media_files):
    window = decode_video(media_files["mp4"], start=0.2, end=0.4)
    # frames at k/24 s with 0.2 <= t < 0.4 -> k = 5..9
    assert_close(window.timestamps, torch.arange(5, 10, dtype=torch.float64) / 24)
    full = decode_video(media_files["mp4"])
    assert_close(window.frames.float(), full.frames[5:10].float())


def test_audio_float32_at_file_rate_never_resampled(media_files):
    audio = decode_audio(media_files["wav"], declared_sample_rate=16000)
    assert isinstance(audio, DecodedAudio)
    assert audio.waveform.dtype == torch.float32 and audio.waveform.shape == (2, 2000)
    assert audio.sample_rate == 8000 and audio.declared_sample_rate == 16000 and audio.clock_rate == 16000
    # the fixture's tone: 0.25 * sin(2 pi 440 t), quantised to 16 bits
    t = torch.arange(2000) / 8000
    assert_close(audio.waveform[0], 0.25 * torch.sin(2 * torch.pi * 440 * t), atol=1e-4)
    assert_close(audio.waveform[0], audio.waveform[1])


def test_audio_window(media_files):
    audio = decode_audio(media_files["wav"], start=0.05, end=0.1)
    assert audio.waveform.shape == (2, 400) and audio.start == pytest.approx(0.05)
    full = decode_audio(media_files["wav"])
    assert_close(audio.waveform, full.waveform[:, 400:800])


def test_embedded_aac_soundtrack(media_files):
    audio = decode_audio(media_files["mp4"])
    assert audio.sample_rate == 16000 and audio.waveform.shape[0] == 2
    assert audio.waveform.shape[1] >= 8000  # 0.5 s (AAC adds encoder padding)
    assert decode_audio(media_files["mp4_silent"], required=False) is None


def test_decode_media_video_soundtrack_embedded_or_separate(media_files):
    embedded = decode_media(MediaItem(MediaType.VIDEO, media_files["mp4"], fps=12.0))
    assert embedded.audio is not None and embedded.audio.sample_rate == 16000 and embedded.declared_fps == 12.0
    separate = decode_media(MediaItem(MediaType.VIDEO, media_files["mp4"], sample_rate=9000.0,
                                      audio_path=media_files["wav"]))
    assert separate.audio.sample_rate == 8000 and separate.audio.declared_sample_rate == 9000.0
    silent = decode_media(MediaItem(MediaType.VIDEO, media_files["mp4_silent"]))
    assert silent.audio is None and silent.frames.shape[0] == 6
    assert decode_media(MediaItem(MediaType.IMAGE, media_files["png"])).shape == (3, 8, 12)
    assert decode_media(MediaItem(MediaType.AUDIO, media_files["wav"])).sample_rate == 8000


BROKEN = [
    ("image", "missing", "file not found"),
    ("image", "truncated_png", "cannot decode image"),
    ("image", "garbage_png", "cannot decode image"),
    ("video", "missing", "file not found"),
    ("video", "truncated_mp4", "cannot decode video"),
    ("video", "garbage_mp4", "cannot decode video"),
    ("video", "empty_mp4", "cannot decode video"),
    ("video", "wav", "no video stream"),
    ("audio", "missing", "file not found"),
    ("audio", "truncated_wav", "audio"),
    ("audio", "garbage_wav", "cannot decode audio"),
    ("audio", "mp4_silent", "no audio stream"),
    ("audio", "png", "no audio stream"),
]


@pytest.mark.parametrize("kind, name, reason", BROKEN, ids=[f"{k}-{n}" for k, n, _ in BROKEN])
def test_broken_files_name_record_field_and_file(media_files, tmp_path, kind, name, reason):
    path = tmp_path / "nope.bin" if name == "missing" else media_files[name]
    decode = {"image": decode_image, "video": decode_video, "audio": decode_audio}[kind]
    with pytest.raises(DatasetError) as info:
        decode(path, referenced_by=SRC, field="input.media[0].path")
    err = info.value
    assert (err.path, err.line, err.field) == ("data/train.jsonl", 4, "input.media[0].path")
    assert str(path) in err.reason and reason in err.reason
    assert str(err).startswith("data/train.jsonl:4: input.media[0].path: ")
    # the full decode check used by `ff data validate --check-media` fails the same way
    with pytest.raises(DatasetError, match=reason):
        check_media(MediaItem(MediaType(kind), path), referenced_by=SRC, field="f")


def test_window_without_frames(media_files):
    with pytest.raises(DatasetError, match=r"no video frames decoded in the window \[5.0, 6.0\)"):
        decode_video(media_files["mp4"], start=5.0, end=6.0)


def test_error_without_record_names_the_file(tmp_path):
    with pytest.raises(DatasetError) as info:
        decode_image(tmp_path / "x.png")
    assert info.value.path == str(tmp_path / "x.png") and info.value.reason == "file not found"


def test_check_media_durations(media_files):
    assert check_media(MediaItem(MediaType.VIDEO, media_files["mp4"])).video_seconds == pytest.approx(0.5)
    assert check_media(MediaItem(MediaType.AUDIO, media_files["wav"])).audio_seconds == pytest.approx(0.25)
    declared = check_media(MediaItem(MediaType.AUDIO, media_files["wav"], sample_rate=16000))
    assert declared.audio_seconds == pytest.approx(0.125)
    with_track = check_media(MediaItem(MediaType.VIDEO, media_files["mp4_silent"], audio_path=media_files["wav"]))
    assert with_track.video_seconds == pytest.approx(0.5) and with_track.audio_seconds == pytest.approx(0.25)
    with pytest.raises(DatasetError, match="references\\[0\\].audio_path: .*file not found"):
        check_media(MediaItem(MediaType.VIDEO, media_files["mp4"], audio_path=Path("/no.wav"), origin="references[0]"),
                    referenced_by=SRC)


def test_check_files_exist_lists_every_missing_file(media_files, tmp_path):
    items = (MediaItem(MediaType.IMAGE, media_files["png"], origin="input.media[0]"),
             MediaItem(MediaType.IMAGE, tmp_path / "gone.png", origin="input.media[1]"))
    target = (MediaItem(MediaType.VIDEO, tmp_path / "gone.mp4"),)
    record = Record(Path("t.jsonl"), 3, "p", inputs=items, supervision="demonstration", candidates=(target,),
                    schema="v2")
    with pytest.raises(DatasetErrors) as info:
        check_files_exist([record])
    assert [(e.line, e.field) for e in info.value.errors] == [
        (3, "input.media[1].path"), (3, "supervision.target.media[0].path")]


def test_check_media_reports_every_file_of_an_item(tmp_path):
    """A video and its separate soundtrack are two files: both missing is two problems, not the first only."""
    item = MediaItem(MediaType.VIDEO, tmp_path / "v.mp4", audio_path=tmp_path / "s.wav", origin="references[0]")
    with pytest.raises(DatasetErrors) as info:
        check_media(item, referenced_by=SRC)
    assert [e.format() for e in info.value.errors] == [
        f"data/train.jsonl:4: references[0].path: {tmp_path}/v.mp4: file not found",
        f"data/train.jsonl:4: references[0].audio_path: {tmp_path}/s.wav: file not found",
    ]


def test_a_bare_column_is_named_as_written(tmp_path):
    """A legacy ``image`` string column has no ``path`` key: messages name ``image``, not ``image.path``."""
    item = MediaItem(MediaType.IMAGE, tmp_path / "a.png", origin="image", bare=True)
    with pytest.raises(DatasetError) as info:
        decode_media(item, referenced_by=SRC)
    assert info.value.format() == f"data/train.jsonl:4: image: {tmp_path}/a.png: file not found"
    assert [e.field for e in missing_files(SRC, item)] == ["image"]


def test_probe_reads_headers_only(media_files):
    """``ff data inspect``'s header reader: sizes, durations, rates and channels of the fixture files."""
    assert probe_media(media_files["png"], MediaType.IMAGE) == MediaHeader(MediaType.IMAGE, width=12, height=8)
    assert probe_media(media_files["mp4"], MediaType.VIDEO) == MediaHeader(
        MediaType.VIDEO, width=24, height=16, seconds=0.5, fps=24.0)
    # Read as audio, a video file gives its embedded soundtrack.
    assert probe_media(media_files["mp4"], MediaType.AUDIO) == MediaHeader(
        MediaType.AUDIO, seconds=0.5, sample_rate=16000, channels=2)
    assert probe_media(media_files["wav"], MediaType.AUDIO) == MediaHeader(
        MediaType.AUDIO, seconds=0.25, sample_rate=8000, channels=2)


@pytest.mark.parametrize("name, mtype, reason", [
    ("garbage_png", MediaType.IMAGE, "cannot read image header: cannot identify image file"),
    ("garbage_mp4", MediaType.VIDEO, "cannot read video header: [Errno 1094995529] Invalid data found"),
    ("mp4_silent", MediaType.AUDIO, "cannot read audio header: no audio stream"),
    ("wav", MediaType.VIDEO, "cannot read video header: no video stream"),
])
def test_probe_failures_name_record_field_and_file(media_files, name, mtype, reason):
    with pytest.raises(DatasetError) as err:
        probe_media(media_files[name], mtype, referenced_by=SRC, field="input.media[0].path")
    assert str(err.value).startswith(f"data/train.jsonl:4: input.media[0].path: {media_files[name]}: {reason}")
