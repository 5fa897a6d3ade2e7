"""Training from tensor-parquet shards: which columns an adapter reads, and the dataflow roles that read them.

A shard row (spec tensor-parquet-dataset-card; :mod:`ff_core.data.tensor_parquet`) already holds what a training
step would otherwise compute: the preprocessed condition (text embeddings, condition latents) and the clean target
latents the VAE would encode. :class:`TensorColumns` is the adapter's declaration of that mapping (class-level, so a
dataset is checked before weights load); the roles below turn row numbers into the batches objectives consume:

* :class:`TensorRows` — one or more shard roots concatenated; its items are row numbers, so distributors shuffle
  integers and a resume skips rows without reading them.
* :class:`TensorRowProcessor` — row number -> ``{"index", "prompt", "condition", "latents", "metadata"}``; with
  ``defer=True`` only ``{"index", "shapes"}`` (the ``_shape`` columns: what a packing batcher weighs), the tensors
  being read by the collator once the batch is chosen.
* :class:`TensorRowCollator` — the batch: conditions and latents stacked per key.
* :class:`StoredTokenCount` — the size function of the packing batchers, from the stored shapes alone.

Objectives take ``batch["latents"]`` through :meth:`~ff_core.adapter.Adapter.stored_latents` instead of encoding
targets: no VAE runs in the step (docs/dataflow.md, "Tensor-parquet rows").
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ff_core.contracts import LATENT_BATCH_KEYS as LATENT_BATCH_KEYS  # re-exported: its home before ff_core.contracts
from ff_core.contracts import TensorColumns as TensorColumns  # re-exported: as LATENT_BATCH_KEYS
from ff_core.data.cache.collation import check_rules, collate_conditions
from ff_core.data.dataflow import BatchCollator, RawItemProcessor
from ff_core.data.dataflow.lazy import stack
from ff_core.errors import DatasetError, raise_collected

if TYPE_CHECKING:  # pyarrow is only needed once shards are opened
    from ff_core.data.records.sources import DatasetConfig
    from ff_core.data.tensor_parquet import TensorParquetDataset


class TensorRows:
    """Several tensor-parquet datasets as one map-style table whose items are global row numbers.

    The distributors shuffle and shard these integers (``MapDistributor``, ``SamplerDistributor``); the processor
    reads the row. Row ``i`` of dataset ``k`` is number ``offsets[k] + i``, in ``data.datasets`` order.

    Args:
        datasets: the opened shard datasets (each reads only the columns it was opened with).
        sizes: rows served from each dataset, its first ones (``train.max_dataset_size``); ``None``: all.
    """

    def __init__(self, datasets: Sequence[TensorParquetDataset], sizes: Sequence[int] | None = None) -> None:
        if not datasets:
            raise ValueError("TensorRows: no dataset")
        self.datasets = list(datasets)
        sizes = [len(d) for d in self.datasets] if sizes is None else list(sizes)
        if len(sizes) != len(self.datasets) or any(not 0 <= n <= len(d) for n, d in zip(sizes, self.datasets)):
            raise ValueError(f"TensorRows: sizes {sizes} do not fit datasets of {[len(d) for d in self.datasets]} rows")
        self.offsets = [0]
        for n in sizes:
            self.offsets.append(self.offsets[-1] + n)

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < len(self):
            raise IndexError(f"TensorRows: row {index} out of range [0, {len(self)})")
        return index

    @property
    def group_bounds(self) -> np.ndarray:
        """Row group ``g`` of the concatenation holds rows ``group_bounds[g]`` to ``group_bounds[g + 1] - 1`` (the
        datasets' own row groups, cut where ``sizes`` ends a dataset): what a two-level shuffle keeps together."""
        parts = [np.zeros(1, dtype=np.int64)]
        for dataset, start, end in zip(self.datasets, self.offsets[:-1], self.offsets[1:]):
            bounds = np.asarray(dataset.group_bounds, dtype=np.int64)
            parts += [bounds[(bounds > 0) & (bounds < end - start)] + start, np.array([end], dtype=np.int64)]
        return np.unique(np.concatenate(parts))  # an empty dataset adds no group

    def max_group_rows(self) -> int:
        """The most rows one row group holds (1 for shards written by ff)."""
        return int(np.diff(self.group_bounds).max(initial=1))

    def locate(self, index: int) -> tuple[int, int]:
        """``(dataset k, row within it)`` of global row ``index``."""
        k = bisect.bisect_right(self.offsets, index) - 1
        return k, index - self.offsets[k]

    def read(self, index: int) -> dict[str, Any]:
        """Row ``index`` decoded: scalars as Python values, tensors as ``torch.Tensor``; from a dataset opened with
        ``hand_off``, uncompressed tensors as file ranges (:meth:`~ff_core.data.tensor_parquet.TensorParquetDataset.
        describe`) that ``DataflowLoader`` reads straight into the batch, in its workers or in the main process."""
        k, row = self.locate(index)
        dataset = self.datasets[k]
        return dataset.describe(row) if dataset.hand_off else dataset[row]

    def shapes(self, index: int) -> dict[str, tuple[int, ...]]:
        """Row ``index``'s tensor shapes, from its ``_shape`` columns only."""
        k, row = self.locate(index)
        return self.datasets[k].shapes(row)


class TensorRowProcessor(RawItemProcessor):
    """Row number -> the sample a training step consumes (runs in the loader's workers).

    The sample is ``{"index", "prompt", "condition": {key: tensor}, "latents": {component: tensor}, "metadata"}``
    (a preference row: ``chosen_latents`` and ``rejected_latents`` instead of ``latents``). With ``defer`` it is
    ``{"index", "shapes"}`` only, read from the ``_shape`` columns, and :class:`TensorRowCollator` reads the rest once
    the batcher has chosen the batch: a packing batcher then weighs its pool without decoding a single tensor, and
    holds no decoded tensors while it chooses.

    Args:
        rows: the shard datasets.
        columns: the adapter's :class:`TensorColumns`.
        defer: leave the tensors to the collator (packing batchers).
        supervision: ``demonstration`` (SFT) or ``preference`` (offline DPO: the latent columns prefixed
            ``chosen_`` and ``rejected_``; :data:`LATENT_BATCH_KEYS`).
    """

    def __init__(self, rows: TensorRows, columns: TensorColumns, defer: bool = False,
                 supervision: str = "demonstration") -> None:
        if supervision not in LATENT_BATCH_KEYS:
            raise ValueError(f"TensorRowProcessor: supervision must be one of {sorted(LATENT_BATCH_KEYS)}, "
                             f"got {supervision!r}")
        self.rows, self.columns, self.defer, self.supervision = rows, columns, defer, supervision

    def process(self, item: int) -> dict[str, Any]:
        if self.defer:
            return {"index": int(item), "shapes": self.rows.shapes(int(item))}
        return self.load(int(item))

    def load(self, index: int) -> dict[str, Any]:
        """The full sample of row ``index``."""
        row = self.rows.read(index)
        prompt = row.get(self.columns.prompt, "") if self.columns.prompt else ""
        sample = {"index": index, "prompt": prompt, "metadata": {}}
        for key, prefix in LATENT_BATCH_KEYS[self.supervision].items():
            try:
                sample["condition"], sample[key] = self.columns.from_row(row, prefix)
            except ValueError as exc:  # a row longer than its pad length
                k, local = self.rows.locate(index)
                path, group, within = self.rows.datasets[k].locate(local)
                raise DatasetError(path, None, None, f"row group {group}, row {within}: {exc}") from None
        return sample


class TensorRowCollator(BatchCollator):
    """Samples of :class:`TensorRowProcessor` -> a batch: ``index`` (tensor), ``prompt`` (list), ``condition`` and
    ``latents`` (or ``chosen_latents`` and ``rejected_latents``; dicts of tensors stacked on a new batch axis),
    ``metadata`` (list).

    Deferred samples (``{"index", "shapes"}``) are read here through ``processor``. Tensors of one key must share a
    shape within a batch (one resolution per batch, as the loader fits media targets to one geometry): a packing
    batcher over mixed sizes needs a family collator that pads or packs.

    Conditions collate by the adapter's ``condition_collation`` (:mod:`ff_core.data.cache.collation`: a text
    embedding stored without padding can be padded per batch, with a mask).

    Args:
        processor: reads deferred samples (``None``: every sample must be complete).
        condition_collation: the adapter's ``condition_collation`` (condition key -> ``stack`` | ``pad`` | ``list``).
    """

    def __init__(
        self, processor: TensorRowProcessor | None = None, condition_collation: Mapping[str, str] | None = None
    ) -> None:
        self.processor = processor
        self.condition_collation = dict(condition_collation or {})
        check_rules(self.condition_collation, "TensorRowCollator")

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        if not samples:
            raise ValueError("TensorRowCollator: cannot collate an empty batch")
        samples = [self._complete(s) for s in samples]
        batch = {"index": torch.tensor([s["index"] for s in samples]), "prompt": [s["prompt"] for s in samples],
                 "condition": self._conditions(samples), "metadata": [s["metadata"] for s in samples]}
        for keys in LATENT_BATCH_KEYS.values():
            batch.update({key: _stack(samples, key) for key in keys if key in samples[0]})
        return batch

    def _conditions(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        if not self.condition_collation:  # stacked, with the shard-specific messages
            return _stack(samples, "condition")
        # Values a worker only located stay lazy through the rules (stacked, padded, masked from their shapes): they
        # are read into the batch in the main process, as without rules.
        return collate_conditions([s["condition"] for s in samples], self.condition_collation,
                                  [f"row {s['index']}" for s in samples])  # fmt: skip

    def _complete(self, sample: dict[str, Any]) -> dict[str, Any]:
        if "condition" in sample:
            return sample
        if self.processor is None:
            raise ValueError(f"TensorRowCollator: row {sample['index']} was deferred (no tensors read) and the "
                             "collator has no processor to read it")
        return self.processor.load(sample["index"])


def _stack(samples: list[dict[str, Any]], part: str) -> dict[str, torch.Tensor]:
    keys = list(samples[0][part])
    out = {}
    for key in keys:
        values = []
        for s in samples:
            if key not in s[part]:
                raise ValueError(f"a batch mixes rows with and without {part} {key!r}: row {samples[0]['index']} has "
                                 f"it, row {s['index']} not (every dataset of a run must store the same columns)")
            values.append(s[part][key])
        shapes = {tuple(v.shape) for v in values}
        if len(shapes) > 1:
            found = ", ".join(f"row {s['index']}: {tuple(v.shape)}" for s, v in zip(samples, values))
            raise ValueError(f"{part} {key!r}: the rows of one batch have different shapes ({found}); store one shape "
                             "per batch, or batch with a collator that pads")
        out[key] = stack(values)  # lazy when the values are (read into the batch in the main process)
    return out


class StoredTokenCount:
    """Size function of the packing batchers (``PoolPackingBatcher(size_fn=...)``, ``SequentialPackingBatcher``)
    from a row's stored shapes: the denoiser tokens of one latent column, ``prod(shape[-k:] // patch)`` over its
    last ``k = len(patch)`` axes (SD3: ``(H/2)(W/2)`` of a (C, H, W) latent; Wan: ``T (H/2)(W/2)`` of (C, T, H, W)
    with ``patch=(1, 2, 2)``), plus the length of ``text_column`` (axis 0) when given.

    It reads ``sample["shapes"]``, which :class:`TensorRowProcessor` fills from the ``_shape`` columns alone (with
    ``defer=True`` nothing else is read before batching).

    Args:
        column: the latent column whose tokens are counted.
        patch: the denoiser's patch size over the latent's last axes.
        text_column: a variable-length condition column (text embeddings ``[L, D]``) whose ``L`` adds to the cost.
    """

    def __init__(self, column: str = "latent", patch: Sequence[int] = (2, 2), text_column: str | None = None) -> None:
        if not patch or any(p < 1 for p in patch):
            raise ValueError(f"StoredTokenCount: patch must be positive integers, found {tuple(patch)}")
        self.column, self.patch, self.text_column = column, tuple(patch), text_column

    def __call__(self, sample: Mapping[str, Any]) -> int:
        shapes = sample["shapes"]
        if self.column not in shapes:
            raise KeyError(f"StoredTokenCount: row {sample.get('index')} has no tensor {self.column!r}; it has "
                           f"{sorted(shapes)}")
        shape = shapes[self.column]
        if len(shape) < len(self.patch):
            raise ValueError(f"StoredTokenCount: {self.column!r} of row {sample.get('index')} has shape {shape}, "
                             f"fewer axes than patch {self.patch}")
        tokens = math.prod(n // p for n, p in zip(shape[-len(self.patch):], self.patch))
        if self.text_column is not None:
            tokens += shapes[self.text_column][0]
        return tokens


# -- opening the shards of data.datasets --------------------------------------------------------------------------
@dataclass
class ShardSource:
    """One ``data.datasets`` entry of tensor-parquet shards, opened for training.

    Attributes:
        name: the entry's name.
        dataset: the reader, opened for the adapter's columns only.
        rows: the rows training serves (its first ones with ``train.max_dataset_size``).
        identity: ``{"rows", "sha256"}`` for the loader's resume fingerprint (the files' paths, sizes and row-group
            sizes, not their times: a copy of the shards on another node resumes alike).
    """

    name: str
    dataset: TensorParquetDataset
    rows: int
    identity: dict[str, Any]


def column_problems(dataset: TensorParquetDataset, columns: TensorColumns, adapter: str,
                    what: str = "the dataset", supervision: str = "demonstration") -> list[DatasetError]:
    """One error per tensor column the adapter trains from that ``dataset`` lacks, naming its first file (every
    file has the first one's columns: the reader checks) and the tensors it has."""
    have = ", ".join(dataset.tensor_names) or "no tensor"
    return [DatasetError(dataset.files[0], None, column, f"no tensor column {column!r} ({column}_bytes, _shape, "
                         f"_dtype), which adapter {adapter!r} trains from; {what} has {have}")
            for column in columns.missing(dataset.tensor_names, supervision)]


def open_shards(
    configs: Sequence[DatasetConfig], columns: TensorColumns, adapter: str, cache_dir: str | None = None,
    cached_groups: int = 4, supervision: str = "demonstration", hand_off: bool = True,
) -> list[ShardSource]:
    """Open every tensor-parquet entry of ``data.datasets`` for training, checked against the adapter's columns.

    Only footers are read (the readers' row indexes, cached), so this runs before any weight loads. Every file of a
    root has the first file's columns (the reader checks), so a missing column is named with the first file. An
    optional column is read only when every root has it: one batch never mixes rows with and without it.

    Raises:
        DatasetErrors: a root without parquet files, files whose columns differ, a required column missing.

    Args:
        configs: the entries with ``tensor_parquet_dir`` and a ``train`` split.
        columns: the adapter's :attr:`~ff_core.adapter.Adapter.tensor_columns`.
        adapter: the adapter's name, for messages.
        cache_dir: where the readers cache their row indexes (``None``: beside the data when writable).
        cached_groups: decoded multi-row row groups each reader keeps per process (at least the two-level shuffle's
            window, :mod:`ff_core.data.tensor_parquet.order`).
        supervision: ``demonstration`` or ``preference`` (latent columns prefixed ``chosen_`` / ``rejected_``).
        hand_off: loader workers hand uncompressed tensors to the main process as file ranges, read there when
            ``DataflowLoader`` materialises the batch (``TensorParquetDataset(hand_off=True)``); ``False``: the
            tensors cross in shared memory.
    """
    from ff_core.data.tensor_parquet import TensorParquetDataset

    errors: list[DatasetError] = []
    opened = []
    for cfg in configs:
        try:
            full = TensorParquetDataset(cfg.root, cache_dir=cache_dir)  # the index only: no data page is read
        except DatasetError as exc:
            errors += exc.errors
            continue
        errors += column_problems(full, columns, adapter, f"dataset {cfg.name!r}", supervision)
        opened.append((cfg, full))
    raise_collected(errors)
    optional = [c for c in columns.optional if all(c in full.tensor_names for _, full in opened)]
    sources = []
    for cfg, full in opened:
        prompt = [columns.prompt] if columns.prompt in full.scalar_names else []
        read = [*columns.required_for(supervision), *optional, *prompt]
        dataset = TensorParquetDataset(cfg.root, columns=read, cache_dir=cache_dir, cached_groups=cached_groups,
                                       hand_off=hand_off)
        limit = cfg.train.max_dataset_size if cfg.train is not None else None
        rows = len(dataset) if limit is None else min(limit, len(dataset))
        sources.append(ShardSource(cfg.name, dataset, rows, {**dataset.identity, "rows": rows}))
    return sources


