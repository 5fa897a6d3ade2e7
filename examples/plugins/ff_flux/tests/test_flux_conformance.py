"""FluxAdapter against ff's adapter conformance kit, maths checks against diffusers' FluxPipeline included, on a
guidance-embedded (dev-like) and a guidance-free (schnell-like) tiny checkpoint."""

import pytest
import torch
from diffusers import FluxPipeline
from ff_flux import FluxAdapter
from ff_flux.testing import build_tiny_flux

from ff_core.adapter import LatentState
from ff_core.testing.conformance import AdapterConformance
from ff_core.testing.reference import LatentLayout


def to_pipeline(pipe, state):
    """The adapter's unpacked (B, C, h, w) latents in FluxPipeline's packed token layout, by the pipeline's own code."""
    x = state.components["latent"]
    return FluxPipeline._pack_latents(x, *x.shape)


def from_pipeline(pipe, latents, like):
    """FluxPipeline's packed latents unpacked by the pipeline's own code, shaped like the adapter's state."""
    h, w = like.components["latent"].shape[-2:]
    scale = pipe.vae_scale_factor
    return LatentState({"latent": FluxPipeline._unpack_latents(latents, h * scale, w * scale, scale)})


class FluxKit(AdapterConformance):
    """The kit configured for FLUX.1 (subclassed per checkpoint kind)."""

    adapter_cls = FluxAdapter
    adapter_kwargs = {"resolution": 32}
    reference_pipeline = FluxPipeline
    # The pipeline packs 2 x 2 latent patches into tokens; ff's state holds them unpacked (LatentState docs).
    reference_layout = LatentLayout(to_pipeline=to_pipeline, from_pipeline=from_pipeline)
    # ff's CFG is FluxPipeline's true_cfg_scale; its guidance_scale is the embedded (distilled) guidance, which the kit
    # passes the adapter's scale through (the dev-like checkpoint; the schnell-like one has none).
    reference_cfg_argument = "true_cfg_scale"
    reference_embedded_guidance_argument = "guidance_scale"
    guidance_embeds = True

    def build_checkpoint(self, path):
        return build_tiny_flux(path, guidance_embeds=self.guidance_embeds)

    def reference_call_kwargs(self, adapter, inputs):
        return {**super().reference_call_kwargs(adapter, inputs), "max_sequence_length": adapter.max_sequence_length}

    def reference_condition(self, pipe, adapter, inputs, run):
        """FluxPipeline hands its step callback ``prompt_embeds`` only: the pooled CLIP embedding comes from its
        ``encode_prompt`` (the kit compares the negative branch through this too, on the negative prompts)."""
        with torch.no_grad():
            embeds, pooled, _ = pipe.encode_prompt([c.prompt for c in inputs], None, device="cpu",
                                                   max_sequence_length=adapter.max_sequence_length)  # fmt: skip
        return {**run.tensors, "prompt_embeds": embeds, "pooled_prompt_embeds": pooled}



class TestFluxDevConformance(FluxKit):
    @pytest.fixture(scope="class")
    @classmethod
    def trained_pretrained(cls, tmp_path_factory, trained_sd3):
        """A dev-like checkpoint with the session's shapes-trained tiny VAE (conftest's ``trained_sd3``: the same
        ``AutoencoderKL`` class), for the encode -> decode round trip."""
        return build_tiny_flux(tmp_path_factory.mktemp("tiny-flux-vae"), vae_from=trained_sd3 / "vae")


class TestFluxSchnellConformance(FluxKit):
    guidance_embeds = False
