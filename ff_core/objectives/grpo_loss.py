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

from dataclasses import dataclass

import torch
from torch import Tensor

# Group advantages are shared with DiffusionNFT: they live in advantages.py (imported here for older imports).
from ff_core.objectives.advantages import group_advantages, tied_groups, zero_std_ratio  # noqa: F401


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
