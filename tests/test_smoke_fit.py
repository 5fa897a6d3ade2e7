"""`ff fit` on prepared smoke rows (docs/datasets.md, "Offline smoke datasets"): for every served alias and both
algorithms, the alias's tiny recipe on a tiny checkpoint of its family trains exactly K = 2 steps (one epoch) on the
rows prepared for world size 1; for sd35-t2i, 2 gloo processes on the rows prepared for world size 2 train exactly 2
steps each, on disjoint rows. The fits load in-process (FlowCLI, as tests/test_grpo_fit.py); the 2-rank run is a
subprocess (tests/test_ddp_resume.py)."""

from __future__ import annotations

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
from ff_core.data.smoke.build import build
from ff_core.data.smoke.catalogue import ALIASES
from ff_core.data.smoke.prepare import prepare
from ff_core.data.smoke.support import support_table
from ff_core.module import FlowModule
from ff_core.plugins import get_adapter_class
from ff_core.pretrained import resolve_contract
from tests.test_ddp_resume import LAUNCHER_VARS, free_port

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
# alias -> (SFT recipe, offline-DPO recipe or None: the SFT recipe with DPO_OBJECTIVE, (plugin, tiny variant)). The
# table of docs/datasets.md, "Offline smoke datasets".
RECIPES = {
    "sd35-t2i": ("sd3/sft_tiny.yaml", "sd3/offline_dpo_tiny.yaml", ("ff_sd3", None)),
    "wan-t2v": ("wan/sft_tiny.yaml", "wan/offline_dpo_tiny.yaml", ("ff_wan", "t2v")),
    "wan-i2v-first": ("wan/i2v_sft_tiny.yaml", None, ("ff_wan", "ti2v")),
    "wan-flf2v": ("wan/i2v_sft_tiny.yaml", None, ("ff_wan", "flf2v")),
    "ltx2-t2av": ("ltx2/sft_tiny.yaml", "ltx2/offline_dpo_tiny.yaml", ("ff_ltx2", "t2av")),
    "ltx2-i2av": ("ltx2/i2av_sft_tiny.yaml", "ltx2/i2av_offline_dpo_tiny.yaml", ("ff_ltx2", "i2av")),
    "h3-t2va": ("minimax/t2va_sft_tiny.yaml", "minimax/t2va_offline_dpo_tiny.yaml", ("ff_minimax", "t2va")),
    "h3-fl2va": ("minimax/fl2va_sft_tiny.yaml", "minimax/fl2va_offline_dpo_tiny.yaml", ("ff_minimax", "fl2va")),
    "h3-ref2va": ("minimax/ref2va_sft_tiny.yaml", "minimax/ref2va_offline_dpo_tiny.yaml", ("ff_minimax", "ref2va")),
}
DPO_OBJECTIVE = {"class_path": "ff_core.objectives.DPOObjective",
                 "init_args": {"beta": 5000.0, "num_train_timesteps": 1}}  # fmt: skip
SERVED = [name for name, entry in support_table().items() if entry.served]
# One epoch, nothing but training: no evaluation, checkpoints, logger or sampling callbacks.
ONE_EPOCH = ["--trainer.max_steps", "-1", "--trainer.max_epochs", "1", "--trainer.callbacks", "[]",
             "--trainer.logger", "false", "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar",
             "false", "--trainer.accumulate_grad_batches", "1", "--data.per_device_batch_size", "1",
             "--data.preprocessing_batch_size", "1", "--data.num_workers", "0"]  # fmt: skip


def test_every_served_alias_has_a_tiny_recipe():
    assert set(SERVED) <= set(RECIPES) and set(RECIPES) <= set(ALIASES)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("smoke") / "out"
    build(root)
    return root


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_sd3):
    """``checkpoint(alias)``: a tiny checkpoint of the alias's family and variant, built once per module."""
    made: dict[tuple, Path] = {}

    def get(alias: str) -> Path:
        plugin, variant = RECIPES[alias][2]
        if plugin == "ff_sd3":
            return tiny_sd3
        if (plugin, variant) not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{plugin}-{variant}")
            if plugin == "ff_wan":
                from ff_wan.testing import build_tiny_wan as make
            elif plugin == "ff_ltx2":
                from ff_ltx2.testing import build_tiny_ltx2 as make
            else:
                from ff_minimax.testing import build_tiny_minimax as make
            made[plugin, variant] = make(folder, variant=variant)
        return made[plugin, variant]

    return get


@pytest.mark.parametrize("algorithm", ["sft", "offline-dpo"])
@pytest.mark.parametrize("name", SERVED)
def test_the_tiny_recipe_trains_exactly_k_steps_on_rows_for_world_size_one(built, checkpoint, tmp_path, name,
                                                                           algorithm):  # fmt: skip
    sft, dpo, _ = RECIPES[name]
    alias = ALIASES[name]
    pretrained = checkpoint(name)
    # The checkpoint's own contract (read from its configs) is the one the alias's variant names.
    assert resolve_contract(get_adapter_class(alias.adapter), str(pretrained)) == support_table()[name].contract
    done = prepare(algorithm, name, 1, source=built, output=tmp_path / "prepared")
    recipe = sft if algorithm == "sft" else dpo or sft
    objective = ["--model.objective", json.dumps(DPO_OBJECTIVE)] if algorithm == "offline-dpo" and dpo is None else []
    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(CONFIGS / recipe), "--model.pretrained_model_name_or_path", str(pretrained),
        "--data.datasets", json.dumps([{"name": name, "dataset_dir": str(done.train.parent)}]),
        "--trainer.default_root_dir", str(tmp_path / "run"), *ONE_EPOCH, *objective])  # fmt: skip
    assert cli.model.objective.__class__.__name__ == ("SFTObjective" if algorithm == "sft" else "DPOObjective")
    cli.trainer.fit(cli.model, cli.datamodule)
    assert (cli.trainer.global_step, cli.trainer.current_epoch) == (2, 1)  # K = 2 batches of 1 row, one epoch
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])


class RankSteps(L.Callback):
    """Saves, per rank, its optimiser steps and the rows (dataset indices) of every batch it trained on."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath, self.rows = Path(dirpath), []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.rows.append(batch["index"].tolist())

    def on_train_end(self, trainer, pl_module) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        found = {"global_step": trainer.global_step, "rows": self.rows, "world_size": trainer.world_size}
        (self.dirpath / f"rank{trainer.global_rank}.json").write_text(json.dumps(found))


def test_two_gloo_ranks_train_exactly_k_steps_each_on_rows_for_world_size_two(built, tiny_sd3, tmp_path):
    done = prepare("sft", "sd35-t2i", 2, source=built, output=tmp_path / "prepared")
    assert done.rows == 4
    callbacks = [{"class_path": "tests.test_smoke_fit.RankSteps", "init_args": {"dirpath": str(tmp_path / "out")}}]
    args = [a for a in ONE_EPOCH]
    args[args.index("--trainer.callbacks") + 1] = json.dumps(callbacks)
    cmd = [sys.executable, "-m", "ff_core.cli", "fit", "--config", str(CONFIGS / "sd3" / "sft_tiny.yaml"),
           "--model.pretrained_model_name_or_path", str(tiny_sd3),
           "--data.datasets", json.dumps([{"name": "smoke", "dataset_dir": str(done.train.parent)}]),
           "--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
           "--trainer.default_root_dir", str(tmp_path / "run"), *args]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(HF_HUB_OFFLINE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert (rank["world_size"], rank["global_step"], len(rank["rows"])) == (2, 2, 2)
        assert all(len(batch) == 1 for batch in rank["rows"])
    seen = [row for rank in ranks for batch in rank["rows"] for row in batch]
    assert sorted(seen) == [0, 1, 2, 3]  # every prepared row once: disjoint shards, nothing repeated
