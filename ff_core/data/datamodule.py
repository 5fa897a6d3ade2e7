"""FlowDataModule: dataset folders -> validated records -> preprocessed conditions -> batches.

Order of work (spec: "Condition cache and target lifecycle"):

* ``setup``: read and validate every split against the adapter's IO contract. No weights are loaded yet,
  so a broken dataset fails before anything heavy happens.
* ``train_dataloader`` / ``val_dataloader``: the adapter is loaded by now (``FlowModule.configure_model``);
  conditions are preprocessed once under no_grad (``adapter.preprocess``), targets are decoded fresh in
  ``__getitem__`` and encoded on the fly by the objective, never cached.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from ff_core.adapter import Adapter, ConditionInput
from ff_core.data.media import check_files_exist, decode_media
from ff_core.data.records import Record
from ff_core.data.sources import DatasetConfig, TrainerType, check_dataset_configs, load_split
from ff_core.data.validation import check_batch_size, check_records
from ff_core.errors import DatasetErrors
from ff_core.plugins import get_adapter_class

log = logging.getLogger(__name__)


@dataclass
class Sample:
    """What one dataset index yields before collation."""

    index: int
    prompt: str
    condition: dict[str, torch.Tensor]
    target: list[torch.Tensor]


class ConditionedDataset(Dataset):
    """Records with their preprocessed conditions; target media are decoded on access."""

    def __init__(self, records: list[Record], conditions: list[dict[str, torch.Tensor]]) -> None:
        self.records, self.conditions = records, conditions

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> Sample:
        record = self.records[index]
        # Targets are decoded fresh on every access and never cached (spec: "Condition cache and target lifecycle").
        candidate = record.candidates[0] if record.candidates else ()
        target = [decode_media(m, referenced_by=record.where) for m in candidate]
        return Sample(index, record.prompt, self.conditions[index], target)


def collate_samples(samples: list[Sample]) -> dict[str, Any]:
    """Conditions stack (same shapes per adapter); targets stay per-sample lists (sizes may differ)."""
    return {
        "index": torch.tensor([s.index for s in samples]),
        "prompt": [s.prompt for s in samples],
        "condition": default_collate([s.condition for s in samples]),
        "target": [s.target for s in samples],
    }


class FlowDataModule(L.LightningDataModule):
    """Datasets for flow-model post-training.

    Args:
        datasets: the dataset folders, exactly as the spec's ``data.datasets``.
        per_device_batch_size: training samples per device and step.
        eval_batch_size: prompts per validation batch.
        preprocessing_batch_size: rows per ``adapter.preprocess`` call.
        cache_dir: where condition caches live.
        enable_preprocess: preprocess conditions before training (required by offline trainers).
        force_reprocess: rebuild conditions even when a cache exists.
        sampler_type: ``auto`` (the trainer's distributed sampler over a shuffled source).
        num_workers: DataLoader worker processes.
        seed: shuffling seed.
        adapter: the adapter name (linked from ``model.adapter``; not set by hand).
        trainer_type: ``sft``, ``offline-dpo`` or ``grpo`` (linked from ``model.objective``).
    """

    def __init__(
        self,
        datasets: list[DatasetConfig],
        per_device_batch_size: int = 1,
        eval_batch_size: int = 8,
        preprocessing_batch_size: int = 8,
        cache_dir: str = "~/.cache/ff/datasets",
        enable_preprocess: bool = True,
        force_reprocess: bool = False,
        sampler_type: str = "auto",
        num_workers: int = 0,
        seed: int = 0,
        adapter: str | None = None,
        trainer_type: TrainerType = "sft",
    ) -> None:
        super().__init__()
        if not datasets:
            raise ValueError("data.datasets must list at least one dataset")
        for name, value in (("per_device_batch_size", per_device_batch_size), ("eval_batch_size", eval_batch_size),
                            ("preprocessing_batch_size", preprocessing_batch_size)):
            if value < 1:
                raise ValueError(f"data.{name} must be >= 1, got {value}")
        if sampler_type != "auto":
            raise ValueError(f"data.sampler_type: only 'auto' is supported so far, got {sampler_type!r}")
        self.datasets = [d if isinstance(d, DatasetConfig) else DatasetConfig(**d) for d in datasets]
        check_dataset_configs(self.datasets, trainer_type)
        self.per_device_batch_size = per_device_batch_size
        self.eval_batch_size = eval_batch_size
        self.preprocessing_batch_size = preprocessing_batch_size
        self.cache_dir = cache_dir
        self.enable_preprocess = enable_preprocess
        self.force_reprocess = force_reprocess
        self.num_workers = num_workers
        self.seed = seed
        self.adapter_name = adapter
        self.trainer_type = trainer_type
        self.train_records: list[Record] = []
        self.eval_records: list[Record] = []

    # -- before weights: read and validate -------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if self.train_records or self.eval_records:
            return
        errors = []
        for cfg in self.datasets:
            for split, enabled in (("train", cfg.train is not None), ("test", cfg.eval is not None)):
                if not enabled:
                    continue
                try:
                    records = load_split(cfg, split, self.trainer_type)
                except DatasetErrors as exc:
                    errors.extend(exc.errors)
                    continue
                (self.train_records if split == "train" else self.eval_records).extend(records)
        if errors:
            raise DatasetErrors(errors)
        if self.adapter_name is not None:
            cls = get_adapter_class(self.adapter_name)
            check_batch_size(
                cls.io_contract, cls.name, self.per_device_batch_size,
                preprocessing_batch_size=self.preprocessing_batch_size, eval_batch_size=self.eval_batch_size,
            )
            check_records(self.train_records + self.eval_records, cls.io_contract)
        check_files_exist(self.train_records + self.eval_records)
        if stage == "fit" and not self.train_records:
            raise ValueError("data.datasets: no dataset has a train split enabled")
        log.info("data: %d training rows, %d evaluation rows", len(self.train_records), len(self.eval_records))

    # -- after weights: conditions and loaders -----------------------------------------------------------
    def _adapter(self) -> Adapter:
        module = self.trainer.lightning_module if self.trainer is not None else None
        adapter = getattr(module, "adapter", None)
        if adapter is None:
            raise RuntimeError("FlowDataModule needs a FlowModule whose adapter is loaded (configure_model)")
        return adapter

    def _dataset(self, records: list[Record]) -> ConditionedDataset:
        adapter = self._adapter()
        conditions: list[dict[str, torch.Tensor]] = []
        for start in range(0, len(records), self.preprocessing_batch_size):
            chunk = records[start : start + self.preprocessing_batch_size]
            with torch.no_grad():
                conditions.extend(adapter.preprocess([ConditionInput(r.prompt, r.negative_prompt) for r in chunk]))
        return ConditionedDataset(records, conditions)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            self._dataset(self.train_records),
            batch_size=self.per_device_batch_size,
            shuffle=True,
            generator=generator,
            num_workers=self.num_workers,
            collate_fn=collate_samples,
            drop_last=False,
        )

    def val_dataloader(self) -> DataLoader | list:
        if not self.eval_records:
            return []
        return DataLoader(
            self._dataset(self.eval_records),
            batch_size=self.eval_batch_size,
            shuffle=False,
            num_workers=0,
            collate_fn=collate_samples,
        )
