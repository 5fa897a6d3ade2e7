"""The conformance kit against deliberately broken SD3 adapters (issue 14): the five bugs a FLUX.1 port slipped past
the old kit each fail it with a message naming the problem, and the unbroken adapter passes every check."""

from __future__ import annotations

import re

import pytest
import torch
from ff_sd3.adapter import SD3Adapter
from test_sd3_conformance import SD3Kit
from torch import nn

from ff_core.adapter import LatentState


class TimestepTwice(SD3Adapter):
    """The likeliest copy-paste bug: the caller already scaled sigma to timesteps, and ``velocity`` scales again."""

    def velocity(self, state, sigma, condition):
        return super().velocity(state, sigma * self.scheduler.config.num_train_timesteps, condition)


class VAENormalisationIgnored(SD3Adapter):
    """Encodes and decodes raw VAE latents: ``shift_factor`` / ``scaling_factor`` ignored on both sides."""

    @torch.no_grad()
    def encode_output(self, media, condition, generator=None):
        x = torch.stack([m[0] for m in media]).float() / 127.5 - 1
        return LatentState({"latent": self.vae.encode(x).latent_dist.sample(generator=generator)})

    @torch.no_grad()
    def decode(self, state):
        images = self.vae.decode(state.components["latent"], return_dict=False)[0]
        return [[img] for img in ((images / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)]


class EncodeNormalisationIgnored(SD3Adapter):
    """Only ``encode_output`` skips ``(z - shift_factor) * scaling_factor``; ``decode`` is right, so the decoding
    check (pipeline latents in, media out) cannot see it: training would learn latents sampling never makes."""

    @torch.no_grad()
    def encode_output(self, media, condition, generator=None):
        x = torch.stack([m[0] for m in media]).float() / 127.5 - 1
        return LatentState({"latent": self.vae.encode(x).latent_dist.sample(generator=generator)})


class WrongUnpackPermutation(SD3Adapter):
    """Unpacks the denoiser's output with height and width swapped: the right shape, the wrong layout."""

    def velocity(self, state, sigma, condition):
        return super().velocity(state, sigma, condition).map(lambda v: v.transpose(-1, -2))


class NoNegativeBranch(SD3Adapter):
    """The contract (inherited) accepts negative prompts, but there is no negative branch: CFG silently skipped."""

    def unconditional(self, condition):
        return None


class T5InModuleDictTrainMode(SD3Adapter):
    """Holds its T5 in an ``nn.ModuleDict`` that the freezing code never reached: left in train mode (dropout on)."""

    text_encoder_3 = property(lambda self: self.encoders["t5"])

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.encoders = nn.ModuleDict({"t5": self._modules.pop("text_encoder_3")})
        self.encoders["t5"].train()


BROKEN = {
    "timestep x1000 twice": (TimestepTwice, "denoiser",
                             r"velocity at sigma 1 .* timestep x1000 .* sigma is scaled by num_train_timesteps twice"),
    "VAE shift/scale ignored": (VAENormalisationIgnored, "decoding",
                                r"decoded output 0 of sample 0 .* differs .*VAE latent normalisation"),
    "encode ignores normalisation": (EncodeNormalisationIgnored, "encoding",
                                     r"encode_output's clean .*latents differs .*latent normalisation"),
    "wrong unpack permutation": (WrongUnpackPermutation, "denoiser",
                                 r"values in another order: a wrong latent packing/unpacking permutation"),
    "CFG skipped": (NoNegativeBranch, "cfg", r"accepts negative prompts .* unconditional\(condition\) returns None: "
                                             r"sampling silently skips classifier-free guidance"),
    "frozen T5 in a ModuleDict in train mode": (T5InModuleDictTrainMode, "frozen_in_eval",
                                                r"frozen module\(s\) .* in train mode .*: encoders\.t5\."),
}  # fmt: skip


@pytest.fixture(scope="module")
def kit():
    return SD3Kit()


@pytest.fixture(scope="module")
def pretrained(kit, tmp_path_factory):
    return kit.build_checkpoint(tmp_path_factory.mktemp("kit-sd3"))


@pytest.fixture(scope="module")
def pipe(kit, pretrained):
    return kit.load_reference_pipeline(pretrained)


def test_the_unbroken_adapter_passes_every_check(kit, pretrained, pipe, tmp_path):
    adapter = SD3Adapter.from_pretrained(pretrained, **kit.adapter_kwargs)
    assert kit.run_checks(adapter, pretrained, tmp_path, pipe) == {}


@pytest.mark.parametrize("bug", list(BROKEN))
def test_each_broken_adapter_fails_the_kit_naming_its_problem(kit, pretrained, pipe, tmp_path, bug):
    cls, check, message = BROKEN[bug]
    failed = kit.run_checks(cls.from_pretrained(pretrained, **kit.adapter_kwargs), pretrained, tmp_path, pipe)
    assert check in failed, f"{bug}: the {check!r} check passed; failures: {failed}"
    assert re.search(message, failed[check]), failed[check]
    print(f"\n{bug}: {sorted(failed)}\n  {check}: {failed[check]}")


def test_a_broken_adapter_fails_under_pytest_through_the_test_methods(kit, pretrained, pipe):
    """The kit's own test methods (what a plugin's test class runs) raise the same messages."""
    adapter = TimestepTwice.from_pretrained(pretrained, **kit.adapter_kwargs)
    inputs = kit.make_inputs(adapter, pretrained)
    case = kit.run_reference(adapter, pipe, inputs, guidance_scale=1.0)
    with pytest.raises(AssertionError, match="scaled by num_train_timesteps twice"):
        kit.test_reference_denoiser_at_each_sigma(adapter, pipe, case)


class SampleWithoutRescale(SD3Adapter):
    """Written against interface 1.1 (not broken): its ``sample`` override takes no ``guidance_rescale``."""

    def sample(self, condition, *, num_steps=20, guidance_scale=1.0, generator=None, shift=None,
               embedded_guidance=None):  # fmt: skip
        return super().sample(condition, num_steps=num_steps, guidance_scale=guidance_scale, generator=generator,
                              shift=shift, embedded_guidance=embedded_guidance)  # fmt: skip


def test_an_older_sample_override_passes_the_kit(kit, pretrained, pipe, tmp_path):
    """The kit passes ``guidance_rescale`` only when a check rescales (as ``FlowModule.generate``), so an adapter whose
    ``sample`` predates it runs every sampling check (with and without CFG) against the pipeline."""
    adapter = SampleWithoutRescale.from_pretrained(pretrained, **kit.adapter_kwargs)
    assert kit.run_checks(adapter, pretrained, tmp_path, pipe) == {}
