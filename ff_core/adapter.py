"""Adapter: the one base class a model family implements.

Class attributes (``name``, ``io_contract``, ``preprocess_version``, ``default_lora_targets``) are readable
without weights, so datasets are validated before anything heavy loads. Instances are built by
:meth:`Adapter.from_pretrained` from a local folder or hub id and expose the stage methods every objective
uses, in the order data flows through them:

``preprocess`` (conditions -> CPU tensors, cacheable) -> ``prepare_condition`` (once per batch, on device)
-> ``encode_output`` (decoded target media -> clean latent state) -> ``velocity`` (one denoiser forward)
-> ``decode`` (latent state -> media) -> ``sample`` (generation for evaluation and RL rollouts).

Objectives (SFT, DPO, GRPO) only see this interface, so they never branch on a model family.
"""

from __future__ import annotations

import inspect
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from ff_core.atomic import replace_dir
from ff_core.contracts import ClipDefaults, Condition, ConditionInput, LatentState, PipelineIOContract, TensorColumns
from ff_core.sampling import sample_ode, shift_sigma

if TYPE_CHECKING:  # the geometry module pulls in the media decoders, peft is heavy: the adapter only names types
    from peft import LoraConfig

    from ff_core.contracts import AudioSpan, MediaGeometry

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
"""The LoRA file :meth:`Adapter.save_lora` writes (diffusers' ``LORA_WEIGHT_NAME_SAFE``)."""


TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}  # fmt: skip
"""The names a config may give a floating dtype by (``model.adapter_kwargs.dtype``, ``model.sharding.param_dtype``)."""


def resolve_dtype(value: str | torch.dtype, key: str = "model.adapter_kwargs.dtype") -> torch.dtype:
    """``value`` as a torch dtype: a dtype as it is, a name from :data:`TORCH_DTYPES`; any other name is a
    :class:`~ff_core.errors.ConfigError` naming ``key`` and the names it takes (an adapter's ``from_pretrained``
    ``dtype`` argument)."""
    from ff_core.errors import ConfigError

    if isinstance(value, torch.dtype):
        return value
    if value not in TORCH_DTYPES:
        raise ConfigError(key, f"unknown dtype {value!r}; expected one of {sorted(TORCH_DTYPES)}")
    return TORCH_DTYPES[value]


def scheduler_sigma_table(scheduler: Any) -> Tensor:
    """The noise levels a diffusers scheduler holds when built (``sigmas``, float32): the table diffusers' training
    scripts index (``noise_scheduler_copy.sigmas[indices]``). Read from a fresh copy built from its config, since
    sampling's ``set_timesteps`` replaces the live scheduler's ``sigmas`` with the inference grid. With
    ``use_dynamic_shifting`` they are unshifted (``i / 1000``); else shifted by the config's ``shift``.

    Args:
        scheduler: a diffusers scheduler with a ``sigmas`` table (``FlowMatchEulerDiscreteScheduler``).
    """
    return type(scheduler).from_config(scheduler.config).sigmas.float().clone()


def reject_input_media(inputs: list[ConditionInput], name: str) -> None:
    """Raise a ``ValueError`` naming the first of ``inputs`` that carries input media, for an adapter (``name``)
    conditioned on the prompt alone."""
    for i, item in enumerate(inputs):
        if item.media:
            raise ValueError(f"inputs[{i}]: {name} takes no input media, got {len(item.media)} item(s)")


def prompt_rows(positive: dict[str, Tensor], negative: dict[str, Tensor]) -> list[dict[str, Tensor]]:
    """Per-sample cache rows of batched prompt encodings: ``positive``'s keys as they are, ``negative``'s prefixed
    ``negative_`` (the keys :meth:`Adapter.unconditional` swaps in). Each tensor is a CPU clone, so every sample owns
    compact storage (no view into the batch tensor reaches the cache)."""
    n = len(next(iter(positive.values())))
    return [{**{k: v[i].cpu().clone() for k, v in positive.items()},
             **{f"negative_{k}": v[i].cpu().clone() for k, v in negative.items()}} for i in range(n)]  # fmt: skip


def move_condition(batch: dict[str, Tensor], device: torch.device, dtype: torch.dtype) -> Condition:
    """``batch`` on ``device``, floating tensors cast to ``dtype`` (the denoiser's), others (ids, masks) keeping
    theirs: the usual :meth:`Adapter.prepare_condition`."""
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else None) for k, v in batch.items()}


class Adapter(nn.Module):
    """Base class of a model family's adapter. Subclass it in a plugin and register it (see hookspecs).

    Class attributes:
        name: registry name used in configs (``model.adapter: sd3-5``).
        io_contract: what the pipeline accepts and emits (see :mod:`ff_core.contracts`). A family whose checkpoints
            differ (Wan I2V variants) sets its default here and resolves each checkpoint's in
            :meth:`resolve_contract`; a loaded adapter's ``io_contract`` is its checkpoint's.
        preprocess_version: bump when ``preprocess`` output changes, to invalidate condition caches.
        default_lora_targets: module names LoRA wraps when the config names none.
        lora_prefix: key prefix of the denoiser in the family's diffusers LoRA files: the ``transformer_name`` of its
            pipeline's LoRA loader mixin (``transformer`` for SD3, FLUX.1 and Wan), so that ``pipe.load_lora_weights``
            finds the keys ff exports; also the key of the denoiser in :meth:`denoisers`.
        preprocessing_components: attribute names of the modules only ``preprocess`` uses (text encoders, a
            condition-only image encoder). Once every condition is in the Arrow cache, ``FlowModule`` releases them
            (:meth:`release_preprocessing`) before the strategy places the model, so they never occupy the
            accelerator for training. A module the other stages use (the VAE that encodes targets) is not one.
        tensor_columns: how preprocessed training rows are stored in tensor-parquet shards (condition columns, clean
            latent columns; :class:`~ff_core.data.tensor_parquet.rows.TensorColumns`); ``None``: the family does not
            train from shards. Read without weights, so a dataset is checked before the model loads.
        interface_version: the ff adapter-interface version (``major.minor``, :data:`ff_core.ADAPTER_INTERFACE_VERSION`)
            the adapter is written for, a string (``"1.1"``); ff refuses it when ff-core's differs in major or is an
            older minor. Read from the class or a base class of the same top-level package (a base from another
            plugin declares that plugin's version); ``None``: the plugin's ``ff_adapter_interface_version`` hook
            declares it, else it is undeclared and checked as ``"1.0"`` (:data:`ff_core.plugins.UNDECLARED_INTERFACE`).
        condition_collation: how each condition key collates when its per-sample tensors may differ in shape
            (:mod:`ff_core.data.cache.collation`): ``stack`` (default), ``pad`` (zero-pad axis 0 to the batch's
            longest, plus a ``<key>_mask`` (B, L) of real entries) or ``list``. Applies to preprocessed conditions and
            to tensor-parquet condition columns alike.
        full_precision_inputs: keyword inputs of the trained networks that FSDP2's ``model.sharding.param_dtype``
            must not cast (:func:`ff_core.sharding.fully_shard_networks` casts the others): diffusers embeds the
            timestep (and FLUX.1's embedded guidance, scaled alike) sinusoidally in fp32, and ``sigma * 1000`` in
            bf16 would round to steps of up to 4.
        default_component_weights: how the flow-matching error (SFT, DPO) and GRPO's step log-probabilities reduce
            over the latent components when the objective's ``component_weights`` is unset
            (:func:`~ff_core.sampling.component_mean`: ``sum_k w_k m_k``, each component's mean times its weight,
            unnormalised): ``None`` (default) pools every element of every component; a family whose reference
            trainer sums one mean per stream declares it here (MiniMax H3: ``{video: 1, audio: 1}``; LTX-2:
            ``{video: 0.5, audio: 0.5}``), so the audio is not drowned by the video's element count. Finite, >= 0,
            at least one > 0 among the components that are not frozen (checked before any weight loads).
        latent_components: the names of the :class:`LatentState` components the adapter's stages produce, in order
            (``("video", "audio")``), read without weights: ``model.frozen_components`` and the objective's
            ``component_weights`` keys are checked against them before any weight loads. ``None`` (default):
            undeclared; they are checked once the model runs, as before.
        checkpoint_classes: what the adapter loads, as ``model_index.json`` names it: ``_class_name`` -> the accepted
            pipeline classes, a component (``transformer``) -> its accepted classes. Checked before any weight loads
            (:func:`ff_core.pretrained.check_checkpoint_classes`): a checkpoint of another family is one line naming
            ``model.pretrained_model_name_or_path``. A component the file does not name (or names ``null``) is not
            checked. ``{}`` (default): no check.
        training_kwargs: ``from_pretrained`` arguments that change training only, never a stored tensor (LTX-2's
            ``first_frame_conditioning_p``): tensor-parquet shards written with another value are used without a
            warning (:mod:`ff_core.data.tensor_parquet.provenance` compares every other ``adapter_kwargs`` entry).
        io_contract_variants: the contracts :meth:`resolve_contract` returns for the family's checkpoint variants, by
            variant name (Wan I2V: ``i2v``, ``flf2v``, ``ti2v``, ``a14b``), readable without a checkpoint: what a tool
            that picks a workflow before any checkpoint is known reads (the offline smoke datasets' catalogue,
            :mod:`ff_core.data.smoke`, checks that ``wan2_i2v`` realises first-last-frame-to-video through ``flf2v``).
            ``{}`` (default): :attr:`io_contract` is the only one.
        clip_defaults: a video family's default clip (:class:`~ff_core.contracts.ClipDefaults`: canvas, frame count,
            rate and the ``from_pretrained`` argument naming the rate), declared once: ``from_pretrained``'s defaults
            are written from it (``height: int = CLIP.height``), and :meth:`resolve_clip` reads it under
            ``model.adapter_kwargs`` for the checks before weights load (the defaults of :meth:`check_adapter_kwargs`
            and :meth:`resolve_output_geometry`). ``None`` (default): no default clip (an image family).
    """

    name: ClassVar[str]
    io_contract: ClassVar[PipelineIOContract]
    preprocess_version: ClassVar[str] = "1"
    default_lora_targets: ClassVar[tuple[str, ...]] = ()
    lora_prefix: ClassVar[str] = "transformer"
    preprocessing_components: ClassVar[tuple[str, ...]] = ()
    tensor_columns: ClassVar[TensorColumns | None] = None
    condition_collation: ClassVar[dict[str, str]] = {}
    interface_version: ClassVar[str | None] = None
    full_precision_inputs: ClassVar[tuple[str, ...]] = ("timestep", "guidance")
    default_component_weights: ClassVar[dict[str, float] | None] = None
    latent_components: ClassVar[tuple[str, ...] | None] = None
    checkpoint_classes: ClassVar[dict[str, tuple[str, ...]]] = {}
    training_kwargs: ClassVar[tuple[str, ...]] = ()
    io_contract_variants: ClassVar[dict[str, PipelineIOContract]] = {}
    clip_defaults: ClassVar[ClipDefaults | None] = None
    preprocessing_released: bool = False
    """Whether :meth:`release_preprocessing` ran: ``preprocess`` is unavailable from then on."""
    embedded_guidance: float | None = None
    """Distilled guidance (docs/plugins.md, "Sampling seams"): the guidance scale a guidance-distilled denoiser is
    conditioned on when a run asks for none (FLUX.1-dev: 3.5, what diffusers' pipeline samples and its training
    scripts train with); ``None``: the checkpoint has no guidance embedding. Instance-level: it is a property of the
    checkpoint (FLUX.1-dev has one, FLUX.1-schnell none). Distinct from CFG (``guidance_scale``), which combines two
    velocities; embedded guidance is one more input of one forward."""

    @classmethod
    def resolve_contract(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any] | None = None
    ) -> PipelineIOContract:
        """The IO contract of one checkpoint, from its config files only (never its weights).

        Datasets are validated against it before anything heavy loads (``FlowDataModule.setup``,
        ``ff data validate --model M --pretrained P``), and the loaded adapter carries it as its ``io_contract``
        (:func:`ff_core.pretrained.load_pretrained` sets it). Override it when the accepted inputs depend on the
        checkpoint (Wan2.1 I2V takes ``first_frame``, FLF2V also requires ``last_frame``): read the JSON with
        :func:`ff_core.pretrained.read_config` and return one of the family's contracts. Must be cheap and must not
        import model code or touch weights. Default: the class attribute :attr:`io_contract`.

        Args:
            pretrained_model_name_or_path: ``model.pretrained_model_name_or_path`` (a folder or hub id); ``None`` when
                unknown (a dataset checked without a checkpoint): return the family's default contract.
            adapter_kwargs: ``model.adapter_kwargs`` (the ``from_pretrained`` arguments), which may select a variant.
        """
        return cls.io_contract

    @classmethod
    def resolve_tensor_columns(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any] | None = None
    ) -> TensorColumns | None:
        """The tensor-parquet columns one checkpoint trains from, from its config files only (a variant with an
        image encoder needs its ``clip_feature`` column, say); same rules as :meth:`resolve_contract`. Default: the
        class attribute :attr:`tensor_columns`."""
        return cls.tensor_columns

    @classmethod
    def resolve_tensor_shapes(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Stored tensor column -> the :class:`~ff_core.data.tensor_parquet.checks.StoredShape` its rows must have for
        this checkpoint (latent channels, patch multiples, embedding widths), from its config files only; same rules as
        :meth:`resolve_contract`. ``ff fit`` checks every shard row's ``_shape`` against it before weights load, so a
        latent stored with the right byte count in the wrong geometry is refused with its row named. Default: none
        (only each row's own consistency is checked)."""
        return {}

    @classmethod
    def check_adapter_kwargs(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any]
    ) -> None:
        """Refuse ``model.adapter_kwargs`` values the checkpoint cannot serve, before any weight loads (``ff fit``'s
        set-up, ``ff data validate --model``): raise :class:`~ff_core.errors.ConfigError` naming the key
        (``model.adapter_kwargs.num_frames``) and the valid values. Same rules as :meth:`resolve_contract` (config
        files only, cheap); check what needs no checkpoint first, so a bad value is reported even when the path is
        wrong too, and with ``pretrained_model_name_or_path=None`` only that. Keys ``from_pretrained`` does not take
        are refused before this is called (:func:`ff_core.pretrained.check_adapter_kwargs`). Default: with
        :attr:`clip_defaults`, the clip's values (:meth:`resolve_clip`: integers >= 1, a rate > 0); else nothing more.
        An override that keeps the clip check calls ``super().check_adapter_kwargs(...)`` or :meth:`resolve_clip`.

        Args:
            pretrained_model_name_or_path: the checkpoint folder or hub id, or ``None`` when unknown.
            adapter_kwargs: ``model.adapter_kwargs``.
        """
        if cls.clip_defaults is not None:
            cls.resolve_clip(adapter_kwargs)

    @classmethod
    def resolve_output_geometry(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any] | None = None
    ) -> tuple[MediaGeometry | AudioSpan | None, ...] | None:
        """What each output's training targets must cover, from config files and ``adapter_kwargs`` only (same rules
        as :meth:`resolve_contract`), so a too-short target is reported from its header (PyAV container metadata)
        before any weight loads, naming file, line and field: per output of the contract, the
        :class:`~ff_core.data.media.geometry.MediaGeometry` :meth:`output_geometry` will return (a video clip: its frame
        grid must lie inside the file, the rule decoding applies), an :class:`~ff_core.data.media.geometry.AudioSpan`
        (the seconds an audio target must hold on its clock), or ``None`` (not checked). Default: with
        :attr:`clip_defaults`, :meth:`resolve_clip` for the contract's first video output and ``None`` for the others
        (a family that cuts its audio to the clip returns an ``AudioSpan`` too); without, ``None``: nothing is checked
        before loading, and decoding still rejects a short clip when it reaches it."""
        if cls.clip_defaults is None:
            return None
        clip = cls.resolve_clip(adapter_kwargs)
        outputs = [o.type.value for o in cls.io_contract.outputs]
        first = outputs.index("video") if "video" in outputs else None
        return tuple(clip if i == first else None for i in range(len(outputs)))

    @classmethod
    def resolve_clip(cls, adapter_kwargs: dict[str, Any] | None = None) -> MediaGeometry:
        """The clip a video family trains and samples at, from ``model.adapter_kwargs`` alone (before weights load):
        its ``height``, ``width``, ``num_frames`` and rate (the argument :attr:`clip_defaults` names, ``fps`` by
        default) over :attr:`clip_defaults`, as a :class:`~ff_core.contracts.MediaGeometry` on the nearest-frame grid
        (a family with another frame rule or frame-count rounding adjusts it in its own
        :meth:`resolve_output_geometry`). A value left out or ``None`` is the default.

        Raises:
            ConfigError: a value that is not an integer >= 1 (canvas, frames) or a number > 0 (rate), naming
                ``model.adapter_kwargs.<key>``; the family's own rules (multiples of the VAE stride) are its own checks.
            TypeError: the adapter declares no :attr:`clip_defaults`, or ``from_pretrained``'s default for one of
                these arguments is not the declared one (a subclass that changes :attr:`clip_defaults` must give
                ``from_pretrained`` the same defaults).
        """
        from ff_core.contracts import MediaGeometry
        from ff_core.errors import ConfigError

        defaults = cls.clip_defaults
        if defaults is None:
            raise TypeError(f"{cls.__name__} declares no clip_defaults (a ClipDefaults class attribute)")
        declared = defaults.arguments()
        signature = inspect.signature(cls.from_pretrained).parameters
        for key, value in declared.items():
            default = signature[key].default if key in signature else None
            if default is not None and default is not inspect.Parameter.empty and default != value:
                raise TypeError(f"{cls.__name__}.from_pretrained's default {key}={default!r} is not its "
                                f"clip_defaults' {value!r}: write the defaults from the one declaration "
                                f"({key}: ... = CLIP.{key})")  # fmt: skip
        given = {k: v for k, v in (adapter_kwargs or {}).items() if k in declared and v is not None}
        values = {**declared, **given}
        for key, value in values.items():
            rate = key == defaults.fps_key
            kinds = (int, float) if rate else int
            if isinstance(value, bool) or not isinstance(value, kinds) or not (value > 0 if rate else value >= 1):
                what = "a number > 0" if rate else "an integer >= 1"
                raise ConfigError(f"model.adapter_kwargs.{key}", f"must be {what}, got {value!r}")
        fps = values[defaults.fps_key] if defaults.fps_key is not None else defaults.fps
        return MediaGeometry(values["height"], values["width"], num_frames=values["num_frames"], fps=float(fps))

    @classmethod
    def check_bucket(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any] | None,
        geometry: MediaGeometry,
    ) -> None:  # fmt: skip
        """Refuse a ``data.buckets`` geometry the adapter cannot train on, before any weight loads: raise
        ``ValueError(reason)``; ``FlowDataModule.setup`` reports it as a :class:`~ff_core.errors.ConfigError` naming
        ``data.buckets[i]``. A bucket replaces the first output's geometry only (:mod:`ff_core.data.media.buckets`), so
        a family whose other outputs are cut to that output's clip (LTX-2's audio: the clip's ``num_frames /
        frame_rate`` seconds) cuts them to each batch's own clip, or refuses buckets whose clip differs from its own.
        Same rules as :meth:`resolve_contract` (config files and ``adapter_kwargs`` only, cheap). Default: every bucket
        is accepted.

        Args:
            pretrained_model_name_or_path: the checkpoint folder or hub id, or ``None`` when unknown.
            adapter_kwargs: ``model.adapter_kwargs``.
            geometry: the bucket's geometry (``height``, ``width``, ``num_frames``, ``fps``, ``start``).
        """

    @classmethod
    def resolve_bucket_geometry(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any] | None,
        geometry: MediaGeometry,
    ) -> tuple[MediaGeometry | AudioSpan | None, ...] | None:  # fmt: skip
        """What each output's training targets must cover in a ``data.buckets`` entry of ``geometry`` (one
        :meth:`check_bucket` accepted), as :meth:`resolve_output_geometry` says for the adapter's own clip; the
        records assigned to that bucket are checked against it from their headers. Default: the bucket's geometry for
        the first output, :meth:`resolve_output_geometry`'s entries for the others. LTX-2 cuts its audio to the
        bucket's clip (an :class:`~ff_core.contracts.AudioSpan` of that clip's seconds from its ``start``)."""
        spans = cls.resolve_output_geometry(pretrained_model_name_or_path, adapter_kwargs)
        return None if spans is None else (geometry, *spans[1:])

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any) -> Adapter:
        """Load every component with its library's ``from_pretrained`` from a folder or hub id."""
        raise NotImplementedError(f"{cls.__name__} must implement from_pretrained")

    def train(self, mode: bool = True) -> Adapter:
        """Switch the :meth:`trained_networks` (whole, LoRA base layers included) to ``mode``; every other module
        stays in eval mode, however deeply it is nested in containers.

        A frozen text encoder in train mode would apply dropout (T5 has 0.1 by default) to the conditions it encodes,
        making preprocessing random; ``module.train()`` from a training loop must not do that. A trained network in
        eval mode would silently train without its dropout (diffusers' training scripts call ``transformer.train()``).
        """
        super().train(mode)
        if mode:
            trained = {id(m) for m in self.trained_networks()}
            self._eval_frozen(self, trained)
        for module in self.detached_modules().values():  # outside the tree, so super().train() misses them
            module.eval()
        return self

    @staticmethod
    def _eval_frozen(module: nn.Module, trained: set[int]) -> None:
        """Eval mode for the children of ``module`` outside the trained networks, looking through the ones that hold
        a trained network (``nn.ModuleDict`` of experts, say) rather than switching them whole."""
        for child in module.children():
            if id(child) in trained:
                continue
            if any(id(m) in trained for m in child.modules()):
                Adapter._eval_frozen(child, trained)
            else:
                child.eval()

    def trained_networks(self) -> list[nn.Module]:
        """The networks that train: the outermost submodules holding a trainable parameter, looking through
        ``nn.ModuleDict`` / ``nn.ModuleList`` containers (which hold networks but are none).

        Usually ``[self.denoiser]``; an adapter with several trained networks (two experts) gets each of them. Override
        it when a trained network shares a non-container parent module with frozen ones.
        """
        found: list[nn.Module] = []

        def visit(module: nn.Module) -> None:
            for child in module.children():
                if not any(p.requires_grad for p in child.parameters()):
                    continue
                if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
                    visit(child)
                elif not any(child is m for m in found):  # a network may also be listed in a container
                    found.append(child)

        visit(self)
        return found

    def sharding_blocks(self) -> dict[str, list[nn.Module]]:
        """The repeated blocks of every trained network, keyed as :meth:`denoisers`: the units FSDP2 shards one by one
        (``model.sharding``, :func:`ff_core.sharding.fully_shard_networks`), so that only one block's parameters are
        gathered at a time. The network itself is sharded last, as the root of what remains (embeddings, norms).

        Default: the outermost submodules whose class is named in the network's diffusers ``_no_split_modules``
        (``JointTransformerBlock`` for SD3, ``WanTransformerBlock`` for Wan); a network without it gets no blocks (it
        is sharded whole: correct, but all of it is gathered at once). Override it to name the blocks explicitly.
        The conformance kit requires at least one block per trained network (``AdapterConformance``'s
        ``test_sharding_blocks_are_repeated_blocks_of_each_network``): a plugin whose network really has none
        overrides that test, saying why.
        """
        out: dict[str, list[nn.Module]] = {}
        for name, network in self.denoisers().items():
            kinds = set(getattr(network, "_no_split_modules", None) or ())
            blocks: list[nn.Module] = []
            inside: set[int] = set()
            for module in network.modules():
                if module is network or id(module) in inside or type(module).__name__ not in kinds:
                    continue
                blocks.append(module)
                inside.update(id(m) for m in module.modules())
            out[name] = blocks
        return out

    @classmethod
    def context_parallel_plan(cls, network: type | nn.Module) -> dict[str, Any] | None:
        """How a trained network splits its tokens over a context-parallel group
        (:class:`~ff_core.strategies.ContextParallelStrategy`, :mod:`ff_core.context_parallel`): a diffusers
        context-parallel plan (module name -> ``ContextParallelInput`` splits / ``ContextParallelOutput`` gathers),
        or ``None``: the network cannot be split, and ``ff fit`` refuses the strategy, naming the class.

        Called with the network's class before any weight loads (``None`` or not decides the refusal) and with the
        loaded network (the plan applied, which may depend on its config). Default: the diffusers class's own
        ``_cp_plan`` (Wan, LTX-2, MiniMax H3, Flux, Qwen-Image have one; SD3 has none). Override it when the
        family's forward needs another split than diffusers' plan (a second token stream, rope of another layout),
        or to give a network without one a plan.
        """
        return getattr(network, "_cp_plan", None)

    # -- what training touches -------------------------------------------------------------------
    @property
    def denoiser(self) -> nn.Module:
        """The network objectives train (the transformer); everything else stays frozen. With several trained
        networks (:meth:`denoisers`), the first one."""
        raise NotImplementedError

    def denoisers(self) -> dict[str, nn.Module]:
        """Every network training adapts, keyed by its diffusers pipeline component name, in pipeline order.

        ``FlowModule`` unfreezes (or wraps with LoRA) each of them, checkpoints hold each one's trained tensors, the
        optimiser covers all, and the LoRA export writes one diffusers-loadable file per network (:meth:`lora_file`).
        Default: ``{lora_prefix: denoiser}``. A family with two experts switched at a boundary noise level (Wan2.2
        A14B: ``transformer`` for high noise, ``transformer_2`` for low) returns both; :meth:`velocity` picks the
        expert per noise level.
        """
        return {self.lora_prefix: self.denoiser}

    def component_parameters(self, component: str) -> dict[str, list[str]]:
        """The parameters of the trained networks that belong to one latent component's branch alone: per network
        (keyed as :meth:`denoisers`), names as its ``named_parameters()`` gives them.

        ``model.frozen_components`` (docs/config.md) keeps these frozen (LoRA wraps no module whose parameters all
        belong here; full fine-tuning leaves them ``requires_grad=False``, out of the optimiser and the checkpoint)
        and drops the component from the loss. Default: the adapter declares no branches, and freezing is refused.
        Raise ``ValueError`` for a name that is not one of the adapter's latent components.

        Args:
            component: a latent component name (a :class:`LatentState` key, e.g. ``audio``).
        """
        raise ValueError(f"adapter {self.name!r} does not declare which parameters belong to which latent component, "
                         "so none can be frozen")  # fmt: skip

    def preprocess(self, inputs: list[ConditionInput]) -> list[dict[str, Tensor]]:
        """Encode conditions (text, condition media) under no_grad; one dict of CPU tensors per sample."""
        raise NotImplementedError

    def preprocess_identity(self) -> dict[str, Any]:
        """What ``preprocess`` output depends on besides its inputs and :attr:`preprocess_version`: the model identity
        (local folder resolved, or hub id and revision), the dtype policy, and the semantic preprocessing settings
        (maximum text length, condition resolution, ...). Plain JSON data.

        It keys the condition cache (spec dataset-guide, "Condition cache and target lifecycle"): change any of it and
        a new cache is built. Leave out what does not change ``preprocess`` output (the target resolution of a
        text-only preprocess, batch sizes), so that changing it reuses the cache.
        """
        raise NotImplementedError(
            f"{type(self).__name__} must implement preprocess_identity() to key the condition cache "
            "(or set data.enable_preprocess: false to keep conditions in memory)"
        )

    def release_preprocessing(self) -> list[str]:
        """Drop the :attr:`preprocessing_components` (set them to ``None``) once every condition is cached, and return
        their names. ``preprocess`` is unavailable afterwards; every other stage works as before."""
        for name in self.preprocessing_components:
            setattr(self, name, None)
        self.preprocessing_released = True
        return list(self.preprocessing_components)

    def frozen_to(self, device: torch.device | str) -> None:
        """Move every component outside the :meth:`trained_networks` (detached ones included) to ``device``.

        Conditions are preprocessed on the accelerator before the strategy places the model (``configure_model``);
        the trained networks are left where they are, for the strategy to place (or shard) them.
        """
        trained = {id(m) for m in self.trained_networks()}
        for child in [*self.children(), *self.detached_modules().values()]:
            if not any(id(m) in trained for m in child.modules()):
                child.to(device)

    # -- frozen components outside the module tree -------------------------------------------------
    _detached: tuple[str, ...] = ()

    def detach_frozen(self) -> list[str]:
        """Take every direct child holding no trained network (VAE, text encoders, ...) out of the module tree, and
        return their names. They stay attributes (``self.vae`` works as before) but are no longer submodules: they
        are not in ``parameters()`` or ``state_dict()``, so a sharding strategy that wraps the whole LightningModule
        (FSDP1's root unit, DeepSpeed's engine) never shards them (they run outside any forward it wraps: while
        preprocessing, encoding targets, decoding samples) and checkpoints never hold them. ``to()`` / ``cuda()`` /
        ``half()`` still reach them (:meth:`_apply`), so a strategy that places the model places them too.

        ``FlowModule.configure_model`` calls it once the trained parameters are chosen (it reads
        :meth:`trained_networks`). Assigning a module to a detached name registers it again.
        """
        trained = {id(m) for m in self.trained_networks()}
        names = [name for name, child in self._modules.items()
                 if child is not None and not any(id(m) in trained for m in child.modules())]  # fmt: skip
        for name in names:
            # A plain attribute: nn.Module skips it. Frozen: eval mode, which train() keeps (it walks them too).
            object.__setattr__(self, name, self._modules.pop(name).eval())
        self._detached = (*self._detached, *names)
        return names

    def detached_modules(self) -> dict[str, nn.Module]:
        """The components :meth:`detach_frozen` took out of the module tree and still held (released ones are gone)."""
        found = {name: self.__dict__.get(name) for name in self._detached}
        return {name: module for name, module in found.items() if isinstance(module, nn.Module)}

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> Adapter:
        # nn.Module.to / cuda / half / float all end here: detached components follow the adapter's device and dtype.
        super()._apply(fn, recurse)
        if recurse:
            for module in self.detached_modules().values():
                module._apply(fn)
        return self

    def prepare_condition(self, batch: dict[str, Tensor]) -> Condition:
        """Realise a collated batch of preprocessed conditions once, on the module's device. An adapter whose
        realisation is random may take a keyword ``generator`` (a seeded CPU generator, or ``None``): the objectives
        pass their per-micro-batch stream through :func:`ff_core.objectives.flow_matching.prepare_batch_condition`."""
        raise NotImplementedError

    def output_geometry(self) -> tuple[MediaGeometry | None, ...]:
        """The geometry each output is encoded at, in the contract's output order (``None``: taken as decoded).

        The data loader's workers fit every decoded target to it before collation (:mod:`ff_core.data.media.geometry`:
        bilinear resize of the shorter side, then a centre crop, as diffusers' training scripts), so
        :meth:`encode_output` never sees a batch of mixed sizes. Called once per training loader; the result is
        pickled to the workers, so return plain data.
        """
        return (None,) * len(self.io_contract.outputs)

    def denoiser_tokens(self, geometry: MediaGeometry) -> int | None:
        """How many tokens the denoiser sees for one target of ``geometry`` (a Wan clip: ``(1 + (F - 1) / 4) ·
        (H / 16) · (W / 16)``), or ``None`` when the family does not say. ``data.max_tokens`` sizes each bucket's
        batch with it (``max_tokens // tokens``), so every bucketed batch fills the same token budget."""
        return None

    def encode_output(
        self, media: list[list[Tensor]], condition: Condition, generator: torch.Generator | None = None
    ) -> LatentState:
        """Encode decoded target media (per sample, in the contract's output order) to clean latents.

        Args:
            media: per sample, the decoded outputs in the contract's order.
            condition: the batch's prepared condition (:meth:`prepare_condition`).
            generator: draws the codec's randomness (a VAE posterior sample); ``None``: the global generator.
                Training passes one seeded per rank and micro-batch, so ranks differ and resumed runs repeat.
        """
        raise NotImplementedError

    def stored_latents(self, latents: dict[str, Tensor], condition: Condition) -> LatentState:
        """Clean latents read from tensor-parquet rows (collated, on the CPU, in their stored dtype) as
        :meth:`encode_output` would return them: on the denoiser's device, in its dtype, in :attr:`tensor_columns`
        order. Override it to add the masks ``encode_output`` sets (a pinned first-frame latent, say).

        Args:
            latents: component name -> (B, ...) tensor, from ``batch["latents"]``.
            condition: the batch's prepared condition.
        """
        param = next(self.denoiser.parameters())
        return LatentState({k: v.to(device=param.device, dtype=param.dtype) for k, v in latents.items()})

    def velocity(self, state: LatentState, sigma: Tensor, condition: Condition) -> LatentState:
        """Predict the flow velocity ``eps - x0`` at noise level ``sigma`` (shape (B,), in [0, 1])."""
        raise NotImplementedError

    def component_velocity(self, state: LatentState, sigmas: dict[str, Tensor], condition: Condition) -> LatentState:
        """The velocity with each latent component at its own noise level: what sampling and GRPO replays call when
        the components step on their own schedules (:meth:`sampling_schedules`).

        Default: :meth:`velocity` at the first component's level (a denoiser conditioned on one noise level: the
        other components are stepped on their schedules but predicted at it). A family whose denoiser takes one noise
        level per stream (MiniMax H3: video and audio rows at their own timesteps in one forward) overrides it.
        Training calls it with each component's level where :meth:`timestep_shifts` gives per-component shifts;
        otherwise it noises every component at one level and calls :meth:`velocity`, which such a family implements
        as this method with that level for every component.

        Args:
            state: the noisy latents.
            sigmas: per component name (every one of ``state``'s), its noise levels, shape (B,).
            condition: the prepared condition.
        """
        return self.velocity(state, sigmas[next(iter(state.components))], condition)

    def decode(self, state: LatentState) -> list[list[Tensor]]:
        """Decode latents to media: per sample, the contract's outputs (images: uint8 (3, H, W))."""
        raise NotImplementedError

    # -- generation ------------------------------------------------------------------------------
    def initial_noise(self, condition: Condition, generator: torch.Generator | None = None) -> LatentState:
        """Pure noise in the latent geometry the condition asks for."""
        raise NotImplementedError

    def unconditional(self, condition: Condition) -> Condition | None:
        """The negative-prompt branch of ``condition`` for CFG, or ``None`` when there is none."""
        return None

    def with_embedded_guidance(self, condition: Condition, scale: float) -> Condition:
        """``condition`` with the distilled-guidance scale ``scale`` (``model.sampling.embedded_guidance``) for
        :meth:`velocity` to feed the denoiser's guidance embedding.

        Default: a copy holding ``condition["embedded_guidance"] = scale``; the adapter's :meth:`velocity` reads
        ``condition.get("embedded_guidance", self.embedded_guidance)``. Sampling applies it to the condition and to its
        CFG branch (:func:`ff_core.sampling.guided_conditions`). Raises ``ValueError`` when the checkpoint has no
        guidance embedding (:attr:`embedded_guidance` is ``None``): a scale that would be ignored is an error.

        Args:
            condition: a prepared condition (:meth:`prepare_condition`, or :meth:`unconditional`'s branch).
            scale: the guidance scale.
        """
        if self.embedded_guidance is None:
            raise ValueError(f"adapter {self.name!r}: this checkpoint has no guidance embedding, so an embedded "
                             f"guidance scale ({scale}) would be ignored; leave it unset")  # fmt: skip
        return {**condition, "embedded_guidance": float(scale)}

    def timestep_shift(self, state: LatentState | None = None) -> float:
        """The noise-schedule shift ``s`` (``sigma <- s * sigma / (1 + (s - 1) * sigma)``, SD3 eq. 23) sampling uses
        for latents shaped like ``state`` (``None``: the adapter's sampling resolution); 1 is no shift.

        Training draws its noise levels with it unless the recipe sets ``timesteps.shift``, so a model trains on the
        schedule it is evaluated on. Families read it from their scheduler config; a resolution-dependent shift
        (diffusers' ``use_dynamic_shifting``: ``exp(mu)`` with ``mu`` linear in the token count, ``calculate_shift``)
        reads the token count from ``state``'s shape.
        """
        return 1.0

    def timestep_shifts(self, state: LatentState | None = None) -> dict[str, float] | None:
        """Per latent component, the shift its sampling schedule uses, for a family whose components denoise on
        their own schedules from one sampler time (:meth:`sampling_schedules`); ``None`` (default): every component
        on :meth:`timestep_shift`'s one schedule.

        When it returns shifts (and the recipe leaves ``timesteps.shift`` unset), training draws ONE weighting draw
        ``u`` per sample and noises component ``k`` at ``shift_sigma(u, shift_k)``, calling
        :meth:`component_velocity` with those levels: each stream trains on the (sigma_k) tuples sampling meets.

        Args:
            state: latents shaped like the batch's (``None``: the adapter's sampling resolution).
        """
        return None

    def sampling_sigmas(self, num_steps: int, shift: float | None = None, state: LatentState | None = None) -> Tensor:
        """Noise levels from 1 towards 0 (``num_steps + 1`` values, last one 0) for Euler sampling.

        Args:
            num_steps: Euler steps.
            shift: overrides the schedule's shift (``model.sampling.shift``); ``None``: :meth:`timestep_shift`.
            state: the run's initial noise: a schedule that depends on the latent geometry (a resolution-dependent
                shift) reads it from its shape; ``None``: the adapter's sampling resolution.
        """
        sigmas = torch.linspace(1.0, 0.0, num_steps + 1)
        return shift_sigma(sigmas, self.timestep_shift(state) if shift is None else shift)

    def sampling_schedules(self, state: LatentState, num_steps: int, shift: float | None = None) -> dict[str, Tensor]:
        """Per latent component of ``state``, its noise levels (``num_steps + 1`` values from 1 towards 0) for sampling.

        Default: :meth:`sampling_sigmas` for ``state``'s geometry, for every component. A family whose components
        denoise on their own schedules (an audio stream beside video) overrides it; the velocity is evaluated with
        :meth:`component_velocity` (by default at the first component's level).

        Args:
            state: the initial noise (component names and shapes).
            num_steps: sampler steps.
            shift: overrides the schedule's shift (``model.sampling.shift``); ``None``: the adapter's.
        """
        if "state" in inspect.signature(self.sampling_sigmas).parameters:
            sigmas = self.sampling_sigmas(num_steps, shift=shift, state=state)
        else:  # an override written for interface 1.0, before schedules could depend on the geometry
            sigmas = self.sampling_sigmas(num_steps, shift=shift)
        return {name: sigmas for name in state.components}

    def sampling_schedulers(
        self, state: LatentState, num_steps: int, shift: float | None = None
    ) -> dict[str, Any] | None:
        """Per latent component of ``state``, the diffusers scheduler evaluation samples with
        (``model.sampling.scheduler: checkpoint``), its timesteps set for ``num_steps`` steps; ``None``: ff's Euler
        steps on :meth:`sampling_schedules` (the pipeline's sampler where the checkpoint's scheduler is Euler).

        Default: :func:`ff_core.sampling.schedulers.checkpoint_schedulers` of the adapter's ``scheduler`` attribute, a
        fresh copy per component, unless it is an Euler one (:data:`~ff_core.sampling.schedulers.EULER_SCHEDULERS`)
        or not a flow one (:func:`~ff_core.sampling.schedulers.is_flow_scheduler`: ``prediction_type`` other than
        ``flow_prediction`` and no ``FlowMatch*`` class; an epsilon / v-prediction scheduler would misread the
        velocity, so Euler it is, logged): released Wan checkpoints' ``UniPCMultistepScheduler`` samples as
        ``WanPipeline`` does. Every component gets a copy of the ONE scheduler, so the same schedule: a family whose
        components need schedules of their own (another shift per stream) overrides this method and returns one
        scheduler per component; one whose pipeline samples otherwise
        than ``scheduler.step`` per timestep (or that cannot honour its masks with it) returns ``None`` and documents
        it. GRPO rollouts never call it (their steps are ff's SDE / ODE steps).

        Args:
            state: the initial noise (component names, masks, device).
            num_steps: sampler steps.
            shift: ``model.sampling.shift`` (replaces the scheduler's ``flow_shift`` / ``shift``); ``None``: its own.
        """
        from ff_core.sampling.schedulers import checkpoint_schedulers

        return checkpoint_schedulers(getattr(self, "scheduler", None), state, num_steps, shift)

    def uses_second_expert(self, sigma: float) -> bool | None:
        """Whether the denoiser's low-noise expert predicts at noise level ``sigma`` (Wan2.2 A14B: ``transformer_2``
        below ``boundary_ratio``), the steps ``guidance_scale_2`` guides (:func:`ff_core.sampling.expert_guidance`);
        ``None`` (default): the checkpoint has one denoiser, and ``guidance_scale_2`` is refused.

        Args:
            sigma: the noise level of a sampling step, in [0, 1].
        """
        return None

    def training_sigmas(self, state: LatentState | None = None) -> Tensor:
        """The table of noise levels the family's reference training draws from, descending from (about) 1 towards
        0, for latents shaped like ``state`` (``model.objective.timesteps.schedule: adapter``,
        :class:`~ff_core.objectives.flow_matching.TimestepSampler`).

        diffusers' training scripts draw ``u`` (logit-normal or uniform) and take ``sigmas[(u * N).long()]`` from a
        copy of the scheduler made at load time, its ``N = num_train_timesteps`` levels. Default: ``i / 1000`` for
        ``i = 1000 .. 1``, shifted by :meth:`timestep_shift` for ``state``: the table of a
        ``FlowMatchEulerDiscreteScheduler`` with a static ``shift``. A scheduler with ``use_dynamic_shifting``
        (FLUX.1) builds its table unshifted (the resolution-dependent ``mu`` applies only in ``set_timesteps``), so
        a family with a diffusers scheduler returns :func:`scheduler_sigma_table` of it instead.

        Args:
            state: the batch's clean latents (a resolution-dependent shift reads their size); ``None``: the
                adapter's sampling resolution.
        """
        levels = torch.arange(1000, 0, -1, dtype=torch.float32) / 1000
        return shift_sigma(levels, self.timestep_shift(state))

    @torch.no_grad()
    def sample(
        self,
        condition: Condition,
        *,
        num_steps: int = 20,
        guidance_scale: float | dict[str, float] = 1.0,
        generator: torch.Generator | None = None,
        shift: float | None = None,
        embedded_guidance: float | None = None,
        guidance_rescale: float | dict[str, float] = 0.0,
        guidance_scale_2: float | None = None,
        scheduler: str = "checkpoint",
    ) -> LatentState:
        """Deterministic sampling from noise to clean latents, with optional CFG (:func:`ff_core.sampling.sample_ode`;
        GRPO's stochastic rollouts are :func:`ff_core.sampling.sample_sde`): with the checkpoint's own scheduler where
        :meth:`sampling_schedulers` gives one (``scheduler: checkpoint``, the default: the family pipeline's default
        output), else, or with ``scheduler: euler``, Euler steps.

        Elements ``initial_noise`` pins through its masks (mask 0, e.g. a condition frame) are never changed.
        ``guidance_scale`` and ``guidance_rescale`` are one value or one per latent component
        (:func:`ff_core.sampling.guided_velocity`). ``shift`` overrides the schedule's shift (see
        :meth:`sampling_sigmas`); ``embedded_guidance`` sets the distilled-guidance scale
        (:meth:`with_embedded_guidance`; ``None``: the adapter's default). ``guidance_scale_2``: the CFG scale of the
        steps the low-noise expert predicts (:meth:`uses_second_expert`; Wan2.2 A14B), ``None``: ``guidance_scale``.
        """
        return sample_ode(self, condition, num_steps=num_steps, guidance_scale=guidance_scale, generator=generator,
                          shift=shift, embedded_guidance=embedded_guidance, guidance_rescale=guidance_rescale,
                          guidance_scale_2=guidance_scale_2, scheduler=scheduler)  # fmt: skip

    # -- LoRA export ----------------------------------------------------------------------------
    def lora_file(self, network: str) -> tuple[str, str]:
        """``(file name, key prefix)`` of one network's LoRA in the export folder (:meth:`save_loras`).

        Default: the network named :attr:`lora_prefix` is ``pytorch_lora_weights.safetensors`` (what
        ``pipe.load_lora_weights(folder)`` reads); another network ``N`` is ``pytorch_lora_weights_N.safetensors``,
        its keys prefixed by :attr:`lora_prefix` too: diffusers loads such a file into the component with a flag
        (Wan2.2: ``pipe.load_lora_weights(folder, weight_name="pytorch_lora_weights_transformer_2.safetensors",
        load_into_transformer_2=True)``; ``WanLoraLoaderMixin`` filters keys by the ``transformer.`` prefix either
        way). Override it for a loader with other conventions.

        Args:
            network: a key of :meth:`denoisers`.
        """
        if network == self.lora_prefix:
            return LORA_WEIGHT_NAME, self.lora_prefix
        return f"{Path(LORA_WEIGHT_NAME).stem}_{network}.safetensors", self.lora_prefix

    def save_loras(
        self,
        directory: str | os.PathLike,
        state_dicts: dict[str, dict[str, Tensor]],
        configs: dict[str, LoraConfig],
        extra_files: dict[str, bytes] | None = None,
    ) -> dict[str, Path]:
        """Write every trained network's diffusers-loadable LoRA into one folder, published atomically (replaced
        whole if it exists); returns each network's file. See :meth:`save_lora` for one file's format and
        :meth:`lora_file` for the names.

        Args:
            directory: the folder to publish.
            state_dicts: per network (a key of :meth:`denoisers`), peft's state dict of its LoRA layers.
            configs: per network, the peft ``LoraConfig`` it was trained with.
            extra_files: more files published in the same folder, by name (``FlowCheckpoint``'s ``ff_export.json``).
        """
        # diffusers' own writer, so the header is byte for byte what its loaders parse (loaders/lora_base.py).
        from diffusers.loaders.lora_base import LoraBaseMixin

        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        tmp.chmod(0o755)  # mkdtemp creates 0700; the published folder is an ordinary one
        try:
            files = {}
            for network, state_dict in state_dicts.items():
                weight_name, prefix = self.lora_file(network)
                tensors = {f"{prefix}.{k}": v.detach().cpu().contiguous() for k, v in state_dict.items()}
                metadata = {f"{prefix}.{k}": v for k, v in configs[network].to_dict().items()}
                LoraBaseMixin.write_lora_layers(
                    state_dict=tensors,
                    save_directory=str(tmp),
                    is_main_process=True,
                    weight_name=weight_name,
                    save_function=None,
                    safe_serialization=True,
                    lora_adapter_metadata=metadata,
                )
                files[network] = directory / weight_name
            for name, data in (extra_files or {}).items():
                (tmp / name).write_bytes(data)
            replace_dir(tmp, directory)  # fsyncs, then one atomic exchange (ff_core.atomic)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return files

    def save_lora(self, directory: str | os.PathLike, state_dict: dict[str, Tensor], config: LoraConfig) -> Path:
        """Write a diffusers-loadable LoRA (``pytorch_lora_weights.safetensors``) atomically.

        Args:
            directory: the folder to publish (replaced whole if it exists).
            state_dict: peft's state dict of the denoiser (``get_peft_model_state_dict``); keys are prefixed with
                :attr:`lora_prefix` the way diffusers' ``load_lora_weights`` expects.
            config: the peft ``LoraConfig`` the denoiser was trained with. It is stored, prefixed the same way, as
                the file's ``lora_adapter_metadata`` (diffusers' ``save_lora_weights(...,
                transformer_lora_adapter_metadata=...)`` format), from which diffusers rebuilds the adapter: without
                it a loader assumes ``lora_alpha == r`` and applies the update at scale 1 instead of ``alpha / r``.
        """
        return self.save_loras(directory, {self.lora_prefix: state_dict}, {self.lora_prefix: config})[self.lora_prefix]
