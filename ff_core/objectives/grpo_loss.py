"""The maths of Flow-GRPO's update (Liu et al. 2025, arXiv 2505.05470, eq. 4-8 and sec. 4), on plain tensors.

For the K samples of one prompt (a group) with rewards ``r_i``, the advantage is ``A_i = (r_i - mean_g r) /
(std_g r + eps)`` (population std of the group; with ``global_std``, the std of every reward of the step, as
Flow-GRPO's ``global_std`` option), clipped to ``[-adv_clip_max, adv_clip_max]``. For one trained SDE step with
the log-prob ``l`` under the current policy and ``l_old`` under the rollout's::

    ratio = exp(l - l_old)
    L_policy = mean_i max(-A_i ratio_i, -A_i clip(ratio_i, 1 - clip_range, 1 + clip_range))

and with a KL penalty of weight ``kl_beta`` to the reference policy, either on the step means
(``|mu_theta - mu_ref|^2 / (2 std^2)``, element mean: the KL of the two Gaussian steps, Flow-GRPO's ``kl_loss``) or
on the velocities (``|v_theta - v_ref|^2``, element mean), ``L = L_policy + kl_beta * KL``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, groups: Tensor, global_std: bool = False, eps: float = 1e-4) -> Tensor:
    """Group-relative advantages ``(r - mean_group) / (std + eps)``, fp32, shape like ``rewards``.

    Args:
        rewards: one reward per sample, shape (N,), every sample of each group present.
        groups: the group id of each sample, shape (N,).
        global_std: divide by the std of all ``rewards`` instead of each group's.
        eps: added to the std (Flow-GRPO's 1e-4), so a group of equal rewards gets zero advantages.
    """
    rewards = rewards.float()
    _, inverse, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=torch.float32, device=rewards.device).index_add_(0, inverse, rewards)
    mean = (sums / counts)[inverse]
    if global_std:
        std = rewards.std(correction=0).expand_as(rewards)
    else:
        sq = torch.zeros_like(sums).index_add_(0, inverse, (rewards - mean) ** 2)
        std = (sq / counts).sqrt()[inverse]
    return (rewards - mean) / (std + eps)


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
