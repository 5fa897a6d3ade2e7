"""FlowDataModule: dataset folders -> validated records -> preprocessed conditions -> batches.

Order of work (spec: "Condition cache and target lifecycle"):

* ``setup``: read and validate every split against the adapter's IO contract. No weights are loaded yet,
  so a broken dataset fails before anything heavy happens.
* :meth:`FlowDataModule.prepare_conditions`, called by ``FlowModule.configure_model`` once the adapter is loaded
  (before the strategy places the model): every split's conditions are opened from the Arrow condition cache
  (:mod:`ff_core.data.cache.store`), built first where missing (``adapter.preprocess`` under no_grad, sharded over the
  ranks). Then the adapter's preprocessing-only components can be released.
* ``train_dataloader`` / ``val_dataloader``: records paired with their memory-mapped conditions; targets are
  decoded fresh by :class:`~ff_core.data.samples.RecordProcessor` in the loader's workers and encoded on the fly
  by the objective, never cached.

Training batches come from the composable dataflow (docs/dataflow.md): ``SamplerDistributor`` for the offline
trainers (spec "Offline dataloader and epoch semantics": every epoch one complete traversal, sharded over
data-parallel ranks exactly as ``torch.utils.data.DistributedSampler`` with ``drop_last=False`` shards it, the
same number of batches on every rank and in every epoch, a final partial batch allowed), ``MapDistributor`` for
online ones → ``RecordProcessor`` → ``SimpleBatcher`` → ``SampleCollator``. The loader
is stateful, so Lightning saves its position in every checkpoint (``loops.fit_loop.combined_loader``) and a run
resumed with ``--ckpt_path`` continues the exact sample order; this module marks each batch consumed when the
training loop takes it (``on_before_batch_transfer``), so batches fetched ahead never count.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import lightning as L
import torch
from torch.utils.data import DataLoader

from ff_core.adapter import Adapter
from ff_core.contracts import MediaGeometry, PipelineIOContract
from ff_core.data.bad_samples import BadSampleLog
from ff_core.data.cache.group import BuildGroup
from ff_core.data.cache.identity import MediaDigests, records_identity
from ff_core.data.cache.store import CacheResult, ConcatConditions, ConditionSource, adapter_preprocess, open_or_build
from ff_core.data.dataflow import (
    BucketBatcher,
    DataflowLoader,
    DataParallelCoords,
    GroupedDistributor,
    MapDistributor,
    SamplerDistributor,
    check_grouping,
)
from ff_core.data.media.buckets import Bucket, assign_buckets
from ff_core.data.media.decode import check_files_exist
from ff_core.data.media.target_spans import target_span_errors
from ff_core.data.records import Record
from ff_core.data.records.sources import (
    OFFLINE_TRAINERS,
    ONLINE_TRAINERS,
    DatasetConfig,
    TrainerType,
    check_dataset_configs,
    folder_error,
    load_split,
    split_file,
)
from ff_core.data.records.validation import check_batch_size, check_records, conform, record_warnings
from ff_core.data.samples import (
    ConditionedRecords,
    RecordProcessor,
    SampleCollator,
    process_and_collate,
)
from ff_core.data.tensor_parquet.checks import check_shard_rows, shard_row_name
from ff_core.data.tensor_parquet.order import GroupedMapDistributor, GroupedSamplerDistributor
from ff_core.data.tensor_parquet.provenance import check_provenance, shard_provenance
from ff_core.data.tensor_parquet.rows import (
    LATENT_BATCH_KEYS,
    ShardSource,
    TensorColumns,
    TensorRowCollator,
    TensorRowProcessor,
    TensorRows,
    open_shards,
)
from ff_core.errors import ConfigError, DatasetErrors, raise_collected
from ff_core.plugins import get_adapter_class, unimplemented
from ff_core.pretrained import (
    check_adapter_kwargs,
    resolve_contract,
    resolve_output_geometry,
    resolve_tensor_columns,
    resolve_tensor_shapes,
)

log = logging.getLogger(__name__)

#: Batch key under which the training loader stamps each batch's delivery number (removed before the step).
STAMP_KEY = "dataflow_seq"
#: Environment variable naming the cache folder when ``data.cache_dir`` is not set.
CACHE_DIR_ENV = "FF_CACHE_DIR"
DEFAULT_CACHE_DIR = "~/.cache/ff/datasets"


def cache_root(cache_dir: str | None = None) -> str:
    """ff's cache folder (condition caches, media headers): ``cache_dir`` (``data.cache_dir``), else
    ``$FF_CACHE_DIR``, else ``~/.cache/ff/datasets``."""
    return os.path.expanduser(cache_dir or os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR)


class EpochAlignedLoader(DataflowLoader):
    """A :class:`DataflowLoader` whose length counts the whole current epoch, as Lightning expects.

    ``DataflowLoader.__len__`` is the number of batches the next ``iter()`` yields, i.e. what is left of the epoch.
    Lightning's training loop, resumed mid-epoch, counts the batches it already ran in that epoch towards the
    length (``batch_progress.current.ready``); reporting only the remainder would end its epoch early and shift
    ``current_epoch`` (and ``max_epochs``) against the uninterrupted run. The sample order is unaffected either way.
    """

    def __len__(self) -> int:
        return self.epoch_step + super().__len__()


class FlowDataModule(L.LightningDataModule):
    """Datasets for flow-model post-training.

    Args:
        datasets: the dataset folders, exactly as the spec's ``data.datasets``.
        per_device_batch_size: training samples per device and step.
        eval_batch_size: prompts per validation batch.
        preprocessing_batch_size: rows per ``adapter.preprocess`` call (at most the adapter's batch capability:
            1 for adapters that take one sample at a time).
        cache_dir: where condition caches live (``None``: ``$FF_CACHE_DIR``, else ``~/.cache/ff/datasets``).
        enable_preprocess: cache conditions in Arrow files every rank memory-maps (docs/datasets.md, "Condition
            cache"); ``false`` preprocesses them into memory at every start and keeps the text encoders loaded.
        force_reprocess: rebuild the condition caches even when complete ones exist (e.g. after replacing a media
            file outside the dataset folder's records).
        preprocess_parallelism: how ranks share a cache build: ``local`` (each node's ranks build the node's copy;
            works without a shared file system) or ``global`` (every rank of the job builds a shard; ``cache_dir``
            must be shared by all nodes).
        sampler_type: ``auto``: every epoch a fresh permutation of all training records (torch's
            ``DistributedSampler`` for offline trainers: seeded by ``seed + epoch``), sharded over data-parallel ranks
            and loader workers, resumable mid-epoch.
        num_workers: training loader worker processes (each decodes the targets of its own shard); validation
            loads in the main process.
        seed: shuffling seed (epoch ``e``'s order depends only on ``(seed, e)``; in the resume fingerprint).
        shuffle: reshuffle the training records every epoch; ``False`` keeps dataset order.
        row_group_window: tensor-parquet shards only: shuffle at two levels, the order of row groups and then the
            rows within each window of this many groups, keeping this many decoded groups per reader
            (:mod:`ff_core.data.tensor_parquet.order`). For shards from writers that put many rows in one row group
            (Parquet decodes whole groups); ``None``: a uniform permutation of rows, right for ff's one-row-per-group
            shards.
        hand_off: tensor-parquet shards: uncompressed tensors travel as file ranges that the main process reads
            straight into the batch (``TensorParquetDataset.describe``, docs/datasets.md), from the workers or, with
            ``num_workers=0``, from the processor; ``False``: workers read them and the rows cross in shared memory
            (without workers: read into the row, then copied into the batch). Either way a shard file must not be
            replaced while a run reads it (with file ranges that is an error naming it). The file-range path
            wins when the shards are page-cached; turn it off when the dataset is far larger than RAM (every read
            then waits on the disk in the main process) or on file systems where reads are slow (FUSE, network).
        buckets: mixed resolutions / durations (docs/dataflow.md, "Mixed geometry"): bucket geometries
            ``[{height, width, num_frames?, fps?, start?, batch_size?}]``. Each training record goes to one bucket from
            its target's header (:mod:`ff_core.data.media.buckets`; one that fits none is an error before weights load),
            its target is decoded and fitted to that bucket, and batches never mix buckets (``BucketBatcher``), so
            nothing is padded. ``None``: every target fitted to the adapter's ``output_geometry()``, fixed batches.
        bad_samples: a training sample whose target cannot be decoded (a truncated PNG or MP4, a header-only WAV),
            found when its batch is drawn: ``error`` stops the run with its one line ``file:line: field: reason``
            (with workers too); ``skip`` forms the batch without it (a smaller batch: every rank keeps its number
            of batches, so DDP and exact resume are unchanged), warns, counts it in the loader state and lists it in
            ``<run dir>/bad_samples.jsonl`` (:mod:`ff_core.data.bad_samples`). A batch of bad samples only stops
            the run either way (with ``per_device_batch_size: 1`` every bad sample does). ``ff data validate
            --check-media`` finds them all before a run.
        max_tokens: with ``buckets``: the token budget of a batch; a bucket without ``batch_size`` takes
            ``max_tokens // adapter.denoiser_tokens(geometry)`` samples (``None``: ``per_device_batch_size``).
        adapter: the adapter name (linked from ``model.adapter``; not set by hand).
        pretrained_model_name_or_path: the checkpoint (linked from ``model.pretrained_model_name_or_path``): records
            are validated against its contract, read from its config files before any weight loads
            (``Adapter.resolve_contract``); ``None``: the adapter's default contract.
        adapter_kwargs: linked from ``model.adapter_kwargs`` (they may select the checkpoint's variant).
        trainer_type: ``sft``, ``offline-dpo`` or ``grpo`` (linked from ``model.objective``).
        grouping: GRPO's ``(prompts_per_step, group_size)`` (linked from ``model.objective``; not set by hand): every
            step the ranks share P prompts, each sampled K times, each rank taking ``P * K / W`` of the pairs
            (:class:`~ff_core.data.dataflow.GroupedDistributor`); ``per_device_batch_size`` is then unused.
            ``None`` with ``grpo`` (a data module built by hand): plain shuffled prompts, which GRPO refuses to train
            on (batches without group ids).
    """

    def __init__(
        self,
        datasets: list[DatasetConfig],
        per_device_batch_size: int = 1,
        eval_batch_size: int = 8,
        preprocessing_batch_size: int = 8,
        cache_dir: str | None = None,
        enable_preprocess: bool = True,
        force_reprocess: bool = False,
        preprocess_parallelism: Literal["local", "global"] = "local",
        sampler_type: str = "auto",
        num_workers: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        row_group_window: int | None = None,
        hand_off: bool = True,
        buckets: list[dict[str, Any]] | None = None,
        max_tokens: int | None = None,
        bad_samples: Literal["error", "skip"] = "error",
        adapter: str | None = None,
        pretrained_model_name_or_path: str | None = None,
        adapter_kwargs: dict[str, Any] | None = None,
        trainer_type: TrainerType = "sft",
        grouping: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        if not datasets:
            raise ValueError("data.datasets must list at least one dataset")
        for name, value in (("per_device_batch_size", per_device_batch_size), ("eval_batch_size", eval_batch_size),
                            ("preprocessing_batch_size", preprocessing_batch_size)):
            if value < 1:
                raise ValueError(f"data.{name} must be >= 1, got {value}")
        if num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {num_workers}")
        if preprocess_parallelism not in ("local", "global"):
            raise ValueError(f"data.preprocess_parallelism must be 'local' or 'global', got {preprocess_parallelism!r}")
        if row_group_window is not None and (isinstance(row_group_window, bool) or row_group_window < 1):
            raise ValueError(f"data.row_group_window must be an integer >= 1 or null, got {row_group_window!r}")
        if not isinstance(hand_off, bool):
            raise ValueError(f"data.hand_off must be true or false, got {hand_off!r}")
        if sampler_type != "auto":
            raise ValueError(f"data.sampler_type: only 'auto' is supported so far, got {sampler_type!r}")
        if bad_samples not in ("error", "skip"):
            raise ConfigError("data.bad_samples", f"must be 'error' or 'skip', got {bad_samples!r}")
        self.bad_samples = bad_samples
        if trainer_type in ONLINE_TRAINERS and num_workers > 1:  # worker streams interleave whole batches: a step
            # would split. A ConfigError: `ff fit` prints it as one line, before any weight loads (not a traceback).
            raise ConfigError("data.num_workers", f"{num_workers} with {trainer_type}: an online step holds whole "
                              "prompt groups, "
                              "served by one stream per rank, and workers would split them; use 0 or 1 (prompts need "
                              "no decoding)")  # fmt: skip
        self.datasets = [d if isinstance(d, DatasetConfig) else DatasetConfig(**d) for d in datasets]
        check_dataset_configs(self.datasets, trainer_type)
        self.per_device_batch_size = per_device_batch_size
        self.eval_batch_size = eval_batch_size
        self.preprocessing_batch_size = preprocessing_batch_size
        self.cache_dir = cache_dir
        self.enable_preprocess = enable_preprocess
        self.force_reprocess = force_reprocess
        self.preprocess_parallelism = preprocess_parallelism
        self.num_workers = num_workers
        self.seed = seed
        self.shuffle = shuffle
        self.row_group_window = row_group_window
        self.hand_off = hand_off
        self.buckets = [Bucket.from_config(b, f"data.buckets[{i}]") for i, b in enumerate(buckets or [])] or None
        if max_tokens is not None and (isinstance(max_tokens, bool) or max_tokens < 1):
            raise ValueError(f"data.max_tokens must be an integer >= 1 or null, got {max_tokens!r}")
        if max_tokens is not None and self.buckets is None:
            raise ValueError("data.max_tokens sizes bucketed batches: set data.buckets too")
        if self.buckets is not None and trainer_type in ONLINE_TRAINERS:
            raise ValueError(f"data.buckets: {trainer_type} rows are prompts (no target to bucket); leave it unset")
        self.max_tokens = max_tokens
        self.bucket_assignment: list[int] | None = None
        """Each training record's bucket (``data.buckets``), assigned in :meth:`setup` from the targets' headers."""
        self.adapter_name = adapter
        self.pretrained_model_name_or_path = pretrained_model_name_or_path
        self.adapter_kwargs = dict(adapter_kwargs or {})
        self.trainer_type = trainer_type
        self.grouping = tuple(grouping) if grouping is not None else None
        self.train_records: list[Record] = []
        self.eval_records: list[Record] = []
        self.train_rows: TensorRows | None = None
        """Training rows of tensor-parquet shards (``tensor_parquet_dir`` entries), once :meth:`setup` opened them."""
        self.shard_sources: list[ShardSource] = []
        self.tensor_columns: TensorColumns | None = None
        self._train_loader: DataflowLoader | None = None
        self._train_loader_key: tuple[int, int] | None = None
        self._saved_loader_state: dict[str, Any] | None = None  # from a checkpoint (load_state_dict)
        self._sources: dict[str, list[ConditionSource]] = {"train": [], "test": []}
        self._digests = MediaDigests()  # every media file is streamed once per run (cache keys, resume identity)
        self._conditions: dict[str, Sequence[dict[str, torch.Tensor]]] = {}
        self._conditions_adapter: int | None = None  # id() of the adapter they were prepared with
        self.cache_results: list[CacheResult] = []
        """What the last :meth:`prepare_conditions` opened or built, one entry per dataset split."""

    @property
    def cache_root(self) -> str:
        """The condition cache folder: ``data.cache_dir``, else ``$FF_CACHE_DIR``, else ``~/.cache/ff/datasets``."""
        return cache_root(self.cache_dir)

    # -- before weights: read and validate -------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if self.trainer_type in ONLINE_TRAINERS and self.grouping is not None and self.trainer is not None:
            # Before any weights load: P * K samples per step must divide over the data-parallel ranks.
            check_grouping(*self.grouping, DataParallelCoords.from_trainer(self.trainer).world_size)
        if self.train_records or self.eval_records or self.train_rows is not None:
            return
        errors = []
        for cfg in self.datasets:
            missing = folder_error(cfg)
            if missing is not None:  # once per dataset, not once per split
                errors.append(missing)
                continue
            if cfg.is_tensor_parquet:  # training rows already preprocessed: opened below, against the adapter
                continue
            for split, enabled in (("train", cfg.train is not None), ("test", cfg.eval is not None)):
                if not enabled:
                    continue
                try:
                    records = load_split(cfg, split, self.trainer_type)
                except DatasetErrors as exc:
                    errors.extend(exc.errors)
                    continue
                (self.train_records if split == "train" else self.eval_records).extend(records)
                if records:
                    self._sources[split].append(ConditionSource(cfg.name, split, cfg.root, split_file(cfg, split),
                                                                records))  # fmt: skip
        if not errors:
            try:
                self._open_shards()
            except DatasetErrors as exc:
                errors.extend(exc.errors)
        if errors:
            raise DatasetErrors(errors)
        if self.adapter_name is not None:
            cls = get_adapter_class(self.adapter_name)
            contract = self._contract(cls)
            # preprocessing_batch_size is not checked: it is capped at the adapter's capability instead.
            check_batch_size(contract, cls.name, self.per_device_batch_size,
                             eval_batch_size=self.eval_batch_size)  # fmt: skip
            check_records(self.train_records + self.eval_records, contract)
            for warning in (w for r in self.train_records + self.eval_records
                            for w in record_warnings(r, contract, cls.name)):
                log.warning("%s", warning.format())
            self.train_records = [conform(r, contract) for r in self.train_records]
            self.eval_records = [conform(r, contract) for r in self.eval_records]
            for split, records in (("train", self.train_records), ("test", self.eval_records)):
                start = 0  # the sources hold what the adapter sees too
                for source in self._sources[split]:
                    source.records = records[start : start + len(source.records)]
                    start += len(source.records)
        check_files_exist(self.train_records + self.eval_records)
        if self.adapter_name is not None:
            if self.trainer is not None:  # a run (not a data check such as `ff data validate --model`)
                self._check_stages(get_adapter_class(self.adapter_name))
            if self.buckets is not None:  # before any header is read
                self._check_buckets(get_adapter_class(self.adapter_name))
            self._check_target_spans(get_adapter_class(self.adapter_name))
        if self.buckets is not None:
            if self.train_rows is not None:
                raise ConfigError("data.buckets", "tensor-parquet rows hold latents of their own size: batch them with "
                                  "a packing batcher (docs/dataflow.md), not geometry buckets")
            self.bucket_assignment = assign_buckets(self.train_records, [b.geometry for b in self.buckets],
                                                    cache_dir=self.cache_root)  # fmt: skip
            if self.adapter_name is not None:
                self._check_bucket_spans(get_adapter_class(self.adapter_name))
        train_rows = len(self.train_rows) if self.train_rows is not None else len(self.train_records)
        if stage == "fit" and not train_rows:
            raise ValueError("data.datasets: no dataset has a train split enabled")
        log.info("data: %d training rows, %d evaluation rows", train_rows, len(self.eval_records))

    def _check_stages(self, cls: type[Adapter]) -> None:
        """The stage methods this run calls that the adapter leaves to the base (which raises), refused before weights
        load in one line naming each and what calls it (overrides that cannot take what ff-core passes are refused at
        registration: :func:`ff_core.plugins.stage_problem`)."""
        records = bool(self.train_records or self.eval_records)
        sampling = "sampling" if self.eval_records or self.trainer_type in ONLINE_TRAINERS else None
        uses = {
            "from_pretrained": "loading the checkpoint",
            "denoiser": "every run",
            "velocity": "every step",
            "prepare_condition": "every step",
            "preprocess": "conditions of dataset records" if records else None,
            "encode_output": ("training on media targets" if self.train_records and self.trainer_type
                              not in ONLINE_TRAINERS else None),  # fmt: skip
            "initial_noise": sampling,
            "decode": sampling,
            "preprocess_identity": ("the condition cache (data.enable_preprocess: false keeps conditions in memory "
                                    "instead)" if records and self.enable_preprocess else None),  # fmt: skip
        }
        missing = [f"{name}() ({uses[name]})" for name in unimplemented(cls, [k for k, v in uses.items() if v])]
        if missing:
            raise ConfigError("model.adapter", f"{cls.name!r} ({cls.__name__}) does not implement "
                              f"{', '.join(missing)}, which this run calls (docs/plugins.md, 'Writing a plugin')")

    def _check_target_spans(self, cls: type[Adapter]) -> None:
        """Targets too short for the adapter's clip (:meth:`~ff_core.adapter.Adapter.resolve_output_geometry`), from
        their headers: every one reported, naming file, line and field, before weights load (the adapter_kwargs
        checked first: the geometry is computed from them). The headers are cached in the cache root's ``headers/``
        (:mod:`~ff_core.data.media.header_cache`): a restart reads only the files that changed."""
        check_adapter_kwargs(cls, self.pretrained_model_name_or_path, self.adapter_kwargs)
        geometry = resolve_output_geometry(cls, self.pretrained_model_name_or_path, self.adapter_kwargs)
        if geometry and self.buckets is None:  # with buckets: per bucket, once records are assigned
            raise_collected(target_span_errors(self.train_records, geometry, cache_dir=self.cache_root))

    def _check_bucket_spans(self, cls: type[Adapter]) -> None:
        """Each bucket's records against what its geometry needs (:meth:`~ff_core.adapter.Adapter.
        resolve_bucket_geometry`: LTX-2's audio of the bucket's own clip), the outputs after the first (the first's fit
        is what assigned the bucket); every shortfall reported, as :meth:`_check_target_spans`."""
        if not hasattr(cls, "resolve_bucket_geometry"):  # a bare loader class
            return
        errors = []
        for i, bucket in enumerate(self.buckets):
            geometry = cls.resolve_bucket_geometry(self.pretrained_model_name_or_path, self.adapter_kwargs,
                                                   bucket.geometry)  # fmt: skip
            records = [r for r, b in zip(self.train_records, self.bucket_assignment) if b == i]
            if geometry and records:
                errors += target_span_errors(records, geometry, skip_first=True, cache_dir=self.cache_root)
        raise_collected(errors)

    def _check_buckets(self, cls: type[Adapter]) -> None:
        """Each bucket against the adapter (:meth:`~ff_core.adapter.Adapter.check_bucket`: config files only), before
        any target header is read or weight loads; one ConfigError naming the first bucket it refuses. A bucket that
        names no ``frame_rule`` takes the adapter's (its first output's geometry's)."""
        check_adapter_kwargs(cls, self.pretrained_model_name_or_path, self.adapter_kwargs)
        geometry = resolve_output_geometry(cls, self.pretrained_model_name_or_path, self.adapter_kwargs)
        if geometry and isinstance(geometry[0], MediaGeometry):
            self.buckets = [b.adopt_frame_rule(geometry[0].frame_rule) for b in self.buckets]
        for i, bucket in enumerate(self.buckets):
            try:
                cls.check_bucket(self.pretrained_model_name_or_path, self.adapter_kwargs, bucket.geometry)
            except ConfigError:  # a model.adapter_kwargs value, named by its own key
                raise
            except ValueError as exc:
                raise ConfigError(f"data.buckets[{i}]", str(exc)) from None

    def _contract(self, cls: type[Adapter]) -> PipelineIOContract:
        """The checkpoint's contract from its config files (no weights), or the class's without a checkpoint."""
        return resolve_contract(cls, self.pretrained_model_name_or_path, self.adapter_kwargs)

    @property
    def _supervision(self) -> str:
        """What training rows supervise: ``preference`` pairs for offline DPO, else ``demonstration`` targets."""
        return "preference" if self.trainer_type == "offline-dpo" else "demonstration"

    def _open_shards(self) -> None:
        """Open the tensor-parquet training entries, checked against the adapter's ``tensor_columns`` from the files'
        footers (before weights load); :attr:`train_rows` serves their rows."""
        configs = [cfg for cfg in self.datasets if cfg.is_tensor_parquet and cfg.train is not None]
        if not configs:
            return
        key = f"data.datasets[{self.datasets.index(configs[0])}].tensor_parquet_dir"
        if self.adapter_name is None:
            raise ConfigError(key, "the adapter's columns are unknown (set model.adapter, which links data.adapter)")
        cls = get_adapter_class(self.adapter_name)
        columns = resolve_tensor_columns(cls, self.pretrained_model_name_or_path, self.adapter_kwargs)
        if columns is None:
            raise ConfigError(key, f"adapter {cls.name!r} declares no tensor_columns, so it cannot train from "
                                   "tensor-parquet shards")
        window = self.row_group_window
        self.shard_sources = open_shards(configs, columns, cls.name, cached_groups=max(4, window or 0),
                                         supervision=self._supervision, hand_off=self.hand_off)
        # What each entry's shards were written for (adapter, contract, checkpoint, geometry) against this recipe.
        expected = self._expected_provenance(cls)
        for cfg, source in zip(configs, self.shard_sources):
            check_provenance(f"data.datasets[{self.datasets.index(cfg)}].tensor_parquet_dir", source.dataset.files[0],
                             expected)  # fmt: skip
        # Every served row's _dtype/_shape (and located byte count) against itself and the adapter's geometry, now:
        # not at the step that draws it (ff_core.data.tensor_parquet.checks).
        shapes = resolve_tensor_shapes(cls, self.pretrained_model_name_or_path, self.adapter_kwargs)
        stored = {p + c: c for p in LATENT_BATCH_KEYS[self._supervision].values() for c in columns.latents}
        check_shard_rows([(s.dataset, s.rows) for s in self.shard_sources], shapes, stored)
        self.train_rows = TensorRows([s.dataset for s in self.shard_sources], [s.rows for s in self.shard_sources])
        self.tensor_columns = columns
        largest = self.train_rows.max_group_rows()
        if window is None and largest > 1 and self.shuffle:
            log.warning("data.datasets: tensor-parquet row groups hold up to %d rows and Parquet decodes whole groups: "
                        "a uniformly shuffled row order decodes a group per row. Set data.row_group_window (e.g. 4) "
                        "to shuffle groups, then rows within windows of groups", largest)

    def _expected_provenance(self, cls: type[Adapter]) -> dict[str, Any]:
        """:func:`~ff_core.data.tensor_parquet.provenance.shard_provenance` of this run: from the linked
        ``model.pretrained_model_name_or_path`` and ``adapter_kwargs`` (``ff fit``), else the attached module's (a
        data module built in Python, not linked); with neither known only the adapter is compared."""
        pretrained, kwargs = self.pretrained_model_name_or_path, self.adapter_kwargs
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        if pretrained is None and getattr(module, "pretrained_model_name_or_path", None) is not None:
            pretrained, kwargs = module.pretrained_model_name_or_path, module.adapter_kwargs
        if pretrained is None:
            return {"adapter": cls.name}
        return shard_provenance(cls, pretrained, kwargs, self._supervision)

    # -- after weights: conditions and loaders -----------------------------------------------------------
    def _adapter(self) -> Adapter:
        module = self.trainer.lightning_module if self.trainer is not None else None
        adapter = getattr(module, "adapter", None)
        if adapter is None:
            raise RuntimeError("FlowDataModule needs a FlowModule whose adapter is loaded (configure_model)")
        return adapter

    def _preprocess_batch_size(self, adapter: Adapter) -> int:
        limit = adapter.io_contract.max_batch_size
        return self.preprocessing_batch_size if limit is None else min(self.preprocessing_batch_size, limit)

    def _preprocessor(self, adapter: Adapter, device: torch.device | str | None) -> Callable:
        """``adapter.preprocess`` over records, with the frozen components moved to ``device`` before the first call."""
        run, placed = adapter_preprocess(adapter), []

        def preprocess(records: list[Record]) -> list[dict[str, Any]]:
            if adapter.preprocessing_released:
                raise RuntimeError(
                    f"conditions are not cached and {adapter.name}'s preprocessing components "
                    f"({', '.join(adapter.preprocessing_components)}) were released after an earlier cache build; "
                    "build the caches before releasing them (FlowDataModule.prepare_conditions)"
                )
            if device is not None and not placed:
                adapter.frozen_to(device)
                placed.append(device)
            return run(records)

        return preprocess

    def prepare_conditions(
        self, adapter: Adapter, device: torch.device | str | None = None, progress: bool | None = None
    ) -> bool:
        """Open every split's condition caches, building the missing ones (a collective call on every rank).

        Returns ``True`` when every condition is cached, so the adapter's preprocessing components may be released;
        ``False`` with ``enable_preprocess: false`` (conditions are preprocessed into memory by the loaders).

        Args:
            adapter: the loaded adapter.
            device: where preprocessing runs: the adapter's frozen components move there before the first
                ``preprocess`` call (``None``: leave them where they are).
            progress: show a progress bar while building (``None``: only on a terminal).
        """
        if not self.enable_preprocess:
            return False
        if self._conditions and self._conditions_adapter == id(adapter):
            return True
        group = BuildGroup.from_trainer(self.trainer) if self.trainer is not None else BuildGroup()
        preprocess = self._preprocessor(adapter, device)
        results: list[CacheResult] = []
        batch_size = self._preprocess_batch_size(adapter)
        for split, sources in self._sources.items():
            opened = [
                open_or_build(source, adapter, cache_dir=self.cache_root, batch_size=batch_size,
                              force=self.force_reprocess, group=group, parallelism=self.preprocess_parallelism,
                              progress=progress, preprocess=preprocess, digests=self._digests)
                for source in sources
            ]  # fmt: skip
            self._conditions[split] = ConcatConditions([r.conditions for r in opened])
            results += opened
        self.cache_results, self._conditions_adapter = results, id(adapter)
        return True

    def _conditioned(self, split: str, records: list[Record]) -> ConditionedRecords:
        if self.enable_preprocess:
            if split not in self._conditions:  # FlowModule.configure_model did not prepare them (another module)
                self.prepare_conditions(self._adapter())
            return ConditionedRecords(records, self._conditions[split])
        adapter = self._adapter()
        preprocess, size = self._preprocessor(adapter, None), self._preprocess_batch_size(adapter)
        conditions: list[dict[str, torch.Tensor]] = []
        for start in range(0, len(records), size):
            conditions.extend(preprocess(records[start : start + size]))
        return ConditionedRecords(records, conditions)

    def train_dataloader(self) -> DataflowLoader:
        # One loader per (trainer, adapter): Lightning restores its state into this very object, and a reload
        # (``reload_dataloaders_every_n_epochs``) must continue from its position rather than restart the order.
        key = (id(self.trainer), id(self._adapter()))
        if self._train_loader is None or self._train_loader_key != key:
            coords = DataParallelCoords.from_trainer(self.trainer)
            source, batch_size = self._train_distributor(coords)
            if self.train_rows is not None:  # shards: the rows hold conditions and clean latents
                processor = TensorRowProcessor(self.train_rows, self.tensor_columns, supervision=self._supervision)
                collator = TensorRowCollator(condition_collation=self._adapter().condition_collation)
            else:
                adapter = self._adapter()
                processor = RecordProcessor(adapter.output_geometry())
                collator = SampleCollator(adapter.condition_collation)
            batching: dict[str, Any] = {"batch_size": batch_size}
            if self.buckets is not None:  # mixed geometry: one bucket per batch, stream order (resume mode "stream")
                sizes = self.bucket_batch_sizes(adapter)
                processor = RecordProcessor(adapter.output_geometry(), [b.geometry for b in self.buckets],
                                            self.bucket_assignment)  # fmt: skip
                source = MapDistributor(self._conditioned("train", self.train_records), shuffle=self.shuffle,
                                        seed=self.seed, name="train", identity=self.train_identity())  # fmt: skip
                batching = {"batcher": BucketBatcher(sizes),
                            "steps_per_epoch": self.bucketed_steps(sizes, coords.world_size)}
            self._train_loader = EpochAlignedLoader(
                source,
                processor,
                collator=collator,
                num_workers=self.num_workers,
                coords=coords,
                stamp_key=STAMP_KEY,
                bad_samples=self.bad_samples,
                on_bad_samples=self._bad_sample_log(),
                **batching,
            )
            self._train_loader_key = key
            if self._saved_loader_state is not None:
                self._train_loader.load_state_dict(self._saved_loader_state)
                self._saved_loader_state = None
            self._check_accumulation(len(self._train_loader))
        return self._train_loader

    # A run resumed on another number of ranks (resume mode "epoch") has another epoch length: the rest of the
    # interrupted epoch is dealt over the new ranks. Lightning sizes the epoch (``len(loader)``) before it restores the
    # loader's state from the loop's, so the data module also keeps that state and restores it as it builds the loader;
    # Lightning's own restore then loads the same state again.
    def state_dict(self) -> dict[str, Any]:
        loader = self._train_loader
        if loader is not None and loader.mode == "epoch":
            return {"train_loader": loader.state_dict()}
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved_loader_state = state_dict.get("train_loader")

    def _bad_sample_log(self) -> BadSampleLog | None:
        """``data.bad_samples: skip``: the list in the run folder (``trainer.log_dir``, else the working directory)."""
        if self.bad_samples != "skip":
            return None
        trainer = self.trainer
        folder = (trainer.log_dir or trainer.default_root_dir) if trainer is not None else os.getcwd()
        return BadSampleLog(folder, trainer.global_rank if trainer is not None else 0)

    def bucket_batch_sizes(self, adapter: Adapter) -> list[int]:
        """Samples per batch of each bucket: its ``batch_size``, else ``max_tokens // adapter.denoiser_tokens``, else
        ``per_device_batch_size``."""
        sizes = []
        for i, bucket in enumerate(self.buckets or []):
            if bucket.batch_size is not None:
                sizes.append(bucket.batch_size)
            elif self.max_tokens is not None:
                tokens = adapter.denoiser_tokens(bucket.geometry)
                if not tokens:
                    raise ConfigError("data.max_tokens", f"adapter {adapter.name!r} does not count its tokens "
                                      f"(denoiser_tokens); give data.buckets[{i}].batch_size instead")
                if tokens > self.max_tokens:
                    raise ConfigError(f"data.buckets[{i}]", f"one sample costs {tokens} tokens, more than "
                                      f"data.max_tokens={self.max_tokens}")
                sizes.append(self.max_tokens // tokens)
            else:
                sizes.append(self.per_device_batch_size)
        return sizes

    def bucketed_steps(self, sizes: Sequence[int], world_size: int) -> int:
        """Batches per rank in a bucketed epoch: ``ceil(sum_b n_b / size_b / world_size)`` (every rank the same
        count, as DDP needs). Epoch boundaries are soft: the stream runs on across them, each bucket's queue kept."""
        counts = [0] * len(sizes)
        for bucket in self.bucket_assignment or []:
            counts[bucket] += 1
        return max(1, math.ceil(sum(n / s for n, s in zip(counts, sizes)) / world_size))

    def _train_distributor(self, coords: DataParallelCoords) -> tuple[Any, int]:
        """The training distributor and the per-rank batch size: shard rows (optionally in two-level order), the
        offline trainers' epoch sampler, GRPO's prompt groups (one step's ``P * K / W`` (prompt, sample) pairs per
        rank), or a plain shuffled map."""
        common = dict(shuffle=self.shuffle, seed=self.seed, name="train", identity=self.train_identity())
        if self.train_rows is not None:  # shards (offline trainers only): row numbers, optionally in two-level order
            offline = self.trainer_type in OFFLINE_TRAINERS
            if self.row_group_window is not None:  # ff_core.data.tensor_parquet.order
                grouped = GroupedSamplerDistributor if offline else GroupedMapDistributor
                return grouped(self.train_rows, self.row_group_window, **common), self.per_device_batch_size
            distributor = SamplerDistributor if offline else MapDistributor
            return distributor(self.train_rows, **common), self.per_device_batch_size
        table = self._conditioned("train", self.train_records)
        if self.trainer_type in OFFLINE_TRAINERS:
            return SamplerDistributor(table, **common), self.per_device_batch_size
        if self.trainer_type in ONLINE_TRAINERS and self.grouping is not None:
            prompts, group_size = self.grouping
            batch_size = check_grouping(prompts, group_size, coords.world_size)
            return GroupedDistributor(table, group_size, prompts, **common), batch_size
        return MapDistributor(table, **common), self.per_device_batch_size

    def train_identity(self) -> dict[str, dict[str, Any]]:
        """Per dataset, the training rows and the SHA-256 of their content (prompts, metadata, every input and
        supervision media file's bytes): the loader's resume fingerprint, so a resume onto changed data fails naming
        the dataset (spec: "Replacing target, chosen, or rejected media in place changes the full record identity
        used by exact-resume checks").
        """
        if self.train_rows is not None:  # shards: their files' paths, sizes and row-group sizes (not their data pages)
            return {source.name: source.identity for source in self.shard_sources}
        return {source.name: {"rows": len(source.records), "sha256": records_identity(source.records, self._digests)}
                for source in self._sources["train"]}

    def sample_names(self, indices: Sequence[int]) -> list[str]:
        """Training samples by where they are stored, for messages (a non-finite step, :mod:`ff_core.nonfinite`):
        a record's ``file:line``, a shard row's ``file: row r (row group g, dataset row i)``.

        Args:
            indices: the batch's ``index`` values (record indices, or rows of :attr:`train_rows`).
        """
        if self.train_rows is not None:
            return [shard_row_name(self.train_rows, int(i)) for i in indices]
        return [f"{self.train_records[i].source}:{self.train_records[i].line}" for i in map(int, indices)]

    def _check_accumulation(self, batches_per_epoch: int) -> None:
        """Spec ("Offline dataloader and epoch semantics"): the rank-local batches of an offline epoch must divide
        evenly by the accumulation steps; ff never pads an epoch or silently flushes a partial window."""
        accumulate = self.trainer.accumulate_grad_batches
        if self.trainer_type in OFFLINE_TRAINERS and batches_per_epoch % accumulate:
            raise ValueError(
                f"trainer.accumulate_grad_batches={accumulate} does not divide the {batches_per_epoch} batches of an "
                f"epoch on each rank: an offline epoch never ends inside an accumulation window. Use a divisor of "
                f"{batches_per_epoch}, or change data.per_device_batch_size or the dataset size"
            )

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # The training loop calls this for the batch it is about to run (after any fetch-ahead): from here on the
        # batch counts as consumed, so a checkpoint written after this step resumes right after it.
        if isinstance(batch, dict) and STAMP_KEY in batch:
            seq = batch.pop(STAMP_KEY)
            if self._train_loader is not None:
                self._train_loader.commit(int(seq))
        return batch

    def test_dataloader(self) -> DataLoader | list:
        """``ff test``: generation for the evaluation prompts, like validation."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader | list:
        """``ff predict``: generation for the evaluation prompts (write them with ``ff_core.callbacks.MediaWriter``)."""
        return self.val_dataloader()

    def val_dataloader(self) -> DataLoader | list:
        if not self.eval_records:
            return []
        return DataLoader(
            self._conditioned("test", self.eval_records),
            batch_size=self.eval_batch_size,
            shuffle=False,
            num_workers=0,
            collate_fn=functools.partial(process_and_collate,
                                         condition_collation=self._adapter().condition_collation),
        )
