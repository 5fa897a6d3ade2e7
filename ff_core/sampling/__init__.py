"""Sampling from flow models: steps and their log-probabilities, guidance, and the loops that use them.

- :mod:`~ff_core.sampling.steps` — the ODE (Euler) step and stochastic steps (Flow-GRPO's SDE, CPS) with Gaussian
  log-probabilities, per-component means, transitions and trajectories;
- :mod:`~ff_core.sampling.guidance` — classifier-free guidance (per component, rescaled, embedded, second expert);
- :mod:`~ff_core.sampling.loops` — Euler sampling for evaluation, SDE / CPS rollouts for GRPO;
- :mod:`~ff_core.sampling.schedulers` — evaluation with the checkpoint's own diffusers scheduler;
- :mod:`~ff_core.sampling.denoiser` — what the loops need of a model (the adapter implements it).

Shared by :meth:`Adapter.sample <ff_core.adapter.Adapter.sample>` (evaluation) and GRPO rollouts and replays; the
names of the first three are importable from here.
"""

from ff_core.sampling.guidance import (
    Guidance,
    check_guidance,
    expert_guidance,
    guidance_for,
    guided_conditions,
    guided_velocity,
    guides,
    rescale_guided,
)
from ff_core.sampling.loops import (
    sample_ode,
    sample_sde,
    schedules,
)
from ff_core.sampling.steps import (
    COMPONENT_WEIGHTS_KEY,
    CPS_LOG_PROBS,
    LOG_SQRT_2PI,
    STEP_KINDS,
    CPSLogProb,
    Sigmas,
    StepKind,
    StepResult,
    StochasticSampling,
    Trajectory,
    Transition,
    check_kept_weights,
    component_mean,
    euler_step,
    gaussian_log_density,
    keep_pinned,
    noise_scale,
    ode_step,
    sde_step,
    shift_sigma,
    step_gaussian,
    step_log_density,
    step_log_prob,
)

__all__ = [
    "COMPONENT_WEIGHTS_KEY",
    "CPS_LOG_PROBS",
    "LOG_SQRT_2PI",
    "STEP_KINDS",
    "CPSLogProb",
    "Guidance",
    "Sigmas",
    "StepKind",
    "StepResult",
    "StochasticSampling",
    "Trajectory",
    "Transition",
    "check_guidance",
    "check_kept_weights",
    "component_mean",
    "euler_step",
    "expert_guidance",
    "gaussian_log_density",
    "guidance_for",
    "guided_conditions",
    "guided_velocity",
    "guides",
    "keep_pinned",
    "noise_scale",
    "ode_step",
    "rescale_guided",
    "sample_ode",
    "sample_sde",
    "schedules",
    "sde_step",
    "shift_sigma",
    "step_gaussian",
    "step_log_density",
    "step_log_prob",
]
