"""FluxAdapter on tiny guidance-embedded (dev-like) and guidance-free (schnell-like) checkpoints: parity with diffusers'
``FluxPipeline`` (prompt encoding, sigmas, a full sampling run from the same seed, decoding, embedded guidance, true
CFG), the resolution-dependent shift against a hand computation, LoRA export loaded by ``load_lora_weights``."""

from __future__ import annotations

import math

import pytest
import torch
from ff_flux import FluxAdapter
from torch.utils.data import default_collate

from ff_core.adapter import ConditionInput, LatentState
from ff_core.plugins import get_adapter_class, get_registry

RES = 32
PROMPTS = ["a red circle on a white background", "a blue square on a black background"]


@pytest.fixture(scope="module", params=["dev", "schnell"])
def variant(request, tiny_flux_dev, tiny_flux_schnell):
    """``(name, checkpoint folder)``: every parity test runs on both kinds of checkpoint."""
    return request.param, {"dev": tiny_flux_dev, "schnell": tiny_flux_schnell}[request.param]


@pytest.fixture(scope="module")
def adapter(variant):
    return FluxAdapter.from_pretrained(variant[1], resolution=RES)


@pytest.fixture(scope="module")
def pipe(variant):
    from diffusers import FluxPipeline

    return FluxPipeline.from_pretrained(variant[1])


@pytest.fixture(scope="module")
def condition(adapter):
    rows = adapter.preprocess([ConditionInput(p) for p in PROMPTS])
    return adapter.prepare_condition(default_collate(rows))


def run_pipe(pipe, adapter, seed, output_type="latent", **kwargs):
    return pipe(PROMPTS, num_inference_steps=3, height=RES, width=RES, output_type=output_type,
                generator=torch.Generator().manual_seed(seed), max_sequence_length=adapter.max_sequence_length,
                **kwargs).images  # fmt: skip


def packed(adapter, state: LatentState) -> torch.Tensor:
    from diffusers import FluxPipeline

    x = state.components["latent"]
    return FluxPipeline._pack_latents(x, *x.shape)


# -- discovery and loading ---------------------------------------------------------------------------
def test_registered_as_flux1():
    info = get_registry().adapters()["flux1"]
    assert info.cls is FluxAdapter and get_adapter_class("flux1") is FluxAdapter
    assert "image" in info.summary


def test_guidance_embedding_follows_the_checkpoint(variant, adapter):
    name, path = variant
    assert adapter.transformer.config.guidance_embeds is (name == "dev")
    assert adapter.embedded_guidance == (3.5 if name == "dev" else None)  # FluxPipeline's default guidance_scale
    if name == "dev":
        assert FluxAdapter.from_pretrained(path, resolution=RES, embedded_guidance=2.0).embedded_guidance == 2.0
    else:
        with pytest.raises(ValueError, match=r"adapter_kwargs\.embedded_guidance=2\.0.*no guidance embedding"):
            FluxAdapter.from_pretrained(path, resolution=RES, embedded_guidance=2.0)


def test_resolution_must_fit_the_packed_latent_grid(tiny_flux_dev):
    with pytest.raises(ValueError, match="multiple of 8"):
        FluxAdapter.from_pretrained(tiny_flux_dev, resolution=36)


# -- condition side ----------------------------------------------------------------------------------
def test_preprocess_matches_flux_pipeline_encode_prompt(adapter, pipe):
    rows = adapter.preprocess([ConditionInput(p, negative_prompt="blurry") for p in PROMPTS])
    pe, pp, text_ids = pipe.encode_prompt(PROMPTS, None, max_sequence_length=adapter.max_sequence_length, device="cpu")
    ne, npp, _ = pipe.encode_prompt(["blurry"] * 2, None, max_sequence_length=adapter.max_sequence_length,
                                    device="cpu")  # fmt: skip
    assert text_ids.abs().sum() == 0  # text positions are zeros: velocity builds them, nothing is cached
    for i, row in enumerate(rows):
        assert row["prompt_embeds"].shape == (16, 64) and row["pooled_prompt_embeds"].shape == (32,)
        torch.testing.assert_close(row["prompt_embeds"], pe[i], msg="T5 prompt embeddings differ from the pipeline's")
        torch.testing.assert_close(row["pooled_prompt_embeds"], pp[i], msg="CLIP pooled embeddings differ")
        torch.testing.assert_close(row["negative_prompt_embeds"], ne[i])
        torch.testing.assert_close(row["negative_pooled_prompt_embeds"], npp[i])


# -- the denoiser and its schedule -------------------------------------------------------------------
def test_latents_are_unpacked_and_packing_round_trips(adapter, condition):
    """LatentState holds image-shaped latents (B, C, h, w); velocity packs them into (h/2)(w/2) tokens of 4C
    features, and the pipeline's unpack inverts that pack exactly (a wrong permutation would not)."""
    from diffusers import FluxPipeline

    noise = adapter.initial_noise(condition, torch.Generator().manual_seed(0)).components["latent"]
    assert noise.shape == (2, 4, 8, 8)
    tokens = FluxPipeline._pack_latents(noise, 2, 4, 8, 8)
    assert tokens.shape == (2, 16, 16)
    # token (row 1, col 2) holds channel 3's 2 x 2 patch at latent rows 2-3, cols 4-5, in (c, dy, dx) order
    torch.testing.assert_close(tokens[0, 1 * 4 + 2, 12:16], noise[0, 3, 2:4, 4:6].reshape(4), rtol=0, atol=0)
    back = FluxPipeline._unpack_latents(tokens, RES, RES, adapter.vae_scale_factor)
    torch.testing.assert_close(back, noise, rtol=0, atol=0)


@pytest.mark.parametrize("num_steps", [1, 3, 8])
def test_sampling_sigmas_are_the_pipelines_with_the_hand_computed_shift(adapter, pipe, num_steps):
    """16 image tokens: ``mu = 0.5 + (1.15 - 0.5) (16 - 256) / (4096 - 256) = 0.459375``; sigmas are
    ``e^mu / (e^mu + 1/t - 1)`` of ``t = linspace(1, 1/n, n)``, then 0 (FluxPipeline's
    FlowMatchEulerDiscreteScheduler)."""
    mu = 0.5 + 0.65 * (16 - 256) / 3840
    assert mu == pytest.approx(0.459375)
    t = torch.linspace(1, 1 / num_steps, num_steps, dtype=torch.float64)
    expected = torch.cat([math.exp(mu) / (math.exp(mu) + 1 / t - 1), torch.zeros(1, dtype=torch.float64)]).float()
    torch.testing.assert_close(adapter.sampling_sigmas(num_steps), expected)
    assert adapter.timestep_shift() == pytest.approx(math.exp(mu))
    if num_steps == 3:  # the schedule a pipeline run leaves on its scheduler
        run_pipe(pipe, adapter, 0)
        torch.testing.assert_close(adapter.sampling_sigmas(3), pipe.scheduler.sigmas.float())


def test_schedule_and_training_shift_follow_the_latent_size(adapter):
    """A 64 x 64 latent is 1024 tokens: ``mu = 0.5 + 0.65 * 768 / 3840 = 0.63`` for sampling and training alike."""
    big = LatentState({"latent": torch.zeros(1, 4, 64, 64)})
    assert adapter.timestep_shift(big) == pytest.approx(math.exp(0.63))
    t = torch.linspace(1, 0.25, 4, dtype=torch.float64)
    expected = torch.cat([math.exp(0.63) / (math.exp(0.63) + 1 / t - 1), torch.zeros(1, dtype=torch.float64)])
    torch.testing.assert_close(adapter.sampling_sigmas(4, state=big), expected.float())


@pytest.mark.parametrize("sigma", [[1.0, 0.6], [0.3, 0.05]])
def test_velocity_is_the_pipelines_transformer_call(adapter, pipe, condition, sigma):
    """One denoiser call at several noise levels as ``FluxPipeline.__call__`` makes it: packed latents, ``t / 1000``
    with ``t = 1000 sigma``, guidance 3.5 for a guidance-embedded transformer, zero text ids, (0, row, col) image
    ids."""
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor(sigma)
    v = adapter.velocity(LatentState({"latent": x}), sigma, condition).components["latent"]
    tokens = pipe._pack_latents(x, 2, 4, 8, 8)
    guidance = torch.full((2,), 3.5) if pipe.transformer.config.guidance_embeds else None
    with torch.no_grad():
        ref = pipe.transformer(hidden_states=tokens, timestep=(sigma * 1000) / 1000, guidance=guidance,
                               pooled_projections=condition["pooled_prompt_embeds"],
                               encoder_hidden_states=condition["prompt_embeds"], txt_ids=torch.zeros(16, 3),
                               img_ids=pipe._prepare_latent_image_ids(2, 4, 4, "cpu", torch.float32),
                               return_dict=False)[0]  # fmt: skip
    torch.testing.assert_close(packed(adapter, LatentState({"latent": v})), ref,
                               msg=lambda m: f"velocity differs from FluxPipeline's transformer call: {m}")
    assert v.requires_grad  # trainable path


# -- whole runs ----------------------------------------------------------------------------------------
def test_sampling_and_decoding_match_the_pipeline(adapter, condition, pipe):
    """Same seed: same initial noise, sigmas, guidance, Euler steps (compared packed, as the pipeline returns them)
    and the same decoded images (up to uint8 rounding)."""
    state = adapter.sample(condition, num_steps=3, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(packed(adapter, state), run_pipe(pipe, adapter, 7),
                               msg=lambda m: f"final latents differ from FluxPipeline's: {m}")
    ours = torch.stack([m[0] for m in adapter.decode(state)])
    theirs = run_pipe(pipe, adapter, 7, output_type="pt")
    assert (ours.float() - theirs * 255).abs().max() <= 1.0  # rounding to uint8 only


def test_embedded_guidance_is_the_pipelines_guidance_scale(variant, adapter, condition, pipe):
    """``model.sampling.embedded_guidance`` is FluxPipeline's ``guidance_scale``: one forward per step."""
    if variant[0] == "schnell":
        with pytest.raises(ValueError, match="no guidance embedding"):
            adapter.sample(condition, num_steps=2, embedded_guidance=2.0)
        return
    state = adapter.sample(condition, num_steps=3, generator=torch.Generator().manual_seed(3), embedded_guidance=1.5)
    torch.testing.assert_close(packed(adapter, state), run_pipe(pipe, adapter, 3, guidance_scale=1.5))
    default = adapter.sample(condition, num_steps=3, generator=torch.Generator().manual_seed(3))
    assert not torch.allclose(default.components["latent"], state.components["latent"])


def test_cfg_is_the_pipelines_true_cfg(adapter, pipe):
    """ff's ``guidance_scale`` with a negative prompt is FluxPipeline's ``true_cfg_scale``: two forwards per step."""
    rows = adapter.preprocess([ConditionInput(p, negative_prompt="blurry") for p in PROMPTS])
    condition = adapter.prepare_condition(default_collate(rows))
    state = adapter.sample(condition, num_steps=3, guidance_scale=4.0, generator=torch.Generator().manual_seed(5))
    theirs = run_pipe(pipe, adapter, 5, true_cfg_scale=4.0, negative_prompt=["blurry"] * 2)
    torch.testing.assert_close(packed(adapter, state), theirs)
    plain = adapter.sample(condition, num_steps=3, generator=torch.Generator().manual_seed(5))
    assert not torch.allclose(plain.components["latent"], state.components["latent"])


def test_encode_applies_the_vae_shift_and_scale(adapter, condition):
    """FLUX.1's VAE shifts and scales (0.1159, 0.3611): ``(z - shift) * scale`` of the posterior sample."""
    cfg = adapter.vae.config
    assert (cfg.shift_factor, cfg.scaling_factor) == (0.1159, 0.3611)
    images = [[torch.randint(0, 256, (3, RES, RES), generator=torch.Generator().manual_seed(i), dtype=torch.uint8)]
              for i in range(2)]  # fmt: skip
    state = adapter.encode_output(images, condition, generator=torch.Generator().manual_seed(0))
    x = torch.stack([m[0] for m in images]).float() / 127.5 - 1
    with torch.no_grad():
        raw = adapter.vae.encode(x).latent_dist.sample(generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(state.components["latent"], (raw - 0.1159) * 0.3611)


# -- LoRA export -------------------------------------------------------------------------------------
def test_exported_lora_loads_and_fuses_in_flux_pipeline(variant, tmp_path):
    """ff's LoRA export, loaded by ``FluxPipeline.load_lora_weights`` and fused, gives the weights ff trained:
    ``W + alpha / rank * B @ A`` (a hand merge)."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    from ff_core.module import LoRAConfig, apply_lora, lora_config, lora_state_dict

    adapter = FluxAdapter.from_pretrained(variant[1], resolution=RES)
    apply_lora(adapter, LoRAConfig(rank=4, alpha=8))
    g = torch.Generator().manual_seed(0)
    expected = {}
    with torch.no_grad():
        for name, p in adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        for name, module in adapter.transformer.named_modules():
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
                expected[f"{name}.weight"] = module.base_layer.weight + 2.0 * b @ a
    assert expected
    adapter.save_lora(tmp_path / "lora", lora_state_dict(adapter), lora_config(adapter))
    pipe = FluxPipeline.from_pretrained(variant[1])
    pipe.load_lora_weights(tmp_path / "lora")
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    fused = pipe.transformer.state_dict()
    base = FluxTransformer2DModel.from_pretrained(variant[1], subfolder="transformer").state_dict()
    assert fused.keys() == base.keys()
    for key, value in fused.items():
        torch.testing.assert_close(value, expected.get(key, base[key]), msg=lambda m: f"{key}: {m}")
