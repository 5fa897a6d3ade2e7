"""The FLUX.1 port's likeliest bugs, each caught by the kit against FluxPipeline with a message naming it: the
timestep scaled by 1000 as SD3's velocity does (FLUX's transformer scales it itself), the VAE's shift and scale
ignored, and a latent unpack with the right shape and the wrong permutation. The unbroken adapter passes every check
(test_flux_conformance.py, whose kit configuration this reuses)."""

from __future__ import annotations

import re

import pytest
import torch
from diffusers import FluxPipeline
from ff_flux import FluxAdapter
from test_flux_conformance import FluxKit

from ff_core.adapter import LatentState


class TimestepTimes1000(FluxAdapter):
    """Copied from SD3's velocity: ``sigma * num_train_timesteps``, which FLUX's transformer multiplies again."""

    def velocity(self, state, sigma, condition):
        return super().velocity(state, sigma * self.scheduler.config.num_train_timesteps, condition)


class VAENormalisationIgnored(FluxAdapter):
    """Decodes raw latents: FLUX.1's ``shift_factor`` / ``scaling_factor`` (0.1159, 0.3611) ignored."""

    @torch.no_grad()
    def decode(self, state):
        images = self.vae.decode(state.components["latent"], return_dict=False)[0]
        return [[img] for img in ((images / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)]


class WrongUnpackPermutation(FluxAdapter):
    """Unpacks tokens (B, hw/4, 4C) as (B, h/2, w/2, 2, 2, C) — the patch offsets before the channels, where the
    pipeline packs ``(C, dy, dx)`` — the right shape, the wrong layout."""

    def velocity(self, state, sigma, condition):
        v = super().velocity(state, sigma, condition).components["latent"]
        b, c, h, w = v.shape
        tokens = FluxPipeline._pack_latents(v, b, c, h, w)
        wrong = tokens.view(b, h // 2, w // 2, 2, 2, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h, w)
        return LatentState({"latent": wrong}, dict(state.masks))


class EmbeddedGuidanceIgnored(FluxAdapter):
    """Feeds the transformer its default distilled guidance whatever the condition asks
    (``model.sampling.embedded_guidance`` silently unused)."""

    def velocity(self, state, sigma, condition):
        return super().velocity(state, sigma, {k: v for k, v in condition.items() if k != "embedded_guidance"})


class PooledFromTheFirstToken(FluxAdapter):
    """Pools CLIP by its first token (``last_hidden_state[:, 0]``) instead of ``pooler_output``: FluxPipeline's
    step callback holds no pooled embedding, so only its ``encode_prompt`` tells."""

    def encode_prompt(self, prompts):
        embeds, _ = super().encode_prompt(prompts)
        ids = self.tokenizer(prompts, padding="max_length", max_length=self.tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").input_ids  # fmt: skip
        return embeds, self.text_encoder(ids).last_hidden_state[:, 0]


class NegativeBranchWithPositivePooled(FluxAdapter):
    """The negative branch keeps the positive prompt's pooled embedding (a copy-paste slip in ``unconditional``)."""

    def unconditional(self, condition):
        return {**super().unconditional(condition), "pooled_prompt_embeds": condition["pooled_prompt_embeds"]}


BROKEN = {
    "timestep x1000 twice": (TimestepTimes1000, "denoiser", r"timestep x1000 .* scaled by num_train_timesteps twice"),
    "VAE shift/scale ignored": (VAENormalisationIgnored, "decoding", r"decoded output 0 of sample 0 .* differs"),
    "embedded guidance ignored": (EmbeddedGuidanceIgnored, "embedded_guidance",
                                  r"embedded guidance 1\.5 differs .* velocity ignores the condition's embedded "
                                  r"guidance"),
    "pooled CLIP embedding from the first token": (PooledFromTheFirstToken, "condition",
                                                   r"prompt encoding differs .*condition\['pooled_prompt_embeds'\]"),
    "negative branch with the positive pooled embedding": (
        NegativeBranchWithPositivePooled, "condition",
        r"the negative branch .* differs .*negative prompts: condition\['pooled_prompt_embeds'\]"),
    "wrong unpack permutation": (WrongUnpackPermutation, "denoiser",
                                 r"values in another order: a wrong latent packing/unpacking permutation"),
}  # fmt: skip


@pytest.fixture(scope="module")
def kit():
    return FluxKit()


@pytest.fixture(scope="module")
def pipe(kit, tiny_flux_dev):
    return kit.load_reference_pipeline(tiny_flux_dev)


@pytest.mark.parametrize("bug", list(BROKEN))
def test_each_broken_flux_adapter_fails_the_kit_naming_its_problem(kit, tiny_flux_dev, pipe, tmp_path, bug):
    """The check that must catch it, alone (``kit.run_checks`` runs them all, LoRA included: slower)."""
    cls, check, message = BROKEN[bug]
    adapter = cls.from_pretrained(tiny_flux_dev, **kit.adapter_kwargs)
    case = kit.run_reference(adapter, pipe, kit.make_inputs(adapter, tmp_path), guidance_scale=1.0)
    with pytest.raises(AssertionError) as failure:
        getattr(kit, f"check_{check}")(adapter, pipe, case)
    assert re.search(message, str(failure.value)), str(failure.value)
