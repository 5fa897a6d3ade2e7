"""What every objective returns, and the interface FlowModule calls."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from ff_core.errors import ConfigError

if TYPE_CHECKING:
    from ff_core.adapter import Adapter
    from ff_core.objectives.rewards import Rewards
    from ff_core.rewards import RewardSpec


@dataclass
class LossOutput:
    """A batch loss with its per-sample terms and scalar diagnostics to log.

    Attributes:
        loss: the scalar that is back-propagated (mean of ``per_sample``).
        per_sample: one loss per sample, shape (B,).
        metrics: detached scalars, logged as ``train/<name>``.
        sigma: the noise levels drawn for the batch, detached, shape (draws, B) (``None`` if the objective has none);
            ``FlowModule.training_step`` returns them so callbacks (``SampleLog``) can record them.
    """

    loss: Tensor
    per_sample: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)
    sigma: Tensor | None = None


class Objective:
    """A training objective. ``trainer_type`` is the dataset supervision it consumes (spec: train.trainer_type).

    Subclasses implement :meth:`training_loss`; they see only the :class:`~ff_core.adapter.Adapter` stages,
    never a model family.
    """

    trainer_type: ClassVar[str]
    automatic_optimization: ClassVar[bool] = True
    """``False``: the objective optimises itself (GRPO's rollout + several optimiser steps per batch): FlowModule
    turns Lightning's manual optimisation on and calls :meth:`training_step` instead of :meth:`training_loss`."""
    sharding_strategies: ClassVar[frozenset[str]] = frozenset({"fsdp2", "fsdp1", "deepspeed"})
    """The sharding strategies the objective trains under (:func:`ff_core.sharding.strategy_kind`: ``fsdp2``
    Lightning's ``ModelParallelStrategy``, ``fsdp1`` its ``FSDPStrategy``, ``deepspeed`` its ``DeepSpeedStrategy``);
    ``FlowModule`` refuses any other before any weight loads (docs/scaling.md). One device and DDP always run."""

    def check_run(self, dp_world_size: int) -> None:
        """Check the objective's settings against the run before any weights load (``FlowModule.setup`` calls it when
        fitting); raise a ``ConfigError`` naming the key.

        Args:
            dp_world_size: data-parallel ranks of the run.
        """

    curve_metric: ClassVar[str] = "loss"
    """The training metric (logged as ``train/<name>``) ``LossCurve`` draws by default."""
    frozen_components: frozenset[str] = frozenset()
    """Latent components left out of the loss: the ``model.frozen_components`` whose weight the objective's
    ``component_weights`` leave unset (set by :meth:`freeze_components`)."""
    supports_frozen_components: ClassVar[bool] = False
    """``True``: the objective can leave :attr:`frozen_components` out of its loss (SFT, offline DPO and GRPO do)."""

    def freeze_components(self, names: Collection[str]) -> None:
        """``FlowModule`` calls it for ``model.frozen_components``, before any weight loads. Freezing is about
        parameters (``FlowModule`` keeps their branch of the denoiser frozen); the loss follows ``component_weights``
        (docs/config.md): set in the config, they are honoured as written, frozen components included (``audio: 0``
        leaves the audio error out; ``audio: 1`` keeps it, and it then trains the parameters that still train through
        the cross-modal modules: LTX-2's ``video_to_audio_attn`` reads the video stream's hidden states); unset, the
        frozen components are left out of the loss (:attr:`frozen_components`). An objective that cannot leave one out
        (``supports_frozen_components`` false) refuses with a ``ConfigError``."""
        if names and not self.supports_frozen_components:
            raise ConfigError("model.frozen_components", f"{type(self).__name__} cannot leave a latent component out "
                              "of its loss; use SFT, offline DPO or GRPO, or train every component")  # fmt: skip
        weights = getattr(self, "component_weights", None)
        self.frozen_components = frozenset(names) if weights is None else frozenset()

    def configure_model(self, adapter: Adapter, lora: bool) -> nn.Module | None:
        """Prepare what the objective needs from the loaded adapter (a frozen reference policy, say).

        ``FlowModule.configure_model`` calls it once, after the trained parameters are chosen (LoRA applied or the
        denoiser unfrozen) and before any step changes a weight. A returned module is held by the FlowModule as its
        submodule ``objective_modules``: it follows the module to its device and is never checkpointed (checkpoints
        hold what trains).

        Args:
            adapter: the loaded adapter.
            lora: the denoiser trains peft LoRA layers (``model.lora`` is set), not all its weights.
        """
        return None

    def training_rewards(self) -> Rewards | None:
        """The rewards this objective trains on (online objectives such as GRPO), or ``None``.

        ``FlowModule.setup`` checks, before any weight loads, that every training record carries the metadata fields
        they read (:meth:`ff_core.objectives.rewards.Rewards.check_records`).
        """
        return None

    def default_eval_rewards(self) -> Rewards | list[RewardSpec] | None:
        """The rewards validation computes when the recipe sets no ``model.eval_rewards``: specs to build, or a built
        :class:`~ff_core.objectives.rewards.Rewards` to share (an online objective returns its training rewards, so a
        model-based reward is loaded once); ``None``: none."""
        return None

    def checkpoint_state(self) -> dict[str, Any] | None:
        """State the objective keeps outside the module's parameters that a resumed run needs (DiffusionNFT's old
        policy), saved in each checkpoint under ``ff_objective_state``; ``None``: nothing."""
        return None

    def load_checkpoint_state(self, state: dict[str, Any] | None) -> None:
        """Take back what :meth:`checkpoint_state` saved (``None``: the checkpoint holds none)."""

    def training_step(self, module: Any, batch: dict[str, Any], generator: torch.Generator) -> None:
        """One manual-optimisation step (objectives with ``automatic_optimization = False``): the objective calls
        ``module.optimizers()``, ``module.manual_backward``, ``module.clip_gradients`` and ``module.log`` itself.

        Args:
            module: the FlowModule.
            batch: the rank's batch.
            generator: the rank's noise generator of this step (``FlowModule.noise_generator``).
        """
        raise NotImplementedError(f"{type(self).__name__} optimises automatically: implement training_loss")

    def training_loss(
        self,
        adapter: Adapter,
        batch: dict[str, Any],
        generator: torch.Generator | None = None,
        expert_generator: torch.Generator | None = None,
    ) -> LossOutput:
        """The loss of one micro-batch; every random draw (noise levels, noise) comes from ``generator``, a CPU
        generator ``FlowModule`` seeds per data-parallel rank and micro-batch (``None``: the global generator).
        ``expert_generator`` (passed only with routed experts under ``expert_choice: per_micro_batch``): a generator
        seeded alike on every rank, which picks the expert of each draw
        (:func:`~ff_core.objectives.flow_matching.monte_carlo_draws`)."""
        raise NotImplementedError
