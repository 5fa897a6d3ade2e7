"""wan2_t2v against ff's adapter conformance kit (the checks every plugin runs), with video targets."""

import torch
from ff_wan import WanT2VAdapter
from ff_wan.testing import build_tiny_wan
from wan_geometry import ADAPTER_KWARGS, FRAMES, SIZE

from ff_core.testing.conformance import AdapterConformance


class TestWanT2VConformance(AdapterConformance):
    adapter_cls = WanT2VAdapter
    adapter_kwargs = ADAPTER_KWARGS

    def build_checkpoint(self, path):
        return build_tiny_wan(path, variant="t2v")

    def make_targets(self, adapter, n):
        g = torch.Generator().manual_seed(0)
        return [[torch.randint(0, 256, (FRAMES, 3, SIZE, SIZE), generator=g, dtype=torch.uint8)] for _ in range(n)]
