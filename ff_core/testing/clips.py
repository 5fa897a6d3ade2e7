"""Small generated video datasets for tests and benchmarks: H.264 MP4s written with PyAV whose frame ``k`` is the
solid grey level ``step * k`` (so the source frame of any decoded frame reads back from its pixels), and V2 SFT
dataset folders of such clips at mixed sizes and durations."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import av
import numpy as np


def write_grey_mp4(
    path: Path, frames: int, fps: int, size: tuple[int, int] = (16, 16), gop: int = 4, step: int = 8
) -> Path:
    """An H.264 MP4 of ``frames`` frames at ``fps``, ``size = (height, width)``, a keyframe every ``gop`` frames;
    frame ``k`` is filled with ``(step * k) % 256``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = size
        stream.pix_fmt = "yuv420p"
        stream.codec_context.gop_size = gop
        stream.codec_context.options = {"keyint_min": str(gop), "sc_threshold": "0"}
        for k in range(frames):
            image = np.full((*size, 3), (step * k) % 256, np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode())
    return path


def fps_filter_frames(path: Path, fps: float, start: float = 0.0) -> list[np.ndarray]:
    """The RGB frames ffmpeg's ``fps`` filter outputs for the first video stream of ``path``, ``start`` seconds cut
    off first (``trim``, then ``setpts=PTS-STARTPTS`` so the grid starts there, as ``ffmpeg -ss start -vf fps=...``
    does): a real filter graph run by PyAV (``buffer -> [trim -> setpts ->] fps -> buffersink``), the independent
    reference of :func:`ff_core.data.media.decode.clip_source_frames`'s ``fps_filter`` rule (MiniMax H3's decode)."""
    out: list[np.ndarray] = []
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        graph = av.filter.Graph()
        chain = [graph.add_buffer(template=stream)]
        if start:
            chain += [graph.add("trim", f"start={start}"), graph.add("setpts", "PTS-STARTPTS")]
        chain += [graph.add("fps", f"fps={fps}"), graph.add("buffersink")]
        for a, b in zip(chain, chain[1:]):
            a.link_to(b)
        graph.configure()

        def drain() -> None:
            while True:
                try:
                    frame = chain[-1].pull()
                except (av.BlockingIOError, av.EOFError):
                    return
                out.append(frame.to_ndarray(format="rgb24"))

        for frame in container.decode(stream):
            chain[0].push(frame)
            drain()
        chain[0].push(None)
        drain()
    return out


def write_offset_streams(root: Path, size: int, video_fps: int, frames: int, audio_rate: int,
                         samples: np.ndarray) -> tuple[Path, Path]:  # fmt: skip
    """A Matroska H.264 video (``size`` x ``size``, grey levels rising frame by frame) whose stream starts at 0.5 s,
    and a Matroska PCM audio of ``samples`` (mono int16) whose stream starts at 0.25 s: both ``start_time`` != 0, the
    case where a file's seconds and a clip's clock part (tests of :mod:`ff_core.audio`'s one clock in the audio+video
    codecs). Returns ``(video, audio)`` paths under ``root``."""
    import fractions

    video, audio = root / "clip.mkv", root / "sound.mka"
    with av.open(str(video), "w") as out:
        stream = out.add_stream("libx264", rate=video_fps)
        stream.width = stream.height = size
        stream.pix_fmt, stream.time_base = "yuv420p", fractions.Fraction(1, video_fps)
        for k in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((size, size, 3), (8 * k) % 256, np.uint8), format="rgb24")
            frame.pts, frame.time_base = k + video_fps // 2, stream.time_base
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    with av.open(str(audio), "w") as out:
        stream = out.add_stream("pcm_s16le", rate=audio_rate, layout="mono")
        for first in range(0, len(samples), 800):
            frame = av.AudioFrame.from_ndarray(samples[None, first : first + 800], format="s16", layout="mono")
            frame.sample_rate, frame.time_base = audio_rate, fractions.Fraction(1, audio_rate)
            frame.pts = audio_rate // 4 + first
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return video, audio


def write_clip_dataset(root: Path, clips: Sequence[tuple[int, int, int, int]], name: str = "train.jsonl") -> Path:
    """A V2 SFT dataset folder: one demonstration per ``(height, width, frames, fps)`` clip, ``clips/<i>.mp4``."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (height, width, frames, fps) in enumerate(clips):
        write_grey_mp4(root / "clips" / f"{i}.mp4", frames, fps, (height, width))
        rows.append({"schema_version": 2, "input": {"prompt": f"clip {i}"}, "supervision": {
            "type": "demonstration", "target": {"media": [{"type": "video", "path": f"clips/{i}.mp4"}]}}})
    (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def av_clip(rgb: tuple[int, int, int], hz: float, frames: int, fps: float, rate: int, size: int = 32,
            channels: int = 1) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """One synthetic audio+video clip: uint8 (F, H, W, 3) frames of an ``rgb`` square on grey, and a float
    (N, channels) sine tone of ``hz`` lasting exactly ``frames / fps`` seconds at ``rate`` Hz (the toy clips of the
    audio+video plugins' tests and benchmarks: a caption names the colour and the pitch)."""
    clip = np.full((frames, size, size, 3), 96, np.uint8)
    side = size // 2
    clip[:, size // 4 : size // 4 + side, size // 4 : size // 4 + side] = rgb
    t = np.arange(int(round(frames / fps * rate))) / rate
    tone = 0.3 * np.sin(2 * np.pi * hz * t)
    return clip, np.repeat(tone[:, None], channels, axis=1)


def write_wav(path: Path, tone: np.ndarray, rate: int) -> Path:
    """``tone`` (float (N, channels) in [-1, 1]) as a 16-bit PCM WAV at ``rate`` (ff's one WAV writer, media
    logging's), the folder created."""
    import torch

    from ff_core.callbacks.media_log import audio_to_wav

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(audio_to_wav(torch.from_numpy(np.ascontiguousarray(tone.T)).float(), rate))
    return path


def write_av_pair(root: Path, stem: str, clip: np.ndarray, tone: np.ndarray, fps: float, rate: int) -> list[dict]:
    """One (video, audio) target of an audio+video dataset: ``clip`` (uint8 (F, H, W, 3)) as ``videos/<stem>.mp4`` at
    ``fps``, ``tone`` as ``audios/<stem>.wav`` at ``rate``; returns the ordered V2 media objects (paths relative to
    ``root``, with ``fps`` and ``sample_rate``)."""
    from ff_core.testing.moving_shapes import write_mp4

    video = {"type": "video", "path": f"videos/{stem}.mp4", "fps": fps}
    audio = {"type": "audio", "path": f"audios/{stem}.wav", "sample_rate": rate}
    write_mp4(root / video["path"], clip, fps)
    write_wav(root / audio["path"], tone, rate)
    return [video, audio]
