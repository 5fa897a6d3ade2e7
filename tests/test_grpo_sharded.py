"""Flow-GRPO under FSDP2 (Lightning's ModelParallelStrategy) and DeepSpeed ZeRO-2 (ff_core.strategies) through
`ff fit` on 2 CPU processes (gloo), against DDP (issue 26, item 1).

Runs of the real console entry, both ranks started at once as torchrun would:

* D: configs/sd3/grpo_tiny.yaml (LoRA) shrunk, under DDP, 2 iterations of 2 inner epochs (4 optimiser steps);
* A: the same under FSDP2 for 1 iteration, its step-2 checkpoint written; B: A resumed from it to step 4;
* DK / FK: full fine-tuning with a KL term (``kl_beta`` > 0: a frozen reference copy, sharded under FSDP2) under DDP
  and FSDP2, 1 iteration;
* Z: D's run under DeepSpeed ZeRO-2 to step 4; ZR: Z resumed from its step-2 checkpoint (DeepSpeed's folder).

The reward ties every sample of the even prompt groups (with ``filter_zero_std`` those micro-batches leave the update)
and scores the others by a continuous function of the pixels, so a weight difference of float rounding cannot flip
it. Under DDP a filtered micro-batch is skipped and the accumulated gradients are averaged once per optimiser step;
under FSDP2 every rank replays it with weight 0 (each forward all-gathers and each backward reduce-scatters: the ranks
must run the same collectives) and the shards' reduce-scatter does the averaging; under ZeRO-2 likewise (each
backward reduces into the rank's gradient partition; the engine clips to ``max_grad_norm`` in its step). Both must
train the same policy: the same rollouts and rewards per rank and step, the same losses, ratios and KL, the same
final weights (within float tolerance: reduce-scatter sums in another order than all-reduce), the resumed run
continuing exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.distributed.tensor import DTensor

from ff_core.rewards.base import Reward
from ff_core.sharding import full_tensor, summoned
from ff_core.testing.shapes import write_prompt_dataset
from tests.test_fsdp2 import launch, wait
from tests.test_grpo_fit import RECIPE

FSDP2 = json.dumps({"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                    "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1}})  # fmt: skip
ZERO2 = json.dumps({"class_path": "ff_core.strategies.DeepSpeedStrategy",
                    "init_args": {"stage": 2, "exclude_frozen_parameters": True}})  # fmt: skip
ZERO3 = ZERO2.replace('"stage": 2', '"stage": 3')
METRICS = ("reward_mean", "policy_loss", "ratio", "kl", "advantage_abs_mean", "zero_std_ratio")


class TieEvenGroups(Reward):
    """0 for every sample of an even prompt group (a tied group), the mean green level of the image for the others."""

    name = "tie_even_groups"

    def __call__(self, batch):
        green = torch.stack([m[0][1].float().mean() / 255 for m in batch.media])
        return torch.where(batch.groups % 2 == 0, torch.zeros_like(green), green)


class Record(L.Callback):
    """Per rank: each step's batch ids and logged GRPO metrics, whether the reference copy is sharded, and the trained
    weights whole after the first training batch and at the end (DTensor shards and ZeRO-3 partitions gathered:
    collectives every rank runs in the same order)."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath, self.steps, self.reference, self.policy_sharded = Path(dirpath), [], None, None
        self.first = None

    def on_train_start(self, trainer, pl_module) -> None:
        reference = getattr(pl_module.objective, "reference", None)
        copies = reference.copies() if reference is not None else []
        self.reference = {"copies": len(copies), "sharded": all(sharded(p) for c in copies for p in c.parameters())}
        self.policy_sharded = all(sharded(p) for p in pl_module.parameters() if p.requires_grad)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        logged = {k: float(trainer.callback_metrics[f"train/{k}"]) for k in METRICS
                  if f"train/{k}" in trainer.callback_metrics}  # fmt: skip
        self.steps.append({"step": trainer.global_step, "index": batch["index"].tolist(), **logged})
        if self.first is None:
            self.first = trained_weights(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        torch.save({"steps": self.steps, "weights": trained_weights(trainer, pl_module), "first": self.first,
                    "reference": self.reference, "policy_sharded": self.policy_sharded},
                   self.dirpath / f"rank{trainer.global_rank}.pt")  # fmt: skip


def trained_weights(trainer, pl_module) -> dict[str, torch.Tensor]:
    with summoned(trainer.strategy.model):  # ZeRO-3's partitions gathered (DTensors below, per tensor)
        return {n: full_tensor(p.detach()).clone() for n, p in pl_module.named_parameters() if p.requires_grad}


def sharded(parameter: torch.Tensor) -> bool:
    """A DTensor (FSDP2) or a ZeRO-3 partitioned parameter."""
    return isinstance(parameter, DTensor) or hasattr(parameter, "ds_id")


def start(tiny_sd3: Path, prompts: Path, root: Path, max_steps: int, *extra: str, strategy: str) -> dict:
    root.mkdir()
    callbacks = [
        {"class_path": "ff_core.callbacks.FlowCheckpoint",
         "init_args": {"every_n_train_steps": 2, "save_top_k": -1, "save_last": True, "dirpath": str(root / "ckpt")}},
        {"class_path": "tests.test_grpo_sharded.Record", "init_args": {"dirpath": str(root / "out")}},
    ]
    return {root: launch(root, [
        "--config", str(RECIPE), "--model.pretrained_model_name_or_path", str(tiny_sd3),
        "--model.objective.init_args.rewards", json.dumps([{"name": "tests.test_grpo_sharded:TieEvenGroups"}]),
        "--model.eval_rewards", "[]",
        # 2 prompts x 3 samples, sample-major over 2 ranks: rank 0 takes (p0, p1, p0), rank 1 (p1, p0, p1), so the
        # ranks filter out different numbers of micro-batches (the even group's samples).
        "--model.objective.init_args.group_size", "3", "--model.objective.init_args.prompts_per_step", "2",
        "--model.objective.init_args.num_steps", "3",
        "--model.objective.init_args.sampler", json.dumps({"kind": "flow_sde", "eta": 0.7, "window": [0, 2]}),
        "--model.objective.init_args.micro_batch_size", "1",
        "--model.objective.init_args.clip_range", "0.2",  # the second inner epoch's ratios leave 1 unclipped
        "--data.datasets", json.dumps([{"name": "prompts", "dataset_dir": str(prompts)}]),
        "--trainer.strategy", strategy, "--trainer.devices", "2",
        "--trainer.max_steps", str(max_steps), "--trainer.limit_val_batches", "0",
        "--trainer.default_root_dir", str(root), "--trainer.logger", "false", "--trainer.enable_progress_bar",
        "false", "--trainer.callbacks", json.dumps(callbacks), *extra,
    ])}  # fmt: skip


def out(root: Path) -> list[dict]:
    return [torch.load(root / "out" / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.fixture(scope="module")
def runs(tiny_sd3, tmp_path_factory):
    base = tmp_path_factory.mktemp("grpo_fsdp2")
    prompts = write_prompt_dataset(base / "prompts")
    lora = ("--model.objective.init_args.num_inner_epochs", "2")
    full = ("--model.lora", "null", "--model.objective.init_args.kl_beta", "0.5",
            "--model.optimizer.init_args.lr", "1.0e-4")  # fmt: skip
    names = ("D", "A", "B", "DK", "FK", "Z", "ZR", "Z3K")
    d, a, b, dk, fk, z, zr, z3k = (base / name for name in names)
    wait({**start(tiny_sd3, prompts, d, 4, *lora, strategy="ddp"),
          **start(tiny_sd3, prompts, a, 2, *lora, strategy=FSDP2)})  # fmt: skip
    ckpt = next((a / "ckpt").glob("*step=2.ckpt"))
    wait({**start(tiny_sd3, prompts, b, 4, *lora, "--ckpt_path", str(ckpt), strategy=FSDP2),
          **start(tiny_sd3, prompts, dk, 2, *full, strategy="ddp")})
    wait({**start(tiny_sd3, prompts, fk, 2, *full, strategy=FSDP2), **start(tiny_sd3, prompts, z, 4, *lora,
                                                                             strategy=ZERO2)})  # fmt: skip
    ckpt = next((z / "ckpt").glob("*step=2.ckpt"))
    wait({**start(tiny_sd3, prompts, zr, 4, *lora, "--ckpt_path", str(ckpt), strategy=ZERO2),
          **start(tiny_sd3, prompts, z3k, 1, *full, strategy=ZERO3)})
    return {name: out(root) for name, root in zip(names, (d, a, b, dk, fk, z, zr, z3k))}


def same_steps(expected: list[dict], actual: list[dict], rel: dict[str, float] | None = None) -> None:
    """The same batches and, within ``rel`` (1e-4 unless named), the same logged metrics at every step."""
    assert [s["step"] for s in actual] == [s["step"] for s in expected]
    for e, a in zip(expected, actual):
        assert a["index"] == e["index"], (e["step"], a["index"], e["index"])
        for key in e:
            if key not in ("step", "index"):
                tolerance = (rel or {}).get(key, 1e-4)
                assert a[key] == pytest.approx(e[key], rel=tolerance, abs=1e-7), (e["step"], key)


def same_weights(expected: dict, actual: dict) -> None:
    assert expected.keys() == actual.keys()
    for name, w in expected.items():
        torch.testing.assert_close(actual[name], w, rtol=1e-4, atol=1e-6, msg=name)


def test_lora_grpo_under_fsdp2_trains_and_resumes_as_ddp(runs):
    """The FSDP2 run (A, then B resumed from A's step-2 checkpoint) takes DDP's steps: per rank the same prompts and
    samples, rewards, advantages, clipped losses and ratios per step, and at the end the same LoRA on both ranks as
    DDP's. Every iteration has a tied group (zero_std_ratio 0.5): FSDP2 replayed its micro-batches with weight 0."""
    ddp = runs["D"]
    assert [r["policy_sharded"] for run in ("D", "A", "B") for r in runs[run]] == [False] * 2 + [True] * 4
    for rank in (0, 1):
        steps = ddp[rank]["steps"]
        assert [s["step"] for s in steps] == [2, 4] and all(s["zero_std_ratio"] == 0.5 for s in steps)
        assert [len(s["index"]) for s in steps] == [3, 3]
        same_steps(steps[:1], runs["A"][rank]["steps"])
        same_steps(steps[1:], runs["B"][rank]["steps"])
        same_weights(ddp[rank]["weights"], runs["B"][rank]["weights"])
    base_b = [n for n in ddp[0]["weights"] if "lora_B" in n]
    assert base_b and all(ddp[0]["weights"][n].abs().sum() > 0 for n in base_b)  # peft starts B at 0: it trained
    assert ddp[0]["steps"][1]["reward_mean"] != ddp[0]["steps"][0]["reward_mean"]


def test_full_fine_tuning_grpo_with_a_sharded_kl_reference_equals_ddp(runs):
    """Full fine-tuning with ``kl_beta`` > 0 keeps a frozen copy of the denoiser as the KL reference: sharded under
    FSDP2 (DTensors, half per rank), whole under DDP; the KL values, losses and weights agree.

    Step 1 within 1e-4; the weights within 1e-5: AdamW's first step moves every entry by about the learning rate
    whatever its gradient's size, so an entry whose gradient is near eps turns the reduce-scatter's rounding into
    ~2e-6 (seen: norm_out's bias). Step 2's rollouts then come from weights that differ by that much, and the
    reward's odd groups are near ties (the green level of one prompt's samples), whose group-normalised differences,
    the advantages, amplify it: step 2's policy loss and mean advantage within 2e-3 (seen: 9e-4), its rewards and KL
    within 1e-4."""
    ddp, fsdp2 = runs["DK"], runs["FK"]
    assert ddp[0]["reference"] == {"copies": 1, "sharded": False}
    assert fsdp2[0]["reference"] == {"copies": 1, "sharded": True} and fsdp2[0]["policy_sharded"]
    amplified = {"policy_loss": 2e-3, "advantage_abs_mean": 2e-3}
    for rank in (0, 1):
        same_steps(ddp[rank]["steps"][:1], fsdp2[rank]["steps"][:1])
        same_steps(ddp[rank]["steps"][1:], fsdp2[rank]["steps"][1:], rel=amplified)
        assert ddp[rank]["steps"][0]["kl"] > 0 and ddp[rank]["steps"][1]["kl"] > 0
        for when in ("first", "weights"):  # after step 1, at the end
            for name, w in ddp[rank][when].items():
                torch.testing.assert_close(fsdp2[rank][when][name], w, rtol=1e-4, atol=1e-5, msg=name)


def test_full_fine_tuning_grpo_under_zero3_equals_ddp(runs):
    """Under DeepSpeed ZeRO-3 the policy and its KL reference copy are partitioned; one optimiser step (six replayed
    backwards per rank, two of them with weight 0) gives DDP's metrics and weights. Only the first step is compared:
    ZeRO-3 sums the gradient norm in another order, and the reward reads 8-bit pixels, so a rounding difference can
    flip one pixel of the next step's samples (seen: 1 of 6x1024) and move that step's advantages by 1e-3. Before
    ``mark_accumulation_boundary`` started each replay as the engine's forward does, ZeRO-3 stepped on the last
    backward's gradients only."""
    ddp, zero3 = runs["DK"], runs["Z3K"]
    assert zero3[0]["reference"] == {"copies": 1, "sharded": True} and zero3[0]["policy_sharded"]
    for rank in (0, 1):
        same_steps(ddp[rank]["steps"][:1], zero3[rank]["steps"])
        same_weights(ddp[rank]["first"], zero3[rank]["first"])


def test_lora_grpo_under_deepspeed_zero2_trains_and_resumes_as_ddp(runs):
    """ZeRO-2 (Z; ZR resumed from Z's step-2 folder) takes DDP's steps and ends with DDP's LoRA on both ranks."""
    ddp = runs["D"]
    for rank in (0, 1):
        same_steps(ddp[rank]["steps"], runs["Z"][rank]["steps"])
        same_steps(ddp[rank]["steps"][1:], runs["ZR"][rank]["steps"])
        same_weights(ddp[rank]["weights"], runs["Z"][rank]["weights"])
        same_weights(ddp[rank]["weights"], runs["ZR"][rank]["weights"])
