"""Sampling from flow models: the deterministic ODE (Euler) step and stochastic steps with Gaussian log-probabilities,
shared by :meth:`Adapter.sample <ff_core.adapter.Adapter.sample>` (evaluation) and GRPO rollouts and replays.

Convention (SD3): ``x_sigma = (1 - sigma) x0 + sigma eps``, the network predicts ``v = eps - x0``; a step goes from
``sigma`` to ``sigma_next < sigma``, ``dt = sigma_next - sigma < 0``. Every step is a Gaussian
``x_next ~ N(mean, std^2)`` per element (the ODE step is its ``std = 0`` limit):

* ``ode`` (Euler, diffusers' ``FlowMatchEulerDiscreteScheduler.step``): ``mean = x + v dt``.
* ``flow_sde`` (Flow-GRPO, Liu et al. 2025, arXiv 2505.05470, eq. 9-12): with ``s = eta sqrt(sigma / (1 - sigma))``,
  ``mean = x (1 + s^2 / (2 sigma) dt) + v (1 + s^2 (1 - sigma) / (2 sigma)) dt``, ``std = s sqrt(-dt)``. At
  ``sigma = 1`` the noise scale is infinite; as flow_grpo's ``sde_step_with_logprob``, ``1 - sigma`` is then taken
  at the schedule's second level (``sigma_max``).
* ``cps`` (coefficients-preserving sampling, Wang & Yu 2025, "Coefficients-Preserving Sampling for Reinforcement
  Learning with Flow Matching"): ``std = sigma_next sin(eta pi / 2)``, ``x0_hat = x - sigma v``,
  ``eps_hat = x + (1 - sigma) v``, ``mean = (1 - sigma_next) x0_hat + sqrt(sigma_next^2 - std^2) eps_hat``: the
  sample keeps the noise level ``sigma_next`` exactly. Its log-prob is FlowCPS's by default, ``-(x_next - mean)^2``
  (the Gaussian log-density times ``2 std^2``, constants dropped; ``cps_log_prob: flow_cps``), or the normalised
  Gaussian one (``cps_log_prob: gaussian``), whose log-ratios are ``1 / (2 std^2)`` times FlowCPS's.

Log-probabilities are computed in fp32 and are the **mean over active latent elements** (Flow-GRPO averages over
elements; pinned elements, mask 0, are excluded); over the components of a multi-component state (video + audio)
they reduce as the flow-matching error of SFT and DPO does (:func:`component_mean`): each component's own mean
weighted by ``component_weights`` and summed, ``sum_k w_k m_k`` (LTX-2's default: ``0.5 m_video + 0.5 m_audio``;
MiniMax H3's ``m_video + m_audio``), or pooled by element count without weights (a single component: its mean);
``frozen_components`` are left out. The sampled
``x_next`` is rounded to the state's storage dtype *before* its log-prob is taken, and a :class:`Transition` stores
exactly the inputs replay needs (``x_t``, rounded ``x_next``, the noise levels), so a replay with the same weights
recomputes the same fp32 mean and gets a bitwise-equal log-prob (tests/test_sampling.py). In bf16 the velocity
itself is a bf16 forward: the replay is still bitwise equal when run on the same batch (same kernels), the rounding
of ``x_next`` to bf16 merely moves the sample, not the density it is scored under.

This package imports no objective: ``ff_core.adapter`` uses it for ``Adapter.sample`` and ``ff_core.objectives`` use
it for training, so neither imports the other for sampling maths.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from ff_core.errors import ConfigError

if TYPE_CHECKING:
    from ff_core.contracts import LatentState

StepKind = Literal["ode", "flow_sde", "cps"]
STEP_KINDS: tuple[str, ...] = ("ode", "flow_sde", "cps")
CPSLogProb = Literal["flow_cps", "gaussian"]
CPS_LOG_PROBS: tuple[str, ...] = ("flow_cps", "gaussian")
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
COMPONENT_WEIGHTS_KEY = "model.objective.init_args.component_weights"

Sigmas = tuple[float, float] | Mapping[str, tuple[float, float]]
"""One step's ``(sigma, sigma_next)``, shared by every component or per component name (own schedules)."""


def shift_sigma(sigma: Tensor, shift: float) -> Tensor:
    """SD3's timestep shift (eq. 23): more weight on high noise for larger ``shift``."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def keep_pinned(new: Tensor, old: Tensor, mask: Tensor | None) -> Tensor:
    """``new`` where ``mask`` is 1 (generated elements), ``old`` where it is 0 (pinned by a condition).

    ``torch.where`` rather than ``mask * new + (1 - mask) * old``: a non-finite ``new`` at a pinned element
    must not leak into it (``0 * inf`` is NaN).
    """
    if mask is None:
        return new
    return torch.where(mask.to(device=new.device, dtype=torch.bool), new, old)


def _component_sigmas(sigmas: Sigmas, name: str) -> tuple[float, float]:
    if isinstance(sigmas, Mapping):
        if name not in sigmas:
            raise KeyError(f"no noise levels for latent component {name!r} (got {sorted(sigmas)})")
        return sigmas[name]
    return sigmas


def _component_value(value: float | Mapping[str, float] | None, name: str) -> float | None:
    return value.get(name) if isinstance(value, Mapping) else value


def ode_step(state: LatentState, velocity: LatentState, sigmas: Sigmas) -> LatentState:
    """:func:`euler_step` with each component on its own ``(sigma, sigma_next)`` (or one pair for all)."""
    out = {}
    for name, x in state.components.items():
        sigma, sigma_next = _component_sigmas(sigmas, name)
        out[name] = keep_pinned(x + (sigma_next - sigma) * velocity.components[name], x, state.masks.get(name))
    return replace(state, components=out, masks=dict(state.masks))


def euler_step(state: LatentState, velocity: LatentState, sigma: float, sigma_next: float) -> LatentState:
    """One ODE step ``x <- x + (sigma_next - sigma) * v`` (diffusers' FlowMatchEulerDiscreteScheduler.step).

    Elements the state's masks pin (mask 0) are left unchanged, as in training, where they are never noised.
    """
    if list(state.components) != list(velocity.components):
        raise ValueError(f"latent components differ: {list(state.components)} vs {list(velocity.components)}")
    return ode_step(state, velocity, (sigma, sigma_next))


# -- one Gaussian step, on plain tensors ----------------------------------------------------------------------------
def noise_scale(kind: StepKind, sigma: float, sigma_next: float, eta: float, sigma_max: float | None = None) -> float:
    """flow_grpo's ``std_dev_t`` of a step (flow_grpo/diffusers_patch/sd3_sde_with_logprob.py): for ``flow_sde`` the
    SDE's diffusion coefficient ``eta sqrt(sigma / (1 - sigma))`` (at ``sigma = 1``, ``1 - sigma`` taken at
    ``sigma_max``), whose step std is this times ``sqrt(-dt)``; for ``cps`` the step std itself,
    ``sigma_next sin(eta pi / 2)``; 0 for ``ode``. flow_grpo's SD3 and FLUX ``kl_loss`` divides by ``2 std_dev_t^2``.

    Args:
        kind: ``ode``, ``flow_sde`` or ``cps``.
        sigma: the current noise level.
        sigma_next: the next one, ``< sigma``.
        eta: the noise level of the stochastic steps (Flow-GRPO's ``noise_level``).
        sigma_max: ``flow_sde`` at ``sigma == 1``: the noise level whose ``1 - sigma`` replaces the zero one.
    """
    if kind == "ode":
        return 0.0
    if kind == "flow_sde":
        if sigma >= 1.0:
            if sigma_max is None or sigma_max >= 1.0:
                raise ValueError("flow_sde at sigma = 1 needs sigma_max < 1 (the schedule's second noise level)")
            return eta * math.sqrt(sigma / (1 - sigma_max))
        return eta * math.sqrt(sigma / (1 - sigma))
    if kind == "cps":
        return sigma_next * math.sin(eta * math.pi / 2)
    raise ValueError(f"step kind must be one of {STEP_KINDS}, got {kind!r}")


def step_gaussian(
    kind: StepKind, x: Tensor, v: Tensor, sigma: float, sigma_next: float, eta: float, sigma_max: float | None = None
) -> tuple[Tensor, float]:
    """The fp32 mean and the (scalar) std of ``x_next`` for one step of ``kind`` (formulas: module docstring).

    Args:
        kind: ``ode``, ``flow_sde`` or ``cps``.
        x: the state at ``sigma``.
        v: the predicted velocity at ``(x, sigma)``.
        sigma: the current noise level.
        sigma_next: the next one, ``< sigma``.
        eta: the noise level of the stochastic steps (Flow-GRPO's ``noise_level``, 0.7 there).
        sigma_max: ``flow_sde`` at ``sigma == 1``: the noise level whose ``1 - sigma`` replaces the zero one.
    """
    x, v = x.float(), v.float()
    dt = sigma_next - sigma
    if kind == "ode":
        return x + v * dt, 0.0
    if kind == "flow_sde":
        s = noise_scale(kind, sigma, sigma_next, eta, sigma_max)
        mean = x * (1 + s**2 / (2 * sigma) * dt) + v * (1 + s**2 * (1 - sigma) / (2 * sigma)) * dt
        return mean, s * math.sqrt(-dt)
    if kind == "cps":
        std = noise_scale(kind, sigma, sigma_next, eta)
        x0_hat, eps_hat = x - sigma * v, x + (1 - sigma) * v
        return (1 - sigma_next) * x0_hat + math.sqrt(max(sigma_next**2 - std**2, 0.0)) * eps_hat, std
    raise ValueError(f"step kind must be one of {STEP_KINDS}, got {kind!r}")


def gaussian_log_density(x_next: Tensor, mean: Tensor, std: float) -> Tensor:
    """Element-wise ``log N(x_next; mean, std^2)`` in fp32 (``x_next`` as stored, upcast exactly)."""
    if not std > 0:
        raise ValueError(f"a stochastic step needs std > 0, got {std} (a CPS step onto sigma_next = 0 has none)")
    return -((x_next.float() - mean) ** 2) / (2 * std**2) - math.log(std) - LOG_SQRT_2PI


def step_log_density(kind: StepKind, x_next: Tensor, mean: Tensor, std: float,
                     cps_log_prob: CPSLogProb = "flow_cps") -> Tensor:  # fmt: skip
    """Element-wise log-density of a stochastic step, fp32: :func:`gaussian_log_density`, except for a ``cps`` step
    with ``cps_log_prob: flow_cps``, FlowCPS's ``-(x_next - mean)^2`` (IamCreateAI/FlowCPS and flow_grpo's
    ``sde_type='cps'``, flow_grpo/diffusers_patch/sd3_sde_with_logprob.py: "remove all constants"), which drops the
    Gaussian's ``1 / (2 std^2)`` with the constants, so its log-ratios are ``2 std^2`` times the Gaussian's and
    ``clip_range`` values from FlowCPS / Flow-GRPO-Fast recipes (1e-5) keep their meaning."""
    if kind == "cps" and cps_log_prob == "flow_cps":
        return -((x_next.float() - mean) ** 2)
    if kind == "cps" and cps_log_prob != "gaussian":
        raise ValueError(f"cps_log_prob must be one of {CPS_LOG_PROBS}, got {cps_log_prob!r}")
    return gaussian_log_density(x_next, mean, std)


def component_mean(
    per_element: Mapping[str, Tensor],
    masks: Mapping[str, Tensor | None],
    component_weights: Mapping[str, float] | None = None,
    frozen_components: Collection[str] = (),
) -> Tensor:
    """Per sample, the per-element values of a latent state's components reduced to one number: each component's
    mean over its active elements (mask 1), weighted and summed as ``component_weights`` say; fp32, shape (B,).

    The one reduction of every per-element quantity of a (multi-component) latent state: the flow-matching error of
    SFT and DPO (:func:`~ff_core.objectives.flow_matching.per_sample_squared_error`), GRPO's step log-probabilities
    and its KL term (:func:`step_log_prob`). With ``component_weights`` it is literally ``sum_k w_k m_k``, ``m_k``
    component ``k``'s own mean over its active elements, over the components not left out, **not normalised** by the
    weights' sum: MiniMax H3's "loss = mean over video + mean over audio" (spec, H3) is ``{video: 1, audio: 1}``, and
    DPO's beta and GRPO's ratios see that scale (docs/objectives.md, "Several latent components"). Without
    ``component_weights`` the components are pooled by element count (each active element weighs the same: SD3 and
    Wan's one-component mean, bit for bit). ``frozen_components`` are left out altogether, their terms and weights
    (LTX-2 with a frozen audio: ``0.5 m_video``). Masked-out elements (mask 0, pinned by a condition) contribute
    neither value nor count.

    Args:
        per_element: per component name, values shaped like the component.
        masks: per component name, its {0, 1} mask (absent or ``None``: every element active).
        component_weights: per component name its weight (finite, >= 0; at least one of the components kept > 0);
            every component that is not frozen must be named. ``None``: pooled by element count.
        frozen_components: components left out (``model.frozen_components``).
    """
    if frozen_components:
        kept = {k: v for k, v in per_element.items() if k not in frozen_components}
        if not kept:
            raise ValueError(f"model.frozen_components {sorted(frozen_components)} freezes every latent component "
                             f"{list(per_element)}: nothing left to train")  # fmt: skip
        per_element = kept
        if component_weights is not None:
            component_weights = {k: w for k, w in component_weights.items() if k not in frozen_components}
    if component_weights is not None:
        check_kept_weights(component_weights, list(per_element), frozen_components)
    total = count = weighted = None
    for name, values in per_element.items():
        mask = masks.get(name)
        mask = torch.ones_like(values) if mask is None else mask.to(values).expand_as(values)
        t, c = (values * mask).flatten(1).sum(1), mask.flatten(1).sum(1)
        if component_weights is not None:
            term = float(component_weights[name]) * (t / c.clamp_min(1))
            weighted = term if weighted is None else weighted + term
        total, count = (t, c) if total is None else (total + t, count + c)
    if component_weights is not None:
        return weighted
    return total / count.clamp_min(1)


def check_kept_weights(weights: Mapping[str, float], components: Collection[str],
                       frozen_components: Collection[str] = (), key: str = COMPONENT_WEIGHTS_KEY) -> None:  # fmt: skip
    """``weights`` (frozen components already left out) name exactly ``components`` (the kept ones), each finite and
    >= 0, at least one > 0: a sum of zero terms would train nothing, silently. One :class:`ConfigError` naming
    ``key`` (``model.objective.init_args.component_weights``); ``FlowModule`` runs it before any weight loads where
    the adapter declares its ``latent_components``, :func:`component_mean` on every call."""
    missing = sorted(set(components) - set(weights))
    extra = sorted(set(weights) - set(components))
    if missing or extra:
        raise ConfigError(key, f"names {sorted(weights)}; the latent components are {list(components)}")
    values = [float(weights[k]) for k in components]
    if any(not math.isfinite(w) or w < 0 for w in values) or not any(w > 0 for w in values):
        left_out = f" (frozen and left out: {sorted(frozen_components)})" if frozen_components else ""
        raise ConfigError(key, f"the latent components kept in the loss{left_out} need finite weights >= 0, at least "
                          f"one > 0; got {dict(weights)}")  # fmt: skip


# -- one step of a latent state -------------------------------------------------------------------------------------
@dataclass
class StepResult:
    """One stochastic step of a latent state.

    Attributes:
        next: ``x_next`` in the state's storage dtype (pinned elements unchanged).
        log_prob: per sample, the mean log-density of ``next`` over active elements, fp32, shape (B,).
        mean: per component, the fp32 Gaussian mean (carries the velocity's graph when it has one).
        std: per component, the scalar std.
        noise_scale: per component, flow_grpo's ``std_dev_t`` (:func:`noise_scale`): the std without ``sqrt(-dt)``
            for ``flow_sde``, the std for ``cps``.
    """

    next: LatentState
    log_prob: Tensor
    mean: dict[str, Tensor]
    std: dict[str, float]
    noise_scale: dict[str, float] = field(default_factory=dict)


def step_log_prob(
    state: LatentState,
    velocity: LatentState,
    next_state: LatentState,
    sigmas: Sigmas,
    kind: StepKind,
    eta: float,
    sigma_max: float | Mapping[str, float] | None = None,
    component_weights: Mapping[str, float] | None = None,
    frozen_components: Collection[str] = (),
    cps_log_prob: CPSLogProb = "flow_cps",
) -> StepResult:
    """The log-prob of a given ``next_state`` under one step of ``kind`` from ``state`` (replay; with gradient when
    ``velocity`` has one). Arguments as :func:`sde_step`."""
    means, stds, scales, dens = {}, {}, {}, {}
    for name, x in state.components.items():
        sigma, sigma_next = _component_sigmas(sigmas, name)
        level = _component_value(sigma_max, name)
        means[name], stds[name] = step_gaussian(kind, x, velocity.components[name], sigma, sigma_next, eta, level)
        scales[name] = noise_scale(kind, sigma, sigma_next, eta, level)
        dens[name] = step_log_density(kind, next_state.components[name], means[name], stds[name], cps_log_prob)
    log_prob = component_mean(dens, state.masks, component_weights, frozen_components)
    return StepResult(next_state, log_prob, means, stds, scales)


def sde_step(
    state: LatentState,
    velocity: LatentState,
    sigmas: Sigmas,
    kind: StepKind,
    eta: float,
    generator: torch.Generator | None = None,
    sigma_max: float | Mapping[str, float] | None = None,
    component_weights: Mapping[str, float] | None = None,
    frozen_components: Collection[str] = (),
    cps_log_prob: CPSLogProb = "flow_cps",
) -> StepResult:
    """Draw ``x_next`` for one stochastic step and score it.

    The noise is drawn per component, in component order, on the generator's device (CPU by default) in fp32;
    ``x_next = mean + std * noise`` is rounded to the storage dtype first and its log-prob taken after, so that
    :func:`step_log_prob` on the stored ``x_next`` gives the same value.

    Args:
        state: ``x_t``.
        velocity: the (guided) velocity at ``x_t``.
        sigmas: ``(sigma, sigma_next)``, or per component name (each component on its own schedule).
        kind: ``flow_sde`` or ``cps`` (``ode`` has no density).
        eta: noise level of the step.
        generator: draws the noise; ``None``: the global generator.
        sigma_max: see :func:`step_gaussian`; one for all components or per component name.
        component_weights: how the per-component log-densities reduce to one log-prob per sample
            (:func:`component_mean`; ``None``: pooled by element count).
        frozen_components: components whose log-density is left out of the log-prob (they are still stepped).
        cps_log_prob: a ``cps`` step's log-density (:func:`step_log_density`): FlowCPS's ``flow_cps`` or
            ``gaussian``.
    """
    nxt = {}
    for name, x in state.components.items():
        sigma, sigma_next = _component_sigmas(sigmas, name)
        mean, std = step_gaussian(kind, x, velocity.components[name], sigma, sigma_next, eta,
                                  _component_value(sigma_max, name))  # fmt: skip
        device = generator.device if generator is not None else x.device
        noise = torch.randn(x.shape, generator=generator, device=device, dtype=torch.float32).to(x.device)
        nxt[name] = keep_pinned((mean + std * noise).to(x.dtype), x, state.masks.get(name))
    next_state = replace(state, components=nxt, masks=dict(state.masks))
    return step_log_prob(state, velocity, next_state, sigmas, kind, eta, sigma_max, component_weights,
                         frozen_components, cps_log_prob)


# -- which steps are stochastic -------------------------------------------------------------------------------------
@dataclass
class StochasticSampling:
    """The stochastic sampler of GRPO rollouts: which steps are SDE steps (the trained ones), and how.

    Attributes:
        kind: ``flow_sde`` (Flow-GRPO) or ``cps`` (coefficients-preserving).
        eta: noise level (Flow-GRPO's ``noise_level``; 0.7 there).
        window: ``[start, end)`` step indices where SDE steps may fall. ``None``: every step but the last, the one onto
            ``sigma = 0``, which stays an ODE step so the rewards score clean latents (Flow-Factory's default
            ``sde_steps``, ``0 .. num_inference_steps - 2``, src/flow_factory/hparams/args.py; flow_grpo's
            Flow-GRPO-Fast window ``(0, len(timesteps) - 1)``; flow_grpo's SD3 recipes train the first 9 of 10 steps,
            ``timestep_fraction: 0.99``). ``[0, num_steps]`` makes every ``flow_sde`` step stochastic (ff before
            issue 23). ODE steps elsewhere.
        num_sde_steps: how many SDE steps a rollout takes, drawn uniformly from the window per rollout batch from
            the rollout generator (Flow-GRPO-Fast / MixGRPO style); ``None``: every step of the window.
        cps_log_prob: a ``cps`` step's log-probability: ``flow_cps`` (FlowCPS's ``-(x' - mean)^2``, element mean;
            constants and the Gaussian's ``1 / (2 std^2)`` dropped, as flow_grpo's ``sde_type='cps'``) or
            ``gaussian`` (the normalised density, whose log-ratios are ``1 / (2 std^2)`` times FlowCPS's: 8-7900x on
            SD3.5's late steps, so ``clip_range`` must shrink as much). Unused by ``flow_sde``.
    """

    kind: Literal["flow_sde", "cps"] = "flow_sde"
    eta: float = 0.7
    window: tuple[int, int] | None = None
    num_sde_steps: int | None = None
    cps_log_prob: CPSLogProb = "flow_cps"

    def __post_init__(self) -> None:
        if self.kind not in ("flow_sde", "cps"):
            raise ValueError(f"model.objective.sampler.kind must be 'flow_sde' or 'cps', got {self.kind!r}")
        if self.cps_log_prob not in CPS_LOG_PROBS:
            raise ValueError(f"model.objective.sampler.cps_log_prob must be one of {list(CPS_LOG_PROBS)}, got "
                             f"{self.cps_log_prob!r}")  # fmt: skip
        if not self.eta > 0:
            raise ValueError(f"model.objective.sampler.eta must be > 0, got {self.eta}")
        if self.window is not None:
            self.window = tuple(int(i) for i in self.window)
            if len(self.window) != 2 or not 0 <= self.window[0] < self.window[1]:
                raise ValueError(f"model.objective.sampler.window must be [start, end) with 0 <= start < end, got "
                                 f"{list(self.window)}")  # fmt: skip
        if self.num_sde_steps is not None and self.num_sde_steps < 1:
            raise ValueError(f"model.objective.sampler.num_sde_steps must be >= 1, got {self.num_sde_steps}")

    def candidate_steps(self, num_steps: int) -> list[int]:
        """The window's step indices for a ``num_steps`` schedule, checked against it."""
        last = num_steps - 1 if self.kind == "cps" else num_steps  # CPS onto sigma 0 has std 0
        if self.window is None and num_steps < 2:
            raise ValueError(f"model.objective.sampler.window: the default window (every step but the last) of a "
                             f"{num_steps}-step schedule is empty; set num_steps >= 2 or the window")  # fmt: skip
        start, end = self.window if self.window is not None else (0, num_steps - 1)  # all but the last step
        if end > last:
            raise ValueError(f"model.objective.sampler.window [{start}, {end}) reaches past step {last - 1} of a "
                             f"{num_steps}-step {self.kind} schedule" + (" (a CPS step onto sigma 0 has no noise)"
                                                                        if self.kind == "cps" else ""))  # fmt: skip
        steps = list(range(start, end))
        if self.num_sde_steps is not None and self.num_sde_steps > len(steps):
            raise ValueError(f"model.objective.sampler.num_sde_steps={self.num_sde_steps} exceeds the {len(steps)} "
                             f"steps of the window {[start, end]}")  # fmt: skip
        return steps

    def sde_steps(self, num_steps: int, generator: torch.Generator | None = None) -> list[int]:
        """The SDE step indices of one rollout, ascending (a random subset when ``num_sde_steps`` is set)."""
        steps = self.candidate_steps(num_steps)
        if self.num_sde_steps is None:
            return steps
        chosen = torch.randperm(len(steps), generator=generator)[: self.num_sde_steps]
        return sorted(steps[int(i)] for i in chosen)


# -- whole trajectories ---------------------------------------------------------------------------------------------
@dataclass
class Transition:
    """One stored SDE step of a rollout: all replay needs to recompute its log-prob.

    Attributes:
        step: index in the schedule.
        state: ``x_t`` (storage dtype).
        next: ``x_next`` as sampled, rounded to the storage dtype.
        sigma: noise level of ``state`` the velocity is evaluated at (the first component's).
        sigma_next: the first component's next noise level.
        log_prob: rollout log-prob of ``next``, fp32, shape (B,).
        levels: per component, its ``(sigma, sigma_next)`` (components may run on their own schedules).
    """

    step: int
    state: LatentState
    next: LatentState
    sigma: float
    sigma_next: float
    log_prob: Tensor
    levels: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def velocity_levels(self) -> float | dict[str, float]:
        """The noise level(s) the step's velocity is evaluated at (:func:`guided_velocity`): per component when the
        transition stores them (components on their own schedules), else the first component's."""
        return {k: sigma for k, (sigma, _) in self.levels.items()} if self.levels else self.sigma


@dataclass
class Trajectory:
    """A rollout: the final clean latents and the SDE transitions, in step order.

    Attributes:
        final: the sampled clean latent state.
        transitions: the stochastic steps (the trained ones).
        sigma_max: per component, its schedule's second noise level (``flow_sde`` at ``sigma = 1``).
    """

    final: LatentState
    transitions: list[Transition] = field(default_factory=list)
    sigma_max: dict[str, float] = field(default_factory=dict)
