"""Offline Diffusion-DPO for rectified flow, on preference pairs (``trainer_type: offline-dpo``).

Wallace et al. 2023, "Diffusion Model Alignment Using Direct Preference Optimization", eq. 14, with the velocity
parametrisation of rectified flow (Liu et al. 2025, "Improving Video Generation with Human Feedback": Flow-DPO with
a constant beta). For a pair (chosen ``w``, rejected ``l``) sharing one prompt, one noise level ``sigma`` and one
noise ``eps`` (both arms, both models)::

    e_m(x0) = mean over latent elements of (v_m(x_sigma, sigma) - (eps - x0))^2       in fp32, m in {theta, ref}
    r_w = -beta/2 * (e_theta(w) - e_ref(w)),   r_l = -beta/2 * (e_theta(l) - e_ref(l))  implicit rewards
    L   = -log sigmoid(r_w - r_l)

averaged over ``num_train_timesteps`` Monte-Carlo (sigma, eps) draws and over the batch. Errors are element means and
beta multiplies their difference by 1/2, as in the authors' released training code and in flow_grpo's
scripts/train_sd3_dpo.py and Flow-Factory's DPO trainer, which use exactly this loss on velocity errors: their beta
values carry over unchanged (flow_grpo's SD3 DPO recipes: 100; Flow-Factory's default 2000, its SD3.5 example 100).
Diffusion-DPO's beta (5000 for SD1.5 and SDXL in Wallace et al.) does NOT carry over unchanged: it multiplies
epsilon-prediction errors, and a velocity error is ``(1 - sigma)^-2`` times the epsilon error at the same point
(``eps_hat = x_sigma + (1 - sigma) v_hat``), so the same loss needs ``beta_v = beta_eps (1 - sigma)^2``
(:func:`velocity_beta`): 1/16 of it at the median of SD3.5's training draws (logit-normal, shift 3: sigma 0.75).
Flow-DPO keeps beta constant across sigma rather than rescaling it per draw, which the authors found avoids
over-optimising high noise levels; ff does the same.

ff's default beta = 5000 acts on velocity errors: it is 50x flow_grpo's SD3 value (100) and 2.5x Flow-Factory's
default (2000), and corresponds to Diffusion-DPO's ``beta_eps = 5000 / (1 - sigma)^2 = 80000`` at sigma 0.75, 16x
Wallace et al.'s 5000 (much stronger). It is kept because the toy benchmark saturates alike for every beta >= 500
(benchmarks/RESULTS.md, "Offline DPO"); take 100-2000 when porting a flow_grpo or Flow-Factory recipe.

Spec ("Condition cache and target lifecycle"): one prepared condition serves both arms' encodes and all four
forwards, so a stochastic condition cannot drift between the arms. The reference is the base with the LoRA disabled,
or a frozen copy for full fine-tuning (:mod:`ff_core.objectives.reference`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ff_core.objectives.base import LossOutput, Objective
from ff_core.objectives.flow_matching import (
    CONDITION_STREAM,
    Sigma,
    TimestepSampler,
    check_component_weights,
    child_generator,
    leading_sigma,
    monte_carlo_draws,
    prepare_batch_condition,
)
from ff_core.objectives.reference import ReferenceModel
from ff_core.objectives.sft import flow_matching_error

if TYPE_CHECKING:
    from ff_core.adapter import Adapter, Condition, LatentState


@dataclass
class PreferenceErrors:
    """Per-sample flow-matching errors of one (sigma, eps) draw, each shape (B,), fp32; reference ones detached.

    Attributes:
        policy_chosen: ``e_theta(w)``.
        policy_rejected: ``e_theta(l)``.
        reference_chosen: ``e_ref(w)``.
        reference_rejected: ``e_ref(l)``.
    """

    policy_chosen: Tensor
    policy_rejected: Tensor
    reference_chosen: Tensor
    reference_rejected: Tensor


@dataclass
class DPOTerms:
    """What :func:`diffusion_dpo_loss` gives for one draw, each shape (B,).

    Attributes:
        loss: ``-log sigmoid(r_w - r_l)`` per sample.
        reward_chosen: implicit reward ``r_w = -beta/2 (e_theta(w) - e_ref(w))``, detached.
        reward_rejected: implicit reward ``r_l``, detached.
    """

    loss: Tensor
    reward_chosen: Tensor
    reward_rejected: Tensor

    @property
    def accuracy(self) -> Tensor:
        """1 where the policy ranks the pair as labelled (``r_w > r_l``), else 0 (a tie, as at the start, is 0)."""
        return (self.reward_chosen > self.reward_rejected).float()


def diffusion_dpo_loss(errors: PreferenceErrors, beta: float) -> DPOTerms:
    """The Diffusion-DPO loss of one Monte-Carlo draw (module docstring), per sample.

    Args:
        errors: the four per-sample errors.
        beta: the KL-regularisation strength (larger: closer to the reference).
    """
    reward_chosen = -0.5 * beta * (errors.policy_chosen - errors.reference_chosen)
    reward_rejected = -0.5 * beta * (errors.policy_rejected - errors.reference_rejected)
    loss = -F.logsigmoid(reward_chosen - reward_rejected)  # log1p(exp(-x)), stable for large |x|
    return DPOTerms(loss, reward_chosen.detach(), reward_rejected.detach())


def velocity_beta(epsilon_beta: float, sigma: float | Tensor) -> float | Tensor:
    """The beta of this (velocity-error) loss that equals Diffusion-DPO's loss with ``epsilon_beta`` on
    epsilon-prediction errors at noise level ``sigma``: ``epsilon_beta (1 - sigma)^2``.

    With ``x_sigma = (1 - sigma) x0 + sigma eps`` and ``v = eps - x0``, an epsilon prediction read from a velocity is
    ``eps_hat = x_sigma + (1 - sigma) v_hat``, so ``|eps_hat - eps|^2 = (1 - sigma)^2 |v_hat - v|^2``. One beta for
    every draw (ff's, Flow-DPO's) matches Diffusion-DPO only at one sigma; at SD3.5's median training sigma (0.75)
    ``velocity_beta(5000, 0.75) = 312.5``.

    Args:
        epsilon_beta: Diffusion-DPO's beta (Wallace et al. 2023: 5000 for SD1.5 / SDXL).
        sigma: the noise level(s) in [0, 1] to match at.
    """
    return epsilon_beta * (1 - sigma) ** 2


def preference_errors(
    adapter: Adapter,
    reference: ReferenceModel,
    chosen: LatentState,
    rejected: LatentState,
    condition: Condition,
    sigma: Sigma,
    noise: LatentState,
    component_weights: dict[str, float] | None = None,
    frozen_components: Collection[str] = (),
) -> PreferenceErrors:
    """Both arms' errors under the policy and the reference, all four at this one ``sigma`` and ``noise``.

    The reference runs first, under no_grad, so no LoRA toggling or network swap happens while a policy graph waits
    for its backward pass.
    """
    args = (condition, sigma, noise, component_weights, frozen_components)
    with torch.no_grad(), reference.active(adapter):
        reference_chosen = flow_matching_error(adapter, chosen, *args)
        reference_rejected = flow_matching_error(adapter, rejected, *args)
    return PreferenceErrors(
        policy_chosen=flow_matching_error(adapter, chosen, *args),
        policy_rejected=flow_matching_error(adapter, rejected, *args),
        reference_chosen=reference_chosen,
        reference_rejected=reference_rejected,
    )


class DPOObjective(Objective):
    """Offline Diffusion-DPO on V2 preference records (formula and conventions: docs/objectives.md, "Offline DPO").

    Args:
        beta: KL-regularisation strength: the implicit rewards are ``-beta/2`` times the policy-minus-reference
            velocity error of each arm (errors as element means): flow_grpo's and Flow-Factory's beta, unchanged
            (flow_grpo SD3: 100). Diffusion-DPO's (5000 for SD1.5/SDXL, on epsilon errors) maps to
            ``beta (1 - sigma)^2`` (:func:`velocity_beta`; ~1/16 at SD3.5's median sigma). The default 5000, on
            velocity errors, is 50x flow_grpo's SD3 value (100) and 2.5x Flow-Factory's default (2000), i.e.
            Diffusion-DPO's beta_eps = 5000 / (1 - 0.75)^2 = 80000 at sigma 0.75 (16x Wallace et al.'s 5000); it is
            kept because the toy benchmark saturates alike for every beta >= 500. Take 100-2000 when porting a
            flow_grpo or Flow-Factory recipe. Larger keeps the policy closer to the reference.
        timesteps: how noise levels are drawn per pair (logit-normal with the adapter's shift, or uniform).
        num_train_timesteps: independent Monte-Carlo (sigma, noise) draws averaged per microbatch.
        reference_offload: full fine-tuning only: keep the frozen reference denoiser in CPU memory and stream its
            weights to the device layer by layer for each forward (accelerate ``cpu_offload``); ignored with LoRA,
            whose reference is the base with the LoRA disabled.
        component_weights: how each candidate's error reduces over a multi-component latent state (video + audio):
            ``None`` uses the adapter's ``default_component_weights`` (``None`` there too: every latent element
            pooled); a mapping sums each component's mean error times its weight, ``sum_k w_k e_k``, unnormalised
            (as :class:`~ff_core.objectives.sft.SFTObjective`). The implicit rewards are ``-beta/2`` times that error,
            so ``beta`` sees the weights' scale: ``{video: 1, audio: 1}`` is twice ``{video: 0.5, audio: 0.5}``.
    """

    trainer_type = "offline-dpo"
    supports_frozen_components = True

    def __init__(
        self,
        beta: float = 5000.0,
        timesteps: TimestepSampler | None = None,
        num_train_timesteps: int = 1,
        reference_offload: bool = False,
        component_weights: dict[str, float] | None = None,
    ) -> None:
        if not beta > 0:
            raise ValueError(f"model.objective.beta must be > 0, got {beta}")
        if num_train_timesteps < 1:
            raise ValueError(f"model.objective.num_train_timesteps must be >= 1, got {num_train_timesteps}")
        self.beta = float(beta)
        self.timesteps = timesteps or TimestepSampler()
        self.num_train_timesteps = num_train_timesteps
        self.reference_offload = reference_offload
        self.component_weights = check_component_weights(component_weights)
        self.reference: ReferenceModel | None = None

    def configure_model(self, adapter: Adapter, lora: bool) -> nn.Module | None:
        self.reference = ReferenceModel(adapter, lora=lora, offload=self.reference_offload)
        return self.reference

    def training_loss(
        self,
        adapter: Adapter,
        batch: dict[str, Any],
        generator: torch.Generator | None = None,
        expert_generator: torch.Generator | None = None,
    ) -> LossOutput:
        if self.reference is None:
            raise RuntimeError("DPOObjective has no reference model: FlowModule.configure_model builds it; used alone, "
                               "call objective.configure_model(adapter, lora=...) first")  # fmt: skip
        # Once: both encodes and all four forwards.
        condition = prepare_batch_condition(adapter, batch["condition"], child_generator(generator, CONDITION_STREAM))
        if "chosen_latents" in batch and "rejected_latents" in batch:  # tensor-parquet rows: stored, no VAE runs
            chosen = adapter.stored_latents(batch["chosen_latents"], condition)
            rejected = adapter.stored_latents(batch["rejected_latents"], condition)
            return self.loss(adapter, chosen, rejected, condition, generator, expert_generator)
        if "chosen" not in batch or "rejected" not in batch:
            raise KeyError(f"offline DPO needs preference batches ('chosen', 'rejected'), got keys {sorted(batch)}")
        with torch.no_grad():
            chosen = adapter.encode_output(batch["chosen"], condition, generator=child_generator(generator, 1))
            rejected = adapter.encode_output(batch["rejected"], condition, generator=child_generator(generator, 2))
        return self.loss(adapter, chosen, rejected, condition, generator, expert_generator)

    def loss(
        self,
        adapter: Adapter,
        chosen: LatentState,
        rejected: LatentState,
        condition: Condition,
        generator: torch.Generator | None = None,
        expert_generator: torch.Generator | None = None,
    ) -> LossOutput:
        """Average of ``num_train_timesteps`` Diffusion-DPO terms on one batch of clean latent pairs.

        Per term, ``sigma`` then the noise are drawn from ``generator`` (the order SFT draws them in), once for the
        pair: both arms and both models see exactly these (``expert_generator``: as SFT's).
        """
        _check_same_geometry(chosen, rejected)
        terms, errors, sigmas = [], [], []
        n = self.num_train_timesteps
        draws = monte_carlo_draws(self.timesteps, adapter, chosen, n, generator, expert_generator)
        for sigma, noise in draws:
            errors.append(preference_errors(adapter, self.reference, chosen, rejected, condition, sigma, noise,
                                            self.component_weights, self.frozen_components))
            terms.append(diffusion_dpo_loss(errors[-1], self.beta))
            sigmas.append(leading_sigma(sigma))
        per_sample = torch.stack([t.loss for t in terms]).mean(0)
        sigma = torch.stack(sigmas).detach()
        return LossOutput(loss=per_sample.mean(), per_sample=per_sample, metrics=_metrics(terms, errors, sigma),
                          sigma=sigma)  # fmt: skip


def _metrics(terms: list[DPOTerms], errors: list[PreferenceErrors], sigma: Tensor) -> dict[str, Tensor]:
    """Means over draws and batch: implicit accuracy and rewards (Wallace et al.'s diagnostics), the four errors."""

    def mean(values: list[Tensor]) -> Tensor:
        return torch.stack(values).detach().float().mean()

    return {
        "implicit_accuracy": mean([t.accuracy for t in terms]),
        "reward_chosen": mean([t.reward_chosen for t in terms]),
        "reward_rejected": mean([t.reward_rejected for t in terms]),
        "reward_margin": mean([t.reward_chosen - t.reward_rejected for t in terms]),
        **{f"error_{name}": mean([getattr(e, name) for e in errors])
           for name in ("policy_chosen", "policy_rejected", "reference_chosen", "reference_rejected")},
        "sigma_mean": sigma.mean(),
    }  # fmt: skip


def _check_same_geometry(chosen: LatentState, rejected: LatentState) -> None:
    """Both arms share one noise draw, so their latents must have one shape (the loader fits both to the adapter's
    ``output_geometry()``)."""
    a = {k: tuple(v.shape) for k, v in chosen.components.items()}
    b = {k: tuple(v.shape) for k, v in rejected.components.items()}
    if a != b:
        raise ValueError(f"offline DPO: chosen and rejected latents differ ({a} vs {b}); both arms share one noise "
                         "draw, so both must be encoded at the adapter's output geometry")  # fmt: skip
