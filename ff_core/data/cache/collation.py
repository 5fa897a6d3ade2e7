"""How per-sample conditions become one batch: an adapter declares a rule per condition key.

Conditions are adapter-owned tensors (``adapter.preprocess`` output, or tensor-parquet condition columns); within a
batch they may differ in shape per sample: a text embedding's length ``L`` (prompts of different lengths with the
padding stripped), a number of condition frames. ``torch.utils.data.default_collate`` refuses those, and padding by
hand in every family invites mistakes (a padded token attended to, a mask off by one). So the adapter states, per key
(``Adapter.condition_collation``), one of:

* ``stack`` (the default for keys not named): one shape per batch, stacked on a new batch axis; a batch of mixed
  shapes is an error naming the key and each sample's shape;
* ``pad``: tensors of shape ``(L_i, ...)`` zero-padded on axis 0 to the batch's longest ``L``, stacked, plus a boolean
  ``<key>_mask`` of shape ``(B, L)``, true on real entries (the trailing axes must agree);
* ``list``: a list of the per-sample tensors, untouched (the adapter loops or packs them itself).

Non-tensor values (strings, numbers, nested structures) of ``stack`` keys go through ``default_collate`` as before.

Values may be :class:`~ff_core.data.dataflow.lazy.LazyValue` descriptions (tensor-parquet values a DataLoader worker
only located): ``stack`` and ``pad`` then return a lazy batch (each value read into its slice where the batch is
materialised, in the main process; padding zeroed there), its mask computed from the shapes alone, and the batch
equals the one collated from the tensors themselves, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

from ff_core.data.dataflow.lazy import LazyValue, materialize, stack

STACK, PAD, LIST = "stack", "pad", "list"
RULES = (STACK, PAD, LIST)
MASK_SUFFIX = "_mask"


def check_rules(rules: Mapping[str, str], owner: str) -> None:
    """Raise a ValueError naming ``owner`` when a rule is unknown or a padded key's mask would shadow a key."""
    bad = {k: r for k, r in rules.items() if r not in RULES}
    if bad:
        raise ValueError(f"{owner}.condition_collation: unknown rule(s) {bad}; expected one of {', '.join(RULES)}")
    clashes = [f"{k}{MASK_SUFFIX}" for k, r in rules.items() if r == PAD and f"{k}{MASK_SUFFIX}" in rules]
    if clashes:
        raise ValueError(f"{owner}.condition_collation: {clashes} is both a key and the mask of a padded key")


def collate_conditions(
    conditions: Sequence[Mapping[str, Any]], rules: Mapping[str, str] | None = None, ids: Sequence[Any] | None = None
) -> dict[str, Any]:
    """One batch of conditions, key by key, by ``rules`` (see the module docstring).

    Args:
        conditions: per sample, its condition dict (every sample must have the same keys).
        rules: condition key -> ``stack`` | ``pad`` | ``list``; keys not named are stacked.
        ids: per sample, what names it in an error (record indices); default: its position in the batch.
    """
    if not conditions:
        raise ValueError("collate_conditions: cannot collate an empty batch")
    rules = rules or {}
    ids = list(ids) if ids is not None else list(range(len(conditions)))
    keys = list(conditions[0])
    for i, c in zip(ids, conditions):
        if list(c) != keys:
            raise ValueError(f"a batch mixes condition keys: sample {ids[0]} has {keys}, sample {i} {list(c)}")
    batch: dict[str, Any] = {}
    for key in keys:
        values = [c[key] for c in conditions]
        rule = rules.get(key, STACK)
        if rule == LIST:
            batch[key] = values
        elif rule == PAD:
            batch[key], batch[f"{key}{MASK_SUFFIX}"] = pad_stack(key, values, ids)
        elif all(isinstance(v, (torch.Tensor, LazyValue)) for v in values):
            shapes = [tuple(v.shape) for v in values]
            if len(set(shapes)) > 1:
                found = ", ".join(f"sample {i}: {s}" for i, s in zip(ids, shapes))
                raise ValueError(f"condition {key!r}: the samples of one batch have different shapes ({found}); "
                                 "declare it 'pad' or 'list' in the adapter's condition_collation")
            lazy = any(isinstance(v, LazyValue) for v in values)
            batch[key] = stack(values) if lazy else torch.stack(values)  # lazy: read where the batch is materialised
        else:
            batch[key] = default_collate(values)
    return batch


def pad_stack(
    key: str, values: Sequence[torch.Tensor | LazyValue], ids: Sequence[Any]
) -> tuple[torch.Tensor | LazyValue, torch.Tensor]:
    """Zero-pad ``(L_i, ...)`` tensors on axis 0 to the longest and stack them; the ``(B, L)`` mask of real entries.

    Lazy values of one dtype give a lazy batch (each padded where it is read: :meth:`LazyValue.padded`); of several
    dtypes they are read here and padded as tensors are (the batch takes the first value's dtype, as before)."""
    trailing = {tuple(v.shape[1:]) for v in values}
    if any(len(v.shape) == 0 for v in values) or len(trailing) > 1:
        found = ", ".join(f"sample {i}: {tuple(v.shape)}" for i, v in zip(ids, values))
        raise ValueError(f"condition {key!r} is padded on axis 0, so its other axes must agree ({found})")
    length = max(v.shape[0] for v in values)
    mask = torch.zeros(len(values), length, dtype=torch.bool)
    for row, v in enumerate(values):  # from the shapes alone: the same mask whether the values are read yet or not
        mask[row, : v.shape[0]] = True
    if any(isinstance(v, LazyValue) for v in values):
        if len({v.dtype for v in values}) == 1:
            return stack([_padded(v, length) for v in values]), mask
        values = [materialize(v) for v in values]
    out = values[0].new_zeros((len(values), length, *values[0].shape[1:]))
    for row, v in enumerate(values):
        out[row, : v.shape[0]] = v
    return out, mask


def _padded(value: torch.Tensor | LazyValue, length: int) -> torch.Tensor | LazyValue:
    """``value`` zero-padded on axis 0 to ``length``: lazily for a lazy value, by copy for a (shorter) tensor."""
    if value.shape[0] == length:
        return value
    if isinstance(value, LazyValue):
        return value.padded(length)
    return torch.cat([value, value.new_zeros((length - value.shape[0], *value.shape[1:]))])
