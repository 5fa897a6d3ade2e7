"""What a user watches while training: a grid of generated samples and the loss curve, as PNG files.

Both write into the trainer's log directory (``<log_dir>/samples/step_000123.png``, ``<log_dir>/loss.png``
and ``loss.csv``), atomically, once per validation run; the samples also go to the recipe's loggers.
"""

from __future__ import annotations

import io
import json
import math
import textwrap
from pathlib import Path
from typing import Any

import lightning as L
import torch
from PIL import Image, ImageDraw

from ff_core.atomic import write_bytes_atomic
from ff_core.callbacks.media_log import (
    EvalSample,
    check_video_format,
    samples_from_outputs,
    send_to_loggers,
    write_sample_files,
)


def log_dir(trainer: L.Trainer) -> Path:
    """The run's log folder. Call it from ``setup`` only: ``trainer.log_dir`` is a collective under DDP, so every
    rank must ask together (asking from a rank-zero-only branch hangs or fails the others)."""
    return Path(trainer.log_dir or trainer.default_root_dir)


def save_png(image: Image.Image, path: Path) -> None:
    """Encode ``image`` as PNG and publish it at ``path`` atomically."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    write_bytes_atomic(path, buf.getvalue())


def image_grid(images: list[torch.Tensor], captions: list[str], cell: int = 96, columns: int = 6) -> Image.Image:
    """Tile uint8 (3, H, W) images (nearest-upscaled to ``cell``) with wrapped captions beneath."""
    rows = max(1, math.ceil(len(images) / columns))
    text_h = 36
    grid = Image.new("RGB", (columns * cell, rows * (cell + text_h)), "white")
    draw = ImageDraw.Draw(grid)
    for i, (img, caption) in enumerate(zip(images, captions)):
        tile = Image.fromarray(img.permute(1, 2, 0).cpu().numpy()).resize((cell, cell), Image.NEAREST)
        x, y = (i % columns) * cell, (i // columns) * (cell + text_h)
        grid.paste(tile, (x, y))
        lines = textwrap.wrap(caption, width=cell // 6)[:3]
        draw.multiline_text((x + 2, y + cell + 1), "\n".join(lines), fill="black", spacing=0)
    return grid


class SampleGrid(L.Callback):
    """Publishes what ``FlowModule.validation_step`` (and ``test_step``) generated, once per run of the loop.

    On disk, always: ``<log_dir>/samples/step_000123.png`` (a grid of the image outputs, or of each video's first
    frame, captioned with the prompt and the total reward), ``step_000123.json`` (index, prompt and rewards of every
    sample, in grid order) and every output of every sample in ``step_000123/`` (PNG, GIF, WAV). Then to each
    logger the trainer has (TensorBoard, W&B, CSV; :mod:`ff_core.callbacks.media_log`). ``ff test`` writes
    ``test_step_000123.*``.

    Args:
        columns: images per grid row.
        cell: pixel size each image is upscaled to.
        send_to_loggers: also send the samples to the trainer's loggers (the files are always written).
        video_format: videos on disk and to W&B as ``gif`` (default) or ``mp4`` (H.264 through PyAV, at the
            adapter's frame rate); TensorBoard always gets a GIF.
    """

    def __init__(self, columns: int = 6, cell: int = 96, send_to_loggers: bool = True,
                 video_format: str = "gif") -> None:
        self.columns, self.cell = columns, cell
        self.video_format = check_video_format(video_format, "SampleGrid")
        self.send_to_loggers = send_to_loggers
        self._samples: list[EvalSample] = []
        self.last_path: Path | None = None
        self.last_loggers: list[str] = []
        self.out_dir: Path | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.out_dir = log_dir(trainer)

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._samples = []

    def on_test_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._samples = []

    def on_validation_batch_end(self, trainer, pl_module, outputs: Any, batch, batch_idx, dataloader_idx=0) -> None:
        self._samples.extend(self._with_format(samples_from_outputs(outputs)))

    def _with_format(self, samples: list[EvalSample]) -> list[EvalSample]:
        for sample in samples:
            sample.video_format = self.video_format
        return samples

    def on_test_batch_end(self, trainer, pl_module, outputs: Any, batch, batch_idx, dataloader_idx=0) -> None:
        self._samples.extend(self._with_format(samples_from_outputs(outputs)))

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.publish(trainer, "val")

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.publish(trainer, "test")

    def publish(self, trainer: L.Trainer, prefix: str) -> None:
        samples = self._samples
        if trainer.world_size > 1 and torch.distributed.is_initialized():
            # Under DDP every rank generated a shard of the prompts: gather them all (a collective: every rank
            # calls it), then keep one copy per index (the distributed sampler repeats tail items to even out).
            gathered: list[Any] = [None] * trainer.world_size
            torch.distributed.all_gather_object(gathered, samples)
            samples = list({s.index: s for part in gathered for s in part}.values())
        if not samples or not trainer.is_global_zero:
            return
        samples.sort(key=lambda s: s.index)
        stem = f"step_{trainer.global_step:06d}" if prefix == "val" else f"{prefix}_step_{trainer.global_step:06d}"
        path = self.out_dir / "samples" / f"{stem}.png"
        grid = self.grid(samples)
        if grid is not None:
            save_png(grid, path)
            self.last_path = path
        files = write_sample_files(samples, path.with_suffix(""))
        # The full prompts and rewards of the grid, in grid order (captions in the image are cut to fit their cell).
        index = [{"index": s.index, "prompt": s.prompt, **({"rewards": s.rewards, "reward": s.reward}
                                                             if s.reward is not None else {})} for s in samples]
        write_bytes_atomic(path.with_suffix(".json"), json.dumps(index, indent=1).encode())
        if self.send_to_loggers:
            self.last_loggers = send_to_loggers(trainer.loggers, samples, grid, trainer.global_step, prefix, files)

    def grid(self, samples: list[EvalSample]) -> Image.Image | None:
        """The captioned grid of each sample's first image (a video's first frame); ``None`` without either."""
        kinds = samples[0].output_types
        position = next((i for i, k in enumerate(kinds) if k in ("image", "video")), None)
        if position is None:
            return None
        images = [s.media[position] if kinds[position] == "image" else s.media[position][0] for s in samples]
        captions = [s.prompt if s.reward is None else f"{s.reward:.3g} {s.prompt}" for s in samples]
        return image_grid(images, captions, self.cell, self.columns)


class LossCurve(L.Callback):
    """Records a logged training metric every step and writes ``loss.csv`` and ``loss.png`` at each validation.

    Args:
        smoothing: window of the moving average drawn over the raw curve.
        metric: the training metric drawn, as the objective logs it without ``train/`` (``loss``, GRPO's
            ``reward_mean`` or ``policy_loss``); ``None``: the objective's ``curve_metric`` (SFT and offline DPO:
            ``loss``; GRPO, which logs no ``loss``: ``reward_mean``). The CSV's second column is named after it.
    """

    def __init__(self, smoothing: int = 20, metric: str | None = None) -> None:
        self.smoothing = smoothing
        self.metric = metric
        self.history: list[tuple[int, float]] = []
        self.out_dir: Path | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.out_dir = log_dir(trainer)
        if self.metric is None:
            self.metric = getattr(getattr(pl_module, "objective", None), "curve_metric", "loss")

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch, batch_idx) -> None:
        # What the step logged (``self.log(..., on_step=True)``), not its return value: an objective that optimises
        # itself (GRPO) returns nothing, and logs its own keys.
        key = f"train/{self.metric}"
        value = trainer.callback_metrics.get(key)
        if value is None:
            logged = sorted(k for k in trainer.callback_metrics if k.startswith("train/"))
            raise KeyError(f"LossCurve: the training step logged no {key!r} (it logged {logged}); set the "
                           "callback's init_args.metric to one of them")  # fmt: skip
        self.history.append((trainer.global_step, float(value)))

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write(trainer)

    def write(self, trainer: L.Trainer) -> None:
        if not self.history or not trainer.is_global_zero:
            return
        out = self.out_dir
        csv = f"step,{self.metric}\n" + "".join(f"{s},{v:.6f}\n" for s, v in self.history)
        write_bytes_atomic(out / "loss.csv", csv.encode())
        save_png(self.plot(), out / "loss.png")

    def plot(
        self, width: int = 480, height: int = 240, title: str | None = None
    ) -> Image.Image:
        title = title or f"training {self.metric or 'loss'} (raw, moving average)"
        image = Image.new("RGB", (width, height), "white")
        draw = ImageDraw.Draw(image)
        steps = [s for s, _ in self.history]
        values = [v for _, v in self.history]
        k = max(1, min(self.smoothing, len(values)))
        windows = [values[max(0, i - k + 1) : i + 1] for i in range(len(values))]
        smooth = [sum(w) / len(w) for w in windows]
        lo, hi = min(values), max(values)
        x0, y0, x1, y1 = 40, 10, width - 10, height - 25
        span_x = max(steps[-1] - steps[0], 1)
        span_y = max(hi - lo, 1e-12)

        def xy(step: int, value: float) -> tuple[float, float]:
            return x0 + (step - steps[0]) / span_x * (x1 - x0), y1 - (value - lo) / span_y * (y1 - y0)

        draw.rectangle((x0, y0, x1, y1), outline="black")
        draw.line([xy(s, v) for s, v in zip(steps, values)], fill=(170, 190, 230), width=1)
        draw.line([xy(s, v) for s, v in zip(steps, smooth)], fill=(20, 60, 200), width=2)
        draw.text((2, y0), f"{hi:.3g}", fill="black")
        draw.text((2, y1 - 10), f"{lo:.3g}", fill="black")
        draw.text((x0, y1 + 5), f"step {steps[0]}", fill="black")
        draw.text((x1 - 70, y1 + 5), f"step {steps[-1]}", fill="black")
        draw.text((x0 + 5, y0 + 3), title, fill="black")
        return image
