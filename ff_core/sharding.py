"""Sharded training: FSDP2 over the adapter's trained networks, and what reads them back whole.

Under Lightning's ``ModelParallelStrategy`` (FSDP2, docs/scaling.md) ``FlowModule.configure_model`` calls
:func:`fully_shard_networks`: every block of :meth:`~ff_core.adapter.Adapter.sharding_blocks` is ``fully_shard``ed,
then each trained network (``Adapter.denoisers()``) as the root of its blocks, over the strategy's data-parallel mesh
dimension (every rank under ff's ``ContextParallelStrategy``: :func:`sharding_mesh`). Nothing else is sharded but a
full fine-tuning's reference copy (:func:`fully_shard_copies`): frozen components (VAE, text encoders) stay plain
modules, replicated on every rank, and are never all-gathered.

Wrappers rename parameters: FSDP1 (``FSDPStrategy``) inserts ``_fsdp_wrapped_module.``, activation checkpointing
``_checkpoint_wrapped_module.``, ``torch.compile`` ``_orig_mod.`` into ``named_parameters()`` while state dicts keep
the plain names; :func:`clean_name` maps one to the other. :func:`full_parameters` reads a network's
parameters whole on every rank (a DTensor shard is all-gathered; FSDP1 flat shards are summoned), which is what the
diffusers LoRA export writes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ff_core.adapter import TORCH_DTYPES, resolve_dtype

if TYPE_CHECKING:
    from ff_core.adapter import Adapter

WRAPPER_NAMES = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")
"""Attribute names wrapper modules (FSDP1, activation checkpointing, ``torch.compile``) insert into parameter names."""



def clean_name(name: str) -> str:
    """``name`` without the wrapper components (:data:`WRAPPER_NAMES`): the key the module's state dict uses.

    Args:
        name: a dotted parameter or module name from ``named_parameters()`` / ``named_modules()``.
    """
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


@dataclass
class ShardingConfig:
    """FSDP2 settings of the trained networks under ``ModelParallelStrategy`` (``model.sharding``).

    Attributes:
        param_dtype: dtype the sharded parameters are all-gathered and computed in (``bfloat16``: bf16 compute over
            fp32 master weights); ``None`` keeps the parameters' own dtype.
        reduce_dtype: dtype gradients are reduce-scattered in (``float32`` keeps the reduction exact under bf16
            compute); ``None``: ``param_dtype``.
        reshard_after_forward: free each block's gathered parameters after its forward (ZeRO-3 style, least memory);
            ``False`` keeps them until the backward (ZeRO-2 style, one all-gather fewer per block).
        cpu_offload: keep the parameter shards, their gradients and the optimiser state on the CPU (FSDP2's
            ``CPUOffloadPolicy``). Refused for now (``True`` raises a ``ConfigError``): it has never run on a GPU, and
            Lightning's strategy moves the module to the device after ``configure_model``, which would undo the
            offload. Kept as a field so that recipes name it once it is checked.
    """

    param_dtype: str | None = None
    reduce_dtype: str | None = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        for key in ("param_dtype", "reduce_dtype"):
            value = getattr(self, key)
            if value is not None:
                resolve_dtype(value, f"model.sharding.{key}")
        if self.cpu_offload:
            from ff_core.errors import ConfigError

            raise ConfigError("model.sharding.cpu_offload", "true is not supported yet: FSDP2's CPU offload has not "
                              "been run on a GPU under ff (Lightning moves the module to the device after sharding); "
                              "use activation checkpointing, bf16 or more GPUs (docs/scaling.md, Memory)")  # fmt: skip

    def fsdp_kwargs(self, root: bool = False) -> dict[str, Any]:
        """Keyword arguments of ``torch.distributed.fsdp.fully_shard`` (mesh aside).

        Args:
            root: for the trained network itself rather than one of its blocks: its forward inputs are not cast to
                ``param_dtype`` by FSDP (which would cast every floating input, the fp32 timestep included), but by
                :func:`cast_forward_inputs`, which keeps the adapter's ``full_precision_inputs``.
        """
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        policy = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES.get(self.param_dtype), reduce_dtype=TORCH_DTYPES.get(
            self.reduce_dtype), cast_forward_inputs=not root)  # fmt: skip
        return {"mp_policy": policy, "reshard_after_forward": self.reshard_after_forward,
                "offload_policy": CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()}  # fmt: skip


STRATEGY_NAMES = {"fsdp2": "FSDP2 (ModelParallelStrategy)", "fsdp1": "FSDP1 (FSDPStrategy)",
                  "deepspeed": "DeepSpeed (DeepSpeedStrategy)"}  # fmt: skip
"""The sharding strategies ff knows, by :func:`strategy_kind`, as messages name them."""


def strategy_kind(strategy: Any) -> str | None:
    """``fsdp2`` (Lightning's ``ModelParallelStrategy``), ``fsdp1`` (``FSDPStrategy``), ``deepspeed``
    (``DeepSpeedStrategy``, ff's CPU subclass included), or ``None``: a strategy that replicates the model (one
    device, DDP)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    kinds = ((ModelParallelStrategy, "fsdp2"), (FSDPStrategy, "fsdp1"), (DeepSpeedStrategy, "deepspeed"))
    return next((kind for cls, kind in kinds if isinstance(strategy, cls)), None)


def sharding_mesh(strategy: Any) -> Any:
    """The device mesh FSDP2 shards the trained networks over under a ``ModelParallelStrategy``: its data-parallel
    dimension, or every rank under ff's :class:`~ff_core.strategies.ContextParallelStrategy`, after checking that the
    run has no tensor-parallel dimension: ff has no tensor-parallel plan, so a ``tensor_parallel_size`` above 1 would
    give the ranks of one group the same batch and shard nothing over them. Raises a ``ConfigError`` naming the
    strategy's keys.

    Args:
        strategy: Lightning's ``ModelParallelStrategy``, its environment set up (``device_mesh`` exists).
    """
    from ff_core.errors import ConfigError
    from ff_core.strategies import ContextParallelStrategy

    if isinstance(strategy, ContextParallelStrategy):
        return strategy.shard_mesh
    mesh = strategy.device_mesh
    dp, tp = mesh["data_parallel"].size(), mesh["tensor_parallel"].size()
    if tp > 1:
        raise ConfigError(
            "trainer.strategy",
            f"ModelParallelStrategy with tensor_parallel_size={tp}: ff shards the trained networks with FSDP2 over "
            f"the data-parallel dimension only (no tensor-parallel plan). Set init_args data_parallel_size: "
            f"{dp * tp} (devices x num_nodes) and tensor_parallel_size: 1 (Lightning's 'auto' gives every device of "
            "a node to tensor parallelism), or use ff_core.strategies.ContextParallelStrategy to split long "
            "sequences",
        )
    return mesh["data_parallel"]


def gradient_divide_factor(strategy: Any) -> float | None:
    """What FSDP2 divides the summed gradients by: ``None`` (its default, the mesh size: the mean over data-parallel
    ranks), or the data-parallel size under :class:`~ff_core.strategies.ContextParallelStrategy`, whose ranks of one
    context-parallel group each hold a part of one sample's gradient (summed, not averaged)."""
    return getattr(strategy, "gradient_divide_factor", None)


def fully_shard_networks(adapter: Adapter, mesh: Any, config: ShardingConfig, divide: float | None = None) -> None:
    """FSDP2 over every trained network: each of its :meth:`~ff_core.adapter.Adapter.sharding_blocks` is a
    ``fully_shard`` unit (all-gathered for its own forward and backward only), then the network itself (its remaining
    parameters: embeddings, norms, output projection). Gradients of every rank are reduce-scattered, so the ranks stay
    identical; each holds ``1 / mesh.size()`` of every parameter.

    Args:
        adapter: the loaded adapter, LoRA applied (or its denoisers unfrozen).
        mesh: the 1-D mesh to shard over (:func:`sharding_mesh`: the data-parallel ranks, or every rank under context
            parallelism).
        config: the FSDP2 settings.
        divide: what the summed gradients are divided by (:func:`gradient_divide_factor`); ``None``: the mesh size.
    """
    blocks = adapter.sharding_blocks()
    for name, network in adapter.denoisers().items():
        shard_network(network, blocks.get(name, ()), mesh, config, adapter.full_precision_inputs, divide)


def fully_shard_copies(adapter: Adapter, copies: list[nn.Module], mesh: Any, config: ShardingConfig) -> None:
    """FSDP2 over the frozen copies of the trained networks (a full fine-tuning's reference policy,
    :class:`~ff_core.objectives.reference.ReferenceModel`), unit for unit as :func:`fully_shard_networks` shards the
    networks they copy: each rank holds ``1 / mesh.size()`` of the copy, all-gathered block by block in its forwards
    (no gradient: nothing to reduce), computed in ``config.param_dtype`` as the policy is. Call it before the trained
    networks are sharded (the copies' blocks are found by their names inside the network).

    Args:
        adapter: the loaded adapter whose ``trained_networks()`` the copies are, in that order.
        copies: the copies (``ReferenceModel.copies()``).
        mesh: the 1-D data-parallel device mesh.
        config: the FSDP2 settings of the trained networks.
    """
    blocks = adapter.sharding_blocks()
    names = {id(network): name for name, network in adapter.denoisers().items()}
    for network, copy in zip(adapter.trained_networks(), copies):
        paths = {id(m): path for path, m in network.named_modules()}
        units = [copy.get_submodule(paths[id(block)]) for block in blocks.get(names.get(id(network)), ())]
        shard_network(copy, units, mesh, config, adapter.full_precision_inputs)


def shard_network(network: nn.Module, blocks: Any, mesh: Any, config: ShardingConfig, keep: tuple[str, ...],
                  divide: float | None = None) -> None:  # fmt: skip
    """``fully_shard`` each of ``blocks``, then ``network`` as their root, its forward inputs cast to
    ``config.param_dtype`` except the keyword inputs named in ``keep`` (:func:`cast_forward_inputs`), the summed
    gradients divided by ``divide`` (``None``: FSDP2's default, the mesh size)."""
    from torch.distributed.fsdp import fully_shard

    for unit in [*blocks, network]:
        fully_shard(unit, mesh=mesh, **config.fsdp_kwargs(root=unit is network))
        if divide is not None:
            unit.set_gradient_divide_factor(divide)
            if mesh.device_type == "cpu":  # gloo has no pre-multiplied sum: sum, then divide
                unit.set_force_sum_reduction_for_comms(True)
    if config.param_dtype is not None:
        cast_forward_inputs(network, TORCH_DTYPES[config.param_dtype], keep)


def check_sharded(module: nn.Module) -> None:
    """Raise, naming the first one, when a trained parameter of ``module`` is not a DTensor after
    :func:`fully_shard_networks`: it lies outside every ``Adapter.denoisers()`` network, so no FSDP2 unit reduces its
    gradient and the ranks would silently diverge.

    Args:
        module: the FlowModule, its trained networks sharded.
    """
    from torch.distributed.tensor import DTensor

    plain = [name for name, p in module.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
    if plain:
        raise RuntimeError(f"FSDP2: {len(plain)} trained parameter(s) are not sharded, e.g. {plain[0]!r}: they lie "
                           "outside the adapter's denoisers(), which ff shards, so their gradients would not be "
                           "reduced across ranks; list their network in Adapter.denoisers() (docs/plugins.md)")


def cast_forward_inputs(network: nn.Module, dtype: torch.dtype, keep: tuple[str, ...]) -> None:
    """Cast the floating tensors ``network`` is called with to ``dtype`` (a forward pre-hook), except the keyword
    inputs named in ``keep``: what FSDP2's ``cast_forward_inputs`` does, less the inputs the network embeds in fp32
    itself (``Adapter.full_precision_inputs``: the timestep).

    Args:
        network: a trained network, ``fully_shard``ed with ``cast_forward_inputs=False``.
        dtype: the compute dtype (``model.sharding.param_dtype``).
        keep: keyword names passed through unchanged.
    """
    from torch.utils._pytree import tree_map

    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tree_map(cast, args), {k: v if k in keep else tree_map(cast, v) for k, v in kwargs.items()}

    network.register_forward_pre_hook(hook, with_kwargs=True)


def local_numel(tensor: Tensor) -> int:
    """Elements this rank stores of ``tensor`` (its shard of a DTensor, its partition of a ZeRO-3 parameter)."""
    from torch.distributed.tensor import DTensor

    if hasattr(tensor, "ds_tensor"):  # DeepSpeed ZeRO-3: ``tensor`` itself is empty outside a gathering
        return tensor.ds_tensor.numel()
    return tensor.to_local().numel() if isinstance(tensor, DTensor) else tensor.numel()


def global_numel(tensor: Tensor) -> int:
    """Elements of ``tensor`` whole (a ZeRO-3 parameter's ``numel()`` is 0 outside a gathering)."""
    return getattr(tensor, "ds_numel", tensor.numel())


def full_tensor(tensor: Tensor) -> Tensor:
    """``tensor`` whole: a DTensor is all-gathered (every rank of its mesh must call this), anything else returned."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@contextmanager
def summoned(root: nn.Module | None) -> Iterator[None]:
    """Within it, FSDP1 modules under ``root`` expose their full (unsharded) parameters, read-only and gathered into
    CPU memory (``offload_to_cpu``: the whole network at once never sits on the accelerator), and DeepSpeed ZeRO-3's
    partitioned trained parameters are all-gathered (``deepspeed.zero.GatheredParameters``); a no-op for any other
    module (FSDP2's DTensors are gathered per tensor by :func:`full_tensor`). Every rank must enter it. The gathered
    storage is freed on exit: copy what must outlive it (:func:`full_parameters` does).

    Args:
        root: the strategy's model (``trainer.strategy.model``), or ``None``.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp1 = root is not None and any(isinstance(m, FullyShardedDataParallel) for m in root.modules())
    summon = FullyShardedDataParallel.summon_full_params
    # ZeRO-3's partitioned parameters: the trained ones only (what an export reads; a LoRA's base stays partitioned).
    partitioned = [p for p in root.parameters() if hasattr(p, "ds_id") and p.requires_grad] if root is not None else []
    if partitioned:
        import deepspeed

        with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):  # all-gathered, re-partitioned on exit
            yield
        return
    with summon(root, writeback=False, offload_to_cpu=True) if fsdp1 else nullcontext():
        yield


def full_parameters(network: nn.Module, keep: Callable[[str], bool] = lambda name: True) -> dict[str, Tensor]:
    """The parameters of ``network`` whose name passes ``keep``, whole, as CPU copies owning their storage, by their
    ``named_parameters()`` name (wrapper components included: peft finds its layers by those names; :func:`clean_name`
    them for a state dict). Call it on every rank (DTensor shards are all-gathered), inside :func:`summoned` under
    FSDP1: its parameters there are views into gathered flat storage that is freed when the context exits, hence the
    copies, which the caller may keep and write after it.

    Args:
        network: a trained network (``Adapter.denoisers()``).
        keep: which names to read (gathering only what is needed: a LoRA's tensors, not the base weights).
    """
    return {name: full_tensor(p.detach()).to("cpu", copy=True) for name, p in network.named_parameters() if keep(name)}
