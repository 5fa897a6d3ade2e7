"""Lightning's DeepSpeed strategy, made to run on the CPU as well as on CUDA GPUs.

DeepSpeed (0.19) trains ZeRO-2 and ZeRO-3 on CPU processes over gloo, but Lightning's stock ``DeepSpeedStrategy``
(2.6) stops three times before it gets there: ``setup_environment`` refuses any accelerator but CUDA ("only supported
on CUDA GPUs"), ``setup_distributed`` requires device indices equal to the local ranks (a CPU device has no index),
and ``deepspeed.initialize`` is handed ``root_device.index`` as its ``device_rank`` (``None`` on the CPU, which
DeepSpeed compares with 0). :class:`DeepSpeedStrategy` changes exactly those three on the CPU and nothing else on a
GPU, so one recipe (``configs/sd3/sft_tiny_deepspeed.yaml``) runs on both; on both it sizes DeepSpeed's logging batch
from the data module instead of building the training loader before the model exists (which fails with ff's data
module, whose loader needs the loaded adapter). It overrides private methods of Lightning's strategy
(``_setup_model_and_optimizer``, ``_auto_select_batch_size``), so Lightning is pinned (``pyproject.toml``) and
tests/test_deepspeed.py runs it under 2 gloo processes.

:class:`ContextParallelStrategy` is Lightning's ``ModelParallelStrategy`` with a context-parallel dimension in place
of the tensor-parallel one: ``FlowModule.configure_model`` splits each sample's tokens over it with diffusers' context
parallelism (:mod:`ff_core.context_parallel`) and shards the trained networks with FSDP2 over every rank.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeedStrategy


class DeepSpeedStrategy(LightningDeepSpeedStrategy):
    """``lightning.pytorch.strategies.DeepSpeedStrategy`` that also runs with ``trainer.accelerator: cpu`` (gloo);
    every argument is Lightning's. Use it as ``trainer.strategy: {class_path: ff_core.strategies.DeepSpeedStrategy,
    init_args: {stage: 2, exclude_frozen_parameters: true}}``."""

    @property
    def _on_cpu(self) -> bool:
        return isinstance(self.accelerator, CPUAccelerator)

    @property
    def _device_rank(self) -> int:
        """What DeepSpeed's ``device_rank`` must be: the CUDA device's index, or the local rank on the CPU."""
        index = self.root_device.index
        return self.local_rank if index is None else index

    def setup_environment(self) -> None:
        if not self._on_cpu:
            return super().setup_environment()
        DDPStrategy.setup_environment(self)  # Lightning's, less the CUDA-only check

    def setup_distributed(self) -> None:
        if not self._on_cpu:
            return super().setup_distributed()
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()  # Lightning's, less the device-index check (a CPU device has none)
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """Lightning's, without ``deepspeed.zero.Init``: under ZeRO-3 Lightning runs ``configure_model`` inside it,
        which partitions every module built there, the text encoders and VAE included, though ff runs them outside
        the engine (encoding conditions and targets, decoding samples) and keeps them out of the module tree
        (``Adapter.detach_frozen``). Here ``configure_model`` builds whole modules and ``deepspeed.initialize``
        partitions the engine's module only: the trained networks (with a LoRA's frozen base, or a full fine-tuning's
        reference copy, which sit in the tree). Each rank holds the whole model once while it loads, as under DDP."""
        self._init_config_if_needed()
        yield

    def _auto_select_batch_size(self) -> int:
        """DeepSpeed's ``train_micro_batch_size_per_gpu`` (its throughput log only) when the config sets none: the data
        module's ``per_device_batch_size``. Lightning's builds the training loader for it, inside the sharded-model
        context, before ``configure_model`` has loaded the adapter the loader needs (on a GPU as on the CPU)."""
        datamodule = getattr(self.lightning_module.trainer, "datamodule", None)
        return int(getattr(datamodule, "per_device_batch_size", None) or 1)

    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> tuple[Any, Any]:
        """Lightning's, with ``device_rank`` the local rank on the CPU (``root_device.index`` is ``None`` there)."""
        import deepspeed

        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank), config=self.config, model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad], optimizer=optimizer,
            lr_scheduler=lr_scheduler, dist_init_required=False,
        )  # fmt: skip
        return engine, deepspeed_optimizer


class ContextParallelStrategy(ModelParallelStrategy):
    """FSDP2 over data parallel x context parallel (docs/scaling.md, "Sequence parallel").

    The ``world_size`` ranks form a ``(data_parallel, ring, ulysses)`` device mesh (ring size 1; the names diffusers'
    ``ContextParallelConfig`` reads), the ranks of one context-parallel group adjacent (one node). Data are sharded
    by the data-parallel rank only (``distributed_sampler_kwargs``, as Lightning's), so the ``context_parallel_size``
    ranks of a group get the same batch, timesteps and noise, and each trained network's forward splits every
    sample's tokens over them (diffusers' Ulysses attention: :mod:`ff_core.context_parallel`). FSDP2 shards the
    trained networks over all ranks (:attr:`shard_mesh`); each rank's gradient holds its tokens' share, so the
    reduction sums over a group and averages over data parallel (:attr:`gradient_divide_factor`).

    Args:
        context_parallel_size: ranks that split one sample's tokens (2 or more; a divisor of the world size).
        data_parallel_size: ranks that take different samples: ``"auto"`` is ``world_size / context_parallel_size``.
        save_distributed_checkpoint, process_group_backend, timeout: as Lightning's ``ModelParallelStrategy``.
    """

    def __init__(self, context_parallel_size: int = 2, data_parallel_size: int | Literal["auto"] = "auto",
                 save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout) -> None:  # fmt: skip
        from ff_core.context_parallel import STRATEGY_KEY
        from ff_core.errors import ConfigError

        if not isinstance(context_parallel_size, int) or context_parallel_size < 2:
            raise ConfigError(STRATEGY_KEY, f"{context_parallel_size!r}: "
                              "2 or more ranks split each sample (1: ModelParallelStrategy)")  # fmt: skip
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)  # fmt: skip
        self.context_parallel_size = context_parallel_size
        self._shard_mesh: Any = None

    def setup_environment(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from ff_core.errors import ConfigError

        self._setup_distributed()
        cp, world = self.context_parallel_size, self.world_size
        dp = world // cp if self._data_parallel_size == "auto" else int(self._data_parallel_size)
        if dp * cp != world:
            raise ConfigError("trainer.strategy.init_args", f"data_parallel_size {dp} x context_parallel_size {cp} "
                              f"must equal the {world} processes (devices x num_nodes)")  # fmt: skip
        self._data_parallel_size = dp
        self._device_mesh = init_device_mesh(self.root_device.type, (dp, 1, cp),
                                             mesh_dim_names=("data_parallel", "ring", "ulysses"))  # fmt: skip
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def data_parallel_size(self) -> int:
        return self.device_mesh["data_parallel"].size()

    @property
    def context_parallel_mesh(self) -> Any:
        """This rank's context-parallel group: the ``(ring, ulysses)`` mesh diffusers' ``ContextParallelConfig``
        takes."""
        return self.device_mesh["ring", "ulysses"]

    @property
    def context_parallel_group(self) -> tuple[int, int, Any]:
        """``(rank in the group, group size, process group)`` of this rank's context-parallel group."""
        mesh = self.device_mesh["ulysses"]
        return mesh.get_local_rank(), mesh.size(), mesh.get_group()

    @property
    def shard_mesh(self) -> Any:
        """Every rank, flattened (1-D): what FSDP2 shards the trained networks over."""
        if self._shard_mesh is None:
            self._shard_mesh = self.device_mesh["data_parallel", "ring", "ulysses"]._flatten("data_context")
        return self._shard_mesh

    @property
    def gradient_divide_factor(self) -> float:
        """What FSDP2 divides the summed gradients by: the data-parallel size (a group's ranks hold parts of one
        gradient, summed; data-parallel replicas are averaged)."""
        return float(self.data_parallel_size)
