"""MiniMax H3 bugs the conformance kit must catch on the component they break (issue 23): the target video's
posterior sampled where the H3 SFT data flow (Flow-Factory's ``encode_h3_target_video``) takes the mode, the target
audio left unnormalised by ``encode_output`` alone, and the audio velocity alone with the wrong sign. The last two
change only the second latent component, which the kit once left to the plugin's own tests (it compared the first
component of the encoding and of each denoiser call). The unbroken adapter passes (test_minimax_conformance.py, whose
kit configuration this reuses)."""

from __future__ import annotations

import re

import pytest
import test_minimax_conformance  # the module, not the class: a Test* name here would collect the kit a second time
from ff_minimax import MiniMaxH3T2VAAdapter

from ff_core.adapter import LatentState


class VideoPosteriorSampled(MiniMaxH3T2VAAdapter):
    """Samples the video posterior from the training generator (ff before issue 23)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.target_posterior = "sample"


class AudioEncodeNormalisationIgnored(MiniMaxH3T2VAAdapter):
    """``encode_output`` gives the audio VAE's raw means (no ``latents_mean`` / ``latents_std``); decoding is right."""

    def encode_output(self, media, condition, generator=None):
        state = super().encode_output(media, condition, generator)
        audio = state.components["audio"]
        mean, std = self._audio_stats(audio)
        return LatentState({"video": state.components["video"], "audio": audio * std + mean})


class AudioVelocityNotNegated(MiniMaxH3T2VAAdapter):
    """Negates the transformer's data-ward prediction for the video rows but not for the audio rows."""

    def component_velocity(self, state, sigmas, condition):
        out = super().component_velocity(state, sigmas, condition)
        return LatentState({"video": out.components["video"], "audio": -out.components["audio"]}, dict(out.masks))


BROKEN = {
    "video posterior sampled": (VideoPosteriorSampled, "encoding",
                                r"encode_output's clean 'video' latents differs .*posterior's mode"),
    "audio encoded unnormalised": (AudioEncodeNormalisationIgnored, "encoding",
                                   r"encode_output's clean 'audio' latents differs .*latent normalisation"),
    "audio velocity sign": (AudioVelocityNotNegated, "denoiser",
                            r"velocity at sigma .* denoiser step at the same latents, component 'audio'"),
}  # fmt: skip


@pytest.fixture(scope="module")
def kit():
    return test_minimax_conformance.TestMiniMaxH3T2VAConformance()


@pytest.fixture(scope="module")
def pipe(kit, tiny_minimax):
    return kit.load_reference_pipeline(tiny_minimax("t2va"))


@pytest.mark.parametrize("bug", list(BROKEN))
def test_each_broken_minimax_adapter_fails_the_kit_naming_its_problem(kit, tiny_minimax, pipe, tmp_path, bug):
    cls, check, message = BROKEN[bug]
    adapter = cls.from_pretrained(tiny_minimax("t2va"), **kit.adapter_kwargs)
    case = kit.run_reference(adapter, pipe, kit.make_inputs(adapter, tmp_path), guidance_scale=1.0)
    with pytest.raises(AssertionError) as failure:
        getattr(kit, f"check_{check}")(adapter, pipe, case)
    assert re.search(message, str(failure.value)), str(failure.value)


def test_the_unbroken_adapter_passes_the_encoding_and_denoiser_checks(kit, tiny_minimax, pipe, tmp_path):
    adapter = MiniMaxH3T2VAAdapter.from_pretrained(tiny_minimax("t2va"), **kit.adapter_kwargs)
    case = kit.run_reference(adapter, pipe, kit.make_inputs(adapter, tmp_path), guidance_scale=1.0)
    kit.check_encoding(adapter, pipe, case)
    kit.check_denoiser(adapter, pipe, case)
