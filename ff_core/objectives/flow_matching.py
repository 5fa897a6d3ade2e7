"""Rectified-flow maths shared by every objective: timestep sampling, noising, targets, Euler steps.

Convention (SD3, Esser et al. 2024, "Scaling Rectified Flow Transformers", sec. 2-3):
``x_sigma = (1 - sigma) * x0 + sigma * eps`` with ``sigma`` in [0, 1] (1 is pure noise) and the network
predicting the velocity ``v = eps - x0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ff_core.adapter import LatentState


@dataclass
class TimestepSampler:
    """How training noise levels are drawn, one per sample.

    Attributes:
        weighting: ``logit_normal`` (sigma = sigmoid(n), n ~ N(mean, std); SD3 sec. 3.1) or ``uniform``.
        logit_mean: mean of the logit-normal.
        logit_std: standard deviation of the logit-normal.
        shift: SD3 resolution shift, ``sigma <- shift * sigma / (1 + (shift - 1) * sigma)``; 1 disables it.
    """

    weighting: Literal["logit_normal", "uniform"] = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0

    def __post_init__(self) -> None:
        if self.weighting not in ("logit_normal", "uniform"):
            raise ValueError(f"weighting must be 'logit_normal' or 'uniform', got {self.weighting!r}")
        if self.logit_std <= 0:
            raise ValueError(f"logit_std must be > 0, got {self.logit_std}")
        if self.shift <= 0:
            raise ValueError(f"shift must be > 0, got {self.shift}")

    def sample(self, batch_size: int, generator: torch.Generator | None = None, device=None) -> Tensor:
        if self.weighting == "logit_normal":
            n = torch.randn(batch_size, generator=generator) * self.logit_std + self.logit_mean
            sigma = torch.sigmoid(n)
        else:
            sigma = torch.rand(batch_size, generator=generator)
        return shift_sigma(sigma, self.shift).to(device)


def shift_sigma(sigma: Tensor, shift: float) -> Tensor:
    """SD3's timestep shift (eq. 23): more weight on high noise for larger ``shift``."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def _bcast(sigma: Tensor, like: Tensor) -> Tensor:
    return sigma.to(like.dtype).reshape(-1, *([1] * (like.ndim - 1)))


def add_noise(x0: Tensor, noise: Tensor, sigma: Tensor) -> Tensor:
    """``x_sigma = (1 - sigma) * x0 + sigma * noise``, ``sigma`` per sample (shape (B,))."""
    s = _bcast(sigma, x0)
    return (1 - s) * x0 + s * noise


def velocity_target(x0: Tensor, noise: Tensor) -> Tensor:
    """The rectified-flow regression target ``noise - x0``."""
    return noise - x0


def euler_step(state: LatentState, velocity: LatentState, sigma: float, sigma_next: float) -> LatentState:
    """One ODE step ``x <- x + (sigma_next - sigma) * v`` (diffusers' FlowMatchEulerDiscreteScheduler.step)."""
    return state.zip_map(velocity, lambda x, v: x + (sigma_next - sigma) * v)


def per_sample_squared_error(pred: LatentState, target: LatentState) -> Tensor:
    """Mean squared error per sample in fp32, averaged over every active element of every component.

    Components are pooled by element count, so a video + audio state weighs each latent element equally.
    Masked-out elements (mask 0, pinned by a condition) contribute neither error nor count.
    """
    total, count = None, None
    for name, p in pred.components.items():
        t = target.components[name]
        err = (p.float() - t.float()) ** 2
        mask = pred.masks.get(name, target.masks.get(name))
        if mask is None:
            mask = torch.ones_like(err)
        else:
            mask = mask.to(err.dtype).expand_as(err)
        e = (err * mask).flatten(1).sum(1)
        c = mask.flatten(1).sum(1)
        total = e if total is None else total + e
        count = c if count is None else count + c
    return total / count.clamp_min(1)
