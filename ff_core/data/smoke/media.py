"""Deterministic media encoders of the smoke datasets: the same arrays give the same bytes (PNG, MP4, WAV).

ff's other writers sit above the data layer (``ff_core.callbacks.media_log``: training; ``ff_core.testing``: the kit),
so the builder keeps its three small ones here. What keeps the bytes fixed:

* PNG: Pillow writes no timestamp.
* MP4: H.264 (``yuv420p``, what every decoder reads) at a constant quantiser, one encoder thread (x264 writes its
  options, the thread count among them, into the stream), no container timestamps; the first and last frames are
  forced to intra frames, so each decodes from its own pixels alone: a preference pair whose rejected clip differs in
  between decodes to the same first and last frames (spec: video DPO corruptions keep the decoded endpoints).
* WAV: 16-bit PCM through the standard library.
"""

from __future__ import annotations

import io
import wave
from fractions import Fraction

import av
import numpy as np
from PIL import Image

QP = 12
PRESET = "veryfast"
"""x264's preset: as small as "medium" here at a third less time."""
"""The constant quantiser of every clip: near-lossless colours at 32x32 (a clip of 124 frames is ~5 kB)."""


def encode_png(image: np.ndarray) -> bytes:
    """uint8 (H, W, 3) as PNG bytes."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def encode_mp4(frames: np.ndarray, fps: float) -> bytes:
    """uint8 (F, H, W, 3) as an H.264 MP4 at ``fps`` (even sizes: ``yuv420p`` halves the chroma), the first and last
    frames intra-coded."""
    f, h, w, _ = frames.shape
    if h % 2 or w % 2:
        raise ValueError(f"yuv420p needs even frame sizes, got {w}x{h}")
    rate = Fraction(fps).limit_denominator(1001)
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.options = {"qp": str(QP), "preset": PRESET}
        stream.codec_context.thread_count = 1
        for t in range(f):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frames[t]), format="rgb24")
            frame.pts = t
            if t in (0, f - 1):
                frame.pict_type = av.video.frame.PictureType.I
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def decoded_endpoints(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """The decoded first and last frames (uint8 (H, W, 3)) of an MP4's first video stream: what a condition image
    must hold to agree with the clip as training decodes it."""
    first = last = None
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(video=0):  # only the two kept frames are converted to RGB
            first, last = first or frame, frame
        return first.to_ndarray(format="rgb24"), last.to_ndarray(format="rgb24")


def encode_wav(samples: np.ndarray, rate: int) -> bytes:
    """float (N,) or (N, channels) in [-1, 1] as 16-bit PCM WAV bytes at ``rate``."""
    data = samples[:, None] if samples.ndim == 1 else samples
    pcm = np.clip(np.rint(data * 32767.0), -32768, 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(pcm.shape[1])
        out.setsampwidth(2)
        out.setframerate(int(rate))
        out.writeframes(pcm.tobytes())
    return buffer.getvalue()
