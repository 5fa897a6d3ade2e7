"""ltx2_t2av against ff's adapter conformance kit: the plumbing checks every plugin runs (metadata without weights,
registration, stage shapes for both latent streams, seeding, schedule, what trains, the condition cache key,
releasing the text encoder and connectors, the LoRA file format).

The kit's maths checks read the pipeline's latents from its step callback, which ``LTX2Pipeline`` gives for the video
stream only (``_callback_tensor_inputs`` has no ``audio_latents``), so they are off here (no ``reference_pipeline``);
tests/test_ltx2_t2av.py runs the same comparisons with diffusers' pipeline on both streams."""

import math

import torch
from ff_ltx2 import LTX2I2AVAdapter, LTX2T2AVAdapter
from ff_ltx2.testing import build_tiny_ltx2
from ltx2_geometry import ADAPTER_KWARGS, FPS, FRAMES, SIZE

from ff_core.testing.conformance import AdapterConformance


class TestLTX2T2AVConformance(AdapterConformance):
    adapter_cls = LTX2T2AVAdapter
    adapter_kwargs = ADAPTER_KWARGS

    def build_checkpoint(self, path):
        return build_tiny_ltx2(path, variant="t2av")

    def make_targets(self, adapter, n):
        """(video, audio) pairs: random frames, and a 16 kHz stereo tone lasting the clip."""
        g = torch.Generator().manual_seed(0)
        t = torch.arange(round(FRAMES / FPS * 16000)) / 16000
        out = []
        for i in range(n):
            video = torch.randint(0, 256, (FRAMES, 3, SIZE, SIZE), generator=g, dtype=torch.uint8)
            audio = (0.3 * torch.sin(2 * math.pi * 220.0 * (i + 1) * t)).repeat(2, 1)
            out.append([video, audio])
        return out


class TestLTX2I2AVConformance(TestLTX2T2AVConformance):
    """ltx2_i2av: the kit binds a random image to the required ``first_frame`` slot; the pinned first latent frame
    (mask 0) must survive sampling and carry no gradient."""

    adapter_cls = LTX2I2AVAdapter
    adapter_kwargs = {**ADAPTER_KWARGS, "image_crf": 0}

    def build_checkpoint(self, path):
        return build_tiny_ltx2(path, variant="i2av")
