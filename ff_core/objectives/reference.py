"""The frozen reference policy of preference objectives (offline Diffusion-DPO).

Diffusion-DPO (Wallace et al. 2023, sec. 4) measures the policy against the model it starts from. ff has two kinds
of reference, chosen by what trains:

* **LoRA** (``model.lora`` set): the reference is the base the LoRA was added to. While :meth:`ReferenceModel.active`
  is entered, every peft LoRA layer of the adapter is switched off (peft's ``BaseTunerLayer.enable_adapters(False)``,
  what diffusers' ``ModelMixin.disable_adapters`` calls) and switched back on when it is left, even on an exception.
  No copy, no memory.
* **Full fine-tuning** (``model.lora: null``): a frozen deep copy of every trained network, made once in
  ``FlowModule.configure_model``, before any step changes a weight. While active, the copies stand in for the trained
  networks inside the adapter (the attributes are swapped and restored), so the family's own ``velocity`` runs them
  and objectives never branch on a family. The copies live in ``FlowModule.objective_modules``: they follow the module
  to its device, stay in eval mode, and are never checkpointed (a resumed run rebuilds them from the base weights,
  which is what they were). With ``offload=True`` they stay in host memory instead and accelerate's ``cpu_offload``
  streams their weights to the device one layer at a time for each forward: one extra copy of the denoiser in CPU
  memory rather than device memory, at the cost of the transfers.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from ff_core.adapter import Adapter


class ReferenceModel(nn.Module):
    """The frozen reference policy of an adapter (see the module docstring).

    Args:
        adapter: the loaded adapter, its trained parameters already chosen (LoRA applied, or the denoiser unfrozen).
        lora: the adapter trains peft LoRA layers: the reference is the base with them disabled.
        offload: full fine-tuning only: keep the reference copy in CPU memory, streamed to the device per forward.
    """

    def __init__(self, adapter: Adapter, lora: bool, offload: bool = False) -> None:
        super().__init__()
        self.lora, self.offload = lora, offload
        self.paths: list[list[str]] = []  # per copy, every attribute path of its network inside the adapter
        if lora:
            _lora_layers(adapter)  # fails now, not at the first step, when there are none
            self.networks = nn.ModuleList()
            return
        paths: dict[int, list[str]] = {}
        for name, module in adapter.named_modules(remove_duplicate=False):
            paths.setdefault(id(module), []).append(name)
        trained = adapter.trained_networks()
        if not trained:
            raise ValueError(f"{adapter.name}: no trained network to copy as the reference (every parameter is frozen)")
        copies = []
        for network in trained:
            copies.append(copy.deepcopy(network).requires_grad_(False).eval())
            self.paths.append(paths[id(network)])
        if offload:
            # A plain list is not registered: FlowModule's device moves and state dict never see these copies.
            self.networks, self._offloaded, self._hooked = nn.ModuleList(), copies, False
        else:
            self.networks = nn.ModuleList(copies)

    def train(self, mode: bool = True) -> ReferenceModel:
        """Always eval mode: the reference is a fixed function (no dropout), whatever mode training sets."""
        return super().train(False)

    def copies(self) -> list[nn.Module]:
        """The frozen copies (full fine-tuning), in ``adapter.trained_networks()`` order; empty for LoRA."""
        return list(self._offloaded) if self.offload and not self.lora else list(self.networks)

    @contextmanager
    def active(self, adapter: Adapter) -> Iterator[None]:
        """While entered, ``adapter``'s stage methods compute with the reference; restored on exit, even on errors.

        Enter it under ``torch.no_grad()``: the reference never trains.
        """
        if self.lora:
            with lora_disabled(adapter):
                yield
            return
        copies = self.copies()
        if self.offload and not self._hooked:
            self._offload_to(next(p.device for n in adapter.trained_networks() for p in n.parameters()))
        swapped: list[tuple[nn.Module, str, nn.Module]] = []
        try:
            for network, paths in zip(copies, self.paths):
                for path in paths:
                    parent, _, leaf = path.rpartition(".")
                    owner = adapter.get_submodule(parent)
                    swapped.append((owner, leaf, getattr(owner, leaf)))
                    setattr(owner, leaf, network)
            yield
        finally:
            for owner, leaf, original in reversed(swapped):
                setattr(owner, leaf, original)

    def _offload_to(self, device) -> None:
        """accelerate's sequential CPU offload: weights stay on the CPU; each layer's reach ``device`` per forward."""
        from accelerate import cpu_offload

        for network in self._offloaded:
            cpu_offload(network, execution_device=device)
        self._hooked = True


def _lora_layers(module: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise ValueError("the LoRA reference needs peft LoRA layers in the adapter; it has none (model.lora unset?)")
    return layers


@contextmanager
def lora_disabled(module: nn.Module) -> Iterator[None]:
    """Every peft LoRA layer in ``module`` off while entered (the base model computes), restored on exit even when
    the body raises.

    peft's ``enable_adapters`` also sets the adapter weights' ``requires_grad`` (off when disabling, on when enabling);
    the flags found on entry are put back, so a frozen LoRA stays frozen and a trained one keeps training.
    """
    layers = _lora_layers(module)
    was_disabled = [layer.disable_adapters for layer in layers]
    grads = [(p, p.requires_grad) for layer in layers for p in layer.parameters()]
    try:
        for layer in layers:
            layer.enable_adapters(False)
        yield
    finally:
        for layer, disabled in zip(layers, was_disabled):
            layer.enable_adapters(not disabled)
        for p, requires_grad in grads:
            p.requires_grad_(requires_grad)
