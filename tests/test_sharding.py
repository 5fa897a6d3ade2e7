"""Sharding seams in one process (issue 13): checkpoint keep-list and LoRA export through wrapper names, the trained
networks' blocks, frozen components outside the module tree, the data-parallel rank from a strategy's device mesh.

The 2-process FSDP2 runs against DDP are in tests/test_fsdp2.py. FSDP1 itself needs an accelerator ("FSDP needs a
non-CPU accelerator device" in torch 2.13), so its renaming is exercised through torch's activation-checkpoint wrapper,
which renames parameters the same way (``named_parameters()`` gains ``_checkpoint_wrapped_module.`` where FSDP1 adds
``_fsdp_wrapped_module.``; state dicts keep the plain names) and which Lightning's FSDPStrategy applies too
(``activation_checkpointing_policy``).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

from ff_core.data.dataflow import DataParallelCoords
from ff_core.errors import ConfigError
from ff_core.lora import LoRAConfig, lora_state_dicts
from ff_core.module import FlowModule
from ff_core.sharding import ShardingConfig, clean_name, sharding_mesh


def loaded(tiny_sd3, lora: LoRAConfig | None) -> FlowModule:
    module = FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32}, lora=lora)
    module.configure_model()  # no trainer: loads, applies LoRA, detaches the frozen components
    return module


def saved_keys(module: FlowModule) -> set[str]:
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    return set(checkpoint["state_dict"])


def wrap_blocks(module: FlowModule) -> None:
    blocks = set(module.adapter.sharding_blocks()["transformer"])
    apply_activation_checkpointing(module.adapter.transformer, check_fn=lambda m: m in blocks)
    assert any("_checkpoint_wrapped_module." in n for n, _ in module.named_parameters())


def test_clean_name_drops_every_wrapper_component():
    name = "adapter.transformer.transformer_blocks.0._fsdp_wrapped_module._checkpoint_wrapped_module.attn.to_q.weight"
    assert clean_name(name) == "adapter.transformer.transformer_blocks.0.attn.to_q.weight"
    assert clean_name("_orig_mod.proj_out.lora_A.default.weight") == "proj_out.lora_A.default.weight"


@pytest.mark.parametrize("lora", [LoRAConfig(rank=2, alpha=2.0), None], ids=["lora", "full"])
def test_checkpoint_keeps_the_trained_tensors_of_wrapped_blocks(tiny_sd3, lora):
    """Before the keep-list read state-dict names, a LoRA checkpoint of wrapped blocks kept only the LoRA layers
    outside them (none here: empty under FSDP1, whose root wraps everything) and a full one lost the blocks' keys."""
    module = loaded(tiny_sd3, lora)
    expected = saved_keys(module)
    assert expected and any(".transformer_blocks." in k for k in expected)
    exported = lora_state_dicts(module.adapter) if lora else None
    wrap_blocks(module)
    assert saved_keys(module) == expected
    if lora:  # the diffusers export reads peft's names, wrappers or not
        again = lora_state_dicts(module.adapter)
        assert set(again["transformer"]) == set(exported["transformer"])
        for key, value in exported["transformer"].items():
            assert torch.equal(again["transformer"][key], value), key


def test_frozen_components_are_outside_the_module_tree_but_follow_it(tiny_sd3):
    """No strategy can wrap or shard what is not a submodule; to() still moves (and casts) them with the module."""
    module = loaded(tiny_sd3, LoRAConfig(rank=2, alpha=2.0))
    adapter = module.adapter
    assert [name for name, _ in adapter.named_children()] == ["transformer"]
    assert set(adapter.detached_modules()) == {"vae", "text_encoder", "text_encoder_2", "text_encoder_3"}
    assert not any(k.startswith(("adapter.vae.", "adapter.text_encoder")) for k in module.state_dict())
    module.to(torch.float64)
    assert adapter.vae.dtype == adapter.text_encoder_3.dtype == adapter.transformer.dtype == torch.float64
    assert adapter.release_preprocessing() and set(adapter.detached_modules()) == {"vae"}
    assert adapter.text_encoder is None
    # A component assigned again is a submodule again (nn.Module's rule).
    adapter.vae = adapter.vae
    assert "vae" in dict(adapter.named_children()) and not adapter.detached_modules()


def test_sharding_blocks_default_reads_the_diffusers_no_split_modules(tiny_sd3):
    """The Adapter default (``_no_split_modules`` classes, outermost) finds SD3's joint blocks, as its override."""
    from ff_core.adapter import Adapter

    module = loaded(tiny_sd3, None)
    adapter = module.adapter
    default = Adapter.sharding_blocks(adapter)["transformer"]
    assert default == list(adapter.transformer.transformer_blocks) == adapter.sharding_blocks()["transformer"]


def test_sharding_config_names_a_bad_dtype():
    with pytest.raises(ValueError, match="model.sharding.param_dtype"):
        ShardingConfig(param_dtype="bf17")
    with pytest.raises(ConfigError, match="model.sharding.cpu_offload"):  # never run on a GPU: refused, not shipped
        ShardingConfig(cpu_offload=True)
    kwargs = ShardingConfig(param_dtype="bfloat16", reduce_dtype="float32").fsdp_kwargs()
    assert kwargs["mp_policy"].param_dtype == torch.bfloat16 and kwargs["mp_policy"].reduce_dtype == torch.float32


def deepspeed(stage: int, cls: type | None = None):
    """A ``DeepSpeedStrategy`` (Lightning's, or ``cls``) built without its ``__init__`` (only the attributes ff reads
    set)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    cls = cls or DeepSpeedStrategy
    strategy = cls.__new__(cls)
    strategy.exclude_frozen_parameters, strategy.config = True, {"zero_optimization": {"stage": stage}}
    return strategy


def trainer_with_mesh(dp: int, tp: int):
    """A Trainer under ModelParallelStrategy whose device mesh is the one its setup_environment would build
    (lightning.fabric.strategies.model_parallel._setup_device_mesh)."""
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.device_mesh import init_device_mesh

    strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_checkpointing=False)
    strategy._device_mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    return trainer


@pytest.mark.parametrize("rank", [0, 1])
def test_data_parallel_rank_comes_from_the_strategys_mesh(fake_world, rank):
    """The loader shards by the mesh's data-parallel coordinate (DataParallelCoords.from_trainer): 2 data-parallel
    ranks split the data (rank r of 2); the 2 ranks of one tensor-parallel group get the same batches (rank 0 of 1),
    whatever their global rank."""
    fake_world(rank)
    coords = DataParallelCoords.from_trainer(trainer_with_mesh(2, 1))
    assert (coords.rank, coords.world_size) == (rank, 2)
    coords = DataParallelCoords.from_trainer(trainer_with_mesh(1, 2))
    assert (coords.rank, coords.world_size) == (0, 1)


def test_a_tensor_parallel_mesh_is_refused_before_weights_load(fake_world, tiny_sd3):
    """ff has no tensor-parallel plan: FlowModule.setup refuses the mesh Lightning's 'auto' sizes give one node
    (every device tensor-parallel), naming the keys to set."""
    fake_world(0)
    assert sharding_mesh(trainer_with_mesh(2, 1).strategy).size() == 2
    trainer = trainer_with_mesh(1, 2)
    module = FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32})
    module.trainer = trainer
    with pytest.raises(ConfigError, match="data_parallel_size: 2"):
        module.setup("validate")
    assert module.adapter is None
    module = FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32}, sharding=ShardingConfig())
    module.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    with pytest.raises(ConfigError, match="model.sharding"):
        module.setup("validate")
    # GRPO trains under FSDP2 and DeepSpeed (tests/test_grpo_sharded.py), not under FSDP1: refused, naming them.
    from ff_core.objectives import GRPOObjective

    grpo = GRPOObjective(rewards=[{"name": "colour"}], group_size=2, prompts_per_step=2)
    module = FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32}, objective=grpo)
    module.trainer = trainer_with_mesh(2, 1)
    module.setup("validate")
    zero2 = deepspeed(2)
    module._check_strategy(zero2)  # DeepSpeed clips in its engine's step: GRPO's max_grad_norm goes into its config
    assert zero2.config["gradient_clipping"] == grpo.max_grad_norm == 1.0
    zero2.config["gradient_clipping"] = 0.5
    with pytest.raises(ConfigError, match="max_grad_norm"):
        module._check_strategy(zero2)
    from lightning.pytorch.strategies import FSDPStrategy

    with pytest.raises(ConfigError, match=r"GRPOObjective runs on one device, DDP, DeepSpeed \(DeepSpeedStrategy\), "
                       r"FSDP2 \(ModelParallelStrategy\), not under FSDP1 \(FSDPStrategy\)"):  # fmt: skip
        module._check_strategy(FSDPStrategy.__new__(FSDPStrategy))


STRATEGY_RECIPES = {
    "sft_tiny_fsdp2.yaml": ("lightning.pytorch.strategies.ModelParallelStrategy", "data_parallel_size: 2"),
    "sft_tiny_fsdp.yaml": ("lightning.pytorch.strategies.FSDPStrategy", "sharding_strategy: FULL_SHARD"),
    "sft_tiny_deepspeed.yaml": ("ff_core.strategies.DeepSpeedStrategy", "exclude_frozen_parameters: true"),
}


@pytest.mark.parametrize("recipe", sorted(STRATEGY_RECIPES))
def test_strategy_recipes_parse(recipe, capsys):
    """`ff fit --config X --print_config` for every strategy recipe (FSDP1's is run by benchmarks/gpu_check.sh)."""
    from pathlib import Path

    from ff_core.cli.flow_cli import run

    path = Path(__file__).resolve().parents[1] / "configs" / "sd3" / recipe
    with pytest.raises(SystemExit) as exit_info:
        run(["fit", "--config", str(path), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    strategy, setting = STRATEGY_RECIPES[recipe]
    assert f"class_path: {strategy}" in printed and setting in printed


def test_fsdp1_wraps_each_adapter_block(tiny_sd3):
    """Under FSDPStrategy ff makes each of the adapter's blocks an FSDP unit (FSDP1 itself needs a GPU: here the
    policy the strategy will wrap with is checked, on a strategy that has not wrapped anything yet)."""
    from types import SimpleNamespace

    from diffusers.models.attention import JointTransformerBlock
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    strategy = FSDPStrategy(sharding_strategy="FULL_SHARD", state_dict_type="full")
    strategy.parallel_devices = [torch.device("cpu")]
    module = FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32}, lora=LoRAConfig(rank=2, alpha=2.0))
    module._trainer = SimpleNamespace(strategy=strategy, datamodule=None)
    module.configure_model()
    policy = strategy.kwargs["auto_wrap_policy"]
    assert isinstance(policy, ModuleWrapPolicy) and policy._module_classes == {JointTransformerBlock}
    assert strategy.kwargs["use_orig_params"] is True  # Lightning's default, which a LoRA needs


def test_lora_export_owns_its_storage(tiny_sd3):
    """Under FSDP1 the exported tensors were views of the summoned flat parameters, written after
    ``summon_full_params`` had freed them (resized their storage to 0). Freeing the parameters' storage the same way
    after the export must leave the exported values readable and unchanged."""
    module = loaded(tiny_sd3, LoRAConfig(rank=2, alpha=2.0))
    lora = {n: p for n, p in module.adapter.transformer.named_parameters() if "lora_" in n}
    with torch.no_grad():  # peft initialises lora_B to zero: give every tensor distinct values
        for p in lora.values():
            p.copy_(torch.randn_like(p))
    want = {n: p.detach().clone() for n, p in lora.items()}
    exported = lora_state_dicts(module.adapter)["transformer"]
    for p in lora.values():  # what FSDP1 does to the gathered storage when the summoning context exits
        p.data.untyped_storage().resize_(0)
    assert len(exported) == len(want)
    for name, value in exported.items():
        source = next(n for n in want if n.replace(".default", "") == name)
        assert value.device.type == "cpu" and torch.equal(value, want[source])


def test_fsdp1_sharded_checkpoints_are_refused(tiny_sd3):
    """FSDP1's sharded state dict keeps the frozen base (FlowModule's keep-list cannot act under the root unit), so
    resuming from it failed; the setting is refused before weights load, naming the key."""
    from lightning.pytorch.strategies import FSDPStrategy

    module = FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32}, lora=LoRAConfig(rank=2, alpha=2.0))
    with pytest.raises(ConfigError, match="state_dict_type: full"):
        module._check_strategy(FSDPStrategy(state_dict_type="sharded"))
    module._check_strategy(FSDPStrategy(state_dict_type="full"))
    assert module.adapter is None


def test_fsdp2_compute_dtype_keeps_the_timestep_fp32(tiny_sd3):
    """FSDP2's own input cast (cast_forward_inputs) turned the fp32 timestep into bf16 (437.6 -> 438) before the
    network's sinusoidal embedding; the root now casts through cast_forward_inputs, which keeps the adapter's
    full_precision_inputs. Checked on the real network in the dtype FSDP2 computes in (its bf16 gathered parameters)
    against a direct call with the inputs cast by hand."""
    from ff_core.sharding import cast_forward_inputs

    config = ShardingConfig(param_dtype="bfloat16", reduce_dtype="float32")
    assert config.fsdp_kwargs(root=True)["mp_policy"].cast_forward_inputs is False
    assert config.fsdp_kwargs()["mp_policy"].cast_forward_inputs is True  # the blocks' inputs are all activations
    module = loaded(tiny_sd3, None)
    transformer = module.adapter.transformer.to(torch.bfloat16)
    seen = []
    transformer.time_text_embed.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, 8, generator=gen)
    embeds, pooled = torch.randn(2, 7, 64, generator=gen), torch.randn(2, 64, generator=gen)
    sigma = torch.tensor([0.4376, 0.9071])
    inputs = {"encoder_hidden_states": embeds, "pooled_projections": pooled, "timestep": sigma * 1000}
    want = transformer(hidden_states=x.bfloat16(), **{**inputs, "encoder_hidden_states": embeds.bfloat16(),
                       "pooled_projections": pooled.bfloat16()}, return_dict=False)[0]  # fmt: skip
    cast_forward_inputs(transformer, torch.bfloat16, module.adapter.full_precision_inputs)
    got = transformer(hidden_states=x, **inputs, return_dict=False)[0]
    assert seen == [torch.float32, torch.float32] and torch.equal(got, want)


def test_resuming_another_lora_is_refused_without_a_state_dict(tiny_sd3):
    """FSDP1, FSDP2 and DeepSpeed drop "state_dict" before on_load_checkpoint, which skipped the guard against resuming
    with another model.lora; the checkpoint's hyper-parameters are compared instead (no weights needed)."""
    lora = LoRAConfig(rank=2, alpha=2.0, target_modules=["to_q"])
    module = FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32}, lora=lora)
    same = {"adapter": "sd3-5", "lora": LoRAConfig(rank=2, alpha=2.0, target_modules=["to_q"], dropout=0.1)}
    module.on_load_checkpoint({"hyper_parameters": same})  # dropout may change
    module.on_load_checkpoint({"hyper_parameters": {**same, "lora": {"rank": 2, "alpha": 2.0,
                                                                     "target_modules": ["to_q"]}}})  # fmt: skip
    for other in (LoRAConfig(rank=4, alpha=2.0, target_modules=["to_q"]), None,
                  LoRAConfig(rank=2, alpha=2.0, target_modules=["to_q", "to_k"])):  # fmt: skip
        with pytest.raises(ConfigError, match="model.lora"):
            module.on_load_checkpoint({"hyper_parameters": {**same, "lora": other}})
    with pytest.raises(ConfigError, match="model.adapter"):
        module.on_load_checkpoint({"hyper_parameters": {**same, "adapter": "wan2_t2v"}})
    assert module.adapter is None


def test_fsdp2_shards_a_full_fine_tunings_reference_copy(fake_world, tiny_sd3):
    """Offline DPO without LoRA copies the denoiser as its reference: under FSDP2 the copy is sharded unit for unit as
    the policy is (it stayed whole, in fp32, on every rank, and was refused before issue 26), frozen, in the
    policy's compute dtype; an offloaded copy is refused, naming the key. Sharded over a fake 2-rank group (no
    collective runs while sharding; tests/test_dpo_fsdp2.py trains it)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from ff_core.objectives import DPOObjective

    fake_world(0)
    module = FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32}, objective=DPOObjective(),
                        sharding=ShardingConfig(param_dtype="bfloat16"))  # fmt: skip
    module.trainer = trainer_with_mesh(2, 1)
    module.configure_model()
    (copy,) = module.objective.reference.copies()
    policy = module.adapter.transformer
    assert isinstance(copy, FSDPModule) and isinstance(policy, FSDPModule) and copy is not policy
    assert all(isinstance(p, DTensor) and not p.requires_grad for p in copy.parameters())
    units = [n for n, m in copy.named_modules() if isinstance(m, FSDPModule) and n]
    assert units == [n for n, m in policy.named_modules() if isinstance(m, FSDPModule) and n] and units
    assert copy._get_fsdp_state()._mp_policy.param_dtype == torch.bfloat16
    offloaded = FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32},
                           objective=DPOObjective(reference_offload=True))  # fmt: skip
    offloaded.trainer = trainer_with_mesh(2, 1)
    with pytest.raises(ConfigError, match="reference_offload"):
        offloaded.configure_model()


def test_detached_frozen_components_stay_in_eval_mode(tiny_sd3):
    """train() walked the module tree only, so a detached text encoder put in train mode (dropout) stayed there."""
    module = loaded(tiny_sd3, LoRAConfig(rank=2, alpha=2.0))
    detached = module.adapter.detached_modules()
    assert detached and not any(m.training for d in detached.values() for m in d.modules())
    for component in detached.values():
        component.train()
    module.train()
    assert module.adapter.transformer.training
    assert not any(m.training for d in detached.values() for m in d.modules())


def test_deepspeed_zero3_refusal_names_a_setting_that_is_accepted(tiny_sd3):
    """ZeRO-3 under Lightning's DeepSpeedStrategy (configure_model inside deepspeed.zero.Init) is refused, naming ff's
    strategy, which is accepted (tests/test_deepspeed.py trains under it)."""
    import re

    from ff_core.strategies import DeepSpeedStrategy

    module = FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32}, lora=LoRAConfig(rank=2, alpha=2.0))
    with pytest.raises(ConfigError, match=re.escape("class_path: ff_core.strategies.DeepSpeedStrategy (init_args: "
                                                    "{stage: 3, exclude_frozen_parameters: true})")):  # fmt: skip
        module._check_strategy(deepspeed(3))
    module._check_strategy(deepspeed(3, DeepSpeedStrategy))  # what it suggests is accepted


def test_a_trained_parameter_outside_the_sharded_networks_is_named(fake_world, tiny_sd3):
    """Safety net after fully_shard_networks: every trained parameter must be a DTensor (sharded, its gradient
    reduce-scattered); one outside Adapter.denoisers() would train unreduced on each rank. Sharded here over a fake
    2-rank group (no collective runs while sharding)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ff_core.sharding import check_sharded, fully_shard_networks

    fake_world(0)
    module = loaded(tiny_sd3, LoRAConfig(rank=2, alpha=2.0))
    fully_shard_networks(module.adapter, init_device_mesh("cpu", (2,)), ShardingConfig())
    check_sharded(module)
    module.adapter.head = torch.nn.Linear(2, 2)  # trains, but is no denoiser
    with pytest.raises(RuntimeError, match="'adapter.head.weight'"):
        check_sharded(module)


def test_fsdp2_refuses_a_ddp_numbered_optimizer_state(tiny_sd3):
    """Lightning's FSDP2 loader maps a file checkpoint's optimizer state by index among all parameters (FSDP2 saves
    it so); a DDP checkpoint numbers the trained parameters only, so with a LoRA's frozen base in the tree the Adam
    moments went to other tensors. Both numberings built here as the two strategies write them: DDP's is
    torch's own optimizer.state_dict(), FSDP2's torch's rekey_optim_state_dict(PARAM_ID) on the same module."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import OptimStateKeyType
    from torch.distributed.fsdp._optim_utils import _get_param_to_fqns

    module = loaded(tiny_sd3, LoRAConfig(rank=2, alpha=2.0))
    optimizer = module.configure_optimizers()
    for p in optimizer.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    optimizer.step()
    ddp = optimizer.state_dict()
    names = {id(p): fqns[0] for p, fqns in _get_param_to_fqns(module).items()}
    params = optimizer.param_groups[0]["params"]
    by_name = {"state": {names[id(p)]: ddp["state"][i] for i, p in enumerate(params)},
               "param_groups": [{**ddp["param_groups"][0], "params": [names[id(p)] for p in params]}]}  # fmt: skip
    fsdp2 = FSDP.rekey_optim_state_dict(by_name, OptimStateKeyType.PARAM_ID, module)
    module._trainer = SimpleNamespace(strategy=ModelParallelStrategy())
    module._check_optimizer_numbering({"optimizer_states": [fsdp2]})
    with pytest.raises(ConfigError, match="ckpt_path"):
        module._check_optimizer_numbering({"optimizer_states": [ddp]})
