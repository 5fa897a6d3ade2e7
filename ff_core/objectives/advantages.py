"""Group-relative advantages of online RL (Flow-GRPO, DiffusionNFT), on plain tensors, computed in float64.

Two ways to turn several rewards into one advantage per sample (``reward_aggregation``):

* ``sum`` (flow_grpo): the weighted total ``r = sum_k w_k r_k`` normalised within its group, ``A = (r - mean_g r) /
  (std + 1e-4)``, the std the group's or (``global_std``) the whole step's: :func:`group_advantages`.
* ``gdpo`` (Flow-Factory's ``advantage_aggregation: gdpo``, ``AdvantageProcessor.compute_gdpo``): each reward
  normalised within its group first, ``a_k = (r_k - mean_g r_k) / max(std_g r_k, 1e-6)``, then ``c = sum_k w_k a_k``
  batch-normalised over the step, ``A = (c - mean c) / max(std c, 1e-6)``: one reward's scale (JPEG kB against a
  [0, 1] aesthetic score) cannot drown the others. :func:`gdpo_advantages`.

A group whose rewards are all equal gets exactly 0 in both (its rounding residue would otherwise be amplified by the
small divisor).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

GDPO_EPS = 1e-6
"""Flow-Factory's floor on GDPO's standard deviations (``max(np.std(...), 1e-6)``)."""


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


def gdpo_advantages(per_reward: Mapping[str, Tensor], weights: Mapping[str, float], groups: Tensor) -> Tensor:
    """GDPO advantages (module docstring), fp32, shape (N,): each reward normalised within its group (population
    std, floored at :data:`GDPO_EPS`; a group tied in that reward contributes exactly 0), weighted, summed, and the
    sum normalised over every sample (population mean and std, floored likewise). Samples whose group is tied in
    every reward get exactly 0.

    Transcribes Flow-Factory's ``AdvantageProcessor.compute_gdpo`` (src/flow_factory/advantage/advantage_processor.py),
    in float64 as its NumPy arrays.

    Args:
        per_reward: per reward key, one score per sample, shape (N,), every sample of each group present.
        weights: per reward key, its weight.
        groups: the group id of each sample, shape (N,).
    """
    _, inverse, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    combined = torch.zeros(len(groups), dtype=torch.float64, device=groups.device)
    all_tied = torch.ones(len(groups), dtype=torch.bool, device=groups.device)
    for key, scores in per_reward.items():
        r = scores.double().to(groups.device)
        sums = torch.zeros(len(counts), dtype=torch.float64, device=r.device).index_add_(0, inverse, r)
        mean = (sums / counts)[inverse]
        sq = torch.zeros_like(sums).index_add_(0, inverse, (r - mean) ** 2)
        std = (sq / counts).sqrt()[inverse].clamp_min(GDPO_EPS)
        tied = tied_groups(scores, groups)
        combined += float(weights[key]) * ((r - mean) / std).masked_fill(tied, 0.0)
        all_tied &= tied
    advantages = (combined - combined.mean()) / combined.std(correction=0).clamp_min(GDPO_EPS)
    return advantages.masked_fill(all_tied, 0.0).float()
