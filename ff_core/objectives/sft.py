"""Supervised flow matching (SFT) on demonstrations.

For a clean latent ``x0`` and noise ``eps``: ``x_sigma = (1 - sigma) x0 + sigma eps``, target ``v = eps - x0``,
loss = fp32 squared error per sample averaged over elements (Lipman et al. 2023; Esser et al. 2024).
``num_train_timesteps`` independent (sigma, eps) draws are averaged inside the microbatch (spec: "Offline
dataloader and epoch semantics"); it does not change epoch length or gradient accumulation.

Targets are decoded media encoded on the fly (``batch["target"]``), or clean latents stored in tensor-parquet shards
(``batch["latents"]``, :mod:`ff_core.data.tensor_parquet.rows`). Either way the (sigma, eps) draws come from the same
generator in the same order (the VAE's posterior sample uses a child generator), so a batch whose stored latents
equal the encoded ones gives the same loss.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch

from ff_core.objectives.base import LossOutput, Objective
from ff_core.objectives.flow_matching import (
    CONDITION_STREAM,
    Sigma,
    TimestepSampler,
    check_component_weights,
    child_generator,
    leading_sigma,
    monte_carlo_draws,
    noise_state,
    per_sample_squared_error,
    prepare_batch_condition,
    resolve_component_weights,
    velocity_target,
)

if TYPE_CHECKING:
    from ff_core.adapter import Adapter, Condition, LatentState


class SFTObjective(Objective):
    """Flow-matching regression on demonstration targets.

    Args:
        timesteps: how noise levels are drawn per sample (logit-normal with SD3 shift, or uniform).
        num_train_timesteps: independent Monte-Carlo (sigma, noise) terms averaged per microbatch.
        component_weights: how a multi-component latent state's error reduces per sample
            (:func:`~ff_core.objectives.flow_matching.per_sample_squared_error`): ``None`` uses the adapter's
            ``default_component_weights`` (``None`` there too: every latent element of every component pooled);
            a mapping sums each component's mean error times its weight, ``sum_k w_k e_k``, unnormalised
            (``{video: 1.0, audio: 1.0}``: MiniMax H3's "mean over video + mean over audio"; ``audio: 0``: the audio
            stream is denoised but not trained on).
    """

    trainer_type = "sft"
    supports_frozen_components = True

    def __init__(
        self,
        timesteps: TimestepSampler | None = None,
        num_train_timesteps: int = 1,
        component_weights: dict[str, float] | None = None,
    ) -> None:
        if num_train_timesteps < 1:
            raise ValueError(f"model.objective.num_train_timesteps must be >= 1, got {num_train_timesteps}")
        self.timesteps = timesteps or TimestepSampler()
        self.num_train_timesteps = num_train_timesteps
        self.component_weights = check_component_weights(component_weights)

    def training_loss(
        self,
        adapter: Adapter,
        batch: dict[str, Any],
        generator: torch.Generator | None = None,
        expert_generator: torch.Generator | None = None,
    ) -> LossOutput:
        condition = prepare_batch_condition(adapter, batch["condition"], child_generator(generator, CONDITION_STREAM))
        if "latents" in batch:  # rows of tensor-parquet shards: the clean latents are stored, no VAE runs
            clean = adapter.stored_latents(batch["latents"], condition)
        else:
            with torch.no_grad():
                clean = adapter.encode_output(batch["target"], condition, generator=child_generator(generator, 1))
        return self.loss(adapter, clean, condition, generator, expert_generator)

    def loss(
        self,
        adapter: Adapter,
        clean: LatentState,
        condition: Condition,
        generator: torch.Generator | None = None,
        expert_generator: torch.Generator | None = None,
    ) -> LossOutput:
        """Average of ``num_train_timesteps`` flow-matching terms on one batch of clean latents.

        Sigmas and noise are drawn from ``generator`` (CPU; ``None``: the global generator), in that order per term;
        with ``expert_generator`` (shared by the ranks) each term's sigmas route to one expert
        (:func:`~ff_core.objectives.flow_matching.monte_carlo_draws`).
        """
        terms, sigmas = [], []
        draws = monte_carlo_draws(self.timesteps, adapter, clean, self.num_train_timesteps, generator, expert_generator)
        for sigma, noise in draws:
            terms.append(flow_matching_error(adapter, clean, condition, sigma, noise, self.component_weights,
                                             self.frozen_components))
            sigmas.append(leading_sigma(sigma))
        per_sample = torch.stack(terms).mean(0)
        sigma = torch.stack(sigmas).detach()
        return LossOutput(loss=per_sample.mean(), per_sample=per_sample, metrics={"sigma_mean": sigma.mean()},
                          sigma=sigma)  # fmt: skip


def flow_matching_error(
    adapter: Adapter,
    clean: LatentState,
    condition: Condition,
    sigma: Sigma,
    noise: LatentState,
    component_weights: dict[str, float] | None = None,
    frozen_components: Collection[str] = (),
) -> torch.Tensor:
    """One Monte-Carlo term: per-sample ``|v_theta(x_sigma, sigma) - (noise - x0)|^2`` averaged over elements
    (over components as ``component_weights`` says: :func:`~ff_core.objectives.flow_matching.per_sample_squared_error`;
    ``None``: the adapter's ``default_component_weights``).

    Elements the clean state's masks pin (mask 0, e.g. an I2AV first frame) enter the denoiser clean and are
    left out of the error, and so are the ``frozen_components`` (noised and denoised all the same). A per-component
    ``sigma`` (dict, :meth:`~ff_core.adapter.Adapter.timestep_shifts`) noises each component at its own level and
    asks :meth:`~ff_core.adapter.Adapter.component_velocity`; the target is ``noise - x0`` either way.
    """
    noisy = noise_state(clean, noise, sigma)
    target = clean.zip_map(noise, velocity_target)
    if isinstance(sigma, dict):
        pred = adapter.component_velocity(noisy, sigma, condition)
    else:
        pred = adapter.velocity(noisy, sigma, condition)
    weights = resolve_component_weights(adapter, component_weights)
    return per_sample_squared_error(pred, target, weights, frozen_components)
