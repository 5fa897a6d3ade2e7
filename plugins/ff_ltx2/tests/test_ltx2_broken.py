"""The LTX-2 port's likeliest bugs, each caught by the kit against LTX2Pipeline on the stream it breaks: the audio
latents' normalisation ignored (the decoded waveform), an audio unpack with the right shape and the wrong layout (the
kit compares every stream of a sampling run and of each denoiser call, test_ltx2_conformance.py's two-stream layout),
the video's frame-rate conditioning left at the pipeline's default, target posteriors sampled where the references
take the mode (both streams, or the audio alone), and the audio targets left unnormalised by ``encode_output`` alone
(the kit compares every component of the encoding; it once compared the first only). The unbroken adapter passes
every check (test_ltx2_conformance.py, whose kit configuration this reuses)."""

from __future__ import annotations

import re

import pytest
import test_ltx2_conformance  # the module, not the class: a Test* name here would collect the kit a second time
from ff_ltx2 import LTX2T2AVAdapter
from ltx2_geometry import ADAPTER_KWARGS

from ff_core.adapter import LatentState


class AudioNormalisationIgnored(LTX2T2AVAdapter):
    """Samples and decodes audio latents without the audio VAE's per-feature ``latents_mean`` / ``latents_std``."""

    def normalize_audio(self, z):
        return z

    def denormalize_audio(self, latents):
        return latents


class AudioUnpackedMelFirst(LTX2T2AVAdapter):
    """Unpacks audio tokens (B, L, C M) as (M, C) per token: the right shape, channels and mel bins transposed."""

    @staticmethod
    def unpack_audio(tokens, like):
        b, c, n, m = like.shape
        return tokens.unflatten(2, (m, c)).permute(0, 3, 1, 2)


class FrameRateNotConditioned(LTX2T2AVAdapter):
    """Conditions the transformer's video positions on the pipeline's default 24 fps, not the clip's frame rate."""

    def velocity(self, state, sigma, condition):
        rate, self.frame_rate = self.frame_rate, 24.0
        try:
            return super().velocity(state, sigma, condition)
        finally:
            self.frame_rate = rate


class PosteriorSampled(LTX2T2AVAdapter):
    """Samples both VAE posteriors from the training generator (ff before issue 23) where ltx-trainer and
    Flow-Factory take the mode."""

    def _latents(self, posterior, generator):
        return posterior.sample(generator=generator)


class AudioPosteriorSampled(LTX2T2AVAdapter):
    """Takes the video posterior's mode but samples the audio's: only the second component differs."""

    def encode_output(self, media, condition, generator=None):
        video = super().encode_output(media, condition, generator).components["video"]
        self.target_posterior = "sample"
        try:
            audio = super().encode_output(media, condition, generator).components["audio"]
        finally:
            self.target_posterior = "mode"
        return LatentState({"video": video, "audio": audio})


class AudioEncodeNormalisationIgnored(LTX2T2AVAdapter):
    """``encode_output`` leaves the audio latents raw (no per-feature ``latents_mean`` / ``latents_std``); decoding
    is right, so only the encoding check, on the audio component, sees it."""

    def encode_output(self, media, condition, generator=None):
        state = super().encode_output(media, condition, generator)
        return LatentState({"video": state.components["video"],
                            "audio": self.denormalize_audio(state.components["audio"])})  # fmt: skip


BROKEN = {
    # Sampling never leaves the normalised space: only decoding (the waveform, to audio_atol) sees it.
    "audio normalisation ignored": (AudioNormalisationIgnored, "decoding",
                                    r"decoded output 1 of sample 0 \(waveform\) differs"),
    # The video attends to the audio tokens, so the mis-laid audio shows in both streams' sampling.
    "audio unpacked mel-first": (AudioUnpackedMelFirst, "sampling",
                                 r"the final '(video|audio)' latents of 3-step sampling .* differs"),
    "fps conditioning ignored": (FrameRateNotConditioned, "denoiser",
                                 r"velocity at sigma .* differs from LTX2Pipeline's denoiser step"),
    # The audio tokens go in packed right and come out unpacked wrong: at the pipeline's latents only the audio
    # velocity differs (the kit once compared the first component, the video, alone).
    "audio unpacked mel-first, one denoiser call": (AudioUnpackedMelFirst, "denoiser",
                                                    r"denoiser step at the same latents, component 'audio'"),
    "posteriors sampled": (PosteriorSampled, "encoding",
                           r"encode_output's clean 'video' latents differs .*posterior's mode"),
    "audio posterior sampled": (AudioPosteriorSampled, "encoding", r"encode_output's clean 'audio' latents differs"),
    "audio encoded unnormalised": (AudioEncodeNormalisationIgnored, "encoding",
                                   r"encode_output's clean 'audio' latents differs .*latent normalisation"),
}  # fmt: skip


@pytest.fixture(scope="module")
def kit():
    return test_ltx2_conformance.TestLTX2T2AVConformance()


@pytest.fixture(scope="module")
def pipe(kit, tiny_ltx2):
    return kit.load_reference_pipeline(tiny_ltx2("t2av"))


@pytest.mark.parametrize("bug", list(BROKEN))
def test_each_broken_ltx2_adapter_fails_the_kit_naming_its_problem(kit, tiny_ltx2, pipe, tmp_path, bug):
    cls, check, message = BROKEN[bug]
    adapter = cls.from_pretrained(tiny_ltx2("t2av"), **ADAPTER_KWARGS)
    case = kit.run_reference(adapter, pipe, kit.make_inputs(adapter, tmp_path), guidance_scale=1.0)
    with pytest.raises(AssertionError) as failure:
        getattr(kit, f"check_{check}")(adapter, pipe, case)
    assert re.search(message, str(failure.value)), str(failure.value)
