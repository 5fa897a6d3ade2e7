"""Audio+video from tensor-parquet shards vs from the dataset folder (LTX-2, MiniMax H3), and what each storage dtype
costs and loses.

Run: ``python benchmarks/bench_av_shards.py [--families ltx2 minimax] [--clips 16] [--steps 20] [--workdir DIR]``.
Prints two markdown tables.

1. **Step time.** Per family, the tiny checkpoint of the tests and its SFT recipes as shipped (``configs/ltx2/
   sft_tiny.yaml`` and ``sft_latents_tiny.yaml``, LTX-2's clip at 64x64 and 17 frames: :data:`GEOMETRY`;
   ``configs/minimax/t2va_sft_tiny.yaml`` and ``t2va_sft_latents_tiny.yaml``), run twice in fresh subprocesses side
   by side (one intra-op thread, no loader workers, batches of 4 for LTX-2 and 1 for H3, LoRA as the recipe):
   ``folder`` decodes each MP4 and WAV, fits them, and encodes both streams with their VAEs every step; ``shards``
   reads the rows ``ff data preprocess-latents`` wrote (bf16, the default) and runs no VAE encode and no text
   encoder. The median step after 5
   warm-up steps, and the encoder forwards counted in training.
2. **Storage.** The same split written with ``--dtype float32``, ``bfloat16`` and ``float8_e4m3fn``: bytes per row
   (parquet files, uncompressed), the latents' error against float32 (relative RMS and the largest relative error of
   an element), and the relative change of one SFT loss on the whole split (same noise and timesteps). A full-size
   LTX-2 row's latents (121 frames at 512x768, 5.04 s of audio: 802,560 elements) are sized from the same dtypes.
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
FAMILIES = {
    # family: (adapter, folder recipe, latents recipe, tiny builder variant)
    "ltx2": ("ltx2_t2av", "configs/ltx2/sft_tiny.yaml", "configs/ltx2/sft_latents_tiny.yaml", "t2av"),
    "minimax": ("minimax-h3-t2va", "configs/minimax/t2va_sft_tiny.yaml", "configs/minimax/t2va_sft_latents_tiny.yaml",
                "t2va"),
}
# The clip each family trains on here: LTX-2 at 64x64, 17 frames (2.1 s of audio), where both VAEs cost what they cost
# at every step; H3 at its tiny recipe's clip (its frame rule fixes 24 fps, 5-15 s).
GEOMETRY = {"ltx2": {"height": 64, "width": 64, "num_frames": 17}, "minimax": {}}
CLIP_FRAMES = {"ltx2": 24}
BATCH = {"ltx2": 4, "minimax": 1}  # H3 packs one request per sequence: its contract's max_batch_size is 1
DTYPES = ("float32", "bfloat16", "float8_e4m3fn")
LTX2_FULL_LATENT_ELEMENTS = 128 * 16 * 16 * 24 + 8 * 126 * 16  # video (C, F', h, w) + audio (C, L, M)


def build(family: str, workdir: Path, clips: int) -> tuple[Path, Path]:
    """The tiny checkpoint and a clip dataset of ``clips`` records (built once per workdir)."""
    model, folder = workdir / f"tiny-{family}", workdir / f"{family}-clips"
    if family == "ltx2":
        from ff_ltx2.testing import build_tiny_ltx2 as build_model
        from ff_ltx2.testing import write_av_clips
    else:
        from ff_minimax.testing import build_tiny_minimax as build_model
        from ff_minimax.testing import write_av_clips
    if not (model / "model_index.json").exists():
        build_model(model, variant=FAMILIES[family][3])
    if not (folder / "train.jsonl").exists():
        write_av_clips(folder, clips, **({"frames": CLIP_FRAMES[family]} if family in CLIP_FRAMES else {}))
    return model, folder


def preprocess(family: str, model: Path, folder: Path, out: Path, dtype: str) -> float:
    from ff_core.cli import main as ff

    start = time.perf_counter()
    if not out.exists():
        assert ff(["data", "preprocess-latents", "--output", str(out), "--no-progress", "--dtype", dtype,
                   "--config", str(REPO / FAMILIES[family][1]), "--model.pretrained_model_name_or_path", str(model),
                   "--data.datasets", json.dumps([{"name": "clips", "dataset_dir": str(folder)}]),
                   *_overrides(family)]) == 0
    return time.perf_counter() - start


def child(args: argparse.Namespace) -> None:
    """One training variant in this process; prints a JSON line."""
    import torch

    torch.set_num_threads(1)
    import lightning as L

    from ff_core.cli.flow_cli import FlowCLI
    from ff_core.data.datamodule import FlowDataModule
    from ff_core.module import FlowModule

    family = FAMILIES[args.family]
    entry = ({"name": "shards", "tensor_parquet_dir": args.data} if args.variant == "shards"
             else {"name": "folder", "dataset_dir": args.data})
    recipe = family[2] if args.variant == "shards" else family[1]
    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(REPO / recipe), "--model.pretrained_model_name_or_path", args.model,
        "--data.datasets", json.dumps([entry]), "--data.num_workers", "0",
        "--data.per_device_batch_size", str(BATCH[args.family]),
        "--data.cache_dir", args.cache, "--trainer.max_steps", str(args.steps), "--trainer.limit_val_batches", "0",
        "--trainer.default_root_dir", str(Path(args.cache).parent / f"run-{args.family}-{args.variant}"),
        "--trainer.logger", "false", "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        *_overrides(args.family)])  # fmt: skip
    times: list[float] = []
    encodes: list[int] = []

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            a = pl_module.adapter
            for m in (a.vae.encoder, a.audio_vae.encoder, a.text_encoder):
                if m is not None:
                    m.register_forward_hook(lambda *_: encodes.append(1))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            times.append(time.perf_counter() - self.start)

    cli.trainer.callbacks.append(Probe())
    wall = time.perf_counter()
    cli.trainer.fit(cli.model, cli.datamodule)
    print(json.dumps({"variant": args.variant, "step_s": statistics.median(times[5:]),
                      "fit_s": time.perf_counter() - wall, "encodes": len(encodes)}))


def run(args: argparse.Namespace, family: str, variant: str, data: Path, model: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--family", family, "--data", str(data), "--model",
           str(model), "--steps", str(args.steps), "--cache", str(args.workdir / "cache")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def storage(family: str, model: Path, roots: dict[str, Path]) -> list[dict]:
    """Bytes per row, latent errors and the loss change of each dtype's shards against float32's."""
    import torch

    from ff_core.data.tensor_parquet import TensorParquetDataset
    from ff_core.data.tensor_parquet.rows import TensorRowCollator, TensorRowProcessor, TensorRows
    from ff_core.module import FlowModule

    module = FlowModule(FAMILIES[family][0], str(model), adapter_kwargs=_kwargs(family))
    module.configure_model()
    adapter, objective = module.adapter, module.objective
    columns = adapter.tensor_columns

    def batch(root: Path) -> dict:
        dataset = TensorParquetDataset(root)
        processor = TensorRowProcessor(TensorRows([dataset]), columns)
        collator = TensorRowCollator(condition_collation=adapter.condition_collation)
        return collator.collate([processor.process(i) for i in range(len(dataset))])

    reference = batch(roots["float32"])
    base = objective.training_loss(adapter, reference, torch.Generator().manual_seed(0)).loss.detach()
    out = []
    for dtype, root in roots.items():
        b = batch(root)
        rows = len(TensorParquetDataset(root))
        size = sum(f.stat().st_size for f in root.rglob("*.parquet")) / rows
        errors, peaks = [], []
        for name, x in reference["latents"].items():
            q = b["latents"][name].float()
            errors.append(float((q - x).pow(2).mean().sqrt() / x.pow(2).mean().sqrt()))
            peaks.append(float(((q - x).abs() / x.abs().clamp_min(1e-3)).max()))
        loss = objective.training_loss(adapter, b, torch.Generator().manual_seed(0)).loss.detach()
        out.append({"dtype": dtype, "bytes_per_row": size, "rel_rms": max(errors), "rel_max": max(peaks),
                    "loss_change": float((loss - base).abs() / base.abs())})  # fmt: skip
    return out


def _kwargs(family: str) -> dict:
    import yaml

    recipe = yaml.safe_load((REPO / FAMILIES[family][1]).read_text())
    return {**(recipe["model"].get("adapter_kwargs") or {}), **GEOMETRY[family]}


def _overrides(family: str) -> list[str]:
    return [a for k, v in GEOMETRY[family].items() for a in (f"--model.adapter_kwargs.{k}", str(v))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--clips", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--child", default=None)
    parser.add_argument("--family", default=None)
    parser.add_argument("--data", default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--cache", default=None)
    args = parser.parse_args()
    if args.child:
        args.variant = args.child
        child(args)
        return
    own = args.workdir is None
    args.workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-av-shards-"))
    try:
        steps, stored = [], []
        for family in args.families:
            model, folder = build(family, args.workdir, args.clips)
            roots = {d: args.workdir / f"{family}-{d}" for d in DTYPES}
            convert = {d: preprocess(family, model, folder, roots[d], d) for d in DTYPES}
            folder_run = run(args, family, "folder", folder, model)
            shard_run = run(args, family, "shards", roots["bfloat16"], model)
            steps.append((family, folder_run, shard_run, convert["bfloat16"]))
            stored += [(family, row) for row in storage(family, model, roots)]
        print(f"\n{args.clips} clips, {args.steps} steps, 1 thread, no loader workers\n")
        print("| family (batch) | variant | median step | encoder forwards in training | speed-up |")
        print("|---|---|---|---|---|")
        for family, f, s, convert in steps:
            print(f"| {family} ({BATCH[family]}) | folder | {f['step_s'] * 1000:.1f} ms | {f['encodes']} | |")
            print(f"| {family} ({BATCH[family]}) | shards (bf16) | {s['step_s'] * 1000:.1f} ms | {s['encodes']} | "
                  f"{f['step_s'] / s['step_s']:.2f}x |")
        print("\nconversion (`ff data preprocess-latents`, bf16, in-process, 0 when the workdir had the shards): "
              + ", ".join(f"{family} {convert:.1f} s" for family, _, _, convert in steps))
        print("\n| family | storage | bytes per row | latent error (rel. RMS / max) | SFT loss change |")
        print("|---|---|---|---|---|")
        for family, r in stored:
            print(f"| {family} | {r['dtype']} | {r['bytes_per_row'] / 1024:.1f} KiB | {r['rel_rms']:.2e} / "
                  f"{r['rel_max']:.2e} | {r['loss_change']:.1e} |")
        print("\nfull-size LTX-2 latents per row (121 frames 512x768, 5.04 s): "
              + ", ".join(f"{d} {LTX2_FULL_LATENT_ELEMENTS * n / 2**20:.2f} MiB"
                          for d, n in (("float32", 4), ("bfloat16", 2), ("float8_e4m3fn", 1))))
    finally:
        if own:
            shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
