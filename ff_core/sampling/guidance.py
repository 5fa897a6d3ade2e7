"""Classifier-free guidance for sampling: per-component scales, guidance rescale, embedded (distilled) guidance and
the second expert's scale (Wan2.2 A14B), shared by evaluation sampling and GRPO rollouts and replays."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ff_core.contracts import Condition, LatentState
    from ff_core.sampling.denoiser import Denoiser

Guidance = float | Mapping[str, float]
"""A guidance setting: one value for every latent component, or one per component name (``{video: 3, audio: 7}``)."""


def guidance_for(value: Guidance, name: str, key: str) -> float:
    """``value`` for the latent component ``name``; a mapping must name it (``key``, the config key, in the error)."""
    if not isinstance(value, Mapping):
        return float(value)
    if name not in value:
        raise ValueError(f"{key} names {sorted(value)}; the latent components are missing {name!r}")
    return float(value[name])


def check_guidance(key: str, value: Guidance, high: float = math.inf) -> Guidance:
    """``value`` (a guidance scale or rescale: one number, or one per latent component name) if every number is in
    ``[0, high]``, else one ``ValueError`` naming ``key``. The component names are checked against the adapter's
    ``latent_components`` before weights load (:func:`ff_core.module.check_components`)."""
    values = list(value.values()) if isinstance(value, Mapping) else [value]
    if not values or any(isinstance(v, bool) or not 0.0 <= float(v) <= high for v in values):
        raise ValueError(f"{key} must be a number in [0, {high:g}] or a mapping of latent component names to such "
                         f"numbers, got {value!r}")  # fmt: skip
    return value


def guides(guidance_scale: Guidance) -> bool:
    """Whether CFG runs (a negative branch is evaluated): some component's scale differs from 1."""
    values = guidance_scale.values() if isinstance(guidance_scale, Mapping) else [guidance_scale]
    return any(float(v) != 1.0 for v in values)


def rescale_guided(guided: Tensor, conditional: Tensor, rescale: float) -> Tensor:
    """Guidance rescale (Lin et al. 2023, "Common Diffusion Noise Schedules and Sample Steps are Flawed", sec. 3.4;
    diffusers' ``rescale_noise_cfg``): ``guided`` scaled to ``conditional``'s per-sample standard deviation, mixed
    ``rescale * that + (1 - rescale) * guided``."""
    dims = list(range(1, guided.ndim))
    rescaled = guided * (conditional.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True))
    return rescale * rescaled + (1 - rescale) * guided


def guided_velocity(
    adapter: Denoiser,
    state: LatentState,
    sigma: float | Mapping[str, float],
    condition: Condition,
    negative: Condition | None,
    scale: Guidance,
    rescale: Guidance = 0.0,
    config_key: str = "model.sampling",
    scale_2: float | None = None,
    detach_negative: bool = False,
) -> LatentState:
    """The velocity at ``(state, sigma)``, with classifier-free guidance when ``negative`` is given: per latent
    component ``k``, ``v_neg + s_k (v - v_neg)`` (``scale``: one for all, or per component). ``sigma`` is one noise
    level for every component (:meth:`Adapter.velocity <ff_core.adapter.Adapter.velocity>`) or one per component name
    (:meth:`Adapter.component_velocity <ff_core.adapter.Adapter.component_velocity>`: components on their own
    schedules).

    With a guidance rescale ``r_k > 0`` (``rescale``, one or per component) the component is guided in x0 space, as
    diffusers' ``LTX2Pipeline`` does: ``x0 = x - sigma_k v`` of both branches (``sigma_k`` the component's level),
    ``x0_g = x0 + (s_k - 1)(x0 - x0_neg)``, :func:`rescale_guided` to the conditional ``x0``'s standard deviation, and
    back ``v = (x - x0_g) / sigma_k`` (in fp32; ``sigma_k > 0`` on every sampling step). Without it the combination
    is the plain one above (the same linear combination, in velocity space). ``config_key`` (``model.sampling``, or
    GRPO's ``model.objective.init_args``) prefixes the keys a mapping that lacks a component is reported under.

    ``detach_negative``: the unconditional branch runs under ``no_grad`` (a constant of the guided velocity; no
    activations kept), so a gradient flows through the conditional branch alone, ``s_k dv/dtheta`` (GRPO's
    ``cfg_replay: detached_uncond``); its values are the same forward's, so the replayed log-prob does not change.

    ``scale_2`` (``guidance_scale_2``): the CFG scale of the steps the denoiser's low-noise expert predicts (Wan2.2
    A14B's ``transformer_2``, :meth:`Adapter.uses_second_expert <ff_core.adapter.Adapter.uses_second_expert>` at the
    first component's level), as ``WanPipeline`` switches ``guidance_scale`` to ``guidance_scale_2`` below its
    boundary; ``None``: ``scale`` on every step.
    """
    scale = expert_guidance(adapter, sigma, scale, scale_2)
    device = next(iter(state.components.values())).device

    def levels(value: float) -> Tensor:
        return torch.full((state.batch_size,), value, device=device)

    if isinstance(sigma, Mapping):
        per = {name: levels(float(value)) for name, value in sigma.items()}

        def predict(c: Condition) -> LatentState:
            return adapter.component_velocity(state, per, c)
    else:
        s = levels(sigma)

        def predict(c: Condition) -> LatentState:
            return adapter.velocity(state, s, c)

    v = predict(condition)
    if negative is None:
        return v
    if detach_negative:
        with torch.no_grad():
            v_neg = predict(negative)
    else:
        v_neg = predict(negative)
    out = {}
    for name, c in v.components.items():
        u, k = v_neg.components[name], guidance_for(scale, name, f"{config_key}.guidance_scale")
        r = guidance_for(rescale, name, f"{config_key}.guidance_rescale")
        if not r:
            out[name] = u + k * (c - u)
            continue
        level = float(sigma[name]) if isinstance(sigma, Mapping) else float(sigma)
        x = state.components[name].float()
        x0, x0_neg = x - level * c.float(), x - level * u.float()
        guided = rescale_guided(x0 + (k - 1) * (x0 - x0_neg), x0, r)
        out[name] = ((x - guided) / level).to(c.dtype)
    return replace(v, components=out, masks=dict(v.masks))


def expert_guidance(
    adapter: Denoiser, sigma: float | Mapping[str, float], scale: Guidance, scale_2: float | None
) -> Guidance:
    """The CFG scale of one step: ``scale_2`` where the adapter's low-noise expert predicts at ``sigma`` (the first
    component's level when per component; :meth:`Adapter.uses_second_expert
    <ff_core.adapter.Adapter.uses_second_expert>`), else ``scale``. ``scale_2`` on a checkpoint with one denoiser is a
    ``ValueError`` (``FlowModule`` refuses the key before sampling)."""
    if scale_2 is None:
        return scale
    level = float(next(iter(sigma.values()))) if isinstance(sigma, Mapping) else float(sigma)
    low = adapter.uses_second_expert(level)
    if low is None:
        raise ValueError(f"guidance_scale_2={scale_2}: adapter {adapter.name!r}'s checkpoint has no low-noise expert")
    return float(scale_2) if low else scale


def guided_conditions(
    adapter: Denoiser,
    condition: Condition,
    guidance_scale: Guidance,
    embedded_guidance: float | None,
    guidance_scale_2: float | None = None,
) -> tuple[Condition, Condition | None]:
    """The condition and CFG's negative branch (``None`` without CFG) of one sampling run.

    CFG (``guidance_scale != 1``) combines two velocities (:func:`guided_velocity`); embedded (distilled) guidance is
    an input of the denoiser (FLUX.1-dev's guidance embedding) that both branches carry
    (:meth:`Adapter.with_embedded_guidance <ff_core.adapter.Adapter.with_embedded_guidance>`). The two are
    independent: a guidance-distilled model samples with one forward per step and no negative prompt.

    Args:
        adapter: the model family's adapter.
        condition: the prepared condition.
        guidance_scale: CFG scale, one or per latent component (1 everywhere: no negative branch).
        embedded_guidance: distilled-guidance scale; ``None``: the adapter's default (the condition as it is).
        guidance_scale_2: the low-noise expert's CFG scale (:func:`expert_guidance`): a negative branch is built when
            either scale guides.
    """
    guided = guides(guidance_scale) or (guidance_scale_2 is not None and guides(guidance_scale_2))
    negative = adapter.unconditional(condition) if guided else None
    if embedded_guidance is not None:
        condition = adapter.with_embedded_guidance(condition, embedded_guidance)
        negative = None if negative is None else adapter.with_embedded_guidance(negative, embedded_guidance)
    return condition, negative
