"""Context parallelism for Wan (issue 27): real ``ff fit`` processes over gloo, against one process.

Every run trains the tiny T2V checkpoint at 48x48 and 9 frames: 3 latent frames of 3x3 patches, 27 tokens, which 2
ranks split 14 + 13 (a token count the group size does not divide). With ``context_parallel_size: 2`` (2
processes, one data-parallel rank) both ranks take the one-process run's batch, timesteps and noise, each runs the
transformer on its slice of the tokens, and the run must be the one-process run: the same samples, levels and losses
per step, the same weights at the end (fp32 tolerance: attention's sums run in another order).

* S / C: LoRA SFT, 3 steps, one process and cp=2 (configs/wan/sft_tiny_cp.yaml as shipped); CR: C resumed from its
  step-1 checkpoint in new processes; C1: the same checkpoint resumed on one process (only the context-parallel size
  changes).
* SD / CD: full fine-tuning offline DPO (a frozen reference copy, split as the policy is), 2 steps.
* SG / CG: LoRA Flow-GRPO, 1 iteration: the group's ranks roll out the same samples together.
* DD / D4: DDP on 2 processes against dp=2 x cp=2 (4 processes, FSDP2 over all four), LoRA SFT, 2 steps.
"""

from __future__ import annotations

import json

import pytest
from ff_wan.testing import write_moving_squares

from ff_core.testing.shapes import write_prompt_dataset
from tests.test_context_parallel import (
    CP2,
    assert_same_grpo,
    assert_same_training,
    assert_split,
    cp_fit,
    rows,
    same_weights,
    steps,
    tokens,
    weights,
)
from tests.test_fsdp2 import REPO, assert_same_run, kill_at, wait
from tests.test_fsdp2 import weights as sharded_weights

DP2_CP2_SHARDED = json.dumps({"class_path": "ff_core.strategies.ContextParallelStrategy",
                              "init_args": {"context_parallel_size": 2, "data_parallel_size": 2,
                                            "save_distributed_checkpoint": True}})  # fmt: skip
GEOMETRY = ("--model.adapter_kwargs", json.dumps({"height": 48, "width": 48, "num_frames": 9, "fps": 8}))  # 27 tokens


def recipe(name: str):
    return REPO / "configs" / "wan" / f"{name}.yaml"


@pytest.fixture(scope="module")
def runs(tiny_wan, tmp_path_factory):
    base = tmp_path_factory.mktemp("wan_cp")
    squares = write_moving_squares(base / "squares", 4, frames=12)
    pairs = write_moving_squares(base / "pairs", 4, frames=12, preference=True)
    prompts = write_prompt_dataset(base / "prompts")
    ckpt = tiny_wan("t2v")
    r = {name: base / name for name in ("S", "C", "K", "CR", "C1", "SD", "CD", "SG", "CG", "DD", "D4")}
    sft, dpo, grpo = recipe("sft_tiny"), recipe("offline_dpo_tiny"), recipe("grpo_tiny")
    wait({**cp_fit(r["S"], sft, ckpt, 1, squares, *GEOMETRY, *steps(3)),
          **cp_fit(r["C"], recipe("sft_tiny_cp"), ckpt, 2, squares, *steps(3))})
    killed = cp_fit(r["K"], recipe("sft_tiny_cp"), ckpt, 2, squares, *steps(1000))
    full = ("--model.lora", "null", "--model.optimizer.init_args.lr", "1.0e-4", "--model.gradient_checkpointing",
            "true", *GEOMETRY, *steps(2))  # fmt: skip
    dpo_one = cp_fit(r["SD"], dpo, ckpt, 1, pairs, *full)
    step1 = kill_at(r["K"], killed[r["K"]], 1)
    wait({**dpo_one, **cp_fit(r["CR"], recipe("sft_tiny_cp"), ckpt, 2, squares, *steps(3), "--ckpt_path", str(step1))})
    rollout = ("--model.objective.init_args.num_steps", "3", "--model.objective.init_args.prompts_per_step", "2",
               "--model.objective.init_args.group_size", "2", "--model.objective.init_args.micro_batch_size", "2",
               "--model.objective.init_args.sampler", json.dumps({"kind": "flow_sde", "eta": 0.7, "window": [0, 2]}),
               "--model.objective.init_args.kl_beta", "0.1", "--model.eval_rewards", "[]", *GEOMETRY,
               *steps(1))  # fmt: skip
    wait({**cp_fit(r["CD"], dpo, ckpt, 2, pairs, *full, "--trainer.strategy", CP2),
          **cp_fit(r["SG"], grpo, ckpt, 1, prompts, *rollout)})
    per_rank = ("--data.per_device_batch_size", "2", *GEOMETRY, *steps(2))
    wait({**cp_fit(r["CG"], grpo, ckpt, 2, prompts, *rollout, "--trainer.strategy", CP2),
          **cp_fit(r["DD"], sft, ckpt, 2, squares, *per_rank, "--trainer.strategy", "ddp")})
    wait({**cp_fit(r["D4"], sft, ckpt, 4, squares, *per_rank, "--trainer.strategy", DP2_CP2_SHARDED),
          **cp_fit(r["C1"], sft, ckpt, 1, squares, *GEOMETRY, *steps(3), "--ckpt_path", str(step1))})
    return r


def test_cp2_sft_trains_as_one_process_on_a_token_count_it_does_not_divide(runs):
    assert tokens(runs["S"], 0) == [27]
    assert_split(runs["S"], runs["C"])  # 14 and 13: each rank's attention holds its slice only
    assert [r["step"] for r in rows(runs["C"], 0)] == [1, 2, 3]
    assert_same_training(runs["S"], runs["C"])


def test_cp2_resumes_exactly(runs):
    resumed, whole = runs["CR"], runs["C"]
    for rank in (0, 1):
        assert [r["step"] for r in rows(resumed, rank)] == [2, 3]
        assert_same_run(rows(resumed, rank), rows(whole, rank)[1:])
    same_weights(weights(resumed), weights(whole))


def test_a_cp2_checkpoint_resumes_on_one_process(runs):
    assert [r["step"] for r in rows(runs["C1"], 0)] == [2, 3]
    assert_same_run(rows(runs["C1"], 0), rows(runs["S"], 0)[1:])
    same_weights(weights(runs["C1"]), weights(runs["S"]))


def test_cp2_full_fine_tuning_dpo_with_its_reference_trains_as_one_process(runs):
    assert_same_training(runs["SD"], runs["CD"], rel=1e-3)  # DPO's loss amplifies rounding by beta


def test_cp2_grpo_rolls_out_and_updates_as_one_process(runs):
    assert_same_grpo(runs["SG"], runs["CG"])


def test_dp2_cp2_trains_as_ddp(runs):
    ddp, mesh = runs["DD"], runs["D4"]
    for rank in range(4):
        assert tokens(mesh, rank) == [14 if rank % 2 == 0 else 13]
        assert_same_run(rows(mesh, rank), rows(ddp, rank // 2))  # ranks 2d, 2d+1: data-parallel rank d
    same_weights(sharded_weights(mesh), weights(ddp))  # the last checkpoint: a folder of 4 shards, read whole
