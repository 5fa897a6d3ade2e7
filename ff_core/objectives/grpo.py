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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from ff_core.objectives.flow_matching import CONDITION_STREAM, child_generator, prepare_batch_condition
from ff_core.objectives.grpo_loss import clipped_policy_loss
from ff_core.objectives.online import (  # noqa: F401 - the shared helpers, importable from here as before
    OnlineObjective,
    _average_gradients,
    _progress,
    _score_once,
    _split,
    slice_batch,
)
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


class GRPOObjective(OnlineObjective):
    """Flow-GRPO on prompt rows (module docstring; maths and keys: docs/objectives.md, "GRPO").

    Args:
        rewards: the weighted rewards to maximise, each ``{name, weight, args, label, offload}`` (a
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
        reward_aggregation: how several weighted rewards become one advantage (:mod:`ff_core.objectives.advantages`):
            ``gdpo`` (default, Flow-Factory's): each reward normalised within its group, then the weighted sum
            normalised over the step, so no reward's scale dominates; applies when two or more rewards carry weight
            (one reward: the weighted-sum path, flow_grpo's). ``sum``: the weighted total normalised within its
            group (flow_grpo; ``global_std`` picks the std).

    ``model.frozen_components`` leaves a component's log-density (and KL) out of the log-prob: its branch does not
    train, as its loss term leaves SFT and DPO; it is still sampled and decoded, so the rewards see it.
    """

    trainer_type = "grpo"
    method = "GRPO"
    supports_frozen_components = True

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
        reward_aggregation: Literal["gdpo", "sum"] = "gdpo",
    ) -> None:
        if not clip_range > 0:
            raise ValueError(f"model.objective.clip_range must be > 0, got {clip_range}")
        for key, value, allowed in (("kl_on", kl_on, ("mean", "velocity")),
                                    ("kl_scale", kl_scale, ("flow_grpo", "exact_gaussian")),
                                    ("cfg_replay", cfg_replay, ("full", "detached_uncond"))):
            if value not in allowed:
                raise ValueError(f"model.objective.{key} must be one of {list(allowed)}, got {value!r}")
        self.setup_online(rewards, group_size, prompts_per_step, num_steps, micro_batch_size, num_inner_epochs,
                          mini_batches, adv_clip_max, global_std, kl_beta, max_grad_norm, reference_offload,
                          component_weights, filter_zero_std, reward_aggregation, shift)
        # One guidance for rollout, replay and KL alike (the first ratio is exactly 1); component names are checked
        # against the adapter's latent_components before weights load (FlowModule, check_components).
        self.guidance_scale = check_guidance(f"{GUIDANCE_KEY}.guidance_scale", guidance_scale)
        self.guidance_rescale = check_guidance(f"{GUIDANCE_KEY}.guidance_rescale", guidance_rescale, high=1.0)
        self.guidance_scale_2 = None if guidance_scale_2 is None else float(
            check_guidance(f"{GUIDANCE_KEY}.guidance_scale_2", guidance_scale_2))  # fmt: skip
        self.embedded_guidance = embedded_guidance
        self.sampler = sampler or StochasticSampling()
        self.sampler.candidate_steps(num_steps)  # a window outside the schedule fails now
        self.clip_range, self.kl_on, self.kl_scale, self.cfg_replay = clip_range, kl_on, kl_scale, cfg_replay

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

    def update(self, module: Any, adapter: Adapter, rollouts: list[Rollout],
               generator: torch.Generator | None = None) -> UpdateStats:  # fmt: skip
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
                self.optimizer_step(module, optimizer, scheduler, terms)
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
