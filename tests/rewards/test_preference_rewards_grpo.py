"""configs/sd3/grpo_tiny.yaml trained for 2 iterations on pickscore, aesthetic, hps, image_reward and vlm_judge
(GDPO: each normalised within its group before the weighted sum), each loaded from a tiny random model folder: every
reward is logged, the policy loss is finite and the LoRA moves."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import lightning as L
import pytest
from tiny_reward_models import build_tiny_llava

from ff_core.cli.flow_cli import FlowCLI
from ff_core.data.datamodule import FlowDataModule
from ff_core.module import FlowModule
from ff_core.testing.shapes import write_prompt_dataset
from ff_core.testing.tiny_rewards import build_tiny_clip, build_tiny_hps, build_tiny_image_reward, write_aesthetic_head

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "sd3" / "grpo_tiny.yaml"


@pytest.fixture(scope="module")
def reward_specs(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference_rewards")
    clip = build_tiny_clip(root / "clip")
    head = write_aesthetic_head(root / "aesthetic.pth", input_size=8)
    hps_folder, hps_checkpoint = build_tiny_hps(root / "hps")
    image_reward = build_tiny_image_reward(root / "image_reward")
    llava = build_tiny_llava(root / "llava")
    return [
        {"name": "pickscore", "weight": 1.0, "args": {"pretrained_model_name_or_path": str(clip), "normalise": True}},
        {"name": "aesthetic", "weight": 0.5, "args": {"pretrained_model_name_or_path": str(clip),
                                                      "head_path": str(head)}},
        {"name": "hps", "weight": 1.0, "args": {"pretrained_model_name_or_path": str(hps_folder),
                                                "checkpoint": str(hps_checkpoint)}},
        {"name": "image_reward", "weight": 0.25, "args": {"pretrained_model_name_or_path": str(image_reward)}},
        {"name": "vlm_judge", "weight": 0.5, "args": {"pretrained_model_name_or_path": str(llava), "dtype": "float32"}},
    ]  # fmt: skip


def test_grpo_trains_on_the_preference_rewards(tiny_sd3, reward_specs, tmp_path):
    prompts = write_prompt_dataset(tmp_path / "prompts")
    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(RECIPE),
        "--model.pretrained_model_name_or_path", str(tiny_sd3),
        "--model.objective.init_args.rewards", json.dumps(reward_specs),
        "--model.objective.init_args.group_size", "2", "--model.objective.init_args.prompts_per_step", "2",
        "--model.objective.init_args.num_steps", "3",
        "--model.objective.init_args.sampler", json.dumps({"kind": "flow_sde", "eta": 0.7, "window": [0, 2]}),
        "--model.objective.init_args.micro_batch_size", "2",
        "--model.eval_rewards", "[]",
        "--data.datasets", json.dumps([{"name": "prompts", "dataset_dir": str(prompts)}]),
        "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0", "--trainer.callbacks", "[]",
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path),
        "--trainer.logger", json.dumps({"class_path": "lightning.pytorch.loggers.CSVLogger",
                                        "init_args": {"save_dir": str(tmp_path), "name": "logs", "version": 0}}),
    ])  # fmt: skip
    lora = {}

    class Start(L.Callback):  # the weights load in setup: snapshot the LoRA when training starts
        def on_train_start(self, trainer, pl_module):
            lora.update({n: p.detach().clone() for n, p in pl_module.named_parameters() if p.requires_grad})

    cli.trainer.callbacks.append(Start())
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 2
    rows = [r for r in csv.DictReader(open(tmp_path / "logs" / "version_0" / "metrics.csv"))
            if r.get("train/reward_mean")]
    assert len(rows) == 2
    for row in rows:
        for key in ("pickscore", "aesthetic", "hps", "image_reward", "vlm_judge"):
            assert math.isfinite(float(row[f"train/reward/{key}_mean"])), key
        assert math.isfinite(float(row["train/policy_loss"]))
    trained = {n: p for n, p in cli.model.named_parameters() if p.requires_grad}
    assert lora.keys() == trained.keys() and lora
    assert any(not p.detach().equal(lora[n]) for n, p in trained.items())  # training moved the LoRA
