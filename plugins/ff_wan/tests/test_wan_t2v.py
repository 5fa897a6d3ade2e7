"""wan2_t2v on a tiny checkpoint: loading, parity with diffusers' WanPipeline (prompt encoding, latent normalisation,
sampling), the denoiser call, geometry checks and the LoRA export loaded by the pipeline."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from ff_wan import WanT2VAdapter
from torch.utils.data import default_collate
from wan_geometry import ADAPTER_KWARGS, FPS, FRAMES, SIZE

from ff_core.adapter import ConditionInput, LatentState
from ff_core.contracts import MediaGeometry

PROMPTS = ["a red square moving left", "  a blue   circle &amp; a big square moving right  "]  # cleaned like Wan


@pytest.fixture(scope="module")
def t2v(tiny_wan):
    return tiny_wan("t2v")


@pytest.fixture(scope="module")
def adapter(t2v):
    return WanT2VAdapter.from_pretrained(t2v, **ADAPTER_KWARGS)


@pytest.fixture(scope="module")
def condition(adapter):
    return adapter.prepare_condition(default_collate(adapter.preprocess([ConditionInput(p) for p in PROMPTS])))


@pytest.fixture(scope="module")
def pipe(t2v):
    from diffusers import WanPipeline

    return WanPipeline.from_pretrained(t2v)


def _videos(n: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 256, (FRAMES, 3, SIZE, SIZE), generator=g, dtype=torch.uint8)] for _ in range(n)]


# -- discovery and loading ---------------------------------------------------------------------------
def test_discovered_through_the_entry_point(monkeypatch):
    try:
        importlib.metadata.distribution("ff-wan")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("ff-wan is not installed (pip install -e plugins/ff_wan --no-deps)")
    from ff_wan import WanI2VAdapter

    from ff_core.plugins import PluginRegistry, get_adapter_class

    monkeypatch.delenv("FF_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    adapters = PluginRegistry().adapters()
    assert adapters["wan2_t2v"].cls is WanT2VAdapter and adapters["wan2_t2v"].distribution == "ff-wan"
    assert adapters["wan2_i2v"].cls is WanI2VAdapter
    assert get_adapter_class("wan2_t2v") is WanT2VAdapter


def test_contract_is_the_spec_row():
    from ff_core.testing.contracts import SUPPORT_TABLE

    assert WanT2VAdapter.io_contract == SUPPORT_TABLE["wan2_t2v"]
    assert WanT2VAdapter.io_contract.outputs[0].requires_fps  # video targets need fps


def test_from_pretrained_freezes_all_but_the_transformer(adapter):
    assert adapter.denoiser is adapter.transformer and adapter.transformer_2 is None
    trainable = {n.split(".")[0] for n, p in adapter.named_parameters() if p.requires_grad}
    assert trainable == {"transformer"}
    assert adapter.max_sequence_length == 16  # 512 requested, capped by the tiny tokenizer
    assert (adapter.temporal_stride, adapter.spatial_stride) == (4, 8)
    assert adapter.denoisers() == {"transformer": adapter.transformer}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_frames": 10}, r"num_frames: \(num_frames - 1\) must be divisible by 4"),
        ({"height": 24}, "height must be a multiple of 16"),
        ({"width": 40}, "width must be a multiple of 16"),
        ({"fps": 0}, "fps must be > 0"),
    ],
)
def test_geometry_arguments_are_checked(t2v, kwargs, message):
    with pytest.raises(ValueError, match=message):
        WanT2VAdapter.from_pretrained(t2v, **{**ADAPTER_KWARGS, **kwargs})


def test_output_geometry_is_the_decode_specification(adapter):
    assert adapter.output_geometry() == (MediaGeometry(SIZE, SIZE, num_frames=FRAMES, fps=FPS),)


# -- condition side: WanPipeline.encode_prompt -------------------------------------------------------
def test_preprocess_matches_wan_pipeline_encode_prompt(adapter, pipe):
    rows = adapter.preprocess([ConditionInput(p, negative_prompt="blurry, static") for p in PROMPTS])
    with torch.no_grad():
        pe, ne = pipe.encode_prompt(PROMPTS, negative_prompt="blurry, static",
                                    max_sequence_length=adapter.max_sequence_length, device="cpu")  # fmt: skip
    for i, row in enumerate(rows):
        assert set(row) == {"prompt_embeds", "negative_prompt_embeds"}
        assert row["prompt_embeds"].shape == (16, 32) and row["prompt_embeds"].device.type == "cpu"
        torch.testing.assert_close(row["prompt_embeds"], pe[i], rtol=0, atol=0)
        torch.testing.assert_close(row["negative_prompt_embeds"], ne[i], rtol=0, atol=0)
    # Trimmed and zero-padded: the second prompt is short, its padding rows are exact zeros.
    tokens = len(adapter.tokenizer(PROMPTS[1].split()[1]).input_ids)
    assert tokens < 16 and (rows[0]["prompt_embeds"][-1] == 0).all()


def test_missing_negative_prompt_is_the_empty_string(adapter):
    a, b = adapter.preprocess([ConditionInput(PROMPTS[0]), ConditionInput(PROMPTS[1], negative_prompt="")])
    torch.testing.assert_close(a["negative_prompt_embeds"], b["negative_prompt_embeds"], rtol=0, atol=0)


def test_preprocess_rejects_input_media(adapter):
    with pytest.raises(ValueError, match="no input media"):
        adapter.preprocess([ConditionInput("x", media=[{"type": "image", "data": torch.zeros(3, 4, 4)}])])


def test_prepare_condition_pads_or_trims_text_to_the_sequence_length(adapter):
    rows = adapter.preprocess([ConditionInput(PROMPTS[0])])
    full = adapter.prepare_condition(default_collate(rows))
    short = adapter.prepare_condition({k: v[None, :10] for k, v in rows[0].items()})  # stored stripped
    torch.testing.assert_close(short["prompt_embeds"], full["prompt_embeds"], rtol=0, atol=0)


def test_stripped_text_embeddings_collate_padded_to_the_pipelines_zeros(adapter):
    """Shards store text embeddings without padding ([L_i, D]): the pad rule batches them, and the condition equals
    the one of fully padded rows."""
    from ff_core.data.cache.collation import collate_conditions

    rows = adapter.preprocess([ConditionInput(p) for p in PROMPTS])
    lengths = [int((r["prompt_embeds"].abs().sum(-1) > 0).sum()) for r in rows]
    assert len(set(lengths)) == 2  # different prompt lengths
    stripped = [{k: v[:n] for k, v in r.items()} for r, n in zip(rows, lengths)]
    batch = collate_conditions(stripped, adapter.condition_collation)
    assert batch["prompt_embeds_mask"].sum(1).tolist() == lengths
    ours = adapter.prepare_condition(batch)
    assert "prompt_embeds_mask" not in ours
    torch.testing.assert_close(ours["prompt_embeds"], adapter.prepare_condition(default_collate(rows))["prompt_embeds"],
                               rtol=0, atol=0)


# -- latent normalisation ----------------------------------------------------------------------------
def test_encode_output_normalises_the_posterior_sample_with_the_vae_config(adapter, condition):
    """``(z - latents_mean) / latents_std`` per channel, from the config's lists (by hand), of the posterior sample
    drawn from the generator; uint8 maps to [-1, 1] once."""
    media = _videos(2)
    z = adapter.encode_output(media, condition, generator=torch.Generator().manual_seed(4)).components["latent"]
    assert z.shape == (2, 4, 3, 4, 4)
    x = torch.stack([m[0] for m in media]).permute(0, 2, 1, 3, 4).float() / 127.5 - 1
    raw = adapter.vae.encode(x).latent_dist.sample(generator=torch.Generator().manual_seed(4))
    cfg = adapter.vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
    assert not torch.allclose(mean, torch.zeros_like(mean)) and not torch.allclose(std, torch.ones_like(std))
    torch.testing.assert_close(z, (raw - mean) / std)
    torch.testing.assert_close(adapter.denormalize(z), raw)


def test_encode_output_checks_the_clip(adapter, condition):
    with pytest.raises(ValueError, match=r"media\[0\]: a clip of 6 frames at 32x32; Wan needs \(frames - 1\) % 4"):
        adapter.encode_output([[torch.zeros(6, 3, SIZE, SIZE, dtype=torch.uint8)]], condition)
    with pytest.raises(ValueError, match=r"media\[1\]: a clip of 9 frames at 32x24; .* multiples of 16x16"):
        adapter.encode_output([[torch.zeros(9, 3, SIZE, SIZE, dtype=torch.uint8)]] * 1
                              + [[torch.zeros(9, 3, SIZE, 24, dtype=torch.uint8)]], condition)  # fmt: skip
    with pytest.raises(ValueError, match=r"media\[0\]: expected one video"):
        adapter.encode_output([[torch.zeros(3, SIZE, SIZE, dtype=torch.uint8)]], condition)
    with pytest.raises(ValueError, match="videos of one batch must share a shape"):
        adapter.encode_output([[torch.zeros(9, 3, SIZE, SIZE, dtype=torch.uint8)],
                               [torch.zeros(5, 3, SIZE, SIZE, dtype=torch.uint8)]], condition)  # fmt: skip


def test_bucketed_clips_of_another_geometry_encode_and_count_their_tokens(adapter, condition):
    """data.buckets fits targets to other geometries than the adapter's: any valid Wan clip encodes, and
    ``denoiser_tokens`` sizes its batches ((1 + (F - 1) / 4) * (H / 16) * (W / 16))."""
    z = adapter.encode_output([[torch.zeros(5, 3, 16, 48, dtype=torch.uint8)]], condition).components["latent"]
    assert z.shape == (1, 4, 2, 2, 6)
    assert adapter.denoiser_tokens(MediaGeometry(16, 48, num_frames=5, fps=8.0)) == 2 * 1 * 3
    assert adapter.denoiser_tokens(MediaGeometry(480, 832, num_frames=81, fps=16.0)) == 21 * 30 * 52


def test_encode_output_takes_decoded_videos(adapter, condition):
    from ff_core.data.media.decode import DecodedVideo

    media = _videos(1)
    frames = media[0][0].permute(0, 2, 3, 1).contiguous()  # what the loader decodes: (F, H, W, 3)
    video = DecodedVideo(frames, FPS, torch.arange(FRAMES, dtype=torch.float64) / FPS)
    g = lambda: torch.Generator().manual_seed(1)  # noqa: E731
    a = adapter.encode_output([[video]], condition, generator=g()).components["latent"]
    b = adapter.encode_output(media, condition, generator=g()).components["latent"]
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# -- denoiser ----------------------------------------------------------------------------------------
def test_velocity_is_the_transformer_at_sigma_times_1000(adapter, condition):
    x = torch.randn(2, 4, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.25, 0.9])
    v = adapter.velocity(LatentState({"latent": x}), sigma, condition).components["latent"]
    expected = adapter.transformer(hidden_states=x, timestep=torch.tensor([250.0, 900.0]),
                                   encoder_hidden_states=condition["prompt_embeds"]).sample  # fmt: skip
    torch.testing.assert_close(v, expected)
    assert v.requires_grad
    v.sum().backward()
    assert adapter.transformer.patch_embedding.weight.grad is not None
    assert all(p.grad is None for p in adapter.text_encoder.parameters())
    adapter.zero_grad(set_to_none=True)


# -- generation: one full sampling run against WanPipeline -----------------------------------------
def test_decode_gives_uint8_videos(adapter):
    videos = adapter.decode(LatentState({"latent": torch.randn(2, 4, 3, 4, 4)}))
    assert [tuple(v[0].shape) for v in videos] == [(FRAMES, 3, SIZE, SIZE)] * 2
    assert all(v[0].dtype == torch.uint8 for v in videos)


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_sampling_matches_wan_pipeline(adapter, condition, pipe, guidance):
    """Same noise (seeded generator), sigmas, CFG and VAE decode as ``WanPipeline.__call__``: equal up to the uint8
    rounding of our output."""
    state = adapter.sample(condition, num_steps=3, guidance_scale=guidance, generator=torch.Generator().manual_seed(7))
    ours = torch.stack([m[0] for m in adapter.decode(state)])
    theirs = pipe(PROMPTS, num_inference_steps=3, guidance_scale=guidance, height=SIZE, width=SIZE,
                  num_frames=FRAMES, output_type="pt", generator=torch.Generator().manual_seed(7),
                  max_sequence_length=adapter.max_sequence_length).frames  # fmt: skip
    assert ours.shape == theirs.shape == (2, FRAMES, 3, SIZE, SIZE)
    assert (ours.float() - theirs * 255).abs().max() <= 0.5 + 1e-4  # rounding to uint8 only


def test_sampling_sigmas_follow_the_scheduler_shift(adapter, pipe):
    assert adapter.timestep_shift() == 3.0
    pipe.scheduler.set_timesteps(4)
    torch.testing.assert_close(adapter.sampling_sigmas(4), pipe.scheduler.sigmas.float(), rtol=0, atol=0)


def test_unipc_checkpoints_euler_sigmas_take_their_flow_shift(adapter):
    """Released Wan checkpoints ship ``UniPCMultistepScheduler(flow_shift=...)``: the Euler sigmas (GRPO rollouts',
    ``model.sampling.scheduler: euler``'s) take its shift; evaluation's UniPC steps: test_wan_schedulers.py."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    saved, adapter.scheduler = adapter.scheduler, unipc
    try:
        assert adapter.timestep_shift() == 5.0
        euler = FlowMatchEulerDiscreteScheduler(shift=5.0)
        euler.set_timesteps(4)
        torch.testing.assert_close(adapter.sampling_sigmas(4), euler.sigmas.float(), rtol=0, atol=0)
    finally:
        adapter.scheduler = saved


# -- LoRA export -------------------------------------------------------------------------------------
def test_exported_lora_loads_into_wan_pipeline_and_changes_the_output_alike(t2v, tmp_path):
    """A LoRA trained in ff (random lora_B: a trained one), exported, loaded by ``WanPipeline.load_lora_weights`` and
    fused gives ``W + alpha / r * B @ A`` (by hand), and the pipeline then generates what ff samples."""
    from diffusers import WanPipeline, WanTransformer3DModel

    from ff_core.lora import LoRAConfig, apply_lora, lora_config, lora_state_dict

    adapter = WanT2VAdapter.from_pretrained(t2v, **ADAPTER_KWARGS)
    apply_lora(adapter, LoRAConfig(rank=4, alpha=8))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        expected = {}
        for name, module in adapter.transformer.named_modules():
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
                expected[f"{name}.weight"] = module.base_layer.weight + 2.0 * b @ a
    assert len(expected) == 4 * 2  # to_q, to_k, to_v, to_out.0 of self- and cross-attention, one block
    adapter.save_lora(tmp_path / "lora", lora_state_dict(adapter), lora_config(adapter))

    pipe = WanPipeline.from_pretrained(t2v)
    pipe.load_lora_weights(tmp_path / "lora")
    cond = adapter.prepare_condition(default_collate(adapter.preprocess([ConditionInput(PROMPTS[0])])))
    ours = adapter.decode(adapter.sample(cond, num_steps=2, generator=torch.Generator().manual_seed(3)))[0][0]
    theirs = pipe(PROMPTS[0], num_inference_steps=2, guidance_scale=1.0, height=SIZE, width=SIZE, num_frames=FRAMES,
                  output_type="pt", generator=torch.Generator().manual_seed(3),
                  max_sequence_length=adapter.max_sequence_length).frames[0]  # fmt: skip
    assert (ours.float() - theirs * 255).abs().max() <= 0.5 + 1e-4
    base = WanPipeline.from_pretrained(t2v)(
        PROMPTS[0], num_inference_steps=2, guidance_scale=1.0, height=SIZE, width=SIZE, num_frames=FRAMES,
        output_type="pt", generator=torch.Generator().manual_seed(3), max_sequence_length=16,
    ).frames[0]  # fmt: skip
    assert (base - theirs).abs().max() > 1 / 255  # the LoRA changes the output
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    fused = pipe.transformer.state_dict()
    plain = WanTransformer3DModel.from_pretrained(t2v, subfolder="transformer").state_dict()
    assert fused.keys() == plain.keys()
    for key, value in fused.items():
        torch.testing.assert_close(value, expected.get(key, plain[key]), msg=lambda m: f"{key}: {m}")


def test_two_expert_t2v_sampling_matches_wan_pipeline(tiny_wan):
    """Wan2.2 T2V-A14B layout: both experts load, the boundary switches them as ``WanPipeline`` does (CFG on both)."""
    from diffusers import WanPipeline
    from ff_wan.adapter import wan_variant

    path = tiny_wan("t2v_a14b")
    assert wan_variant(path) == "t2v"  # a text-to-video checkpoint, whatever its experts
    adapter = WanT2VAdapter.from_pretrained(path, **ADAPTER_KWARGS)
    assert set(adapter.denoisers()) == {"transformer", "transformer_2"} and adapter.boundary_ratio == 0.875
    condition = adapter.prepare_condition(default_collate(adapter.preprocess([ConditionInput(p) for p in PROMPTS])))
    ours = torch.stack([m[0] for m in adapter.decode(adapter.sample(
        condition, num_steps=4, guidance_scale=3.0, generator=torch.Generator().manual_seed(2)))])
    theirs = WanPipeline.from_pretrained(path)(
        PROMPTS, num_inference_steps=4, guidance_scale=3.0, height=SIZE, width=SIZE, num_frames=FRAMES,
        output_type="pt", generator=torch.Generator().manual_seed(2), max_sequence_length=16,
    ).frames  # fmt: skip
    assert (ours.float() - theirs * 255).abs().max() <= 0.5 + 1e-4


def test_sharding_blocks_are_each_experts_transformer_blocks(adapter, tiny_wan):
    """FSDP2's units (docs/scaling.md): each trained network's ``blocks``, as the Adapter default finds them from
    diffusers' ``_no_split_modules``; both experts of a two-expert checkpoint."""
    from ff_core.adapter import Adapter

    blocks = adapter.sharding_blocks()
    assert blocks == {"transformer": list(adapter.transformer.blocks)} == Adapter.sharding_blocks(adapter)
    experts = WanT2VAdapter.from_pretrained(tiny_wan("t2v_a14b"), **ADAPTER_KWARGS)
    blocks = experts.sharding_blocks()
    assert list(blocks) == ["transformer", "transformer_2"]
    assert blocks["transformer_2"] == list(experts.transformer_2.blocks) and blocks["transformer_2"]
