"""The maths of Flow-GRPO's update (Liu et al. 2025, arXiv 2505.05470, eq. 4-8 and sec. 4), on plain tensors.

For the K samples of one prompt (a group) with rewards ``r_i``, the advantage is ``A_i = (r_i - mean_g r) /
(std_g r + eps)`` (population std of the group; with ``global_std``, the std of every reward of the step, as
Flow-GRPO's ``global_std`` option), computed in float64 as flow_grpo's ``PerPromptStatTracker``
(flow_grpo/stat_tracking.py), and exactly 0 for a group of equal rewards; clipped to ``[-adv_clip_max,
adv_clip_max]`` by the loss. For one trained SDE step with
the log-prob ``l`` under the current policy and ``l_old`` under the rollout's::

    ratio = exp(l - l_old)
    L_policy = mean_i max(-A_i ratio_i, -A_i clip(ratio_i, 1 - clip_range, 1 + clip_range))

and with a KL penalty of weight ``kl_beta`` to the reference policy, either on the step means (element mean of
``|mu_theta - mu_ref|^2`` over ``2 s_sigma^2``, flow_grpo's SD3 ``kl_loss``, ``kl_scale: flow_grpo``; or over
``2 std^2``, the exact KL of the two Gaussian steps, ``kl_scale: exact_gaussian``) or on the velocities
(``|v_theta - v_ref|^2``, element mean), ``L = L_policy + kl_beta * KL`` (:meth:`GRPOObjective.kl
<ff_core.objectives.grpo.GRPOObjective.kl>`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, groups: Tensor, global_std: bool = False, eps: float = 1e-4) -> Tensor:
    """Group-relative advantages ``(r - mean_group) / (std + eps)``, shape like ``rewards``, fp32.

    Computed in float64, as flow_grpo's ``PerPromptStatTracker`` (``np.array(rewards, dtype=np.float64)``): in fp32 the
    mean of K equal rewards is off by a rounding (22.37 x 8 sums to a value that is not 8 x 22.37), and that residue
    divided by ``std + eps ~ 1e-4`` gave a tied group advantages of up to 0.1, one sign for the whole group. A group
    whose rewards are all equal (:func:`tied_groups`) gets exactly 0.

    Args:
        rewards: one reward per sample, shape (N,), every sample of each group present.
        groups: the group id of each sample, shape (N,).
        global_std: divide by the std of all ``rewards`` instead of each group's.
        eps: added to the std (Flow-GRPO's 1e-4).
    """
    r = rewards.double()
    _, inverse, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=torch.float64, device=r.device).index_add_(0, inverse, r)
    mean = (sums / counts)[inverse]
    if global_std:
        std = r.std(correction=0).expand_as(r)
    else:
        sq = torch.zeros_like(sums).index_add_(0, inverse, (r - mean) ** 2)
        std = (sq / counts).sqrt()[inverse]
    advantages = (r - mean) / (std + eps)
    return advantages.masked_fill(tied_groups(rewards, groups), 0.0).float()


def tied_groups(rewards: Tensor, groups: Tensor) -> Tensor:
    """Per sample, whether every reward of its group is equal (the group's reward std is zero), shape (N,), bool:
    such a group teaches nothing (its advantages are 0). flow_grpo logs their share as ``zero_std_ratio``
    (scripts/train_sd3.py, ``calculate_zero_std_ratio``)."""
    _, inverse, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    r = rewards.double()

    def reduce(start: float, how: str) -> Tensor:
        out = torch.full((len(counts),), start, dtype=torch.float64, device=r.device)
        return out.scatter_reduce_(0, inverse, r, how)

    return (reduce(-math.inf, "amax") == reduce(math.inf, "amin"))[inverse]


def zero_std_ratio(rewards: Tensor, groups: Tensor) -> Tensor:
    """The share of groups whose rewards are all equal (zero std), a 0-d fp32 tensor: flow_grpo's ``zero_std_ratio``."""
    tied = tied_groups(rewards, groups)
    _, first = _first_of_each_group(groups)
    return tied[first].float().mean()


def _first_of_each_group(groups: Tensor) -> tuple[Tensor, Tensor]:
    """``(group ids, index of each id's first sample)``."""
    ids, inverse = torch.unique(groups, return_inverse=True)
    positions = torch.arange(len(groups), device=groups.device)
    first = torch.full((len(ids),), len(groups), dtype=torch.long, device=groups.device)
    return ids, first.scatter_reduce_(0, inverse, positions, "amin")


@dataclass
class PolicyTerms:
    """One trained step's clipped surrogate, per sample (shape (B,)).

    Attributes:
        loss: ``max(-A ratio, -A clip(ratio))``.
        ratio: ``exp(l - l_old)``, detached.
        clipped_low: 1 where ``ratio < 1 - clip_range``.
        clipped_high: 1 where ``ratio > 1 + clip_range``.
    """

    loss: Tensor
    ratio: Tensor
    clipped_low: Tensor
    clipped_high: Tensor


def clipped_policy_loss(
    log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, clip_range: float, adv_clip_max: float
) -> PolicyTerms:
    """PPO's clipped surrogate of one step, per sample (module docstring).

    Args:
        log_prob: current policy's log-prob of the stored step, (B,), with gradient.
        old_log_prob: the rollout's, (B,).
        advantages: (B,), unclipped.
        clip_range: the ratio's clip ``epsilon``.
        adv_clip_max: advantages are clipped to ``[-adv_clip_max, adv_clip_max]``.
    """
    adv = advantages.float().clamp(-adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob.float() - old_log_prob.float())
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_range, 1 + clip_range)
    r = ratio.detach()
    return PolicyTerms(torch.maximum(unclipped, clipped), r, (r < 1 - clip_range).float(),
                       (r > 1 + clip_range).float())  # fmt: skip
