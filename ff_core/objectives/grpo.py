"""Flow-GRPO (``trainer_type: grpo``): online RL of a flow model on prompt rows, with rewards on its own samples.

Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL" (arXiv 2505.05470); the loss maths is in
:mod:`ff_core.objectives.grpo_loss`, the sampler in :mod:`ff_core.sampling`. One training step of the Lightning loop
is one GRPO iteration over the rank's share of the step's prompt groups (``P`` prompts x ``K`` samples over ``W``
ranks, :class:`~ff_core.data.dataflow.GroupedDistributor`):

1. **Rollout** (no_grad), in micro-batches of ``micro_batch_size``: ``num_steps`` sampler steps, SDE steps on the
   sampler's window (stored as transitions), ODE elsewhere; noise from a generator seeded by (noise seed, rank,
   optimiser step), so runs and resumes repeat.
2. **Rewards** on the decoded samples: pointwise ones on each rank, then every rank's scores (and, for groupwise
   rewards, samples) are gathered; advantages are normalised per group (float64; a tied group's are exactly 0) and
   clipped; with ``filter_zero_std`` the samples of groups whose rewards are all equal leave the update.
3. **Update**, ``num_inner_epochs`` times: the rank's micro-batches are split into ``mini_batches`` optimiser steps;
   in each, every stored transition of every micro-batch is replayed with gradient (the same micro-batches as the
   rollout, so the first ratio is exactly 1), its clipped surrogate (plus ``kl_beta`` x KL to the reference)
   back-propagated, gradients accumulated over transitions and micro-batches (Flow-GRPO's accumulation over trained
   timesteps and samples), clipped to ``max_grad_norm``, then one optimiser and scheduler step (an optimiser step
   whose samples were all filtered out leaves the weights and the optimiser state alone).

Rollout and replay run the networks in eval mode (no dropout), so the replayed log-prob of an unchanged policy is
bitwise the rollout's: SD3-family transformers have no dropout, so nothing is lost there; a LoRA dropout is off.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn

from ff_core.errors import ConfigError
from ff_core.groups import check_grouping
from ff_core.objectives.base import LossOutput, Objective
from ff_core.objectives.flow_matching import (
    CONDITION_STREAM,
    check_component_weights,
    child_generator,
    prepare_batch_condition,
    resolve_component_weights,
)
from ff_core.objectives.grpo_loss import clipped_policy_loss, group_advantages, tied_groups, zero_std_ratio
from ff_core.objectives.reference import ReferenceModel
from ff_core.objectives.rewards import Rewards
from ff_core.rewards.base import RewardBatch
from ff_core.sampling import (
    StochasticSampling,
    Trajectory,
    check_guidance,
    component_mean,
    guided_conditions,
    guided_velocity,
    sample_sde,
    step_log_prob,
)

if TYPE_CHECKING:
    import lightning as L

    from ff_core.adapter import Adapter, Condition

log = logging.getLogger(__name__)
GUIDANCE_KEY = "model.objective.init_args"  # where the guidance keys sit in a recipe


@dataclass
class Rollout:
    """One rollout micro-batch: its rows, prepared conditions, trajectory and advantages.

    Attributes:
        rows: ``slice`` of the rank's batch.
        condition: the prepared condition (``adapter.prepare_condition``).
        negative: its CFG branch (``None`` without CFG).
        trajectory: the sampled trajectory with its stored SDE transitions.
        advantages: per sample, filled once the rewards are gathered, shape (b,).
        keep: per sample, whether it enters the update (``filter_zero_std``: not in a tied group), bool (b,);
            ``None``: every sample.
        kept_anywhere: whether any rank keeps a sample of its micro-batch at this position (the ranks' micro-batches
            are cut alike): a micro-batch no rank keeps is replayed by none, so the ranks' backwards stay in step.
    """

    rows: slice
    condition: Condition
    negative: Condition | None
    trajectory: Trajectory
    advantages: Tensor | None = None
    keep: Tensor | None = None
    kept_anywhere: bool = True

    @property
    def kept(self) -> int:
        """How many of the micro-batch's samples enter the update."""
        return self.rows.stop - self.rows.start if self.keep is None else int(self.keep.sum())


@dataclass
class UpdateStats:
    """Per-(sample, transition) diagnostics of one iteration's updates, concatenated."""

    ratio: list[Tensor] = field(default_factory=list)
    clipped_low: list[Tensor] = field(default_factory=list)
    clipped_high: list[Tensor] = field(default_factory=list)
    policy_loss: list[Tensor] = field(default_factory=list)
    kl: list[Tensor] = field(default_factory=list)
    approx_kl: list[Tensor] = field(default_factory=list)
    first_ratio: Tensor | None = None

    def means(self) -> dict[str, Tensor]:
        out = {name: torch.cat(values).mean() for name, values in vars(self).items()
               if isinstance(values, list) and values}  # fmt: skip
        if self.first_ratio is not None:
            out["ratio_first_max_dev"] = (self.first_ratio - 1).abs().max()
        return out


class GRPOObjective(Objective):
    """Flow-GRPO on prompt rows (module docstring; maths and keys: docs/objectives.md, "GRPO").

    Args:
        rewards: the weighted rewards to maximise, each ``{name, weight, args, label}`` (a
            :class:`~ff_core.rewards.base.RewardSpec`; ``ff plugins`` lists the names). Plain mappings, not RewardSpec
            objects, in the signature: jsonargparse merges a list of dataclasses item by item, so a command-line
            ``rewards`` override would inherit the recipe's ``args``; a list of mappings is replaced whole.
        group_size: K, samples per prompt (a group; advantages compare them).
        prompts_per_step: P, prompts per step over all data-parallel ranks; every rank takes ``P*K/W`` samples.
        num_steps: sampler steps of a rollout.
        guidance_scale: classifier-free guidance of rollouts, replays and the KL term (1 disables it): one scale, or
            one per latent component (``{video: 2, audio: 4}``), as ``model.sampling.guidance_scale``.
        guidance_rescale: guidance rescale of rollouts, replays and the KL term (in [0, 1]; 0: off), one or per
            component, as ``model.sampling.guidance_rescale`` (:func:`~ff_core.sampling.guided_velocity`).
        guidance_scale_2: the CFG scale of the steps a two-expert checkpoint's low-noise expert predicts (Wan2.2 A14B's
            ``transformer_2``; ``WanPipeline``'s ``guidance_scale_2``), in rollouts, replays and the KL term alike;
            ``None``: ``guidance_scale`` on every step. Refused for a checkpoint with one denoiser.
        embedded_guidance: distilled-guidance scale of rollouts and replays for a guidance-embedded denoiser
            (FLUX.1-dev), distinct from CFG; ``None``: the adapter's default.
        shift: noise-schedule shift of the rollout sigmas (``None``: the checkpoint scheduler's).
        sampler: the stochastic steps (kind, eta, SDE window / random subset).
        micro_batch_size: samples per rollout and replay forward (``None``: the rank's whole share at once).
        num_inner_epochs: passes of updates over one rollout (PPO epochs; Flow-GRPO: 1).
        mini_batches: optimiser steps per inner epoch; the rank's micro-batches are split evenly among them.
        clip_range: PPO ratio clip ``epsilon`` (Flow-GRPO: 1e-4).
        adv_clip_max: advantages are clipped to ``[-adv_clip_max, adv_clip_max]`` (Flow-GRPO: 5).
        global_std: normalise advantages by the std of every reward of the step (over all ranks) instead of each
            group's: flow_grpo's ``sample.global_std``, true in its config/base.py and every SD3 / FLUX recipe, and
            Flow-Factory's default. ``False``: each group's own std (the Flow-GRPO paper's eq. 4, flow_grpo's Wan2.1
            recipe, ff's default before issue 23).
        filter_zero_std: leave the samples of groups whose rewards are all equal (zero std, advantage 0) out of the
            update, as flow_grpo does (scripts/train_sd3.py drops samples with zero advantage before training): the
            loss is the mean over the kept samples, and the KL term sees only them. ``False``: they stay in, with
            advantage 0 (their KL term and their share of the mean remain).
        kl_beta: weight of the KL penalty to the reference policy (0: none, no reference is kept).
        kl_on: ``mean`` (the Gaussian steps' means, scaled by ``kl_scale``) or ``velocity`` (``|v - v_ref|^2``).
        kl_scale: ``kl_on: mean``'s divisor. ``flow_grpo``: ``|mu - mu_ref|^2 / (2 s_sigma^2)``, ``s_sigma =
            eta sqrt(sigma / (1 - sigma))`` without ``sqrt(|dt|)`` (flow_grpo's SD3 / FLUX ``kl_loss``, so its
            ``beta`` values carry over; for ``cps`` its std, the exact KL). ``exact_gaussian``: the KL of the two
            Gaussian steps, ``|mu - mu_ref|^2 / (2 std^2)``, ``std = s_sigma sqrt(|dt|)`` (flow_grpo's Wan2.1
            script), ``1 / |dt|`` times ``flow_grpo``'s (3.7-25x on SD3.5's 10-step schedule).
        cfg_replay: the gradient of the guided velocity in replays (``guidance_scale != 1``). ``full``: through both
            branches, as flow_grpo's ``compute_log_prob`` and Flow-Factory. ``detached_uncond``: the unconditional
            branch a constant (run under no_grad): only the conditional branch trains, at ``guidance_scale`` times
            the rate, and its activations are not kept.
        max_grad_norm: clip the gradient norm before each optimiser step (``None``: no clipping). Lightning's
            ``trainer.gradient_clip_val`` does not apply to manual optimisation.
        reference_offload: full fine-tuning with ``kl_beta > 0``: keep the frozen reference in CPU memory.
        component_weights: how a step's log-probability (and the KL term) reduces over a multi-component latent state
            (video + audio), as SFT's and DPO's error does (:func:`~ff_core.sampling.component_mean`):
            ``sum_k w_k m_k``, unnormalised, ``m_k`` a component's mean log-density. ``None`` uses the adapter's
            ``default_component_weights`` (LTX-2: ``{video: 0.5, audio: 0.5}``; MiniMax H3: ``{video: 1, audio:
            1}``; ``None`` there too: every latent element of every component pooled).

    ``model.frozen_components`` leaves a component's log-density (and KL) out of the log-prob: its branch does not
    train, as its loss term leaves SFT and DPO; it is still sampled and decoded, so the rewards see it.
    """

    trainer_type = "grpo"
    supports_frozen_components = True
    automatic_optimization = False
    curve_metric = "reward_mean"  # it logs no single "loss": LossCurve draws the batch's mean reward
    # Under DDP it all-reduces its accumulated gradients itself (the wrapper's per-backward sync switched off); under
    # FSDP2 and DeepSpeed each backward's reduction does, every rank replaying every micro-batch (_gradient_sync).
    sharding_strategies = frozenset({"fsdp2", "deepspeed"})

    def __init__(
        self,
        rewards: list[dict[str, Any]],
        group_size: int = 8,
        prompts_per_step: int = 4,
        num_steps: int = 10,
        guidance_scale: float | dict[str, float] = 1.0,
        embedded_guidance: float | None = None,
        shift: float | None = None,
        sampler: StochasticSampling | None = None,
        micro_batch_size: int | None = None,
        num_inner_epochs: int = 1,
        mini_batches: int = 1,
        clip_range: float = 1e-4,
        adv_clip_max: float = 5.0,
        global_std: bool = True,
        kl_beta: float = 0.0,
        kl_on: Literal["mean", "velocity"] = "mean",
        kl_scale: Literal["flow_grpo", "exact_gaussian"] = "flow_grpo",
        filter_zero_std: bool = True,
        cfg_replay: Literal["full", "detached_uncond"] = "full",
        max_grad_norm: float | None = 1.0,
        reference_offload: bool = False,
        component_weights: dict[str, float] | None = None,
        guidance_rescale: float | dict[str, float] = 0.0,
        guidance_scale_2: float | None = None,
    ) -> None:
        for key, value in (("group_size", group_size), ("prompts_per_step", prompts_per_step),
                           ("num_steps", num_steps), ("num_inner_epochs", num_inner_epochs),
                           ("mini_batches", mini_batches), ("micro_batch_size", micro_batch_size or 1)):
            if value < 1:
                raise ValueError(f"model.objective.{key} must be >= 1, got {value}")
        for key, value in (("clip_range", clip_range), ("adv_clip_max", adv_clip_max)):
            if not value > 0:
                raise ValueError(f"model.objective.{key} must be > 0, got {value}")
        if kl_beta < 0:
            raise ValueError(f"model.objective.kl_beta must be >= 0, got {kl_beta}")
        for key, value, allowed in (("kl_on", kl_on, ("mean", "velocity")),
                                    ("kl_scale", kl_scale, ("flow_grpo", "exact_gaussian")),
                                    ("cfg_replay", cfg_replay, ("full", "detached_uncond"))):
            if value not in allowed:
                raise ValueError(f"model.objective.{key} must be one of {list(allowed)}, got {value!r}")
        if group_size < 2:  # one sample per group: every advantage is 0 and the policy never moves
            raise ValueError(f"model.objective.group_size must be >= 2 (advantages compare a prompt's samples), "
                             f"got {group_size}")  # fmt: skip
        if not rewards:
            raise ValueError("model.objective.rewards: GRPO needs at least one reward")
        self.rewards = Rewards(rewards, config_key="model.objective.rewards")
        self.group_size, self.prompts_per_step = group_size, prompts_per_step
        self.num_steps, self.shift = num_steps, shift
        # One guidance for rollout, replay and KL alike (the first ratio is exactly 1); component names are checked
        # against the adapter's latent_components before weights load (FlowModule, check_components).
        self.guidance_scale = check_guidance(f"{GUIDANCE_KEY}.guidance_scale", guidance_scale)
        self.guidance_rescale = check_guidance(f"{GUIDANCE_KEY}.guidance_rescale", guidance_rescale, high=1.0)
        self.guidance_scale_2 = None if guidance_scale_2 is None else float(
            check_guidance(f"{GUIDANCE_KEY}.guidance_scale_2", guidance_scale_2))  # fmt: skip
        self.embedded_guidance = embedded_guidance
        self.sampler = sampler or StochasticSampling()
        self.sampler.candidate_steps(num_steps)  # a window outside the schedule fails now
        self.micro_batch_size = micro_batch_size
        self.num_inner_epochs, self.mini_batches = num_inner_epochs, mini_batches
        self.clip_range, self.adv_clip_max, self.global_std = clip_range, adv_clip_max, global_std
        self.kl_beta, self.kl_on, self.kl_scale, self.max_grad_norm = kl_beta, kl_on, kl_scale, max_grad_norm
        self.filter_zero_std, self.cfg_replay = filter_zero_std, cfg_replay
        self.reference_offload = reference_offload
        self.component_weights = check_component_weights(component_weights)
        self.reference: ReferenceModel | None = None
        self._rewards_device: torch.device | None = None
        self._sync: Literal["none", "manual", "strategy"] = "none"  # set per step: _gradient_sync

    @property
    def grouping(self) -> tuple[int, int]:
        """``(prompts_per_step, group_size)``: what the data module needs to deal prompt groups (linked)."""
        return self.prompts_per_step, self.group_size

    def check_run(self, dp_world_size: int) -> None:
        """``mini_batches`` must not exceed the rollout micro-batches of a rank (``P * K / W`` samples in runs of
        ``micro_batch_size``): each optimiser step replays at least one micro-batch, and ``global_step`` counts
        ``num_inner_epochs * mini_batches`` per iteration."""
        per_rank = check_grouping(self.prompts_per_step, self.group_size, dp_world_size)
        micro_batches = math.ceil(per_rank / (self.micro_batch_size or per_rank))
        if self.mini_batches > micro_batches:
            raise ConfigError(
                "model.objective.mini_batches",
                f"{self.mini_batches} optimiser steps per pass, but each rank replays only {micro_batches} "
                f"micro-batch(es) ({per_rank} samples per rank in runs of model.objective.micro_batch_size="
                f"{self.micro_batch_size}); lower it or set a smaller micro_batch_size",
            )

    def configure_model(self, adapter: Adapter, lora: bool) -> nn.Module | None:
        if self.kl_beta > 0:
            self.reference = ReferenceModel(adapter, lora=lora, offload=self.reference_offload)
        return self.reference

    def training_rewards(self) -> Rewards:
        """The rewards maximised: ``FlowModule.setup`` refuses training rows lacking a metadata field they read."""
        return self.rewards

    def default_eval_rewards(self) -> Rewards:
        """Validation scores the training rewards (the same instances: a reward model loads once) unless the recipe
        sets ``model.eval_rewards``."""
        return self.rewards

    def reduction(self, adapter: Adapter) -> dict[str, Any]:
        """How per-element log-densities reduce over the latent components (rollout, replay and KL alike):
        ``component_weights`` (or the adapter's default) and ``frozen_components``, for
        :func:`~ff_core.sampling.component_mean`."""
        return {"component_weights": resolve_component_weights(adapter, self.component_weights),
                "frozen_components": self.frozen_components}

    def training_loss(self, adapter, batch, generator=None) -> LossOutput:
        raise RuntimeError("GRPO optimises manually: FlowModule.training_step calls GRPOObjective.training_step")

    # -- one iteration ---------------------------------------------------------------------------------------------
    def training_step(self, module: L.LightningModule, batch: dict[str, Any], generator: torch.Generator) -> None:
        """Rollout, rewards, advantages and ``num_inner_epochs * mini_batches`` optimiser steps (module docstring).

        Args:
            module: the FlowModule (optimiser, ``manual_backward``, ``clip_gradients``, logging, ``all_gather``).
            batch: the rank's share of the step's (prompt, sample) pairs, with their ``group`` ids.
            generator: the rollout noise generator of this rank and step.
        """
        adapter = module.adapter
        self._sync = _gradient_sync(module)
        if self._rewards_device != module.device:  # reward models score where the policy runs
            self.rewards.to(module.device)
            self._rewards_device = module.device
        was_training = adapter.training
        adapter.eval()  # rollout and replay alike: the first ratio is exactly 1 (module docstring)
        try:
            rollouts = self.rollout(adapter, batch, generator, progress=lambda d, n: _progress(module, d, n))
            rewards = self.score(adapter, module, batch, rollouts)
            stats = self.update(module, adapter, rollouts)
        finally:
            adapter.train(was_training)
        bs = len(batch["prompt"])
        for name, value in {**rewards, **stats.means()}.items():
            module.log(f"train/{name}", value.detach().float(), batch_size=bs, prog_bar=name == "reward_mean")

    def rollout(self, adapter: Adapter, batch: dict[str, Any], generator: torch.Generator | None,
                progress=None) -> list[Rollout]:  # fmt: skip
        """The rank's samples, in micro-batches, under no_grad (step 1 of the module docstring)."""
        n = len(batch["prompt"])
        size = self.micro_batch_size or n
        rollouts = []
        with torch.no_grad():
            for start in range(0, n, size):
                rows = slice(start, min(start + size, n))
                condition = prepare_batch_condition(adapter, slice_batch(batch["condition"], rows),
                                                    child_generator(generator, CONDITION_STREAM + start))
                trajectory = sample_sde(adapter, condition, self.sampler, num_steps=self.num_steps,
                                        guidance_scale=self.guidance_scale, generator=generator, shift=self.shift,
                                        embedded_guidance=self.embedded_guidance,
                                        guidance_rescale=self.guidance_rescale, config_key=GUIDANCE_KEY,
                                        guidance_scale_2=self.guidance_scale_2, **self.reduction(adapter))  # fmt: skip
                # Replays use the very conditions the rollout sampled with (embedded guidance included).
                condition, negative = guided_conditions(adapter, condition, self.guidance_scale,
                                                        self.embedded_guidance, self.guidance_scale_2)  # fmt: skip
                rollouts.append(Rollout(rows, condition, negative, trajectory))
                if progress is not None:
                    progress(rows.stop, n)
        return rollouts

    def score(self, adapter: Adapter, module: Any, batch: dict[str, Any], rollouts: list[Rollout]) -> dict[str, Tensor]:
        """Decode, score, gather every rank's scores and set each rollout's advantages; returns reward metrics."""
        media = [m for r in rollouts for m in adapter.decode(r.trajectory.final)]
        groups = batch.get("group")
        if groups is None:  # each sample its own group would make every advantage 0: never train on that silently
            raise ValueError("GRPO: the batch carries no `group` ids; GRPO batches come from the data module's "
                             "GroupedDistributor (data.grouping, linked from model.objective)")  # fmt: skip
        types = tuple(str(t.value) for t in adapter.io_contract.output_types)
        rates = tuple(getattr(adapter, "output_rates", None) or (None,) * len(types))  # as FlowModule.generate
        reward_batch = RewardBatch(media, list(batch["prompt"]), list(batch["metadata"]), groups.cpu(), types, rates)
        per_reward = _score_once(self.rewards, reward_batch, module)
        gather = _gatherer(module)
        all_groups = gather(groups.to(torch.long))
        if self.rewards.has_groupwise:  # needs whole groups: every rank scores the gathered step alike
            gathered = _gather_objects(module, reward_batch)
            whole = RewardBatch([m for b in gathered for m in b.media], [p for b in gathered for p in b.prompts],
                                [d for b in gathered for d in b.metadata], all_groups.cpu(),
                                reward_batch.output_types, reward_batch.rates)  # fmt: skip
            all_scores = {k: gather(v) for k, v in per_reward.items()} | self.rewards.groupwise(whole)
        else:
            all_scores = {k: gather(v) for k, v in per_reward.items()}
        total = self.rewards.combine(all_scores).total
        all_groups = all_groups.to(total.device)
        advantages = group_advantages(total, all_groups, self.global_std)
        tied = tied_groups(total, all_groups)  # over every rank's groups, as the advantages
        rank, n = _rank(module), len(batch["prompt"])
        local, local_tied = advantages[rank * n : (rank + 1) * n], tied[rank * n : (rank + 1) * n]
        for r in rollouts:
            device = next(iter(r.trajectory.final.components.values())).device
            r.advantages = local[r.rows].to(device)
            r.keep = (~local_tied[r.rows]).to(device) if self.filter_zero_std and local_tied[r.rows].any() else None
            r.kept_anywhere = not self.filter_zero_std or not bool(tied.view(-1, n)[:, r.rows].all())
        metrics = {"reward_mean": total.mean(), "reward_std": total.std(correction=0),
                   "zero_std_ratio": zero_std_ratio(total, all_groups)}  # fmt: skip
        for key, scores in all_scores.items():
            metrics[f"reward/{key}_mean"], metrics[f"reward/{key}_std"] = scores.mean(), scores.std(correction=0)
        clipped = advantages.clamp(-self.adv_clip_max, self.adv_clip_max)  # what the loss uses
        metrics["advantage_abs_mean"] = clipped.abs().mean()
        return metrics

    def update(self, module: Any, adapter: Adapter, rollouts: list[Rollout]) -> UpdateStats:
        """``num_inner_epochs`` passes of ``mini_batches`` optimiser steps over the rollouts (step 3)."""
        optimizer, scheduler = module.optimizers(), module.lr_schedulers()
        stats = UpdateStats()
        chunks = [c for c in _split(rollouts, self.mini_batches) if c]
        # Under FSDP2 and DeepSpeed each forward all-gathers and each backward reduces: every rank must run the same
        # forwards and backwards, so a micro-batch this rank filtered out whole is replayed with weight 0 when another
        # rank keeps a sample of its own micro-batch at that position (none replays one that no rank keeps).
        lockstep = self._sync == "strategy"
        boundary = getattr(module, "mark_accumulation_boundary", None)
        for _ in range(self.num_inner_epochs):
            for chunk in chunks:
                # Every kept (sample, transition) weighs the same in the optimiser step: the mean over them.
                terms = sum(len(r.trajectory.transitions) * r.kept for r in chunk)
                guard = getattr(module, "nonfinite_guard", None)  # ff_core.nonfinite: model.nonfinite
                replays = [(r, t) for r in chunk if r.kept or (lockstep and r.kept_anywhere)
                           for t in r.trajectory.transitions]  # fmt: skip
                for i, (r, t) in enumerate(replays):
                    if boundary is not None:  # DeepSpeed: the last backward of the optimiser step
                        boundary(i == len(replays) - 1)
                    loss = self.transition_loss(adapter, r, t, stats)
                    if guard is not None:
                        guard.observe_loss(loss)
                    module.manual_backward(loss * r.kept / terms if r.kept else loss)  # loss: 0 when unkept
                if _average_gradients(module, terms, self._sync) == 0:  # no rank kept a sample (filter_zero_std)
                    _count_step_without_stepping(optimizer)
                elif guard is not None and _nonfinite_skip(module, guard, optimizer):  # before any weight moves
                    _count_step_without_stepping(optimizer)
                else:
                    if self.max_grad_norm is not None:
                        module.clip_gradients(optimizer, gradient_clip_val=self.max_grad_norm,
                                              gradient_clip_algorithm="norm")  # fmt: skip
                    optimizer.step()
                optimizer.zero_grad()
                if scheduler is not None:
                    scheduler.step()
        return stats

    def transition_loss(self, adapter: Adapter, rollout: Rollout, t, stats: UpdateStats) -> Tensor:
        """The mean over the micro-batch's kept samples of one transition's clipped surrogate plus the KL term, with
        gradient; a micro-batch with no kept sample (replayed under FSDP2 only to keep the ranks' collectives in step)
        gives a zero loss with a zero gradient and no statistics."""
        if not rollout.kept:
            stats = UpdateStats()  # thrown away
        trajectory = rollout.trajectory
        sigmas = t.levels or (t.sigma, t.sigma_next)
        v = guided_velocity(adapter, t.state, t.velocity_levels, rollout.condition, rollout.negative,
                            self.guidance_scale, self.guidance_rescale, GUIDANCE_KEY,
                            self.guidance_scale_2,
                            detach_negative=self.cfg_replay == "detached_uncond")  # the rollout's guidance
        step = step_log_prob(t.state, v, t.next, sigmas, self.sampler.kind, self.sampler.eta, trajectory.sigma_max,
                             **self.reduction(adapter), cps_log_prob=self.sampler.cps_log_prob)  # as the rollout's
        policy = clipped_policy_loss(step.log_prob, t.log_prob, rollout.advantages, self.clip_range,
                                     self.adv_clip_max)  # fmt: skip
        loss = policy.loss
        if stats.first_ratio is None:
            stats.first_ratio = policy.ratio
        keep = rollout.keep if rollout.keep is not None else slice(None)  # the whole micro-batch runs: exact replay
        if self.kl_beta > 0:
            kl = self.kl(adapter, rollout, t, v, step)
            loss = loss + self.kl_beta * kl
            stats.kl.append(kl.detach()[keep])
        stats.ratio.append(policy.ratio[keep])
        stats.clipped_low.append(policy.clipped_low[keep])
        stats.clipped_high.append(policy.clipped_high[keep])
        stats.policy_loss.append(policy.loss.detach()[keep])
        stats.approx_kl.append((0.5 * (step.log_prob.detach() - t.log_prob) ** 2)[keep])
        return loss[keep].mean() if rollout.kept else loss.sum() * 0

    def kl(self, adapter: Adapter, rollout: Rollout, t, v, step) -> Tensor:
        """Per sample, the KL term to the reference at this transition (``kl_on``, ``kl_scale``), with gradient:
        element means reduced over the components as the log-prob (:meth:`reduction`), each component at its own
        levels (its own ``std`` or ``noise_scale``)."""
        with torch.no_grad(), self.reference.active(adapter):
            v_ref = guided_velocity(adapter, t.state, t.velocity_levels, rollout.condition, rollout.negative,
                                    self.guidance_scale, self.guidance_rescale, GUIDANCE_KEY,
                                    self.guidance_scale_2)  # fmt: skip
            ref = step_log_prob(t.state, v_ref, t.next, t.levels or (t.sigma, t.sigma_next), self.sampler.kind,
                                self.sampler.eta, rollout.trajectory.sigma_max)  # fmt: skip
        masks = t.state.masks
        if self.kl_on == "velocity":
            diffs = {k: (x.float() - v_ref.components[k].float()) ** 2 for k, x in v.components.items()}
        else:  # flow_grpo: / (2 std_dev_t^2), its sde_step_with_logprob's std without sqrt(-dt); exact: / (2 std^2)
            scale = step.std if self.kl_scale == "exact_gaussian" else step.noise_scale
            diffs = {k: (m - ref.mean[k]) ** 2 / (2 * scale[k] ** 2) for k, m in step.mean.items()}
        return component_mean(diffs, masks, **self.reduction(adapter))


def slice_batch(value: Any, rows: slice) -> Any:
    """Rows ``rows`` of a collated value (tensors along dim 0; dicts, lists and tuples recursively)."""
    if isinstance(value, Tensor):
        return value[rows]
    if isinstance(value, dict):
        return {k: slice_batch(v, rows) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(slice_batch(v, rows) for v in value)
    return value


def _split(items: list, parts: int) -> list[list]:
    """``items`` in ``parts`` contiguous runs, as even as possible (the first ones longer)."""
    q, r = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + q + (i < r)
        out.append(items[start:end])
        start = end
    return out


def _data_parallel(module: Any) -> tuple[int, int, Any]:
    """``(rank, size, group)`` of the data-parallel dimension (``FlowModule.data_parallel``): the ranks of one
    context-parallel group (ff's ``ContextParallelStrategy``) roll out the same samples, so rewards, advantages and
    counts are gathered over the data-parallel replicas only; ``(0, 1, None)`` outside a trainer."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        return 0, 1, None
    coords = getattr(module, "data_parallel", None)
    if coords is None:  # a host that is not a FlowModule: every process is a data-parallel rank
        return trainer.global_rank, trainer.world_size, None
    return coords.rank, coords.world_size, coords.group


def _rank(module: Any) -> int:
    return _data_parallel(module)[0]


def _gatherer(module: Any):
    """``tensor -> every data-parallel rank's tensor, concatenated in rank order`` (the tensor itself on one)."""
    _, size, group = _data_parallel(module)
    if size == 1:
        return lambda x: x
    if group is None:  # every process: Lightning's all_gather
        return lambda x: module.all_gather(x.to(module.device)).flatten(0, 1).cpu()
    import torch.distributed as dist

    def gather(x: Tensor) -> Tensor:
        # Through the module's device (NCCL gathers device tensors only), back to the CPU, where rewards return scores.
        x = x.to(module.device).contiguous()
        out = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(out, x, group=group)
        return torch.cat(out).cpu()

    return gather


def _gather_objects(module: Any, obj: Any) -> list[Any]:
    _, size, group = _data_parallel(module)
    if size == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def _score_once(rewards: Any, batch: RewardBatch, module: Any) -> dict[str, Tensor]:
    """The pointwise rewards of the rank's samples. The ranks of a context-parallel group hold the same samples: each
    scores every ``size``-th one (rank ``r``: samples ``r, r + size, ...``) and the group all-gathers the scores, so a
    sample is scored once per group, not once per rank."""
    trainer = getattr(module, "_trainer", None)
    rank, size, group = getattr(module, "context_parallel", (0, 1, None)) if trainer is not None else (0, 1, None)
    if size == 1:
        return rewards.pointwise(batch)
    import torch.distributed as dist

    mine = list(range(rank, len(batch.prompts), size))
    pick = lambda xs: [xs[i] for i in mine]  # noqa: E731
    groups = batch.groups[mine] if batch.groups is not None else None
    part = RewardBatch(pick(batch.media), pick(batch.prompts), pick(batch.metadata), groups, batch.output_types,
                       batch.rates)  # fmt: skip
    scores = {k: v.cpu() for k, v in rewards.pointwise(part).items()} if mine else None
    parts: list[Any] = [None] * size
    dist.all_gather_object(parts, scores, group=group)
    some = next(p for p in parts if p is not None)
    out = {}
    for key in some:
        whole = torch.empty(len(batch.prompts), dtype=some[key].dtype)
        for r, p in enumerate(parts):
            if p is not None:
                whole[r::size] = p[key]
        out[key] = whole
    return out


def _gradient_sync(module: Any) -> Literal["none", "manual", "strategy"]:
    """Who averages the replayed gradients over the data-parallel ranks: ``none`` (one process), ``manual`` (DDP:
    :func:`_average_gradients`, once per optimiser step) or ``strategy`` (FSDP2, DeepSpeed: each backward's reduction,
    ``FlowModule.strategy_reduces_gradients``).

    Under DDP, the wrapper's per-backward all-reduce is turned off: under manual optimisation Lightning re-arms DDP's
    reducer before every ``manual_backward``, so each replayed transition would all-reduce the whole gradient; GRPO
    accumulates over every transition of a run first (as Flow-GRPO does under accelerate's ``accumulate``), so it sets
    DDP's ``require_backward_grad_sync`` off (the flag ``no_sync`` sets, which Lightning's ``prepare_for_backward``
    honours) and averages the accumulated gradients in one flat all-reduce.

    Under FSDP2 each backward reduce-scatters the gradients of the blocks it ran into the rank's shards, which
    accumulate over the step's transitions: the mean over ranks of each rank's accumulated gradient, as DDP's, without
    a full gradient ever held whole (``set_requires_gradient_sync(False)`` would save the communication at the cost of
    an unsharded gradient per rank). DeepSpeed ZeRO-2 reduces each backward's gradients into the rank's partition
    likewise (its engine's ``backward``) and clips in its ``step`` (``FlowModule`` writes ``max_grad_norm`` into its
    config). Every rank must then run the same forwards and backwards (:meth:`GRPOObjective.update`).
    """
    trainer = getattr(module, "_trainer", None)
    if trainer is None or trainer.world_size == 1:
        return "none"
    from torch.nn.parallel import DistributedDataParallel

    if getattr(module, "strategy_reduces_gradients", False):  # FSDP2, DeepSpeed
        return "strategy"
    wrapper = getattr(trainer.strategy, "model", None)
    if not isinstance(wrapper, DistributedDataParallel):
        raise ValueError(f"GRPO runs on one device, under DDP (trainer.strategy: ddp) or FSDP2; got "
                         f"{type(trainer.strategy).__name__}")  # fmt: skip
    wrapper.require_backward_grad_sync = False
    return "manual"


def _average_gradients(module: Any, terms: int, sync: Literal["none", "manual", "strategy"] = "manual") -> int:
    """Average the trainable parameters' gradients over the data-parallel ranks; returns the (sample, transition)
    terms back-propagated for the step on all ranks together (``terms`` on one process).

    ``terms``: this rank's. With ``filter_zero_std`` ranks may have trained on different numbers of samples, none at
    all, or (Wan2.2 A14B, LoRA on both experts) on different experts, so the set of parameters holding a gradient can
    differ between ranks. One small all-reduce first sums, per parameter, whether a rank has its gradient (and the
    terms); the gradients are then averaged over exactly the parameters some rank trained (a rank without one adds
    zeros), in one flat all-reduce of the same tensors on every rank. A parameter no rank trained keeps no gradient
    (``None``), so the optimiser leaves it and its state alone, as on one process: a zero gradient would not (AdamW's
    weight decay and momentum still move it). Under ``sync="strategy"`` (FSDP2, :func:`_gradient_sync`) the shards
    are already averaged: only the terms are summed.
    """
    trainer = getattr(module, "_trainer", None)
    if trainer is None or trainer.world_size == 1:
        return terms
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    if sync == "strategy":  # the shards' reduce-scatter averaged them: only the count remains
        count = torch.tensor([float(terms)], device=module.device)
        dist.all_reduce(count, group=_data_parallel(module)[2])
        return int(count.item())
    params = [p for p in module.parameters() if p.requires_grad]
    flags = torch.tensor([float(p.grad is not None) for p in params] + [float(terms)], device=params[0].device)
    dist.all_reduce(flags)
    trained = [p for p, had in zip(params, flags[:-1].tolist()) if had > 0]
    for p in trained:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if trained:
        grads = [p.grad for p in trained]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat /= trainer.world_size
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)
    return int(flags[-1].item())


def _nonfinite_skip(module: Any, guard: Any, optimizer: Any) -> bool:
    """The non-finite check of one optimiser step (:class:`ff_core.nonfinite.NonFiniteGuard`), on the averaged
    gradients, on every rank alike: raises under ``stop``; ``True`` when ``skip`` dropped the step's gradients."""
    skipped = guard.check(module, optimizer)
    log_nonfinite = getattr(module, "log_nonfinite", None)
    if log_nonfinite is not None:
        log_nonfinite()
    return skipped


def _count_step_without_stepping(optimizer: Any) -> None:
    """Count an optimiser step in Lightning's loop (``trainer.global_step``, hence ``max_steps`` and the schedules)
    without calling the optimiser: nothing was back-propagated on any rank, and a step with no gradient would trip a
    ``GradScaler`` (``trainer.precision: 16-mixed``: "No inf checks were recorded"). These are the two hooks
    ``LightningOptimizer.step`` runs around the strategy's step under manual optimisation (a bare torch optimiser,
    outside a Trainer, has no step counter to advance)."""
    for hook in ("_on_before_step", "_on_after_step"):
        if callable(getattr(optimizer, hook, None)):
            getattr(optimizer, hook)()


def _progress(module: Any, done: int, total: int) -> None:
    """``rollout done/total`` on rank 0's training progress bar while an iteration samples: appended to the task's
    description of Lightning's rich bar (removed when the rollout ends), the postfix of its tqdm bar."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None or not trainer.is_global_zero:
        return
    bar, text = trainer.progress_bar_callback, f"rollout {done}/{total}" if done < total else ""
    task_id, progress = getattr(bar, "train_progress_bar_id", None), getattr(bar, "progress", None)
    if task_id is not None and progress is not None:  # RichProgressBar
        base = progress.tasks[task_id].description.split(" · rollout")[0]
        progress.update(task_id, description=f"{base} · {text}" if text else base)
        bar.refresh()
        return
    tqdm_bar = getattr(bar, "train_progress_bar", None)
    if tqdm_bar is not None and hasattr(tqdm_bar, "set_postfix_str"):
        tqdm_bar.set_postfix_str(text, refresh=True)
