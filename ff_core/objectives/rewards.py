"""The rewards a recipe configures (``model.objective.rewards``, ``model.eval_rewards``): each named reward built
through the plugin registry, scored pointwise or groupwise, and combined by weight.

The reward interface and ff_core's own rewards are :mod:`ff_core.rewards`; this module resolves a recipe's names to
those classes (:func:`ff_core.plugins.get_reward_class`), so it sits above the registry with the objectives that use it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ff_core.errors import ConfigError, DatasetError, DatasetErrors
from ff_core.plugins import get_reward_class
from ff_core.rewards.base import GROUPWISE, MAX_REPORTED_RECORDS, POINTWISE, Reward, RewardBatch, RewardSpec


@dataclass
class RewardScores:
    """The scores of one batch.

    Attributes:
        total: (B,) weighted sum of the per-reward scores.
        per_reward: (B,) score of each reward, keyed by its :attr:`RewardSpec.key`, in config order.
    """

    total: Tensor
    per_reward: dict[str, Tensor]


class Rewards:
    """The weighted set of rewards a recipe configures.

    Args:
        specs: the rewards, their weights and options; ``RewardSpec`` objects or plain dicts as written in YAML.
        config_key: the config key they were given under, for error messages (``model.eval_rewards``).
    """

    def __init__(self, specs: Sequence[RewardSpec | dict[str, Any]], config_key: str = "rewards") -> None:
        self.config_key = config_key
        self.specs: list[RewardSpec] = [RewardSpec.from_config(s, f"{config_key}[{i}]") for i, s in enumerate(specs)]
        self.rewards: list[Reward] = [_build(s, f"{config_key}[{i}]") for i, s in enumerate(self.specs)]
        self.device = torch.device("cpu")
        keys = [s.key for s in self.specs]
        for i, key in enumerate(keys):
            if key in keys[:i]:
                raise ConfigError(
                    f"{config_key}[{i}]", f"reward {key!r} is configured twice; give one a distinct `label`"
                )

    def __len__(self) -> int:
        return len(self.rewards)

    @property
    def keys(self) -> list[str]:
        return [s.key for s in self.specs]

    @property
    def has_groupwise(self) -> bool:
        return any(r.kind == GROUPWISE for r in self.rewards)

    def to(self, device: torch.device | str) -> Rewards:
        """Score on ``device``: each reward moves there, but one with ``offload`` stays in CPU memory and visits it
        only while it scores (:meth:`_score`)."""
        self.device = torch.device(device)
        for spec, reward in zip(self.specs, self.rewards):
            reward.to("cpu" if spec.offload else self.device)
        return self

    # -- checks before training ----------------------------------------------------------------------------
    def check_records(self, records: Iterable[Any]) -> None:
        """Refuse records that lack a metadata field a configured reward reads.

        Raises :class:`~ff_core.errors.DatasetErrors` with one ``path:line: metadata.<field>: ...`` error per record
        and field (at most :data:`MAX_REPORTED_RECORDS` per field), each naming the reward.

        Args:
            records: :class:`~ff_core.data.records.base.Record` objects (anything with ``metadata``, ``source``
                and ``line``).
        """
        needs = [(spec.key, f) for spec, r in zip(self.specs, self.rewards) for f in r.required_fields]
        if not needs:
            return
        errors: list[DatasetError] = []
        missing: dict[tuple[str, str], list[Any]] = {}  # (reward, field) -> records lacking it
        for record in records:
            for reward, name in needs:
                if name not in record.metadata:
                    missing.setdefault((reward, name), []).append(record)
        for (reward, name), lacking in missing.items():
            for record in lacking[:MAX_REPORTED_RECORDS]:
                errors.append(DatasetError(record.source, record.line, f"metadata.{name}", (
                    f"reward {reward!r} ({self.config_key}) needs the metadata field {name!r}, which this record "
                    "lacks (a legacy row's extra column or a V2 record's metadata key)"
                )))
            if len(lacking) > MAX_REPORTED_RECORDS:
                more = len(lacking) - MAX_REPORTED_RECORDS
                errors.append(DatasetError(lacking[MAX_REPORTED_RECORDS].source, None, f"metadata.{name}",
                                           f"... {more} more records lack it (reward {reward!r})"))
        if errors:
            raise DatasetErrors(errors)

    def check_outputs(self, output_types: Sequence[str], adapter: str = "the adapter") -> None:
        """Refuse a reward whose media kinds the adapter never emits (found before weights load).

        Args:
            output_types: the adapter contract's output kinds.
            adapter: the adapter's name, for the message.
        """
        kinds = {str(t) for t in output_types}
        for i, (spec, reward) in enumerate(zip(self.specs, self.rewards)):
            if not kinds & set(reward.media_types):
                raise ConfigError(f"{self.config_key}[{i}]", (
                    f"reward {spec.name!r} scores {'/'.join(reward.media_types)}, but {adapter} outputs "
                    f"{', '.join(map(str, output_types))}"
                ))

    # -- scoring ---------------------------------------------------------------------------------------------
    def pointwise(self, batch: RewardBatch) -> dict[str, Tensor]:
        """Scores of the pointwise rewards (computable on each rank alone)."""
        return self._score(batch, POINTWISE)

    def groupwise(self, batch: RewardBatch) -> dict[str, Tensor]:
        """Scores of the groupwise rewards; ``batch`` must hold whole groups (gathered across ranks)."""
        return self._score(batch, GROUPWISE)

    def combine(self, per_reward: dict[str, Tensor]) -> RewardScores:
        """The weighted total of per-reward scores (every configured reward must be present), in config order."""
        absent = [k for k in self.keys if k not in per_reward]
        if absent:
            raise KeyError(f"scores of {', '.join(absent)} are missing: compute pointwise and groupwise rewards")
        ordered = {k: per_reward[k] for k in self.keys}
        total = sum(spec.weight * ordered[spec.key].float() for spec in self.specs)
        if not isinstance(total, Tensor):  # no rewards configured
            total = torch.zeros(0)
        return RewardScores(total=total, per_reward=ordered)

    def __call__(self, batch: RewardBatch) -> RewardScores:
        """Every reward on one batch (pointwise and groupwise alike): for single-process use and evaluation."""
        return self.combine({**self.pointwise(batch), **self.groupwise(batch)})

    def _score(self, batch: RewardBatch, kind: str) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for spec, reward in zip(self.specs, self.rewards):
            if reward.kind != kind:
                continue
            with torch.no_grad(), _visiting(reward, self.device if spec.offload else None):
                scores = reward(batch)
            out[spec.key] = _check_scores(scores, len(batch), spec.key)
        return out


def _check_scores(scores: Tensor, n: int, key: str) -> Tensor:
    if not isinstance(scores, Tensor) or tuple(scores.shape) != (n,):
        shape = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
        raise ValueError(f"reward {key!r} returned {shape}; a reward returns one score per sample, shape ({n},)")
    # Back on the CPU (B floats, free): rewards may score on different devices (a CLIP model on the accelerator, JPEG
    # sizes on the CPU), and their scores are combined, gathered and logged together.
    scores = scores.detach().float().cpu()
    if not torch.isfinite(scores).all():
        bad = int((~torch.isfinite(scores)).nonzero()[0])
        raise ValueError(f"reward {key!r} returned a non-finite score for sample {bad}: {scores[bad].item()}")
    return scores


def _build(spec: RewardSpec, key: str) -> Reward:
    try:
        cls = get_reward_class(spec.name)
    except KeyError as exc:
        raise ConfigError(f"{key}.name", exc.args[0]) from None
    try:
        return cls(**spec.args)
    except TypeError as exc:  # an unknown or missing keyword argument
        raise ConfigError(f"{key}.args", f"reward {spec.name!r}: {exc}") from None
    except ValueError as exc:  # the reward's own check of a value
        raise ConfigError(f"{key}.args", f"reward {spec.name!r}: {exc}") from None


@contextmanager
def _visiting(reward: Reward, device: torch.device | None) -> Iterator[None]:
    """An offloaded reward on ``device`` for the time it scores, back in CPU memory after (``None``: stays put)."""
    if device is None or device.type == "cpu":
        yield
        return
    reward.to(device)
    try:
        yield
    finally:
        reward.to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()
