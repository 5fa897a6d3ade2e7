"""The conformance kit's targets are what ``ff fit``'s loader delivers (issue 31): real PNG / MP4 / WAV files decoded by
the loader's record parser, ``RecordProcessor`` (fitted to the adapter's geometry) and ``SampleCollator``, for every
output kind and for a target of two media (audio+video); an ``encode_output`` that cannot take them fails with the
form it was given. The kit against real adapters: plugins/ff_wan/tests/test_wan_kit_targets.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from ff_core.contracts import MediaGeometry, MediaType
from ff_core.data.media.decode import DecodedAudio, DecodedVideo
from ff_core.testing.conformance_targets import (
    describe_targets,
    encoding_delivered,
    loader_targets,
    media_tensor,
)

IMAGE, VIDEO, AUDIO = MediaType.IMAGE, MediaType.VIDEO, MediaType.AUDIO


def test_an_image_target_is_the_pngs_pixels_as_uint8_chw(tmp_path):
    targets = loader_targets((IMAGE,), (MediaGeometry(24, 32),), 2, size=(8, 8), folder=tmp_path)
    assert [len(t) for t in targets] == [1, 1]
    for i, (image,) in enumerate(targets):
        assert image.dtype == torch.uint8 and tuple(image.shape) == (3, 24, 32)
        written = np.asarray(Image.open(tmp_path / f"images/{i:03d}_0.png").convert("RGB"))  # read by Pillow alone
        assert torch.equal(image, torch.from_numpy(written.copy()).permute(2, 0, 1))
    assert not torch.equal(targets[0][0], targets[1][0])


def test_a_video_target_is_a_decoded_clip_on_the_geometrys_grid(tmp_path):
    """An odd canvas (written one pixel larger: yuv420p) and a clip that starts 0.25 s in, at 12 fps: the loader's
    ``decode_clip`` takes grid frames 3..7 of the file and fits them to 15 x 17."""
    geometry = MediaGeometry(15, 17, num_frames=5, fps=12.0, start=0.25)
    ((video,),) = loader_targets((VIDEO,), (geometry,), 1, size=(8, 8), folder=tmp_path)
    assert isinstance(video, DecodedVideo) and video.audio is None
    assert video.frames.dtype == torch.uint8 and tuple(video.frames.shape) == (5, 15, 17, 3)
    assert video.fps == 12.0 and video.source_frames.tolist() == [3, 4, 5, 6, 7]
    torch.testing.assert_close(video.timestamps, 0.25 + torch.arange(5, dtype=torch.float64) / 12)
    assert video.frames.float().std() > 30  # random content survives H.264 at the kit's qp


def test_a_video_output_without_a_clip_geometry_is_the_whole_file(tmp_path):
    ((video,),) = loader_targets((VIDEO,), (None,), 1, size=(16, 24), folder=tmp_path)
    assert isinstance(video, DecodedVideo) and tuple(video.frames.shape) == (9, 16, 24, 3) and video.fps == 8.0


def test_an_audio_target_is_the_wavs_waveform_at_its_own_rate(tmp_path):
    ((audio,),) = loader_targets((AUDIO,), (None,), 1, size=(8, 8), sample_rate=8000, audio_seconds=0.5,
                                 folder=tmp_path)  # fmt: skip
    assert isinstance(audio, DecodedAudio) and audio.sample_rate == 8000
    assert audio.waveform.dtype == torch.float32 and tuple(audio.waveform.shape) == (2, 4000)
    assert 0.29 < float(audio.waveform[0].abs().max()) <= 0.31 and 0.19 < float(audio.waveform[1].abs().max()) <= 0.21
    # 16-bit PCM of the written tone: 220 Hz left, 330 Hz right.
    t = torch.arange(4000) / 8000
    torch.testing.assert_close(audio.waveform[0], 0.3 * torch.sin(2 * torch.pi * 220 * t), atol=1 / 32767, rtol=0)


def test_an_audio_video_target_is_a_clip_and_its_soundtrack_in_the_contracts_order(tmp_path):
    """A target of two media (LTX-2, MiniMax H3): ``[DecodedVideo, DecodedAudio]``, the sound lasting the video file
    (its 9-frame clip and the frame to spare at 8 fps: 1.25 s)."""
    geometry = (MediaGeometry(32, 32, num_frames=9, fps=8.0), None)
    targets = loader_targets((VIDEO, AUDIO), geometry, 2, size=(8, 8), folder=tmp_path)
    for video, audio in targets:
        assert isinstance(video, DecodedVideo) and tuple(video.frames.shape) == (9, 32, 32, 3)
        assert isinstance(audio, DecodedAudio) and tuple(audio.waveform.shape) == (2, 20000)
    assert not torch.equal(targets[0][1].waveform, targets[1][1].waveform)  # each sample its own pitch
    assert describe_targets(targets) == (
        "2 sample(s), each [DecodedVideo with frames uint8 (F, H, W, 3) = (9, 32, 32, 3) at 8 fps, DecodedAudio with "
        "waveform float32 (C, N) = (2, 20000) at 16000 Hz]")  # fmt: skip


def test_the_same_seed_gives_the_same_targets_and_shapes_content_differs():
    geometry = (MediaGeometry(32, 32, num_frames=3, fps=8.0),)
    a, b = (loader_targets((VIDEO,), geometry, 1, size=(8, 8)) for _ in range(2))
    shapes = loader_targets((VIDEO,), geometry, 1, size=(8, 8), content="shapes", seed=123)
    assert torch.equal(a[0][0].frames, b[0][0].frames)
    assert shapes[0][0].frames.float().std() < a[0][0].frames.float().std()  # a shape on a plain background


def test_media_tensor_is_ffs_media_layout():
    frames = torch.randint(0, 256, (3, 4, 6, 3), dtype=torch.uint8)
    video = DecodedVideo(frames, 8.0, torch.arange(3) / 8.0)
    assert torch.equal(media_tensor(video), frames.permute(0, 3, 1, 2))
    waveform = torch.zeros(2, 5)
    assert media_tensor(DecodedAudio(waveform, 8000)) is waveform
    with pytest.raises(TypeError, match="not a decoded target: str"):
        media_tensor("clip.mp4")


class _Adapter:
    """Stands for an adapter in the message: ``encoding_delivered`` reads only its class name."""


def test_a_failing_encode_becomes_an_assertion_naming_the_delivered_form():
    targets = [[DecodedVideo(torch.zeros(9, 4, 6, 3, dtype=torch.uint8), 8.0, torch.arange(9) / 8.0)]]
    with pytest.raises(AssertionError) as failure, encoding_delivered(_Adapter(), targets):
        torch.stack([t[0] for t in targets])
    message = str(failure.value)
    assert message.startswith(
        "_Adapter.encode_output fails on the targets `ff fit`'s loader delivers (1 sample(s), "
        "each [DecodedVideo with frames uint8 (F, H, W, 3) = (9, 4, 6, 3) at 8 fps]; "
    )
    assert "TypeError: expected Tensor as element 0" in message and isinstance(failure.value.__cause__, TypeError)
    with pytest.raises(AssertionError, match="^a check's own$"), encoding_delivered(_Adapter(), targets):
        raise AssertionError("a check's own")  # passes through unchanged
