"""Context parallelism for Wan (issue 27): real ``ff fit`` processes over gloo, against one process.

Every run trains the tiny T2V checkpoint at 48x48 and 9 frames: 3 latent frames of 3x3 patches, 27 tokens, which 2
ranks split 14 + 13 (a token count the group size does not divide). With ``context_parallel_size: 2`` (2
processes, one data-parallel rank) both ranks take the one-process run's batch, timesteps and noise, each runs the
transformer on its half of the tokens, and the run must be the one-process run: the same samples, levels and losses
per step, the same weights at the end (fp32 tolerance: attention's sums run in another order).

* S / C: LoRA SFT, 3 steps, one process and cp=2; CR: C resumed from its step-1 checkpoint in new processes.
* SD / CD: full fine-tuning offline DPO (a frozen reference copy, split as the policy is), 2 steps.
* SG / CG: LoRA Flow-GRPO, 1 iteration: the group's ranks roll out the same samples together.
* D4 / DD: dp=2 x cp=2 (4 processes, FSDP2 over all four) against DDP on 2 processes, LoRA SFT, 2 steps.

Each rank's attention sees its slice: the self-attention inputs hold 14 or 13 tokens under cp=2, 27 in one process
(``tests.test_context_parallel.Tokens``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ff_wan.testing import write_moving_squares

from ff_core.callbacks import read_sample_log
from ff_core.testing.shapes import write_prompt_dataset
from tests.test_fsdp2 import REPO, assert_same_run, launch, wait
from tests.test_grpo_sharded import same_steps

CP2 = json.dumps({"class_path": "ff_core.strategies.ContextParallelStrategy",
                  "init_args": {"context_parallel_size": 2, "save_distributed_checkpoint": False}})  # fmt: skip
DP2_CP2 = CP2.replace('"context_parallel_size": 2', '"context_parallel_size": 2, "data_parallel_size": 2')
GEOMETRY = json.dumps({"height": 48, "width": 48, "num_frames": 9, "fps": 8})  # 3 x 3 x 3 = 27 tokens
TOKENS = 27


def fit(root: Path, recipe: str, checkpoint: Path, ranks: int, *extra: str, dataset: Path) -> dict:
    root.mkdir()
    callbacks = [
        {"class_path": "ff_core.callbacks.FlowCheckpoint",
         "init_args": {"every_n_train_steps": 1, "save_top_k": -1, "save_last": True, "dirpath": str(root / "ckpt")}},
        {"class_path": "ff_core.callbacks.SampleLog",
         "init_args": {"dirpath": str(root / "ids"), "outputs": ["sigma", "noise_seed", "loss"]}},
        {"class_path": "tests.test_context_parallel.Tokens", "init_args": {"dirpath": str(root / "tokens")}},
        {"class_path": "tests.test_grpo_sharded.Record", "init_args": {"dirpath": str(root / "out")}},
    ]  # fmt: skip
    name = "prompts" if "grpo" in recipe else "squares"
    return {root: launch(root, [
        "--config", str(REPO / "configs" / "wan" / f"{recipe}.yaml"),
        "--model.pretrained_model_name_or_path", str(checkpoint), "--model.adapter_kwargs", GEOMETRY,
        "--data.datasets", json.dumps([{"name": name, "dataset_dir": str(dataset)}]),
        "--trainer.devices", str(ranks), "--trainer.limit_val_batches", "0", "--trainer.default_root_dir", str(root),
        "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.callbacks", json.dumps(callbacks), *extra,
    ], ranks=ranks)}  # fmt: skip


def steps(n: int) -> tuple[str, ...]:
    return ("--trainer.max_steps", str(n))


def weights(root: Path) -> dict[str, torch.Tensor]:
    return torch.load(root / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]


def tokens(root: Path, rank: int) -> list[int]:
    return json.loads((root / "tokens" / f"rank{rank}.json").read_text())


def rows(root: Path, rank: int) -> list[dict]:
    return read_sample_log(root / "ids" / f"rank{rank}.jsonl")


def same_weights(got: dict, want: dict, atol: float = 1e-6) -> None:
    assert got.keys() == want.keys() and want
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=atol, msg=key)


@pytest.fixture(scope="module")
def runs(tiny_wan, tmp_path_factory):
    base = tmp_path_factory.mktemp("wan_cp")
    squares = write_moving_squares(base / "squares", 4, frames=12)
    pairs = write_moving_squares(base / "pairs", 4, frames=12, preference=True)
    prompts = write_prompt_dataset(base / "prompts")
    ckpt = tiny_wan("t2v")
    r = {name: base / name for name in ("S", "C", "CR", "SD", "CD", "SG", "CG", "DD", "D4")}
    wait({**fit(r["S"], "sft_tiny", ckpt, 1, *steps(3), dataset=squares),
          **fit(r["C"], "sft_tiny", ckpt, 2, *steps(3), "--trainer.strategy", CP2, dataset=squares)})
    step1 = next((r["C"] / "ckpt").glob("*step=1.ckpt"))
    full = ("--model.lora", "null", "--model.optimizer.init_args.lr", "1.0e-4")
    wait({**fit(r["CR"], "sft_tiny", ckpt, 2, *steps(3), "--trainer.strategy", CP2, "--ckpt_path", str(step1),
                dataset=squares),
          **fit(r["SD"], "offline_dpo_tiny", ckpt, 1, *steps(2), *full, dataset=pairs)})  # fmt: skip
    grpo = ("--model.objective.init_args.num_steps", "3", "--model.objective.init_args.prompts_per_step", "2",
            "--model.objective.init_args.group_size", "2", "--model.objective.init_args.micro_batch_size", "2",
            "--model.objective.init_args.sampler", json.dumps({"kind": "flow_sde", "eta": 0.7, "window": [0, 2]}),
            "--model.eval_rewards", "[]", *steps(1))  # fmt: skip
    wait({**fit(r["CD"], "offline_dpo_tiny", ckpt, 2, *steps(2), *full, "--trainer.strategy", CP2, dataset=pairs),
          **fit(r["SG"], "grpo_tiny", ckpt, 1, *grpo, dataset=prompts)})
    per_rank = ("--data.per_device_batch_size", "2")
    wait({**fit(r["CG"], "grpo_tiny", ckpt, 2, *grpo, "--trainer.strategy", CP2, dataset=prompts),
          **fit(r["DD"], "sft_tiny", ckpt, 2, *steps(2), *per_rank, "--trainer.strategy", "ddp", dataset=squares)})
    wait(fit(r["D4"], "sft_tiny", ckpt, 4, *steps(2), *per_rank, "--trainer.strategy", DP2_CP2, dataset=squares))
    return r


def test_cp2_sft_trains_as_one_process_on_a_token_count_it_does_not_divide(runs):
    one, cp = runs["S"], runs["C"]
    assert tokens(one, 0) == [TOKENS]
    assert tokens(cp, 0) == [14] and tokens(cp, 1) == [13]  # each rank's attention holds its slice only
    for rank in (0, 1):
        assert [r["step"] for r in rows(cp, rank)] == [1, 2, 3]
        assert_same_run(rows(cp, rank), rows(one, 0))  # ids, sigma, noise seed; loss within 1e-5
    same_weights(weights(cp), weights(one))


def test_cp2_resumes_exactly(runs):
    resumed, whole = runs["CR"], runs["C"]
    for rank in (0, 1):
        assert [r["step"] for r in rows(resumed, rank)] == [2, 3]
        assert_same_run(rows(resumed, rank), rows(whole, rank)[1:])
    same_weights(weights(resumed), weights(whole))


def test_cp2_full_fine_tuning_dpo_with_its_reference_trains_as_one_process(runs):
    one, cp = runs["SD"], runs["CD"]
    for rank in (0, 1):
        assert_same_run(rows(cp, rank), rows(one, 0), rel=1e-3)  # DPO's loss amplifies rounding by beta
    same_weights(weights(cp), weights(one))


def test_cp2_grpo_rolls_out_and_updates_as_one_process(runs):
    one = torch.load(runs["SG"] / "out" / "rank0.pt", weights_only=False)
    for rank in (0, 1):
        cp = torch.load(runs["CG"] / "out" / f"rank{rank}.pt", weights_only=False)
        assert [s["step"] for s in cp["steps"]] == [1]
        same_steps(one["steps"], cp["steps"])  # prompts, rewards, advantages, losses, ratios
        same_weights(cp["weights"], one["weights"], atol=1e-5)


def test_dp2_cp2_trains_as_ddp(runs):
    ddp, mesh = runs["DD"], runs["D4"]
    for rank in range(4):
        assert tokens(mesh, rank) == [14 if rank % 2 == 0 else 13]
        assert_same_run(rows(mesh, rank), rows(ddp, rank // 2))  # ranks 2d, 2d+1: data-parallel rank d
    same_weights(weights(mesh), weights(ddp))
