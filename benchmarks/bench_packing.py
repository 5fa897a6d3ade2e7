"""Padding waste and throughput of the dataflow batchers on a realistic mix of clip lengths and resolutions.

Run: ``python benchmarks/bench_packing.py [--samples 20000] [--budget 80000]``. Prints a markdown table.

Token cost of a sample = text tokens + (H/(s·p))·(W/(s·p))·(1+(T−1)/t) with a Wan-like tokenizer (s=8, t=4, p=2).
* padding = padded tokens / (padded + real) when every sample of a batch is padded to the batch's largest
  (what a dense batch costs); packed = concatenated (SequentialPackingBatcher) has none by construction.
* fill = real tokens / (batches · budget): how much of the per-step token budget carries data.
* over budget = batches whose cost (padded, or packed for the sequential packer) exceeds the budget.
* samples/s = batching throughput of the batcher alone (no decoding).
"""

from __future__ import annotations

import argparse
import random
import time

from ff_core.data.dataflow import PoolPackingBatcher, SequentialPackingBatcher, SimpleBatcher, video_token_count

# (frames, height, width, weight): images, short and long clips at SD / HD / square resolutions
MIX = [(1, 1024, 1024, 3), (1, 512, 512, 2), (17, 480, 832, 3), (33, 480, 832, 4), (49, 480, 832, 3),
       (81, 480, 832, 2), (33, 720, 1280, 2), (49, 720, 1280, 1), (81, 512, 512, 2), (17, 256, 256, 2)]


def make_samples(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    weights = [m[3] for m in MIX]
    out = []
    for i in range(n):
        t, h, w, _ = rng.choices(MIX, weights)[0]
        text = rng.randint(8, 226)
        out.append({"id": i, "video": (3, t, h, w), "input_ids": range(text),
                    "n": text + video_token_count((3, t, h, w), 8, 4, 2)})
    return out


def measure(name: str, batcher, samples: list[dict], budget: int, packed: bool) -> dict:
    start = time.perf_counter()
    batches = list(batcher.batches(iter(samples)))
    seconds = time.perf_counter() - start
    real = sum(s["n"] for b in batches for s in b)
    padded = sum(len(b) * max(s["n"] for s in b) for b in batches)
    cost = [sum(s["n"] for s in b) if packed else len(b) * max(s["n"] for s in b) for b in batches]
    return {"batcher": name, "batches": len(batches), "samples/batch": sum(map(len, batches)) / len(batches),
            "padding": 0.0 if packed else (padded - real) / padded, "fill": real / (len(batches) * budget),
            "over budget": sum(c > budget for c in cost) / len(batches),
            "dropped": getattr(batcher, "dropped", 0), "samples/s": len(samples) / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--budget", type=int, default=80000, help="tokens per batch")
    args = parser.parse_args()
    samples, budget = make_samples(args.samples), args.budget
    size = lambda s: s["n"]  # noqa: E731
    rows = [
        measure("SimpleBatcher(1)", SimpleBatcher(1), samples, budget, packed=False),
        measure("SimpleBatcher(4), padded", SimpleBatcher(4), samples, budget, packed=False),
        measure("PoolPacking(pool=16, max_bs=1)", PoolPackingBatcher(budget, 16, 1, size_fn=size), samples, budget,
                packed=False),
        measure("PoolPacking(pool=16, max_bs=8, no halving)",
                PoolPackingBatcher(budget, 16, 8, apply_long_sample_halving=False, size_fn=size),
                samples, budget, packed=False),
        measure("PoolPacking(pool=64, max_bs=8, no halving)",
                PoolPackingBatcher(budget, 64, 8, apply_long_sample_halving=False, size_fn=size),
                samples, budget, packed=False),
        measure("SequentialPacking(budget), packed", SequentialPackingBatcher(max_sequence_length=budget),
                samples, budget, packed=True),
    ]
    cols = list(rows[0])
    print(f"{args.samples} samples, budget {budget} tokens; median sample "
          f"{sorted(s['n'] for s in samples)[len(samples) // 2]} tokens")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = [r["batcher"], str(r["batches"]), f"{r['samples/batch']:.2f}", f"{r['padding']:.1%}",
                 f"{r['fill']:.1%}", f"{r['over budget']:.1%}", str(r["dropped"]), f"{r['samples/s']:,.0f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
