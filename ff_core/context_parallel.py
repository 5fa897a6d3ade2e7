"""Context parallelism: each sample's tokens split over the ranks of a group (docs/scaling.md, "Sequence parallel").

Under :class:`~ff_core.strategies.ContextParallelStrategy`, ``FlowModule.configure_model`` hands every trained network
(and a full fine-tuning's reference copy) to diffusers' context parallelism: the network's context-parallel plan
(:meth:`~ff_core.adapter.Adapter.context_parallel_plan`, by default the diffusers class's ``_cp_plan``) names the
inputs split over the group's ranks and the outputs gathered back, and its attention processors run attention over
the group (below). Every rank of a group gets the same
batch, timesteps and noise (the data are sharded by the data-parallel rank), runs the network on its slice of the
tokens, and receives the whole output: losses, samplers and rewards run unchanged and alike on the group's ranks.

Attention is Ulysses attention (each rank holds its slice of the tokens for all heads; an all-to-all gives it all
the tokens for its share of the heads, then back), in diffusers' "anything" variant: a token or head count the group
size does not divide is split unevenly (``torch.tensor_split``), so frame counts and canvases need not be chosen
around the mesh. diffusers 0.42 has no backward for that variant (``TemplatedUlyssesAnythingAttention.backward``
raises); :class:`UlyssesAnythingAttention` is the same computation built from differentiable all-to-alls, and
:func:`enable` installs it in diffusers' dispatcher in its place. (Ring attention is not offered: diffusers' ring
needs equal slices, and its uneven variant has no backward either.)

Gradients: the gathered output's backward hands each rank the gradient of its own slice, and the attention
collectives carry the rest, so each rank's parameter gradients are its tokens' share and the group's sum is the
whole gradient; FSDP2 sums over all ranks and divides by the data-parallel size
(:func:`~ff_core.sharding.gradient_divide_factor`).

What diffusers lacks and this module adds: that backward; a per-head attention mask cut to the rank's heads
(LTX-2's processors pass one); the uneven output gather on gloo (:func:`all_gather_uneven`); resolving the mesh on a
CPU process (diffusers divides by the accelerator count, 0 on the CPU; ff hands it the strategy's own mesh and
device); and refusing, before weights load, a checkpoint whose denoiser has no plan.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ff_core.errors import ConfigError

if TYPE_CHECKING:
    from ff_core.adapter import Adapter

STRATEGY_KEY = "trainer.strategy.init_args.context_parallel_size"


def denoiser_classes(adapter_cls: type[Adapter], pretrained: str | os.PathLike) -> dict[str, type]:
    """The classes of the checkpoint's trained networks, by pipeline component name, read from its
    ``model_index.json`` without loading a weight: the adapter's :attr:`~ff_core.adapter.Adapter.lora_prefix`
    component and any ``<prefix>_2`` (a second expert). Empty when the checkpoint names none (not a diffusers
    pipeline folder): the plan is then checked once the networks are loaded."""
    from ff_core.pretrained import read_config

    try:
        index = read_config(pretrained, "model_index.json")
    except (OSError, ValueError):  # a folder without a pipeline index: checked after loading
        return {}
    out = {}
    for name in (adapter_cls.lora_prefix, f"{adapter_cls.lora_prefix}_2"):
        entry = index.get(name)
        if not isinstance(entry, (list, tuple)) or len(entry) != 2 or entry[0] is None:
            continue
        try:
            out[name] = getattr(importlib.import_module(entry[0]), entry[1])
        except (ImportError, AttributeError):
            continue
    return out


def check_heads(pretrained: str | os.PathLike, components: list[str], size: int) -> None:
    """Refuse a group size Ulysses attention cannot spread a network's heads over: each rank takes ``ceil(h / size)``
    heads, the last one padded, and diffusers requires the padding to be smaller than a share (``h = 5`` over 4
    ranks is not; 3 over 2 is). Reads every ``*num_attention_heads`` entry of each component's ``config.json``."""
    from ff_core.pretrained import read_config

    for name in components:
        try:
            config = read_config(pretrained, "config.json", subfolder=name)
        except (OSError, ValueError):
            continue
        for key, heads in config.items():
            if not key.endswith("num_attention_heads") or not isinstance(heads, int):
                continue
            share = -(-heads // size)
            if (-heads) % size >= share:
                raise ConfigError(STRATEGY_KEY, f"{size}: {name}'s {heads} attention heads ({key}) cannot be spread "
                                  f"over {size} ranks ({share} each, the last padded by {(-heads) % size}); use a "
                                  f"size that divides {heads}")  # fmt: skip


def check_plans(adapter_cls: type[Adapter], classes: dict[str, type], size: int) -> None:
    """Refuse a trained network without a context-parallel plan, naming the strategy key and the class."""
    for name, cls in classes.items():
        if adapter_cls.context_parallel_plan(cls) is None:
            raise ConfigError(STRATEGY_KEY, f"{size}: {adapter_cls.name}'s {name} ({cls.__name__}) has no "
                              "context-parallel plan (diffusers' _cp_plan; Adapter.context_parallel_plan), so its "
                              "tokens cannot be split over ranks; use ModelParallelStrategy or DDP")  # fmt: skip


def enable(network: nn.Module, plan: dict[str, Any], strategy: Any) -> None:
    """Split ``network``'s tokens over this rank's context-parallel group (diffusers' ``enable_parallelism``), with
    the mesh and device of ``strategy`` (a :class:`~ff_core.strategies.ContextParallelStrategy`).

    Call it after a LoRA is injected (the plan's hooks sit on the modules the LoRA wraps) and before FSDP2 shards the
    network; a copy of the network (a reference policy) is enabled on its own: diffusers' hooks replace ``forward``
    with closures over the module they were registered on, which a deep copy would still call.
    """
    from diffusers.hooks import context_parallel as hooks
    from diffusers.models import attention_dispatch
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    if attention_dispatch.TemplatedUlyssesAnythingAttention.__module__ == attention_dispatch.__name__:
        attention_dispatch.TemplatedUlyssesAnythingAttention = UlyssesAnythingAttention  # same forward, differentiable
    if hooks._all_gather_anything.__module__ == hooks.__name__:
        hooks._all_gather_anything = all_gather_uneven  # gloo all-gathers equal sizes only; correct on NCCL too
    config = ContextParallelConfig(ulysses_degree=strategy.context_parallel_size, ulysses_anything=True,
                                   mesh=strategy.context_parallel_mesh)  # fmt: skip

    def resolve(config: ContextParallelConfig) -> ParallelConfig:
        # diffusers' ModelMixin._resolve_parallel_config, with the strategy's device (it divides the rank by the
        # accelerator count, which is 0 on the CPU)
        parallel = ParallelConfig(context_parallel_config=config)
        parallel.setup(strategy.global_rank, strategy.world_size, strategy.root_device, mesh=config.mesh)
        network._parallel_config = parallel
        return parallel

    network._resolve_parallel_config = resolve  # an instance attribute: shadows the method for this call only
    try:
        network.enable_parallelism(config=config, cp_plan=plan)
    finally:
        del network._resolve_parallel_config


def enable_networks(adapter: Adapter, copies: list[nn.Module], strategy: Any) -> None:
    """:func:`enable` on every trained network (``Adapter.denoisers()``) and on the frozen ``copies`` of them (a full
    fine-tuning's reference policy, in ``trained_networks()`` order), each with its adapter's plan; refused (naming the
    key) for a network without one."""
    networks = adapter.denoisers()
    check_plans(type(adapter), {name: type(network) for name, network in networks.items()},
                strategy.context_parallel_size)  # fmt: skip
    plans = {id(network): type(adapter).context_parallel_plan(network) for network in networks.values()}
    for network in networks.values():
        enable(network, plans[id(network)], strategy)
    for network, copy in zip(adapter.trained_networks(), copies):
        enable(copy, plans[id(network)], strategy)


class _SeqToHeads(torch.autograd.Function):
    """``(B, S_local, H, D) -> (B, S, H_local, D)``: the group's all-to-all of Ulysses attention (uneven slices and
    head shares allowed); its backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        from diffusers.models.attention_dispatch import all_to_all_single_any_qkv_async, ulysses_anything_metadata

        ctx.group, ctx.meta = group, ulysses_anything_metadata(x)
        return all_to_all_single_any_qkv_async(x, group)()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        from diffusers.models.attention_dispatch import all_to_all_single_any_o_async

        return all_to_all_single_any_o_async(grad.contiguous(), ctx.group, **ctx.meta)(), None


class _HeadsToSeq(torch.autograd.Function):
    """``(B, S, H_local, D) -> (B, S_local, H, D)``: the inverse of :class:`_SeqToHeads` for a tensor whose slice had
    ``meta`` (heads, local length)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, meta: dict[str, int]) -> Tensor:
        from diffusers.models.attention_dispatch import all_to_all_single_any_o_async

        ctx.group = group
        return all_to_all_single_any_o_async(x, group, **meta)()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        from diffusers.models.attention_dispatch import all_to_all_single_any_qkv_async

        return all_to_all_single_any_qkv_async(grad.contiguous(), ctx.group)(), None, None


class UlyssesAnythingAttention:
    """diffusers' ``TemplatedUlyssesAnythingAttention`` (0.42: forward only), differentiable: the queries, keys and
    values go through :class:`_SeqToHeads`, the attention backend's forward runs under autograd on the whole sequence
    for this rank's heads, and the output comes back through :class:`_HeadsToSeq`. Same arguments as diffusers'
    ``apply``; the log-sum-exp is not returned (no backend ff runs under context parallelism needs it)."""

    @staticmethod
    def apply(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, dropout_p: float, is_causal: bool,
              scale: float | None, enable_gqa: bool, return_lse: bool, forward_op: Any, backward_op: Any,
              _parallel_config: Any = None, **kwargs: Any) -> Tensor:  # fmt: skip
        if return_lse:
            raise NotImplementedError("UlyssesAnythingAttention returns no log-sum-exp")
        group = _parallel_config.context_parallel_config._ulysses_mesh.get_group()
        meta = {"NUM_QO_HEAD": query.shape[2], "Q_S_LOCAL": query.shape[1]}
        kv_local = key.shape[1]
        query, key, value = (_SeqToHeads.apply(x.contiguous(), group) for x in (query, key, value))
        heads = meta["NUM_QO_HEAD"]
        if attn_mask is not None and attn_mask.ndim == 4 and attn_mask.shape[1] == heads > 1:  # a mask per head
            rank, size = dist.get_rank(group), dist.get_world_size(group)
            share = -(-heads // size)  # this rank's heads after the all-to-all (the last rank's share may be short)
            attn_mask = attn_mask[:, rank * share : min((rank + 1) * share, heads)]
        if attn_mask is not None and attn_mask.shape[-1] == kv_local:  # a local key mask: the whole sequence's
            attn_mask = all_gather_uneven(attn_mask, attn_mask.ndim - 1, group)
        out = forward_op(_NoContext(), query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, False,
                         _save_ctx=False, _parallel_config=_parallel_config)  # fmt: skip
        if query.requires_grad and not out.requires_grad:
            raise RuntimeError("context parallelism: the attention backend's forward is not differentiable under "
                               "autograd; use the native backend (torch SDPA)")  # fmt: skip
        return _HeadsToSeq.apply(out.contiguous(), group, meta)


class _NoContext:
    """Stands in for the autograd context diffusers' attention forward ops write to when they save for a backward
    (``_save_ctx=False``: they do not)."""


def all_gather_uneven(tensor: Tensor, dim: int, group: Any) -> Tensor:
    """Every rank's ``tensor`` concatenated along ``dim``, the ranks' sizes along it allowed to differ: padded to the
    largest, all-gathered, trimmed. diffusers' ``_all_gather_anything`` (the output gather of its "anything" mode)
    all-gathers the unequal tensors as they are, which NCCL accepts and gloo refuses."""
    from diffusers.models._modeling_parallel import gather_size_by_comm

    tensor = tensor.contiguous()
    sizes = gather_size_by_comm(tensor.shape[dim], group)
    pad = [0, 0] * (tensor.ndim - 1 - dim) + [0, max(sizes) - tensor.shape[dim]]
    padded = F.pad(tensor, pad).contiguous()
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)
