"""wan2_t2v and wan2_i2v against ff's adapter conformance kit (the checks every plugin runs), maths checks against
diffusers' WanPipeline / WanImageToVideoPipeline included: one transformer (Wan2.1) and two experts switched at a
boundary noise level (Wan2.2 A14B); image-to-video conditions built from each checkpoint's contract (first_frame,
last_frame) and passed to the pipeline as its ``image`` / ``last_image``."""

import pytest
import torch
from diffusers import WanImageToVideoPipeline, WanPipeline
from ff_wan import WanI2VAdapter, WanT2VAdapter
from ff_wan.testing import build_tiny_wan
from PIL import Image
from wan_geometry import ADAPTER_KWARGS, FRAMES, SIZE

from ff_core.testing.conformance import AdapterConformance, vae_posterior_sample


def _pil(image: torch.Tensor) -> Image.Image:
    return Image.fromarray(image.permute(1, 2, 0).numpy())


class TestWanT2VConformance(AdapterConformance):
    adapter_cls = WanT2VAdapter
    adapter_kwargs = ADAPTER_KWARGS
    reference_pipeline = WanPipeline
    variant = "t2v"

    def build_checkpoint(self, path):
        return build_tiny_wan(path, variant=self.variant)

    def reference_call_kwargs(self, adapter, inputs):
        return {**super().reference_call_kwargs(adapter, inputs), "max_sequence_length": adapter.max_sequence_length}

    def reference_encode(self, pipe, adapter, targets, generator):
        """Wan's normalisation: ``(z - latents_mean) / latents_std`` per channel, the inverse of WanPipeline's
        ``latents / latents_std + latents_mean`` before decoding."""
        z = vae_posterior_sample(pipe.vae, targets, generator)
        config = pipe.vae.config
        mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1).to(z)
        std = torch.tensor(config.latents_std).view(1, -1, 1, 1, 1).to(z)
        return (z - mean) / std


class TestWanT2VTwoExpertConformance(TestWanT2VConformance):
    variant = "t2v_a14b"


class TestWanI2VConformance(TestWanT2VConformance):
    """Wan2.1 I2V: ``first_frame`` (required) encoded by the VAE and the CLIP image encoder."""

    adapter_cls = WanI2VAdapter
    reference_pipeline = WanImageToVideoPipeline
    variant = "i2v"

    def reference_call_kwargs(self, adapter, inputs):
        (item,) = inputs  # wan2_i2v: max_batch_size 1
        images = {m["slot"]: _pil(m["data"]) for m in item.media}
        return {**super().reference_call_kwargs(adapter, inputs), "image": images["first_frame"],
                "last_image": images.get("last_frame")}  # fmt: skip

    def reference_condition(self, pipe, adapter, inputs, run):
        """Besides the prompt embeddings: ``first_frame_latent`` is ``prepare_latents``' condition, ``clip_feature``
        ``encode_image`` of the bound images."""
        kwargs = self.reference_call_kwargs(adapter, inputs)
        image = pipe.video_processor.preprocess(kwargs["image"], height=SIZE, width=SIZE)
        last = kwargs["last_image"]
        last_image = None if last is None else pipe.video_processor.preprocess(last, height=SIZE, width=SIZE)
        with torch.no_grad():
            latents = pipe.prepare_latents(image, 1, adapter.vae.config.z_dim, SIZE, SIZE, FRAMES, torch.float32,
                                           "cpu", torch.Generator().manual_seed(0), None, last_image)  # fmt: skip
            out = {**run.tensors, "first_frame_latent": latents[1]}  # (TI2V: also the first-frame mask)
            if pipe.image_encoder is not None:
                images = kwargs["image"] if last is None else [kwargs["image"], last]
                out["clip_feature"] = pipe.encode_image(images, "cpu")[None]  # one sample
        return out


class TestWanFLF2VConformance(TestWanI2VConformance):
    """Wan2.1 FLF2V: ``first_frame`` and ``last_frame`` both required."""

    variant = "flf2v"


class TestWanTI2VConformance(TestWanI2VConformance):
    """Wan2.2 TI2V: the first latent frame pinned to the image's, per-token timesteps."""

    variant = "ti2v"


class TestWanA14BConformance(TestWanI2VConformance):
    """Wan2.2 I2V-A14B: two experts, channel-concatenated condition, no image encoder."""

    variant = "a14b"



class _UniPCCheckpoint:
    """A checkpoint saved with the ``UniPCMultistepScheduler`` released Wan checkpoints ship. The kit's sampling runs
    (``test_reference_sampling_run*``) hold ff's evaluation sample to the pipeline's default output, UniPC steps and
    all. Four kit checks compare ff's *Euler* schedule with the pipeline scheduler's table and steps, which a UniPC
    checkpoint does not share: the Euler sigmas (GRPO rollouts', ``scheduler: euler``'s) and the training table are
    ``FlowMatchEulerDiscreteScheduler``'s at the UniPC's ``flow_shift`` (as diffusers' Wan training scripts build
    them), checked on the Euler checkpoints above and in test_wan_t2v.py / test_wan_schedulers.py."""

    def build_checkpoint(self, path):
        return build_tiny_wan(path, variant=self.variant, scheduler="unipc")

    def _euler_only(self):
        pytest.skip("compares ff's Euler schedule with the pipeline's scheduler: a UniPC checkpoint's differ by design "
                    "(checked on the Euler checkpoints)")

    def test_reference_sampling_sigmas(self, *args, **kwargs):
        self._euler_only()

    def test_reference_training_sigmas(self, *args, **kwargs):
        self._euler_only()

    def test_reference_denoiser_at_each_sigma(self, *args, **kwargs):
        self._euler_only()

    def test_reference_lora_loads_through_load_lora_weights(self, *args, **kwargs):
        self._euler_only()


class TestWanT2VUniPCConformance(_UniPCCheckpoint, TestWanT2VConformance):
    """Wan2.1 T2V with its UniPC: the kit's sampling runs equal ``WanPipeline``'s default output."""


class TestWanTI2VUniPCConformance(_UniPCCheckpoint, TestWanTI2VConformance):
    """Wan2.2 TI2V with its UniPC: the pinned first latent frame kept through the scheduler's steps."""
