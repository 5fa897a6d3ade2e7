"""Lightning's progress bars, counting optimiser steps on step-limited runs.

Most ff recipes stop at ``trainer.max_steps`` and leave ``max_epochs`` unset, which Lightning turns into ``-1``: its
bars then count epochs only, and the Rich one prints ``Epoch 4/-2``. These subclasses add ``step=12/100`` (optimiser
steps done out of ``max_steps``) to the metrics both bars show, and drop the epoch total when there is none. ``ff
fit`` swaps them in for Lightning's own bars (:func:`with_step_counts`), keeping their settings; a recipe may also
name them (``ff_core.callbacks.StepTQDMProgressBar``, ``StepRichProgressBar``).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.trainer.states import TrainerFn


def _step_count(trainer: L.Trainer) -> str | None:
    """``"12/100"`` on a run limited by ``max_steps`` while it fits (validation inside ``fit`` included: the train
    bar is refreshed then too), else ``None``."""
    if trainer.max_steps is None or trainer.max_steps < 0 or trainer.state.fn != TrainerFn.FITTING:
        return None
    return f"{trainer.global_step}/{trainer.max_steps}"


class _StepMetrics:
    """``step=<done>/<max_steps>`` first among a Lightning bar's metrics on step-limited runs (mixed in before it)."""

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, int | str | float]:
        metrics = super().get_metrics(trainer, pl_module)  # type: ignore[misc]
        step = _step_count(trainer)
        return metrics if step is None else {"step": step, **metrics}


class StepTQDMProgressBar(_StepMetrics, TQDMProgressBar):
    """Lightning's tqdm bar with ``step=<done>/<max_steps>`` among its metrics on step-limited runs."""


class StepRichProgressBar(_StepMetrics, RichProgressBar):
    """Lightning's Rich bar with ``step=<done>/<max_steps>`` among its metrics on step-limited runs, and ``Epoch N``
    without an epoch total when ``max_epochs`` sets none (Lightning's prints ``Epoch N/-2``)."""

    def _get_train_description(self, current_epoch: int) -> str:
        description = super()._get_train_description(current_epoch)
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs < 1:  # unlimited: Lightning appends "/{max_epochs - 1}"
            description = description.replace(f"/{max_epochs - 1}", "", 1)
        return description


def with_step_counts(trainer: L.Trainer) -> None:
    """Replace Lightning's own progress bar in ``trainer.callbacks`` (exactly ``TQDMProgressBar`` or
    ``RichProgressBar``, the default or one a recipe names) by its step-counting subclass with the same settings;
    any other bar is left alone."""
    bar: Any = trainer.progress_bar_callback
    if type(bar) is TQDMProgressBar:
        new: Any = StepTQDMProgressBar(refresh_rate=bar.refresh_rate, process_position=bar.process_position,
                                       leave=bar._leave)  # fmt: skip
    elif type(bar) is RichProgressBar:
        new = StepRichProgressBar(refresh_rate=bar.refresh_rate, leave=bar._leave, theme=bar.theme,
                                  console_kwargs=bar._console_kwargs)  # fmt: skip
    else:
        return
    trainer.callbacks[trainer.callbacks.index(bar)] = new
