"""minimax-h3-fl2va and minimax-h3-ref2va against the adapter conformance kit, on T2VA's kit wiring
(test_minimax_conformance.py: the recorded denoising loop, both schedules): the plumbing checks (stage shapes and
dtypes, seeded sampling and encoding, LoRA targets and export, train / eval modes, sharding blocks, preprocessing
identity, an SFT step) and the maths checks against ``MiniMaxH3ModularPipeline`` (prompt encoding with the keyframes'
or references' labels and vision blocks, both schedules, the denoiser at every step of a 3-step run on both streams,
the final latents, decoding, target encoding, the exported LoRA through ``load_lora_weights``: into
``transformer_ref`` for Ref2VA). The pipeline draws the condition noise from its generator before anything else, so
each case's condition is realised from a generator of the kit's seed; the loop's rows carry the condition rows first,
which the recording drops (they never change: only target rows are stepped)."""

from __future__ import annotations

import math

import test_minimax_conformance as t2va  # a module: pytest does not collect T2VA's class a second time
import torch
from ff_minimax.fl2va import MiniMaxH3FL2VAAdapter, to_pil
from ff_minimax.ref2va import MiniMaxH3Ref2VAAdapter
from ff_minimax.testing import TINY_FRAMES, TINY_SIZE, build_tiny_minimax

from ff_core.adapter import ConditionInput
from ff_core.data.media.decode import DecodedAudio

ADAPTER_KWARGS = {"height": TINY_SIZE, "width": TINY_SIZE, "num_frames": TINY_FRAMES}


def _image(seed: int, height: int = 20, width: int = 28) -> torch.Tensor:
    return torch.randint(0, 256, (3, height, width), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def keyframe_inputs(prompt: str, folder) -> list[ConditionInput]:
    """The first-plus-last FL2VA form (both optional slots bound), keyframes of other aspect ratios than the canvas."""
    return [ConditionInput(prompt, None, [
        {"type": "image", "data": _image(1), "path": folder / "first.png", "slot": "first_frame"},
        {"type": "image", "data": _image(2, 24, 18), "path": folder / "last.png", "slot": "last_frame"}])]


class TestMiniMaxH3FL2VAConformance(t2va.TestMiniMaxH3T2VAConformance):
    """The T2VA kit wiring (recorded denoising loop, both schedules) with the keyframes passed as ``image`` /
    ``last_image``. The pipeline draws the keyframe noise from its generator before anything else, so the case's
    condition is realised from a generator of the kit's seed (:meth:`MiniMaxH3FL2VAAdapter.realise`); the loop's rows
    carry the keyframe rows first, which the recording drops (they never change: only target rows are stepped)."""

    adapter_cls = MiniMaxH3FL2VAAdapter

    def build_checkpoint(self, path):
        return build_tiny_minimax(path, variant="fl2va")

    def make_inputs(self, adapter, folder):
        return keyframe_inputs(self.prompts[0], folder)

    def reference_call_kwargs(self, adapter, inputs):
        slots = {m["slot"]: to_pil(m["data"]) for m in inputs[0].media}
        return {**super().reference_call_kwargs(adapter, inputs), "image": slots["first_frame"],
                "last_image": slots["last_frame"]}  # fmt: skip

    def run_reference(self, adapter, pipe, inputs, *, guidance_scale, embedded_guidance=None):
        case = super().run_reference(adapter, pipe, inputs, guidance_scale=guidance_scale,
                                     embedded_guidance=embedded_guidance)  # fmt: skip
        case.condition = adapter.realise(case.condition, generator=torch.Generator().manual_seed(self.seed))
        return case

    def reference_run(self, pipe, latents, **kwargs):
        run = super().reference_run(pipe, latents, **kwargs)
        n = latents["latents"].shape[0]  # the target's rows: what the recording keeps of every step
        self.__class__.keyframe_rows = run.latents[-1]["latents"].shape[0] - n
        run.latents = [{**r, "latents": r["latents"][-n:]} for r in run.latents]
        return run

    def test_reference_velocity_is_the_negated_data_ward_prediction(self, adapter, reference, reference_case):
        """As T2VA's, on the target rows of the recorded first forward (the keyframe rows' predictions dropped)."""
        case = reference_case
        _, module, args, kw = case.run.calls[0]
        n = kw["hidden_states"].shape[1] - case.run.latents[0]["latents"].shape[0]
        assert n == self.keyframe_rows > 0
        with torch.no_grad():
            raw, _ = module(*args, **{**kw, "return_dict": False})
            state = self.reference_layout.adapter_state(reference, case.run.latents[0], case.init)
            ours = adapter.component_velocity(state, {k: torch.tensor([v]) for k, v in
                                                      self.reference_levels(adapter, case, 0).items()},
                                              case.condition)  # fmt: skip
        theirs = t2va.from_rows(reference, {"latents": -raw[0, n:], "audio_latents": torch.zeros_like(
            case.run.latents[0]["audio_latents"])}, case.init)  # fmt: skip
        torch.testing.assert_close(ours.components["video"], theirs.components["video"], atol=1e-5, rtol=1e-4)


class TestMiniMaxH3Ref2VAConformance(t2va.TestMiniMaxH3T2VAConformance):
    """Ref2VA through the kit's maths checks: T2VA's wiring with the references passed as diffusers' reference objects
    (an image, an audio clip at the audio VAE's rate, another image), the loop recorded on ``transformer_ref``, the
    visual prefix realised from the kit's seed, and the reference rows of both streams dropped from the recording."""

    adapter_cls = MiniMaxH3Ref2VAAdapter
    adapter_kwargs = {**ADAPTER_KWARGS, "reference_image_short_edge": 16}
    loaded = ("transformer_ref", *t2va.LOADED[1:])

    def build_checkpoint(self, path):
        return build_tiny_minimax(path, variant="ref2va")

    def load_reference_pipeline(self, pretrained):
        pipe = t2va.ModularPipeline.from_pretrained(str(pretrained), workflow="ref2va")
        pipe.load_components(names=list(self.loaded), torch_dtype=torch.float32)
        pipe.update_components(processor=t2va.load_processor(pretrained))
        pipe.register_to_config(reference_image_short_edge=16)
        return pipe

    def make_inputs(self, adapter, folder):
        tone = 0.3 * torch.sin(2 * math.pi * 330.0 * torch.arange(2 * adapter.audio_rate) / adapter.audio_rate)
        return [ConditionInput(self.prompts[0], None, [
            {"type": "image", "data": _image(1), "path": folder / "a.png"},
            {"type": "audio", "data": DecodedAudio(tone.repeat(2, 1), adapter.audio_rate), "path": folder / "s.wav"},
            {"type": "image", "data": _image(3, 16, 24), "path": folder / "b.png"}])]

    def reference_call_kwargs(self, adapter, inputs):
        from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3AudioReference, MiniMaxH3ImageReference

        refs = [MiniMaxH3ImageReference(image=to_pil(m["data"])) if m["type"] == "image" else
                MiniMaxH3AudioReference(audio=m["data"].waveform, sample_rate=m["data"].sample_rate)
                for m in inputs[0].media]  # fmt: skip
        return {**super().reference_call_kwargs(adapter, inputs), "references": refs}

    def run_reference(self, adapter, pipe, inputs, *, guidance_scale, embedded_guidance=None):
        case = super().run_reference(adapter, pipe, inputs, guidance_scale=guidance_scale,
                                     embedded_guidance=embedded_guidance)  # fmt: skip
        case.condition = adapter.realise(case.condition, generator=torch.Generator().manual_seed(self.seed))
        return case

    def reference_run(self, pipe, latents, **kwargs):
        # T2VA's recording hooks `pipe.transformer`: point it at this workflow's partition for the run.
        pipe.transformer = pipe.transformer_ref
        try:
            run = super().reference_run(pipe, latents, **kwargs)
        finally:
            pipe.transformer = None
        n_v, n_a = latents["latents"].shape[0], latents["audio_latents"].shape[0]
        run.latents = [{"latents": r["latents"][-n_v:], "audio_latents": r["audio_latents"][-n_a:]}
                       for r in run.latents]  # fmt: skip
        return run

    def test_reference_velocity_is_the_negated_data_ward_prediction(self, adapter, reference, reference_case):
        """As T2VA's, on the target rows of the recorded first forward (reference rows' predictions dropped)."""
        case = reference_case
        _, module, args, kw = case.run.calls[0]
        n = kw["hidden_states"].shape[1] - case.run.latents[0]["latents"].shape[0]
        assert n > 0 and module is reference.transformer_ref
        with torch.no_grad():
            raw, _ = module(*args, **{**kw, "return_dict": False})
            state = self.reference_layout.adapter_state(reference, case.run.latents[0], case.init)
            ours = adapter.component_velocity(state, {k: torch.tensor([v]) for k, v in
                                                      self.reference_levels(adapter, case, 0).items()},
                                              case.condition)  # fmt: skip
        theirs = t2va.from_rows(reference, {"latents": -raw[0, n:], "audio_latents": torch.zeros_like(
            case.run.latents[0]["audio_latents"])}, case.init)  # fmt: skip
        torch.testing.assert_close(ours.components["video"], theirs.components["video"], atol=1e-5, rtol=1e-4)
