"""Dataset folders: the ``data.datasets`` config, split files, media directories and path resolution.

Spec: dataset-guide, "Directory and split layout". A dataset folder holds ``train.txt|train.jsonl``
(required) and ``test.txt|test.jsonl`` (optional) plus ``images/``, ``videos/``, ``audios/`` by default.
Training rows of SFT / offline DPO are strict V2 records; evaluation always uses the legacy formats, so one
folder may hold a V2 ``train.jsonl`` beside a legacy prompt-only ``test.jsonl``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ff_core.contracts import MediaType
from ff_core.data.records import (
    SUPERVISION_FOR_TRAINER,
    Record,
    Schema,
    parse_legacy_row,
    parse_v2_record,
    read_jsonl,
    read_prompts_txt,
    scan_jsonl,
    supervision_errors,
)
from ff_core.errors import DatasetError, DatasetErrors

Split = Literal["train", "test"]
TrainerType = Literal["sft", "offline-dpo", "grpo", "nft"]
OFFLINE_TRAINERS = ("sft", "offline-dpo")
ONLINE_TRAINERS = ("grpo", "nft")
"""Trainers whose rows are prompts sampled in groups (Flow-GRPO, DiffusionNFT)."""


@dataclass
class SplitConfig:
    """Per-split options of one dataset (``data.datasets[i].train`` / ``.eval``).

    Attributes:
        weight: sampling weight against other datasets (offline sources must use 1).
        max_dataset_size: keep only the first N rows of the split (``None``: all).
    """

    weight: float = 1.0
    max_dataset_size: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not self.weight > 0:
            raise ValueError(f"weight must be a number > 0, got {self.weight!r}")
        size = self.max_dataset_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"max_dataset_size must be an integer >= 1, got {size!r}")


@dataclass
class DatasetConfig:
    """One entry of ``data.datasets``: a dataset folder (``dataset_dir``) or tensor-parquet shards
    (``tensor_parquet_dir``), exactly one of them.

    Attributes:
        name: a name for logs and mixing.
        dataset_dir: the dataset folder (``~`` expanded); V2 and Ref2VA reference paths resolve against it.
        tensor_parquet_dir: the root of preprocessed tensor-parquet shards (every ``*.parquet`` below it; spec
            tensor-parquet-dataset-card): rows holding the adapter's conditions and clean latents
            (``Adapter.tensor_columns``), trained from without text encoders or VAE encodes (SFT and offline DPO;
            no ``eval`` split: evaluation prompts come from a dataset folder entry).
        image_dir: root of legacy ``image``/``images`` paths (default ``{dataset_dir}/images``).
        video_dir: root of legacy ``video``/``videos`` paths (default ``{dataset_dir}/videos``).
        audio_dir: root of legacy ``audio``/``audios`` paths (default ``{dataset_dir}/audios``).
        train: options of the training split; ``None`` leaves this dataset out of training.
        eval: options of the evaluation split (``test.*``); ``None`` disables evaluation on it.
    """

    name: str
    dataset_dir: str | None = None
    tensor_parquet_dir: str | None = None
    image_dir: str | None = None
    video_dir: str | None = None
    audio_dir: str | None = None
    train: SplitConfig | None = field(default_factory=SplitConfig)
    eval: SplitConfig | None = None

    def __post_init__(self) -> None:
        if (self.dataset_dir is None) == (self.tensor_parquet_dir is None):
            raise ValueError("set exactly one of dataset_dir (a dataset folder) and tensor_parquet_dir (tensor-parquet "
                             f"shards), found dataset_dir={self.dataset_dir!r}, "
                             f"tensor_parquet_dir={self.tensor_parquet_dir!r}")
        for key in ("name", "dataset_dir" if self.dataset_dir is not None else "tensor_parquet_dir"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{key} must be a non-empty string, got {value!r}")
        # A YAML mapping (``train: {weight: 1}``, ``eval: {}``) arrives as a dict when built by hand.
        for key in ("train", "eval"):
            value = getattr(self, key)
            if isinstance(value, dict):
                try:
                    setattr(self, key, SplitConfig(**value))
                except TypeError as exc:
                    raise ValueError(f"{key}: {exc}") from None

    @property
    def is_tensor_parquet(self) -> bool:
        """Whether this entry is tensor-parquet shards (``tensor_parquet_dir``) rather than a dataset folder."""
        return self.tensor_parquet_dir is not None

    @property
    def root(self) -> Path:
        """``dataset_dir`` (or ``tensor_parquet_dir``), ``~`` expanded and normalised (``a/../b`` -> ``b``), so
        messages name files one way."""
        return _normalised(self.tensor_parquet_dir if self.is_tensor_parquet else self.dataset_dir)

    def media_dir(self, mtype: MediaType | str) -> Path:
        """The root of relative ordinary media paths of one type (spec: ``image_dir`` and friends)."""
        mtype = MediaType(mtype)
        override = {MediaType.IMAGE: self.image_dir, MediaType.VIDEO: self.video_dir, MediaType.AUDIO: self.audio_dir}
        value = override[mtype]
        return _normalised(value) if value else self.root / f"{mtype.value}s"

    def media_dirs(self) -> dict[MediaType, Path]:
        return {t: self.media_dir(t) for t in MediaType}


def _normalised(path: str) -> Path:
    return Path(os.path.normpath(Path(path).expanduser()))


def check_dataset_configs(datasets: Sequence[DatasetConfig], trainer_type: TrainerType) -> None:
    """Cross-entry rules of ``data.datasets``, naming the key the user wrote.

    Spec: "Each offline source must use train.weight: 1; replacement weighting would make full traversal
    stop meaning one data epoch". Names must be unique (they label logs and caches). Tensor-parquet shards train
    the offline trainers only, have no evaluation split and no media folders, and do not mix with dataset folders in
    training (their batches carry stored latents, a folder's decoded media).
    """
    problems = [] if trainer_type in OFFLINE_TRAINERS else [
        f"data.datasets[{i}].tensor_parquet_dir: tensor-parquet shards train the offline trainers (sft, offline-dpo), "
        f"not {trainer_type!r}" for i, cfg in enumerate(datasets) if cfg.is_tensor_parquet and cfg.train is not None]
    for i, cfg in enumerate(datasets):
        if not cfg.is_tensor_parquet:
            continue
        if cfg.eval is not None:
            problems.append(f"data.datasets[{i}].eval: tensor-parquet shards hold no evaluation prompts; evaluate on a "
                            "dataset folder entry (dataset_dir with eval: {}, train: null)")
        problems += [f"data.datasets[{i}].{key}: only dataset folders (dataset_dir) have media folders"
                     for key in ("image_dir", "video_dir", "audio_dir") if getattr(cfg, key) is not None]
    kinds = {cfg.is_tensor_parquet for cfg in datasets if cfg.train is not None}
    if len(kinds) > 1:
        problems.append("data.datasets: training mixes tensor-parquet shards with dataset folders; train from one kind "
                        "(convert folders with `ff data preprocess-latents`)")
    seen: dict[str, int] = {}
    for i, cfg in enumerate(datasets):
        if cfg.name in seen:
            problems.append(f"data.datasets[{i}].name: {cfg.name!r} is already used by data.datasets[{seen[cfg.name]}]")
        seen.setdefault(cfg.name, i)
        if trainer_type in OFFLINE_TRAINERS and cfg.train is not None and cfg.train.weight != 1:
            problems.append(
                f"data.datasets[{i}].train.weight: offline trainer {trainer_type!r} needs weight 1, "
                f"found {cfg.train.weight}"
            )
    if problems:
        raise ValueError("\n".join(problems))


def folder_error(cfg: DatasetConfig) -> DatasetError | None:
    """The error of a ``dataset_dir`` that is not a folder, or ``None``; callers report it once per dataset,
    not once per split."""
    if cfg.root.is_dir():
        return None
    what = "is not a folder" if cfg.root.exists() else "folder does not exist"
    key = "tensor_parquet_dir" if cfg.is_tensor_parquet else "dataset_dir"
    return DatasetError(cfg.root, None, key, f"dataset {cfg.name!r}: {what}")


def split_file(cfg: DatasetConfig, split: Split) -> Path | None:
    """The split's file (``<split>.jsonl`` or ``<split>.txt``), or ``None`` when both are absent."""
    jsonl, txt = cfg.root / f"{split}.jsonl", cfg.root / f"{split}.txt"
    if jsonl.exists() and txt.exists():
        raise DatasetErrors([DatasetError(cfg.root, None, None, f"both {jsonl.name} and {txt.name} exist; keep one")])
    return jsonl if jsonl.exists() else txt if txt.exists() else None


def detect_schema(path: Path) -> Schema:
    """``v2`` when the first JSON object of a ``.jsonl`` file carries ``schema_version``, else ``legacy``."""
    if path.suffix != ".jsonl":
        return "legacy"
    try:
        with path.open(encoding="utf-8-sig") as handle:
            for text in handle:
                if not text.strip():
                    continue
                try:
                    obj: Any = json.loads(text)
                except json.JSONDecodeError:
                    continue
                return "v2" if isinstance(obj, dict) and "schema_version" in obj else "legacy"
    except (OSError, UnicodeDecodeError):
        pass  # read_jsonl reports it with the file name
    return "legacy"


def load_split(cfg: DatasetConfig, split: Split, trainer_type: TrainerType | None) -> list[Record]:
    """Read and validate one split of one dataset; raise :class:`DatasetErrors` listing every problem.

    Args:
        cfg: the dataset entry.
        split: ``train`` (required to exist) or ``test`` (optional: ``[]`` when absent).
        trainer_type: ``sft`` / ``offline-dpo``: ``train`` must be strict V2 records of the supervision the
            trainer consumes, homogeneous across the file. ``grpo``: legacy generation rows. ``None``: detect
            (V2 when the file's records carry ``schema_version``, then homogeneous). ``test`` is always legacy.
    """
    missing = folder_error(cfg)
    if missing is not None:
        raise DatasetErrors([missing])
    path = split_file(cfg, split)
    if path is None:
        if split == "test":
            return []
        raise DatasetErrors([DatasetError(
            cfg.root, None, None, f"dataset {cfg.name!r}: no training split (neither train.jsonl nor train.txt exists)"
        )])
    if split == "test" or trainer_type in ONLINE_TRAINERS:
        schema: Schema = "legacy"
    elif trainer_type in OFFLINE_TRAINERS:
        schema = "v2"
    else:
        schema = detect_schema(path)
    if schema == "legacy":
        records = _read_legacy(cfg, path)
    else:
        if path.suffix == ".txt":
            raise DatasetErrors([DatasetError(
                path, None, None, f"trainer {trainer_type!r} needs strict V2 records in train.jsonl, not prompts"
            )])
        records, errors = scan_jsonl(path, lambda obj, p, n: parse_v2_record(obj, p, n, cfg.root))
        # Homogeneity (spec: "A training source must be homogeneous") is reported with the format errors.
        errors += supervision_errors(records, SUPERVISION_FOR_TRAINER[trainer_type] if trainer_type else None)
        if errors:
            raise DatasetErrors(sorted(errors, key=DatasetError.sort_key))
    options = cfg.train if split == "train" else cfg.eval
    if options is not None and options.max_dataset_size is not None:
        records = records[: options.max_dataset_size]
    return records


def _read_legacy(cfg: DatasetConfig, path: Path) -> list[Record]:
    if path.suffix == ".txt":
        return read_prompts_txt(path)
    dirs = cfg.media_dirs()
    return read_jsonl(path, lambda obj, p, n: parse_legacy_row(obj, p, n, dirs, cfg.root), skip_blank=True)

