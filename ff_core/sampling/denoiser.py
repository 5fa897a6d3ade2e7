"""What sampling needs of a model: the methods :class:`~ff_core.adapter.Adapter` implements and the loops call.

Sampling takes any object with these methods (the adapter, in ff), so the sampler never imports the adapter that
uses it; :class:`Denoiser` names them for readers and type checkers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from ff_core.contracts import Condition, LatentState


class Denoiser(Protocol):
    """A flow model as the sampling loops use it (see :class:`~ff_core.adapter.Adapter` for each method's contract)."""

    name: str

    def velocity(self, state: LatentState, sigma: Tensor, condition: Condition) -> LatentState: ...

    def component_velocity(self, state: LatentState, sigmas: dict[str, Tensor], condition: Condition
                           ) -> LatentState: ...  # fmt: skip

    def initial_noise(self, condition: Condition, generator: torch.Generator | None = None) -> LatentState: ...

    def unconditional(self, condition: Condition) -> Condition | None: ...

    def with_embedded_guidance(self, condition: Condition, scale: float) -> Condition: ...

    def sampling_schedules(self, state: LatentState, num_steps: int, shift: float | None = None
                           ) -> dict[str, Tensor]: ...  # fmt: skip

    def sampling_schedulers(self, state: LatentState, num_steps: int, shift: float | None = None
                            ) -> dict[str, Any] | None: ...  # fmt: skip

    def uses_second_expert(self, sigma: float) -> bool | None: ...
