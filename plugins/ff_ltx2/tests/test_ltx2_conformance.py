"""ltx2_t2av and ltx2_i2av against ff's adapter conformance kit: the plumbing checks every plugin runs and the maths
checks against diffusers' LTX2Pipeline / LTX2ImageToVideoPipeline (prompt encoding through the connectors, the
sampling sigmas, the denoiser at each sigma, sampling with and without CFG, decoding, the LoRA export) on both
latent streams.

The kit records the pipeline's ``latents`` and ``audio_latents`` after every step (``LatentLayout.step_tensors``);
``LTX2Pipeline`` hands its step callback any of its locals named in ``_callback_tensor_inputs``, which lists only
``latents``, so :meth:`TestLTX2T2AVConformance.load_reference_pipeline` adds ``audio_latents`` to that list on the
instance. Latents cross with the pipeline's own functions: packed and normalised as the callback shows them,
unpacked and denormalised as ``__call__`` takes them."""

import torch
from diffusers import LTX2ImageToVideoPipeline, LTX2Pipeline
from ff_ltx2 import LTX2I2AVAdapter, LTX2T2AVAdapter
from ff_ltx2.audio import log_mel
from ff_ltx2.testing import build_tiny_ltx2
from ltx2_geometry import ADAPTER_KWARGS, AUDIO_RATE, FPS, FRAMES, PLAIN_GUIDANCE, SIZE
from PIL import Image

from ff_core.adapter import LatentState
from ff_core.testing.conformance import AdapterConformance, media_tensor
from ff_core.testing.reference import LatentLayout


def _patches(pipe):
    return pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size


def to_step(pipe, state: LatentState) -> dict:
    """The adapter's (unpacked, normalised) state as the pipeline's step callback shows it: packed tokens."""
    p, pt = _patches(pipe)
    return {"latents": pipe._pack_latents(state.components["video"], p, pt),
            "audio_latents": pipe._pack_audio_latents(state.components["audio"])}  # fmt: skip


def to_call(pipe, state: LatentState) -> dict:
    """The state as ``__call__`` takes it: unpacked and denormalised (``prepare_latents`` normalises and packs)."""
    video, audio = state.components["video"], state.components["audio"]
    vae, audio_vae = pipe.vae, pipe.audio_vae
    video = pipe._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    packed = pipe._denormalize_audio_latents(pipe._pack_audio_latents(audio), audio_vae.latents_mean,
                                             audio_vae.latents_std)  # fmt: skip
    return {"latents": video, "audio_latents": pipe._unpack_audio_latents(packed, audio.shape[2], audio.shape[3])}


def from_step(pipe, latents: dict, like: LatentState) -> LatentState:
    p, pt = _patches(pipe)
    v, a = like.components["video"], like.components["audio"]
    video = pipe._unpack_latents(latents["latents"], v.shape[2] // pt, v.shape[3] // p, v.shape[4] // p, p, pt)
    return LatentState({"video": video, "audio": pipe._unpack_audio_latents(latents["audio_latents"], a.shape[2],
                                                                            a.shape[3])})  # fmt: skip


class TestLTX2T2AVConformance(AdapterConformance):
    adapter_cls = LTX2T2AVAdapter
    adapter_kwargs = ADAPTER_KWARGS
    reference_pipeline = LTX2Pipeline
    reference_layout = LatentLayout(to_pipeline=to_step, from_pipeline=from_step,
                                    step_tensors=("latents", "audio_latents"), to_pipeline_call=to_call)  # fmt: skip
    variant = "t2av"

    def build_checkpoint(self, path):
        return build_tiny_ltx2(path, variant=self.variant)

    # The kit's (video, audio) targets: an MP4 and a stereo WAV at the tiny audio VAE's rate, decoded as training does.
    target_sample_rate = AUDIO_RATE

    def load_reference_pipeline(self, pretrained):
        pipe = self.reference_pipeline.from_pretrained(pretrained)
        pipe._callback_tensor_inputs = [*type(pipe)._callback_tensor_inputs, "audio_latents"]  # its own local
        return pipe

    def reference_guidance_kwargs(self, guidance_scale):
        """Plain CFG at the same scale on both streams, the pipeline's extra guidance terms off (docs/ltx2.md)."""
        return {"guidance_scale": guidance_scale, "audio_guidance_scale": guidance_scale, **PLAIN_GUIDANCE}

    # Each stream at its own scale, the guidance rescale on (the pipeline's own terms; STG and modality guidance off).
    reference_component_guidance = ({"video": 2.0, "audio": 5.0}, {"video": 0.7, "audio": 0.4})

    def reference_component_guidance_kwargs(self, scales, rescales):
        return {**PLAIN_GUIDANCE, "guidance_scale": scales["video"], "audio_guidance_scale": scales["audio"],
                "guidance_rescale": rescales["video"], "audio_guidance_rescale": rescales["audio"]}

    def reference_call_kwargs(self, adapter, inputs):
        return {**super().reference_call_kwargs(adapter, inputs), "frame_rate": adapter.frame_rate,
                "max_sequence_length": adapter.max_sequence_length}  # fmt: skip

    def reference_condition(self, pipe, adapter, inputs, run):
        """``encode_prompt`` then the connectors, for the prompts and the negative prompts."""
        with torch.no_grad():
            pe, pm, ne, nm = pipe.encode_prompt([c.prompt for c in inputs], [c.negative_prompt or "" for c in inputs],
                                                max_sequence_length=adapter.max_sequence_length, device="cpu")
            out = {}
            for prefix, (embeds, mask) in (("", (pe, pm)), ("negative_", (ne, nm))):
                video, audio, connector_mask = pipe.connectors(embeds, mask, padding_side="left")
                out.update({f"{prefix}video_prompt_embeds": video, f"{prefix}audio_prompt_embeds": audio,
                            f"{prefix}prompt_attention_mask": connector_mask})  # fmt: skip
        return out

    # ltx-trainer's process_videos.py (encode_video / encode_audio) and Flow-Factory's LTX-2 target codec train on
    # the posteriors' modes.
    reference_posterior = "mode"

    def reference_encode(self, pipe, adapter, targets, generator):
        """Both streams through the pipeline's own VAE path, never the adapter's (Flow-Factory's
        ``encode_ltx2_target_video`` / ``encode_ltx2_target_audio``, ltx-trainer's ``encode_video`` / ``encode_audio``):

        * video: ``pipe.video_processor.preprocess_video`` of the frames in [0, 1], ``pipe.vae.encode(x)
          .latent_dist.mode()``, ``LTX2Pipeline._normalize_latents``;
        * audio: each decoded waveform (at the audio VAE's rate) cut by hand to the ``4 L`` mel hops' samples, LTX-2's
          log-mel (``ff_ltx2.audio.log_mel``, held against a hand STFT in test_ltx2_audio.py) cut to ``4 L`` frames,
          ``pipe.audio_vae.encode(mel).latent_dist.mode()`` cut to ``L`` latent frames, then the pipeline's
          ``_pack_audio_latents`` / ``_normalize_audio_latents`` / ``_unpack_audio_latents``.
        """
        assert self.reference_posterior == "mode"
        vae, audio_vae = pipe.vae, pipe.audio_vae
        frames = [media_tensor(video).float() / 255 for video, _ in targets]  # DecodedVideo -> (F, 3, H, W) in [0, 1]
        pixels = pipe.video_processor.preprocess_video(frames, height=SIZE, width=SIZE)
        z = vae.encode(pixels).latent_dist.mode()
        video = pipe._normalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        cfg = audio_vae.config
        frames_l = round(FRAMES / FPS * cfg.sample_rate / cfg.mel_hop_length / 4)  # LTX2Pipeline's audio_num_frames
        samples = 4 * frames_l * cfg.mel_hop_length
        assert all(audio.sample_rate == cfg.sample_rate and audio.waveform.shape[-1] >= samples for _, audio in targets)
        waves = torch.stack([media_tensor(audio)[:, :samples] for _, audio in targets])
        mel = log_mel(waves, sample_rate=cfg.sample_rate, n_fft=1024, hop_length=cfg.mel_hop_length,
                      n_mels=cfg.mel_bins)[:, :, : 4 * frames_l]  # fmt: skip
        za = audio_vae.encode(mel).latent_dist.mode()[:, :, :frames_l]
        packed = pipe._normalize_audio_latents(pipe._pack_audio_latents(za), audio_vae.latents_mean,
                                               audio_vae.latents_std)  # fmt: skip
        return {"video": video, "audio": pipe._unpack_audio_latents(packed, frames_l, za.shape[3])}

    def reference_media(self, adapter, output):
        """Frames in uint8 units; the waveform right-padded with silence to the clip's clock, as ff decodes it."""
        frames, audio = output.frames, output.audio
        samples = round(adapter.duration * float(adapter.vocoder.config.output_sampling_rate))
        audio = torch.nn.functional.pad(audio.float(), (0, samples - audio.shape[-1]))
        return [[f.float() * 255, a] for f, a in zip(frames, audio)]


class TestLTX2I2AVConformance(TestLTX2T2AVConformance):
    """ltx2_i2av: the kit binds a random image to the required ``first_frame`` slot; the pipeline gets it as
    ``image`` (and the state's pinned first latent frame through its latents, as in a two-stage run)."""

    adapter_cls = LTX2I2AVAdapter
    adapter_kwargs = {**ADAPTER_KWARGS, "image_crf": 0}
    reference_pipeline = LTX2ImageToVideoPipeline
    variant = "i2av"

    def reference_call_kwargs(self, adapter, inputs):
        (image, *_) = [m["data"] for m in inputs[0].media]
        return {**super().reference_call_kwargs(adapter, inputs), "image_crf": 0,
                "image": Image.fromarray(image.permute(1, 2, 0).numpy())}  # fmt: skip

    def reference_condition(self, pipe, adapter, inputs, run):
        """Besides the text: ``prepare_latents``' first latent frame of each bound image."""
        out = super().reference_condition(pipe, adapter, inputs, run)
        latents = []
        with torch.no_grad():
            for item in inputs:
                image = pipe.video_processor.preprocess(Image.fromarray(item.media[0]["data"].permute(1, 2, 0).numpy()),
                                                        height=SIZE, width=SIZE)  # fmt: skip
                packed, _ = pipe.prepare_latents(image, 1, 4, SIZE, SIZE, FRAMES, 0.0, torch.float32, "cpu",
                                                 torch.Generator().manual_seed(0), None)  # fmt: skip
                p, pt = _patches(pipe)
                video = pipe._unpack_latents(packed, (FRAMES - 1) // 2 + 1, SIZE // 8, SIZE // 8, p, pt)
                latents.append(video[:, :, :1])
        return {**out, "first_frame_latent": torch.cat(latents)}
