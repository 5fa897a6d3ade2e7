"""FluxAdapter against ff's adapter conformance kit, on a guidance-embedded and a guidance-free tiny checkpoint."""

from ff_flux import FluxAdapter
from ff_flux.testing import build_tiny_flux

from ff_core.testing.conformance import AdapterConformance


class TestFluxDevConformance(AdapterConformance):
    adapter_cls = FluxAdapter
    adapter_kwargs = {"resolution": 32}

    def build_checkpoint(self, path):
        return build_tiny_flux(path, guidance_embeds=True)


class TestFluxSchnellConformance(AdapterConformance):
    adapter_cls = FluxAdapter
    adapter_kwargs = {"resolution": 32}

    def build_checkpoint(self, path):
        return build_tiny_flux(path, guidance_embeds=False)
