"""The maths of DiffusionNFT's update (Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward
Process", arXiv 2509.16117), on plain tensors, as its official trainer computes it (NVlabs/DiffusionNFT,
``scripts/train_nft_sd3.py``).

A rollout's clean sample ``x0`` is noised on the forward process, ``x_t = (1 - t) x0 + t eps`` at one of the rollout
schedule's levels ``t``; with the trained velocity ``v`` and the sampling (old) policy's ``v_old`` at ``x_t``, the
implicit positive and negative policies are::

    v+ = beta v + (1 - beta) v_old          v- = (1 + beta) v_old - beta v

Each is judged in x0 space, ``x0± = x_t - t v±``, with an adaptive (self-normalising) weight, the sample's mean
absolute x0 error, held constant::

    L± = mean((x0± - x0)^2) / sg(max(mean|x0± - x0|, 1e-5))

and weighted by the sample's optimality probability ``r = clip(clip(A, -c, c) / c / 2 + 1/2, 0, 1)`` (``A`` its
group advantage, ``c = adv_clip_max``)::

    L = c (r L+ + (1 - r) L-) / beta   (+ kl_beta mean((v - v_ref)^2) with a reference)

A sample better than its group (``r > 1/2``) pulls ``v`` so that the positive mixture reconstructs it, a worse one
pushes the negative mixture onto it (which moves ``v`` away from it): no likelihoods, no sampler in the loss.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ff_core.sampling import component_mean

AdvantageMode = Literal["all", "positive_only", "negative_only", "binary", "one_only"]
WEIGHT_FLOOR = 1e-5
"""The official trainer's floor on the adaptive weight (``.clip(min=0.00001)``)."""


def optimality_probability(advantages: Tensor, adv_clip_max: float, mode: AdvantageMode = "all") -> Tensor:
    """``r`` in [0, 1] per sample from its advantage (module docstring), with the official trainer's ``adv_mode``:
    ``positive_only`` / ``negative_only`` keep one sign (the other becomes 0, ``r = 1/2``), ``binary`` takes the sign
    (``r`` in {0, 1/2, 1}), ``one_only`` maps positive advantages to 1 and the rest to 0 (``r`` in {1/2, ~0.6})."""
    a = advantages.float().clamp(-adv_clip_max, adv_clip_max)
    if mode == "positive_only":
        a = a.clamp(0, adv_clip_max)
    elif mode == "negative_only":
        a = a.clamp(-adv_clip_max, 0)
    elif mode == "one_only":
        a = torch.where(a > 0, torch.ones_like(a), torch.zeros_like(a))
    elif mode == "binary":
        a = torch.sign(a)
    elif mode != "all":
        raise ValueError(f"adv_mode must be one of all, positive_only, negative_only, binary, one_only; got {mode!r}")
    return ((a / adv_clip_max) / 2.0 + 0.5).clamp(0, 1)


@dataclass
class NFTTerms:
    """One (micro-batch, timestep)'s DiffusionNFT terms, per sample (shape (B,)).

    Attributes:
        loss: ``c (r L+ + (1 - r) L-) / beta``, with gradient.
        positive: ``L+``, detached.
        negative: ``L-``, detached.
    """

    loss: Tensor
    positive: Tensor
    negative: Tensor


def nft_policy_loss(
    velocity: Mapping[str, Tensor],
    old_velocity: Mapping[str, Tensor],
    noisy: Mapping[str, Tensor],
    clean: Mapping[str, Tensor],
    sigma: Mapping[str, Tensor],
    r: Tensor,
    beta: float,
    adv_clip_max: float,
    masks: Mapping[str, Tensor | None] | None = None,
    component_weights: Mapping[str, float] | None = None,
    frozen_components: Collection[str] = (),
) -> NFTTerms:
    """DiffusionNFT's policy loss of one timestep (module docstring), per sample.

    Several latent components reduce as every per-element term of ff does (:func:`~ff_core.sampling.component_mean`:
    pooled by element count, or ``sum_k w_k m_k``); the adaptive weight is the reduction's own mean absolute error
    (pooled: one over every element of the sample, as the official trainer's one tensor; weighted: each component's).

    Args:
        velocity: per component, the trained policy's velocity ``v`` (B, ...), with gradient.
        old_velocity: per component, the sampling policy's ``v_old``.
        noisy: per component, ``x_t``.
        clean: per component, the rollout's ``x0``.
        sigma: per component, each sample's noise level ``t``, shape (B,).
        r: the optimality probabilities, shape (B,).
        beta: the implicit policies' mixing strength (the official ``config.beta``).
        adv_clip_max: ``c``: the loss is scaled by it, as the official trainer's.
        masks: per component, its {0, 1} mask (pinned condition elements, 0, leave the loss).
        component_weights: the components' weights (``None``: pooled).
        frozen_components: components left out.
    """
    masks = dict(masks or {})

    def mixed_loss(v_mix: Mapping[str, Tensor]) -> Tensor:
        errors = {}
        for k, v in v_mix.items():
            s = sigma[k].to(v.device, torch.float32).reshape(-1, *([1] * (v.ndim - 1)))
            errors[k] = noisy[k].float() - s * v.float() - clean[k].float()  # x0 prediction minus x0
        absolute = {k: e.detach().double().abs() for k, e in errors.items()}
        if component_weights is None:  # one weight per sample over every element, the official trainer's
            w = component_mean(absolute, masks, None, frozen_components).clamp_min(WEIGHT_FLOOR)
            weights = dict.fromkeys(errors, w)
        else:
            weights = {k: component_mean({k: a}, {k: masks.get(k)}).clamp_min(WEIGHT_FLOOR)
                       for k, a in absolute.items()}
        scaled = {k: e**2 / weights[k].float().reshape(-1, *([1] * (e.ndim - 1))) for k, e in errors.items()}
        return component_mean(scaled, masks, component_weights, frozen_components)

    positive = mixed_loss({k: beta * v + (1 - beta) * old_velocity[k].detach() for k, v in velocity.items()})
    negative = mixed_loss({k: (1 + beta) * old_velocity[k].detach() - beta * v for k, v in velocity.items()})
    r = r.to(positive.device).float()
    loss = adv_clip_max * (r * positive + (1 - r) * negative) / beta
    return NFTTerms(loss=loss, positive=positive.detach(), negative=negative.detach())


def old_policy_decay(step: int, flat_steps: int = 0, ramp_rate: float = 0.001, max_decay: float = 0.5) -> float:
    """The sampling policy's EMA decay after optimiser step ``step``: 0 for the first ``flat_steps``, then rising by
    ``ramp_rate`` per step up to ``max_decay`` (the official ``return_decay``: its ``decay_type`` 1 is the default
    ``(0, 0.001, 0.5)``, type 2 ``(75, 0.0075, 0.999)`` (its OCR recipe), type 0 ``(0, 0, 0)``: the old policy is the
    current one). ``old <- decay * old + (1 - decay) * current`` after each iteration."""
    if step < flat_steps:
        return 0.0
    return min((step - flat_steps) * ramp_rate, max_decay)
