"""FlowCLI: LightningCLI over FlowModule, FlowDataModule and Lightning's Trainer (``ff fit|validate|test|predict``).

Every typed ``__init__`` argument of the three is a config key (``ff fit --help``).
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from ff_core.callbacks.progress import with_step_counts
from ff_core.ckpt_path import check_ckpt_path
from ff_core.data.datamodule import FlowDataModule
from ff_core.errors import ConfigError, ResumeError
from ff_core.module import FlowModule
from ff_core.run_folder import claim_run_folder


class FlowCLI(LightningCLI):
    """LightningCLI with ff's late bindings (STYLE 14: links, never globals)."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The datamodule validates records against the adapter's contract before weights load, and picks
        # the supervision it requires from the objective.
        parser.link_arguments("model.adapter", "data.adapter")
        # The checkpoint decides the contract of families whose variants differ (Adapter.resolve_contract).
        parser.link_arguments("model.pretrained_model_name_or_path", "data.pretrained_model_name_or_path")
        parser.link_arguments("model.adapter_kwargs", "data.adapter_kwargs")
        parser.link_arguments(
            "model", "data.trainer_type", compute_fn=lambda m: m.objective.trainer_type, apply_on="instantiate"
        )
        # GRPO: the data module deals each step's prompt groups (P prompts x K samples) over the ranks.
        parser.link_arguments(
            "model", "data.grouping", compute_fn=lambda m: getattr(m.objective, "grouping", None),
            apply_on="instantiate",
        )

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Lightning's parsing, then ``--ckpt_path`` checked (:func:`ff_core.ckpt_path.check_ckpt_path`) before
        LightningCLI reads the checkpoint's hyperparameters from it."""
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        if subcommand:
            check_ckpt_path(self.config[subcommand].get("ckpt_path"))

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """Lightning's trainer, its progress bar counting optimiser steps on step-limited runs
        (:mod:`ff_core.callbacks.progress`)."""
        trainer = super().instantiate_trainer(**kwargs)
        with_step_counts(trainer)
        return trainer

    def fit(self, **kwargs: Any) -> None:
        """``trainer.fit`` in a run folder no other live run holds (:mod:`ff_core.run_folder`); a checkpoint whose
        data state cannot continue this run's data is refused as one line (``ConfigError`` on ``ckpt_path``)."""
        lock = claim_run_folder(self.trainer)
        try:
            self.trainer.fit(**kwargs)
        except ResumeError as exc:
            reason = str(exc).split("load_state_dict: ", 1)[-1]
            raise ConfigError("ckpt_path", f"{kwargs.get('ckpt_path')}: {reason}") from None
        finally:
            lock.release()


# Lightning warnings that are expected in every ff run, silenced so real ones stand out:
# - frozen components (VAE, text encoders) stay in eval mode on purpose while the denoiser trains;
# - the dataflow loader is an IterableDataset with an exact __len__: it shards across workers itself.
_EXPECTED_WARNINGS = (r"Found \d+ module\(s\) in eval mode", r"Your `IterableDataset` has `__len__` defined")


def run(args: list[str] | None) -> None:
    """``ff fit ...``: ``args=None`` reads ``sys.argv`` (the console script)."""
    for message in _EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    # prog: `ff fit --help` says `ff`, also when started as `python -m ff_core.cli`.
    FlowCLI(FlowModule, FlowDataModule, args=args, save_config_kwargs={"overwrite": True}, parser_kwargs={"prog": "ff"})
