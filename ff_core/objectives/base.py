"""What every objective returns, and the interface FlowModule calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor

if TYPE_CHECKING:
    from ff_core.adapter import Adapter


@dataclass
class LossOutput:
    """A batch loss with its per-sample terms and scalar diagnostics to log.

    Attributes:
        loss: the scalar that is back-propagated (mean of ``per_sample``).
        per_sample: one loss per sample, shape (B,).
        metrics: detached scalars, logged as ``train/<name>``.
    """

    loss: Tensor
    per_sample: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


class Objective:
    """A training objective. ``trainer_type`` is the dataset supervision it consumes (spec: train.trainer_type).

    Subclasses implement :meth:`training_loss`; they see only the :class:`~ff_core.adapter.Adapter` stages,
    never a model family.
    """

    trainer_type: ClassVar[str]

    def training_loss(self, adapter: Adapter, batch: dict[str, Any]) -> LossOutput:
        raise NotImplementedError
