"""The maths half of the conformance kit: an adapter compared with its family's diffusers pipeline.

:class:`ff_core.testing.conformance.AdapterConformance` runs these checks when a plugin names its reference pipeline;
they are plain functions too, raising :class:`AssertionError` with a message that says what differed, where, and
what it looks like (``velocity at sigma 0.667 ... matches the pipeline's denoiser at timestep x1000``).

One pipeline run (:func:`run_pipeline`) from the adapter's own initial noise, with ``callback_on_step_end`` recording
the latents after every step and the condition tensors the pipeline feeds its denoiser, gives every reference:

* the **condition** (prompt encoding): the pipeline's callback tensors (``prompt_embeds``, ...) against the keys of
  the adapter's prepared condition of the same name;
* **one denoiser call at each sigma** of the schedule: the pipeline's Euler step ``(x_{k+1} - x_k) / (s_{k+1} - s_k)``
  is its velocity at ``(x_k, s_k)``; the adapter's ``velocity`` at the same latents and sigma must equal it;
* the **full sampling run** from the same initial latents, and the **decoded media**.

Latents cross between the two sides through :class:`LatentLayout` (identity for families whose pipeline latents are
the adapter's unpacked ones, SD3 and Wan; a packing family provides the pipeline's own pack and unpack). Elements an
adapter pins (mask 0, a TI2V condition frame) are taken from the adapter's initial state and not compared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ff_core.adapter import Adapter, Condition, LatentState


# -- comparisons with messages -----------------------------------------------------------------------------------
def differences(ours: Tensor, theirs: Tensor, *, atol: float, rtol: float, mask: Tensor | None = None) -> str | None:
    """``None`` when ``ours`` is within ``atol + rtol * |theirs|`` of ``theirs`` wherever ``mask`` is 1 (everywhere
    without one); else what differs and where: the largest difference, its index and both values, how many elements
    are beyond tolerance."""
    if ours.shape != theirs.shape:
        return f"shapes differ: adapter {tuple(ours.shape)}, reference {tuple(theirs.shape)}"
    ours, theirs = ours.detach().double().cpu(), theirs.detach().double().cpu()
    delta = (ours - theirs).abs()
    bad = delta > atol + rtol * theirs.abs()
    if mask is not None:
        keep = torch.broadcast_to(mask.detach().cpu().bool(), delta.shape)
        bad, delta = bad & keep, delta * keep
    if not bad.any():
        return None
    index = tuple(int(i) for i in torch.unravel_index(delta.argmax(), delta.shape))
    return (f"max |adapter - reference| = {float(delta.max()):.4g} at index {list(index)} (adapter "
            f"{float(ours[index]):.4g}, reference {float(theirs[index]):.4g}); {int(bad.sum())} of {bad.numel()} "
            f"elements beyond atol={atol:g}, rtol={rtol:g}")  # fmt: skip


def check_close(what: str, ours: Tensor, theirs: Tensor, *, atol: float, rtol: float = 0.0,
                mask: Tensor | None = None, hint: str = "") -> None:  # fmt: skip
    """Raise ``AssertionError("<what> differs from the reference: <where>. <hint>")`` unless close."""
    problem = differences(ours, theirs, atol=atol, rtol=rtol, mask=mask)
    if problem is not None:
        raise AssertionError(f"{what} differs from the reference: {problem}." + (f" {hint}" if hint else ""))


def is_permutation(ours: Tensor, theirs: Tensor, *, atol: float) -> bool:
    """Whether ``ours`` holds ``theirs``' values in another order (per sample): the signature of a latent
    packing/unpacking of the right shape with the wrong axis order."""
    if ours.shape != theirs.shape:
        return False
    a = ours.detach().double().flatten(1).sort(dim=1).values
    b = theirs.detach().double().flatten(1).sort(dim=1).values
    return bool(((a - b).abs() <= atol + 1e-3 * b.abs()).all())


# -- crossing between the adapter's latents and the pipeline's ----------------------------------------------------
Latents = Tensor | dict[str, Tensor]
"""A pipeline's latents: one tensor (``latents``), or several ``__call__`` arguments by name
(:attr:`LatentLayout.step_tensors`)."""


def _clone(latents: Latents) -> Latents:
    return {k: v.clone() for k, v in latents.items()} if isinstance(latents, dict) else latents.clone()


def first_latents(latents: Latents) -> Tensor:
    """The first stream of pipeline latents (the one whose schedule the sampling steps through)."""
    return next(iter(latents.values())) if isinstance(latents, dict) else latents


@dataclass(frozen=True)
class LatentLayout:
    """How the pipeline's latents map to the adapter's :class:`~ff_core.adapter.LatentState` and back.

    Default: the pipeline's ``latents`` are the adapter's single component, as is (SD3, Wan: unpacked
    ``(B, C, [F,] H, W)``). A family whose pipeline packs latents into tokens (FLUX.1) passes the pipeline's own
    functions (``FluxPipeline._pack_latents`` / ``_unpack_latents``), never the adapter's, so a wrong permutation in
    the adapter cannot hide on both sides.

    A pipeline with several latent streams (LTX-2: video ``latents`` and ``audio_latents``) names every ``__call__``
    argument that carries one in :attr:`step_tensors`; its latents are then a dict by those names, recorded from the
    step callback each step (its ``_callback_tensor_inputs`` must list them), and a pipeline whose ``__call__`` takes
    them in another form than its callback shows (LTX-2: unpacked and denormalised in, packed and normalised out)
    gives that form with :attr:`to_pipeline_call`.

    Attributes:
        to_pipeline: ``(pipe, state) -> latents`` in the pipeline's layout (as its step callback shows them).
        from_pipeline: ``(pipe, latents, like) -> LatentState`` shaped like ``like`` (the adapter's initial state).
        step_tensors: the pipeline's latent arguments, recorded at every step (default: its one ``latents``).
        to_pipeline_call: ``(pipe, state) -> latents`` as ``__call__`` takes them; ``None``: :attr:`to_pipeline`'s.
    """

    to_pipeline: Callable[[Any, LatentState], Latents] | None = None
    from_pipeline: Callable[[Any, Latents, LatentState], LatentState] | None = None
    step_tensors: tuple[str, ...] = ("latents",)
    to_pipeline_call: Callable[[Any, LatentState], Latents] | None = None

    def pipeline_latents(self, pipe: Any, state: LatentState) -> Latents:
        if self.to_pipeline is not None:
            return self.to_pipeline(pipe, state)
        if len(state.components) != 1:
            raise NotImplementedError("several latent components: give the kit a LatentLayout (reference_layout)")
        return next(iter(state.components.values()))

    def call_latents(self, pipe: Any, state: LatentState) -> Latents:
        """The latents ``state`` is passed to the pipeline's ``__call__`` as."""
        if self.to_pipeline_call is not None:
            return self.to_pipeline_call(pipe, state)
        return self.pipeline_latents(pipe, state)

    def adapter_state(self, pipe: Any, latents: Latents, like: LatentState) -> LatentState:
        """The adapter's state for pipeline ``latents``; pinned elements (mask 0) are ``like``'s."""
        if self.from_pipeline is not None:
            state = self.from_pipeline(pipe, latents, like)
        else:
            state = LatentState({next(iter(like.components)): latents})
        components = {}
        for name, tensor in state.components.items():
            mask = like.masks.get(name)
            tensor = tensor.to(like.components[name].dtype)
            components[name] = tensor if mask is None else torch.where(mask.bool(), tensor, like.components[name])
        return LatentState(components, dict(like.masks))


# -- one pipeline run, recorded -----------------------------------------------------------------------------------
@dataclass
class PipelineRun:
    """What :func:`run_pipeline` recorded.

    Attributes:
        latents: the pipeline's latents before the first step and after each (``steps + 1``).
        sigmas: the noise levels it stepped through (``steps + 1``, from its scheduler).
        stream_sigmas: per latent stream (a name of :attr:`latents`' dict) that steps on its own schedule, its noise
            levels (``steps + 1``; MiniMax H3's audio on its own scheduler); the others step on :attr:`sigmas`.
        tensors: its callback tensors at the first step (``prompt_embeds``, ...), besides the latents.
        calls: every denoiser call, ``(component name, module, args, kwargs)``, in order.
        output: the pipeline's output (decoded media).
    """

    latents: list[Latents] = field(default_factory=list)
    sigmas: Tensor | None = None
    stream_sigmas: dict[str, Tensor] = field(default_factory=dict)
    tensors: dict[str, Tensor] = field(default_factory=dict)
    calls: list[tuple[str, nn.Module, tuple, dict]] = field(default_factory=list)
    output: Any = None

    def velocity(self, k: int) -> Latents:
        """The pipeline's velocity at step ``k`` (guidance included): its Euler update over the sigma step (per stream
        when it has several, each over its own schedule's step, :attr:`stream_sigmas`, else :attr:`sigmas`')."""
        after, before = self.latents[k + 1], self.latents[k]
        if isinstance(after, dict):
            out = {}
            for name in after:
                sigmas = self.stream_sigmas.get(name, self.sigmas)
                out[name] = (after[name] - before[name]) / float(sigmas[k + 1] - sigmas[k])
            return out
        return (after - before) / float(self.sigmas[k + 1] - self.sigmas[k])


@torch.no_grad()
def run_pipeline(pipe: Any, latents: Latents, *, steps: int, denoisers: Sequence[str],
                 call_latents: Latents | None = None, **kwargs: Any) -> PipelineRun:  # fmt: skip
    """Call ``pipe`` from ``latents`` for ``steps`` Euler steps, recording a :class:`PipelineRun`.

    Args:
        pipe: the diffusers pipeline.
        latents: initial latents in the pipeline's layout (as its step callback shows them): one tensor, or a dict by
            the ``__call__`` arguments that carry them (several streams), each recorded at every step.
        steps: ``num_inference_steps``.
        denoisers: the pipeline components whose calls are recorded (the adapter's ``denoisers()`` names).
        call_latents: the same latents as ``__call__`` takes them, when that differs (``None``: ``latents``).
        kwargs: every other ``__call__`` argument (prompts, guidance, geometry, ``output_type``, ...).
    """
    run = PipelineRun(latents=[_clone(latents)])
    names = list(latents) if isinstance(latents, dict) else ["latents"]
    inputs = [k for k in getattr(pipe, "_callback_tensor_inputs", ["latents"])]
    missing = [n for n in names if n not in inputs]
    if missing:
        raise AssertionError(f"{type(pipe).__name__}'s step callback does not expose {missing} "
                             f"(_callback_tensor_inputs: {inputs}): the kit cannot record those latents")  # fmt: skip

    def on_step(pipeline, i, t, tensors):
        step = {n: tensors[n].clone() for n in names}
        run.latents.append(step if isinstance(latents, dict) else step["latents"])
        if i == 0:
            run.tensors = {k: v.clone() for k, v in tensors.items() if k not in names and isinstance(v, Tensor)}
        run.sigmas = pipeline.scheduler.sigmas.clone()
        return {}

    handles = []
    for name in denoisers:
        module = getattr(pipe, name, None)
        if isinstance(module, nn.Module):
            def record(mod, args, kw, name=name):
                run.calls.append((name, mod, args, dict(kw)))

            handles.append(module.register_forward_pre_hook(record, with_kwargs=True))
    try:
        given = _clone(latents if call_latents is None else call_latents)
        given = given if isinstance(given, dict) else {"latents": given}
        run.output = pipe(**given, num_inference_steps=steps, callback_on_step_end=on_step,
                          callback_on_step_end_tensor_inputs=inputs, **kwargs)  # fmt: skip
    finally:
        for handle in handles:
            handle.remove()
    if len(run.latents) != steps + 1 or run.sigmas is None:
        raise AssertionError(f"{type(pipe).__name__} ran {len(run.latents) - 1} steps, asked for {steps}")
    run.sigmas = run.sigmas[: steps + 1].float().cpu()
    return run


# -- diagnoses ----------------------------------------------------------------------------------------------------
@torch.no_grad()
def diagnose_velocity(
    pipe: Any, run: PipelineRun, k: int, ours: Tensor, reference: Tensor, layout: LatentLayout, like: LatentState,
    *, atol: float, component: str | None = None,
) -> str:  # fmt: skip
    """What a velocity mismatch at step ``k`` looks like: the pipeline's denoiser re-run with its timestep scaled by
    1000 or 1/1000 (a sigma scaled by ``num_train_timesteps`` twice, or not at all), or the same values in another
    order (a wrong packing permutation). ``ours`` and ``reference`` are in the adapter's layout, of latent component
    ``component`` (``None``: the first); ``""`` when none fits."""
    if is_permutation(ours, reference, atol=atol):
        return ("The adapter's velocity holds the reference's values in another order: a wrong latent packing/"
                "unpacking permutation of the right shape?")  # fmt: skip
    # One denoiser call per step (no CFG batch) and one latent stream: re-run step k's call with a rescaled timestep.
    if len(run.calls) == len(run.latents) - 1 and len(layout.step_tensors) == 1:
        name, module, args, kwargs = run.calls[k]
        if "timestep" in kwargs and isinstance(kwargs["timestep"], Tensor):
            t = kwargs["timestep"]
            for factor, why in ((1000.0, "scaled by num_train_timesteps twice"), (1e-3, "not scaled to timesteps")):
                out = module(*args, **{**kwargs, "timestep": t * factor, "return_dict": False})[0]
                v = layout.adapter_state(pipe, out, like).components[component or next(iter(like.components))]
                if differences(ours, v, atol=atol * 10, rtol=1e-2) is None:
                    return (f"The adapter's velocity is the pipeline's {name} at timestep x{factor:g} "
                            f"({float(t.flatten()[0]):g} -> {float(t.flatten()[0]) * factor:g}): the sigma is {why}.")
    return ("Check the timestep the denoiser gets (sigma vs sigma * num_train_timesteps), the latent (un)packing, "
            "and the condition passed to the denoiser.")


def denoiser_guidance(run: PipelineRun) -> dict[str, float]:
    """The guidance inputs the pipeline's denoiser received at its first recorded call: keyword tensors named
    ``*guidance*`` (FLUX.1's and HunyuanVideo's ``guidance``, the embedded guidance; HunyuanVideo scales it by 1000
    before the call), by name, first element. Empty when none was recorded."""
    if not run.calls:
        return {}
    _, _, _, kwargs = run.calls[0]
    return {k: float(v.flatten()[0]) for k, v in kwargs.items()
            if "guidance" in k and isinstance(v, Tensor) and v.numel()}  # fmt: skip


def state_tensor(state: LatentState) -> Tensor:
    """The first component of ``state``: the one whose noise levels sampling steps through (the CFG check compares
    it; the denoiser, sampling and encoding checks compare every component)."""
    return next(iter(state.components.values()))


def first_mask(state: LatentState) -> Tensor | None:
    return state.masks.get(next(iter(state.components)))


def condition_differences(condition: Condition, reference: dict[str, Tensor], *, atol: float, rtol: float) -> list[str]:
    """Per key both hold, what differs between the adapter's prepared condition and the reference tensors."""
    problems = []
    for key in sorted(set(condition) & set(reference)):
        ours, theirs = condition[key], reference[key]
        if not (isinstance(ours, Tensor) and isinstance(theirs, Tensor)):
            continue
        problem = differences(ours.float(), theirs.float().to(ours.device), atol=atol, rtol=rtol)
        if problem is not None:
            problems.append(f"condition[{key!r}]: {problem}")
    return problems


def velocity_at(adapter: Adapter, state: LatentState, sigma: float | dict[str, float],
                condition: Condition) -> LatentState:  # fmt: skip
    """The adapter's conditional velocity at one noise level for the whole batch (``velocity``), or at one level per
    latent component (``component_velocity``: components on their own schedules)."""
    device = state_tensor(state).device
    if isinstance(sigma, dict):
        levels = {name: torch.full((state.batch_size,), float(s), device=device) for name, s in sigma.items()}
        return adapter.component_velocity(state, levels, condition)
    return adapter.velocity(state, torch.full((state.batch_size,), float(sigma), device=device), condition)
