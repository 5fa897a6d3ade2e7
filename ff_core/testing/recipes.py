"""Run a recipe as ``ff fit`` does, cut to a CPU smoke test (plugin fit tests: ff-wan, ff-ltx2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ff_core.cli.flow_cli import FlowCLI
from ff_core.data.datamodule import FlowDataModule
from ff_core.module import FlowModule


def fit_tiny(config: str | Path, pretrained: str | Path, datasets: list[dict[str, Any]], root: str | Path,
             *extra: str) -> FlowCLI:  # fmt: skip
    """Fit ``config`` on ``pretrained`` (a tiny checkpoint) and ``datasets`` (``data.datasets`` entries) for two
    steps, validating and sampling (two steps) at the second, logging every step under ``root``, loading in-process.

    Args:
        config: the recipe YAML.
        pretrained: ``model.pretrained_model_name_or_path``.
        datasets: ``data.datasets``, passed as JSON.
        root: ``trainer.default_root_dir``.
        extra: further command-line overrides, appended last (so they win).
    """
    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(config), "--model.pretrained_model_name_or_path", str(pretrained),
        "--data.datasets", json.dumps(datasets), "--model.sampling.num_steps", "2", "--trainer.max_steps", "2",
        "--trainer.val_check_interval", "2", "--trainer.log_every_n_steps", "1", "--data.num_workers", "0",
        "--trainer.default_root_dir", str(root), *extra])  # fmt: skip
    cli.trainer.fit(cli.model, cli.datamodule)
    return cli
