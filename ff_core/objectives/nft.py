"""DiffusionNFT (``trainer_type: nft``): online RL of a flow model on the forward process, beside Flow-GRPO.

Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward Process" (arXiv 2509.16117); defaults
as its official trainer and SD3.5 recipes (NVlabs/DiffusionNFT, ``scripts/train_nft_sd3.py``, ``config/nft.py``);
the loss maths is :mod:`ff_core.objectives.nft_loss`. One training step is one iteration over the rank's share of
the step's prompt groups, as GRPO's (:mod:`ff_core.objectives.online`):

1. **Rollout** (no_grad) with the *sampling* (old) policy, any sampler: ODE by default (Euler, or the checkpoint's
   own scheduler), or GRPO's SDE steps; no classifier-free guidance (DiffusionNFT trains guidance-free: the policy
   learns to need none). Only the final clean latents are kept: no transitions, no log-probabilities.
2. **Rewards** and group advantages as GRPO's (``reward_aggregation``, ``global_std``), each mapped to an optimality
   probability ``r`` in [0, 1].
3. **Update**, ``num_inner_epochs`` x ``mini_batches`` optimiser steps: for each sample, ``int(num_steps *
   timestep_fraction)`` distinct levels of the rollout's schedule drawn at random (the official trainer's 9 of 10),
   fresh noise at each, the sample re-noised on the forward process; the old policy's velocity there (no_grad, the
   old weights swapped in once per optimiser step) and the trained one's (with gradient) give the implicit positive
   and negative policies' loss, plus ``kl_beta`` x the squared velocity distance to the reference. The loss is the
   mean over the step's (sample, timestep) terms, clipped to ``max_grad_norm``, one optimiser step.
4. **Old policy**: after the iteration, ``old <- d old + (1 - d) current`` with ``d`` :func:`old_policy_decay` of the
   optimiser step (0 at first: the old policy follows the trained one, then lags it more, up to ``decay_max``).

The old policy is a copy of the trained parameters (the LoRA's, or every trained weight under full fine-tuning),
kept beside them (on their device; under FSDP2 sharded as they are) and saved whole in checkpoints
(``ff_objective_state``), so a resumed run samples from the same policy. Swapping it in exchanges tensor storages (no
copy); FSDP2's sharded parameters are copied in place instead (FSDP2 all-gathers from their own storage), with one
temporary copy of the rank's shards. It runs on one device, under DDP and under FSDP2; DeepSpeed is refused.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from ff_core.objectives.flow_matching import (
    CONDITION_STREAM,
    child_generator,
    noise_state,
    prepare_batch_condition,
    randn_like,
)
from ff_core.objectives.nft_loss import AdvantageMode, nft_policy_loss, old_policy_decay, optimality_probability
from ff_core.objectives.online import OnlineObjective, _split, slice_batch
from ff_core.sampling import StochasticSampling, Trajectory, component_mean, sample_ode, sample_sde
from ff_core.sampling.loops import schedules
from ff_core.sampling.schedulers import check_sampling_scheduler

if TYPE_CHECKING:
    from ff_core.adapter import Adapter, Condition, LatentState

log = logging.getLogger(__name__)
OLD_POLICY_KEY = "old_policy"


@dataclass
class NFTRollout:
    """One rollout micro-batch: its rows, prepared condition and sampled clean latents.

    Attributes:
        rows: ``slice`` of the rank's batch.
        condition: the prepared condition.
        trajectory: the sample (``final``; no transitions).
        advantages: per sample, set once the rewards are gathered, shape (b,).
        keep: unused by DiffusionNFT (every sample trains, as the official trainer); kept for the shared scoring.
        kept_anywhere: likewise.
    """

    rows: slice
    condition: Condition
    trajectory: Trajectory
    advantages: Tensor | None = None
    keep: Tensor | None = None
    kept_anywhere: bool = True


@dataclass
class NFTStats:
    """Per-(sample, timestep) diagnostics of one iteration's updates."""

    policy_loss: list[Tensor] = field(default_factory=list)
    positive_loss: list[Tensor] = field(default_factory=list)
    negative_loss: list[Tensor] = field(default_factory=list)
    old_deviation: list[Tensor] = field(default_factory=list)
    kl: list[Tensor] = field(default_factory=list)
    optimality: list[Tensor] = field(default_factory=list)
    old_decay: Tensor | None = None

    def means(self) -> dict[str, Tensor]:
        out = {name: torch.cat(values).mean() for name, values in vars(self).items()
               if isinstance(values, list) and values}  # fmt: skip
        if self.old_decay is not None:
            out["old_decay"] = self.old_decay
        return out


@dataclass
class _Plan:
    """A micro-batch's draws for one optimiser step: per timestep, the noised state, the levels and the old policy's
    (and the reference's) velocities."""

    noisy: list[LatentState]
    levels: list[dict[str, Tensor]]
    old: list[dict[str, Tensor]]
    reference: list[dict[str, Tensor]] | None
    r: Tensor


class NFTObjective(OnlineObjective):
    """DiffusionNFT on prompt rows (module docstring; keys: docs/objectives.md, "DiffusionNFT").

    Args:
        rewards: the weighted rewards to maximise, as GRPO's.
        group_size: K, samples per prompt (the official recipes: 24).
        prompts_per_step: P, prompts per step over all data-parallel ranks.
        num_steps: rollout sampler steps (the official SD3.5 recipes: 10); their levels are the training timesteps.
        shift: noise-schedule shift of the rollout sigmas (``None``: the checkpoint scheduler's).
        scheduler: the ODE rollout's stepping, as ``model.sampling.scheduler``: ``euler`` or ``checkpoint`` (the
            checkpoint's own scheduler where it is not Euler; the official trainer uses a 2nd-order DPM solver).
        sampler: GRPO's SDE steps instead of the ODE (``{kind: flow_sde, eta: 0.7}``); ``None``: ODE.
        micro_batch_size: samples per rollout and training forward (``None``: the rank's whole share).
        num_inner_epochs: passes over one rollout (official: 1).
        mini_batches: optimiser steps per pass (the official ``gradient_step_per_epoch``, 1 or 2).
        nft_beta: ``beta`` of the implicit policies (official: 1; its OCR and multi-reward recipes 0.1).
        adv_clip_max: advantages are clipped to ``[-c, c]`` and scaled into ``r`` by it; the loss is scaled by it.
        adv_mode: how advantages become ``r`` (:func:`~ff_core.objectives.nft_loss.optimality_probability`).
        global_std: advantages divide by the std of every reward of the step (official: true).
        timestep_fraction: share of the rollout's levels trained per sample (official: 0.99, i.e. 9 of 10).
        decay_flat_steps: optimiser steps during which the old policy is the trained one.
        decay_ramp_rate: the old policy's decay gained per optimiser step after them.
        decay_max: the decay's ceiling (official default 0.5; OCR recipe 75 / 0.0075 / 0.999).
        kl_beta: weight of ``mean((v - v_ref)^2)`` to the reference (official SD3.5: 1e-4; 0: no reference kept).
        max_grad_norm: gradient-norm clip per optimiser step (official: 1).
        reference_offload: full fine-tuning with ``kl_beta > 0``: keep the frozen reference in CPU memory.
        component_weights: how the per-element terms reduce over several latent components (as GRPO's).
        reward_aggregation: ``gdpo`` (default) or ``sum``, as GRPO's.
    """

    trainer_type = "nft"
    method = "DiffusionNFT"
    supports_frozen_components = True
    # FSDP2: the old policy is copied into the DTensor shards in place; DeepSpeed's engine keeps its own flat copies of
    # the parameters (and ZeRO-3 partitions them), which the old policy cannot be swapped into.
    sharding_strategies = frozenset({"fsdp2"})

    def __init__(
        self,
        rewards: list[dict[str, Any]],
        group_size: int = 8,
        prompts_per_step: int = 4,
        num_steps: int = 10,
        shift: float | None = None,
        scheduler: Literal["euler", "checkpoint"] = "euler",
        sampler: StochasticSampling | None = None,
        micro_batch_size: int | None = None,
        num_inner_epochs: int = 1,
        mini_batches: int = 1,
        nft_beta: float = 1.0,
        adv_clip_max: float = 5.0,
        adv_mode: AdvantageMode = "all",
        global_std: bool = True,
        timestep_fraction: float = 0.99,
        decay_flat_steps: int = 0,
        decay_ramp_rate: float = 0.001,
        decay_max: float = 0.5,
        kl_beta: float = 1e-4,
        max_grad_norm: float | None = 1.0,
        reference_offload: bool = False,
        component_weights: dict[str, float] | None = None,
        reward_aggregation: Literal["gdpo", "sum"] = "gdpo",
    ) -> None:
        if not nft_beta > 0:
            raise ValueError(f"model.objective.nft_beta must be > 0, got {nft_beta}")
        if not 0 < timestep_fraction <= 1:
            raise ValueError(f"model.objective.timestep_fraction must be in (0, 1], got {timestep_fraction}")
        if decay_flat_steps < 0 or decay_ramp_rate < 0 or not 0 <= decay_max < 1:
            raise ValueError("model.objective: decay_flat_steps and decay_ramp_rate must be >= 0 and decay_max in "
                             f"[0, 1), got {decay_flat_steps}, {decay_ramp_rate}, {decay_max}")  # fmt: skip
        optimality_probability(torch.zeros(1), 1.0, adv_mode)  # an unknown mode fails now
        self.setup_online(rewards, group_size, prompts_per_step, num_steps, micro_batch_size, num_inner_epochs,
                          mini_batches, adv_clip_max, global_std, kl_beta, max_grad_norm, reference_offload,
                          component_weights, False, reward_aggregation, shift)  # fmt: skip
        self.scheduler = check_sampling_scheduler(scheduler, "model.objective.init_args.scheduler")
        self.sampler = sampler
        if sampler is not None:
            sampler.candidate_steps(num_steps)
        self.nft_beta, self.adv_mode, self.timestep_fraction = nft_beta, adv_mode, timestep_fraction
        self.decay = (decay_flat_steps, decay_ramp_rate, decay_max)
        self.train_timesteps = max(1, int(num_steps * timestep_fraction))
        self._old: dict[str, Tensor] | None = None  # the sampling policy's copy of the trained parameters

    # -- the old (sampling) policy ---------------------------------------------------------------------------------
    def _trained(self, module: Any) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in module.named_parameters() if p.requires_grad]

    def _old_policy(self, module: Any) -> dict[str, Tensor]:
        """The old policy's tensors, created from the trained ones on first use (or placed from a checkpoint)."""
        trained = self._trained(module)
        if self._old is None:
            self._old = {n: p.detach().clone() for n, p in trained}
        elif any(n not in self._old for n, _ in trained):
            missing = next(n for n, _ in trained if n not in self._old)
            raise KeyError(f"DiffusionNFT: the checkpoint's old policy lacks {missing!r}: was it written with a "
                           "different model.lora setting?")  # fmt: skip
        for n, p in trained:
            old = self._old[n]
            if _sharded(p) and not _sharded(old):  # whole, from a checkpoint: shard it as the parameter
                from torch.distributed.tensor import distribute_tensor

                self._old[n] = distribute_tensor(old.to(device=p.device, dtype=p.dtype), p.device_mesh, p.placements)
            elif old.device != p.device or old.dtype != p.dtype:
                self._old[n] = old.to(device=p.device, dtype=p.dtype)
        return self._old

    @contextlib.contextmanager
    def sampling_policy(self, module: Any) -> Iterator[None]:
        """The old policy's weights in the trained parameters' place: their storages exchanged (no copy), or, for
        FSDP2's sharded parameters, copied into the shards in place and back."""
        old = self._old_policy(module)
        trained = self._trained(module)
        if any(_sharded(p) for _, p in trained):
            with torch.no_grad():
                current = {n: p.detach().clone() for n, p in trained}
                for n, p in trained:
                    p.copy_(old[n])
            try:
                yield
            finally:
                with torch.no_grad():
                    for n, p in trained:
                        p.copy_(current[n])
            return

        def swap() -> None:
            with torch.no_grad():
                for n, p in trained:
                    p.data, old[n] = old[n], p.data

        swap()
        try:
            yield
        finally:
            swap()

    def update_old_policy(self, module: Any) -> float:
        """``old <- d old + (1 - d) current`` with ``d`` the decay at the module's optimiser step; returns ``d``."""
        d = old_policy_decay(int(module.global_step), *self.decay)
        old = self._old_policy(module)
        with torch.no_grad():
            for n, p in self._trained(module):
                old[n].mul_(d).add_(p.detach(), alpha=1 - d)
        return d

    def checkpoint_state(self) -> dict[str, Any] | None:
        """The old policy whole, on the CPU (FSDP2's shards gathered one tensor at a time: every rank calls this, as
        Lightning builds the checkpoint on every rank; only global rank 0 keeps the tensors, which it writes)."""
        if self._old is None:
            return None
        import torch.distributed as dist

        keep = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        out = {}
        for n, t in self._old.items():
            whole = t.detach().full_tensor() if _sharded(t) else t.detach()  # collective for DTensors
            if keep:
                out[n] = whole.cpu()
        return {OLD_POLICY_KEY: out}

    def load_checkpoint_state(self, state: dict[str, Any] | None) -> None:
        if state is None or OLD_POLICY_KEY not in state:
            log.warning("DiffusionNFT: the checkpoint holds no old policy; sampling starts from the loaded weights")
            self._old = None
            return
        self._old = dict(state[OLD_POLICY_KEY])

    # -- one iteration ---------------------------------------------------------------------------------------------
    def rollout(self, adapter: Adapter, batch: dict[str, Any], generator: torch.Generator | None,
                progress=None) -> list[NFTRollout]:  # fmt: skip
        """The rank's samples, in micro-batches, with the old policy (swapped in by :meth:`sampling_policy`)."""
        n = len(batch["prompt"])
        size = self.micro_batch_size or n
        rollouts = []
        with torch.no_grad():
            for start in range(0, n, size):
                rows = slice(start, min(start + size, n))
                condition = prepare_batch_condition(adapter, slice_batch(batch["condition"], rows),
                                                    child_generator(generator, CONDITION_STREAM + start))
                if self.sampler is None:
                    final = sample_ode(adapter, condition, num_steps=self.num_steps, generator=generator,
                                       shift=self.shift, scheduler=self.scheduler)  # fmt: skip
                else:
                    final = sample_sde(adapter, condition, self.sampler, num_steps=self.num_steps, generator=generator,
                                       shift=self.shift, **self.reduction(adapter)).final  # fmt: skip
                rollouts.append(NFTRollout(rows, condition, Trajectory(final)))
                if progress is not None:
                    progress(rows.stop, n)
        return rollouts

    def update(self, module: Any, adapter: Adapter, rollouts: list[NFTRollout],
               generator: torch.Generator | None = None) -> NFTStats:  # fmt: skip
        """``num_inner_epochs`` passes of ``mini_batches`` optimiser steps, then the old policy's update (steps 3-4)."""
        optimizer, scheduler = module.optimizers(), module.lr_schedulers()
        stats = NFTStats()
        chunks = [c for c in _split(rollouts, self.mini_batches) if c]
        guard = getattr(module, "nonfinite_guard", None)
        for _ in range(self.num_inner_epochs):
            for chunk in chunks:
                with self.sampling_policy(module):  # the old policy's velocities of the whole step, swapped in once
                    plans = [self.plan(adapter, r, generator) for r in chunk]
                terms = sum(len(r.advantages) for r in chunk) * self.train_timesteps
                for r, plan in zip(chunk, plans):
                    for j in range(self.train_timesteps):
                        loss = self.timestep_loss(adapter, r, plan, j, stats)
                        if guard is not None:
                            guard.observe_loss(loss)
                        module.manual_backward(loss.sum() / terms)
                self.optimizer_step(module, optimizer, scheduler, terms)
        stats.old_decay = torch.tensor(self.update_old_policy(module))
        return stats

    def plan(self, adapter: Adapter, rollout: NFTRollout, generator: torch.Generator | None) -> _Plan:
        """The micro-batch's training draws (levels, noise) and the old policy's and reference's velocities, no_grad.

        Draw order from ``generator``: per sample, a permutation of the rollout's ``num_steps`` levels (the first
        ``int(num_steps * timestep_fraction)`` train), then per trained timestep the noise of every component."""
        clean = rollout.trajectory.final
        levels_all = schedules(adapter, clean, self.num_steps, self.shift)
        b = clean.batch_size
        picks = torch.stack([torch.randperm(self.num_steps, generator=generator)[: self.train_timesteps]
                             for _ in range(b)])  # fmt: skip
        device = next(iter(clean.components.values())).device
        noisy, levels, old, reference = [], [], [], [] if self.kl_beta > 0 else None
        with torch.no_grad():
            for j in range(self.train_timesteps):
                sigma = {k: torch.tensor([s[int(i)] for i in picks[:, j]], device=device)
                         for k, s in levels_all.items()}  # fmt: skip
                noise = {k: randn_like(x, generator) for k, x in clean.components.items()}
                x_t = noise_state(clean, type(clean)(noise, masks=dict(clean.masks)), sigma)
                noisy.append(x_t)
                levels.append(sigma)
                old.append(dict(adapter.component_velocity(x_t, sigma, rollout.condition).components))
                if reference is not None:
                    with self.reference.active(adapter):
                        reference.append(dict(adapter.component_velocity(x_t, sigma, rollout.condition).components))
        r = optimality_probability(rollout.advantages, self.adv_clip_max, self.adv_mode)
        return _Plan(noisy, levels, old, reference, r)

    def timestep_loss(self, adapter: Adapter, rollout: NFTRollout, plan: _Plan, j: int, stats: NFTStats) -> Tensor:
        """Per sample, the DiffusionNFT loss at the plan's ``j``-th timestep (plus the KL term), with gradient."""
        x_t, sigma = plan.noisy[j], plan.levels[j]
        v = adapter.component_velocity(x_t, sigma, rollout.condition).components
        reduction = self.reduction(adapter)
        terms = nft_policy_loss(v, plan.old[j], x_t.components, rollout.trajectory.final.components, sigma, plan.r,
                                self.nft_beta, self.adv_clip_max, x_t.masks, **reduction)  # fmt: skip
        loss = terms.loss
        masks = x_t.masks
        if plan.reference is not None:
            kl = component_mean({k: (x.float() - plan.reference[j][k].float()) ** 2 for k, x in v.items()}, masks,
                                **reduction)  # fmt: skip
            loss = loss + self.kl_beta * kl
            stats.kl.append(kl.detach())
        stats.policy_loss.append(terms.loss.detach())
        stats.positive_loss.append(terms.positive)
        stats.negative_loss.append(terms.negative)
        stats.optimality.append(plan.r)
        stats.old_deviation.append(component_mean({k: (x.detach().float() - plan.old[j][k].float()) ** 2
                                                   for k, x in v.items()}, masks, **reduction))  # fmt: skip
        return loss


def _sharded(tensor: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)
