"""The "moving shapes" video demo dataset: one saturated coloured shape sliding left or right, and its scorer.

The video counterpart of :mod:`ff_core.testing.shapes`. Every clip shows one circle, square or triangle in one of
the six palette colours (hues 60 degrees apart) crossing a plain background (black by default) at constant speed,
leftwards or rightwards, as its caption says: "a red square moving left". Colour and direction are recoverable from
the saturated pixels alone, so :func:`motion_direction` and :func:`clip_colour` are exact classifiers on the dataset
and :func:`motion_accuracy` (the share of generated clips whose direction, and colour, match the caption) scores a
video model without any weights.

Layout written by :func:`write_moving_shapes_dataset` (spec: dataset-guide, "Offline V2 records": video targets carry
their ``fps``)::

    out_dir/videos/00000.mp4 ...   H.264 MP4 written with PyAV at ``fps``
    out_dir/train.jsonl            one V2 demonstration record per line
    out_dir/test.txt               one legacy evaluation prompt per line (colour x direction cycling)

CLI: ``python -m ff_core.testing.moving_shapes OUT_DIR [--n-train 192] [--n-test 12] [--width 32] [--height 32]
[--frames 9] [--fps 8] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch
from PIL import Image, ImageDraw
from torch import Tensor

from ff_core.rewards import Reward, RewardBatch
from ff_core.testing.shapes import BACKGROUNDS, COLOURS, PALETTE, SHAPES, dominant_colour

DIRECTIONS: tuple[str, ...] = ("left", "right")
NO_MOTION = "none"
"""What :func:`motion_direction` returns when the shape is missing or does not move measurably."""


@dataclass(frozen=True)
class MotionSpec:
    """One clip: what it shows (the caption's words) and on what background."""

    colour: str
    shape: str
    direction: str
    background: str = "black"

    @property
    def prompt(self) -> str:
        return f"a {self.colour} {self.shape} moving {self.direction}"


def draw_clip(spec: MotionSpec, frames: int, width: int, height: int, rng: random.Random) -> np.ndarray:
    """Draw ``spec`` as ``frames`` uint8 RGB frames (F, H, W, 3).

    The shape's radius is 18-26 % of the height; its centre travels horizontally at constant speed, from a start
    in the first third of the way to an end in the last third (mirrored for "left"), at a random height: the
    displacement is at least a third of the free width, so the direction is plain to see in any two distant frames.
    No antialiasing: every shape pixel carries the exact palette colour.
    """
    if spec.direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {spec.direction!r}; expected one of {DIRECTIONS}")
    r = height * rng.uniform(0.18, 0.26)
    free = width - 2 * r  # the centre stays in [r, width - r]: the shape never leaves the canvas
    x0 = r + free * rng.uniform(0.0, 1 / 3)
    x1 = r + free * rng.uniform(2 / 3, 1.0)
    if spec.direction == "left":
        x0, x1 = width - x0, width - x1
    cy = height / 2 + (height / 2 - r) * rng.uniform(-0.6, 0.6)
    out = np.empty((frames, height, width, 3), dtype=np.uint8)
    for t in range(frames):
        cx = x0 + (x1 - x0) * t / max(frames - 1, 1)
        out[t] = np.asarray(_draw_frame(spec, width, height, cx, cy, r))
    return out


def _draw_frame(spec: MotionSpec, width: int, height: int, cx: float, cy: float, r: float) -> Image.Image:
    img = Image.new("RGB", (width, height), BACKGROUNDS[spec.background])
    draw = ImageDraw.Draw(img)
    fill = PALETTE[spec.colour]
    if spec.shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif spec.shape == "square":
        h = r * 0.85  # as in ff_core.testing.shapes: a square of half-side r looks bigger than the circle
        draw.rectangle((cx - h, cy - h, cx + h, cy + h), fill=fill)
    elif spec.shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + 0.8 * r), (cx + r, cy + 0.8 * r)], fill=fill)
    else:
        raise ValueError(f"unknown shape {spec.shape!r}; expected one of {SHAPES}")
    return img


def write_mp4(path: str | Path, frames: np.ndarray, fps: float, qp: int = 10) -> Path:
    """Write uint8 RGB frames (F, H, W, 3) as an H.264 MP4 with PyAV, every frame at ``1 / fps`` s.

    ``yuv420p`` (the pixel format every player reads) halves the chroma resolution, so the sizes must be even; a low
    constant ``qp`` keeps the palette colours saturated enough for :func:`~ff_core.testing.shapes.dominant_colour`
    and the bytes deterministic (x264's crf rate control gave different files for the same frames here).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    f, h, w, _ = frames.shape
    if h % 2 or w % 2:
        raise ValueError(f"yuv420p needs even frame sizes, got {w}x{h}")
    rate = Fraction(fps).limit_denominator(1001)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.options = {"qp": str(qp), "preset": "medium"}
        for t in range(f):
            frame = av.VideoFrame.from_ndarray(frames[t], format="rgb24")
            frame.pts = t
            frame.time_base = 1 / rate
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_moving_shapes_dataset(
    out_dir: str | Path,
    n_train: int = 192,
    n_test: int = 12,
    width: int = 32,
    height: int = 32,
    frames: int = 9,
    fps: float = 8.0,
    seed: int = 0,
    backgrounds: Sequence[str] = ("black",),
) -> Path:
    """Write the moving-shapes dataset to ``out_dir`` (see the module docstring); deterministic for ``seed``.

    Train clips cycle through every (colour, direction) pair, so the classes are balanced; shape and background
    are drawn at random. Test prompts cycle through the pairs too (``n_test >= 12`` covers every one).

    Args:
        out_dir: the dataset folder (created).
        n_train: training clips.
        n_test: evaluation prompts.
        width: frame width in pixels (even).
        height: frame height in pixels (even).
        frames: frames per clip.
        fps: the clips' frame rate, written into the MP4 and each record's ``fps``.
        seed: drawing seed.
        backgrounds: background names (keys of :data:`ff_core.testing.shapes.BACKGROUNDS`) drawn at random.
    """
    unknown = [b for b in backgrounds if b not in BACKGROUNDS]
    if unknown or not backgrounds:
        raise ValueError(f"backgrounds={list(backgrounds)!r}: expected a non-empty subset of {list(BACKGROUNDS)}")
    out = Path(out_dir)
    (out / "videos").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    pairs = [(c, d) for c in COLOURS for d in DIRECTIONS]
    lines = []
    for i in range(n_train):
        colour, direction = pairs[i % len(pairs)]
        spec = MotionSpec(colour, rng.choice(SHAPES), direction, rng.choice(list(backgrounds)))
        rel = f"videos/{i:05d}.mp4"
        write_mp4(out / rel, draw_clip(spec, frames, width, height, rng), fps)
        record = {
            "schema_version": 2,
            "input": {"prompt": spec.prompt, "media": []},
            "supervision": {"type": "demonstration", "target": {"media": [{"type": "video", "path": rel, "fps": fps}]}},
            "metadata": {"colour": colour, "shape": spec.shape, "direction": direction, "background": spec.background},
        }
        lines.append(json.dumps(record, separators=(",", ":")))
    (out / "train.jsonl").write_text("\n".join(lines) + "\n")
    test = [MotionSpec(c, rng.choice(SHAPES), d).prompt for c, d in (pairs[i % len(pairs)] for i in range(n_test))]
    (out / "test.txt").write_text("\n".join(test) + "\n")
    return out


# ---------------------------------------------------------------------------------------------------------
# Scoring generated clips.
def _as_frames(clip: Tensor | np.ndarray) -> Tensor:
    """A clip as float (T, H, W, 3) in [0, 1], from uint8 (T, 3, H, W) (the adapters' decode) or (T, H, W, 3)."""
    x = torch.as_tensor(clip)
    if x.ndim != 4 or 3 not in (x.shape[1], x.shape[-1]):
        raise ValueError(f"expected a clip of shape (T, 3, H, W) or (T, H, W, 3), got {tuple(x.shape)}")
    if x.shape[1] == 3 and x.shape[-1] != 3:
        x = x.permute(0, 2, 3, 1)
    return x.float() / 255 if x.dtype == torch.uint8 else x.float().clamp(0, 1)


def saturated_mask(frames: Tensor) -> Tensor:
    """(T, H, W) bool: the pixels of float frames (T, H, W, 3) that belong to a palette shape.

    The same rule as :func:`~ff_core.testing.shapes.dominant_colour`: HSV saturation > 0.5 and value > 0.3, so white,
    black and gray backgrounds and dark or washed-out blends never count.
    """
    mx, mn = frames.max(-1).values, frames.min(-1).values
    return ((mx - mn) > 0.5 * mx) & (mx > 0.3)


def centroid_track(clip: Tensor | np.ndarray, min_fraction: float = 0.005) -> tuple[Tensor, Tensor]:
    """The horizontal centroid of each frame's saturated pixels, in pixels: ``(times, xs)`` for the frames that
    hold at least ``min_fraction`` of the frame's pixels (frames where the shape is missing are left out)."""
    frames = _as_frames(clip)
    mask = saturated_mask(frames)
    counts = mask.sum((1, 2))
    xs = torch.arange(frames.shape[2], dtype=torch.float32)
    centroid = (mask.sum(1).float() * xs).sum(-1) / counts.clamp(min=1)
    keep = counts >= max(1, min_fraction * frames.shape[1] * frames.shape[2])
    return torch.arange(frames.shape[0], dtype=torch.float32)[keep], centroid[keep]


def motion_direction(clip: Tensor | np.ndarray, min_travel: float = 0.1) -> str:
    """``"left"``, ``"right"`` or ``"none"``: which way the saturated shape of a clip moves.

    The sign of the least-squares slope of the horizontal centroid over time (:func:`centroid_track`); ``"none"``
    when fewer than two frames show the shape or when the fitted travel over the clip is below ``min_travel`` of the
    frame width (a shape standing still, or noise).

    Args:
        clip: uint8 (T, 3, H, W) as the video adapters decode, uint8 (T, H, W, 3) as PyAV decodes, or float in [0, 1].
        min_travel: smallest fitted displacement first to last frame, as a fraction of the width, for a verdict.
    """
    t, x = centroid_track(clip)
    if len(t) < 2:
        return NO_MOTION
    tc = t - t.mean()
    slope = float((tc * (x - x.mean())).sum() / (tc * tc).sum())
    width, span = _as_frames(clip).shape[2], float(t[-1] - t[0])
    if abs(slope) * span < min_travel * width:
        return NO_MOTION
    return "right" if slope > 0 else "left"


def clip_colour(clip: Tensor | np.ndarray) -> str:
    """The palette colour most saturated pixels of the whole clip are closest to (``"none"`` if none): the frames
    side by side through :func:`~ff_core.testing.shapes.dominant_colour`."""
    frames = _as_frames(clip)
    strip = frames.permute(3, 1, 0, 2).reshape(3, frames.shape[1], -1)  # (3, H, T * W)
    return dominant_colour(strip)


def prompt_motion(prompt: str) -> tuple[str, str]:
    """``(colour, direction)`` named by a caption ("a red square moving left"), ``"none"`` for either one missing."""
    words = re.findall(r"[a-z]+", prompt.lower())
    colour = next((w for w in words if w in PALETTE), NO_MOTION)
    direction = next((w for w in words if w in DIRECTIONS), NO_MOTION)
    return colour, direction


@dataclass(frozen=True)
class MotionScore:
    """How many clips match their captions.

    Attributes:
        n: clips scored.
        direction: share whose :func:`motion_direction` is the caption's direction.
        colour: share whose :func:`clip_colour` is the caption's colour.
        both: share matching in direction and colour.
        confusion: ``(wanted direction, found direction) -> count``.
    """

    n: int
    direction: float
    colour: float
    both: float
    confusion: dict[tuple[str, str], int]


def motion_accuracy(clips: Sequence[Tensor | np.ndarray], prompts: Sequence[str]) -> MotionScore:
    """Score generated ``clips`` against the captions they were generated from (one prompt per clip)."""
    if len(clips) != len(prompts) or not clips:
        raise ValueError(f"need one prompt per clip and at least one clip; got {len(clips)} clips, "
                         f"{len(prompts)} prompts")
    hits_dir = hits_col = hits_both = 0
    confusion: dict[tuple[str, str], int] = {}
    for clip, prompt in zip(clips, prompts):
        colour, direction = prompt_motion(prompt)
        got_dir, got_col = motion_direction(clip), clip_colour(clip)
        confusion[(direction, got_dir)] = confusion.get((direction, got_dir), 0) + 1
        hits_dir += got_dir == direction
        hits_col += got_col == colour
        hits_both += got_dir == direction and got_col == colour
    n = len(clips)
    return MotionScore(n, hits_dir / n, hits_col / n, hits_both / n, dict(sorted(confusion.items())))


class PromptMotionReward(Reward):
    """Moving-shapes reward: 1 when a generated clip moves the way its prompt says (:func:`motion_direction` against
    :func:`prompt_motion`), and with ``colour=True`` also shows the prompt's colour; else 0. Its mean over the test
    prompts is the video demo's accuracy. Name it by dotted path, ``ff_core.testing.moving_shapes:PromptMotionReward``.

    Args:
        colour: require the colour to match too.
    """

    name = "moving_shapes_prompt_motion"
    media_types = ("video",)

    def __init__(self, colour: bool = False) -> None:
        super().__init__()
        self.colour = colour

    def __call__(self, batch: RewardBatch) -> Tensor:
        clips = batch.outputs(self.media_types, self.name)
        scores = []
        for clip, prompt in zip(clips, batch.prompts):
            colour, direction = prompt_motion(prompt)
            ok = motion_direction(clip.cpu()) == direction and (not self.colour or clip_colour(clip.cpu()) == colour)
            scores.append(float(ok))
        return torch.tensor(scores, dtype=torch.float32)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ff_core.testing.moving_shapes", description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--n-train", type=int, default=192)
    p.add_argument("--n-test", type=int, default=12)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--height", type=int, default=32)
    p.add_argument("--frames", type=int, default=9)
    p.add_argument("--fps", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backgrounds", default="black", help="comma-separated: white, black, gray")
    a = p.parse_args(argv)
    out = write_moving_shapes_dataset(a.out_dir, n_train=a.n_train, n_test=a.n_test, width=a.width, height=a.height,
                                      frames=a.frames, fps=a.fps, seed=a.seed, backgrounds=a.backgrounds.split(","))
    print(f"wrote {a.n_train} training clips ({a.frames} frames, {a.width}x{a.height}, {a.fps:g} fps) "
          f"and {a.n_test} test prompts to {out}")


if __name__ == "__main__":
    main()
