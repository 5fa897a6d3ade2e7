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
import warnings
from pathlib import Path

import torch
from PIL import Image, ImageDraw

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ff_core.adapter import ConditionInput  # noqa: E402
from ff_core.module import FlowModule  # noqa: E402
from ff_core.testing.moving_shapes import MotionScore, motion_accuracy, write_mp4  # noqa: E402


def latest_checkpoint(run_dir: Path) -> Path:
    candidates = sorted(run_dir.glob("version_*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise SystemExit(f"no checkpoint under {run_dir}/version_*/checkpoints: run scripts/demo_video.sh first")
    return candidates[-1]


@torch.no_grad()
def generate(module: FlowModule, prompts: list[str], seeds: int, steps: int) -> list[tuple[str, torch.Tensor]]:
    """``(prompt, uint8 clip (T, 3, H, W))`` for every seed and prompt, seed-major."""
    adapter = module.adapter.eval()
    conditions = adapter.preprocess([ConditionInput(p) for p in prompts])
    batch = torch.utils.data.default_collate(conditions)
    out = []
    for seed in range(seeds):
        state = adapter.sample(adapter.prepare_condition(batch), num_steps=steps,
                               generator=torch.Generator().manual_seed(seed))
        out += [(p, media[0]) for p, media in zip(prompts, adapter.decode(state))]
    return out


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

    ckpt = args.checkpoint or latest_checkpoint(args.run_dir)
    prompts = [line.strip() for line in args.prompts.read_text().splitlines() if line.strip()]
    with warnings.catch_warnings():  # checkpoints hold trained tensors only: the frozen rest comes from the base
        warnings.filterwarnings("ignore", message="Found keys that are in the model state dict but not in the")
        trained = FlowModule.load_from_checkpoint(ckpt, map_location="cpu")
    base = FlowModule(adapter=trained.hparams.adapter,
                      pretrained_model_name_or_path=trained.hparams.pretrained_model_name_or_path,
                      adapter_kwargs=trained.hparams.adapter_kwargs)
    base.configure_model()

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
