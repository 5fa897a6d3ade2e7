"""SFT from tensor-parquet shards vs from a dataset folder: time per training step and what the step runs.

Run: ``python benchmarks/bench_latents_sft.py [--rows 256] [--resolution 128] [--steps 30] [--workdir DIR]``.
Prints a markdown table. Each variant runs in a fresh subprocess (one intra-op thread, no loader workers) with
``ff fit``'s own objects: the tiny SD3-architecture checkpoint of the tests (VAE downsampling 4x, transformer patch
1), LoRA rank 8, batches of 8, the shapes dataset at ``--resolution``:

* ``folder``: the target PNGs are decoded and fitted by the loader, then encoded by the VAE in every step.
* ``shards``: the same records converted once by ``ff data preprocess-latents`` (timed separately); the step reads
  stored latents and text embeddings (no VAE encode, no text encoder loaded).

The first 5 steps are warm-up; the table gives the median step time after them (loading included in neither).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> None:
    """One variant in this process; prints a JSON line."""
    import torch

    torch.set_num_threads(1)
    import lightning as L

    from ff_core.data.datamodule import FlowDataModule
    from ff_core.lora import LoRAConfig
    from ff_core.module import FlowModule

    entry = ({"name": "shards", "tensor_parquet_dir": args.data} if args.variant == "shards"
             else {"name": "folder", "dataset_dir": args.data})
    dm = FlowDataModule([entry], adapter="sd3-5", per_device_batch_size=8, cache_dir=args.cache)
    module = FlowModule("sd3-5", args.model, adapter_kwargs={"resolution": args.resolution},
                        lora=LoRAConfig(rank=8, alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    times: list[float] = []

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            times.append(time.perf_counter() - self.start)

    encodes = []

    class EncodeCounter(L.Callback):
        def on_train_start(self, trainer, pl_module):
            pl_module.adapter.vae.encoder.register_forward_hook(lambda *_: encodes.append(1))

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[Timer(), EncodeCounter()])
    wall = time.perf_counter()
    trainer.fit(module, datamodule=dm)
    wall = time.perf_counter() - wall
    print(json.dumps({"variant": args.variant, "step_s": statistics.median(times[5:]), "fit_s": wall,
                      "vae_encodes": len(encodes)}))


def run(args: argparse.Namespace, variant: str, data: Path, model: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--data", str(data), "--model", str(model),
           "--resolution", str(args.resolution), "--steps", str(args.steps), "--cache", str(args.workdir / "cache")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--resolution", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--child", default=None)
    parser.add_argument("--data", default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--cache", default=None)
    args = parser.parse_args()
    if args.child:
        args.variant = args.child
        child(args)
        return
    own = args.workdir is None
    args.workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-latents-"))
    try:
        from ff_sd3.testing import build_tiny_sd3

        from ff_core.testing.shapes import write_shapes_dataset

        model = args.workdir / "tiny-sd3"
        if not (model / "model_index.json").exists():
            build_tiny_sd3(model, num_layers=2, image_size=args.resolution)
        folder = args.workdir / "shapes"
        if not (folder / "train.jsonl").exists():
            write_shapes_dataset(folder, n_train=args.rows, n_test=1, size=args.resolution)
        shards = args.workdir / "shards"
        start = time.perf_counter()
        if not shards.exists():
            from ff_core.cli import main as ff

            datasets = json.dumps([{"name": "shapes", "dataset_dir": str(folder)}])
            assert ff(["data", "preprocess-latents", "--output", str(shards), "--no-progress",
                       "--config", str(REPO / "configs" / "sd3" / "sft_tiny.yaml"),
                       "--model.pretrained_model_name_or_path", str(model), "--data.datasets", datasets,
                       "--model.adapter_kwargs", json.dumps({"resolution": args.resolution}),
                       "--data.cache_dir", str(args.workdir / "cache")]) == 0
        convert = time.perf_counter() - start
        rows = [run(args, "folder", folder, model), run(args, "shards", shards, model)]
        size = sum(f.stat().st_size for f in shards.rglob("*.parquet"))
        print(f"\n{args.rows} records at {args.resolution} px, batches of 8, {args.steps} steps; conversion "
              f"`ff data preprocess-latents`: {convert:.1f} s, {size / 2**20:.1f} MiB of shards\n")
        print("| variant | median step | VAE encoder forwards in training | fit wall time (load included) |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['variant']} | {r['step_s'] * 1000:.1f} ms | {r['vae_encodes']} | {r['fit_s']:.1f} s |")
        print(f"\nspeed-up per step: {rows[0]['step_s'] / rows[1]['step_s']:.2f}x")
    finally:
        if own:
            shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
