"""SD3Adapter against ff's adapter conformance kit (the checks every plugin runs)."""

from ff_sd3.adapter import SD3Adapter
from ff_sd3.testing import build_tiny_sd3

from ff_core.testing.conformance import AdapterConformance


class TestSD3Conformance(AdapterConformance):
    adapter_cls = SD3Adapter
    adapter_kwargs = {"resolution": 32}

    def build_checkpoint(self, path):
        return build_tiny_sd3(path, num_layers=2)
