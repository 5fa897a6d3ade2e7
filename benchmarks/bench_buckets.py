"""Batching a mixed-geometry clip set through the real loader: geometry buckets vs fixed batches.

Run: ``python benchmarks/bench_buckets.py [--clips 96] [--budget 600] [--workdir DIR]``. Prints a markdown table.

The clip set: H.264 MP4s (``ff_core.testing.clips``) at four source shapes (16:9, 9:16, 1:1, 4:3; 72-128 px) and
1.1-3 s at 16, 24 or 30 fps, as V2 SFT records. The recipe's buckets are three canvases (48x80, 80x48, 64x64) times
two clip lengths (17 and 33 frames at 16 fps); a record goes to the bucket of closest aspect whose frame grid fits
its clip (``ff_core.data.media.buckets``). Tokens of one target are Wan's: ``(1 + (F - 1) / 4) · (H / 16) · (W / 16)``
(VAE 8x spatial, 4x temporal, patch 2). Every batch comes out of ``DataflowLoader`` (``MapDistributor`` →
``RecordProcessor``: PyAV decode of the clip window + fit → batcher → ``SampleCollator``), one epoch.

* padding = padded / (padded + real) tokens when every sample of a batch is padded to the batch's largest;
* fill = real tokens / (batches · budget);
* over budget = batches whose padded cost exceeds the budget.

Compared: ``BucketBatcher`` with ``batch_size_b = budget // tokens_b`` (what ``data.max_tokens`` does), and fixed
``SimpleBatcher(B)`` over the same records, each fitted to its own bucket (mixed shapes padded), for B = 1 and the
largest B that keeps the largest bucket within budget.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from ff_core.contracts import MediaGeometry
from ff_core.data.dataflow import BucketBatcher, DataflowLoader, MapDistributor, SimpleBatcher
from ff_core.data.media.buckets import assign_buckets
from ff_core.data.records.sources import DatasetConfig, load_split
from ff_core.data.samples import ConditionedRecords, RecordProcessor, SampleCollator
from ff_core.testing.clips import write_clip_dataset

SOURCES = [(72, 128), (128, 72), (96, 96), (96, 128)]  # (height, width)
FPS = [16, 24, 30]
BUCKETS = [MediaGeometry(h, w, num_frames=f, fps=16.0) for h, w in ((48, 80), (80, 48), (64, 64)) for f in (17, 33)]


def tokens(frames: int, height: int, width: int) -> int:
    return (1 + (frames - 1) // 4) * (height // 16) * (width // 16)


def geometry_tokens(g: MediaGeometry) -> int:
    return tokens(g.num_frames, g.height, g.width)


def clip_set(n: int, seed: int = 0) -> list[tuple[int, int, int, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        h, w = rng.choice(SOURCES)
        fps = rng.choice(FPS)
        out.append((h, w, int(rng.uniform(1.1, 3.0) * fps), fps))
    return out


def run(table, processor, batcher, steps: int, budget: int) -> dict:
    loader = DataflowLoader(MapDistributor(table, seed=0), processor, batcher, SampleCollator(), steps_per_epoch=steps)
    start = time.perf_counter()
    real = padded = batches = over = samples = 0
    for batch in loader:
        sizes = [tokens(*t[0].frames.shape[:3]) for t in batch["target"]]
        cost = max(sizes) * len(sizes)
        real, padded = real + sum(sizes), padded + cost - sum(sizes)
        batches, samples = batches + 1, samples + len(sizes)
        over += cost > budget
    seconds = time.perf_counter() - start
    return {"batches": batches, "per_batch": samples / batches, "padding": padded / (padded + real),
            "fill": real / (batches * budget), "over": over / batches, "samples_s": samples / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=96)
    parser.add_argument("--budget", type=int, default=600)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    root = (args.workdir or Path(tempfile.mkdtemp(prefix="ff-buckets-"))) / "clips"
    if not (root / "train.jsonl").exists():
        write_clip_dataset(root, clip_set(args.clips))
    records = load_split(DatasetConfig(name="clips", dataset_dir=str(root)), "train", "sft")
    assignment = assign_buckets(records, BUCKETS)
    table = ConditionedRecords(records, [{} for _ in records])
    processor = RecordProcessor((None,), BUCKETS, assignment)
    cost = [geometry_tokens(g) for g in BUCKETS]
    sizes = [args.budget // c for c in cost]
    counts = [assignment.count(b) for b in range(len(BUCKETS))]
    print(f"{len(records)} clips; buckets (HxWxF: records, tokens, batch size): "
          + ", ".join(f"{g.height}x{g.width}x{g.num_frames}: {n}, {c}, {s}"
                      for g, n, c, s in zip(BUCKETS, counts, cost, sizes)))
    print()
    print("| batcher | batches | samples/batch | padding | fill | over budget | samples/s (decode incl.) |")
    print("|---|---|---|---|---|---|---|")
    bucket_steps = -(-sum(n / s for n, s in zip(counts, sizes)) // 1)
    largest_fixed = args.budget // max(cost)
    rows = [(f"BucketBatcher(budget // tokens_b), budget {args.budget}", BucketBatcher(sizes), int(bucket_steps)),
            ("SimpleBatcher(1)", SimpleBatcher(1), len(records)),
            (f"SimpleBatcher({largest_fixed}), padded", SimpleBatcher(largest_fixed),
             -(-len(records) // largest_fixed))]
    for name, batcher, steps in rows:
        r = run(table, processor, batcher, steps, args.budget)
        print(f"| {name} | {r['batches']} | {r['per_batch']:.2f} | {r['padding']:.1%} | {r['fill']:.1%} | "
              f"{r['over']:.1%} | {r['samples_s']:.0f} |")


if __name__ == "__main__":
    main()
