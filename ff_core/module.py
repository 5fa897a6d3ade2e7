"""FlowModule: the LightningModule that wires an adapter, an objective and the optimiser.

It stays thin (STYLE 5): the objective computes the loss from the adapter's stages; this module loads the
adapter (in ``configure_model``, after the data were validated), freezes what is not trained, applies
LoRA through peft, logs, and keeps checkpoints small (only trainable tensors are saved; frozen components
come back from ``pretrained_model_name_or_path``). Sampling and evaluation (``model.sampling``, the validation,
test and predict steps) are :mod:`ff_core.evaluation`'s.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, is_dataclass
from typing import Any

import lightning as L
import torch
from jsonargparse import lazy_instance
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.trainer.states import TrainerFn

from ff_core.adapter import Adapter
from ff_core.context_parallel import check_heads, check_plans, denoiser_classes, enable_networks
from ff_core.contracts import PipelineIOContract
from ff_core.data.dataflow import DataParallelCoords
from ff_core.errors import ConfigError
from ff_core.evaluation import Evaluation, SamplingConfig
from ff_core.lora import LoRAConfig, apply_lora, frozen_parameters
from ff_core.lora import lora_configs as lora_configs  # re-exported: docs named ff_core.module before ff_core.lora
from ff_core.lora import lora_state_dicts as lora_state_dicts  # re-exported: as lora_configs
from ff_core.nonfinite import NonFiniteGuard, NonFinitePolicy
from ff_core.nonfinite import check_strategy as check_nonfinite_strategy
from ff_core.objectives import Objective, SFTObjective
from ff_core.objectives.rewards import Rewards
from ff_core.plugins import get_adapter_class
from ff_core.preemption import PreemptionGuard
from ff_core.pretrained import check_adapter_kwargs, load_pretrained, resolve_contract
from ff_core.rewards import RewardSpec
from ff_core.sampling import COMPONENT_WEIGHTS_KEY, check_kept_weights
from ff_core.seeding import derive_seed
from ff_core.sharding import (
    STRATEGY_NAMES,
    ShardingConfig,
    check_sharded,
    clean_name,
    fully_shard_copies,
    fully_shard_networks,
    gradient_divide_factor,
    sharding_mesh,
    strategy_kind,
)
from ff_core.vae_memory import apply_vae_memory, check_vae_memory

log = logging.getLogger(__name__)

NOISE_SEED_KEY = "ff_noise_seed"
"""Checkpoint entry holding the run's resolved training-noise seed."""
NONFINITE_KEY = "ff_nonfinite_skipped"
"""Checkpoint entry holding the steps ``model.nonfinite: skip`` skipped so far."""
OBJECTIVE_STATE_KEY = "ff_objective_state"
"""Checkpoint entry holding the objective's own state (:meth:`~ff_core.objectives.base.Objective.checkpoint_state`)."""


# Saved in checkpoints' hyper-parameters: allow them under torch.load(weights_only=True), Lightning's default; under
# the names checkpoints written before they moved out of this module hold, too (a pickle names a class by its path).
CHECKPOINT_CLASSES = (LoRAConfig, SamplingConfig, ShardingConfig)
torch.serialization.add_safe_globals([*CHECKPOINT_CLASSES, (LoRAConfig, "ff_core.module.LoRAConfig"),
                                      (SamplingConfig, "ff_core.module.SamplingConfig")])  # fmt: skip


class FlowModule(Evaluation, L.LightningModule):
    """Post-train a flow-matching model.

    Args:
        adapter: registered adapter name (``sd3-5``; see ``ff plugins``) or dotted path ``pkg.mod:Class``.
        pretrained_model_name_or_path: local folder or hub id in the family's diffusers layout.
        adapter_kwargs: extra keyword arguments of the adapter's ``from_pretrained`` (resolution, dtype, ...).
        objective: the training objective (default: supervised flow matching).
        optimizer: optimiser factory over the trainable parameters (default AdamW, lr 1e-4).
        lr_scheduler: optional learning-rate scheduler factory, stepped every optimiser step.
        lora: train a LoRA of the denoiser instead of all its weights.
        sampling: validation sampling options.
        gradient_checkpointing: recompute the denoiser's activations in the backward pass (less memory, ~30 %
            more compute); needs a denoiser with diffusers' ``enable_gradient_checkpointing``. Works under every
            strategy (FSDP2 included: it recomputes inside each sharded block).
        sharding: FSDP2 settings (mixed precision, resharding, CPU offload; :class:`~ff_core.sharding.ShardingConfig`)
            of the trained networks under Lightning's ``ModelParallelStrategy``, which needs this module to shard:
            ``configure_model`` shards them over the strategy's mesh (``sharding_mesh``) whether this is set or not
            (``None``: FSDP2's defaults, the parameters' own dtype). Refused under any other strategy (FSDP1's and
            DeepSpeed's precision and offload are the strategy's own arguments). docs/scaling.md.
        noise_seed: seed of the training noise (noise levels and noise); ``None``: the run's ``seed_everything``
            (0 without one). Each micro-batch draws from a generator seeded by (this seed, data-parallel rank,
            optimiser step, micro-batch in the accumulation window): ranks draw different noise, and a resumed run
            the same noise as the uninterrupted one (checkpoints keep the seed).
        eval_rewards: rewards scored on the samples generated from the evaluation prompts (validation and test),
            ``[{name, weight, args, label, offload}]`` (see ``ff plugins``); logged as ``val/reward/<label>`` (batch
            mean) and ``val/reward`` (weighted total, on the progress bar). ``None``: the objective's default (an online
            objective's training rewards), else none. Every evaluation record must carry the metadata fields they
            read. Plain mappings, not dataclasses, on purpose: jsonargparse merges a list of dataclasses given on the
            command line into the recipe's item by item (a reward would inherit the recipe's ``args`` and ``label``);
            a list of mappings is replaced whole.
        frozen_components: latent components whose branch of the denoiser does not train (``[audio]``: LTX-2's
            audio stream): the adapter names their parameters (:meth:`~ff_core.adapter.Adapter.component_parameters`),
            which stay frozen under LoRA and full fine-tuning alike, and the objective leaves them out of the loss
            (SFT and offline DPO: its error term; GRPO: its step log-prob term). docs/config.md.
        nonfinite: what a non-finite loss or gradient does, checked before every optimiser step on every rank
            (:mod:`ff_core.nonfinite`): ``stop`` (default) ends the run with one line naming the step, the rank(s)
            and the step's samples, before the step, so no checkpoint holds poisoned weights; ``skip`` drops the
            step's gradients (the optimiser changes nothing), logs ``train/nonfinite_skipped`` and lists the step in
            the run folder's ``nonfinite_skipped.jsonl``. docs/scaling.md, "Non-finite losses and gradients".
        vae_tiling: encode and decode with the VAE's tiling (diffusers' ``enable_tiling``; a mapping: its
            arguments, e.g. ``{tile_sample_min_height: 256, tile_sample_stride_height: 192}``): less memory on long
            or large clips, results near tile seams change slightly (:mod:`ff_core.vae_memory`).
        vae_slicing: encode and decode a batch one sample at a time (``enable_slicing``; same results).
    """

    def __init__(
        self,
        adapter: str,
        pretrained_model_name_or_path: str,
        adapter_kwargs: dict[str, Any] | None = None,
        objective: Objective = lazy_instance(SFTObjective),
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        lora: LoRAConfig | None = None,
        sampling: SamplingConfig | None = None,
        gradient_checkpointing: bool = False,
        sharding: ShardingConfig | None = None,
        noise_seed: int | None = None,
        eval_rewards: list[dict[str, Any]] | None = None,
        frozen_components: list[str] | None = None,
        nonfinite: NonFinitePolicy = "stop",
        vae_tiling: bool | dict[str, Any] = False,
        vae_slicing: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["objective", "optimizer", "lr_scheduler"])
        try:
            self.adapter_cls: type[Adapter] = get_adapter_class(adapter)  # class only: no weights yet
        except KeyError as exc:  # names the closest registered adapter; `ff fit` prints it as one line
            raise ConfigError("model.adapter", exc.args[0]) from None
        self.pretrained_model_name_or_path = pretrained_model_name_or_path
        self.adapter_kwargs = dict(adapter_kwargs or {})
        self.objective = objective
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.lora = lora
        self.sampling = sampling or SamplingConfig()
        self.gradient_checkpointing = gradient_checkpointing
        self.sharding = sharding
        self.noise_seed = noise_seed
        self.frozen_components = list(dict.fromkeys(frozen_components or ()))
        self.nonfinite_guard = NonFiniteGuard(nonfinite)
        check_vae_memory(vae_tiling, vae_slicing)
        self.vae_tiling, self.vae_slicing = vae_tiling, vae_slicing
        objective.freeze_components(self.frozen_components)  # before any weights load: an objective may refuse
        # Before any weights load (STYLE 3): keys and values that need no checkpoint now, the checkpoint's in setup.
        check_adapter_kwargs(self.adapter_cls, None, self.adapter_kwargs)
        guidance = {f"model.sampling.{k}": getattr(self.sampling, k) for k in ("guidance_scale", "guidance_rescale")}
        guidance |= {f"model.objective.init_args.{k}": getattr(objective, k) for k in ("guidance_scale",
                     "guidance_rescale") if hasattr(objective, k)}  # GRPO's rollouts: one or per component too
        check_components(self.adapter_cls, self.frozen_components, getattr(objective, "component_weights", None),
                         guidance)  # fmt: skip
        self._run_noise_seed: int | None = None  # resolved at train start: noise_seed, the checkpoint's, or the run's
        self._shared_expert = False  # timesteps.expert_choice resolved per_micro_batch (_resolve_expert_choice)
        self._checkpoint_noise_seed: int | None = None
        self._preemption = PreemptionGuard()  # SIGTERM: a resumable checkpoint at the next step, then exit 143
        # Checked now (unknown keys, weights); the reward classes are built in setup, after the data are validated.
        self.eval_rewards = None if eval_rewards is None else [
            RewardSpec.from_config(spec, f"model.eval_rewards[{i}]") for i, spec in enumerate(eval_rewards)]
        self.eval_reward_set: Rewards | None = None  # built in setup, before weights load
        self._rewards_device: torch.device | None = None
        self.adapter: Adapter | None = None
        self._contract: PipelineIOContract | None = None
        self.objective_modules: torch.nn.Module | None = None  # what the objective keeps (offline DPO's reference)
        # Checkpoints hold what trains (the LoRA, or the whole denoiser); frozen parts reload from the base folder.
        self.strict_loading = False
        self.register_state_dict_post_hook(_keep_trained)

    @property
    def automatic_optimization(self) -> bool:
        """Lightning's switch: off for objectives that optimise themselves (GRPO: several optimiser steps per batch).
        ``trainer.accumulate_grad_batches`` and ``trainer.gradient_clip_val`` are then refused by Lightning; GRPO has
        its own ``mini_batches`` and ``max_grad_norm``."""
        return self.objective.automatic_optimization

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        if value != self.objective.automatic_optimization:
            raise ValueError("FlowModule.automatic_optimization follows model.objective; it cannot be set")

    @property
    def strategy_reduces_gradients(self) -> bool:
        """Whether each backward reduces the gradients over the data-parallel ranks itself (FSDP2's reduce-scatter
        into the shards, DeepSpeed ZeRO's partitioned reduction), so that every rank must run the same forwards and
        backwards: an objective that optimises itself (GRPO) then leaves the averaging to the strategy. ``False`` on
        one device and under DDP (whose per-backward all-reduce an objective may switch off)."""
        return self._trainer is not None and strategy_kind(self._trainer.strategy) in ("fsdp2", "deepspeed")

    def mark_accumulation_boundary(self, last: bool) -> None:
        """Before each forward and backward of an optimiser step: say whether it is the step's last (a no-op but
        under DeepSpeed).

        DeepSpeed's engine decides when to reduce and keep gradients by counting backwards against its
        ``gradient_accumulation_steps`` (Lightning's ``accumulate_grad_batches``, 1), and its ZeRO optimiser starts
        each micro-step in the engine's ``forward`` (ZeRO-3 counts micro-steps there: the first backward after it
        overwrites the gradient partitions, later ones add). Lightning runs the engine's forward once per training
        step; an objective that back-propagates several times per step (GRPO: every replayed transition) calls this
        before each forward, which does what the engine's forward does first and marks the step's last backward
        (``set_gradient_accumulation_boundary``). Without it ZeRO-2 and ZeRO-3 each kept only the last backward's
        gradients (measured: 2 ranks x 3 backwards of a linear layer under ZeRO-2; a full fine-tuning GRPO step
        under ZeRO-3, tests/test_grpo_sharded.py)."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        if strategy_kind(strategy) == "deepspeed":
            from deepspeed.runtime.base_optimizer import ZeROOptimizer

            engine = strategy.model
            if isinstance(engine.optimizer, ZeROOptimizer):  # deepspeed.DeepSpeedEngine.forward's prologue
                engine.optimizer.clear_backward_seen_flag()
            engine.set_gradient_accumulation_boundary(last)

    # -- before weights: rewards and the records they read ---------------------------------------------
    def setup(self, stage: str) -> None:
        """Build the evaluation rewards and check that the records carry the metadata fields every configured reward
        reads. Lightning calls it after the data module's ``setup`` (records loaded and validated) and before
        ``configure_model`` loads any weight, so a dataset without a needed field fails fast, naming the reward, the
        field and each record's file and line."""
        if self.eval_reward_set is None and stage != TrainerFn.PREDICTING:  # ff predict scores nothing
            self.eval_reward_set = self._build_eval_rewards()
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if self.eval_reward_set is not None and datamodule is not None:
            self.eval_reward_set.check_records(getattr(datamodule, "eval_records", ()))
        if self.adapter is None:
            check_adapter_kwargs(self.adapter_cls, self.pretrained_model_name_or_path, self.adapter_kwargs)
        strategy = getattr(self._trainer, "strategy", None) if self._trainer is not None else None
        if strategy is not None:
            self._check_strategy(strategy)
        self._check_guidance()
        self._check_guidance_rescale()
        self._check_sampler_kwargs()
        self._check_micro_batch()
        if stage != TrainerFn.FITTING:
            return
        if self._trainer is not None:
            self.objective.check_run(DataParallelCoords.from_trainer(self._trainer).world_size)
        training = self.objective.training_rewards()
        if training is not None:
            training.check_outputs(list(self.output_types), self.adapter_cls.name)
            if datamodule is not None:
                training.check_records(getattr(datamodule, "train_records", ()))

    def _check_strategy(self, strategy: Any) -> None:
        """Refuse, before weights load, a strategy setting ff cannot honour (docs/scaling.md)."""
        from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

        from ff_core.strategies import ContextParallelStrategy
        from ff_core.strategies import DeepSpeedStrategy as FlowDeepSpeed

        check_nonfinite_strategy(self.nonfinite_guard.policy, strategy)
        kind, allowed = strategy_kind(strategy), self.objective.sharding_strategies
        if kind is not None and kind not in allowed:
            runs = ", ".join(["one device", "DDP", *(STRATEGY_NAMES[k] for k in sorted(allowed))])
            raise ConfigError("trainer.strategy", f"{type(self.objective).__name__} runs on {runs}, not under "
                              f"{STRATEGY_NAMES[kind]}")  # fmt: skip
        if kind == "deepspeed" and not self.objective.automatic_optimization:
            self._clip_in_deepspeed(strategy)
        if isinstance(strategy, ContextParallelStrategy):  # a plan to split each trained network by, heads to spread
            classes = denoiser_classes(self.adapter_cls, self.pretrained_model_name_or_path)
            check_plans(self.adapter_cls, classes, strategy.context_parallel_size)
            check_heads(self.pretrained_model_name_or_path, list(classes), strategy.context_parallel_size)
        elif isinstance(strategy, ModelParallelStrategy):
            sharding_mesh(strategy)  # a tensor-parallel dimension is refused: ff has no tensor-parallel plan
        elif self.sharding is not None:
            raise ConfigError("model.sharding", f"applies under ModelParallelStrategy (FSDP2) only, not under "
                              f"{type(strategy).__name__}: FSDP1's and DeepSpeed's precision and offload are "
                              "trainer.strategy arguments; drop model.sharding")  # fmt: skip
        if isinstance(strategy, FSDPStrategy) and strategy._state_dict_type != "full":
            # FSDP1's sharded state dict is built from the wrapped module's state_dict(), where FlowModule sits under
            # the root unit's _fsdp_wrapped_module. prefix: _keep_trained cannot drop the frozen base there (the root
            # unit's own hook requires every parameter it holds), so the checkpoint would expect them back on resume.
            raise ConfigError("trainer.strategy", f"FSDPStrategy with state_dict_type: {strategy._state_dict_type!r} "
                              "is not supported: set init_args state_dict_type: full (one gathered file), or use "
                              "ModelParallelStrategy (FSDP2) for sharded checkpoints")  # fmt: skip
        if isinstance(strategy, DeepSpeedStrategy) and not strategy.exclude_frozen_parameters:
            # DeepSpeed writes its engine's parameters, not the filtered state dict on_save_checkpoint returns.
            raise ConfigError("trainer.strategy", "DeepSpeedStrategy: set init_args exclude_frozen_parameters: true, "
                              "so that its checkpoints hold what trains only (the LoRA, or the denoiser), as under "
                              "every other strategy")  # fmt: skip
        stock_zero3 = isinstance(strategy, DeepSpeedStrategy) and not isinstance(strategy, FlowDeepSpeed)
        if stock_zero3 and strategy.zero_stage_3:
            # Lightning runs configure_model inside deepspeed.zero.Init under stage 3, which partitions every module
            # built there (text encoders and VAE too), although they run outside the engine's forward.
            raise ConfigError("trainer.strategy", "DeepSpeed ZeRO-3 under Lightning's DeepSpeedStrategy partitions the "
                              "frozen text encoders and VAE as they load: use class_path: ff_core.strategies."
                              "DeepSpeedStrategy (init_args: {stage: 3, exclude_frozen_parameters: true}), which "
                              "partitions the trained networks only")  # fmt: skip

    def _clip_in_deepspeed(self, strategy: Any) -> None:
        """DeepSpeed clips gradients inside its engine's step (``gradient_clipping`` in its config; Lightning's
        ``clip_gradients`` does nothing under it): an objective that clips itself (GRPO's ``max_grad_norm``) has its
        norm written there. A config that sets another value is refused, naming both keys."""
        norm = getattr(self.objective, "max_grad_norm", None)
        config = strategy.config
        if config.get("gradient_clipping") not in (None, norm or 0.0):
            raise ConfigError("trainer.strategy", f"the DeepSpeed config's gradient_clipping "
                              f"({config['gradient_clipping']}) differs from model.objective.init_args.max_grad_norm "
                              f"({norm}), which ff writes into it under DeepSpeed: drop one")  # fmt: skip
        config["gradient_clipping"] = norm or 0.0

    @property
    def io_contract(self) -> PipelineIOContract:
        """The checkpoint's IO contract: the loaded adapter's, else resolved from the checkpoint's config files
        (:meth:`~ff_core.adapter.Adapter.resolve_contract`, no weights)."""
        if self.adapter is not None:
            return self.adapter.io_contract
        if self._contract is None:
            self._contract = resolve_contract(self.adapter_cls, self.pretrained_model_name_or_path,
                                              self.adapter_kwargs)  # fmt: skip
        return self._contract

    @property
    def output_types(self) -> tuple[str, ...]:
        """The adapter contract's output kinds (``image``, ``video``, ``audio``), in ``decode``'s order."""
        return tuple(str(t) for t in self.io_contract.output_types)

    # -- model -------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.adapter is not None:
            return
        # A folder or hub id that cannot be loaded is a ConfigError naming model.pretrained_model_name_or_path.
        adapter = load_pretrained(self.adapter_cls, self.pretrained_model_name_or_path, self.adapter_kwargs)
        self._check_embedded_guidance(adapter)
        self._check_guidance_scale_2(adapter)
        apply_vae_memory(adapter, self.vae_tiling, self.vae_slicing)
        adapter.requires_grad_(False)
        networks = adapter.denoisers()
        frozen = frozen_parameters(adapter, self.frozen_components)
        if self.lora is not None:
            apply_lora(adapter, self.lora, frozen)
        else:
            for name, network in networks.items():
                network.requires_grad_(True)
                for parameter in frozen[name]:
                    network.get_parameter(parameter).requires_grad_(False)
        if self.gradient_checkpointing:
            for name, network in networks.items():
                if not hasattr(network, "enable_gradient_checkpointing"):
                    raise ValueError(f"model.gradient_checkpointing: the {adapter.name!r} {name} does not support it")
                network.enable_gradient_checkpointing()
        # Before any step changes a weight: offline DPO copies the denoiser here as its reference (full fine-tuning).
        self.objective_modules = self.objective.configure_model(adapter, lora=self.lora is not None)
        # Frozen components leave the module tree: no strategy shards or checkpoints them (Adapter.detach_frozen).
        adapter.detach_frozen()
        # from_pretrained returns eval-mode modules; take this module's mode (train right after construction).
        self.adapter = adapter.train(self.training)
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        log.info("%s: %d trainable parameters", adapter.name, trainable)
        self._prepare_conditions(adapter)
        if self._trainer is not None:
            # Outside the tree, a strategy that places modules one by one (FSDP1) would leave them on the CPU.
            adapter.frozen_to(self._trainer.strategy.root_device)
            self._shard(adapter)

    def _shard(self, adapter: Adapter) -> None:
        """FSDP2 under ``ModelParallelStrategy``: shard the trained networks block by block over the data-parallel
        mesh (:func:`~ff_core.sharding.fully_shard_networks`). The strategy itself shards nothing: it hands the mesh
        to ``configure_model`` and expects the module to do it; unsharded, the ranks would train without any gradient
        reduction and silently diverge."""
        from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

        from ff_core.strategies import ContextParallelStrategy

        strategy = self._trainer.strategy
        networks = adapter.denoisers()
        self._shared_expert = self._resolve_expert_choice(adapter, strategy)
        if isinstance(strategy, DDPStrategy) and len(networks) > 1:
            # A step whose samples all route to one expert leaves the other's parameters without a gradient, which
            # DDP's reducer refuses unless told to look for them (Lightning's ddp_find_unused_parameters_true).
            strategy._ddp_kwargs.setdefault("find_unused_parameters", True)
        if isinstance(strategy, FSDPStrategy) and len(networks) > 1:
            # Each sharded network all-gathers in its own forward, and an adapter may route each sample to one
            # network (Wan2.2's experts by noise level): ranks whose samples pick different networks would wait on
            # different collectives. FSDP2 runs them (below); FSDP1 cannot be tested on the CPU.
            raise ConfigError("trainer.strategy", f"{adapter.name} trains {len(networks)} networks "
                              f"({', '.join(networks)}), which FSDP1 does not shard; use FSDP2 (ModelParallelStrategy) "
                              "or DDP")  # fmt: skip
        if isinstance(strategy, ModelParallelStrategy):
            mesh, config = sharding_mesh(strategy), self.sharding or ShardingConfig()
            copies = self._reference_copies()
            if isinstance(strategy, ContextParallelStrategy):  # tokens split over the group, before FSDP2 wraps
                enable_networks(adapter, copies, strategy)
            if copies:  # before the networks: its blocks are found by their names inside them
                fully_shard_copies(adapter, copies, mesh, config)
            fully_shard_networks(adapter, mesh, config, gradient_divide_factor(strategy))
            check_sharded(self)  # a trained parameter outside every sharded network would never be reduced
        elif isinstance(strategy, FSDPStrategy):
            # FSDP1 wraps this module right after configure_model, with the FSDP arguments in strategy.kwargs: without
            # a policy it would flatten the whole denoiser into one unit (gathered whole for every forward), so each
            # of the adapter's blocks becomes a unit unless the recipe names a policy. (Lightning keeps its default
            # use_orig_params=True, which a LoRA needs: frozen and trained tensors share the flat parameters.)
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            kinds = {type(block) for blocks in adapter.sharding_blocks().values() for block in blocks}
            if kinds and strategy.kwargs.get("auto_wrap_policy") is None:
                strategy.kwargs["auto_wrap_policy"] = ModuleWrapPolicy(kinds)

    def _resolve_expert_choice(self, adapter: Adapter, strategy: Any) -> bool:
        """Whether each micro-batch's noise levels route to one expert picked alike on every rank
        (``timesteps.expert_choice``, :class:`~ff_core.objectives.flow_matching.TimestepSampler`): ``per_micro_batch``,
        or ``auto`` under FSDP2 or DeepSpeed with routed experts. Both need every rank to run the same expert at each
        step (FSDP2 all-gathers each expert's blocks in its forward; DeepSpeed reduces the gradients a backward
        produced, in buckets every rank must fill alike): refused with ``per_sample``, and for GRPO with a random SDE
        step subset (``num_sde_steps``: ranks would replay transitions at different levels)."""
        from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

        kind = "DeepSpeed" if isinstance(strategy, DeepSpeedStrategy) else "FSDP2"
        routed = len(adapter.denoisers()) > 1 and adapter.uses_second_expert(1.0) is not None
        sharded = isinstance(strategy, (ModelParallelStrategy, DeepSpeedStrategy)) and len(adapter.denoisers()) > 1
        timesteps = getattr(self.objective, "timesteps", None)
        choice = getattr(timesteps, "expert_choice", None)
        if sharded and not routed:
            raise ConfigError("trainer.strategy", f"{adapter.name} trains {len(adapter.denoisers())} networks "
                              f"({', '.join(adapter.denoisers())}) without routing noise levels to them "
                              f"(Adapter.uses_second_expert): {kind} cannot know that every rank runs the same one; "
                              "use DDP")  # fmt: skip
        if sharded and choice == "per_sample":
            raise ConfigError("model.objective.init_args.timesteps.expert_choice", f"per_sample under {kind}: "
                              f"{adapter.name}'s experts would run different collectives on different ranks; use "
                              "per_micro_batch (or auto)")  # fmt: skip
        sampler = getattr(self.objective, "sampler", None)
        if sharded and getattr(sampler, "num_sde_steps", None) is not None:
            raise ConfigError("model.objective.init_args.sampler.num_sde_steps", f"a random subset of SDE steps per "
                              f"rollout under {kind}: ranks would replay transitions on different {adapter.name} "
                              "experts; set a fixed window instead")  # fmt: skip
        if choice == "per_micro_batch" and not routed:
            raise ConfigError("model.objective.init_args.timesteps.expert_choice", f"per_micro_batch: "
                              f"{adapter.name} on this checkpoint has no routed experts")  # fmt: skip
        return routed and (choice == "per_micro_batch" or (choice == "auto" and sharded))

    def _reference_copies(self) -> list[torch.nn.Module]:
        """The frozen copies of a full fine-tuning's reference policy (offline DPO, GRPO with ``kl_beta``), which FSDP2
        shards as it shards the networks they copy (:func:`~ff_core.sharding.fully_shard_copies`); refused when they
        are offloaded to the CPU (``reference_offload``: sharding already divides them over the ranks)."""
        from ff_core.objectives.reference import ReferenceModel

        reference = getattr(self.objective, "reference", None)
        if not isinstance(reference, ReferenceModel) or not reference.copies():
            return []
        if reference.offload:
            raise ConfigError("model.objective.init_args.reference_offload", "true is not supported under "
                              "ModelParallelStrategy (FSDP2): the reference copy is sharded over the ranks there, as "
                              "the policy is; drop it")  # fmt: skip
        return reference.copies()

    def _check_micro_batch(self) -> None:
        """An objective that batches its own forwards (GRPO's ``micro_batch_size``: samples per rollout and replay
        forward, ``None`` the rank's whole share) must stay within the contract's ``max_batch_size`` (MiniMax H3: 1),
        as the data batch sizes do; refused before any weight loads, naming the key."""
        if not hasattr(self.objective, "micro_batch_size"):
            return
        most, size = self.io_contract.max_batch_size, self.objective.micro_batch_size
        if most is not None and (size is None or size > most):
            shown = "unset (the rank's whole share in one forward)" if size is None else str(size)
            raise ConfigError("model.objective.init_args.micro_batch_size",
                              f"{shown}, but adapter {self.adapter_cls.name!r} supports at most {most} sample(s) per "
                              f"batch; set it to {most}")  # fmt: skip

    def _prepare_conditions(self, adapter: Adapter) -> None:
        """Open (or build) the data module's condition caches now, between loading and the strategy's placement of
        the model: a build runs on the accelerator with only the frozen components there, and once every condition
        is cached the preprocessing-only components (text encoders) are released, so they never reach the
        accelerator for training (docs/datasets.md, "Condition cache")."""
        trainer = self._trainer
        prepare = getattr(getattr(trainer, "datamodule", None), "prepare_conditions", None)
        if prepare is None:
            return
        # Lightning calls configure_model inside the strategy's tensor-init context (default device: the
        # accelerator; default dtype: the precision's). preprocess output must not depend on it (the cache key does
        # not), so it runs with torch's defaults, as it would anywhere else.
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            with torch.device("cpu"):
                cached = prepare(adapter, device=trainer.strategy.root_device)
        finally:
            torch.set_default_dtype(default_dtype)
        if not cached:
            return
        released = adapter.release_preprocessing()
        if released:
            log.info("%s: conditions cached; released %s", adapter.name, ", ".join(released))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        keep = self._checkpoint_keys(checkpoint["state_dict"])
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}
        if self._run_noise_seed is not None:
            checkpoint[NOISE_SEED_KEY] = self._run_noise_seed
        checkpoint[NONFINITE_KEY] = self.nonfinite_guard.skipped
        objective_state = self.objective.checkpoint_state()
        if objective_state is not None:
            checkpoint[OBJECTIVE_STATE_KEY] = objective_state

    def _checkpoint_keys(self, state_dict: dict[str, Any]) -> set[str]:
        """What a checkpoint holds: the LoRA tensors, or (full fine-tuning) every trained network (``denoisers()``)
        whole, buffers included, less the parameters ``frozen_components`` keeps frozen (they reload from the base)."""
        # named_parameters() carries the names wrappers insert (FSDP1's _fsdp_wrapped_module., activation
        # checkpointing's _checkpoint_wrapped_module.); state dicts do not.
        trainable = {clean_name(n) for n, p in self.named_parameters() if p.requires_grad}
        if self.lora is not None:
            return trainable
        networks = {id(m) for m in self.adapter.denoisers().values()}
        prefixes = tuple(f"{clean_name(n)}." for n, m in self.named_modules() if id(m) in networks)
        frozen = {clean_name(n) for n, p in self.named_parameters() if not p.requires_grad and n.startswith(prefixes)}
        return trainable | {k for k in state_dict if k.startswith(prefixes) and k not in frozen}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._checkpoint_noise_seed = checkpoint.get(NOISE_SEED_KEY)
        self.nonfinite_guard.skipped = int(checkpoint.get(NONFINITE_KEY, 0))
        if self._trainer is None or self._trainer.state.fn == "fit":
            self.objective.load_checkpoint_state(checkpoint.get(OBJECTIVE_STATE_KEY))
        if self._trainer is not None and self._trainer.state.fn != "fit":  # a resume exports the LoRA again
            from ff_core.callbacks.checkpoint import check_lora_export

            check_lora_export(self._trainer.ckpt_path, checkpoint)  # the LoRA folder beside it is the same save
        self._check_optimizer_numbering(checkpoint)
        if "state_dict" not in checkpoint:
            # FSDP1, FSDP2 and DeepSpeed load the tensors themselves and drop "state_dict" before this hook: compare
            # the settings the checkpoint was written with instead.
            self._check_checkpoint_hparams(checkpoint.get("hyper_parameters") or {})
            return
        missing = self._checkpoint_keys(self.state_dict()) - set(checkpoint["state_dict"])
        if missing:
            raise KeyError(
                f"checkpoint lacks {len(missing)} tensor(s) this run trains, e.g. {sorted(missing)[0]!r}: "
                "was it written with a different model.lora setting?"
            )

    def _check_optimizer_numbering(self, checkpoint: dict[str, Any]) -> None:
        """Under FSDP2, Lightning maps a gathered checkpoint's optimizer state (keyed by parameter index) to parameter
        names by position among *all* the module's parameters, frozen ones included; FSDP2 writes it that way, but DDP
        and single-device runs number the optimizer's (trained) parameters only. With frozen parameters in the tree
        (a LoRA's base) the Adam state would go to other tensors: such a resume is refused."""
        from lightning.pytorch.strategies import ModelParallelStrategy

        if self._trainer is None or not isinstance(self._trainer.strategy, ModelParallelStrategy):
            return
        states = checkpoint.get("optimizer_states") or []
        saved = [i for state in states for group in state.get("param_groups", []) for i in group.get("params", [])]
        if not saved or not all(isinstance(i, int) for i in saved):  # a sharded folder: keyed by name
            return
        expected = [i for i, p in enumerate(self.parameters()) if p.requires_grad]
        if saved != expected:
            raise ConfigError("ckpt_path", "this checkpoint numbers its optimizer state as a DDP or single-device run "
                              "does (trained parameters only), and FSDP2 (ModelParallelStrategy) would map it by "
                              "position among all parameters, frozen ones included, giving the Adam state to the "
                              "wrong tensors: resume it under the strategy that wrote it (DDP or one device); FSDP2 "
                              "checkpoints resume under FSDP2, DDP and one device")  # fmt: skip

    def _check_checkpoint_hparams(self, hparams: dict[str, Any]) -> None:
        """Refuse resuming a checkpoint written with another adapter or another LoRA shape (``None``-ness, rank,
        alpha, targets; dropout may change) when the strategy leaves no state dict to compare keys with."""
        if "adapter" in hparams:
            try:
                other = get_adapter_class(hparams["adapter"])
            except KeyError:
                other = None
            if other is not self.adapter_cls:
                raise ConfigError("model.adapter", f"the checkpoint was written by adapter {hparams['adapter']!r}, "
                                  f"this run is {self.adapter_cls.name!r}")  # fmt: skip
        if "lora" not in hparams:
            return

        def shape(lora: Any) -> dict[str, Any] | None:
            if lora is None:
                return None
            values = asdict(lora) if is_dataclass(lora) else dict(lora)
            return {k: values.get(k, getattr(LoRAConfig, k)) for k in ("rank", "alpha", "target_modules")}

        if shape(hparams["lora"]) != shape(self.lora):
            raise ConfigError("model.lora", f"the checkpoint was written with model.lora {shape(hparams['lora'])}, "
                              f"this run has {shape(self.lora)}: resume with the same setting")  # fmt: skip

    # -- modes -------------------------------------------------------------------------------------------
    # Lightning (2.x) never calls train(): it keeps each module's mode, and restores the modes it saw before a
    # validation run. The trained networks would train in the eval mode from_pretrained left them in (no dropout),
    # so training sets the modes itself; Adapter.train keeps frozen components in eval mode. Generation
    # (validation/test/predict) runs after Lightning's on_*_model_eval hooks: everything in eval mode.
    def on_train_start(self) -> None:
        self.trainer.model.train()  # the strategy's wrapper (DDP, ...) around this module, as Lightning's hooks do
        self._run_noise_seed = self._resolve_noise_seed()
        self._preemption.start(self.trainer)

    # -- preemption (ff_core.preemption): SIGTERM sets a flag; the next optimiser-step boundary saves and stops ----
    def on_fit_start(self) -> None:
        self._preemption.install(self.trainer)  # before Lightning registers its signal handlers

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._preemption.check(self.trainer)  # after every callback (the checkpoint callbacks too) saw the batch

    def on_validation_model_train(self) -> None:
        # Back to training after a validation inside fit (sanity check included); a lone `ff validate` stays eval.
        self.trainer.model.train(self.trainer.state.fn == TrainerFn.FITTING)

    # -- training noise ----------------------------------------------------------------------------------
    def _resolve_noise_seed(self) -> int:
        """``model.noise_seed``, else the checkpoint's (a resumed run continues its noise), else the run's seed."""
        saved = self._checkpoint_noise_seed
        if self.noise_seed is not None:
            if saved is not None and saved != self.noise_seed:
                raise ValueError(
                    f"model.noise_seed={self.noise_seed}, but the checkpoint resumed from was trained with noise seed "
                    f"{saved}: a resumed run must draw the noise of the run it continues (set it to {saved} or drop it)"
                )
            return self.noise_seed
        if saved is not None:
            return saved
        # Lightning's seed_everything (LightningCLI's `seed_everything:`) exports the run's seed here.
        return int(os.environ.get("PL_GLOBAL_SEED", 0))

    @property
    def data_parallel(self) -> DataParallelCoords:
        """This rank's data-parallel coordinates (rank, size, process group): what shards the data and seeds the
        noise; the ranks of one context-parallel group share them."""
        return DataParallelCoords.from_trainer(self.trainer)

    @property
    def context_parallel(self) -> tuple[int, int, Any]:
        """``(rank, size, process group)`` of this rank's context-parallel group (``(0, 1, None)`` without one): the
        ranks that hold the same samples and split their tokens (ff_core.strategies.ContextParallelStrategy)."""
        return getattr(self.trainer.strategy, "context_parallel_group", (0, 1, None))

    def noise_generator(self, batch_idx: int) -> tuple[torch.Generator, int]:
        """The CPU generator of this micro-batch's training noise, and its seed (see :func:`micro_batch_seed`)."""
        if self._run_noise_seed is None:
            self._run_noise_seed = self._resolve_noise_seed()
        trainer = self.trainer
        rank = self.data_parallel.rank
        seed = micro_batch_seed(self._run_noise_seed, rank, trainer.global_step, self._micro_batch(batch_idx))
        return torch.Generator().manual_seed(seed), seed

    def expert_generator(self, batch_idx: int) -> torch.Generator:
        """The CPU generator that picks this micro-batch's expert, seeded alike on every data-parallel rank (run
        noise seed, step, micro-batch: :func:`micro_batch_seed` without the rank)."""
        seed = derive_seed(self._run_noise_seed, self.trainer.global_step, self._micro_batch(batch_idx))
        return torch.Generator().manual_seed(seed)

    def _micro_batch(self, batch_idx: int) -> int:
        """The micro-batch's place in its accumulation window: Lightning steps the optimiser when ``batch_idx + 1`` is
        a multiple of ``accumulate_grad_batches`` (or at the end of an epoch)."""
        return batch_idx % self.trainer.accumulate_grad_batches

    # -- steps -------------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any] | None:
        generator, seed = self.noise_generator(batch_idx)
        self.nonfinite_guard.observe_batch(batch.get("index", ()))  # named if the step turns out non-finite
        if not self.automatic_optimization:  # the objective runs its own optimiser steps (GRPO)
            self.objective.training_step(self, batch, generator)
            return None
        shared = {"expert_generator": self.expert_generator(batch_idx)} if self._shared_expert else {}
        out = self.objective.training_loss(self.adapter, batch, generator, **shared)
        self.nonfinite_guard.observe_loss(out.loss)
        bs = len(batch["index"])
        self.log("train/loss", out.loss.detach(), prog_bar=True, batch_size=bs)
        for name, value in out.metrics.items():
            self.log(f"train/{name}", value, batch_size=bs)
        # Lightning back-propagates "loss"; callbacks get the rest (SampleLog records the noise drawn).
        return {"loss": out.loss, "sigma": out.sigma, "noise_seed": seed}

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """After the backward, before the step (automatic optimisation; GRPO checks in its own ``update``): a
        non-finite loss or gradient on any rank stops the run or skips the step (``model.nonfinite``)."""
        if self.automatic_optimization:
            self.nonfinite_guard.check(self, optimizer)
            self.log_nonfinite()

    def log_nonfinite(self) -> None:
        """``train/nonfinite_skipped`` (the steps skipped so far) every step, under ``model.nonfinite: skip``."""
        if self.nonfinite_guard.policy == "skip":
            self.log("train/nonfinite_skipped", float(self.nonfinite_guard.skipped))

    # -- optimisation --------------------------------------------------------------------------------------
    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        if not params:
            raise RuntimeError("nothing to train: every parameter is frozen")
        optimizer = (
            self.optimizer_factory(params) if self.optimizer_factory else torch.optim.AdamW(params, lr=1e-4)
        )
        if self.lr_scheduler_factory is None:
            return optimizer
        scheduler = self.lr_scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _keep_trained(module: FlowModule, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``FlowModule.state_dict()`` holds what a checkpoint holds (:meth:`FlowModule._checkpoint_keys`): every strategy
    builds its checkpoint from it (torch.distributed.checkpoint's ``get_model_state_dict`` under FSDP2), and a sharded
    FSDP2 checkpoint is loaded into the keys it returns, so a frozen LoRA base it held would be looked for in the
    checkpoint. Only a top-level state dict is filtered: as a submodule (inside FSDP1's root unit) names carry the
    wrapper's prefix, and ``on_save_checkpoint`` filters the result."""
    if prefix or module.adapter is None:
        return
    keep = module._checkpoint_keys(state_dict)
    for key in [k for k in state_dict if k not in keep]:
        del state_dict[key]


def micro_batch_seed(seed: int, dp_rank: int, step: int, micro_batch: int) -> int:
    """The seed of one micro-batch's training noise: a function of these four numbers only.

    Distinct per data-parallel rank (the coordinate that shards the data, so the ranks of one context-parallel group
    share it), optimiser step and micro-batch of an accumulation window; a resumed run recomputes exactly the seeds
    of the uninterrupted run. Seeding the global RNG instead gives every rank the same noise (seed_everything seeds
    all ranks alike) and a resumed run different noise.

    Args:
        seed: the run's noise seed (``model.noise_seed``, else ``seed_everything``).
        dp_rank: data-parallel rank.
        step: optimiser steps taken before this micro-batch (``trainer.global_step``).
        micro_batch: index of the micro-batch in its gradient-accumulation window.
    """
    return derive_seed(seed, dp_rank, step, micro_batch)


def check_components(adapter_cls: type[Adapter], frozen: list[str], weights: dict[str, float] | None,
                     per_component: dict[str, Any] | None = None) -> None:  # fmt: skip
    """Before any weight loads: ``model.frozen_components``, the objective's ``component_weights`` and any
    per-component mapping of ``per_component`` (config key -> value: ``model.sampling.guidance_scale``) name the
    adapter's latent components (:attr:`~ff_core.adapter.Adapter.latent_components`; undeclared: checked once the
    model runs), the weights the loss will use (the objective's, else the adapter's ``default_component_weights``
    minus the frozen components) give at least one kept component a weight > 0, an adapter that declares no
    branches (:meth:`~ff_core.adapter.Adapter.component_parameters` not overridden) freezes none, and freezing every
    component (nothing would train) is refused. One
    :class:`ConfigError` naming the key and the valid names."""
    names = getattr(adapter_cls, "latent_components", None)
    if frozen and getattr(adapter_cls, "component_parameters", None) is Adapter.component_parameters:
        raise ConfigError("model.frozen_components", f"adapter {adapter_cls.name!r} does not declare which "
                          "parameters belong to which latent component, so none can be frozen")  # fmt: skip
    if names is None:
        return
    for name in frozen:
        if name not in names:
            raise ConfigError("model.frozen_components", f"{name!r} is not a latent component of "
                              f"{adapter_cls.name}; they are {list(names)}")  # fmt: skip
    if frozen and set(names) <= set(frozen):  # every branch frozen: configure_optimizers would find nothing to train
        raise ConfigError("model.frozen_components", f"{sorted(frozen)} freezes every latent component of "
                          f"{adapter_cls.name} ({list(names)}): nothing would train; leave one out")  # fmt: skip
    mappings = {COMPONENT_WEIGHTS_KEY: weights, **(per_component or {})}
    for key, value in mappings.items():
        if isinstance(value, dict) and sorted(value) != sorted(names):
            raise ConfigError(key, f"names {sorted(value)}; {adapter_cls.name}'s latent components are {list(names)} "
                              "(name each once)")  # fmt: skip
    # The loss is sum_k w_k m_k over the components kept (ff_core.sampling.component_mean). Config weights are
    # honoured as written, frozen components included (checked where the objective is built); unset, the adapter's
    # default minus the frozen components, which must leave a term.
    if weights is None and getattr(adapter_cls, "default_component_weights", None) is not None:
        dropped = set(frozen)
        kept = {k: w for k, w in adapter_cls.default_component_weights.items() if k not in dropped}
        check_kept_weights(kept, [n for n in names if n not in dropped], sorted(dropped),
                           key=f"{COMPONENT_WEIGHTS_KEY} (unset: {adapter_cls.name}'s default_component_weights)")
