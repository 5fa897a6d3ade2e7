"""configs/sd3/grpo_tiny.yaml through `ff fit` on the CPU: rollout -> reward -> update -> eval, checkpoint, resume."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from ff_core.cli.flow_cli import FlowCLI
from ff_core.data.datamodule import FlowDataModule
from ff_core.module import FlowModule
from ff_core.rewards.base import Reward
from ff_core.testing.shapes import write_prompt_dataset

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "sd3" / "grpo_tiny.yaml"


@pytest.fixture(scope="module")
def prompts_dir(tmp_path_factory):
    return write_prompt_dataset(tmp_path_factory.mktemp("prompts"))


def grpo_args(tiny_sd3, prompts_dir, root, *extra):
    """The recipe, shrunk: 2 prompts x 2 samples per step, 3 sampler steps (SDE on the first 2), evaluation of 3
    prompts with 2 ODE steps."""
    return [
        "--config", str(RECIPE),
        "--model.pretrained_model_name_or_path", str(tiny_sd3),
        "--model.objective.init_args.group_size", "2", "--model.objective.init_args.prompts_per_step", "2",
        "--model.objective.init_args.num_steps", "3",
        "--model.objective.init_args.sampler", json.dumps({"kind": "flow_sde", "eta": 0.7, "window": [0, 2]}),
        "--model.objective.init_args.micro_batch_size", "2",
        "--model.sampling.num_steps", "2",
        "--data.datasets", json.dumps([{"name": "prompts", "dataset_dir": str(prompts_dir),
                                        "eval": {"max_dataset_size": 3}}]),
        "--data.eval_batch_size", "3",
        "--trainer.default_root_dir", str(root),
        "--trainer.logger", json.dumps({"class_path": "lightning.pytorch.loggers.CSVLogger",
                                        "init_args": {"save_dir": str(root), "name": "logs", "version": 0}}),
        *extra,
    ]  # fmt: skip


def metrics(root: Path) -> list[dict[str, str]]:
    return [r for r in csv.DictReader(open(root / "logs" / "version_0" / "metrics.csv")) if r.get("train/reward_mean")]


@pytest.fixture(scope="module")
def grpo_run(tiny_sd3, prompts_dir, tmp_path_factory):
    """The real console script: 3 GRPO iterations (one optimiser step each), evaluation after step 3."""
    root = tmp_path_factory.mktemp("grpo")
    cmd = [sys.executable, "-m", "ff_core.cli", "fit", *grpo_args(
        tiny_sd3, prompts_dir, root, "--trainer.max_steps", "3", "--trainer.val_check_interval", "3",
        "--trainer.callbacks", json.dumps([{"class_path": "ff_core.callbacks.FlowCheckpoint",
                                            "init_args": {"every_n_train_steps": 1, "save_last": True,
                                                          "save_top_k": -1}},
                                           {"class_path": "ff_core.callbacks.LossCurve"}]))]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def test_recipe_runs_rollout_reward_update_and_eval(grpo_run):
    """Every iteration logs rewards, advantages, ratio, clip fractions and policy loss; the first replayed ratio of
    each iteration (one optimiser step per iteration) is exactly 1 with the real SD3 transformer; global_step counts
    optimiser steps; the checkpoint holds the LoRA and the optimiser state; evaluation generated."""
    rows = metrics(grpo_run)
    assert len(rows) == 3
    for row in rows:
        assert float(row["train/ratio_first_max_dev"]) == 0
        for name in ("reward/colour_mean", "reward/colour_std", "ratio", "clipped_low", "clipped_high", "policy_loss",
                     "approx_kl", "advantage_abs_mean"):
            assert row[f"train/{name}"] != ""
    evals = [r for r in csv.DictReader(open(grpo_run / "logs" / "version_0" / "metrics.csv")) if r.get("val/reward")]
    assert len(evals) == 1 and 0 <= float(evals[0]["val/reward/colour"]) <= 1  # eval scores the training reward
    last = torch.load(grpo_run / "logs" / "version_0" / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 3
    assert last["state_dict"] and all("lora_" in k for k in last["state_dict"])
    assert last["optimizer_states"][0]["state"]
    # LossCurve draws what GRPO logs (it logs no "loss"): the mean reward of each step, as in metrics.csv (whose
    # step column is the global step before the iteration's optimiser step, LossCurve's the one after).
    curve = list(csv.DictReader(open(grpo_run / "logs" / "version_0" / "loss.csv")))
    assert [int(r["step"]) for r in curve] == [1, 2, 3]
    assert [float(r["reward_mean"]) for r in curve] == [
        pytest.approx(float(r["train/reward_mean"]), abs=1e-6) for r in rows]
    assert (grpo_run / "logs" / "version_0" / "loss.png").stat().st_size > 0


def fit(tiny_sd3, prompts_dir, root, *extra) -> FlowCLI:
    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=grpo_args(
        tiny_sd3, prompts_dir, root, "--trainer.limit_val_batches", "0", "--trainer.callbacks", "[]",
        "--trainer.enable_progress_bar", "false", *extra))  # fmt: skip
    return cli


def test_resumed_run_equals_the_uninterrupted_one(grpo_run, tiny_sd3, prompts_dir, tmp_path):
    """From the step-2 checkpoint, one more iteration reproduces the uninterrupted run's third step: the same
    prompts and rollout noise (seeded by noise seed, rank and optimiser step), the same LoRA weights after it."""
    [step2] = (grpo_run / "logs" / "version_0" / "checkpoints").glob("*step=2.ckpt")
    cli = fit(tiny_sd3, prompts_dir, tmp_path, "--trainer.max_steps", "3")
    cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=str(step2))
    uninterrupted = torch.load(grpo_run / "logs" / "version_0" / "checkpoints" / "last.ckpt",
                               weights_only=False)["state_dict"]  # fmt: skip
    resumed = {k: v for k, v in cli.model.state_dict().items() if k in uninterrupted}
    assert resumed.keys() == uninterrupted.keys()
    before = torch.load(step2, weights_only=False)["state_dict"]
    assert any(not torch.equal(before[k], v) for k, v in uninterrupted.items())  # step 3 did change the LoRA
    for k, v in uninterrupted.items():
        torch.testing.assert_close(resumed[k], v, rtol=0, atol=0)


def test_accumulate_grad_batches_is_refused(tiny_sd3, prompts_dir, tmp_path):
    cli = fit(tiny_sd3, prompts_dir, tmp_path, "--trainer.max_steps", "1", "--trainer.accumulate_grad_batches", "2")
    with pytest.raises(Exception, match="accumulat"):
        cli.trainer.fit(cli.model, cli.datamodule)


def test_lightning_ema_averages_the_grpo_weights(tiny_sd3, prompts_dir, tmp_path):
    """EMA of the trained weights is Lightning's EMAWeightAveraging: it updates once per GRPO iteration, and after
    training the module holds the average, which differs from the last iterate."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    cli = fit(tiny_sd3, prompts_dir, tmp_path, "--trainer.max_steps", "2")
    ema = EMAWeightAveraging(decay=0.5)
    cli.trainer.callbacks.append(ema)
    last = {}

    class LastIterate(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            last.update({n: p.detach().clone() for n, p in pl_module.named_parameters() if p.requires_grad})

    cli.trainer.callbacks.insert(0, LastIterate())
    cli.trainer.fit(cli.model, cli.datamodule)
    assert ema._latest_update_step == 2
    final = {n: p for n, p in cli.model.named_parameters() if p.requires_grad}
    assert any(not torch.equal(final[n], last[n]) for n in last)


class NeedsSolution(Reward):
    name = "needs_solution"
    required_fields = ("solution",)

    def __call__(self, batch):
        return torch.zeros(len(batch))


def test_rows_lacking_a_reward_field_fail_before_weights_load(tiny_sd3, prompts_dir, tmp_path):
    from ff_core.errors import DatasetErrors

    cli = fit(tiny_sd3, prompts_dir, tmp_path, "--trainer.max_steps", "1", "--model.objective.init_args.rewards",
              json.dumps([{"name": "test_grpo_fit:NeedsSolution"}]), "--model.eval_rewards", "[]")  # fmt: skip
    with pytest.raises(DatasetErrors, match=r"train.txt:1: metadata.solution: reward 'test_grpo_fit:NeedsSolution' "
                                            r"\(model.objective.rewards\)"):
        cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.model.adapter is None


class Constant(Reward):
    name = "constant"

    def __call__(self, batch):
        return torch.full((len(batch),), 22.37)


def test_iterations_whose_groups_all_tie_count_a_step_and_change_nothing(tiny_sd3, prompts_dir, tmp_path):
    """A reward every sample ties on (issue 23, item 12): ``zero_std_ratio`` logs 1, ``filter_zero_std`` leaves every
    sample out of the update, and Lightning's loop still counts each iteration's optimiser step (``global_step``, hence
    the next iteration's noise seed, advance) while the weights and the optimiser state stay as they were (no
    gradient: AdamW skips every parameter, momentum and weight decay included)."""
    cli = fit(tiny_sd3, prompts_dir, tmp_path, "--trainer.max_steps", "2", "--model.objective.init_args.rewards",
              json.dumps([{"name": "test_grpo_fit:Constant"}]), "--model.eval_rewards", "[]")  # fmt: skip
    start = {}

    class Start(L.Callback):
        def on_train_start(self, trainer, pl_module):
            start.update({n: p.detach().clone() for n, p in pl_module.named_parameters() if p.requires_grad})

    cli.trainer.callbacks.append(Start())
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 2
    rows = metrics(tmp_path)
    assert [float(r["train/zero_std_ratio"]) for r in rows] == [1.0, 1.0]
    assert all(not r.get("train/ratio") for r in rows)  # nothing replayed
    for n, p in cli.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, start[n]), n
    assert not cli.model.optimizers().optimizer.state
