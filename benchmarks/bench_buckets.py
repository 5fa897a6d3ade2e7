"""Batching a mixed-geometry clip set through the real loader: geometry buckets vs fixed batches.

Run: ``python benchmarks/bench_buckets.py [--clips 96] [--budget 600] [--workdir DIR] [--model wan|ltx2]``. Prints
a markdown table.

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

``--model ltx2``: the LTX-2 case (docs/ltx2.md, "Buckets"). Audio+video records (an MP4 and a 16 kHz WAV of the same
length; 16:9, 9:16 and 1:1 sources of 72-128 px, 1.1-3 s at 24, 25 or 30 fps); buckets of LTX-2's grid at its 24-fps
clock: 64x128, 128x64 and 96x96 canvases (multiples of the VAE's 32) times 25, 49 and 65 frames (8 k + 1). A target's
tokens are the transformer's two streams: video ``((F - 1) / 8 + 1) (H / 32) (W / 32)`` plus audio ``round(F / 24 *
25)`` (the clip's own clock at 25 audio latents a second, what ``encode_output`` cuts; ``denoiser_tokens``); a batch
mixing clips pads each stream to its longest. Also compared: ``PoolPackingBatcher`` (token-budget packing by that
count over a pool of 16, padded within the batch): what packing without buckets reaches.
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
LTX2_SOURCES = [(72, 128), (128, 72), (96, 96)]
LTX2_FPS = [24, 25, 30]
LTX2_BUCKETS = [MediaGeometry(h, w, num_frames=f, fps=24.0) for h, w in ((64, 128), (128, 64), (96, 96))
                for f in (25, 49, 65)]  # fmt: skip


def ltx2_tokens(frames: int, height: int, width: int) -> tuple[int, int]:
    """LTX-2's (video, audio) tokens of a clip on its 24-fps clock: 32x spatial / 8x temporal VAE, patch 1; 25 audio
    latent frames a second (16 kHz, mel hop 160, 4x)."""
    return (1 + (frames - 1) // 8) * (height // 32) * (width // 32), round(frames / 24 * 25)


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


def run(table, processor, batcher, steps: int, budget: int, count=None) -> dict:
    """One epoch; ``count(frames, height, width)``: a target's tokens per stream (default: Wan's one stream), each
    stream padded to its longest in the batch."""
    count = count or (lambda *shape: (tokens(*shape),))
    loader = DataflowLoader(MapDistributor(table, seed=0), processor, batcher, SampleCollator(), steps_per_epoch=steps)
    start = time.perf_counter()
    real = padded = batches = over = samples = 0
    for batch in loader:
        streams = [count(*t[0].frames.shape[:3]) for t in batch["target"]]
        sizes = [sum(s) for s in streams]
        cost = sum(max(column) for column in zip(*streams)) * len(sizes)
        real, padded = real + sum(sizes), padded + cost - sum(sizes)
        batches, samples = batches + 1, samples + len(sizes)
        over += cost > budget
    seconds = time.perf_counter() - start
    return {"batches": batches, "per_batch": samples / batches, "padding": padded / (padded + real),
            "fill": real / (batches * budget), "over": over / batches, "samples_s": samples / seconds}


def ltx2_clip_set(n: int, seed: int = 0) -> list[tuple[int, int, int, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        h, w = rng.choice(LTX2_SOURCES)
        fps = rng.choice(LTX2_FPS)
        out.append((h, w, int(rng.uniform(1.1, 3.0) * fps), fps))
    return out


def write_av_dataset(root: Path, clips: list[tuple[int, int, int, int]]) -> Path:
    """V2 SFT records of (video with fps, audio with sample_rate) pairs: grey MP4s and 16 kHz tones of their length."""
    import json

    import numpy as np

    from ff_core.testing.clips import write_grey_mp4, write_wav

    rows = []
    for i, (height, width, frames, fps) in enumerate(clips):
        write_grey_mp4(root / "videos" / f"{i}.mp4", frames, fps, (height, width))
        t = np.arange(round(frames / fps * 16000)) / 16000
        write_wav(root / "audios" / f"{i}.wav", 0.3 * np.sin(2 * np.pi * 440 * t)[:, None], 16000)
        media = [{"type": "video", "path": f"videos/{i}.mp4", "fps": fps},
                 {"type": "audio", "path": f"audios/{i}.wav", "sample_rate": 16000}]  # fmt: skip
        rows.append({"schema_version": 2, "input": {"prompt": f"clip {i}"},
                     "supervision": {"type": "demonstration", "target": {"media": media}}})  # fmt: skip
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def ltx2_main(args: argparse.Namespace) -> None:
    """The LTX-2 case (module docstring)."""
    from ff_core.data.dataflow import PoolPackingBatcher

    root = (args.workdir or Path(tempfile.mkdtemp(prefix="ff-buckets-ltx2-"))) / "av"
    if not (root / "train.jsonl").exists():
        write_av_dataset(root, ltx2_clip_set(args.clips))
    records = load_split(DatasetConfig(name="av", dataset_dir=str(root)), "train", "sft")
    assignment = assign_buckets(records, LTX2_BUCKETS)
    table = ConditionedRecords(records, [{} for _ in records])
    processor = RecordProcessor((None, None), LTX2_BUCKETS, assignment)
    cost = [sum(ltx2_tokens(g.num_frames, g.height, g.width)) for g in LTX2_BUCKETS]
    sizes = [args.budget // c for c in cost]
    counts = [assignment.count(b) for b in range(len(LTX2_BUCKETS))]
    print(f"{len(records)} audio+video clips; buckets (HxWxF: records, tokens, batch size): "
          + ", ".join(f"{g.height}x{g.width}x{g.num_frames}: {n}, {c}, {s}"
                      for g, n, c, s in zip(LTX2_BUCKETS, counts, cost, sizes)))
    print()
    print("| batcher | batches | samples/batch | padding | fill | over budget | samples/s (decode incl.) |")
    print("|---|---|---|---|---|---|---|")
    largest_fixed = args.budget // max(cost)

    def size(sample) -> int:
        return sum(ltx2_tokens(*sample["target"][0].frames.shape[:3]))

    def packer(size_fn) -> PoolPackingBatcher:
        return PoolPackingBatcher(args.budget, pool_size=16, max_batch_size=len(records), size_fn=size_fn,
                                  apply_long_sample_halving=False)  # fmt: skip

    # The packer's batches in one epoch (the loader needs the count): packed from the records' costs alone.
    packed = sum(1 for _ in packer(lambda n: n).batches(iter([cost[b] for b in assignment])))

    rows = [(f"BucketBatcher(budget // tokens_b), budget {args.budget}", BucketBatcher(sizes),
             int(-(-sum(n / s for n, s in zip(counts, sizes)) // 1))),
            ("SimpleBatcher(1)", SimpleBatcher(1), len(records)),
            (f"SimpleBatcher({largest_fixed}), padded", SimpleBatcher(largest_fixed),
             -(-len(records) // largest_fixed)),
            (f"PoolPackingBatcher(budget {args.budget}, pool 16), padded", packer(size), packed)]
    for name, batcher, steps in rows:
        r = run(table, processor, batcher, steps, args.budget, count=ltx2_tokens)
        print(f"| {name} | {r['batches']} | {r['per_batch']:.2f} | {r['padding']:.1%} | {r['fill']:.1%} | "
              f"{r['over']:.1%} | {r['samples_s']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=96)
    parser.add_argument("--budget", type=int, default=600)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--model", choices=("wan", "ltx2"), default="wan")
    args = parser.parse_args()
    if args.model == "ltx2":
        ltx2_main(args)
        return
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
