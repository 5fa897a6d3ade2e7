"""The sampling loops: Euler (ODE) sampling for evaluation and SDE / CPS rollouts with their transitions for GRPO."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

import torch

from ff_core.sampling.guidance import Guidance, guided_conditions, guided_velocity
from ff_core.sampling.schedulers import check_sampling_scheduler, sample_with_schedulers
from ff_core.sampling.steps import StochasticSampling, Trajectory, Transition, ode_step, sde_step

if TYPE_CHECKING:
    from ff_core.contracts import Condition, LatentState
    from ff_core.sampling.denoiser import Denoiser

def schedules(adapter: Denoiser, state: LatentState, num_steps: int, shift: float | None) -> dict[str, list[float]]:
    """Per component, its ``num_steps + 1`` noise levels (:meth:`Adapter.sampling_schedules`), checked."""
    out = {k: [float(x) for x in v] for k, v in adapter.sampling_schedules(state, num_steps, shift=shift).items()}
    if list(out) != list(state.components) or any(len(v) != num_steps + 1 for v in out.values()):
        raise ValueError(f"{adapter.name}: sampling_schedules must give {num_steps + 1} noise levels for each of "
                         f"{list(state.components)}, got {({k: len(v) for k, v in out.items()})}")  # fmt: skip
    return out


def sample_ode(
    adapter: Denoiser,
    condition: Condition,
    *,
    num_steps: int,
    guidance_scale: Guidance = 1.0,
    generator: torch.Generator | None = None,
    shift: float | None = None,
    embedded_guidance: float | None = None,
    guidance_rescale: Guidance = 0.0,
    guidance_scale_2: float | None = None,
    scheduler: str = "checkpoint",
) -> LatentState:
    """Deterministic sampling from ``adapter.initial_noise`` to clean latents (what ``Adapter.sample`` does).

    ``scheduler``: ``checkpoint`` (default) steps with the checkpoint's own scheduler where the adapter gives one that
    is not Euler (:meth:`Adapter.sampling_schedulers <ff_core.adapter.Adapter.sampling_schedulers>`: released Wan
    checkpoints' UniPC; :func:`ff_core.sampling.schedulers.sample_with_schedulers`), so the sample is the family
    pipeline's default output; every other case, and ``euler``, is Euler, as follows. ``guidance_scale_2``: the
    low-noise expert's CFG scale (:func:`expert_guidance`).

    Euler sampling:
    each component steps on its own schedule (:meth:`Adapter.sampling_schedules
    <ff_core.adapter.Adapter.sampling_schedules>`, which sees the initial noise's geometry), the velocity is evaluated
    with every component at its level (:meth:`Adapter.component_velocity
    <ff_core.adapter.Adapter.component_velocity>`), with the conditions of :func:`guided_conditions` and CFG as
    :func:`guided_velocity` combines it (``guidance_scale``, ``guidance_rescale``: one or per component)."""
    check_sampling_scheduler(scheduler)
    state = adapter.initial_noise(condition, generator)
    condition, negative = guided_conditions(adapter, condition, guidance_scale, embedded_guidance, guidance_scale_2)
    own = adapter.sampling_schedulers(state, num_steps, shift) if scheduler == "checkpoint" else None
    if own is not None:
        return sample_with_schedulers(adapter, state, own, condition, negative, guidance_scale, guidance_rescale,
                                      guidance_scale_2)  # fmt: skip
    levels = schedules(adapter, state, num_steps, shift)
    for i in range(num_steps):
        v = guided_velocity(adapter, state, {k: s[i] for k, s in levels.items()}, condition, negative, guidance_scale,
                            guidance_rescale, scale_2=guidance_scale_2)  # fmt: skip
        state = ode_step(state, v, {k: (s[i], s[i + 1]) for k, s in levels.items()})
    return state


def sample_sde(
    adapter: Denoiser,
    condition: Condition,
    sampler: StochasticSampling,
    *,
    num_steps: int,
    guidance_scale: Guidance = 1.0,
    generator: torch.Generator | None = None,
    shift: float | None = None,
    embedded_guidance: float | None = None,
    component_weights: Mapping[str, float] | None = None,
    frozen_components: Collection[str] = (),
    guidance_rescale: Guidance = 0.0,
    config_key: str = "model.objective.init_args",
    guidance_scale_2: float | None = None,
) -> Trajectory:
    """A GRPO rollout: ODE steps outside ``sampler``'s SDE steps, stochastic steps (stored as transitions) on them;
    each component on its own schedule, as :func:`sample_ode`. Each transition's log-prob reduces over the components
    as ``component_weights`` and ``frozen_components`` say (:func:`component_mean`), and its velocity is CFG's
    (:func:`guided_velocity`, ``guidance_scale`` and ``guidance_rescale`` one or per component): replays must pass the
    same. ``guidance_scale_2``: the low-noise expert's CFG scale on the steps it predicts (:func:`expert_guidance`).

    Draw order from ``generator``: the initial noise, the SDE step subset (when ``num_sde_steps`` is set), then each
    SDE step's noise in step order. Call it under ``torch.no_grad()``.
    """
    state = adapter.initial_noise(condition, generator)
    sde = set(sampler.sde_steps(num_steps, generator))
    condition, negative = guided_conditions(adapter, condition, guidance_scale, embedded_guidance, guidance_scale_2)
    levels = schedules(adapter, state, num_steps, shift)
    primary = levels[next(iter(state.components))]
    trajectory = Trajectory(state, sigma_max={k: s[1] for k, s in levels.items() if len(s) > 1})
    for i in range(num_steps):
        v = guided_velocity(adapter, state, {k: s[i] for k, s in levels.items()}, condition, negative, guidance_scale,
                            guidance_rescale, config_key, guidance_scale_2)  # fmt: skip
        steps = {k: (s[i], s[i + 1]) for k, s in levels.items()}
        if i in sde:
            out = sde_step(state, v, steps, sampler.kind, sampler.eta, generator, trajectory.sigma_max,
                           component_weights, frozen_components, sampler.cps_log_prob)
            trajectory.transitions.append(Transition(i, state, out.next, primary[i], primary[i + 1], out.log_prob,
                                                     steps))  # fmt: skip
            state = out.next
        else:
            state = ode_step(state, v, steps)
    trajectory.final = state
    return trajectory
