"""Evaluation sampling with the checkpoint's own diffusers scheduler (``model.sampling.scheduler: checkpoint``).

ff's evaluation path (:func:`ff_core.sampling.sample_ode`) steps with Euler (``x <- x + (sigma_next - sigma) v``),
which *is* the family pipeline's sampler wherever the checkpoint ships an Euler scheduler (SD3, FLUX.1, LTX-2:
``FlowMatchEulerDiscreteScheduler``; MiniMax H3: ``MiniMaxH3Scheduler``, a rectified-flow Euler step). Released Wan2.1
/ Wan2.2 checkpoints ship a ``UniPCMultistepScheduler`` (``prediction_type: flow_prediction``, ``use_flow_sigmas``,
``flow_shift``), a multistep predictor-corrector: ``WanPipeline`` samples with it, so Euler steps give other videos
than the pipeline's default for the same seed. Here the loop is the pipeline's (diffusers
``pipelines/wan/pipeline_wan.py``, ``__call__``'s denoising loop)::

    scheduler.set_timesteps(num_steps); scheduler.set_begin_index(0)
    for t in scheduler.timesteps:
        v = CFG(denoiser(x, timestep=t))            # ff: the adapter's velocity at sigma = t / num_train_timesteps
        x = scheduler.step(v, t, x).prev_sample

generic over families: each latent component steps with its own copy of the scheduler (a multi-component state, or
an adapter whose components have schedulers of their own, :meth:`~ff_core.adapter.Adapter.sampling_schedulers`), the
velocity is evaluated with every component at its own level, and elements a state's masks pin (mask 0: Wan2.2 TI2V's
first latent frame, MiniMax H3 FL2VA keyframes) are restored after each step. Restoring them is exact for a scheduler
that acts element by element (every diffusers flow scheduler without ``thresholding``): the generated elements then
see exactly the pipeline's inputs (the pipelines feed the pinned values to the denoiser and overwrite them at the
end); a thresholding scheduler on a masked state is refused.

Only a *flow* scheduler is taken (:func:`is_flow_scheduler`: ``config.prediction_type == "flow_prediction"``, as
UniPC / DPM-Solver / DEIS with flow sigmas, or a ``FlowMatch*`` class such as ``FlowMatchHeunDiscreteScheduler``): the
loop feeds it velocities. A checkpoint whose scheduler predicts ``epsilon``, ``v_prediction`` or ``sample`` (a
third-party adapter carrying a DDPM-era scheduler) would turn them into garbage silently, so it keeps ff's Euler path
(one info line names the class and why). The default gives every latent component a copy of the ONE checkpoint
scheduler (same shift); an adapter whose components need schedules of their own (another shift for an audio stream)
overrides :meth:`~ff_core.adapter.Adapter.sampling_schedulers` and builds one per component.

GRPO rollouts keep ff's Euler / SDE steps (:func:`ff_core.sampling.sample_sde`): their log-probabilities are those
steps' Gaussians. ``model.sampling.scheduler: euler`` keeps Euler for evaluation too (at the checkpoint scheduler's
shift, :meth:`~ff_core.adapter.Adapter.sampling_sigmas`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from ff_core.sampling.guidance import guided_velocity
from ff_core.sampling.steps import keep_pinned

if TYPE_CHECKING:
    from ff_core.contracts import Condition, LatentState
    from ff_core.sampling.denoiser import Denoiser
    from ff_core.sampling.guidance import Guidance

log = logging.getLogger(__name__)

SamplingScheduler = Literal["checkpoint", "euler"]
SAMPLING_SCHEDULERS: tuple[str, ...] = ("checkpoint", "euler")

EULER_SCHEDULERS: tuple[str, ...] = ("FlowMatchEulerDiscreteScheduler", "MiniMaxH3Scheduler")
"""Scheduler classes (or bases) whose ``step`` is the Euler step ff's own sampler takes: checkpoints shipping one keep
ff's Euler path, bit for bit (their pipeline-parity tests hold it to the pipelines)."""


def is_euler_scheduler(scheduler: Any) -> bool:
    """Whether ``scheduler``'s class, or a base of it, is one of :data:`EULER_SCHEDULERS`."""
    return any(cls.__name__ in EULER_SCHEDULERS for cls in type(scheduler).__mro__)


def is_flow_scheduler(scheduler: Any) -> bool:
    """Whether ``scheduler`` takes a velocity in ``step``: its config's ``prediction_type`` is ``flow_prediction``
    (UniPC, DPM-Solver, DEIS, SA-Solver with flow sigmas: Wan's), or its class or a base is a ``FlowMatch*`` one
    (``FlowMatchHeunDiscreteScheduler``, ``FlowMatchLCMScheduler``: no ``prediction_type``, velocity by design)."""
    config = getattr(scheduler, "config", None) or {}
    if config.get("prediction_type") == "flow_prediction":
        return True
    return any(cls.__name__.startswith("FlowMatch") for cls in type(scheduler).__mro__)


@functools.lru_cache(maxsize=None)
def _note_not_flow(name: str, prediction_type: str | None) -> None:
    """One info line per scheduler class that the checkpoint path leaves to ff's Euler steps."""
    log.info("model.sampling.scheduler: checkpoint: the checkpoint's %s (prediction_type %r) is not a flow scheduler "
             "(its step takes no velocity); evaluation samples with ff's Euler steps", name, prediction_type)


def checkpoint_schedulers(
    scheduler: Any, state: LatentState, num_steps: int, shift: float | None = None
) -> dict[str, Any] | None:
    """Per latent component of ``state``, a fresh copy of the checkpoint's ``scheduler`` with its timesteps set for
    ``num_steps`` steps on ``state``'s device; ``None`` when ff's Euler path is the pipeline's sampler already (no
    scheduler, an Euler one, or an object without diffusers' ``set_timesteps`` / ``step``) or the only one that fits
    (a scheduler that is not a flow one, :func:`is_flow_scheduler`: its ``step`` would misread the velocity; logged).

    Every component gets a copy of the same scheduler, so the same schedule (shift): an adapter whose components need
    their own (another shift per stream) overrides :meth:`~ff_core.adapter.Adapter.sampling_schedulers`.

    Args:
        scheduler: the adapter's checkpoint scheduler (a diffusers ``SchedulerMixin``).
        state: the initial noise (component names, device).
        num_steps: sampler steps (``set_timesteps(num_steps)``, as the pipeline).
        shift: ``model.sampling.shift``: replaces the config's ``flow_shift`` (UniPC, DPM-Solver) or ``shift``;
            ``None``: the checkpoint's.
    """
    if scheduler is None or is_euler_scheduler(scheduler):
        return None
    if not all(callable(getattr(scheduler, name, None)) for name in ("set_timesteps", "step", "from_config")):
        return None
    if not is_flow_scheduler(scheduler):
        _note_not_flow(type(scheduler).__name__, (getattr(scheduler, "config", None) or {}).get("prediction_type"))
        return None
    overrides: dict[str, Any] = {}
    if shift is not None:
        key = next((k for k in ("flow_shift", "shift") if k in scheduler.config), None)
        if key is None:
            raise ValueError(f"model.sampling.shift: the checkpoint's {type(scheduler).__name__} has no shift to set; "
                             "leave it unset or sample with model.sampling.scheduler: euler")  # fmt: skip
        overrides[key] = float(shift)
    if state.masks and scheduler.config.get("thresholding", False):
        raise ValueError(f"model.sampling.scheduler: checkpoint: the checkpoint's {type(scheduler).__name__} "
                         "thresholds whole samples, so the elements a condition pins cannot be kept; use "
                         "model.sampling.scheduler: euler")  # fmt: skip
    device = next(iter(state.components.values())).device
    out = {}
    for name in state.components:
        copy = type(scheduler).from_config(scheduler.config, **overrides)
        copy.set_timesteps(num_steps, device=device)
        if callable(getattr(copy, "set_begin_index", None)):
            copy.set_begin_index(0)  # WanPipeline's, before its loop
        out[name] = copy
    return out


def sample_with_schedulers(
    adapter: Denoiser,
    state: LatentState,
    schedulers: Mapping[str, Any],
    condition: Condition,
    negative: Condition | None,
    guidance_scale: Guidance,
    guidance_rescale: Guidance = 0.0,
    guidance_scale_2: float | None = None,
) -> LatentState:
    """The pipeline's denoising loop (module docstring) from ``state`` (the initial noise) to clean latents.

    Args:
        adapter: the model family's adapter.
        state: the initial noise (:meth:`~ff_core.adapter.Adapter.initial_noise`, masks included).
        schedulers: per component, its scheduler with timesteps set (:func:`checkpoint_schedulers`).
        condition: the prepared condition (:func:`~ff_core.sampling.guided_conditions`).
        negative: CFG's branch, or ``None``.
        guidance_scale: CFG scale, one or per component.
        guidance_rescale: guidance rescale, one or per component.
        guidance_scale_2: the low-noise expert's CFG scale (Wan2.2 A14B), or ``None``.
    """
    if list(schedulers) != list(state.components):
        raise ValueError(f"{adapter.name}: sampling_schedulers must give one scheduler for each of "
                         f"{list(state.components)}, got {list(schedulers)}")  # fmt: skip
    timesteps = {k: s.timesteps for k, s in schedulers.items()}
    lengths = {k: len(t) for k, t in timesteps.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"{adapter.name}: the components' schedulers give different step counts {lengths}")
    for i in range(next(iter(lengths.values()))):
        # The pipeline's denoiser sees timestep t; ff's velocity takes sigma and multiplies by num_train_timesteps.
        levels = {k: float(t[i]) / schedulers[k].config.num_train_timesteps for k, t in timesteps.items()}
        v = guided_velocity(adapter, state, levels, condition, negative, guidance_scale, guidance_rescale,
                            scale_2=guidance_scale_2)  # fmt: skip
        out = {}
        for name, x in state.components.items():
            new = schedulers[name].step(v.components[name], timesteps[name][i], x, return_dict=False)[0]
            out[name] = keep_pinned(new, x, state.masks.get(name))
        state = replace(state, components=out, masks=dict(state.masks))
    return state


def check_sampling_scheduler(value: str, key: str = "model.sampling.scheduler") -> SamplingScheduler:
    """``value`` if it is ``checkpoint`` or ``euler``, else a ``ValueError`` naming ``key``."""
    if value not in SAMPLING_SCHEDULERS:
        raise ValueError(f"{key} must be one of {list(SAMPLING_SCHEDULERS)}, got {value!r}")
    return value  # type: ignore[return-value]

