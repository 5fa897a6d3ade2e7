"""The "shapes" demo dataset: saturated coloured shapes on plain backgrounds, with a colour classifier.

Every image is one circle, square or triangle in one of six saturated colours whose hues are 60 degrees apart
(red 0, yellow 60, green 120, cyan 180, blue 240, magenta 300), on a white, black or gray background. The colour
is therefore recoverable from the hue of the saturated pixels alone, which makes :func:`dominant_colour` an exact
classifier on the dataset and a cheap, weight-free reward ("does the sample show the colour the prompt asked
for?") for the demo recipes.

Layout written by :func:`write_shapes_dataset` (spec: dataset-guide, strict V2 demonstration records)::

    out_dir/images/00000.png ...
    out_dir/train.jsonl      one V2 demonstration record per line
    out_dir/test.txt         one legacy evaluation prompt per line (colours cycle through the palette)

:func:`write_preference_dataset` writes V2 preference records instead (offline DPO): each prompt with a chosen and a
rejected image, ``out_dir/pairs/00000_chosen.png`` and ``00000_rejected.png``, that differ only in the shape's colour.

CLI: ``python -m ff_core.testing.shapes OUT_DIR [--n-train 384] [--n-test 12] [--size 32] [--seed 0]
[--preference [--chosen-shift 0] [--rejected-shift K] | [--pair CHOSEN,REJECTED]]``.
"""

from __future__ import annotations

import argparse
import colorsys
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image, ImageDraw
from torch import Tensor

from ff_core.rewards import Reward, RewardBatch

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "yellow": (255, 255, 0),
    "green": (0, 255, 0),
    "cyan": (0, 255, 255),
    "blue": (0, 0, 255),
    "magenta": (255, 0, 255),
}
"""Shape colours, fully saturated, hues 60 degrees apart (so nearest-hue classification is unambiguous)."""

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
BACKGROUNDS: dict[str, tuple[int, int, int]] = {"white": (255, 255, 255), "black": (0, 0, 0), "gray": (128, 128, 128)}
COLOURS: tuple[str, ...] = tuple(PALETTE)
_HUES = {name: colorsys.rgb_to_hsv(*(c / 255 for c in rgb))[0] * 360 for name, rgb in PALETTE.items()}


@dataclass(frozen=True)
class ShapeSpec:
    """One drawn image: what it shows and where."""

    colour: str
    shape: str
    background: str

    @property
    def prompt(self) -> str:
        return f"a {self.colour} {self.shape} on a {self.background} background"


def draw_shape(spec: ShapeSpec, size: int, rng: random.Random) -> Image.Image:
    """Draw ``spec`` on a ``size`` x ``size`` RGB canvas, with jittered size (radius 22-36 % of the side)
    and centre (+-12 %). No antialiasing: every shape pixel carries the exact palette colour."""
    img = Image.new("RGB", (size, size), BACKGROUNDS[spec.background])
    draw = ImageDraw.Draw(img)
    r = size * rng.uniform(0.22, 0.36)
    cx = size / 2 + size * rng.uniform(-0.12, 0.12)
    cy = size / 2 + size * rng.uniform(-0.12, 0.12)
    fill = PALETTE[spec.colour]
    if spec.shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif spec.shape == "square":
        h = r * 0.85  # a square of half-side r looks bigger than a circle of radius r
        draw.rectangle((cx - h, cy - h, cx + h, cy + h), fill=fill)
    elif spec.shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + 0.8 * r), (cx + r, cy + 0.8 * r)], fill=fill)
    else:
        raise ValueError(f"unknown shape {spec.shape!r}; expected one of {SHAPES}")
    return img


def write_shapes_dataset(
    out_dir: str | Path, n_train: int = 384, n_test: int = 12, size: int = 32, seed: int = 0
) -> Path:
    """Write the shapes dataset to ``out_dir`` (see the module docstring); deterministic for ``seed``.

    Train colours cycle through the palette (balanced classes); shape and background are drawn at random.
    Test prompt colours cycle through the palette too, so ``n_test >= 6`` covers every colour.
    """
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for i in range(n_train):
        spec = ShapeSpec(COLOURS[i % len(COLOURS)], rng.choice(SHAPES), rng.choice(list(BACKGROUNDS)))
        rel = f"images/{i:05d}.png"
        draw_shape(spec, size, rng).save(out / rel)
        record = {
            "schema_version": 2,
            "input": {"prompt": spec.prompt, "media": []},
            "supervision": {"type": "demonstration", "target": {"media": [{"type": "image", "path": rel}]}},
            "metadata": {"colour": spec.colour, "shape": spec.shape, "background": spec.background},
        }
        lines.append(json.dumps(record, separators=(",", ":")))
    return _write_splits(out, lines, _palette_prompts(rng, n_test))


def _palette_prompts(rng: random.Random, n: int) -> list[str]:
    """``n`` evaluation prompts whose colours cycle through the palette (shape and background at random)."""
    return [ShapeSpec(COLOURS[i % len(COLOURS)], rng.choice(SHAPES), rng.choice(list(BACKGROUNDS))).prompt
            for i in range(n)]


def _write_splits(out: Path, train_lines: list[str], test_prompts: list[str]) -> Path:
    (out / "train.jsonl").write_text("\n".join(train_lines) + "\n")
    (out / "test.txt").write_text("\n".join(test_prompts) + "\n")
    return out


def write_preference_dataset(
    out_dir: str | Path,
    n_train: int = 384,
    n_test: int = 12,
    size: int = 32,
    seed: int = 0,
    chosen_shift: int = 0,
    rejected_shift: int | None = None,
    pair: tuple[str, str] | None = None,
) -> Path:
    """Write a shapes preference dataset to ``out_dir`` (see the module docstring); deterministic for ``seed``.

    Prompt colours cycle through the palette (shape and background at random, as :func:`write_shapes_dataset`). For
    a prompt asking for palette colour ``k``, the chosen image shows ``COLOURS[(k + chosen_shift) % 6]`` and the
    rejected one ``COLOURS[(k + rejected_shift) % 6]`` (``rejected_shift`` ``None``: a random colour other than the
    chosen one), the same shape at the same place on the same background: the pair differs in colour alone. The
    default prefers the colour the prompt asks for. With ``pair=(chosen, rejected)`` every pair has these two colours
    and the prompts name none ("a circle on a white background"): a preference between colours the prompt leaves
    open (the preference benchmark). ``test.txt`` holds legacy evaluation prompts: colours cycling through the
    palette, or with ``pair`` every shape on every background in turn.

    Args:
        out_dir: the dataset folder (created).
        n_train: preference records.
        n_test: evaluation prompts.
        size: image side in pixels.
        seed: drawing seed.
        chosen_shift: palette steps from the prompt's colour to the chosen image's.
        rejected_shift: palette steps from the prompt's colour to the rejected image's (``None``: random).
        pair: the (chosen, rejected) colours of every pair, for prompts without a colour; the shifts must be unset.
    """
    if pair is not None and (chosen_shift or rejected_shift is not None or len(set(pair)) != 2
                             or not set(pair) <= set(COLOURS)):  # fmt: skip
        raise ValueError(f"pair={pair!r}: two different palette colours {COLOURS}, without chosen/rejected shifts")
    if rejected_shift is not None and (rejected_shift - chosen_shift) % len(COLOURS) == 0:
        raise ValueError(f"chosen_shift={chosen_shift} and rejected_shift={rejected_shift} pick the same colour")
    out = Path(out_dir)
    (out / "pairs").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for i in range(n_train):
        k = i % len(COLOURS)
        spec = ShapeSpec(COLOURS[k], rng.choice(SHAPES), rng.choice(list(BACKGROUNDS)))
        if pair is not None:
            (chosen, rejected), prompt = pair, _colourless_prompt(spec.shape, spec.background)
        else:
            chosen, prompt = COLOURS[(k + chosen_shift) % len(COLOURS)], spec.prompt
            if rejected_shift is None:
                rejected = rng.choice([c for c in COLOURS if c != chosen])
            else:
                rejected = COLOURS[(k + rejected_shift) % len(COLOURS)]
        placement = rng.getstate()  # both images drawn from one state: same size and place
        media = {}
        for arm, colour in (("chosen", chosen), ("rejected", rejected)):
            rng.setstate(placement)
            rel = f"pairs/{i:05d}_{arm}.png"
            draw_shape(ShapeSpec(colour, spec.shape, spec.background), size, rng).save(out / rel)
            media[arm] = {"media": [{"type": "image", "path": rel}]}
        record = {
            "schema_version": 2,
            "input": {"prompt": prompt, "media": []},
            "supervision": {"type": "preference", **media},
            "metadata": {"colour": None if pair else spec.colour, "chosen": chosen, "rejected": rejected,
                         "shape": spec.shape, "background": spec.background},
        }  # fmt: skip
        lines.append(json.dumps(record, separators=(",", ":")))
    if pair is not None:
        backgrounds = list(BACKGROUNDS)
        prompts = [_colourless_prompt(SHAPES[i % 3], backgrounds[i // 3 % 3]) for i in range(n_test)]
    else:
        prompts = _palette_prompts(rng, n_test)
    return _write_splits(out, lines, prompts)


def write_prompt_dataset(out: Path | str, colourless: bool = True) -> Path:
    """A prompt-only dataset for online RL (GRPO): ``train.txt`` and ``test.txt``, one prompt per line, each holding
    every (shape, background) prompt: colourless ones ("a circle on a white background", which the demo model draws
    in a spread of colours: the colour rewards' playground), or with ``colourless=False`` one per palette colour too.

    Args:
        out: the dataset folder (created).
        colourless: prompts that name no colour.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if colourless:
        prompts = [_colourless_prompt(shape, bg) for bg in BACKGROUNDS for shape in SHAPES]
    else:
        prompts = [ShapeSpec(c, shape, bg).prompt for c in COLOURS for bg in BACKGROUNDS for shape in SHAPES]
    for split in ("train", "test"):
        (out / f"{split}.txt").write_text("\n".join(prompts) + "\n")
    return out


def _colourless_prompt(shape: str, background: str) -> str:
    return f"a {shape} on a {background} background"


def _to_float_hwc(image: Tensor | Image.Image) -> Tensor:
    if isinstance(image, Image.Image):
        return torch.frombuffer(bytearray(image.convert("RGB").tobytes()), dtype=torch.uint8).view(
            image.height, image.width, 3
        ).float() / 255
    if image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"expected an RGB image tensor of shape (3, H, W), got {tuple(image.shape)}")
    x = image.float() / 255 if image.dtype == torch.uint8 else image.float().clamp(0, 1)
    return x.permute(1, 2, 0)


def dominant_colour(image: Tensor | Image.Image, min_fraction: float = 0.01) -> str:
    """The palette colour most saturated pixels of ``image`` are closest to, by hue; ``"none"`` if none.

    Args:
        image: uint8 (3, H, W) tensor, float (3, H, W) tensor in [0, 1], or a PIL image.
        min_fraction: fewest saturated pixels (as a fraction of the image) for a verdict.

    Pixels with HSV saturation <= 0.5 or value <= 0.3 are background, gray or edge blends and are ignored;
    each remaining pixel votes for the palette colour with the nearest hue (circular distance).
    """
    x = _to_float_hwc(image).reshape(-1, 3)
    mx, _ = x.max(1)
    mn, _ = x.min(1)
    chroma = mx - mn
    keep = (chroma > 0.5 * mx) & (mx > 0.3)
    if keep.sum() < max(1, min_fraction * x.shape[0]):
        return "none"
    r, g, b = x[keep].unbind(1)
    c, m = chroma[keep], mx[keep]
    # Standard RGB -> hue (degrees), vectorised.
    hue = torch.where(
        m == r, ((g - b) / c) % 6, torch.where(m == g, (b - r) / c + 2, (r - g) / c + 4)
    ) * 60
    ref = torch.tensor([_HUES[n] for n in COLOURS])
    d = (hue[:, None] - ref[None, :]).abs() % 360
    d = torch.minimum(d, 360 - d)
    votes = torch.bincount(d.argmin(1), minlength=len(COLOURS))
    return COLOURS[int(votes.argmax())]


def prompt_colour(prompt: str) -> str:
    """The first palette colour word in ``prompt`` (case-insensitive), or ``"none"``."""
    for word in re.findall(r"[a-z]+", prompt.lower()):
        if word in PALETTE:
            return word
    return "none"


class PromptColourReward(Reward):
    """Shapes demo reward: 1 when a sample's :func:`dominant_colour` is the colour its prompt names
    (:func:`prompt_colour`), else 0; its mean over the evaluation prompts is the demo's colour accuracy. Recipes name
    it by dotted path, ``ff_core.testing.shapes:PromptColourReward``.

    Args:
        default: the colour to reward for prompts that name none (the preference benchmark's chosen colour);
            ``None``: such prompts score 0.
    """

    name = "shapes_prompt_colour"

    def __init__(self, default: str | None = None) -> None:
        super().__init__()
        if default is not None and default not in PALETTE:
            raise ValueError(f"default must be a palette colour {COLOURS}, got {default!r}")
        self.default = default

    def __call__(self, batch: RewardBatch) -> Tensor:
        wanted = [prompt_colour(p) for p in batch.prompts]
        wanted = [self.default if w == "none" and self.default else w for w in wanted]
        images = batch.outputs(self.media_types, self.name)
        return torch.tensor([float(dominant_colour(x.cpu()) == w) for x, w in zip(images, wanted)])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ff_core.testing.shapes", description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--n-train", type=int, default=384)
    p.add_argument("--n-test", type=int, default=12)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preference", action="store_true", help="write V2 preference pairs (offline DPO)")
    p.add_argument("--chosen-shift", type=int, default=0, help="palette steps from the prompt's colour (--preference)")
    p.add_argument("--rejected-shift", type=int, default=None, help="as --chosen-shift; default: a random other colour")
    p.add_argument("--pair", default=None, help="CHOSEN,REJECTED colours of every pair, prompts without a colour")
    p.add_argument("--prompts", action="store_true", help="write a prompt-only dataset (online RL: GRPO)")
    a = p.parse_args(argv)
    if a.prompts:
        out = write_prompt_dataset(a.out_dir)
        print(f"wrote the colourless shape prompts (train.txt, test.txt) to {out}")
        return
    if a.preference:
        pair = tuple(a.pair.split(",")) if a.pair else None
        out = write_preference_dataset(a.out_dir, n_train=a.n_train, n_test=a.n_test, size=a.size, seed=a.seed,
                                       chosen_shift=a.chosen_shift, rejected_shift=a.rejected_shift, pair=pair)
        print(f"wrote {a.n_train} preference pairs and {a.n_test} test prompts to {out}")
        return
    out = write_shapes_dataset(a.out_dir, n_train=a.n_train, n_test=a.n_test, size=a.size, seed=a.seed)
    print(f"wrote {a.n_train} training images and {a.n_test} test prompts to {out}")


if __name__ == "__main__":
    main()
