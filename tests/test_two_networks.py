"""More than one trained network (``Adapter.denoisers()``): a small real two-expert adapter (two tiny diffusers
``WanTransformer3DModel`` experts switched at a boundary noise level, as Wan2.2 A14B) trains a LoRA of both, its
checkpoints hold both networks' trained tensors, the optimiser covers both, and the export loads into diffusers'
``WanPipeline`` through ``load_lora_weights(..., load_into_transformer_2=True)`` with outputs equal to ff's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
from torch import Tensor, nn

from ff_core.adapter import LORA_WEIGHT_NAME, Adapter, LatentState
from ff_core.lora import LoRAConfig, lora_configs, lora_state_dicts
from ff_core.module import FlowModule
from ff_core.testing.contracts import SUPPORT_TABLE
from tests.test_sharding import trainer_with_mesh

ADAPTER = "test_two_networks:TwoExperts"
CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
              text_dim=16, freq_dim=16, ffn_dim=16, num_layers=1, cross_attn_norm=True,
              qk_norm="rms_norm_across_heads", rope_max_seq_len=32)  # fmt: skip
TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


class TwoExperts(Adapter):
    """``transformer`` denoises noise levels at or above ``boundary``, ``transformer_2`` those below (the Wan2.2
    pipeline's rule, ``t >= boundary_timestep``)."""

    name = "two-experts"
    io_contract = SUPPORT_TABLE["wan2_t2v"]
    default_lora_targets = TARGETS
    boundary = 0.5

    def __init__(self, transformer: nn.Module, transformer_2: nn.Module) -> None:
        super().__init__()
        self.transformer, self.transformer_2 = transformer, transformer_2

    @classmethod
    def from_pretrained(cls, path, **kwargs: Any) -> TwoExperts:
        experts = ("transformer", "transformer_2")
        return cls(*(WanTransformer3DModel.from_pretrained(path, subfolder=s) for s in experts))

    @property
    def denoiser(self) -> nn.Module:
        return self.transformer

    def denoisers(self) -> dict[str, nn.Module]:
        return {"transformer": self.transformer, "transformer_2": self.transformer_2}

    def velocity(self, state: LatentState, sigma: Tensor, condition: dict[str, Any]) -> LatentState:
        x, high = state.components["latent"], sigma >= self.boundary
        out = torch.empty_like(x)
        for expert, rows in ((self.transformer, high), (self.transformer_2, ~high)):
            if rows.any():
                out[rows] = expert(x[rows], sigma[rows] * 1000, condition["embeds"][rows], return_dict=False)[0]
        return LatentState({"latent": out})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("two-experts")
    for seed, sub in ((0, "transformer"), (1, "transformer_2")):
        torch.manual_seed(seed)
        WanTransformer3DModel(**CONFIG).save_pretrained(root / sub)
    return root


def loaded(checkpoint: Path, lora: LoRAConfig | None) -> FlowModule:
    module = FlowModule(ADAPTER, str(checkpoint), lora=lora)
    module.configure_model()  # no trainer: loads, applies LoRA, nothing else
    return module


def step_inputs() -> tuple[LatentState, Tensor, dict[str, Tensor]]:
    g = torch.Generator().manual_seed(0)
    state = LatentState({"latent": torch.randn(2, 4, 2, 4, 4, generator=g)})
    return state, torch.tensor([0.9, 0.1]), {"embeds": torch.randn(2, 5, 16, generator=g)}


def test_lora_covers_both_experts_in_optimiser_and_checkpoint(checkpoint):
    module = loaded(checkpoint, LoRAConfig(rank=2, alpha=4.0))
    adapter = module.adapter
    assert {id(m) for m in adapter.trained_networks()} == {id(adapter.transformer), id(adapter.transformer_2)}
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in trainable)
    for expert in ("transformer", "transformer_2"):
        assert any(n.startswith(f"adapter.{expert}.") for n in trainable), expert
    optimizer = module.configure_optimizers()
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == sum(
        p.numel() for p in module.parameters() if p.requires_grad)
    # One step with a sample on each side of the boundary trains both experts' LoRA.
    before = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    state, sigma, cond = step_inputs()
    adapter.velocity(state, sigma, cond).components["latent"].square().mean().backward()
    optimizer.step()
    changed = {n for n, p in module.named_parameters() if p.requires_grad and not torch.equal(p, before[n])}
    assert {n.split(".")[1] for n in changed} == {"transformer", "transformer_2"}
    # The checkpoint holds exactly the trained tensors of both, nothing frozen.
    ckpt = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(ckpt)
    assert set(ckpt["state_dict"]) == trainable


def test_full_fine_tuning_checkpoints_both_networks_whole(checkpoint):
    module = loaded(checkpoint, None)
    ckpt = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(ckpt)
    expected = {k for k in module.state_dict() if k.startswith(("adapter.transformer.", "adapter.transformer_2."))}
    assert set(ckpt["state_dict"]) == expected and any(k.startswith("adapter.transformer_2.") for k in expected)
    ckpt["state_dict"] = {k: v for k, v in ckpt["state_dict"].items() if not k.startswith("adapter.transformer_2.")}
    with pytest.raises(KeyError, match="transformer_2"):
        module.on_load_checkpoint(ckpt)


def test_lora_export_loads_into_both_wan_pipeline_transformers(checkpoint, tmp_path):
    module = loaded(checkpoint, LoRAConfig(rank=2, alpha=6.0))  # alpha != rank: the header's alpha must be applied
    adapter = module.adapter.eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # B starts at zero: give both LoRAs an effect
        for name, p in adapter.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    files = adapter.save_loras(tmp_path / "lora", lora_state_dicts(adapter), lora_configs(adapter))
    assert files == {"transformer": tmp_path / "lora" / LORA_WEIGHT_NAME,
                     "transformer_2": tmp_path / "lora" / "pytorch_lora_weights_transformer_2.safetensors"}

    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=FlowMatchEulerDiscreteScheduler(),
                       transformer=WanTransformer3DModel.from_pretrained(checkpoint, subfolder="transformer"),
                       transformer_2=WanTransformer3DModel.from_pretrained(checkpoint, subfolder="transformer_2"),
                       boundary_ratio=0.5)  # fmt: skip
    pipe.load_lora_weights(tmp_path / "lora")
    pipe.load_lora_weights(tmp_path / "lora", weight_name=files["transformer_2"].name, load_into_transformer_2=True)
    state, _, cond = step_inputs()
    x, e = state.components["latent"][:1], cond["embeds"][:1]
    with torch.no_grad():
        for sigma, ours, theirs in ((0.9, adapter.transformer, pipe.transformer),
                                    (0.1, adapter.transformer_2, pipe.transformer_2)):
            t = torch.tensor([sigma * 1000])
            expected = ours(x, t, e, return_dict=False)[0]
            found = theirs(x, t, e, return_dict=False)[0]
            base = WanTransformer3DModel.from_pretrained(
                checkpoint, subfolder="transformer" if ours is adapter.transformer else "transformer_2")(
                x, t, e, return_dict=False)[0]
            assert (expected - base).abs().max() > 1e-3  # the LoRA changes the output
            assert (found - expected).abs().max() < 1e-5, (found - expected).abs().max()


def test_fsdp_refuses_two_routed_networks(checkpoint, fake_world):
    """Each sample runs the expert its noise level picks: under FSDP two ranks could wait on different experts'
    all-gathers. ff makes every rank pick the same expert through ``Adapter.uses_second_expert``
    (plugins/ff_wan/tests/test_wan_a14b_fsdp2.py); a two-network adapter without it is refused once it is loaded."""
    from ff_core.errors import ConfigError

    fake_world(0)
    module = FlowModule(ADAPTER, str(checkpoint), lora=LoRAConfig(rank=2, alpha=2.0))
    module.trainer = trainer_with_mesh(2, 1)
    with pytest.raises(ConfigError, match="transformer, transformer_2"):
        module.configure_model()
