"""How often does the demo model draw the colour its prompt asks for?

Loads a FlowModule checkpoint (default: the latest demo run), generates ``--seeds`` images for every prompt of
the shapes test split, classifies each image's dominant colour (``ff_core.testing.shapes.dominant_colour``) and
compares it with the prompt's colour. The untrained base (same architecture, random transformer) is measured
side by side as the baseline. Writes a grid of the trained model's samples.

    python benchmarks/demo_colour_accuracy.py [--checkpoint runs/demo/version_0/checkpoints/last.ckpt]
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from demo_checkpoint import generate, latest_checkpoint, load_trained_and_base  # noqa: E402

from ff_core.callbacks.samples import image_grid  # noqa: E402
from ff_core.testing.shapes import dominant_colour, prompt_colour  # noqa: E402


def accuracy(samples: list[tuple[str, torch.Tensor]]) -> tuple[float, Counter]:
    confusion = Counter((prompt_colour(p), dominant_colour(img)) for p, img in samples)
    hits = sum(n for (want, got), n in confusion.items() if want == got)
    return hits / len(samples), confusion


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--run-dir", type=Path, default=Path("runs/demo"))
    parser.add_argument("--prompts", type=Path, default=Path("build/shapes/test.txt"))
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--grid", type=Path, default=None, help="PNG of the trained model's samples")
    args = parser.parse_args()

    ckpt = args.checkpoint or latest_checkpoint(args.run_dir, "scripts/demo.sh")
    prompts = [line.strip() for line in args.prompts.read_text().splitlines() if line.strip()]
    trained, base = load_trained_and_base(ckpt)

    rows = []
    for label, module in (("untrained base (baseline)", base), (f"trained ({ckpt})", trained)):
        samples = generate(module, prompts, args.seeds, args.steps)
        acc, confusion = accuracy(samples)
        rows.append((label, acc, len(samples)))
        if module is trained:
            wrong = {k: n for k, n in confusion.items() if k[0] != k[1]}
            print("trained misclassifications (wanted, got): count:", dict(sorted(wrong.items())))
            grid_path = args.grid or ckpt.parent.parent / "samples" / "final_colour_eval.png"
            grid_path.parent.mkdir(parents=True, exist_ok=True)
            image_grid([img for _, img in samples[: len(prompts)]], [p for p, _ in samples[: len(prompts)]]).save(
                grid_path)
            print(f"samples grid: {grid_path}")
    print("\n| model | colour match | samples |\n|---|---|---|")
    for label, acc, n in rows:
        print(f"| {label} | {acc:.1%} | {n} |")


if __name__ == "__main__":
    main()
