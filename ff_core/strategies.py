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
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy
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
