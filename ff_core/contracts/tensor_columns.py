"""Which tensor-parquet columns an adapter's training inputs are stored in (docs/plugins.md, "Tensor rows"): plain
data, so a dataset of shards is checked against the adapter before weights load."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

LATENT_BATCH_KEYS: dict[str, dict[str, str]] = {
    "demonstration": {"latents": ""},
    "preference": {"chosen_latents": "chosen_", "rejected_latents": "rejected_"},
}
"""Per supervision, the batch keys of the stored clean latents and the prefix of their columns: a preference row
holds the condition once and each latent column twice, as ``chosen_<column>`` and ``rejected_<column>``."""


def _as_mapping(value: Mapping[str, str] | Sequence[str], what: str) -> dict[str, str]:
    if isinstance(value, str):
        raise TypeError(f"TensorColumns.{what}: give a sequence of column names or a mapping, not the string {value!r}")
    return dict(value) if isinstance(value, Mapping) else {name: name for name in value}


@dataclass(frozen=True)
class TensorColumns:
    """How an adapter's training inputs are stored in tensor-parquet rows (docs/plugins.md, "Tensor rows").

    Each tensor column is a triplet ``<column>_bytes/_shape/_dtype`` in the shards. A sequence of names maps each
    column to the key of the same name; a mapping renames (``{"text_embedding": "prompt_embeds"}``: the card's
    column feeds the condition key ``prompt_embeds``).

    Attributes:
        condition: column -> key of the condition dict ``preprocess`` returns (``prepare_condition`` input).
        latents: column -> latent component name, in the :class:`~ff_core.adapter.LatentState`'s order (the clean
            target ``encode_output`` would return).
        optional: condition columns a dataset may lack (a negative prompt's embeddings, used for CFG only); read when
            the shards have them.
        prompt: the scalar column holding each row's prompt (logs, sample records); ``None``: rows have none.
        pad: condition column -> length: tensors stored without padding (the card's text embeddings ``[L, 4096]``,
            "padding stripped") are zero-padded on their first axis to this length when read, as the family's
            pipeline pads them (diffusers' Wan pipelines pad T5 embeddings to 512 with zeros), so rows of different
            ``L`` batch together.
    """

    condition: Mapping[str, str] | Sequence[str]
    latents: Mapping[str, str] | Sequence[str] = ("latent",)
    optional: tuple[str, ...] = ()
    prompt: str | None = "prompt"
    pad: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        condition, latents = _as_mapping(self.condition, "condition"), _as_mapping(self.latents, "latents")
        object.__setattr__(self, "condition", condition)
        object.__setattr__(self, "latents", latents)
        object.__setattr__(self, "optional", tuple(self.optional))
        if not latents:
            raise ValueError("TensorColumns.latents: name at least one latent column")
        both = set(condition) & set(latents)
        if both:
            raise ValueError(f"TensorColumns: column(s) {sorted(both)} are both condition and latent columns")
        unknown = set(self.optional) - set(condition)
        if unknown:
            raise ValueError(f"TensorColumns.optional: {sorted(unknown)} are not condition columns")
        object.__setattr__(self, "pad", dict(self.pad))
        bad = {c: n for c, n in self.pad.items() if c not in condition or not isinstance(n, int) or n < 1}
        if bad:
            raise ValueError(f"TensorColumns.pad: {bad}: expected condition columns and lengths >= 1")

    @property
    def required(self) -> tuple[str, ...]:
        """The tensor columns every demonstration row must have: condition columns not optional, then the latents."""
        return self.required_for("demonstration")

    def required_for(self, supervision: str) -> tuple[str, ...]:
        """The tensor columns every row of ``supervision`` (``demonstration`` or ``preference``) must have."""
        prefixes = LATENT_BATCH_KEYS[supervision].values()
        return (*(c for c in self.condition if c not in self.optional),
                *(prefix + c for prefix in prefixes for c in self.latents))

    def missing(self, tensors: Sequence[str], supervision: str = "demonstration") -> list[str]:
        """Required tensor columns absent from ``tensors`` (a dataset's tensor names), in declaration order."""
        have = set(tensors)
        return [c for c in self.required_for(supervision) if c not in have]

    def from_row(
        self, row: Mapping[str, Any], prefix: str = ""
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``(condition, latents)`` of one decoded row, keyed as the adapter consumes them.

        Args:
            row: the decoded row.
            prefix: of the latent columns (``chosen_`` / ``rejected_`` for a preference arm).
        """
        condition = {}
        for col, key in self.condition.items():
            tensor = _present(row, col, optional=col in self.optional) if col in row else None
            if tensor is not None:
                condition[key] = self._padded(col, tensor)
        latents = {key: _present(row, prefix + col) for col, key in self.latents.items()}
        return condition, latents

    def _padded(self, column: str, tensor: Any) -> Any:
        length = self.pad.get(column)
        if length is None or tensor.shape[0] == length:
            return tensor
        if tensor.shape[0] > length:
            raise ValueError(f"{column}: {tensor.shape[0]} entries on axis 0, more than the pad length {length}")
        if not isinstance(tensor, torch.Tensor):  # a value a worker located (a LazyValue): padded where it is read
            return tensor.padded(length)
        return torch.cat([tensor, tensor.new_zeros((length - tensor.shape[0], *tensor.shape[1:]))])

    def to_row(
        self, condition: Mapping[str, torch.Tensor], latents: Mapping[str, torch.Tensor], prefix: str = ""
    ) -> dict[str, Any]:
        """The tensor columns of one sample (``ff data preprocess-latents``): the inverse of :meth:`from_row`.

        Condition keys the columns do not name are left out; a missing required one is an error.

        Args:
            condition: one sample's condition, as ``preprocess`` returns it.
            latents: one sample's clean latent components (no batch axis).
            prefix: of the latent columns (``chosen_`` / ``rejected_`` for a preference arm).
        """
        row: dict[str, Any] = {}
        for col, key in self.condition.items():
            if key in condition:
                row[col] = condition[key]
            elif col not in self.optional:
                raise KeyError(f"TensorColumns: the condition has no {key!r} (column {col!r}); it has "
                               f"{sorted(condition)}")
        for col, key in self.latents.items():
            if key not in latents:
                raise KeyError(f"TensorColumns: the latents have no component {key!r} (column {col!r}); they have "
                               f"{sorted(latents)}")
            row[prefix + col] = latents[key]
        return row


def _present(row: Mapping[str, Any], column: str, optional: bool = False) -> torch.Tensor | None:
    """``row[column]``; the absent-tensor placeholder (read as ``None``, :func:`~ff_core.data.tensor_parquet.
    is_empty_triplet`) is an error for a column training needs."""
    value = row[column]
    if value is None and not optional:
        raise ValueError(f"{column}: the row holds the empty placeholder (b'', [], '') where training needs a tensor")
    return value
