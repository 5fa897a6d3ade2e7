"""minimax-h3-t2va against ff's adapter conformance kit: the plumbing checks every plugin runs and the maths checks
against diffusers' ``MiniMaxH3ModularPipeline`` on the tiny checkpoint (prompt encoding, both sampling schedules, one
denoiser call on both streams at each step, a short sampling run from the same noise, decoding, target encoding, the
LoRA export loaded through the pipeline's ``load_lora_weights``).

The modular pipeline has no step callback, so :meth:`TestMiniMaxH3T2VAConformance.reference_run` records its
denoising loop instead: the packed video and audio rows after every ``MiniMaxH3LoopSchedulerStep``, the text rows the
transformer reads, and both schedulers' sigmas (audio steps on its own schedule: the run's ``stream_sigmas``). Rows
cross into the adapter's state with the pipeline's own ``patchify_video_latents`` (packing) and an independent
unpacking written from ``MiniMaxH3AfterDenoiseStep`` (never the adapter's)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from diffusers import ModularPipeline
from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents
from diffusers.modular_pipelines.minimax_h3.denoise import MiniMaxH3LoopSchedulerStep
from ff_minimax import MiniMaxH3T2VAAdapter
from ff_minimax.testing import TINY_FRAMES, TINY_SIZE, build_tiny_minimax
from ff_minimax.text import load_processor

from ff_core.adapter import LatentState
from ff_core.testing.conformance import AdapterConformance, media_tensor
from ff_core.testing.reference import LatentLayout, PipelineRun

ADAPTER_KWARGS = {"height": TINY_SIZE, "width": TINY_SIZE, "num_frames": TINY_FRAMES}
LOADED = ("transformer", "vae", "audio_vae", "scheduler", "audio_scheduler", "text_encoder", "tokenizer")


def to_rows(pipe, state: LatentState) -> dict:
    """The state as the denoising loop holds it (B = 1): video rows (``patchify_video_latents``), channel-major
    audio rows (``MiniMaxH3PrepareLatentsStep``'s layout of pre-generated audio latents)."""
    video, audio = state.components["video"], state.components["audio"][0]
    rows = audio.permute(0, 2, 1).reshape(-1, audio.shape[1])
    return {"latents": patchify_video_latents(video, pipe.patch_size), "audio_latents": rows}


def to_call(pipe, state: LatentState) -> dict:
    """The state as ``__call__`` takes pre-generated latents: video (1, C, F', h, w), audio (2, C_a, L)."""
    return {"latents": state.components["video"], "audio_latents": state.components["audio"][0]}


def from_rows(pipe, latents: dict, like: LatentState) -> LatentState:
    """Rows back to the state (``MiniMaxH3AfterDenoiseStep``'s reshape, written out here)."""
    pt, ph, pw = pipe.patch_size
    _, c, f, h, w = like.components["video"].shape
    video = latents["latents"].reshape(1, f // pt, h // ph, w // pw, c, pt, ph, pw)
    video = video.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(1, c, f, h, w)
    _, channels, ca, length = like.components["audio"].shape
    audio = latents["audio_latents"].reshape(channels, length, ca).permute(0, 2, 1)
    return LatentState({"video": video, "audio": audio[None]})


class TestMiniMaxH3T2VAConformance(AdapterConformance):
    adapter_cls = MiniMaxH3T2VAAdapter
    adapter_kwargs = ADAPTER_KWARGS
    reference_pipeline = ModularPipeline
    reference_layout = LatentLayout(to_pipeline=to_rows, from_pipeline=from_rows,
                                    step_tensors=("latents", "audio_latents"), to_pipeline_call=to_call)  # fmt: skip
    prompts = ("a red square with a low tone",)
    # The H3 SFT data flow (Flow-Factory's encode_h3_target_video / encode_h3_target_audio) trains on the posterior
    # modes, in fp32: not the conditioning recipe (encode_vae_condition: a seed-42 sample rounded to fp16).
    reference_posterior = "mode"
    # The pipeline samples condition latents under its keyframe_encode_seed, 42 (encode_vae_condition): the kit's
    # generators use the same seed (the conditioned workflows realise their conditions from it).
    seed = 42

    def build_checkpoint(self, path):
        return build_tiny_minimax(path, variant="t2va")

    def load_reference_pipeline(self, pretrained):
        """``ModularPipeline.from_pretrained`` on the folder (its ``modular_model_index.json``), every component loaded
        with ``from_pretrained``; the processor through :func:`~ff_minimax.text.load_processor` (no torchvision)."""
        pipe = ModularPipeline.from_pretrained(str(pretrained))
        pipe.load_components(names=list(LOADED), torch_dtype=torch.float32)
        pipe.update_components(processor=load_processor(pretrained))
        return pipe

    # The kit's (video, audio) targets: an MP4 and a stereo WAV at the tiny audio VAE's rate (ff_minimax.testing's
    # sampling_rate), decoded as training does.
    target_sample_rate = 8000

    def reference_guidance_kwargs(self, guidance_scale):
        """Guidance-distilled: the pipeline takes no guidance argument."""
        assert guidance_scale == 1.0
        return {}

    def reference_run(self, pipe, latents, *, steps, denoisers, call_latents=None, **kwargs):
        """Run the modular pipeline from ``call_latents`` for ``steps`` Euler steps (``num_inference_steps = steps +
        1``: its grid counts the terminal 0), recording the loop's rows after every scheduler step."""
        run = PipelineRun(latents=[{k: v.clone() for k, v in latents.items()}])

        original = MiniMaxH3LoopSchedulerStep.__call__

        def recording(block, components, block_state, i, t):
            out = original(block, components, block_state, i, t)
            run.latents.append({"latents": block_state.latents.clone(),
                                "audio_latents": block_state.audio_latents.clone()})  # fmt: skip
            return out

        def text_rows(module, args, kw):
            # Cloned: the loop updates its rows in place after the call.
            kw = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
            run.calls.append(("transformer", module, args, kw))
            if not run.tensors:
                tags = kw["token_tags"][kw["text_indices"]]
                run.tensors = {"prompt_embeds": kw["encoder_hidden_states"].clone(), "text_token_tags": tags[None]}

        (prompt,) = kwargs.pop("prompt")
        handle = pipe.transformer.register_forward_pre_hook(text_rows, with_kwargs=True)
        try:
            with mock.patch.object(MiniMaxH3LoopSchedulerStep, "__call__", recording):
                run.output = pipe(prompt=prompt, num_inference_steps=steps + 1, **call_latents, **kwargs,
                                  output=["videos", "audio"])  # fmt: skip
        finally:
            handle.remove()
        run.sigmas = pipe.scheduler.sigmas.float().cpu()
        run.stream_sigmas = {"audio_latents": pipe.audio_scheduler.sigmas.float().cpu()}
        assert len(run.latents) == steps + 1 and len(run.sigmas) == steps + 1
        return run

    def reference_levels(self, adapter, case, k):
        """Video at the video scheduler's sigma, audio at the audio scheduler's (one forward serves both)."""
        return {"video": float(case.run.sigmas[k]), "audio": float(case.run.stream_sigmas["audio_latents"][k])}

    def reference_training_sigmas(self, pipe):
        """The H3 scheduler builds no table before ``set_timesteps`` (no released training recipe to mirror)."""
        return None

    def reference_encode(self, pipe, adapter, targets, generator):
        """Both streams through the pipeline's own VAEs and conventions, never the adapter's (Flow-Factory's
        ``encode_h3_target_video`` / ``encode_h3_target_audio``, the H3 SFT data flow):

        * video: pixels in [0, 1] normalised by the pipeline's ``pixel_mean`` / ``pixel_std`` (as
          ``encode_vae_condition`` does), ``pipe.vae.encode(x).latent_dist.mode()`` in fp32, ``(z - latents_mean) /
          latents_std`` from the VAE's config (the inverse of ``MiniMaxH3VaeDecoderStep``'s ``z * std + mean``);
        * audio: each stereo channel of the decoded waveform (at the audio VAE's rate) cut by hand to, or right-padded
          with silence to, the aligned ``L * hop`` samples, as one mono item,
          ``pipe.audio_vae.encode(w).latent_dist.mode()``, normalised per latent channel from the audio VAE's config
          (the inverse of ``MiniMaxH3AudioDecoderStep``'s).
        """
        assert self.reference_posterior == "mode"
        vae, audio_vae = pipe.vae, pipe.audio_vae
        videos = torch.stack([media_tensor(video) for video, _ in targets])  # DecodedVideo -> (B, F, 3, H, W)
        videos = videos.permute(0, 2, 1, 3, 4).float() / 255  # (B, 3, F, H, W)
        pmean = torch.tensor(pipe.pixel_mean).view(1, -1, 1, 1, 1)
        pstd = torch.tensor(pipe.pixel_std).view(1, -1, 1, 1, 1)
        z = vae.encode((videos - pmean) / pstd).latent_dist.mode().float()
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        assert all(audio.sample_rate == audio_vae.config.sampling_rate for _, audio in targets)
        n = adapter.audio_samples  # L hop
        waves = torch.stack([F.pad(media_tensor(audio)[:, :n], (0, max(0, n - audio.waveform.shape[-1])))
                             for _, audio in targets])  # (B, 2, L hop)  # fmt: skip
        za = audio_vae.encode(waves.reshape(-1, 1, waves.shape[-1])).latent_dist.mode().float()
        za = za.reshape(waves.shape[0], 2, *za.shape[1:])
        amean = torch.tensor(audio_vae.config.latents_mean).view(1, 1, -1, 1)
        astd = torch.tensor(audio_vae.config.latents_std).view(1, 1, -1, 1)
        return {"video": (z - mean) / std, "audio": (za - amean) / astd}

    def reference_media(self, adapter, output):
        """Frames in uint8 units, the stereo waveform as the pipeline's audio decode step gives it."""
        return [[output["videos"][0].float() * 255, output["audio"][0].float()]]

    # -- the audio stream's own schedule and call, and the sign convention, by hand ---------------------------
    def test_reference_audio_schedule_is_the_audio_schedulers(self, adapter, reference, reference_case):
        ours = adapter.sampling_schedules(reference_case.init, self.reference_steps)
        torch.testing.assert_close(ours["audio"], reference_case.run.stream_sigmas["audio_latents"], rtol=0,
                                   atol=1e-6)  # fmt: skip
        assert not torch.allclose(ours["audio"], ours["video"])  # shift 3 vs 12: two schedules

    def test_reference_audio_denoiser_at_each_step(self, adapter, reference, reference_case):
        """The audio half of each step's forward: the pipeline's audio update over its own sigma step."""
        case, layout = reference_case, self.reference_layout
        for k in range(self.reference_steps):
            state = layout.adapter_state(reference, case.run.latents[k], case.init)
            levels = self.reference_levels(adapter, case, k)
            with torch.no_grad():
                ours = adapter.component_velocity(state, {n: torch.tensor([v]) for n, v in levels.items()},
                                                  case.condition)  # fmt: skip
            theirs = layout.adapter_state(reference, case.run.velocity(k), case.init)
            torch.testing.assert_close(ours.components["audio"], theirs.components["audio"], atol=1e-4, rtol=1e-3)

    def test_reference_velocity_is_the_negated_data_ward_prediction(self, adapter, reference, reference_case):
        """Hand check of the sign convention at one step: H3's scheduler computes ``x0 = x_t + sigma v_H3``; ff's
        ``x0 = x_t - sigma v``. The transformer's raw output at the recorded call, negated, is the adapter's video
        velocity."""
        case = reference_case
        name, module, args, kw = case.run.calls[0]
        with torch.no_grad():
            raw, _ = module(*args, **{**kw, "return_dict": False})
            state = self.reference_layout.adapter_state(reference, case.run.latents[0], case.init)
            ours = adapter.component_velocity(state, {n: torch.tensor([v]) for n, v in
                                                      self.reference_levels(adapter, case, 0).items()},
                                              case.condition)  # fmt: skip
        theirs = from_rows(reference, {"latents": -raw[0], "audio_latents": torch.zeros_like(
            case.run.latents[0]["audio_latents"])}, case.init)  # fmt: skip
        torch.testing.assert_close(ours.components["video"], theirs.components["video"], atol=1e-5, rtol=1e-4)
        x, sigma = state.components["video"], float(case.run.sigmas[0])
        x0_ff = x - sigma * ours.components["video"]
        x0_h3 = x + sigma * (-ours.components["video"])
        torch.testing.assert_close(x0_ff, x0_h3)


def test_modular_pipeline_is_the_reference_and_it_rejects_cfg_arguments(tiny_minimax):
    """The checkpoint is guidance-distilled: its blocks take no guidance_scale or negative_prompt (ff's no-CFG rule
    mirrors the pipeline)."""
    pipe = ModularPipeline.from_pretrained(str(tiny_minimax("t2va")))
    names = {p.name for p in pipe.blocks.inputs}
    assert "prompt" in names and not {"guidance_scale", "negative_prompt"} & names


@pytest.mark.parametrize("frames", [100, 400])
def test_the_pipeline_refuses_the_clips_ff_refuses(tiny_minimax, frames):
    """ff's clip rule (ff_minimax.rules.check_clip) is the pipeline's own: it refuses the same frame counts."""
    from ff_minimax.rules import check_clip

    with pytest.raises(ValueError, match="num_frames"):
        check_clip(frames, TINY_SIZE, TINY_SIZE)
    pipe = ModularPipeline.from_pretrained(str(tiny_minimax("t2va")))
    pipe.load_components(names=list(LOADED), torch_dtype=torch.float32)
    pipe.update_components(processor=load_processor(tiny_minimax("t2va")))
    with pytest.raises(ValueError, match="between 5.0 and 15.0 seconds"):
        pipe(prompt="a red square", height=TINY_SIZE, width=TINY_SIZE, num_frames=frames, num_inference_steps=2)
