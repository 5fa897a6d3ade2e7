"""One-GPU check of the strategies and one throughput figure (docs/scaling.md, "Checking on a GPU").

1. Each plugin's tiny recipes (built by ``scripts/setup.sh`` into ``build/``) for a few steps under single-device,
   FSDP1 (``FSDPStrategy``), FSDP2 (``ModelParallelStrategy``) and DeepSpeed ZeRO-2, each a separate ``ff fit``
   process on GPU 0: status, wall time, the last step's loss. DeepSpeed rows are skipped (with the reason) when it
   is not installed. SD3 runs the dedicated recipes (``configs/sd3/sft_tiny_{fsdp,fsdp2,deepspeed}.yaml``) with
   ``devices: 1``; Wan runs its ``sft_tiny.yaml`` with the same strategies given on the command line.
2. Throughput at a realistic size: a random-initialised ``SD3Transformer2DModel`` with SD3.5-medium's config (2.24 B
   parameters; ``benchmarks/memory_budget.py``) in bf16, 1024x1024 images (4096 image tokens, patch 2 over 128x128
   latents) and 333 text tokens (77 CLIP + 256 T5), forward and backward per step. Tokens/s counts image tokens.
   Model FLOPs per step: ``6 * N * T`` for the N parameters of the matmuls applied to T = image + text tokens, plus
   attention ``12 * L * T^2 * D`` (QK^T and AV, forward and backward, L joint blocks of width D); MFU divides the
   achieved rate by the GPU's dense bf16 peak (``--peak-tflops``, default from the device name).

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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "4090": 165.0}
FSDP2 = json.dumps({"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                    "init_args": {"data_parallel_size": 1, "tensor_parallel_size": 1,
                                  "save_distributed_checkpoint": False}})  # fmt: skip
FSDP1 = json.dumps({"class_path": "lightning.pytorch.strategies.FSDPStrategy",
                    "init_args": {"sharding_strategy": "FULL_SHARD", "state_dict_type": "full"}})
DEEPSPEED = json.dumps({"class_path": "lightning.pytorch.strategies.DeepSpeedStrategy",
                        "init_args": {"stage": 2, "exclude_frozen_parameters": True}})
STRATEGIES = {"single": [], "fsdp": ["--trainer.strategy", FSDP1], "fsdp2": ["--trainer.strategy", FSDP2],
              "deepspeed": ["--trainer.strategy", DEEPSPEED]}  # fmt: skip
SD3_RECIPES = {"fsdp": "configs/sd3/sft_tiny_fsdp.yaml", "fsdp2": "configs/sd3/sft_tiny_fsdp2.yaml",
               "deepspeed": "configs/sd3/sft_tiny_deepspeed.yaml"}  # fmt: skip


def cases() -> list[tuple[str, str, list[str]]]:
    """(recipe, strategy, extra arguments) of every tiny-recipe run."""
    out = []
    for strategy, args in STRATEGIES.items():
        if strategy in SD3_RECIPES:  # the shipped recipe, on one device
            out.append((SD3_RECIPES[strategy], strategy, ["--trainer.devices", "1"] + (
                ["--trainer.strategy.init_args.data_parallel_size", "1"] if strategy == "fsdp2" else [])))
        else:
            out.append(("configs/sd3/sft_tiny.yaml", strategy, list(args)))
        out.append(("configs/wan/sft_tiny.yaml", strategy, list(args)))
    return out


def run_recipe(recipe: str, strategy: str, extra: list[str], steps: int, timeout: float, accelerator: str) -> dict:
    if strategy == "deepspeed":
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            return {"status": "skipped: deepspeed not installed"}
    with tempfile.TemporaryDirectory(prefix="ff-gpu-check-") as root:
        callbacks = [{"class_path": "ff_core.callbacks.SampleLog",
                      "init_args": {"dirpath": f"{root}/ids", "outputs": ["loss"]}}]  # fmt: skip
        cmd = [sys.executable, "-m", "ff_core.cli", "fit", "--config", recipe, "--trainer.accelerator", accelerator,
               "--trainer.devices", "1", "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0",
               "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
               "--trainer.enable_checkpointing", "false", "--trainer.default_root_dir", root,
               "--trainer.callbacks", json.dumps(callbacks), *extra]  # fmt: skip
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
        start = time.monotonic()
        try:
            result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"status": f"timeout after {timeout:.0f} s", "seconds": time.monotonic() - start}
        seconds = time.monotonic() - start
        if result.returncode != 0:
            last = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["?"]
            return {"status": f"FAILED: {last[0][:160]}", "seconds": seconds}
        rows = [json.loads(line) for line in Path(f"{root}/ids/rank0.jsonl").read_text().splitlines()]
        return {"status": "ok", "seconds": seconds, "loss": rows[-1]["loss"], "steps": rows[-1]["step"]}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "gpu_check.md"))
    parser.add_argument("--steps", type=int, default=4, help="optimiser steps per tiny-recipe run")
    parser.add_argument("--timeout", type=float, default=90, help="seconds per tiny-recipe run")
    parser.add_argument("--batch", type=int, default=2, help="images per throughput step")
    parser.add_argument("--throughput-steps", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of the GPU")
    parser.add_argument("--skip-recipes", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--accelerator", default="gpu", help="cpu: smoke-test the recipe runs without a GPU")
    a = parser.parse_args()
    lines = ["| recipe | strategy | status | wall s | last loss |", "|---|---|---|---|---|"]
    if not a.skip_recipes:
        for recipe, strategy, extra in cases():
            r = run_recipe(recipe, strategy, extra, a.steps, a.timeout, a.accelerator)
            loss = f"{r['loss']:.4f} (step {r['steps']})" if "loss" in r else ""
            lines.append(f"| `{recipe}` | {strategy} | {r['status']} | {r.get('seconds', 0):.1f} | {loss} |")
            print(lines[-1], flush=True)
    if not a.skip_throughput:
        lines += throughput_table(throughput(a.batch, a.throughput_steps, a.peak_tflops))
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
