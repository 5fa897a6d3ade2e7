"""Condition cache: cold vs warm time to the first training batch, and peak memory per rank as the dataset grows.

Run: ``python benchmarks/bench_cache.py [--prompts 3000] [--rss-rows 1000 10000] [--workdir DIR]``. Prints two
markdown tables. Every measurement runs in a fresh subprocess (one rank, one intra-op thread, no loader workers).

The model is the tiny SD3-architecture checkpoint of the tests, with 77-token tokenizers (as SD3's CLIP), so one
row holds prompt and negative-prompt embeddings of (154, 64) float32 plus pooled ones: 80 KiB. Datasets are V2 SFT
records ``a <colour> <shape> number <i>`` with a 32x32 PNG target each.

* Time to first batch: the data module reads and validates the records (``setup``), the adapter loads
  (``configure_model``), the conditions are prepared (``prepare_conditions``: built cold, opened warm) and the first
  batch of 8 comes out of the training loader. ``in memory`` is ``data.enable_preprocess: false``, which is what
  every run did before the cache: ``adapter.preprocess`` over every record at each start.
* Memory: one full epoch (batches of 32, targets decoded) after the conditions are prepared, warm; ``VmHWM`` is the
  process's peak resident set, ``RssAnon`` its private memory at the end, ``RssFile`` the mapped file pages resident
  at the end (the cache's pages it touched: shared page cache the kernel reclaims, not memory the process owns).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COLOURS = ("red", "green", "blue", "yellow", "cyan", "magenta")
SHAPES = ("circle", "square", "triangle")


def write_dataset(root: Path, n: int) -> Path:
    """``n`` V2 SFT records with distinct prompts and a 32x32 target each (written once)."""
    if (root / "train.jsonl").exists():
        return root
    from PIL import Image

    (root / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        colour, shape = COLOURS[i % 6], SHAPES[i // 6 % 3]
        Image.new("RGB", (32, 32), (i % 256, (i // 256) % 256, 0)).save(root / "images" / f"{i}.png")
        target = {"media": [{"type": "image", "path": f"images/{i}.png"}]}
        prompt = f"a {colour} {shape} number {i}"
        lines.append(json.dumps({"schema_version": 2, "input": {"prompt": prompt, "media": []},
                                 "supervision": {"type": "demonstration", "target": target}}))  # fmt: skip
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    return root


def child(args: argparse.Namespace) -> None:
    """One measurement in this (fresh) process; prints a JSON line."""
    import torch

    torch.set_num_threads(1)
    import lightning as L

    from ff_core.data.datamodule import FlowDataModule
    from ff_core.data.records.sources import DatasetConfig
    from ff_core.lora import LoRAConfig
    from ff_core.module import FlowModule

    batch = 8 if args.child == "ttfb" else 32
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, max_steps=1,
                        enable_checkpointing=False, enable_model_summary=False)  # fmt: skip
    model = FlowModule("sd3-5", args.model, adapter_kwargs={"resolution": 32},
                       lora=LoRAConfig(rank=4, target_modules=["to_q"]))  # fmt: skip
    data = FlowDataModule([DatasetConfig(name="bench", dataset_dir=args.data)], adapter="sd3-5",
                          per_device_batch_size=batch, preprocessing_batch_size=32, cache_dir=args.cache,
                          enable_preprocess=args.mode != "memory")  # fmt: skip
    trainer.strategy.connect(model)
    data.trainer = trainer
    times = {}
    t = time.perf_counter()
    data.setup("fit")
    times["setup"] = time.perf_counter() - t
    t = time.perf_counter()
    model.configure_model()  # no datamodule attached to the trainer: conditions are prepared below
    times["load"] = time.perf_counter() - t
    t = time.perf_counter()
    if data.prepare_conditions(model.adapter):
        model.adapter.release_preprocessing()
    times["conditions"] = time.perf_counter() - t
    t = time.perf_counter()
    loader = data.train_dataloader()
    batches = iter(loader)
    next(batches)
    times["first_batch"] = time.perf_counter() - t
    out = {"times": times, "reused": [r.reused for r in data.cache_results]}
    if args.child == "rss":
        for _ in batches:
            pass
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        out["memory_mib"] = {k: int(status[k].split()[0]) / 1024 for k in ("VmHWM", "RssAnon", "RssFile")}
        out["cache_mib"] = sum(r.bytes for r in data.cache_results) / 2**20
    print(json.dumps(out))


def run_child(*args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=3000)
    parser.add_argument("--rss-rows", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--workdir", help="keep the model and datasets here between runs (default: a temp folder)")
    parser.add_argument("--child", choices=["ttfb", "rss"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-cache-"))
    model = work / "tiny-sd3-77"
    if not (model / "model_index.json").exists():
        from ff_sd3.testing import build_tiny_sd3

        build_tiny_sd3(model, num_layers=2, text_max_length=77)
    common = ["--model", str(model)]

    print(f"### Time to first batch, {args.prompts} prompts\n")
    print("| run | setup | adapter load | conditions | first batch | data total | everything |")
    print("|---|---|---|---|---|---|---|")
    data = write_dataset(work / f"data-{args.prompts}", args.prompts)
    cache = work / f"cache-{args.prompts}"
    shutil.rmtree(cache, ignore_errors=True)
    rows = {}
    for name, mode in (("in memory (before)", "memory"), ("cold (builds the cache)", "cache"),
                       ("warm (reuses it)", "cache")):  # fmt: skip
        r = run_child("--child", "ttfb", *common, "--data", str(data), "--cache", str(cache), "--mode", mode)
        t = r["times"]
        rows[name] = (t["conditions"] + t["first_batch"], sum(t.values()))
        print(f"| {name} | {t['setup']:.2f} s | {t['load']:.2f} s | {t['conditions']:.2f} s | "
              f"{t['first_batch']:.3f} s | {rows[name][0]:.2f} s | {rows[name][1]:.2f} s |")  # fmt: skip
    cold, warm = rows["cold (builds the cache)"], rows["warm (reuses it)"]
    print(f"\nwarm / cold: data {100 * warm[0] / cold[0]:.1f} %, everything {100 * warm[1] / cold[1]:.1f} %\n")

    print("### Memory of one rank over a full epoch\n")
    print("| rows | conditions | cache size | VmHWM | RssAnon | RssFile |")
    print("|---|---|---|---|---|---|")
    for n in args.rss_rows:
        data, cache = write_dataset(work / f"data-{n}", n), work / f"cache-{n}"
        run_child("--child", "ttfb", *common, "--data", str(data), "--cache", str(cache))  # build (or reuse)
        for mode in ("memory", "cache"):
            r = run_child("--child", "rss", *common, "--data", str(data), "--cache", str(cache), "--mode", mode)
            m = r["memory_mib"]
            size = f"{r['cache_mib']:.0f} MiB" if mode == "cache" else "-"
            label = "in memory (before)" if mode == "memory" else "memory-mapped cache"
            print(f"| {n} | {label} | {size} | {m['VmHWM']:.0f} MiB | {m['RssAnon']:.0f} MiB | "
                  f"{m['RssFile']:.0f} MiB |")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
