"""The conformance kit's training targets: tiny real media files, decoded by the training loader's own code.

``ff fit`` never hands ``Adapter.encode_output`` tensors of the kit's making: its loader's workers decode every target
of a record (:class:`~ff_core.data.samples.RecordProcessor`: :func:`~ff_core.data.media.geometry.decode_target`, fitted
to ``adapter.output_geometry()``) and :class:`~ff_core.data.samples.SampleCollator` gives ``batch["target"]``, per
sample a list in the contract's output order of

* an image: ``uint8`` (3, H, W) tensor (:func:`~ff_core.data.media.decode.decode_image` of a PNG, fitted);
* a video: :class:`~ff_core.data.media.decode.DecodedVideo`, ``frames`` ``uint8`` (F, H, W, 3) on the clip's frame
  grid (:func:`~ff_core.data.media.decode.decode_clip` of an MP4), ``fps``, ``timestamps``, ``audio`` (its embedded
  soundtrack, ``None`` here);
* an audio clip: :class:`~ff_core.data.media.decode.DecodedAudio`, ``waveform`` ``float32`` (C, N) at the file's own
  rate (:func:`~ff_core.data.media.decode.decode_audio` of a WAV, never resampled: the adapter converts).

:func:`loader_targets` writes such files (a V2 dataset folder: ``train.jsonl`` and its media), reads the records with
the loader's parser (:func:`~ff_core.data.records.sources.load_split`), checks their outputs against the contract as
``ff data validate`` does, and decodes them with the processor and collator training uses, so an adapter whose
``encode_output`` handles another form fails the kit exactly where it would fail at the first training step.
:func:`encoding_delivered` turns such a failure into a message naming the form it was given.
"""

from __future__ import annotations

import json
import math
import random
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import numpy as np
from PIL import Image
from torch import Tensor

from ff_core.contracts import MediaGeometry, MediaType, PipelineIOContract
from ff_core.data.media.decode import DecodedAudio, DecodedVideo

Content = Literal["random", "shapes"]
#: What the kit's target files show: ``random`` (uniform noise pixels, a two-pitch stereo tone) or ``shapes`` (the
#: shapes and moving-shapes demo media a tiny VAE is trained on, for the encode -> decode round trip).
CONTENTS = ("random", "shapes")

#: A video output taken whole (no ``num_frames`` in its geometry) is written with this many frames at this rate.
DEFAULT_FRAMES, DEFAULT_FPS = 9, 8.0
#: An audio output with no video beside it lasts this many seconds unless the kit says otherwise.
DEFAULT_AUDIO_SECONDS = 1.0


def loader_targets(
    outputs: Sequence[MediaType],
    geometry: Sequence[MediaGeometry | None],
    n: int,
    *,
    size: tuple[int, int],
    content: Content = "random",
    seed: int = 0,
    sample_rate: int = 16000,
    audio_seconds: float | None = None,
    folder: str | Path | None = None,
) -> list[list[Any]]:
    """``n`` training targets exactly as ``ff fit``'s loader hands them to ``encode_output``: per sample a list in the
    order of ``outputs``, decoded from real files (:func:`write_target_dataset`) by :func:`delivered_targets`.

    Args:
        outputs: the contract's output types, in order (``adapter.io_contract.output_types``).
        geometry: ``adapter.output_geometry()``, one entry per output (the loader fits the decoded targets to it).
        n: samples.
        size: ``(height, width)`` of an image or video output without a geometry.
        content: what the files show (:data:`CONTENTS`).
        seed: drawing seed.
        sample_rate: the WAV files' rate (and each record's ``sample_rate``).
        audio_seconds: length of an audio output; ``None``: the video clip's (``start + num_frames / fps`` on its
            clock) when the target has one, else :data:`DEFAULT_AUDIO_SECONDS`.
        folder: where the dataset folder is written (kept); ``None``: a temporary folder removed once decoded.
    """
    if folder is not None:
        root = write_target_dataset(folder, outputs, geometry, n, size=size, content=content, seed=seed,
                                    sample_rate=sample_rate, audio_seconds=audio_seconds)  # fmt: skip
        return delivered_targets(root, outputs, geometry)
    with tempfile.TemporaryDirectory(prefix="ff-kit-targets-") as tmp:
        return loader_targets(outputs, geometry, n, size=size, content=content, seed=seed, sample_rate=sample_rate,
                              audio_seconds=audio_seconds, folder=tmp)  # fmt: skip


def delivered_targets(root: Path, outputs: Sequence[MediaType], geometry: Sequence[MediaGeometry | None]
                      ) -> list[list[Any]]:  # fmt: skip
    """``batch["target"]`` of the V2 demonstrations in ``root/train.jsonl``, through the training loader's code: the
    records parsed as ``ff fit`` parses an SFT split, their outputs checked against the contract's (order, ``fps``,
    ``sample_rate``: ``ff data validate``'s rules), each target decoded by ``RecordProcessor(geometry)`` and the
    samples collated by ``SampleCollator``. A file the loader cannot decode raises its ``DatasetError``."""
    from ff_core.contracts import OutputSpec
    from ff_core.data.records.sources import DatasetConfig, load_split
    from ff_core.data.records.validation import check_records
    from ff_core.data.samples import ConditionedRecord, RecordProcessor, SampleCollator

    records = load_split(DatasetConfig(name="conformance-kit", dataset_dir=str(root)), "train", "sft")
    # The outputs' rules only: the kit's records carry no condition media (conditions come from make_inputs).
    specs = tuple(OutputSpec(t, requires_fps=t is MediaType.VIDEO, requires_sample_rate=t is MediaType.AUDIO)
                  for t in outputs)  # fmt: skip
    check_records(records, PipelineIOContract(outputs=specs))
    processor = RecordProcessor(tuple(geometry))
    samples = [processor.process(ConditionedRecord(i, r, {})) for i, r in enumerate(records)]
    bad = [s["bad_sample"] for s in samples if "bad_sample" in s]
    if bad:
        raise bad[0]
    return SampleCollator().collate(samples)["target"]


def write_target_dataset(
    root: str | Path,
    outputs: Sequence[MediaType],
    geometry: Sequence[MediaGeometry | None],
    n: int,
    *,
    size: tuple[int, int],
    content: Content = "random",
    seed: int = 0,
    sample_rate: int = 16000,
    audio_seconds: float | None = None,
) -> Path:
    """A V2 SFT dataset folder of ``n`` demonstrations whose targets are ``outputs`` (one file per output: PNG, H.264
    MP4 through PyAV, 16-bit WAV), each covering what its ``geometry`` decodes: a clip of ``num_frames`` at ``fps``
    from ``start`` (one frame to spare), written at the output's canvas. Arguments as :func:`loader_targets`'s."""
    if content not in CONTENTS:
        raise ValueError(f"content must be one of {CONTENTS}, got {content!r}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    geometry = list(geometry) + [None] * (len(outputs) - len(geometry))
    video = next((g for t, g in zip(outputs, geometry) if t is MediaType.VIDEO), None)
    frames, fps = _clip(video)
    if audio_seconds is None:
        has_video = MediaType.VIDEO in outputs
        audio_seconds = frames / fps if has_video else DEFAULT_AUDIO_SECONDS
    rng, lines = random.Random(seed), []
    for i in range(n):
        media = []
        for j, (kind, g) in enumerate(zip(outputs, geometry)):
            height, width = (g.height, g.width) if g is not None else size
            stem = f"{i:03d}_{j}"
            if kind is MediaType.IMAGE:
                rel = f"images/{stem}.png"
                _image(rng, content, height, width, i).save(_parent(root / rel))
                media.append({"type": "image", "path": rel})
            elif kind is MediaType.VIDEO:
                from ff_core.testing.moving_shapes import write_mp4

                rel = f"videos/{stem}.mp4"
                # yuv420p needs even sides: an odd canvas is written one pixel larger and centre-cropped on loading.
                write_mp4(root / rel, _frames(rng, content, frames, height + height % 2, width + width % 2, i), fps)
                media.append({"type": "video", "path": rel, "fps": fps})
            else:
                from ff_core.testing.clips import write_wav

                rel = f"audios/{stem}.wav"
                write_wav(root / rel, _tone(i, audio_seconds, sample_rate), sample_rate)
                media.append({"type": "audio", "path": rel, "sample_rate": sample_rate})
        target = {"type": "demonstration", "target": {"media": media}}
        lines.append(json.dumps({"schema_version": 2, "input": {"prompt": f"sample {i}"}, "supervision": target}))
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _parent(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _clip(geometry: MediaGeometry | None) -> tuple[int, float]:
    """Frames and rate of the file written for a video output: the grid's rate, its frames from the clip's start
    and one to spare (a clip too short for its grid is rejected, never stretched)."""
    if geometry is None or geometry.num_frames is None:
        return DEFAULT_FRAMES, DEFAULT_FPS
    fps = geometry.fps or DEFAULT_FPS
    return geometry.num_frames + math.ceil(geometry.start * fps) + 1, float(fps)


def _image(rng: random.Random, content: Content, height: int, width: int, i: int) -> Image.Image:
    if content == "random":
        return Image.fromarray(np.random.default_rng(rng.getrandbits(32)).integers(0, 256, (height, width, 3),
                                                                                  dtype=np.uint8))  # fmt: skip
    from ff_core.testing.shapes import BACKGROUNDS, COLOURS, SHAPES, ShapeSpec, draw_shape

    # As write_shapes_dataset draws its images (square, the longer side), fitted to the canvas by the loader.
    spec = ShapeSpec(COLOURS[i % len(COLOURS)], rng.choice(SHAPES), rng.choice(list(BACKGROUNDS)))
    return draw_shape(spec, max(height, width), rng)


def _frames(rng: random.Random, content: Content, frames: int, height: int, width: int, i: int) -> np.ndarray:
    if content == "random":
        return np.random.default_rng(rng.getrandbits(32)).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)
    from ff_core.testing.moving_shapes import DIRECTIONS, MotionSpec, draw_clip
    from ff_core.testing.shapes import COLOURS, SHAPES

    spec = MotionSpec(COLOURS[i % len(COLOURS)], rng.choice(SHAPES), DIRECTIONS[i % len(DIRECTIONS)])
    return draw_clip(spec, frames, width, height, rng)


def _tone(i: int, seconds: float, rate: int) -> np.ndarray:
    """A stereo tone, (N, 2) in [-1, 1]: the channels at different pitches (a swapped or averaged channel shows)."""
    t = np.arange(round(seconds * rate)) / rate
    pitch = 220.0 * (i + 1)
    return np.stack([0.3 * np.sin(2 * np.pi * pitch * t), 0.2 * np.sin(2 * np.pi * 1.5 * pitch * t)], axis=1)


# -- what the targets are, for messages and references -------------------------------------------------------------
def describe_media(item: Any) -> str:
    """One decoded target in words: ``DecodedVideo with frames uint8 (F, H, W, 3) = (9, 32, 32, 3) at 8 fps``."""
    if isinstance(item, DecodedVideo):
        sound = "" if item.audio is None else f", soundtrack {describe_media(item.audio)}"
        return (f"DecodedVideo with frames {_dtype(item.frames)} (F, H, W, 3) = {tuple(item.frames.shape)} at "
                f"{item.fps:g} fps{sound}")  # fmt: skip
    if isinstance(item, DecodedAudio):
        return (f"DecodedAudio with waveform {_dtype(item.waveform)} (C, N) = {tuple(item.waveform.shape)} at "
                f"{item.sample_rate} Hz")  # fmt: skip
    if isinstance(item, Tensor):
        layout = "(3, H, W) " if item.ndim == 3 else ""
        return f"{_dtype(item)} {layout}tensor {tuple(item.shape)}"
    return type(item).__name__


def describe_targets(targets: list[list[Any]]) -> str:
    """A batch of targets in words (its first sample; every sample has the same form)."""
    first = ", ".join(describe_media(m) for m in targets[0]) if targets else ""
    return f"{len(targets)} sample(s), each [{first}]"


def _dtype(tensor: Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def media_tensor(item: Any) -> Tensor:
    """A decoded target in ff's media layout, the one ``decode`` returns: an image ``uint8`` (3, H, W) as it is, a
    :class:`DecodedVideo`'s frames as ``uint8`` (F, 3, H, W), a :class:`DecodedAudio`'s waveform (C, N); a tensor a
    plugin's own ``make_targets`` gives is taken as already in that layout. For the kit's reference side (never an
    adapter's code)."""
    if isinstance(item, DecodedVideo):
        return item.frames.permute(0, 3, 1, 2)
    if isinstance(item, DecodedAudio):
        return item.waveform
    if isinstance(item, Tensor):
        return item
    raise TypeError(f"not a decoded target: {type(item).__name__}")


@contextmanager
def encoding_delivered(adapter: Any, targets: list[list[Any]], what: str = "encode_output") -> Iterator[None]:
    """Run a block that hands ``targets`` to ``adapter.encode_output`` (directly, or through an objective's loss): an
    exception it raises (an ``AssertionError`` of a nested check passes through) becomes an ``AssertionError`` naming
    the form of the targets, the form training delivers (:func:`describe_targets`), and the original error."""
    try:
        yield
    except AssertionError:
        raise
    except Exception as exc:
        raise AssertionError(
            f"{type(adapter).__name__}.{what} fails on the targets `ff fit`'s loader delivers "
            f"({describe_targets(targets)}; decoded from real files by ff_core.data.media.geometry.decode_target and "
            f"fitted to output_geometry(), as in training): {type(exc).__name__}: {exc}. Take images as uint8 "
            "(3, H, W) tensors, videos as DecodedVideo (frames uint8 (F, H, W, 3)) and audio as DecodedAudio "
            "(waveform (C, N) at its own rate)."
        ) from exc
