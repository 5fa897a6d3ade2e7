"""Built-in collators (spec §2): a group of samples → one batch."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.data import default_collate

from .base import BatchCollator


class DefaultBatchCollator(BatchCollator):
    """Stack with ``torch.utils.data.default_collate`` (equal shapes per key)."""

    def collate(self, samples: list[dict[str, Any]]) -> Any:
        return default_collate(samples)


class ListBatchCollator(BatchCollator):
    """For packed, variable-size batches: media stay per-sample lists (the spec's ``VFMListCollator``).

    A key becomes a list when it is named in ``list_keys`` or when its values are not all tensors of one shape;
    equal-shape tensors are stacked and numbers become a tensor. Strings and other objects stay lists.

    Args:
        list_keys: Keys always kept as lists (e.g. ``["video", "audio"]``); ``None`` decides per key by shape.
    """

    def __init__(self, list_keys: Iterable[str] | None = None) -> None:
        self.list_keys = frozenset(list_keys or ())

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        if not samples:
            raise ValueError("ListBatchCollator: cannot collate an empty batch")
        batch: dict[str, Any] = {}
        for key in samples[0]:
            values = [s[key] for s in samples]
            if key in self.list_keys:
                batch[key] = values
            elif all(isinstance(v, torch.Tensor) for v in values) and len({v.shape for v in values}) == 1:
                batch[key] = torch.stack(values)
            elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                batch[key] = torch.tensor(values)
            else:
                batch[key] = values
        return batch
