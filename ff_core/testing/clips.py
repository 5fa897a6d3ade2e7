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
