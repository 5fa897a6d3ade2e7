"""DeepSpeed ZeRO-2 and ZeRO-3 through `ff fit` on 2 CPU processes (gloo), against DDP (issue 26, items 3 and 4).

`ff_core.strategies.DeepSpeedStrategy` is Lightning's DeepSpeedStrategy, runnable on the CPU. Runs of the real
console entry, both ranks started at once as torchrun would:

* D: configs/sd3/sft_tiny.yaml (LoRA) under DDP, 2 ranks x 2 samples, 4 steps;
* Z: configs/sd3/sft_tiny_deepspeed.yaml (the same recipe under ZeRO-2, as a user runs it) to step 4, checkpoints
  (DeepSpeed's folders) every 2 steps; ZR: Z resumed from its step-2 folder to step 4;
* PD / PZ: LoRA offline DPO under DDP and ZeRO-2, 2 steps;
* DF / Z3 / Z3R: full fine-tuning under DDP and ZeRO-3, 4 steps, Z3 resumed from its step-2 folder; Z3L: LoRA under
  ZeRO-3, 2 steps.

ZeRO-2 must train exactly what DDP trains: the same samples and noise per rank and step, the same losses, and the same
LoRA (the diffusers export beside each checkpoint; ZeRO-2 partitions gradients and optimiser state, the weights stay
whole), the resumed run continuing the uninterrupted one exactly.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.test_fsdp2 import DDP_RECIPE, DPO_RECIPE, assert_same_run, assert_same_weights, report, rows, start, wait

REPO_RECIPE = DDP_RECIPE.parent / "sft_tiny_deepspeed.yaml"
ZERO2 = json.dumps({"class_path": "ff_core.strategies.DeepSpeedStrategy",
                    "init_args": {"stage": 2, "exclude_frozen_parameters": True}})  # fmt: skip
ZERO3 = ZERO2.replace('"stage": 2', '"stage": 3')


def lora(root, name: str = "last") -> dict[str, torch.Tensor]:
    return load_file(root / "ckpt" / f"{name}.lora" / "pytorch_lora_weights.safetensors")


@pytest.fixture(scope="module")
def sft_runs(tiny_sd3, shapes_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("deepspeed")
    ddp, zero2, resumed = base / "D", base / "Z", base / "ZR"
    wait({**start(DDP_RECIPE, tiny_sd3, shapes_dir, ddp, 4, ddp=True),
          **start(REPO_RECIPE, tiny_sd3, shapes_dir, zero2, 4)})  # fmt: skip
    ckpt = next((zero2 / "ckpt").glob("*step=2.ckpt"))
    wait(start(REPO_RECIPE, tiny_sd3, shapes_dir, resumed, 4, "--ckpt_path", str(ckpt)))
    return ddp, zero2, resumed, ckpt


@pytest.fixture(scope="module")
def dpo_runs(tiny_sd3, shapes_dpo_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("deepspeed_dpo")
    ddp, zero2 = base / "PD", base / "PZ"
    wait({**start(DPO_RECIPE, tiny_sd3, shapes_dpo_dir, ddp, 2, ddp=True),
          **start(DPO_RECIPE, tiny_sd3, shapes_dpo_dir, zero2, 2, "--trainer.strategy", ZERO2, "--trainer.devices",
                  "2")})  # fmt: skip
    return ddp, zero2


def test_zero2_sft_trains_and_resumes_as_ddp(sft_runs):
    """The recipe as shipped runs on 2 CPU processes; per rank DDP's samples, noise and losses at every step, the
    resumed run taking steps 3-4 of the uninterrupted one; the LoRA exports (at step 2, at the end, after the resume)
    equal DDP's. The checkpoint is DeepSpeed's folder (per-rank optimiser partitions)."""
    ddp, zero2, resumed, ckpt = sft_runs
    assert ckpt.is_dir() and (ckpt / "latest").is_file()
    for rank in (0, 1):
        expected = rows(ddp, rank)
        assert [r["step"] for r in expected] == [1, 2, 3, 4]
        assert_same_run(rows(zero2, rank), expected)
        assert_same_run(rows(resumed, rank), expected[2:])
        assert report(zero2, rank)["trained_local"] == report(ddp, rank)["trained_total"]  # weights stay whole
    assert any(w.abs().sum() > 0 for n, w in lora(ddp).items() if "lora_B" in n)  # trained (B starts at 0)
    assert_same_weights(lora(zero2, ckpt.stem), lora(ddp, ckpt.stem))
    assert_same_weights(lora(zero2), lora(ddp))
    assert_same_weights(lora(resumed), lora(ddp))


def test_zero2_lora_dpo_trains_as_ddp(dpo_runs):
    ddp, zero2 = dpo_runs
    for rank in (0, 1):
        assert_same_run(rows(zero2, rank), rows(ddp, rank), rel=1e-4)  # DPO's beta scales the rounding (test_fsdp2)
    assert_same_weights(lora(zero2), lora(ddp))


def zero_weights(folder) -> dict[str, torch.Tensor]:
    """A DeepSpeed checkpoint folder's trained weights whole (Lightning's zero-to-fp32 conversion, as a user runs
    it), named as in the module's state dict."""
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    whole = folder.with_suffix(".whole.pt")
    convert_zero_checkpoint_to_fp32_state_dict(folder, whole)
    return torch.load(whole, map_location="cpu", weights_only=False)["state_dict"]


@pytest.fixture(scope="module")
def zero3_runs(tiny_sd3, shapes_dir, tmp_path_factory):
    """Full fine-tuning under DDP and ZeRO-3, 4 steps side by side, and ZeRO-3 resumed from its step-2 folder; LoRA
    under ZeRO-3 (the base partitioned with its adapter), 2 steps."""
    base = tmp_path_factory.mktemp("zero3")
    ddp, zero3, resumed, lora3 = base / "DF", base / "Z3", base / "Z3R", base / "Z3L"
    full = ("--model.lora", "null")
    zero3_args = ("--trainer.strategy", ZERO3, "--trainer.devices", "2")
    wait({**start(DDP_RECIPE, tiny_sd3, shapes_dir, ddp, 4, *full, ddp=True),
          **start(DDP_RECIPE, tiny_sd3, shapes_dir, zero3, 4, *full, *zero3_args)})  # fmt: skip
    ckpt = next((zero3 / "ckpt").glob("*step=2.ckpt"))
    wait({**start(DDP_RECIPE, tiny_sd3, shapes_dir, resumed, 4, *full, *zero3_args, "--ckpt_path", str(ckpt)),
          **start(DDP_RECIPE, tiny_sd3, shapes_dir, lora3, 2, *zero3_args)})  # fmt: skip
    return ddp, zero3, resumed, lora3


def test_zero3_partitions_what_trains_and_trains_as_ddp(zero3_runs):
    """ZeRO-3 without ``deepspeed.zero.Init`` (ff_core.strategies.DeepSpeedStrategy): each rank holds half of the
    trained denoiser (whole on every DDP rank), the text encoders and VAE stay whole outside the engine; per rank DDP's
    samples, noise and losses at every step, the resumed run continuing the uninterrupted one, and the weights
    gathered from DeepSpeed's folders equal DDP's."""
    ddp, zero3, resumed, _ = zero3_runs
    for rank in (0, 1):
        expected = rows(ddp, rank)
        assert_same_run(rows(zero3, rank), expected)
        assert_same_run(rows(resumed, rank), expected[2:])
        partitioned, whole = report(zero3, rank), report(ddp, rank)
        assert whole["trained_local"] == whole["trained_total"] == partitioned["trained_total"]
        assert partitioned["trained_local"] == pytest.approx(partitioned["trained_total"] / 2, rel=0.01)
        assert partitioned["detached"] == whole["detached"] != []  # text encoders and VAE outside the engine
    want = torch.load(ddp / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    for run in (zero3, resumed):
        got = zero_weights(run / "ckpt" / "last.ckpt")
        assert_same_weights(got, want)


def test_zero3_lora_export_is_gathered_and_trains_as_ddp(sft_runs, zero3_runs):
    """LoRA under ZeRO-3: the base and the adapter partitioned, the diffusers LoRA export gathered from the
    partitions equal to DDP's at step 2."""
    ddp = sft_runs[0]
    lora3 = zero3_runs[3]
    for rank in (0, 1):
        assert_same_run(rows(lora3, rank), rows(ddp, rank)[:2])
        assert report(lora3, rank)["trained_local"] < report(ddp, rank)["trained_total"]
    step2 = next((ddp / "ckpt").glob("*step=2.lora")).stem
    assert_same_weights(lora(lora3), lora(ddp, step2))
