"""``ff fit``'s progress bar on step-limited runs (issue 31): Lightning's own bars, swapped for subclasses that show
optimiser steps out of ``max_steps`` and no ``Epoch N/-2`` (ff_core/callbacks/progress.py)."""

from __future__ import annotations

import json
from pathlib import Path

from lightning.pytorch.callbacks import RichProgressBar

from ff_core.callbacks.progress import StepRichProgressBar, StepTQDMProgressBar
from ff_core.cli.flow_cli import FlowCLI
from ff_core.data.datamodule import FlowDataModule
from ff_core.module import FlowModule

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "sd3" / "sft_tiny.yaml"


def cli(tiny_sd3, shapes_dir, root, *extra: str) -> FlowCLI:
    return FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(RECIPE), "--model.pretrained_model_name_or_path", str(tiny_sd3),
        "--data.datasets", json.dumps([{"name": "shapes", "dataset_dir": str(shapes_dir)}]),
        "--trainer.max_steps", "3", "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
        "--trainer.enable_checkpointing", "false", "--trainer.default_root_dir", str(root), *extra])  # fmt: skip


def test_lightnings_default_bar_is_swapped(tiny_sd3, shapes_dir, tmp_path):
    run = cli(tiny_sd3, shapes_dir, tmp_path, "--trainer.callbacks", "[]")
    assert isinstance(run.trainer.progress_bar_callback, (StepRichProgressBar, StepTQDMProgressBar))


def test_the_tqdm_bar_counts_steps_out_of_max_steps(tiny_sd3, shapes_dir, tmp_path, capsys):
    tqdm = {"class_path": "lightning.pytorch.callbacks.TQDMProgressBar", "init_args": {"leave": True}}
    run = cli(tiny_sd3, shapes_dir, tmp_path, "--trainer.callbacks", json.dumps([tqdm]))
    assert type(run.trainer.progress_bar_callback) is StepTQDMProgressBar
    run.trainer.fit(run.model, run.datamodule)
    out = capsys.readouterr().out  # Lightning's tqdm bars write to stdout
    assert "step=3/3" in out and "step=1/3" not in out.split("step=3/3")[-1]


def test_a_rich_bar_keeps_its_settings_and_shows_no_negative_epoch_total(tiny_sd3, shapes_dir, tmp_path):
    rich = {"class_path": "lightning.pytorch.callbacks.RichProgressBar", "init_args": {"leave": True,
                                                                                       "refresh_rate": 7}}
    run = cli(tiny_sd3, shapes_dir, tmp_path, "--trainer.callbacks", json.dumps([rich]))
    bar = run.trainer.progress_bar_callback
    assert type(bar) is StepRichProgressBar and (bar.refresh_rate, bar._leave) == (7, True)
    assert bar in run.trainer.callbacks and sum(isinstance(c, RichProgressBar) for c in run.trainer.callbacks) == 1
    bar.setup(run.trainer, run.model, "fit")
    assert bar._get_train_description(4).strip() == "Epoch 4"  # Lightning's: "Epoch 4/-2"
    run.trainer.fit_loop.max_epochs = 6  # a run with an epoch limit keeps its total
    assert bar._get_train_description(4).strip() == "Epoch 4/5"
