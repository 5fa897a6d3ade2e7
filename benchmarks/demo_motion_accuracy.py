"""Does the video demo model move the shape the way its prompt says?

Loads a FlowModule checkpoint (default: the latest video demo run), generates ``--seeds`` clips for every prompt of
the moving-shapes test split ("a red square moving left"), and scores each clip with
:func:`ff_core.testing.moving_shapes.motion_accuracy`: the direction of the saturated pixels' centroid over time, and
the clip's colour, against the caption. The untrained base (same checkpoint folder, its random transformer) is scored
side by side as the baseline: chance is 50 % for the direction (a random model mostly scores "none": no measurable
motion). Writes the trained model's first-seed clips as MP4 files and a PNG of their frames, one clip per row.

    python benchmarks/demo_motion_accuracy.py [--checkpoint runs/demo_video/version_0/checkpoints/last.ckpt]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from PIL import Image, ImageDraw

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from demo_checkpoint import generate, latest_checkpoint, load_trained_and_base  # noqa: E402

from ff_core.testing.moving_shapes import MotionScore, motion_accuracy, write_mp4  # noqa: E402


def frame_strips(samples: list[tuple[str, torch.Tensor]], scale: int = 3) -> Image.Image:
    """One row per clip: its frames left to right (nearest-upscaled by ``scale``), the prompt on the left."""
    text_w = 170
    t, _, h, w = samples[0][1].shape
    sheet = Image.new("RGB", (text_w + t * w * scale, len(samples) * h * scale), "white")
    draw = ImageDraw.Draw(sheet)
    for row, (prompt, clip) in enumerate(samples):
        y = row * h * scale
        draw.text((2, y + 2), prompt, fill="black")
        for i, frame in enumerate(clip):
            tile = Image.fromarray(frame.permute(1, 2, 0).cpu().numpy()).resize((w * scale, h * scale), Image.NEAREST)
            sheet.paste(tile, (text_w + i * w * scale, y))
    return sheet


def score(samples: list[tuple[str, torch.Tensor]]) -> MotionScore:
    return motion_accuracy([clip for _, clip in samples], [p for p, _ in samples])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--run-dir", type=Path, default=Path("runs/demo_video"))
    parser.add_argument("--prompts", type=Path, default=Path("build/moving_shapes/test.txt"))
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fps", type=float, default=8.0, help="frame rate of the written MP4s")
    parser.add_argument("--out", type=Path, default=None, help="folder for the trained model's clips and frames PNG")
    args = parser.parse_args()

    ckpt = args.checkpoint or latest_checkpoint(args.run_dir, "scripts/demo_video.sh")
    prompts = [line.strip() for line in args.prompts.read_text().splitlines() if line.strip()]
    trained, base = load_trained_and_base(ckpt)

    rows = []
    for label, module in (("untrained base (baseline)", base), (f"trained ({ckpt})", trained)):
        samples = generate(module, prompts, args.seeds, args.steps)
        result = score(samples)
        rows.append((label, result))
        print(f"{label}: direction confusion (wanted, found): count: {result.confusion}")
        if module is trained:
            out = args.out or ckpt.parent.parent / "samples" / "motion_eval"
            out.mkdir(parents=True, exist_ok=True)
            first = samples[: len(prompts)]
            for i, (_, clip) in enumerate(first):
                write_mp4(out / f"{i:02d}.mp4", clip.permute(0, 2, 3, 1).contiguous().numpy(), args.fps)
            frame_strips(first).save(out / "frames.png")
            print(f"trained samples (seed 0): {out}/*.mp4, {out}/frames.png")
    print("\n| model | direction matches prompt | colour matches | both | clips |\n|---|---|---|---|---|")
    for label, r in rows:
        print(f"| {label} | {r.direction:.1%} | {r.colour:.1%} | {r.both:.1%} | {r.n} |")


if __name__ == "__main__":
    main()
