"""The reward interface: a reward scores decoded media (and prompts, and each row's metadata) as one float each.

Rewards are what online objectives (Flow-GRPO) optimise and what evaluation reports (``val/reward/<name>``). A
reward is **pointwise** (each sample scored alone: colour, aesthetics, CLIP score) or **groupwise** (a sample's score
depends on the other samples of its group, the samples of one prompt: a pairwise preference model, a rank). Under
data parallelism pointwise rewards run on each rank; groupwise ones only after the group is gathered onto one rank,
which is why the configured set (:class:`ff_core.objectives.rewards.Rewards`) computes the two kinds separately
(Flow-GRPO, Liu et al. 2025, sec. 4: advantages are normalised within each prompt's group).

A reward declares the record metadata it reads (:attr:`Reward.required_fields`, e.g. a GenEval-style reward needs
``include``/``exclude``, a Sudoku reward ``solution``); :meth:`~ff_core.objectives.rewards.Rewards.check_records`
refuses a dataset that lacks one before any weight loads, naming the reward, the field and the record's file and line.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from ff_core.errors import ConfigError

POINTWISE = "pointwise"
GROUPWISE = "groupwise"
MAX_REPORTED_RECORDS = 20
"""check_records reports at most this many records per missing field (then a count), so a big dataset stays legible."""


@dataclass
class RewardBatch:
    """What a reward scores: B generated samples with their prompts and the metadata of the rows they came from.

    Attributes:
        media: per sample, the decoded outputs in the adapter contract's output order: image uint8 (3, H, W),
            video uint8 (T, 3, H, W), audio float32 (C, N) in [-1, 1].
        prompts: the prompt of each sample.
        metadata: each row's reward metadata (a legacy row's extra columns, a V2 record's ``metadata``).
        groups: (B,) int group id per sample (same prompt = same group), for groupwise rewards; ``None``: every
            sample is its own group.
        output_types: the contract's output kinds (``image``, ``video``, ``audio``), parallel to ``media[i]``.
        rates: fps (video) or sample rate (audio) per output where known, parallel to ``output_types``.
    """

    media: list[list[Tensor]]
    prompts: list[str]
    metadata: list[dict[str, Any]]
    groups: Tensor | None = None
    output_types: tuple[str, ...] = ("image",)
    rates: tuple[float | None, ...] = (None,)

    def __post_init__(self) -> None:
        n = len(self.media)
        if len(self.prompts) != n or len(self.metadata) != n:
            raise ValueError(
                f"RewardBatch: {n} samples of media but {len(self.prompts)} prompts and {len(self.metadata)} metadata"
            )
        if self.groups is not None and tuple(self.groups.shape) != (n,):
            raise ValueError(f"RewardBatch.groups must have shape ({n},), got {tuple(self.groups.shape)}")
        self.output_types = tuple(str(t) for t in self.output_types)
        if len(self.rates) != len(self.output_types):
            self.rates = tuple(self.rates) + (None,) * (len(self.output_types) - len(self.rates))

    def __len__(self) -> int:
        return len(self.media)

    def group_ids(self) -> Tensor:
        """(B,) group id of each sample: :attr:`groups`, or every sample its own group when it is ``None``."""
        return self.groups if self.groups is not None else torch.arange(len(self.media))

    def output_index(self, media_types: Iterable[str], reward: str = "reward") -> int:
        """Position of the first output whose type is one of ``media_types`` (what a single-medium reward scores).

        Args:
            media_types: the kinds the reward accepts.
            reward: the reward's name, for the error.
        """
        media_types = tuple(media_types)
        for i, kind in enumerate(self.output_types):
            if kind in media_types:
                return i
        raise ValueError(
            f"reward {reward!r} scores {'/'.join(media_types)} but the samples hold {', '.join(self.output_types)}"
        )

    def outputs(self, media_types: Iterable[str], reward: str = "reward") -> list[Tensor]:
        """Per sample, the first output whose type is one of ``media_types``."""
        i = self.output_index(media_types, reward)
        return [sample[i] for sample in self.media]

    def rate(self, media_types: Iterable[str]) -> float | None:
        """The fps / sample rate of the output :meth:`outputs` picks (``None`` when unknown)."""
        return self.rates[self.output_index(media_types)]


class Reward:
    """One reward: ``reward(batch)`` returns a (B,) float32 tensor, higher is better.

    Subclasses set the class attributes and take their options (the config's ``args``) as typed ``__init__``
    arguments documented in ``Args:``. Plugins register them through the ``ff_rewards`` hook
    (:mod:`ff_core.hookspecs`); nothing may load weights at import or registration time, only in ``__init__``.

    Attributes:
        name: registry name used in configs (``rewards: [{name: colour, ...}]``).
        kind: ``pointwise`` (each sample alone) or ``groupwise`` (needs the whole group: gathered across ranks first;
            ``batch.groups`` says which samples belong together).
        required_fields: metadata fields each record must carry (checked before training, by
            :meth:`Rewards.check_records`). An instance may narrow or extend it from its options.
        media_types: the output kinds the reward scores (the first matching output of each sample).
    """

    name: ClassVar[str]
    kind: ClassVar[str] = POINTWISE
    required_fields: ClassVar[tuple[str, ...]] = ()
    media_types: ClassVar[tuple[str, ...]] = ("image",)

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def to(self, device: torch.device | str) -> Reward:
        """Move whatever model the reward holds to ``device`` (scores are computed there); returns ``self``."""
        self.device = torch.device(device)
        return self

    def __call__(self, batch: RewardBatch) -> Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


@dataclass
class RewardSpec:
    """One configured reward of a weighted set (``rewards: [{name: colour, weight: 1.0, args: {...}}]``).

    Attributes:
        name: a registered reward name (see ``ff plugins``) or a dotted path ``pkg.module:Class``.
        weight: its weight in the total, ``sum(weight * score)``.
        args: keyword arguments of the reward class's ``__init__``.
        label: the key it is logged and reported under (``val/reward/<label>``); default: ``name``. Needed when one
            reward appears twice with different ``args``.
        offload: keep the reward's model in CPU memory and move it to the training device only while it scores
            (a large judge then takes accelerator memory only during scoring, at the cost of two copies per step).
    """

    name: str
    weight: float = 1.0
    args: dict[str, Any] = field(default_factory=dict)
    label: str | None = None
    offload: bool = False

    @property
    def key(self) -> str:
        return self.label or self.name

    @classmethod
    def from_config(cls, value: RewardSpec | dict[str, Any], key: str) -> RewardSpec:
        """A spec from a config entry (a mapping with these fields), checked; errors name ``key``
        (``model.eval_rewards[1]``)."""
        return _as_spec(value, key)


def _as_spec(spec: RewardSpec | dict[str, Any], key: str) -> RewardSpec:
    if isinstance(spec, RewardSpec):
        result = spec
    elif isinstance(spec, dict):
        unknown = set(spec) - {"name", "weight", "args", "label", "offload"}
        if unknown or "name" not in spec:
            what = f"unknown key(s) {', '.join(sorted(unknown))}" if unknown else "missing `name`"
            raise ConfigError(key, f"{what}; a reward is {{name, weight, args, label, offload}}")
        result = RewardSpec(**spec)
    else:
        raise ConfigError(key, f"expected {{name, weight, args}}, found {type(spec).__name__}")
    if not isinstance(result.weight, (int, float)) or not math.isfinite(result.weight):
        raise ConfigError(f"{key}.weight", f"expected a finite number, found {result.weight!r}")
    if not isinstance(result.offload, bool):
        raise ConfigError(f"{key}.offload", f"expected true or false, found {result.offload!r}")
    if not isinstance(result.args, dict):
        raise ConfigError(f"{key}.args", f"expected a mapping of keyword arguments, found {result.args!r}")
    return result


