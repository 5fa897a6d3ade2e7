"""LoRA through peft: the recipe's ``model.lora`` settings, wrapping every trained network, and the state dicts and
configs an export writes (gathered whole under FSDP2). ``model.frozen_components`` keeps LoRA off the frozen
branches."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ff_core.errors import ConfigError
from ff_core.sharding import clean_name, full_parameters

if TYPE_CHECKING:
    from peft import LoraConfig

    from ff_core.adapter import Adapter

@dataclass
class LoRAConfig:
    """Low-rank adaptation of the denoiser through peft.

    Attributes:
        rank: LoRA rank ``r``.
        alpha: scaling numerator (``lora_alpha``); the update is scaled by ``alpha / rank``.
        target_modules: module names to wrap; ``None`` uses the adapter's ``default_lora_targets``.
        dropout: dropout on the LoRA branch.
    """

    rank: int = 16
    alpha: float = 16.0
    target_modules: list[str] | None = None
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"model.lora.rank must be >= 1, got {self.rank}")


def frozen_parameters(adapter: Adapter, components: list[str]) -> dict[str, set[str]]:
    """Per trained network (``adapter.denoisers()``), the names of the parameters of the frozen latent components'
    branches (:meth:`~ff_core.adapter.Adapter.component_parameters`); empty sets without any."""
    frozen: dict[str, set[str]] = {name: set() for name in adapter.denoisers()}
    for component in components:
        try:
            declared = adapter.component_parameters(component)
        except ValueError as exc:
            raise ConfigError("model.frozen_components", str(exc)) from None
        for network, names in declared.items():
            frozen[network].update(names)
    return frozen


def _frozen_modules(network: torch.nn.Module, frozen: set[str]) -> list[str]:
    """The modules of ``network`` whose own parameters are all ``frozen`` (no LoRA wraps them). Own parameters only:
    peft wraps layers that hold their weights (``Linear``, ``Conv``, ...), never a container of them."""
    out = []
    for name, module in network.named_modules():
        names = [f"{name}.{n}" if name else n for n, _ in module.named_parameters(recurse=False)]
        if names and all(n in frozen for n in names):
            out.append(name)
    return out


def apply_lora(adapter: Adapter, cfg: LoRAConfig, frozen: dict[str, set[str]] | None = None) -> None:
    """Wrap the target modules of every trained network (``adapter.denoisers()``) with peft LoRA layers, one adapter
    per network with the same settings; only those layers train. ``frozen`` (:func:`frozen_parameters`): per network,
    parameters of frozen branches; a module whose parameters are all frozen gets no LoRA (peft ``exclude_modules``)."""
    from peft import LoraConfig, inject_adapter_in_model

    targets = cfg.target_modules or list(adapter.default_lora_targets)
    if not targets:
        raise ValueError(f"model.lora.target_modules: adapter {adapter.name!r} has no defaults; name the modules")
    for name, network in adapter.denoisers().items():
        excluded = _frozen_modules(network, (frozen or {}).get(name, set()))
        # A regex peft full-matches: a list entry would also exclude every module whose name merely ends with it.
        excluded = "|".join(re.escape(m) for m in excluded) if excluded else None
        config = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                            exclude_modules=excluded, init_lora_weights="gaussian")  # fmt: skip
        if hasattr(network, "add_adapter"):  # diffusers ModelMixin: keeps peft bookkeeping for load/save
            network.add_adapter(config)
        else:
            inject_adapter_in_model(config, network)
            network.peft_config = {"default": config}
        for name, p in network.named_parameters():
            p.requires_grad_("lora_" in name)


def lora_config(adapter: Adapter) -> LoraConfig:
    """The peft ``LoraConfig`` :func:`apply_lora` gave the denoiser (rank, alpha, targets): what an export records."""
    return adapter.denoiser.peft_config["default"]


def lora_state_dict(adapter: Adapter) -> dict[str, torch.Tensor]:
    """peft's state dict of the denoiser's LoRA layers (keys without the adapter name), whole on every rank (see
    :func:`lora_state_dicts`)."""
    return lora_state_dicts(adapter)[next(iter(adapter.denoisers()))]


def lora_configs(adapter: Adapter) -> dict[str, LoraConfig]:
    """:func:`lora_config` of every trained network, keyed as ``adapter.denoisers()``."""
    return {name: network.peft_config["default"] for name, network in adapter.denoisers().items()}


def lora_state_dicts(adapter: Adapter) -> dict[str, dict[str, torch.Tensor]]:
    """peft's state dict of every trained network's LoRA layers, keyed as ``adapter.denoisers()`` (what
    :meth:`~ff_core.adapter.Adapter.save_loras` writes). The tensors are whole: FSDP2 shards are all-gathered, so
    every rank must call it; under FSDP1 call it inside :func:`ff_core.sharding.summoned`."""
    from peft.utils import get_peft_model_state_dict

    out = {}
    for name, network in adapter.denoisers().items():
        # peft finds its layers by named_modules() names, wrapper components (FSDP1, activation checkpointing)
        # included: it selects from the parameters under those names; the export keys are the plain ones.
        state = get_peft_model_state_dict(network, state_dict=full_parameters(network, lambda n: "lora_" in n))
        out[name] = {clean_name(k): v for k, v in state.items()}
    return out
