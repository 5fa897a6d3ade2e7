"""SD3Adapter against ff's adapter conformance kit (the checks every plugin runs), maths checks against diffusers'
StableDiffusion3Pipeline included."""

import pytest
from diffusers import StableDiffusion3Pipeline
from ff_sd3.adapter import SD3Adapter
from ff_sd3.testing import build_tiny_sd3

from ff_core.testing.conformance import AdapterConformance


class SD3Kit(AdapterConformance):
    """The kit configured for SD3 (not collected: the broken-adapter tests reuse it)."""

    adapter_cls = SD3Adapter
    adapter_kwargs = {"resolution": 32}
    reference_pipeline = StableDiffusion3Pipeline

    def build_checkpoint(self, path):
        # A latent normalisation that is not the identity, so decoding that ignores it differs from the pipeline's.
        return build_tiny_sd3(path, num_layers=2, vae_shift_factor=0.3, vae_scaling_factor=1.7)

    def reference_call_kwargs(self, adapter, inputs):
        return {**super().reference_call_kwargs(adapter, inputs), "max_sequence_length": adapter.max_sequence_length}


class TestSD3Conformance(SD3Kit):
    @pytest.fixture(scope="class")
    @classmethod
    def trained_pretrained(cls, trained_sd3):
        """The session's tiny SD3 whose VAE is trained on the shapes (conftest), for the round trip."""
        return trained_sd3
