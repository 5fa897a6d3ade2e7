"""Lightning checkpoints plus, when training a LoRA, a diffusers-loadable LoRA folder beside each one.

``epoch=0-step=20.ckpt`` gets ``epoch=0-step=20.lora/pytorch_lora_weights.safetensors``, loadable with the
family's diffusers pipeline (``pipe.load_lora_weights(folder)``) at the trained scale ``alpha / rank``: the file's
``lora_adapter_metadata`` holds the peft config the run applied. An adapter with several trained networks
(``Adapter.denoisers()``) gets one file per network in the same folder (``Adapter.lora_file``: Wan2.2's second expert
is ``pytorch_lora_weights_transformer_2.safetensors``). Both are published atomically.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from ff_core.module import lora_configs, lora_state_dicts
from ff_core.sharding import summoned


def lora_dir_for(checkpoint_path: str | Path) -> Path:
    path = Path(checkpoint_path)
    return path.with_name(path.stem + ".lora")


class FlowCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that also exports the LoRA of a FlowModule trained with ``model.lora``.

    Accepts every argument of :class:`lightning.pytorch.callbacks.ModelCheckpoint`.
    """

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        module = trainer.lightning_module
        if getattr(module, "lora", None) is None or module.adapter is None:
            return
        with summoned(trainer.strategy.model):  # FSDP1: full parameters; FSDP2's shards are gathered per tensor
            states = lora_state_dicts(module.adapter)  # every rank takes part in the gathering
        if trainer.is_global_zero:  # one file per trained network (Adapter.lora_file)
            module.adapter.save_loras(lora_dir_for(filepath), states, lora_configs(module.adapter))
        trainer.strategy.barrier("ff_lora_export")

    def _remove_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        super()._remove_checkpoint(trainer, filepath)
        if trainer.is_global_zero:
            shutil.rmtree(lora_dir_for(filepath), ignore_errors=True)
