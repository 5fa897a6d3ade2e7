"""configs/sd3/nft_tiny.yaml (DiffusionNFT) through `ff fit` on the CPU: rollout with the old policy -> rewards ->
forward-process update -> old-policy EMA, checkpoints holding the old policy, and an exact resume."""

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
from ff_core.module import OBJECTIVE_STATE_KEY, FlowModule
from ff_core.objectives.nft_loss import old_policy_decay
from ff_core.sharding import full_tensor
from ff_core.testing.shapes import write_prompt_dataset

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "sd3" / "nft_tiny.yaml"


@pytest.fixture(scope="module")
def prompts_dir(tmp_path_factory):
    return write_prompt_dataset(tmp_path_factory.mktemp("prompts"))


def nft_args(tiny_sd3, prompts_dir, root, *extra):
    """The recipe, shrunk: 2 prompts x 2 samples per step, 3 ODE steps (2 trained timesteps per sample), a fast
    old-policy ramp so the decay is visible within 3 steps."""
    return [
        "--config", str(RECIPE),
        "--model.pretrained_model_name_or_path", str(tiny_sd3),
        "--model.objective.init_args.group_size", "2", "--model.objective.init_args.prompts_per_step", "2",
        "--model.objective.init_args.num_steps", "3", "--model.objective.init_args.micro_batch_size", "2",
        "--model.objective.init_args.decay_ramp_rate", "0.2",
        "--model.sampling.num_steps", "2",
        "--data.datasets", json.dumps([{"name": "prompts", "dataset_dir": str(prompts_dir),
                                        "eval": {"max_dataset_size": 3}}]),
        "--data.eval_batch_size", "3",
        "--trainer.default_root_dir", str(root),
        "--trainer.logger", json.dumps({"class_path": "lightning.pytorch.loggers.CSVLogger",
                                        "init_args": {"save_dir": str(root), "name": "logs", "version": 0}}),
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def nft_run(tiny_sd3, prompts_dir, tmp_path_factory):
    """The real console script: 3 DiffusionNFT iterations (one optimiser step each), evaluation after step 3."""
    root = tmp_path_factory.mktemp("nft")
    cmd = [sys.executable, "-m", "ff_core.cli", "fit", *nft_args(
        tiny_sd3, prompts_dir, root, "--trainer.max_steps", "3", "--trainer.val_check_interval", "3",
        "--trainer.callbacks", json.dumps([{"class_path": "ff_core.callbacks.FlowCheckpoint",
                                            "init_args": {"every_n_train_steps": 1, "save_last": True,
                                                          "save_top_k": -1}}]))]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def checkpoint(root: Path, step: int) -> dict:
    [path] = (root / "logs" / "version_0" / "checkpoints").glob(f"*step={step}.ckpt")
    return torch.load(path, weights_only=False)


def test_recipe_trains_logs_and_keeps_the_old_policy(nft_run):
    """Every iteration logs rewards, the policy loss and its halves, the KL to the base, the old policy's decay
    (0.2, 0.4, 0.5 capped: the official ramp with rate 0.2) and its distance; each checkpoint holds the old policy,
    which is the EMA ``d old + (1 - d) current`` of the previous one and the step's LoRA."""
    logged = list(csv.DictReader(open(nft_run / "logs" / "version_0" / "metrics.csv")))
    rows = [r for r in logged if r.get("train/reward_mean")]
    assert len(rows) == 3
    for row in rows:
        for name in ("reward/colour_mean", "policy_loss", "positive_loss", "negative_loss", "kl", "optimality",
                     "old_deviation", "advantage_abs_mean"):
            assert row[f"train/{name}"] != "", name
    assert [float(r["train/old_decay"]) for r in rows] == pytest.approx([0.2, 0.4, 0.5])
    evals = [r for r in logged if r.get("val/reward")]
    assert len(evals) == 1
    ckpts = {s: checkpoint(nft_run, s) for s in (1, 2, 3)}
    for step in (2, 3):
        old = ckpts[step][OBJECTIVE_STATE_KEY]["old_policy"]
        previous = ckpts[step - 1][OBJECTIVE_STATE_KEY]["old_policy"]
        current = ckpts[step]["state_dict"]
        assert set(old) == set(current) and all("lora_" in k for k in old)
        d = old_policy_decay(step, 0, 0.2, 0.5)
        for name, value in old.items():
            torch.testing.assert_close(value, d * previous[name] + (1 - d) * current[name], rtol=1e-6, atol=1e-7)
        assert any(not torch.equal(old[k], current[k]) for k in old)  # the sampling policy lags the trained one


def test_resumed_run_equals_the_uninterrupted_one(nft_run, tiny_sd3, prompts_dir, tmp_path):
    """From the step-2 checkpoint one more iteration reproduces the uninterrupted third step bit for bit: the same
    rollout (sampled with the restored old policy), the same training draws, the same LoRA and old policy after it."""
    ckpt = next((nft_run / "logs" / "version_0" / "checkpoints").glob("*step=2.ckpt"))
    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=nft_args(
        tiny_sd3, prompts_dir, tmp_path, "--trainer.limit_val_batches", "0", "--trainer.callbacks", "[]",
        "--trainer.enable_progress_bar", "false", "--trainer.max_steps", "3"))  # fmt: skip
    cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=str(ckpt))
    last = checkpoint(nft_run, 3)
    for k, v in last["state_dict"].items():
        torch.testing.assert_close(cli.model.state_dict()[k], v, rtol=0, atol=0)
    resumed_old = cli.model.objective.checkpoint_state()["old_policy"]
    for k, v in last[OBJECTIVE_STATE_KEY]["old_policy"].items():
        torch.testing.assert_close(resumed_old[k], v, rtol=0, atol=0)


class DumpOldPolicy(L.Callback):
    """Saves, per rank, the trained weights, DiffusionNFT's old policy and each step's gathered reward mean."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath, self.rewards = Path(dirpath), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rewards.append(float(trainer.callback_metrics["train/reward_mean"]))

    def on_train_end(self, trainer, pl_module) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        weights = {n: full_tensor(p.detach()).clone() for n, p in pl_module.named_parameters() if p.requires_grad}
        old = {n: full_tensor(t).clone() for n, t in pl_module.objective._old_policy(pl_module).items()}
        torch.save({"weights": weights, "old": old, "rewards": self.rewards},
                   self.dirpath / f"rank{trainer.global_rank}.pt")  # fmt: skip


def test_deepspeed_is_refused_before_weights_load(tiny_sd3):
    """DeepSpeed's engine keeps its own flat copies of the parameters, which the old policy cannot be copied into."""
    from ff_core.errors import ConfigError
    from ff_core.objectives import NFTObjective
    from ff_core.strategies import DeepSpeedStrategy

    module = FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32},
                        objective=NFTObjective(rewards=[{"name": "colour"}], group_size=2, prompts_per_step=2))
    with pytest.raises(ConfigError, match=r"NFTObjective runs on one device, DDP, FSDP2 \(ModelParallelStrategy\), "
                       r"not under DeepSpeed"):  # fmt: skip
        module._check_strategy(DeepSpeedStrategy.__new__(DeepSpeedStrategy))


FSDP2 = json.dumps({"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                    "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1,
                                  "save_distributed_checkpoint": False}})  # fmt: skip


def start(tiny_sd3, prompts_dir, root: Path, max_steps: int, strategy: str, *extra: str) -> dict:
    from tests.test_fsdp2 import launch

    root.mkdir()
    callbacks = [{"class_path": "ff_core.callbacks.FlowCheckpoint",
                  "init_args": {"every_n_train_steps": 1, "save_top_k": -1, "dirpath": str(root / "ckpt")}},
                 {"class_path": "tests.test_nft_fit.DumpOldPolicy", "init_args": {"dirpath": str(root / "out")}}]
    args = nft_args(tiny_sd3, prompts_dir, root, "--trainer.strategy", strategy, "--trainer.devices", "2",
                    "--trainer.max_steps", str(max_steps), "--trainer.limit_val_batches", "0", "--trainer.logger",
                    "false", "--trainer.enable_progress_bar", "false", "--trainer.callbacks", json.dumps(callbacks),
                    *extra)  # fmt: skip
    return {root: launch(root, args)}


def test_fsdp2_trains_and_resumes_as_ddp(tiny_sd3, prompts_dir, tmp_path):
    """2 gloo ranks, each group split over them. Under DDP: the same gathered rewards, identical weights and old
    policies on both ranks at the end (gradients averaged once per optimiser step, the old policy's EMA of identical
    weights), and trained. Under FSDP2 (LoRA, the old policy sharded as the parameters) DDP's two steps: the same
    gathered rewards, the same LoRA and old policy at the end (within float tolerance: reduce-scatter sums in another
    order than all-reduce); resumed from its step-1 checkpoint (the old policy saved whole, re-sharded), the FSDP2
    run ends where the uninterrupted one does."""
    from tests.test_fsdp2 import wait

    d, a, b = tmp_path / "D", tmp_path / "A", tmp_path / "B"
    wait({**start(tiny_sd3, prompts_dir, d, 2, "ddp"), **start(tiny_sd3, prompts_dir, a, 2, FSDP2)})
    ckpt = next((a / "ckpt").glob("*step=1.ckpt"))
    wait(start(tiny_sd3, prompts_dir, b, 2, FSDP2, "--ckpt_path", str(ckpt)))
    runs = {name: [torch.load(root / "out" / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
            for name, root in (("D", d), ("A", a), ("B", b))}  # fmt: skip
    ddp = runs["D"]
    assert ddp[0]["rewards"] == ddp[1]["rewards"] and len(ddp[0]["rewards"]) == 2
    for key in ("weights", "old"):
        for name, w in ddp[0][key].items():
            assert torch.equal(w, ddp[1][key][name]), (key, name)
    assert any(w.abs().sum() > 0 for n, w in ddp[0]["weights"].items() if "lora_B" in n)
    for rank in (0, 1):
        assert runs["A"][rank]["rewards"] == pytest.approx(runs["D"][rank]["rewards"], rel=1e-4)
        assert runs["B"][rank]["rewards"] == pytest.approx(runs["D"][rank]["rewards"][1:], rel=1e-4)
        for run in ("A", "B"):
            for key in ("weights", "old"):
                expected, actual = runs["D"][rank][key], runs[run][rank][key]
                assert expected.keys() == actual.keys()
                for name, w in expected.items():
                    torch.testing.assert_close(actual[name], w, rtol=1e-4, atol=1e-6, msg=f"{run} {key} {name}")
