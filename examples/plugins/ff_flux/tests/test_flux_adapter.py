"""FluxAdapter on tiny guidance-embedded (dev-like) and guidance-free (schnell-like) checkpoints, beyond the kit's
reference checks against ``FluxPipeline`` (test_flux_conformance.py: prompt encoding, sigmas, the denoiser at each
sigma, sampling with and without true CFG, decoding, LoRA): the guidance embedding per checkpoint and ff's
``embedded_guidance`` as the pipeline's ``guidance_scale``, the packing layout by hand, the resolution-dependent shift
against a hand computation, the VAE's shift and scale."""

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
        with pytest.raises(ValueError, match=r"adapter_kwargs\.embedded_guidance: 2\.0 is set.*no guidance embedding"):
            FluxAdapter.from_pretrained(path, resolution=RES, embedded_guidance=2.0)


def test_resolution_must_fit_the_packed_latent_grid(tiny_flux_dev):
    with pytest.raises(ValueError, match="multiple of 8"):
        FluxAdapter.from_pretrained(tiny_flux_dev, resolution=36)


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


# -- guidance and the VAE ---------------------------------------------------------------------------------
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
