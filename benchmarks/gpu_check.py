"""GPU check of the strategies and one throughput figure (docs/scaling.md, "Checking on a GPU").

1. Each plugin's tiny recipes (``scripts/build_inputs.sh`` builds their inputs) for a few steps under single-device,
   FSDP1 (``FSDPStrategy``), FSDP2 (``ModelParallelStrategy``) and DeepSpeed ZeRO-2, each a separate ``ff fit``
   process: status, wall time, the last step's loss. DeepSpeed rows are skipped (with the reason) when it is not
   installed. SD3 runs the dedicated recipes (``configs/sd3/sft_tiny_{fsdp,fsdp2,deepspeed}.yaml``); Wan and LTX-2
   run their ``sft_tiny.yaml`` with the same strategies given on the command line. The sharded strategies run on 2
   GPUs when 2 are visible (per-device batch halved: the same samples a step as single-device) and on 1 otherwise:
   **a one-GPU run shards nothing** (every rank holds every parameter), so it checks that the strategy runs, not that
   its gathering is right. Every run saves a checkpoint (and its LoRA export) halfway, a second process resumes from
   it (``--ckpt_path``) to the last step, and the table reports how far the resumed run's last loss and exported LoRA
   are from the uninterrupted run's (0 when resuming is exact) and how far that LoRA is from the single-device run's.
2. Throughput at a realistic size: a random-initialised ``SD3Transformer2DModel`` with SD3.5-medium's config (2.24 B
   parameters; ``benchmarks/memory_budget.py``) in bf16, 1024x1024 images (4096 image tokens, patch 2 over 128x128
   latents) and 333 text tokens (77 CLIP + 256 T5), forward and backward per step. Tokens/s counts image tokens.
   Model FLOPs per step: ``6 * N * T`` for the N parameters of the matmuls applied to T = image + text tokens, plus
   attention ``12 * L * T^2 * D`` (QK^T and AV, forward and backward, L joint blocks of width D); MFU divides the
   achieved rate by the GPU's dense bf16 peak (``--peak-tflops``, default from the device name). The count is an
   approximation: it applies every parameter to every token (the context-only and image-only projections of each
   joint block, the embedders and the output layer each see only part of T) and leaves out the image-only
   self-attention (``attn2``) of SD3.5-medium's layers 0-12, so it is an estimate to compare runs, not an exact MFU.

Writes a Markdown table to ``--out`` (default ``benchmarks/gpu_check.md``) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "4090": 165.0}
FSDP2 = json.dumps({"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                    "init_args": {"data_parallel_size": 1, "tensor_parallel_size": 1,
                                  "save_distributed_checkpoint": False}})  # fmt: skip
FSDP1 = json.dumps({"class_path": "lightning.pytorch.strategies.FSDPStrategy",
                    "init_args": {"sharding_strategy": "FULL_SHARD", "state_dict_type": "full"}})
DEEPSPEED = json.dumps({"class_path": "ff_core.strategies.DeepSpeedStrategy",
                        "init_args": {"stage": 2, "exclude_frozen_parameters": True}})
STRATEGIES = {"single": [], "fsdp": ["--trainer.strategy", FSDP1], "fsdp2": ["--trainer.strategy", FSDP2],
              "deepspeed": ["--trainer.strategy", DEEPSPEED]}  # fmt: skip
VIDEO_RECIPES = ("configs/wan/sft_tiny.yaml", "configs/ltx2/sft_tiny.yaml")
SD3_RECIPES = {"fsdp": "configs/sd3/sft_tiny_fsdp.yaml", "fsdp2": "configs/sd3/sft_tiny_fsdp2.yaml",
               "deepspeed": "configs/sd3/sft_tiny_deepspeed.yaml"}  # fmt: skip


def gpu_count(accelerator: str) -> int:
    """GPUs the sharded runs use: 2 when 2 are visible (sharding over a real mesh), else 1."""
    if accelerator == "cpu":
        return 1
    import torch

    return min(2, torch.cuda.device_count())


def cases(devices: int) -> list[tuple[str, str, list[str]]]:
    """(recipe, strategy, extra arguments) of every tiny-recipe run; the sharded ones on ``devices`` devices."""
    out = []
    for strategy, args in STRATEGIES.items():
        n = 1 if strategy == "single" else devices
        if strategy in SD3_RECIPES:  # the shipped recipe (4 samples per device on 2 devices)
            extra = ["--trainer.devices", str(n), "--data.per_device_batch_size", str(8 // n)]
            out.append((SD3_RECIPES[strategy], strategy, extra + (
                ["--trainer.strategy.init_args.data_parallel_size", str(n)] if strategy == "fsdp2" else [])))
        else:
            out.append(("configs/sd3/sft_tiny.yaml", strategy, list(args)))
        for recipe in VIDEO_RECIPES:  # their own strategy flags; 4 samples a step
            video = ["--trainer.devices", str(n), "--data.per_device_batch_size", str(4 // n), *args]
            if strategy == "fsdp2":
                video += ["--trainer.strategy.init_args.data_parallel_size", str(n)]
            out.append((recipe, strategy, video))
    return out


def lora_files(checkpoint_dir: Path, step: int) -> dict[str, dict]:
    """The LoRA export FlowCheckpoint wrote beside the step's checkpoint: file name -> tensors."""
    from safetensors.torch import load_file

    folder = next(checkpoint_dir.glob(f"*step={step}.lora"))
    return {f.name: load_file(f) for f in sorted(folder.glob("*.safetensors"))}


def max_difference(a: dict[str, dict], b: dict[str, dict]) -> float:
    """Largest absolute difference of two LoRA exports (infinite when their files or keys differ)."""
    if a.keys() != b.keys() or any(a[f].keys() != b[f].keys() for f in a):
        return float("inf")
    return max((float((a[f][k].float() - b[f][k].float()).abs().max()) for f in a for k in a[f]), default=0.0)


def fit(cmd: list[str], root: Path, timeout: float) -> tuple[dict | None, dict]:
    """Runs one ``ff fit``; (its last SampleLog row or None, status and wall time)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0,1")}
    start = time.monotonic()
    try:
        result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, {"status": f"timeout after {timeout:.0f} s", "seconds": time.monotonic() - start}
    seconds = time.monotonic() - start
    if result.returncode != 0:
        last = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["?"]
        return None, {"status": f"FAILED: {last[0][:160]}", "seconds": seconds}
    rows = [json.loads(line) for line in (root / "ids" / "rank0.jsonl").read_text().splitlines()]
    return rows[-1], {"status": "ok", "seconds": seconds}


def run_recipe(recipe: str, strategy: str, extra: list[str], steps: int, timeout: float, accelerator: str,
               reference: Callable[[], dict[str, dict] | None]) -> dict:
    """The uninterrupted run (checkpoint halfway and at the end), then the run resumed from the halfway checkpoint;
    ``reference`` gives the single-device run's final LoRA export of the same recipe family, if any."""
    if strategy == "deepspeed":
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            return {"status": "skipped: deepspeed not installed"}
    half = max(1, steps // 2)
    with tempfile.TemporaryDirectory(prefix="ff-gpu-check-") as tmp:
        out = {}
        for phase in ("full", "resumed"):
            root = Path(tmp) / phase
            callbacks = [{"class_path": "ff_core.callbacks.SampleLog",
                          "init_args": {"dirpath": f"{root}/ids", "outputs": ["loss"]}},
                         {"class_path": "ff_core.callbacks.FlowCheckpoint",
                          "init_args": {"dirpath": f"{root}/ckpt", "every_n_train_steps": half, "save_top_k": -1}}]
            cmd = [sys.executable, "-m", "ff_core.cli", "fit", "--config", recipe, "--trainer.accelerator",
                   accelerator, "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0",
                   "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
                   "--trainer.default_root_dir", str(root), "--trainer.callbacks", json.dumps(callbacks), *extra]
            if phase == "resumed":
                cmd += ["--ckpt_path", str(next((Path(tmp) / "full" / "ckpt").glob(f"*step={half}.ckpt")))]
            row, result = fit(cmd, root, timeout)
            out[phase] = {"row": row, **result}
            if row is None:
                return {**result, "seconds": sum(o["seconds"] for o in out.values())}
            out[phase]["lora"] = lora_files(root / "ckpt", steps)
        full, resumed = out["full"], out["resumed"]
        want = reference()
        return {"status": "ok", "seconds": full["seconds"] + resumed["seconds"], "loss": full["row"]["loss"],
                "steps": full["row"]["step"], "resume_loss": abs(resumed["row"]["loss"] - full["row"]["loss"]),
                "resume_lora": max_difference(resumed["lora"], full["lora"]),
                "vs_single": max_difference(full["lora"], want) if want is not None else None,
                "lora": full["lora"]}  # fmt: skip


def throughput(batch: int, steps: int, peak_tflops: float | None) -> dict:
    import torch
    from diffusers import SD3Transformer2DModel

    sys.path.insert(0, str(REPO / "benchmarks"))
    from memory_budget import SD35_MEDIUM

    device = torch.device("cuda")
    torch.manual_seed(0)
    with device:
        model = SD3Transformer2DModel(**SD35_MEDIUM).to(torch.bfloat16)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    latent, text = 128, 77 + 256
    x = torch.randn(batch, 16, latent, latent, device=device, dtype=torch.bfloat16)
    context = torch.randn(batch, text, 4096, device=device, dtype=torch.bfloat16)
    pooled = torch.randn(batch, 2048, device=device, dtype=torch.bfloat16)
    t = torch.rand(batch, device=device) * 1000

    def step() -> None:
        out = model(hidden_states=x, encoder_hidden_states=context, pooled_projections=pooled, timestep=t,
                    return_dict=False)[0]
        out.float().square().mean().backward()
        model.zero_grad(set_to_none=True)

    for _ in range(2):  # warm-up
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    image_tokens = (latent // 2) ** 2
    tokens = image_tokens + text
    layers, width = SD35_MEDIUM["num_layers"], SD35_MEDIUM["num_attention_heads"] * SD35_MEDIUM["attention_head_dim"]
    flops = batch * (6 * params * tokens + 12 * layers * tokens**2 * width)
    name = torch.cuda.get_device_name()
    peak = peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    return {"device": name, "params": params, "batch": batch, "step_s": seconds,
            "tokens_per_s": batch * image_tokens / seconds, "tflops": flops / seconds / 1e12,
            "mfu": flops / seconds / (peak * 1e12) if peak else None,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}  # fmt: skip


def _cp_rank(rank: int, world: int, port: int, frames: int, size: int, steps: int, out: str, gpu: bool) -> None:
    """One rank of :func:`context_parallel`: a Wan2.1-1.3B-sized random transformer (bf16, gradient checkpointing),
    its tokens split over ``world`` ranks with ff's context parallelism; writes its step time and peak memory."""
    import types

    import torch
    import torch.distributed as dist
    from diffusers import WanTransformer3DModel
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(REPO / "benchmarks"))
    from memory_budget import WAN_1_3B

    from ff_core.context_parallel import enable

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(rank)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    torch.manual_seed(0)
    with device:
        model = WanTransformer3DModel(**WAN_1_3B).to(torch.bfloat16)
    model.enable_gradient_checkpointing()
    if world > 1:
        dist.init_process_group("nccl" if gpu else "gloo", rank=rank, world_size=world)
        mesh = init_device_mesh(device.type, (1, 1, world), mesh_dim_names=("data_parallel", "ring", "ulysses"))
        strategy = types.SimpleNamespace(context_parallel_size=world, context_parallel_mesh=mesh["ring", "ulysses"],
                                         global_rank=rank, world_size=world, root_device=device)  # fmt: skip
        enable(model, model._cp_plan, strategy)
    latent = (frames - 1) // 4 + 1
    x = torch.randn(1, 16, latent, size // 8, size // 8, device=device, dtype=torch.bfloat16)
    context = torch.randn(1, 512, 4096, device=device, dtype=torch.bfloat16)
    t = torch.full((1,), 500.0, device=device)

    def step() -> None:
        model(hidden_states=x, encoder_hidden_states=context, timestep=t, return_dict=False)[0].float().square(
            ).mean().backward()  # fmt: skip
        model.zero_grad(set_to_none=True)

    step()
    sync()
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    seconds = (time.perf_counter() - start) / steps
    tokens = latent * (size // 16) ** 2
    peak = torch.cuda.max_memory_allocated() / 2**30 if gpu else float("nan")  # the CPU smoke run measures time only
    Path(out, f"rank{rank}.json").write_text(json.dumps({"step_s": seconds, "tokens": tokens, "peak_gib": peak}))
    if world > 1:
        dist.destroy_process_group()


def context_parallel(frames: int, size: int, steps: int, gpu: bool = True) -> list[str]:
    """Rows of a long clip's forward + backward without context parallelism and with cp=2 (when 2 GPUs are
    visible): step time, tokens per second and each rank's peak memory (``gpu=False``: a smoke run on 2 CPU
    processes over gloo, timing only)."""
    import torch
    import torch.multiprocessing as mp

    rows = ["", f"| context parallel: Wan-1.3B-sized transformer, bf16, checkpointing, {frames} frames at {size}x{size}"
            " | step | tokens / s | peak memory per rank |", "|---|---|---|---|"]  # fmt: skip
    for world in (1, 2):
        if gpu and world > torch.cuda.device_count():
            rows.append(f"| cp={world} | needs {world} GPUs | | |")
            continue
        with tempfile.TemporaryDirectory() as out:
            port = 29000 + os.getpid() % 1000 + world
            mp.start_processes(_cp_rank, args=(world, port, frames, size, steps, out, gpu), nprocs=world,
                               start_method="spawn")  # fmt: skip
            r = [json.loads(Path(out, f"rank{i}.json").read_text()) for i in range(world)]
        seconds = max(x["step_s"] for x in r)
        rows.append(f"| cp={world} | {seconds * 1000:.0f} ms | {r[0]['tokens'] / seconds:.0f} | "
                    f"{max(x['peak_gib'] for x in r):.1f} GiB |")  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "gpu_check.md"))
    parser.add_argument("--steps", type=int, default=4, help="optimiser steps per tiny-recipe run")
    parser.add_argument("--timeout", type=float, default=90, help="seconds per tiny-recipe process")
    parser.add_argument("--batch", type=int, default=2, help="images per throughput step")
    parser.add_argument("--throughput-steps", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of the GPU")
    parser.add_argument("--skip-recipes", action="store_true")
    parser.add_argument("--strategies", default="", help="comma-separated subset of: " + ", ".join(STRATEGIES))
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--cp-frames", type=int, default=81, help="frames of the context-parallel row's clip")
    parser.add_argument("--cp-size", type=int, default=480, help="side of its square canvas")
    parser.add_argument("--skip-cp", action="store_true")
    parser.add_argument("--accelerator", default="gpu", help="cpu: smoke-test the recipe runs without a GPU")
    a = parser.parse_args()
    devices = gpu_count(a.accelerator)
    lines = [f"Sharded strategies on {devices} device(s)" + (": one device shards nothing." if devices == 1 else "."),
             "", "| recipe | strategy | status | wall s | last loss | resumed: loss, LoRA max diff | LoRA vs single |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    single: dict[str, dict] = {}  # the single-device run's final LoRA export, by plugin
    if not a.skip_recipes:
        for recipe, strategy, extra in cases(devices):
            if a.strategies and strategy not in a.strategies.split(","):
                continue
            family = recipe.split("/")[1]
            r = run_recipe(recipe, strategy, extra, a.steps, a.timeout, a.accelerator, lambda: single.get(family))
            if strategy == "single" and "lora" in r:
                single[family] = r["lora"]
            loss = f"{r['loss']:.4f} (step {r['steps']})" if "loss" in r else ""
            resume = f"{r['resume_loss']:.1e}, {r['resume_lora']:.1e}" if "loss" in r else ""
            vs = f"{r['vs_single']:.1e}" if r.get("vs_single") is not None else ""
            lines.append(f"| `{recipe}` | {strategy} | {r['status']} | {r.get('seconds', 0):.1f} | {loss} | {resume} "
                         f"| {vs} |")
            print(lines[-1], flush=True)
    if not a.skip_throughput:
        lines += throughput_table(throughput(a.batch, a.throughput_steps, a.peak_tflops))
    if not a.skip_cp:
        lines += context_parallel(a.cp_frames, a.cp_size, a.throughput_steps, gpu=a.accelerator != "cpu")
    text = "\n".join(lines) + "\n"
    Path(a.out).write_text(text)
    print(text)


def throughput_table(t: dict) -> list[str]:
    mfu = f"{100 * t['mfu']:.1f} %" if t["mfu"] is not None else "n/a (give --peak-tflops)"
    return ["", "| throughput: SD3.5-medium-sized random transformer, bf16, 1024 px | value |", "|---|---|",
            f"| device | {t['device']} |", f"| parameters | {t['params'] / 1e9:.2f} B |",
            f"| batch (images) | {t['batch']} |", f"| forward + backward step | {t['step_s'] * 1000:.0f} ms |",
            f"| image tokens / s | {t['tokens_per_s']:.0f} |", f"| model TFLOP/s | {t['tflops']:.0f} |",
            f"| MFU | {mfu} |", f"| peak memory | {t['peak_mem_gib']:.1f} GiB |"]  # fmt: skip

if __name__ == "__main__":
    main()
