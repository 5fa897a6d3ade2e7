"""Evaluation samples to disk and to every Lightning logger a recipe configures.

One :class:`EvalSample` per evaluation prompt (its index, prompt, decoded outputs and reward scores) goes to:

* disk, always: ``<dir>/<index>[_<position>].png|gif|mp4|wav`` per output (video as an animated GIF, or an H.264 MP4
  written with PyAV when the callback's ``video_format`` is ``mp4``, with the audio output that follows it, if any,
  muxed in as its AAC soundtrack; audio as 16-bit PCM WAV) -
  :func:`write_sample_files`;
* TensorBoard (``TensorBoardLogger``): the grid image, each video as an animated GIF (the image summary TensorBoard
  plays; torch's ``add_video`` would need moviepy) and each audio clip (multi-channel WAV) - :func:`log_tensorboard`.
  TensorBoard plays no sound in a video, so a (video, audio) pair stays a silent GIF beside its audio clip there;
* Weights & Biases (``WandbLogger``, wandb imported only then): the grid, the very files written to disk
  (``wandb.Video`` of each GIF / MP4 file, so a (video, audio) pair written as MP4 arrives as one video with its
  soundtrack and its audio is not logged again; ``wandb.Audio`` of each other WAV) and a table of prompts and
  rewards - :func:`log_wandb`;
* CSV (``CSVLogger``): the files under the logger's ``log_dir/media/step_<step>/`` and one row per sample and output
  in ``log_dir/samples.csv`` (step, index, prompt, output, path, reward per label, total) - :func:`log_csv`.

Other loggers are skipped (their metrics still get ``val/reward``); the files on disk are always written.
"""

from __future__ import annotations

import csv
import io
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from ff_core.atomic import write_bytes_atomic

DEFAULT_FPS = 8.0
DEFAULT_SAMPLE_RATE = 16000
EXTENSIONS = {"image": "png", "video": "gif", "audio": "wav"}
VIDEO_FORMATS = ("gif", "mp4")


@dataclass
class EvalSample:
    """One generated evaluation sample, as the logging callbacks see it.

    Attributes:
        index: the evaluation row's index.
        prompt: its prompt.
        media: decoded outputs in the contract's order (image uint8 (3, H, W), video uint8 (T, 3, H, W), audio
            float (C, N) in [-1, 1]), on the CPU.
        output_types: kind of each output.
        rates: fps / sample rate of each output (``None``: unknown, the defaults are used).
        rewards: score per reward label (empty without evaluation rewards).
        reward: weighted total (``None`` without evaluation rewards).
        video_format: how videos are written to disk and to W&B: ``gif`` or ``mp4``, which carries the audio output
            after the video as its soundtrack (TensorBoard always gets a GIF, the only animation its image summary
            plays, and the audio beside it).
    """

    index: int
    prompt: str
    media: list[Tensor]
    output_types: tuple[str, ...]
    rates: tuple[float | None, ...] = ()
    rewards: dict[str, float] = field(default_factory=dict)
    reward: float | None = None
    video_format: str = "gif"

    def rate(self, position: int, default: float) -> float:
        rate = self.rates[position] if position < len(self.rates) else None
        return float(rate) if rate else default

    def soundtrack(self, position: int) -> int | None:
        """The position of the audio output muxed into the video at ``position`` when it is written as MP4: the first
        audio output after it (an ordered (video, audio) pair: LTX-2, MiniMax H3); ``None``: none, or not an MP4."""
        if self.output_types[position] != "video" or self.video_format != "mp4":
            return None
        return next((p for p in range(position + 1, len(self.media)) if self.output_types[p] == "audio"), None)

    def file_name(self, position: int) -> str:
        suffix = f"_{position}" if position else ""
        kind = self.output_types[position]
        return f"{self.index:05d}{suffix}.{self.video_format if kind == 'video' else EXTENSIONS[kind]}"


def samples_from_outputs(outputs: dict[str, Any]) -> list[EvalSample]:
    """The :class:`EvalSample` s of one ``FlowModule.validation_step`` output (media moved to the CPU)."""
    n = len(outputs["index"])
    types = tuple(outputs.get("output_types") or ("image",) * len(outputs["media"][0]))
    rates = tuple(outputs.get("rates") or ())
    rewards = outputs.get("rewards") or {}
    totals = outputs.get("reward") or [None] * n
    return [
        EvalSample(int(outputs["index"][i]), outputs["prompt"][i], [m.detach().cpu() for m in outputs["media"][i]],
                   types, rates, {k: float(v[i]) for k, v in rewards.items()}, totals[i])
        for i in range(n)
    ]


# -- encoders -----------------------------------------------------------------------------------------------
def check_video_format(value: str, owner: str) -> str:
    if value not in VIDEO_FORMATS:
        raise ValueError(f"{owner}.video_format must be one of {VIDEO_FORMATS}, got {value!r}")
    return value


def video_to_mp4(video: Tensor, fps: float = DEFAULT_FPS, audio: Tensor | None = None,
                 sample_rate: int = DEFAULT_SAMPLE_RATE) -> bytes:  # fmt: skip
    """An H.264 MP4 (yuv420p, PyAV) of a uint8 (T, 3, H, W) video at ``fps`` (a rational rate, so 23.976 stays
    exact to the millisecond). yuv420p needs even sides: an odd last row / column is repeated.

    With ``audio`` (float (C, N) in [-1, 1], 1 or 2 channels, at ``sample_rate``) the MP4 gets an AAC soundtrack
    muxed beside the video, both starting at 0: a pipeline whose outputs are an ordered (video, audio) pair plays as
    one file (the WAV is written too)."""
    from fractions import Fraction

    import av
    import numpy as np

    if video.dtype != torch.uint8 or video.ndim != 4 or video.shape[1] != 3:
        raise ValueError(f"a video is uint8 (T, 3, H, W), got {video.dtype} {tuple(video.shape)}")
    if audio is not None and (audio.ndim != 2 or not audio.is_floating_point() or audio.shape[0] not in (1, 2)):
        raise ValueError(f"a soundtrack is float (C, N) with 1 or 2 channels, got {audio.dtype} {tuple(audio.shape)}")
    frames = video.permute(0, 2, 3, 1).contiguous().numpy()
    pad = ((0, 0), (0, frames.shape[1] % 2), (0, frames.shape[2] % 2), (0, 0))
    frames = np.pad(frames, pad, mode="edge")
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        stream.codec_context.options = {"crf": "18"}
        sound = None
        if audio is not None:
            layout = "mono" if audio.shape[0] == 1 else "stereo"
            sound = container.add_stream("aac", rate=int(sample_rate), layout=layout)
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
        if sound is not None:  # planar float samples; the encoder re-frames them into AAC's 1024-sample frames
            pcm = np.ascontiguousarray(audio.detach().float().clamp(-1, 1).cpu().numpy())
            chunk = av.AudioFrame.from_ndarray(pcm, format="fltp", layout=sound.layout.name)
            chunk.sample_rate, chunk.pts = int(sample_rate), 0
            container.mux(sound.encode(chunk))
            container.mux(sound.encode())
    return buf.getvalue()


def video_to_gif(video: Tensor, fps: float = DEFAULT_FPS) -> bytes:
    """An animated GIF of a uint8 (T, 3, H, W) video at ``fps`` (GIF stores frame durations in 10 ms units, and
    at most 256 colours per frame: Pillow quantises richer frames)."""
    if video.dtype != torch.uint8 or video.ndim != 4 or video.shape[1] != 3:
        raise ValueError(f"a video is uint8 (T, 3, H, W), got {video.dtype} {tuple(video.shape)}")
    frames = [Image.fromarray(f.permute(1, 2, 0).contiguous().numpy()) for f in video]
    buf = io.BytesIO()
    duration = max(10, round(1000 / fps / 10) * 10)
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=duration, loop=0)
    return buf.getvalue()


def audio_to_wav(audio: Tensor, sample_rate: int = DEFAULT_SAMPLE_RATE) -> bytes:
    """16-bit PCM WAV of a float (C, N) waveform in [-1, 1] (values outside are clipped; ``x * 32767`` rounded)."""
    if audio.ndim != 2 or not audio.is_floating_point():
        raise ValueError(f"audio is float (C, N), got {audio.dtype} {tuple(audio.shape)}")
    pcm = (audio.float().clamp(-1, 1) * 32767).round().to(torch.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(pcm.shape[0])
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(pcm.T.contiguous().numpy().astype("<i2").tobytes())  # interleaved frames
    return buf.getvalue()


def png_bytes(image: Tensor | Image.Image) -> bytes:
    if isinstance(image, Tensor):
        image = Image.fromarray(image.permute(1, 2, 0).contiguous().numpy())
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def encode_output(sample: EvalSample, position: int) -> bytes:
    """The file content of one output: PNG, GIF / MP4 (``sample.video_format``) or WAV by its kind."""
    kind, item = sample.output_types[position], sample.media[position]
    if kind == "image":
        return png_bytes(item)
    if kind == "video" and sample.video_format == "mp4":
        track = sample.soundtrack(position)
        audio = {} if track is None else {"audio": sample.media[track],
                                          "sample_rate": int(sample.rate(track, DEFAULT_SAMPLE_RATE))}  # fmt: skip
        return video_to_mp4(item, sample.rate(position, DEFAULT_FPS), **audio)
    if kind == "video":
        return video_to_gif(item, sample.rate(position, DEFAULT_FPS))
    if kind == "audio":
        return audio_to_wav(item, int(sample.rate(position, DEFAULT_SAMPLE_RATE)))
    raise ValueError(f"unknown output kind {kind!r}")


def write_sample_files(samples: list[EvalSample], folder: Path) -> dict[tuple[int, int], Path]:
    """Write every output of every sample into ``folder`` (atomically); returns ``{(index, position): path}``."""
    paths = {}
    for sample in samples:
        for position in range(len(sample.media)):
            path = folder / sample.file_name(position)
            write_bytes_atomic(path, encode_output(sample, position))
            paths[(sample.index, position)] = path
    return paths


# -- loggers ------------------------------------------------------------------------------------------------
def log_tensorboard(writer: Any, samples: list[EvalSample], grid: Image.Image | None, step: int,
                    prefix: str = "val") -> None:
    """Send the grid, videos and audio to a TensorBoard ``SummaryWriter`` (``TensorBoardLogger.experiment``).

    Videos go as animated GIFs whatever ``video_format`` (TensorBoard's image summary plays GIFs, and no summary
    plays a video with sound): an MP4's soundtrack is logged as its own audio summary, the silent GIF beside it.
    """
    from tensorboard.compat.proto.summary_pb2 import Summary

    if grid is not None:
        writer.add_image(f"{prefix}/samples", torch.from_numpy(_hwc(grid)), step, dataformats="HWC")
    values = []
    for sample in samples:
        for position, kind in enumerate(sample.output_types):
            tag = f"{prefix}/sample_{sample.index:05d}" + (f"_{position}" if position else "")
            item = sample.media[position]
            if kind == "video":
                t, _, h, w = item.shape
                gif = video_to_gif(item, sample.rate(position, DEFAULT_FPS))
                values.append(Summary.Value(tag=tag, image=Summary.Image(height=h, width=w, colorspace=3,
                                                                         encoded_image_string=gif)))
            elif kind == "audio":
                rate = int(sample.rate(position, DEFAULT_SAMPLE_RATE))
                values.append(Summary.Value(tag=tag, audio=Summary.Audio(
                    sample_rate=rate, num_channels=item.shape[0], length_frames=item.shape[1],
                    encoded_audio_string=audio_to_wav(item, rate), content_type="audio/wav")))
    if values:
        # torch's add_video/add_audio need moviepy and take mono audio only; the summary protos they would build
        # are written directly (the same file writer add_image uses).
        writer._get_file_writer().add_summary(Summary(value=values), step)
    writer.flush()


def log_wandb(logger: Any, samples: list[EvalSample], grid: Image.Image | None, step: int, prefix: str = "val",
              paths: dict[tuple[int, int], Path] | None = None) -> None:
    """Send the grid, the sample files and a table of prompts and rewards to a ``WandbLogger``.

    W&B gets the files written to disk (``paths``, from :func:`write_sample_files`; ``None``: written now under the
    run's local folder, ``<run>/ff_samples/<prefix>_step_<step>``): ``wandb.Video`` of each video file, so an MP4 with
    its audio muxed (``video_format: mp4``) plays with sound and its soundtrack's audio output is not logged again,
    and ``wandb.Audio`` of each other WAV. Files, not arrays: wandb encodes arrays with moviepy / soundfile, which
    ff does not need.
    """
    import wandb  # only here: wandb is optional

    if paths is None:
        folder = Path(logger.experiment.dir).parent / "ff_samples" / f"{prefix}_step_{step:06d}"
        paths = write_sample_files(samples, folder)
    payload: dict[str, Any] = {}
    if grid is not None:
        payload[f"{prefix}/samples"] = wandb.Image(grid)
    for sample in samples:
        muxed = {sample.soundtrack(p) for p in range(len(sample.media))} - {None}
        for position, kind in enumerate(sample.output_types):
            key = f"{prefix}/sample_{sample.index:05d}" + (f"_{position}" if position else "")
            path = str(paths[(sample.index, position)])
            if kind == "video":
                payload[key] = wandb.Video(path)
            elif kind == "audio" and position not in muxed:
                payload[key] = wandb.Audio(path)
    labels = sorted({k for s in samples for k in s.rewards})
    columns = ["index", "prompt", *labels, "reward"]
    rows = [[s.index, s.prompt, *(s.rewards.get(k) for k in labels), s.reward] for s in samples]
    payload[f"{prefix}/samples_table"] = wandb.Table(columns=columns, data=rows)
    logger.experiment.log({**payload, "trainer/global_step": step})


def log_csv(log_dir: Path, samples: list[EvalSample], step: int, prefix: str = "val") -> Path:
    """Write the samples under ``log_dir/media/step_<step>/`` and append one row per sample and output to
    ``log_dir/samples.csv`` (rewritten atomically; earlier rows kept). Returns the CSV's path."""
    folder = log_dir / "media" / f"{prefix}_step_{step:06d}"
    paths = write_sample_files(samples, folder)
    labels = sorted({k for s in samples for k in s.rewards})
    columns = ["stage", "step", "index", "prompt", "output", "path", *(f"reward/{k}" for k in labels), "reward"]
    table = log_dir / "samples.csv"
    rows: list[list[Any]] = []
    if table.exists():
        with table.open(newline="") as f:
            old = list(csv.reader(f))
        if old and old[0] != columns:  # another set of rewards: keep old rows under the new header, by name
            where = {c: i for i, c in enumerate(old[0])}
            old = [columns] + [[r[where[c]] if c in where else "" for c in columns] for r in old[1:]]
        rows = old[1:]
    for sample in samples:
        for position, kind in enumerate(sample.output_types):
            path = paths[(sample.index, position)].relative_to(log_dir)
            rows.append([prefix, step, sample.index, sample.prompt, kind, str(path),
                         *(sample.rewards.get(k, "") for k in labels), "" if sample.reward is None else sample.reward])
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(columns)
    writer.writerows(rows)
    write_bytes_atomic(table, buf.getvalue().encode())
    return table


def _hwc(image: Image.Image):
    import numpy as np

    return np.array(image.convert("RGB"))  # a writable copy: torch.from_numpy warns about read-only arrays


def send_to_loggers(loggers: list[Any], samples: list[EvalSample], grid: Image.Image | None, step: int,
                    prefix: str = "val", paths: dict[tuple[int, int], Path] | None = None) -> list[str]:
    """Send the samples to each logger of a kind ff knows; returns the kinds it sent to (for tests and logs).
    ``paths``: the samples' files on disk (:func:`write_sample_files`), which W&B logs as they are."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

    sent = []
    for logger in loggers:
        if isinstance(logger, TensorBoardLogger):
            log_tensorboard(logger.experiment, samples, grid, step, prefix)
            sent.append("tensorboard")
        elif isinstance(logger, WandbLogger):
            log_wandb(logger, samples, grid, step, prefix, paths)
            sent.append("wandb")
        elif isinstance(logger, CSVLogger):
            log_csv(Path(logger.log_dir), samples, step, prefix)
            sent.append("csv")
    return sent
