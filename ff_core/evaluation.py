"""Evaluation of a :class:`~ff_core.module.FlowModule`: how samples are generated (:class:`SamplingConfig`,
``model.sampling``), the checks of those settings against the adapter before any weight loads, and the validation,
test and predict steps that sample the evaluation prompts and score them with ``model.eval_rewards``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from ff_core.errors import ConfigError
from ff_core.objectives.flow_matching import prepare_batch_condition
from ff_core.objectives.rewards import Rewards
from ff_core.plugins import takes_argument
from ff_core.rewards import RewardBatch
from ff_core.sampling import check_guidance, guides
from ff_core.sampling.schedulers import check_sampling_scheduler

if TYPE_CHECKING:
    from ff_core.adapter import Adapter


@dataclass
class SamplingConfig:
    """How validation samples are generated.

    Attributes:
        num_steps: Euler steps from noise to image.
        guidance_scale: classifier-free guidance scale (1 disables CFG): one for every latent component, or one per
            component (``{video: 3.0, audio: 7.0}``: LTX-2's pipeline guides its streams apart; each must be named).
        guidance_rescale: guidance rescale (diffusers' ``guidance_rescale``, in [0, 1]; 0: off), one or per component
            like ``guidance_scale``: the guided x0 prediction pulled towards the conditional one's standard deviation
            (:func:`ff_core.sampling.guided_velocity`).
        seed: base seed; batch ``i`` of a validation run uses ``seed + i`` so samples are comparable.
        shift: noise-schedule shift of the sampling sigmas; ``None`` (default) keeps the checkpoint scheduler's.
        embedded_guidance: distilled-guidance scale a guidance-embedded denoiser is conditioned on (FLUX.1-dev's
            guidance embedding), independent of CFG's ``guidance_scale``; ``None`` (default): the adapter's. An error
            for a checkpoint without a guidance embedding.
        guidance_scale_2: the CFG scale of the steps a two-expert checkpoint's low-noise expert predicts (Wan2.2
            A14B's ``transformer_2``, below ``boundary_ratio``; ``WanPipeline``'s ``guidance_scale_2``; T2V-A14B's
            recommendation: ``guidance_scale: 4.0``, ``guidance_scale_2: 3.0``); ``None`` (default):
            ``guidance_scale`` on every step. An error for a checkpoint with one denoiser.
        scheduler: ``checkpoint`` (default): sample with the checkpoint's own scheduler where it is not Euler
            (released Wan checkpoints' ``UniPCMultistepScheduler``), so samples equal the family pipeline's default
            output for the seed (:mod:`ff_core.sampling.schedulers`); checkpoints with an Euler scheduler sample as
            with ``euler``. ``euler``: ff's Euler steps at the scheduler's shift, whatever the checkpoint ships.
    """

    num_steps: int = 20
    guidance_scale: float | dict[str, float] = 1.0
    seed: int = 0
    shift: float | None = None
    embedded_guidance: float | None = None
    guidance_rescale: float | dict[str, float] = 0.0
    guidance_scale_2: float | None = None
    scheduler: Literal["checkpoint", "euler"] = "checkpoint"

    def __post_init__(self) -> None:
        check_guidance("model.sampling.guidance_scale", self.guidance_scale)
        if self.guidance_scale_2 is not None:
            check_guidance("model.sampling.guidance_scale_2", self.guidance_scale_2)
        check_sampling_scheduler(self.scheduler)
        check_guidance("model.sampling.guidance_rescale", self.guidance_rescale, high=1.0)
        if self.shift is not None and self.shift <= 0:
            raise ValueError(f"model.sampling.shift must be > 0 (or null for the scheduler's), got {self.shift}")


class Evaluation:
    """The evaluation half of :class:`~ff_core.module.FlowModule` (a mixin: it reads the module's ``sampling``,
    ``objective``, ``adapter``, ``adapter_cls``, ``eval_rewards`` and ``io_contract``). Validation and test
    generate from the evaluation prompts and score the samples; ``ff predict`` generates only."""

    def _build_eval_rewards(self) -> Rewards | None:
        key = "model.eval_rewards"
        specs = self.eval_rewards
        if specs is None:
            specs, key = self.objective.default_eval_rewards(), "model.objective (its default eval rewards)"
        if not specs:
            return None
        rewards = specs if isinstance(specs, Rewards) else Rewards(specs, config_key=key)
        rewards.check_outputs([str(t) for t in self.io_contract.output_types], self.adapter_cls.name)
        return rewards

    def _check_guidance(self) -> None:
        """A contract without classifier-free guidance (``negative_prompt: rejected``, MiniMax H3: a
        guidance-distilled checkpoint) samples with one forward per step: a ``guidance_scale`` other than 1 would ask
        for a second, unconditional forward the checkpoint has no branch for. Refused before any weight loads, naming
        the key (spec dataset-guide, "MiniMax H3 datasets": training and evaluation keep ``guidance_scale: 1.0``)."""
        keys = {"model.sampling.guidance_scale": self.sampling.guidance_scale,
                "model.objective.init_args.guidance_scale": getattr(self.objective, "guidance_scale", 1.0)}
        guided = {key: value for key, value in keys.items() if guides(value)}  # one scale, or one per component
        if not guided or self.io_contract.uses_cfg:  # the contract is read only when CFG is asked for
            return
        key, value = next(iter(guided.items()))
        raise ConfigError(key, f"{value}, but adapter {self.adapter_cls.name!r} has no classifier-free guidance (its "
                               "contract rejects negative prompts); keep it 1.0")  # fmt: skip

    def _check_guidance_rescale(self) -> None:
        """A ``guidance_rescale`` the adapter's ``sample`` cannot take (an override without it or ``**kwargs``) is
        refused before any weight loads, naming the key, rather than as a TypeError at the first validation."""
        if not self._rescale_kwargs():
            return
        if takes_argument(self.adapter_cls.sample, "guidance_rescale"):
            return
        raise ConfigError("model.sampling.guidance_rescale", f"{self.sampling.guidance_rescale}, but adapter "
                          f"{self.adapter_cls.name!r} overrides sample() without a guidance_rescale argument; keep it "
                          "0.0")  # fmt: skip

    def _check_sampler_kwargs(self) -> None:
        """A ``guidance_scale_2`` or ``scheduler`` the adapter's ``sample`` cannot take (an override without the
        argument or ``**kwargs``) is refused before any weight loads, naming the key."""
        for name, value in self._sampler_kwargs().items():
            if not takes_argument(self.adapter_cls.sample, name):
                raise ConfigError(f"model.sampling.{name}", f"{value!r}, but adapter {self.adapter_cls.name!r} "
                                  f"overrides sample() without a {name} argument; leave it unset")  # fmt: skip

    def _check_guidance_scale_2(self, adapter: Adapter) -> None:
        """``guidance_scale_2`` guides a low-noise expert's steps: refused, naming the key, as soon as the loaded
        checkpoint turns out to have one denoiser (:meth:`~ff_core.adapter.Adapter.uses_second_expert`)."""
        keys = {"model.sampling.guidance_scale_2": self.sampling.guidance_scale_2,
                "model.objective.init_args.guidance_scale_2": getattr(self.objective, "guidance_scale_2", None)}
        for key, value in keys.items():
            if value is not None and adapter.uses_second_expert(1.0) is None:
                raise ConfigError(key, f"{value} is set, but the {adapter.name!r} checkpoint "
                                       f"{self.pretrained_model_name_or_path} has one denoiser (no low-noise expert); "
                                       "leave it unset")  # fmt: skip

    def _check_embedded_guidance(self, adapter: Adapter) -> None:
        """A distilled-guidance scale asked of a checkpoint without a guidance embedding would be ignored: refuse it
        as soon as the checkpoint is known, naming the key (docs/plugins.md, "Sampling seams")."""
        keys = {"model.sampling.embedded_guidance": self.sampling.embedded_guidance,
                "model.objective.embedded_guidance": getattr(self.objective, "embedded_guidance", None)}
        for key, value in keys.items():
            if value is not None and adapter.embedded_guidance is None:
                raise ConfigError(key, f"{value} is set, but the {adapter.name!r} checkpoint "
                                       f"{self.pretrained_model_name_or_path} has no guidance embedding; "
                                       "leave it unset")  # fmt: skip

    def _rescale_kwargs(self) -> dict[str, Any]:
        """``guidance_rescale=`` for ``adapter.sample`` only when it rescales: an adapter written against an
        interface before it (1.1 - 1.3) may override ``sample`` without that argument (or ``**kwargs``)."""
        rescale = self.sampling.guidance_rescale
        values = rescale.values() if isinstance(rescale, dict) else [rescale]
        return {"guidance_rescale": rescale} if any(float(v) for v in values) else {}

    def _sampler_kwargs(self) -> dict[str, Any]:
        """``guidance_scale_2=`` and ``scheduler=`` for ``adapter.sample`` only where they differ from the defaults: an
        adapter written against an interface before them may override ``sample`` without those arguments."""
        out: dict[str, Any] = {}
        if self.sampling.guidance_scale_2 is not None:
            out["guidance_scale_2"] = self.sampling.guidance_scale_2
        if self.sampling.scheduler != "checkpoint":
            out["scheduler"] = self.sampling.scheduler
        return out

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        return self.evaluate(batch, batch_idx, "val")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        return self.evaluate(batch, batch_idx, "test")

    def evaluate(self, batch: dict[str, Any], batch_idx: int, prefix: str) -> dict[str, Any]:
        """:meth:`generate`, then score the samples with the evaluation rewards: logs ``<prefix>/reward/<label>``
        and ``<prefix>/reward`` (means over the evaluation set, reduced across ranks) and adds ``rewards`` (per
        label, one float per sample) and ``reward`` (weighted totals) to the outputs the callbacks see."""
        out = self.generate(batch, batch_idx)
        rewards = self.eval_reward_set
        if not rewards:
            return out
        if self._rewards_device != self.device:
            rewards.to(self.device)
            self._rewards_device = self.device
        scores = rewards(self.reward_batch(out))
        size = len(out["prompt"])
        # Scores come back on the CPU; the reduction across ranks (NCCL) needs them on the module's device.
        for key, values in scores.per_reward.items():
            self.log(f"{prefix}/reward/{key}", values.mean().to(self.device), batch_size=size, sync_dist=True)
        self.log(f"{prefix}/reward", scores.total.mean().to(self.device), prog_bar=True, batch_size=size,
                 sync_dist=True)  # fmt: skip
        out["rewards"] = {key: values.tolist() for key, values in scores.per_reward.items()}
        out["reward"] = scores.total.tolist()
        return out

    def reward_batch(self, out: dict[str, Any]) -> RewardBatch:
        """The :class:`~ff_core.rewards.RewardBatch` of :meth:`generate`'s output; samples of one prompt form a
        group (for groupwise rewards)."""
        prompts = list(out["prompt"])
        first = {p: i for i, p in reversed(list(enumerate(prompts)))}
        return RewardBatch(media=out["media"], prompts=prompts, metadata=list(out["metadata"]),
                           groups=torch.tensor([first[p] for p in prompts]), output_types=out["output_types"],
                           rates=out["rates"])

    def predict_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> dict[str, Any]:
        return self.generate(batch, batch_idx)

    def generate(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        """Sample media for a batch of evaluation prompts: ``{"index", "prompt", "media", "metadata",
        "output_types", "rates"}`` (media per sample, in the contract's output order; each row's reward metadata,
        for whatever scores the samples; the output kinds; their fps / sample rate where the adapter states them in
        an ``output_rates`` attribute, else ``None``). Batch ``i`` is seeded with ``sampling.seed + i``, so runs
        compare: its condition's own draws too (a noised condition prefix, MiniMax H3 FL2VA / Ref2VA), taken from the
        same generator before the noise, as the pipelines draw them, never from the global RNG."""
        generator = torch.Generator().manual_seed(self.sampling.seed + batch_idx)
        condition = prepare_batch_condition(self.adapter, batch["condition"], generator)
        state = self.adapter.sample(
            condition,
            num_steps=self.sampling.num_steps,
            guidance_scale=self.sampling.guidance_scale,
            generator=generator,
            shift=self.sampling.shift,
            embedded_guidance=self.sampling.embedded_guidance,
            **self._rescale_kwargs(),
            **self._sampler_kwargs(),
        )
        types = self.output_types
        rates = tuple(getattr(self.adapter, "output_rates", None) or (None,) * len(types))
        return {"index": batch["index"].tolist(), "prompt": batch["prompt"], "media": self.adapter.decode(state),
                "metadata": batch.get("metadata", [{} for _ in batch["prompt"]]), "output_types": types,
                "rates": rates}
