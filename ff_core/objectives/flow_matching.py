"""Rectified-flow training maths shared by every objective: timestep sampling, noising, targets (sampling steps:
:mod:`ff_core.sampling`, re-exported here).

Convention (SD3, Esser et al. 2024, "Scaling Rectified Flow Transformers", sec. 2-3):
``x_sigma = (1 - sigma) * x0 + sigma * eps`` with ``sigma`` in [0, 1] (1 is pure noise) and the network
predicting the velocity ``v = eps - x0``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from ff_core.sampling import COMPONENT_WEIGHTS_KEY, component_mean, euler_step, keep_pinned, shift_sigma  # noqa: F401
from ff_core.seeding import derive_seed

if TYPE_CHECKING:
    from ff_core.adapter import Adapter, Condition, LatentState


@dataclass
class TimestepSampler:
    """How training noise levels are drawn, one per sample.

    Attributes:
        weighting: ``logit_normal`` (sigma = sigmoid(n), n ~ N(mean, std); SD3 sec. 3.1) or ``uniform``.
        logit_mean: mean of the logit-normal.
        logit_std: standard deviation of the logit-normal.
        shift: SD3 resolution shift, ``sigma <- shift * sigma / (1 + (shift - 1) * sigma)``; 1 disables it.
            ``None`` (default) takes the adapter's (:meth:`~ff_core.adapter.Adapter.timestep_shift`: for SD3 the
            checkpoint scheduler's ``shift``), so training draws noise levels on the schedule sampling uses; where
            the adapter gives one shift per component (:meth:`resolve_shifts`), each component's. Set, it applies to
            every component.
        schedule: ``continuous`` (default): sigma is the weighting's draw, shifted by :attr:`shift`. ``adapter``: the
            weighting's draw ``u`` picks level ``floor(u * N)`` of the adapter's ``N`` training noise levels for the
            batch's latent geometry (:meth:`~ff_core.adapter.Adapter.training_sigmas`) sorted ascending, so sigma
            grows with ``u`` and :attr:`logit_mean` means what it means for ``continuous`` (> 0: noisier). diffusers'
            training scripts index their descending table with ``u`` (``sigmas[(u * num_train_timesteps).long()]``):
            the same levels with the same probabilities for a symmetric weighting (uniform, ``logit_mean`` 0), the
            mirrored ones for ``logit_mean`` m, which ff reaches with ``-m``. The table holds the adapter's shift,
            so :attr:`shift` must stay ``None``.
        expert_choice: with routed experts (Wan2.2 A14B, :meth:`~ff_core.adapter.Adapter.uses_second_expert`), how
            the noise levels pick them. ``per_sample``: each sample's draw picks its own, as the reference trainers
            do. ``per_micro_batch``: per micro-batch and draw, one expert for every sample, on every data-parallel
            rank alike: one level drawn from a generator all ranks seed alike (run seed, step, micro-batch) picks it
            (so each expert with the probability the distribution gives its range of levels), then each sample's
            level is drawn from this rank's generator within that range (the distribution restricted to it, by
            rejection): each sample's level keeps the ``per_sample`` distribution
            (plugins/ff_wan/tests/test_wan_a14b_fsdp2.py), and every rank runs the same expert's forward, which FSDP2
            needs (each expert's all-gathers in the same order on every rank). ``auto`` (default):
            ``per_micro_batch`` under FSDP2 and DeepSpeed, ``per_sample`` otherwise.
    """

    weighting: Literal["logit_normal", "uniform"] = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float | None = None
    schedule: Literal["continuous", "adapter"] = "continuous"
    expert_choice: Literal["auto", "per_sample", "per_micro_batch"] = "auto"

    def __post_init__(self) -> None:
        if self.weighting not in ("logit_normal", "uniform"):
            raise ValueError(f"weighting must be 'logit_normal' or 'uniform', got {self.weighting!r}")
        if self.logit_std <= 0:
            raise ValueError(f"logit_std must be > 0, got {self.logit_std}")
        if self.shift is not None and self.shift <= 0:
            raise ValueError(f"shift must be > 0 (or null for the adapter's), got {self.shift}")
        if self.schedule not in ("continuous", "adapter"):
            raise ValueError(f"schedule must be 'continuous' or 'adapter', got {self.schedule!r}")
        if self.schedule == "adapter" and self.shift is not None:
            raise ValueError(f"shift={self.shift} with schedule='adapter': the adapter's table of training noise "
                             "levels holds its own shift; leave shift null or use schedule='continuous'")  # fmt: skip
        if self.expert_choice not in ("auto", "per_sample", "per_micro_batch"):
            raise ValueError(f"expert_choice must be 'auto', 'per_sample' or 'per_micro_batch', got "
                             f"{self.expert_choice!r}")  # fmt: skip

    def resolve_shift(self, adapter: Adapter, clean: LatentState | None = None) -> float:
        """The recipe's :attr:`shift`, else the adapter's for latents shaped like ``clean``.

        Args:
            adapter: the model family's adapter.
            clean: the batch's clean latents (a resolution-dependent shift depends on their size); ``None``: the
                adapter's sampling resolution.
        """
        return self.shift if self.shift is not None else float(adapter.timestep_shift(clean))

    def resolve_shifts(self, adapter: Adapter, clean: LatentState | None = None) -> dict[str, float] | None:
        """The adapter's per-component shifts (:meth:`~ff_core.adapter.Adapter.timestep_shifts`) when the recipe
        leaves :attr:`shift` unset; ``None``: one shift for every component (a recipe :attr:`shift` applies to all).

        Args:
            adapter: the model family's adapter.
            clean: the batch's clean latents.
        """
        if self.shift is not None:
            return None
        per_component = getattr(adapter, "timestep_shifts", None)  # an adapter without the seam: one shift
        shifts = per_component(clean) if per_component is not None else None
        if shifts is None:
            return None
        shifts = {str(k): float(v) for k, v in shifts.items()}
        if any(not math.isfinite(v) or v <= 0 for v in shifts.values()):
            raise ValueError(f"{adapter.name}: timestep_shifts must be finite and > 0, got {shifts}")
        if self.schedule == "adapter":
            if len(set(shifts.values())) > 1:  # the adapter's table holds one shift: it cannot serve two schedules
                raise ValueError(f"timesteps.schedule='adapter' with {adapter.name}'s per-component shifts {shifts}: "
                                 "its table of training noise levels holds one shift; use schedule='continuous'")
            return None  # trivial: every component on the table's one schedule
        return shifts

    def resolve_table(self, adapter: Adapter, clean: LatentState | None = None) -> Tensor | None:
        """With ``schedule: adapter``, the adapter's training noise levels for latents shaped like ``clean``; else
        ``None``."""
        if self.schedule != "adapter":
            return None
        table = adapter.training_sigmas(clean).detach().float().cpu()
        if table.ndim != 1 or not len(table) or not ((table >= 0) & (table <= 1)).all():
            raise ValueError(f"{adapter.name}: training_sigmas must be a non-empty 1-D table of noise levels in "
                             f"[0, 1], got shape {tuple(table.shape)}")  # fmt: skip
        return table

    def sample(
        self,
        batch_size: int,
        generator: torch.Generator | None = None,
        device=None,
        shift: float | None = None,
        table: Tensor | None = None,
    ) -> Tensor:
        """``batch_size`` noise levels in [0, 1], drawn on the CPU (from ``generator``) and moved to ``device``.

        Args:
            batch_size: how many.
            generator: CPU random generator; ``None`` uses the global one.
            device: where the result goes.
            shift: the shift to apply, as :meth:`resolve_shift` gives it; ``None``: :attr:`shift`, else 1.
            table: the adapter's training levels (:meth:`resolve_table`, any order): each draw ``u`` picks level
                ``floor(u * len(table))`` of them sorted ascending (sigma grows with ``u``, as the continuous draw's
                does) and no shift applies.
        """
        if self.weighting == "logit_normal":
            n = torch.randn(batch_size, generator=generator) * self.logit_std + self.logit_mean
            sigma = torch.sigmoid(n)
        else:
            sigma = torch.rand(batch_size, generator=generator)
        if table is not None:  # indices = (u * N).long() as diffusers' scripts; u < 1, the clamp is for u = 1.0
            ascending = table.sort().values  # sigma grows with u: logit_mean keeps its continuous meaning
            return ascending[(sigma * len(table)).long().clamp_(max=len(table) - 1)].to(device)
        shift = shift if shift is not None else self.shift if self.shift is not None else 1.0
        return shift_sigma(sigma, shift).to(device)


CONDITION_STREAM = 3
"""The child stream (:func:`child_generator`) a stochastic condition realisation draws from (streams 1 and 2 are the
target codec's; a GRPO rollout's micro-batch starting at row ``r`` takes ``CONDITION_STREAM + r``)."""


def prepare_batch_condition(adapter: Adapter, batch: dict[str, Any],
                            generator: torch.Generator | None = None) -> Condition:  # fmt: skip
    """``adapter.prepare_condition(batch)``, passing ``generator`` when the adapter's ``prepare_condition`` takes a
    ``generator`` keyword: an adapter whose condition is realised stochastically once per batch (MiniMax H3 FL2VA /
    Ref2VA noise their condition prefix) then draws from the objective's seeded stream, so its draws are reproducible
    per rank and micro-batch and a resumed run repeats them; any other adapter is called as before.

    Args:
        adapter: the adapter.
        batch: the collated preprocessed conditions.
        generator: a seeded CPU generator (``None``: the adapter draws from the global one).
    """
    if generator is not None and "generator" in inspect.signature(adapter.prepare_condition).parameters:
        return adapter.prepare_condition(batch, generator=generator)
    return adapter.prepare_condition(batch)


def child_generator(generator: torch.Generator | None, stream: int) -> torch.Generator | None:
    """A CPU generator seeded from ``generator``'s seed and ``stream``: an independent, reproducible stream for a
    second kind of draw (the target codec's posterior sample) that leaves ``generator``'s own draws (noise levels,
    noise) untouched. ``None`` stays ``None`` (the global generator).

    Args:
        generator: a generator seeded once with ``manual_seed`` (its ``initial_seed`` names it).
        stream: which child stream.
    """
    if generator is None:
        return None
    return torch.Generator().manual_seed(derive_seed(generator.initial_seed(), stream))


Sigma = Tensor | dict[str, Tensor]
"""A training noise level per sample, shape (B,): one for every latent component, or per component name its own
(an adapter with :meth:`~ff_core.adapter.Adapter.timestep_shifts`)."""


def leading_sigma(sigma: Sigma) -> Tensor:
    """The noise level logged and handed to callbacks: ``sigma`` itself, or the first component's."""
    return next(iter(sigma.values())) if isinstance(sigma, dict) else sigma


def monte_carlo_draws(
    timesteps: TimestepSampler,
    adapter: Adapter,
    like: LatentState,
    n: int,
    generator: torch.Generator | None,
    expert_generator: torch.Generator | None = None,
) -> Iterator[tuple[Sigma, LatentState]]:
    """``n`` independent ``(sigma, noise)`` draws for a batch shaped like ``like``: per draw, the noise levels (with the
    recipe's or the adapter's shift) then the noise, from ``generator`` in that order — the order every objective
    draws in, so a micro-batch's noise is a function of its generator's seed alone.

    With per-component shifts (:meth:`TimestepSampler.resolve_shifts`) ``sigma`` is a dict: one weighting draw ``u``
    per sample, component ``k`` at ``shift_sigma(u, shift_k)`` (sampling's coupled schedules from one time).

    Args:
        timesteps: how noise levels are drawn.
        adapter: gives the default shift (:meth:`TimestepSampler.resolve_shift`).
        like: a clean latent state of the batch (shapes, dtype, device).
        n: how many draws (``num_train_timesteps``).
        generator: CPU generator; ``None``: the global one.
        expert_generator: a CPU generator every data-parallel rank seeds alike: per draw, one expert for the whole
            batch (``expert_choice: per_micro_batch``, :func:`draw_within_one_expert`); ``None``: per sample.
    """
    device = next(iter(like.components.values())).device
    shift = timesteps.resolve_shift(adapter, like)  # the recipe's, else the sampling schedule's
    table = timesteps.resolve_table(adapter, like)  # schedule: adapter
    shifts = timesteps.resolve_shifts(adapter, like)
    if expert_generator is not None and shifts is not None:
        raise ValueError(f"{adapter.name}: expert_choice per_micro_batch with per-component noise levels is not "
                         "supported")  # fmt: skip
    for _ in range(n):
        if expert_generator is not None:
            sigma = draw_within_one_expert(timesteps, adapter, like.batch_size, generator, expert_generator,
                                           shift=shift, table=table).to(device)  # fmt: skip
        elif shifts is None:
            sigma = timesteps.sample(like.batch_size, generator=generator, device=device, shift=shift, table=table)
        else:  # one u per sample, each component on its own schedule
            u = timesteps.sample(like.batch_size, generator=generator, device=device, shift=1.0)
            sigma = {k: shift_sigma(u, shifts[k]) for k in like.components}
        yield sigma, like.map(lambda x: randn_like(x, generator))


def draw_within_one_expert(
    timesteps: TimestepSampler,
    adapter: Adapter,
    batch_size: int,
    generator: torch.Generator | None,
    shared: torch.Generator,
    *,
    shift: float | None = None,
    table: Tensor | None = None,
    max_rounds: int = 10_000,
) -> Tensor:
    """``batch_size`` noise levels (CPU) that all route to one expert (``expert_choice: per_micro_batch``).

    The expert is the one a level drawn from ``shared`` routes to (:meth:`Adapter.uses_second_expert
    <ff_core.adapter.Adapter.uses_second_expert>`): with ``shared`` seeded alike on every rank, every rank picks the
    same, each expert with the probability :meth:`TimestepSampler.sample` gives its range. The levels are then drawn
    from ``generator`` and those routed elsewhere rejected, in draw order, until ``batch_size`` remain: the
    distribution restricted to the expert's range. So each level's distribution is the unrestricted one,
    ``P(range) * p(sigma | range)`` summed over the experts.

    Args:
        timesteps: how levels are drawn.
        adapter: routes a level to its expert.
        batch_size: how many levels.
        generator: this rank's CPU generator.
        shared: a CPU generator seeded alike on every data-parallel rank.
        shift, table: as :meth:`TimestepSampler.sample` takes them.
        max_rounds: the most batches drawn before giving up (a range of probability ~0 is picked with probability
            ~0, so a healthy run never comes near it).
    """
    (pick,) = timesteps.sample(1, generator=shared, shift=shift, table=table)
    expert = adapter.uses_second_expert(float(pick))
    if expert is None:
        raise ValueError(f"{adapter.name}: expert_choice per_micro_batch needs routed experts "
                         "(Adapter.uses_second_expert), and this checkpoint has one denoiser")  # fmt: skip
    kept: list[Tensor] = []
    for _ in range(max_rounds):
        draws = timesteps.sample(batch_size, generator=generator, shift=shift, table=table)
        kept += [s for s in draws if adapter.uses_second_expert(float(s)) == expert]
        if len(kept) >= batch_size:
            return torch.stack(kept[:batch_size])
    raise RuntimeError(f"{adapter.name}: {max_rounds} batches of noise levels drew fewer than {batch_size} in the "
                       f"range of the expert picked at level {float(pick):.6f}")  # fmt: skip


def randn_like(x: Tensor, generator: torch.Generator | None) -> Tensor:
    """Standard normal noise shaped like ``x``, drawn on the generator's device (CPU by default), in ``x``'s dtype."""
    device = generator.device if generator is not None else x.device
    return torch.randn(x.shape, generator=generator, device=device, dtype=torch.float32).to(x)


def _bcast(sigma: Tensor, like: Tensor) -> Tensor:
    """Per-sample ``sigma`` (B,) as fp32, shaped to broadcast against ``like`` (B, ...)."""
    return sigma.to(device=like.device, dtype=torch.float32).reshape(-1, *([1] * (like.ndim - 1)))


def add_noise(x0: Tensor, noise: Tensor, sigma: Tensor, mask: Tensor | None = None) -> Tensor:
    """``x_sigma = (1 - sigma) * x0 + sigma * noise``, ``sigma`` per sample (shape (B,)).

    Computed in fp32 and cast once to ``x0``'s dtype: rounding sigma itself to bf16 (8 bits of mantissa) would
    move every sample to a noise level the loss does not report. Where ``mask`` is 0 (a pinned condition element)
    the clean value is kept: pinned elements sit at noise level 0.
    """
    s = _bcast(sigma, x0)
    clean = x0.float()
    noisy = (1 - s) * clean + s * noise.float()
    return keep_pinned(noisy, clean, mask).to(x0.dtype)


def noise_state(clean: LatentState, noise: LatentState, sigma: Sigma) -> LatentState:
    """:func:`add_noise` on every component (at its own level where ``sigma`` is a dict by component name); elements
    the clean state's masks pin stay clean."""
    if list(clean.components) != list(noise.components):
        raise ValueError(f"latent components differ: {list(clean.components)} vs {list(noise.components)}")
    levels = sigma if isinstance(sigma, dict) else dict.fromkeys(clean.components, sigma)
    noisy = {k: add_noise(x, noise.components[k], levels[k], clean.masks.get(k)) for k, x in clean.components.items()}
    return replace(clean, components=noisy, masks=dict(clean.masks))


def velocity_target(x0: Tensor, noise: Tensor) -> Tensor:
    """The rectified-flow regression target ``noise - x0``, in fp32 (the loss is computed in fp32)."""
    return noise.float() - x0.float()


def check_component_weights(weights: Mapping[str, float] | None,
                            key: str = COMPONENT_WEIGHTS_KEY) -> dict[str, float] | None:  # fmt: skip
    """``weights`` as a plain dict, checked: finite, non-negative, not all zero. ``key`` names the config key."""
    if weights is None:
        return None
    out = {str(k): float(v) for k, v in dict(weights).items()}
    if not out or any(not math.isfinite(v) or v < 0 for v in out.values()) or not any(out.values()):
        raise ValueError(f"{key} must map latent component names to finite weights >= 0, not all 0; got {out}")
    return out


def resolve_component_weights(adapter: Adapter, weights: Mapping[str, float] | None) -> Mapping[str, float] | None:
    """The objective's ``component_weights`` or, where the config leaves them unset, the model family's reduction
    (``Adapter.default_component_weights``; ``None`` there too: pooled by element count)."""
    return weights if weights is not None else getattr(adapter, "default_component_weights", None)


def per_sample_squared_error(
    pred: LatentState,
    target: LatentState,
    component_weights: Mapping[str, float] | None = None,
    frozen_components: Collection[str] = (),
) -> Tensor:
    """Mean squared error per sample in fp32, over every active element of every component.

    The components reduce as :func:`~ff_core.sampling.component_mean` says (GRPO's step log-probabilities reduce the
    same way): without ``component_weights`` they are pooled by element count, so a video + audio state weighs each
    latent element equally (a stream with more latent elements weighs more). With them, each component's own mean over
    its active elements times its weight, summed, ``sum_k w_k e_k`` (not normalised by the weights' sum):
    ``{video: 1, audio: 1}`` weighs the streams equally whatever their sizes, ``{video: 1, audio: 0}`` leaves the
    audio out of the loss (it is still noised and denoised). Masked-out elements (mask 0, pinned by a condition)
    contribute neither error nor count.

    Args:
        pred: the predicted velocity.
        target: the regression target.
        component_weights: per component name its weight; every component of ``pred`` must be named (frozen ones
            may be left out).
        frozen_components: components left out of the error altogether (``model.frozen_components``: their
            branch does not train, docs/config.md); the rest reduce as above.
    """
    errors = {k: (p.float() - target.components[k].float()) ** 2 for k, p in pred.components.items()}
    masks = {k: pred.masks.get(k, target.masks.get(k)) for k in pred.components}
    return component_mean(errors, masks, component_weights, frozen_components)
