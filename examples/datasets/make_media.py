"""Write the tiny media files the example datasets reference (no binary files are committed).

    python examples/datasets/make_media.py            # every dataset under examples/datasets/
    python examples/datasets/make_media.py DIR ...    # only these dataset folders

Each referenced ``.png`` becomes a 32x48 solid-colour PNG, each ``.mp4`` a 12-frame 24 fps H.264 clip with a
stereo AAC soundtrack, each ``.wav`` a 0.5 s 16-bit PCM tone at the manifest's ``sample_rate`` (default
16 kHz). The writers are also the fixtures of ``tests/data``.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import av
import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
# Media-directory overrides an example's recipe would set under data.datasets (spec: "image_dir ...").
OVERRIDES = {"h3_fl2va": {"image_dir": "."}}


def _colour(path: Path) -> tuple[int, int, int]:
    h = zlib.crc32(str(path.name).encode())
    return (h & 255, (h >> 8) & 255, (h >> 16) & 255)


def write_png(path: Path, size: tuple[int, int] = (32, 48), colour: tuple[int, int, int] | None = None) -> Path:
    """An RGB PNG of ``size`` = (height, width)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    array = np.empty((*size, 3), np.uint8)
    array[:] = colour if colour is not None else _colour(path)
    Image.fromarray(array).save(path)
    return path


def write_mp4(
    path: Path, frames: int = 12, fps: int = 24, size: tuple[int, int] = (32, 48), audio_rate: int | None = 16000
) -> Path:
    """An H.264 MP4 whose frame ``i`` is filled with value ``10 * i``, plus a stereo AAC track of the same length."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=fps)
        video.height, video.width = size
        video.pix_fmt = "yuv420p"
        audio = None
        if audio_rate:
            audio = container.add_stream("aac", rate=audio_rate)
            audio.layout = "stereo"
        for i in range(frames):
            image = np.full((*size, 3), (10 * i) % 256, np.uint8)
            container.mux(video.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(video.encode())
        if audio is not None:
            samples = int(audio_rate * frames / fps)
            tone = _tone(samples, audio_rate)
            data = np.stack([tone, tone])
            for start in range(0, samples, 1024):
                frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(data[:, start : start + 1024]),
                                                   format="fltp", layout="stereo")
                frame.sample_rate, frame.pts = audio_rate, start
                container.mux(audio.encode(frame))
            container.mux(audio.encode())
    return path


def write_wav(path: Path, seconds: float = 0.5, rate: int = 16000, channels: int = 1) -> Path:
    """A 16-bit PCM WAV tone of ``seconds`` at ``rate`` with ``channels`` identical channels."""
    path.parent.mkdir(parents=True, exist_ok=True)
    samples = int(round(seconds * rate))
    pcm = (_tone(samples, rate) * 32767).astype(np.int16)
    interleaved = np.repeat(pcm, channels)[None]  # packed s16: (1, samples * channels)
    layout = "mono" if channels == 1 else "stereo"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("pcm_s16le", rate=rate)
        stream.layout = layout
        frame = av.AudioFrame.from_ndarray(interleaved, format="s16", layout=layout)
        frame.sample_rate, frame.pts = rate, 0
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def _tone(samples: int, rate: int) -> np.ndarray:
    return (0.25 * np.sin(2 * np.pi * 440.0 * np.arange(samples) / rate)).astype(np.float32)


def make_dataset_media(dataset_dir: Path, **overrides: str) -> list[Path]:
    """Write every file the dataset's splits reference (skipping those that exist); return their paths."""
    from ff_core.data.records.sources import DatasetConfig, load_split

    cfg = DatasetConfig(name=dataset_dir.name, dataset_dir=str(dataset_dir), eval={},
                        **{k: str(dataset_dir / v) for k, v in overrides.items()})
    written = []
    for split in ("train", "test"):
        for record in load_split(cfg, split, None):
            for _, item in record.media():
                for path, rate in ((item.path, item.sample_rate), (item.audio_path, item.sample_rate)):
                    if path is None or path.exists():
                        continue
                    if path.suffix == ".png":
                        write_png(path)
                    elif path.suffix == ".mp4":
                        write_mp4(path)
                    elif path.suffix == ".wav":
                        write_wav(path, rate=int(rate or 16000))
                    else:
                        raise ValueError(f"{record.source}:{record.line}: no writer for {path.suffix} files")
                    written.append(path)
    return written


def main(argv: list[str]) -> int:
    dirs = [Path(a) for a in argv] or sorted(p for p in HERE.iterdir() if (p / "train.jsonl").exists()
                                             or (p / "train.txt").exists())
    for d in dirs:
        made = make_dataset_media(d, **OVERRIDES.get(d.name, {}))
        print(f"{d}: wrote {len(made)} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
