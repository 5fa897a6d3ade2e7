"""LTX-2 behind ff's stage methods: ``ltx2_t2av`` (text to audio + video).

The maths follows diffusers' ``LTX2Pipeline`` (pipelines/ltx2/pipeline_ltx2.py) step for step, without
instantiating it:

* text: the Gemma-3 tokenizer pads on the left to ``max_sequence_length``; every hidden state of the text encoder
  (embeddings + each layer) is stacked and flattened per token (``_get_gemma_prompt_embeds``), then the text
  connectors (``LTX2TextConnectors``) turn it into the video and audio streams' prompt embeddings and their
  attention mask. Both run once, in :meth:`preprocess`, and are cached (the negative prompt, "" when absent, too).
* latents: a two-component :class:`~ff_core.adapter.LatentState`, ``video`` (B, C, F, h, w) normalised per channel
  ``(z - latents_mean) * scaling_factor / latents_std`` and ``audio`` (B, C, L, M) normalised per packed feature
  (``latents_mean`` / ``latents_std`` of the audio VAE have one entry per ``(channel, mel bin)``); both unpacked.
* denoiser: :meth:`velocity` packs them into tokens inside (video ``[B, F h w / p^2, C p_t p^2]``, audio
  ``[B, L, C M]``), calls ``transformer(..., timestep=sigma * 1000, sigma=sigma * 1000, fps=frame_rate)`` as the
  pipeline does, and unpacks both velocities ``eps - x0``.
* schedule: ``FlowMatchEulerDiscreteScheduler`` at ``sigmas = linspace(1, 1/N, N)`` with the resolution-dependent
  shift ``mu = calculate_shift(video tokens, ...)`` of the scheduler config; the audio stream steps on the same
  sigmas (the pipeline deep-copies the scheduler for it).
* decode: video VAE of the denormalised latents, audio VAE to a mel spectrogram, vocoder to the waveform.
* targets (:meth:`encode_output`): the video clip on the ``frame_rate`` grid (the loader fits it to
  :meth:`output_geometry`, or to its ``data.buckets`` entry: :meth:`check_bucket`), the audio cut to that clip's own
  clock ``frames / frame_rate`` (:mod:`ff_ltx2.audio`; a
  soundtrack that ends early is right-padded with silence, as ltx-trainer's ``MediaDataset._extract_audio`` and
  Flow-Factory's ``prepare_ltx2_target_audio`` do), both VAE posteriors taken at their mode (``latent_dist.mode()``:
  ltx-trainer's ``scripts/process_videos.py`` ``encode_video`` / ``encode_audio`` call ltx-core's encoders, which
  return normalised means; Flow-Factory's ``encode_ltx2_target_video`` / ``encode_ltx2_target_audio`` take the mode);
  ``target_posterior="sample"`` draws posterior samples from the training generator instead.
* ``first_frame_conditioning_p`` (ltx-trainer's text-to-video option): a per-sample Bernoulli(p) draw in
  :meth:`prepare_condition`; a drawn sample's first latent frame stays clean, at timestep 0, out of the loss
  (:meth:`_clean_state`, :meth:`_timesteps`).
"""

from __future__ import annotations

import inspect
import math
import os
import re
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ff_core.adapter import (
    Adapter,
    Condition,
    ConditionInput,
    LatentState,
    move_condition,
    prompt_rows,
    reject_input_media,
    resolve_dtype,
    scheduler_sigma_table,
)
from ff_core.audio import audio_on_clock, clip_clock_start, clock_window, to_model_rate
from ff_core.contracts import (
    AUDIO_OUT,
    VIDEO_OUT,
    AudioSpan,
    ClipDefaults,
    MediaGeometry,
    MediaType,
    PipelineIOContract,
    SlotSpec,
    TensorColumns,
)
from ff_core.errors import ConfigError
from ff_core.image_latents import pixels_to_signed, signed_to_uint8
from ff_core.seeding import derive_seed
from ff_ltx2.audio import log_mel

# Spec dataset-guide, "Offline model support", ltx2_t2av: every candidate an exact ordered (video, audio) pair with
# required fps and sample_rate.
T2AV_CONTRACT = PipelineIOContract(outputs=(VIDEO_OUT, AUDIO_OUT))
# ltx2_i2av: the same pair, conditioned on the required first_frame image slot.
I2AV_CONTRACT = PipelineIOContract(outputs=(VIDEO_OUT, AUDIO_OUT), slots=(SlotSpec("first_frame", MediaType.IMAGE),))
TEXT_KEYS = ("video_prompt_embeds", "audio_prompt_embeds", "prompt_attention_mask")
LTX2_CLIP = ClipDefaults(height=512, width=768, num_frames=121, fps=24.0, fps_key="frame_rate")
"""LTX-2's default clip: 121 frames of 512x768 at 24 fps (diffusers' ``LTX2Pipeline`` defaults), its rate the
``frame_rate`` argument."""
# Tensor-parquet rows (docs/ltx2.md, "Training from shards"): the latents under FastVideo's T2VA names (``vae_latent``,
# ``audio_latent``: its pyarrow_schema_t2va), the text under the condition keys: the connectors' outputs, stored at
# max_sequence_length with the mask (the connectors fill padded positions with their learnable registers, so the
# padding is content and is not stripped). The negative prompt's (CFG in sampling only) when the rows have it.
T2AV_COLUMNS = TensorColumns(
    condition=(*TEXT_KEYS, *(f"negative_{k}" for k in TEXT_KEYS)),
    latents={"vae_latent": "video", "audio_latent": "audio"},
    optional=tuple(f"negative_{k}" for k in TEXT_KEYS),
)
# LoRA targets that leave the audio stream's own layers frozen (docs/ltx2.md, "Freezing the audio stream"): the video
# self- and text-attention and the audio-to-video attention (video queries reading the audio), never audio_attn1 /
# audio_attn2 / video_to_audio_attn. peft matches a target on a "." boundary, so "attn1.to_q" is not "audio_attn1".
VIDEO_LORA_TARGETS: tuple[str, ...] = tuple(f"{m}.{p}" for m in ("attn1", "attn2", "audio_to_video_attn")
                                            for p in ("to_q", "to_k", "to_v", "to_out.0"))  # fmt: skip

# The audio stream's own parameters (docs/ltx2.md, "Freezing the audio stream"): named ``audio_*`` at the top of the
# transformer or of a block (projections, time and caption embeddings, norms, self/text attention, feed-forward,
# modulation tables, including the audio side's table of the audio<->video attentions), the video-to-audio attention
# (audio queries reading the video) and the audio-timestep modulation of the cross-modal attentions. The video stream
# keeps the audio-to-video attention and its norm (video queries reading the audio) and everything else.
_AUDIO_PARAMETER = re.compile(
    r"^(transformer_blocks\.\d+\.)?(audio_(?!to_video_)|video_to_audio_|av_cross_attn_audio_)")


def video_vae_compression(config: dict[str, Any]) -> tuple[int, int]:
    """``(spatial, temporal)`` compression of an ``AutoencoderKLLTX2Video`` config, from what its blocks do.

    Explicit ``spatial_compression_ratio`` / ``temporal_compression_ratio`` win (the released checkpoints: 32, 8).
    Else each scaled encoder block halves the axes its ``downsample_type`` names (``spatial``: height and width,
    ``temporal``: frames, ``spatiotemporal``: all three), after the ``patch_size`` / ``patch_size_t`` patchify; the
    model's own default (``patch * 2 ** blocks`` for both axes) is wrong for any block that is not spatiotemporal.
    """
    spatial, temporal = config.get("spatial_compression_ratio"), config.get("temporal_compression_ratio")
    if spatial is not None and temporal is not None:
        return int(spatial), int(temporal)
    scaling = config.get("spatio_temporal_scaling", (True, True, True, True))
    blocks = len(config.get("layers_per_block", (4, 6, 6, 2, 2)))
    if isinstance(scaling, bool):
        scaling = (scaling,) * (blocks - 1)
    types = config.get("downsample_type", ("spatial", "temporal", "spatiotemporal", "spatiotemporal"))
    spatial_blocks = sum(on and k in ("spatial", "spatiotemporal") for on, k in zip(scaling, types))
    temporal_blocks = sum(on and k in ("temporal", "spatiotemporal") for on, k in zip(scaling, types))
    s = int(config.get("patch_size", 4)) * 2**spatial_blocks
    t = int(config.get("patch_size_t", 1)) * 2**temporal_blocks
    return (int(spatial) if spatial is not None else s), (int(temporal) if temporal is not None else t)


KWARGS = "model.adapter_kwargs"
# How encode_output takes the target latents from the VAE posteriors (adapter_kwargs.target_posterior).
TARGET_POSTERIORS = ("mode", "sample")
# The stream of first_frame_conditioning_p's draws, derived from the objective's condition generator (its seed): the
# generator itself is left as it was (evaluation samples its noise from it next).
FIRST_FRAME_STREAM = 0x1F1F
# Set on a transformer whose video timestep may be per token (T2AV with first_frame_conditioning_p > 0): the
# context-parallel plan, built from the class and the network, then splits the timestep with the tokens.
PER_TOKEN_TIMESTEPS = "ff_per_token_timesteps"
# AutoencoderKLLTX2Audio's mel_compression_ratio (diffusers' LATENT_DOWNSAMPLE_FACTOR): mel bins per latent bin.
AUDIO_MEL_COMPRESSION = 4


def geometry_problems(num_frames: int, height: int, width: int, spatial: int, temporal: int, patch: int,
                      patch_t: int) -> list[tuple[str, str]]:  # fmt: skip
    """``(key, reason)`` for each axis of a clip the checkpoint cannot encode (empty: it can): ``(num_frames - 1)``
    divisible by the video VAE's temporal compression x the transformer's temporal patch (LTX-2: 8 k + 1 frames), the
    canvas by its spatial compression x patch (LTX-2: multiples of 32)."""
    problems = []
    if num_frames < 1 or (num_frames - 1) % (temporal * patch_t):
        problems.append(("num_frames", f"(num_frames - 1) must be divisible by {temporal * patch_t} (the video VAE's "
                         f"temporal compression x patch), got {num_frames}; valid: "
                         f"{', '.join(str(1 + k * temporal * patch_t) for k in range(1, 4))}, ..."))  # fmt: skip
    for key, value in (("height", height), ("width", width)):
        if value < 1 or value % (spatial * patch):
            problems.append((key, f"must be a multiple of {spatial * patch} (video VAE compression x patch size), got "
                             f"{value}"))  # fmt: skip
    return problems


def check_geometry(num_frames: int, height: int, width: int, spatial: int, temporal: int, patch: int,
                   patch_t: int) -> None:  # fmt: skip
    """Refuse a clip geometry the checkpoint cannot encode (:func:`geometry_problems`), naming the
    ``model.adapter_kwargs`` key. Used before weights load (:meth:`LTX2T2AVAdapter.check_adapter_kwargs`, from the
    config files) and by the constructor."""
    for key, reason in geometry_problems(num_frames, height, width, spatial, temporal, patch, patch_t)[:1]:
        raise ConfigError(f"{KWARGS}.{key}", reason)


def _check_number(key: str, value: Any, *, integer: bool, minimum: float, strict: bool = False) -> None:
    """``adapter_kwargs[key]`` is a number (an integer when ``integer``) ``>= minimum`` (``> minimum`` when
    ``strict``), else one ConfigError naming it."""
    kind = int if integer else (int, float)
    ok = isinstance(value, kind) and not isinstance(value, bool) and (value > minimum if strict else value >= minimum)
    if not ok:
        what = "an integer" if integer else "a number"
        raise ConfigError(f"{KWARGS}.{key}", f"must be {what} {'>' if strict else '>='} {minimum:g}, got {value!r}")


def _tolerance(audio_tolerance: float | None) -> float:
    """``audio_tolerance`` as :func:`~ff_core.audio.clock_window` takes it: ``None`` pads any shortfall."""
    return math.inf if audio_tolerance is None else float(audio_tolerance)


def _to_video(item: Any, index: int) -> tuple[Tensor, float]:
    """One decoded target video as ``uint8`` (F, 3, H, W) and its first second on the clip's clock, where the audio is
    cut from (:func:`~ff_core.audio.clip_clock_start`)."""
    frames = getattr(item, "frames", None)
    if frames is not None:
        return frames.permute(0, 3, 1, 2), clip_clock_start(item)
    if isinstance(item, Tensor) and item.ndim == 4 and item.shape[1] == 3:
        return item, 0.0
    shape = tuple(item.shape) if isinstance(item, Tensor) else type(item).__name__
    raise ValueError(f"media[{index}][0]: expected a video (DecodedVideo or uint8 (F, 3, H, W) tensor), got {shape}")


class LTX2T2AVAdapter(Adapter):
    """LTX-2 text-to-audio+video (any checkpoint in diffusers' ``LTX2Pipeline`` layout).

    Build it with :meth:`from_pretrained`; the transformer (video, audio and cross-modal blocks alike) trains,
    everything else is frozen.
    """

    name: ClassVar[str] = "ltx2_t2av"
    io_contract: ClassVar[PipelineIOContract] = T2AV_CONTRACT
    preprocess_version: ClassVar[str] = "1"
    # Every attention projection of the transformer (video and audio self/cross attention, audio<->video attention):
    # the LTX-2 trainer's default LoRA targets.
    default_lora_targets: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out.0")
    lora_prefix: ClassVar[str] = "transformer"
    preprocessing_components: ClassVar[tuple[str, ...]] = ("text_encoder", "connectors")
    # One mean error per stream, as the LTX-2 trainers; pooled by element count the audio would get ~2 % of the loss
    # at a 5 s 512x768 clip (16,128 of 802,560 latent elements). 0.5 each (the loss is sum_k w_k m_k,
    # ff_core.sampling.component_mean): half the trainers' sum, ff's LTX-2 loss scale since the per-stream means came
    # in, which the recipes' lr / DPO beta and the benchmark figures were set at. A config's component_weights wins.
    default_component_weights: ClassVar[dict[str, float] | None] = {"video": 0.5, "audio": 0.5}
    latent_components: ClassVar[tuple[str, ...] | None] = ("video", "audio")
    # The diffusers pipelines of LTX-2 checkpoints (diffusers/pipelines/__init__.py): refused before weights load.
    checkpoint_classes: ClassVar[dict[str, tuple[str, ...]]] = {
        "_class_name": ("LTX2Pipeline", "LTX2ImageToVideoPipeline", "LTX2ConditionPipeline", "LTX2InContextPipeline",
                        "LTX2ModularPipeline", "LTX25ModularPipeline"),
        "transformer": ("LTX2VideoTransformer3DModel",)}
    tensor_columns: ClassVar[TensorColumns] = T2AV_COLUMNS
    # Training-time settings: shards written with other values hold the same tensors (provenance ignores them).
    training_kwargs: ClassVar[tuple[str, ...]] = ("first_frame_conditioning_p", "use_cross_timestep")
    # The default clip, once: from_pretrained's defaults (so _settings and check_adapter_kwargs) and
    # resolve_output_geometry (resolve_clip) read it.
    clip_defaults: ClassVar[ClipDefaults] = LTX2_CLIP

    def __init__(
        self,
        *,
        transformer: nn.Module,
        vae: nn.Module,
        audio_vae: nn.Module,
        vocoder: nn.Module,
        connectors: nn.Module,
        text_encoder: nn.Module,
        tokenizer: Any,
        scheduler: Any,
        height: int,
        width: int,
        num_frames: int,
        frame_rate: float,
        max_sequence_length: int = 1024,
        use_cross_timestep: bool = True,
        mel_n_fft: int = 1024,
        audio_tolerance: float | None = None,
        target_posterior: str = "mode",
        first_frame_conditioning_p: float = 0.0,
    ) -> None:
        """
        Args:
            transformer: the ``LTX2VideoTransformer3DModel``.
            vae: the ``AutoencoderKLLTX2Video``.
            audio_vae: the ``AutoencoderKLLTX2Audio``.
            vocoder: the ``LTX2Vocoder`` (mel spectrogram -> waveform; ``LTX2VocoderWithBWE`` for LTX-2.3).
            connectors: the ``LTX2TextConnectors``.
            text_encoder: the Gemma-3 text encoder.
            tokenizer: its tokenizer (padded on the left, as the pipeline does).
            scheduler: the checkpoint's ``FlowMatchEulerDiscreteScheduler`` (its shift settings set the schedule).
            height: pixel rows of sampled videos and training targets (multiple of the VAE's spatial compression x
                the transformer's patch size).
            width: pixel columns, likewise.
            num_frames: frames per video; ``(num_frames - 1)`` divisible by the VAE's temporal compression.
            frame_rate: frames per second: the video grid targets are sampled onto and the clock the audio is cut to
                (``num_frames / frame_rate`` seconds); also the transformer's ``fps`` conditioning.
            max_sequence_length: Gemma tokens per prompt (diffusers' default 1024; capped by the tokenizer).
            use_cross_timestep: the pipeline's ``use_cross_timestep`` (its default ``True``): audio<->video attention
                modulated by the other stream's noise level.
            mel_n_fft: FFT size of the target audio's mel spectrogram (LTX-2's audio processor: 1024).
            audio_tolerance: ``None`` (default): a target's audio shorter than the clip's clock is right-padded with
                silence, however short (ltx-trainer's ``MediaDataset._extract_audio`` and Flow-Factory's
                ``prepare_ltx2_target_audio`` trim or right-pad with zeros; ``ff data validate`` notes each one). A
                number of seconds: the old rule, audio short by more than that is rejected (``0.05`` was the
                default before).
            target_posterior: ``"mode"`` (default): the target latents are the VAE posteriors' modes, video and
                audio (ltx-trainer's ``encode_video`` / ``encode_audio``, Flow-Factory's LTX-2 target codec);
                ``"sample"``: posterior samples drawn from the training generator (video first, then audio).
            first_frame_conditioning_p: the share of training samples whose first latent frame is pinned clean
                (timestep 0 on its tokens, not noised, out of the loss), so that one LoRA serves text-to-video and
                image-to-video (ltx-trainer's ``first_frame_conditioning_p``; docs/ltx2.md, "First-frame
                conditioning"). 0 (default): never; ``ltx2_i2av`` always pins its condition image and takes none.
        """
        super().__init__()
        self.transformer, self.vae, self.audio_vae, self.vocoder = transformer, vae, audio_vae, vocoder
        self.connectors, self.text_encoder, self.tokenizer = connectors, text_encoder, tokenizer
        self.scheduler = scheduler
        self.tokenizer.padding_side = "left"  # Gemma pads on the left for the connectors (pipeline)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.spatial_stride, self.temporal_stride = video_vae_compression(dict(vae.config))
        type(self)._check_values(height=height, width=width, num_frames=num_frames, frame_rate=frame_rate,
                                 max_sequence_length=max_sequence_length, mel_n_fft=mel_n_fft,
                                 audio_tolerance=audio_tolerance, target_posterior=target_posterior,
                                 first_frame_conditioning_p=first_frame_conditioning_p)  # fmt: skip
        check_geometry(num_frames, height, width, self.spatial_stride, self.temporal_stride,
                       transformer.config.patch_size, transformer.config.patch_size_t)  # fmt: skip
        self.height, self.width, self.num_frames, self.frame_rate = height, width, num_frames, float(frame_rate)
        self.max_sequence_length = min(max_sequence_length, tokenizer.model_max_length)
        self.use_cross_timestep, self.mel_n_fft, self.audio_tolerance = use_cross_timestep, mel_n_fft, audio_tolerance
        self.target_posterior = target_posterior
        self.first_frame_conditioning_p = float(first_frame_conditioning_p)
        if self.first_frame_conditioning_p > 0:  # its training timesteps are per token: split them under cp
            setattr(transformer, PER_TOKEN_TIMESTEPS, True)
        for frozen in (vae, audio_vae, vocoder, connectors, text_encoder):
            frozen.requires_grad_(False).eval()

    # -- before weights: adapter_kwargs and the targets' geometry -------------------------------
    @classmethod
    def _settings(cls, adapter_kwargs: dict[str, Any] | None) -> dict[str, Any]:
        """``adapter_kwargs`` over :meth:`from_pretrained`'s defaults (one place for them: its signature)."""
        params = list(inspect.signature(cls.from_pretrained).parameters.values())[1:]
        defaults = {p.name: p.default for p in params if p.default is not p.empty}
        return {**defaults, **(adapter_kwargs or {})}

    @classmethod
    def _check_values(cls, **values: Any) -> None:
        """The checks of :meth:`check_adapter_kwargs` that need no checkpoint, on the given values."""
        for key in ("height", "width", "num_frames", "max_sequence_length", "mel_n_fft"):
            if key in values:
                _check_number(key, values[key], integer=True, minimum=1)
        if "frame_rate" in values:
            _check_number("frame_rate", values["frame_rate"], integer=False, minimum=0, strict=True)
        if values.get("audio_tolerance") is not None:
            _check_number("audio_tolerance", values["audio_tolerance"], integer=False, minimum=0)
        p = values.get("first_frame_conditioning_p", 0.0)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
            raise ConfigError(f"{KWARGS}.first_frame_conditioning_p", f"must be a probability, 0 <= p <= 1, got {p!r}")
        if "target_posterior" in values and values["target_posterior"] not in TARGET_POSTERIORS:
            raise ConfigError(f"{KWARGS}.target_posterior", f"must be one of {', '.join(TARGET_POSTERIORS)}, got "
                              f"{values['target_posterior']!r}")  # fmt: skip

    @classmethod
    def check_adapter_kwargs(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any]
    ) -> None:
        """Before any weight loads: every number in range, ``dtype`` and ``target_posterior`` known, ``image_crf`` only
        for ``ltx2_i2av``;
        with the checkpoint, the clip geometry against its video VAE's compression and the transformer's patch sizes
        (:func:`check_geometry`, read from ``vae/config.json`` and ``transformer/config.json``)."""
        from ff_core.pretrained import read_config

        settings = cls._settings(adapter_kwargs)
        cls._check_values(**{k: settings[k] for k in ("height", "width", "num_frames", "frame_rate",
                                                      "max_sequence_length", "mel_n_fft", "audio_tolerance",
                                                      "target_posterior", "first_frame_conditioning_p")})
        try:
            resolve_dtype(settings["dtype"])
            cls._extra_kwargs(settings["image_crf"])
        except ValueError as exc:  # "model.adapter_kwargs.<key>: reason"
            key, _, reason = str(exc).partition(": ")
            raise ConfigError(key, reason) from None
        if pretrained_model_name_or_path is None:
            return
        vae = read_config(pretrained_model_name_or_path, subfolder="vae")
        transformer = read_config(pretrained_model_name_or_path, subfolder="transformer")
        spatial, temporal = video_vae_compression(vae)
        check_geometry(settings["num_frames"], settings["height"], settings["width"], spatial, temporal,
                       int(transformer.get("patch_size", 1)), int(transformer.get("patch_size_t", 1)))  # fmt: skip

    @classmethod
    def resolve_output_geometry(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any] | None = None
    ) -> tuple[MediaGeometry, AudioSpan]:
        """The video clip :meth:`output_geometry` decodes, and the audio span :meth:`target_mel` cuts (the clip's
        ``num_frames / frame_rate`` seconds; ``audio_tolerance`` short at most, any shortfall, ``math.inf``, when it is
        ``None``: padded with silence, noted by ``ff data validate``): from ``adapter_kwargs`` alone."""
        s = cls._settings(adapter_kwargs)
        cls._check_values(**{k: s[k] for k in ("height", "width", "num_frames", "frame_rate", "audio_tolerance")})
        video = cls.resolve_clip(adapter_kwargs)  # adapter_kwargs over clip_defaults
        return video, AudioSpan(video.num_frames / video.fps, tolerance=_tolerance(s["audio_tolerance"]))

    @classmethod
    def check_bucket(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any] | None,
        geometry: MediaGeometry,
    ) -> None:  # fmt: skip
        """Refuse a ``data.buckets`` clip the checkpoint cannot train on (before weights load). ltx-trainer's resolution
        buckets ``WxHxF`` (``scripts/process_videos.py`` ``parse_resolution_buckets``): any canvas of multiples of the
        video VAE's spatial compression x the transformer's patch (LTX-2: 32) and any ``8 k + 1`` frames (its temporal
        compression x temporal patch), read from ``vae/config.json`` and ``transformer/config.json`` as
        :func:`check_geometry` does (without a checkpoint only the rate is checked). The rate must be ``frame_rate``:
        the clip's audio is cut to its own ``num_frames / frame_rate`` seconds and the transformer is conditioned on
        ``frame_rate`` (its rope's seconds per latent frame). Any ``start`` >= 0: the video is decoded from there on
        the clip's clock and the audio is cut from the same instant (:meth:`target_mel`), its span checked per bucket
        (:meth:`resolve_bucket_geometry`)."""
        video, _ = cls.resolve_output_geometry(pretrained_model_name_or_path, adapter_kwargs)
        if geometry.num_frames is None or geometry.fps is None or not math.isclose(geometry.fps, video.fps):
            raise ValueError(f"{cls.name} trains on clips at model.adapter_kwargs.frame_rate {video.fps:g} fps (the "
                             "transformer's fps conditioning and the audio's clock), got "
                             f"{'no clip' if geometry.num_frames is None else f'{geometry.num_frames} frames'} at "
                             f"{geometry.fps} fps; give num_frames and fps: {video.fps:g}")  # fmt: skip
        if pretrained_model_name_or_path is None:
            return
        from ff_core.pretrained import read_config

        vae = read_config(pretrained_model_name_or_path, subfolder="vae")
        transformer = read_config(pretrained_model_name_or_path, subfolder="transformer")
        problems = geometry_problems(geometry.num_frames, geometry.height, geometry.width, *video_vae_compression(vae),
                                     int(transformer.get("patch_size", 1)), int(transformer.get("patch_size_t", 1)))
        for key, reason in problems[:1]:
            raise ValueError(f"{key}: {reason}")

    @classmethod
    def resolve_bucket_geometry(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any] | None,
        geometry: MediaGeometry,
    ) -> tuple[MediaGeometry, AudioSpan]:  # fmt: skip
        """What a bucket's targets must cover: its clip, and the audio of that clip's own clock, ``num_frames /
        frame_rate`` seconds from its ``start`` (:meth:`encode_output` cuts exactly that), with ``audio_tolerance``."""
        _, span = cls.resolve_output_geometry(pretrained_model_name_or_path, adapter_kwargs)
        return geometry, AudioSpan(geometry.num_frames / float(geometry.fps), start=geometry.start,
                                   tolerance=span.tolerance)  # fmt: skip

    @classmethod
    def resolve_tensor_shapes(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The stored shapes the checkpoint's configs fix (``ff fit`` checks every shard row before weights load):
        ``vae_latent`` (C, F', h, w) with C the video VAE's ``latent_channels``, F' a multiple of the transformer's
        ``patch_size_t`` and h, w of its ``patch_size`` (what :meth:`pack_video` folds); ``audio_latent`` (C_a, L, M)
        with the audio VAE's ``latent_channels`` and ``mel_bins`` / 4 (its mel compression); the prompt embeddings
        (L, the transformer's ``caption_channels``) and their mask (L,). Nothing without a checkpoint."""
        from ff_core.data.tensor_parquet.checks import StoredShape
        from ff_core.pretrained import read_config

        if pretrained_model_name_or_path is None:
            return {}
        vae = read_config(pretrained_model_name_or_path, subfolder="vae")
        audio_vae = read_config(pretrained_model_name_or_path, subfolder="audio_vae")
        transformer = read_config(pretrained_model_name_or_path, subfolder="transformer")
        p, pt = int(transformer.get("patch_size", 1)), int(transformer.get("patch_size_t", 1))
        audio = {0: int(audio_vae["latent_channels"])} if "latent_channels" in audio_vae else {}
        if "mel_bins" in audio_vae:
            audio[2] = int(audio_vae["mel_bins"]) // AUDIO_MEL_COMPRESSION
        shapes: dict[str, Any] = {
            "vae_latent": StoredShape(4, {0: int(vae["latent_channels"])} if "latent_channels" in vae else {},
                                      {1: pt, 2: p, 3: p}, "(C, F', h, w): C = the video VAE's latent_channels"),
            "audio_latent": StoredShape(3, audio, meaning="(C_a, L, M): the audio VAE's latent_channels, mel_bins / 4"),
        }  # fmt: skip
        width = {-1: int(transformer["caption_channels"])} if "caption_channels" in transformer else {}
        for prefix in ("", "negative_"):
            for key in ("video_prompt_embeds", "audio_prompt_embeds"):
                shapes[prefix + key] = StoredShape(2, width, meaning="(max_sequence_length, caption_channels)")
            shapes[prefix + "prompt_attention_mask"] = StoredShape(1, meaning="(max_sequence_length,)")
        return shapes

    # -- loading ---------------------------------------------------------------------------------
    @classmethod
    def _components(cls, path: str, dt: torch.dtype, revision: str | None) -> dict[str, Any]:
        import transformers
        from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
        from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder
        from diffusers.schedulers import FlowMatchEulerDiscreteScheduler
        from transformers import AutoTokenizer

        from ff_core.pretrained import read_config

        index = read_config(path, "model_index.json")

        def named(component: str, default: Any, library: Any) -> Any:
            """The class ``model_index.json`` names for ``component`` (LTX-2.3 ships ``LTX2VocoderWithBWE``)."""
            name = (index.get(component) or [None, None])[1]
            found = getattr(library, name, None) if name else default
            if not isinstance(found, type):
                raise ValueError(f"{path}: model_index.json names an unknown {component} class {name!r}")
            return found

        import diffusers.pipelines.ltx2 as ltx2

        text_cls = named("text_encoder", transformers.Gemma3ForConditionalGeneration, transformers)
        vocoder_cls = named("vocoder", LTX2Vocoder, ltx2)
        kw = {"revision": revision}
        return {
            "transformer": LTX2VideoTransformer3DModel.from_pretrained(path, subfolder="transformer",
                                                                       torch_dtype=dt, **kw),
            # The VAEs and the vocoder stay fp32: decoding and target encoding are not where memory goes.
            "vae": AutoencoderKLLTX2Video.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32, **kw),
            "audio_vae": AutoencoderKLLTX2Audio.from_pretrained(path, subfolder="audio_vae",
                                                                torch_dtype=torch.float32, **kw),
            "vocoder": vocoder_cls.from_pretrained(path, subfolder="vocoder", torch_dtype=torch.float32, **kw),
            "connectors": LTX2TextConnectors.from_pretrained(path, subfolder="connectors", torch_dtype=dt, **kw),
            "text_encoder": text_cls.from_pretrained(path, subfolder="text_encoder", dtype=dt, **kw),
            "tokenizer": AutoTokenizer.from_pretrained(path, subfolder="tokenizer", **kw),
            "scheduler": FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler", **kw),
        }  # fmt: skip

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *,
        image_crf: int | None = None,
        height: int = LTX2_CLIP.height,
        width: int = LTX2_CLIP.width,
        num_frames: int = LTX2_CLIP.num_frames,
        frame_rate: float = LTX2_CLIP.fps,
        max_sequence_length: int = 1024,
        use_cross_timestep: bool = True,
        mel_n_fft: int = 1024,
        audio_tolerance: float | None = None,
        target_posterior: str = "mode",
        first_frame_conditioning_p: float = 0.0,
        dtype: str | torch.dtype = "float32",
        revision: str | None = None,
    ) -> LTX2T2AVAdapter:
        """Load every component of a diffusers LTX-2 checkpoint (local folder or hub id).

        Args:
            pretrained_model_name_or_path: folder in the diffusers layout (``model_index.json``), or a hub id.
            height: see :class:`LTX2T2AVAdapter`.
            width: see :class:`LTX2T2AVAdapter`.
            num_frames: see :class:`LTX2T2AVAdapter`.
            frame_rate: see :class:`LTX2T2AVAdapter`.
            max_sequence_length: see :class:`LTX2T2AVAdapter`.
            use_cross_timestep: see :class:`LTX2T2AVAdapter`.
            mel_n_fft: see :class:`LTX2T2AVAdapter`.
            audio_tolerance: see :class:`LTX2T2AVAdapter`.
            target_posterior: see :class:`LTX2T2AVAdapter`.
            first_frame_conditioning_p: see :class:`LTX2T2AVAdapter`.
            image_crf: ``ltx2_i2av`` only (:class:`LTX2I2AVAdapter`); ``ltx2_t2av`` refuses a value.
            dtype: weights dtype of the transformer, the connectors and the text encoder (VAEs, vocoder: fp32).
            revision: hub revision.
        """
        path, dt = str(pretrained_model_name_or_path), resolve_dtype(dtype)
        # The geometry against the checkpoint's configs before any weight loads (ff fit checked it already).
        cls.check_adapter_kwargs(path, {"height": height, "width": width, "num_frames": num_frames,
                                        "frame_rate": frame_rate, "max_sequence_length": max_sequence_length,
                                        "mel_n_fft": mel_n_fft, "audio_tolerance": audio_tolerance,
                                        "image_crf": image_crf, "dtype": dtype,
                                        "target_posterior": target_posterior,
                                        "first_frame_conditioning_p": first_frame_conditioning_p})  # fmt: skip
        extra = cls._extra_kwargs(image_crf)
        adapter = cls(**cls._components(path, dt, revision), **extra, height=height, width=width, num_frames=num_frames,
                      frame_rate=frame_rate, max_sequence_length=max_sequence_length,
                      use_cross_timestep=use_cross_timestep, mel_n_fft=mel_n_fft,
                      audio_tolerance=audio_tolerance, target_posterior=target_posterior,
                      first_frame_conditioning_p=first_frame_conditioning_p)  # fmt: skip
        local = Path(path).expanduser()
        adapter.source = {"checkpoint": str(local.resolve()) if local.exists() else path, "revision": revision,
                          "dtype": str(dt).removeprefix("torch.")}  # fmt: skip
        return adapter

    @classmethod
    def _extra_kwargs(cls, image_crf: int | None) -> dict[str, Any]:
        if image_crf is not None:
            raise ValueError("model.adapter_kwargs.image_crf: ltx2_t2av takes no condition image (use ltx2_i2av)")
        return {}

    per_token_timesteps: ClassVar[bool] = False
    """Whether the video timestep is per token (I2AV's pinned first frame), split with the tokens under context
    parallelism. The plan is built from the class and the network (:meth:`context_parallel_plan`), so a T2AV adapter
    with ``first_frame_conditioning_p > 0`` marks its transformer instead (:data:`PER_TOKEN_TIMESTEPS`); T2AV's (B,)
    timestep otherwise stays out of the plan (diffusers' hook would warn that it does not split it)."""

    @property
    def denoiser(self) -> nn.Module:
        return self.transformer

    def sharding_blocks(self) -> dict[str, list[nn.Module]]:
        """The transformer's blocks (each one video + audio + cross-modal layer): the units FSDP2 shards one by one.
        Named explicitly: ``LTX2VideoTransformer3DModel`` declares no ``_no_split_modules``."""
        return {"transformer": list(self.transformer.transformer_blocks)}

    @classmethod
    def context_parallel_plan(cls, network: type | nn.Module) -> dict[str, Any] | None:
        """Both token streams split over the group (docs/scaling.md, "Sequence parallel"). diffusers' own
        ``LTX2VideoTransformer3DModel._cp_plan`` (0.42) splits the video only, expects the 3-D rope of
        ``rope_type: interleaved`` (the ``split`` layout's 4-D rope is left whole and the forward fails), misses the
        video cross-attention rope and the I2AV per-token timestep, and splits the prompt with its mask. Here: the video
        and audio tokens, each stream's self- and cross-attention rope in the checkpoint's layout, the per-token video
        timestep (:attr:`per_token_timesteps`: I2AV's; T2AV's with ``first_frame_conditioning_p > 0``, whose
        transformer is marked :data:`PER_TOKEN_TIMESTEPS`; its sampling's (B,) timestep then passes whole), both outputs
        gathered; the prompts stay whole on every rank (Ulysses attention over duplicated keys is exact)."""
        from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

        if isinstance(network, type):
            return {} if getattr(network, "_cp_plan", None) is not None else None
        if network.config.rope_type == "split":  # (B, heads, tokens, dim / 2)
            rope = {i: ContextParallelInput(split_dim=2, expected_dims=4, split_output=True) for i in (0, 1)}
        else:  # interleaved: (B, tokens, dim)
            rope = {i: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True) for i in (0, 1)}
        inputs = {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
                  "audio_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)}
        if cls.per_token_timesteps or getattr(network, PER_TOKEN_TIMESTEPS, False):  # (B, video tokens)
            inputs["timestep"] = ContextParallelInput(split_dim=1, expected_dims=2)
        return {
            "": inputs,
            **{name: dict(rope) for name in ("rope", "cross_attn_rope", "audio_rope", "cross_attn_audio_rope")},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
            "audio_proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        }  # fmt: skip

    def component_parameters(self, component: str) -> dict[str, list[str]]:
        """``audio``: the audio stream's parameters (:data:`_AUDIO_PARAMETER`); ``video``: every other transformer
        parameter. ``model.frozen_components: [audio]`` trains the video alone (docs/ltx2.md)."""
        if component not in ("video", "audio"):
            raise ValueError(f"{self.name} has the latent components ['video', 'audio'], not {component!r}")
        names = [n for n, _ in self.transformer.named_parameters()]
        return {self.lora_prefix: [n for n in names if bool(_AUDIO_PARAMETER.match(n)) == (component == "audio")]}

    @property
    def output_rates(self) -> tuple[float, float]:
        """The generated video's frame rate and the vocoder's sample rate (samples are logged and muxed at them)."""
        return (self.frame_rate, float(self.vocoder.config.output_sampling_rate))

    # -- condition side --------------------------------------------------------------------------
    def preprocess_identity(self) -> dict[str, Any]:
        """Checkpoint, revision, dtype and the token length: the connector outputs depend on nothing else."""
        source = getattr(self, "source", None)
        if source is None:
            raise ValueError(f"{self.name}: built without from_pretrained, so its checkpoint is unknown; set .source")
        return {**source, "max_sequence_length": self.max_sequence_length}

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str]) -> dict[str, Tensor]:
        """``LTX2Pipeline._get_gemma_prompt_embeds`` then ``connectors``: per prompt the video and audio streams'
        prompt embeddings (B, L, D) and the connectors' attention mask (B, L)."""
        inputs = self.tokenizer([p.strip() for p in prompts], padding="max_length", max_length=self.max_sequence_length,
                                truncation=True, add_special_tokens=True, return_tensors="pt")  # fmt: skip
        device = self.text_encoder.device
        ids, mask = inputs.input_ids.to(device), inputs.attention_mask.to(device)
        hidden = self.text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        embeds = torch.stack(hidden, dim=-1).flatten(2, 3).to(self.text_encoder.dtype)  # every layer, per token
        video, audio, connector_mask = self.connectors(embeds.to(self.connectors.dtype), mask, padding_side="left")
        return {"video_prompt_embeds": video, "audio_prompt_embeds": audio, "prompt_attention_mask": connector_mask}

    def _text_rows(self, inputs: list[ConditionInput]) -> list[dict[str, Tensor]]:
        positive = self.encode_prompt([item.prompt for item in inputs])
        negative = self.encode_prompt([item.negative_prompt or "" for item in inputs])
        return prompt_rows(positive, negative)

    @torch.no_grad()
    def preprocess(self, inputs: list[ConditionInput]) -> list[dict[str, Tensor]]:
        reject_input_media(inputs, self.name)
        return self._text_rows(inputs)

    def prepare_condition(self, batch: dict[str, Tensor], generator: torch.Generator | None = None) -> Condition:
        """The batch on the transformer's device and dtype; with ``first_frame_conditioning_p > 0`` and a
        ``generator`` (the objective's seeded condition stream, :func:`~ff_core.objectives.flow_matching.
        prepare_batch_condition`), also ``first_frame_pinned`` (B,) bool: which samples :meth:`_clean_state` pins.

        ltx-trainer's draw (``training_strategies/base_strategy.py``, ``_create_first_frame_conditioning_mask``): one
        Bernoulli(p) per sample, ``torch.rand(B) < p``. Drawn here once per batch, so the VAE-encoded targets
        (:meth:`encode_output`) and the stored ones (:meth:`stored_latents`, tensor-parquet shards) pin the same
        samples, from a stream derived from ``generator``'s seed (:data:`FIRST_FRAME_STREAM`) that leaves
        ``generator`` itself untouched: evaluation samples with it next. Without a generator nothing is drawn."""
        condition = move_condition(batch, self.transformer.device, self.transformer.dtype)
        if self.first_frame_conditioning_p > 0 and generator is not None:
            stream = torch.Generator().manual_seed(derive_seed(generator.initial_seed(), FIRST_FRAME_STREAM))
            n = condition["video_prompt_embeds"].shape[0]
            pinned = torch.rand(n, generator=stream) < self.first_frame_conditioning_p
            condition["first_frame_pinned"] = pinned.to(self.transformer.device)
        return condition

    def unconditional(self, condition: Condition) -> Condition | None:
        if "negative_video_prompt_embeds" not in condition:
            return None
        rest = {k: v for k, v in condition.items() if k not in TEXT_KEYS and not k.startswith("negative_")}
        return {**rest, **{k: condition[f"negative_{k}"] for k in TEXT_KEYS}}

    # -- latent normalisation --------------------------------------------------------------------
    def _video_stats(self, like: Tensor) -> tuple[Tensor, Tensor, float]:
        mean = self.vae.latents_mean.view(1, -1, 1, 1, 1).to(like.device, like.dtype)
        std = self.vae.latents_std.view(1, -1, 1, 1, 1).to(like.device, like.dtype)
        return mean, std, float(self.vae.config.scaling_factor)

    def normalize_video(self, z: Tensor) -> Tensor:
        mean, std, scale = self._video_stats(z)
        return (z - mean) * scale / std

    def denormalize_video(self, latents: Tensor) -> Tensor:
        mean, std, scale = self._video_stats(latents)
        return latents * std / scale + mean

    def _audio_stats(self, like: Tensor) -> tuple[Tensor, Tensor]:
        """The audio VAE's statistics per packed feature ``c * M + m``, as (1, C, 1, M) for unpacked latents."""
        c, m = like.shape[1], like.shape[3]
        mean = self.audio_vae.latents_mean.view(1, c, 1, m).to(like.device, like.dtype)
        std = self.audio_vae.latents_std.view(1, c, 1, m).to(like.device, like.dtype)
        return mean, std

    def normalize_audio(self, z: Tensor) -> Tensor:
        mean, std = self._audio_stats(z)
        return (z - mean) / std

    def denormalize_audio(self, latents: Tensor) -> Tensor:
        mean, std = self._audio_stats(latents)
        return latents * std + mean

    # -- packing (inside velocity only: the state is unpacked) -----------------------------------
    def pack_video(self, x: Tensor) -> Tensor:
        """(B, C, F, H, W) -> (B, F/p_t * H/p * W/p, C p_t p p) (``LTX2Pipeline._pack_latents``)."""
        p, pt = self.transformer.config.patch_size, self.transformer.config.patch_size_t
        b, c, f, h, w = x.shape
        x = x.reshape(b, c, f // pt, pt, h // p, p, w // p, p)
        return x.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)

    def unpack_video(self, tokens: Tensor, like: Tensor) -> Tensor:
        p, pt = self.transformer.config.patch_size, self.transformer.config.patch_size_t
        b, _, f, h, w = like.shape
        x = tokens.reshape(b, f // pt, h // p, w // p, -1, pt, p, p)
        return x.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)

    @staticmethod
    def pack_audio(x: Tensor) -> Tensor:
        """(B, C, L, M) -> (B, L, C M) (``LTX2Pipeline._pack_audio_latents`` without patches)."""
        return x.transpose(1, 2).flatten(2, 3)

    @staticmethod
    def unpack_audio(tokens: Tensor, like: Tensor) -> Tensor:
        return tokens.unflatten(2, (like.shape[1], like.shape[3])).transpose(1, 2)

    # -- geometry --------------------------------------------------------------------------------
    @property
    def duration(self) -> float:
        """The clip's official clock in seconds: ``num_frames / frame_rate``."""
        return self.num_frames / self.frame_rate

    @property
    def audio_latent_frames(self) -> int:
        """``round(duration * sample_rate / mel_hop / 4)``: the pipeline's ``audio_num_frames``."""
        return self.audio_frames_for(self.duration)

    def audio_frames_for(self, seconds: float) -> int:
        """Audio latent frames of a clip lasting ``seconds`` (``LTX2Pipeline``: ``round(duration *
        audio_latents_per_second)``)."""
        cfg = self.audio_vae.config
        per_second = cfg.sample_rate / cfg.mel_hop_length / float(self.audio_vae.temporal_compression_ratio)
        return round(seconds * per_second)

    def latent_shapes(self, batch_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The video (B, C, F', H', W') and audio (B, C_a, L, M') latent shapes of one generated clip."""
        video = (batch_size, self.vae.config.latent_channels, (self.num_frames - 1) // self.temporal_stride + 1,
                 self.height // self.spatial_stride, self.width // self.spatial_stride)  # fmt: skip
        cfg = self.audio_vae.config
        audio = (batch_size, cfg.latent_channels, self.audio_latent_frames,
                 cfg.mel_bins // self.audio_vae.mel_compression_ratio)  # fmt: skip
        return video, audio

    def output_geometry(self) -> tuple[MediaGeometry | None, ...]:
        """The video's decode specification (``num_frames`` on the ``frame_rate`` grid, fitted to the canvas); the
        audio is decoded whole and cut to the same clock in :meth:`encode_output`."""
        return (MediaGeometry(self.height, self.width, num_frames=self.num_frames, fps=self.frame_rate), None)

    def denoiser_tokens(self, geometry: MediaGeometry) -> int | None:
        """Video tokens ``F' h' w' / (p_t p^2)`` plus the clip's audio tokens (one per audio latent frame of its
        ``frames / fps`` seconds)."""
        p, pt = self.transformer.config.patch_size, self.transformer.config.patch_size_t
        frames = self.num_frames if geometry.num_frames is None else geometry.num_frames
        video = ((frames - 1) // self.temporal_stride + 1) // pt * (geometry.height // (self.spatial_stride * p)) * (
            geometry.width // (self.spatial_stride * p))
        return video + self.audio_frames_for(frames / (geometry.fps or self.frame_rate))

    # -- target side -----------------------------------------------------------------------------
    def _videos(self, media: list[list[Any]]) -> tuple[Tensor, list[float]]:
        videos, starts = [], []
        for i, outputs in enumerate(media):
            if len(outputs) != 2:
                raise ValueError(f"media[{i}]: {self.name} trains on exact (video, audio) pairs, got "
                                 f"{len(outputs)} item(s)")  # fmt: skip
            video, start = _to_video(outputs[0], i)
            if videos and video.shape != videos[0].shape:
                raise ValueError(f"media[{i}][0]: a clip of {tuple(video.shape)} (F, 3, H, W) in a batch whose first "
                                 f"is {tuple(videos[0].shape)}: {self.name} trains each batch on one clip geometry "
                                 "(data.buckets batches never mix buckets; batch mixed clips by bucket)")  # fmt: skip
            videos.append(video)
            starts.append(start)
        frames, _, height, width = videos[0].shape
        p, pt = self.transformer.config.patch_size, self.transformer.config.patch_size_t
        for key, reason in geometry_problems(frames, height, width, self.spatial_stride, self.temporal_stride, p,
                                             pt)[:1]:  # fmt: skip
            raise ValueError(f"media[0][0]: a clip of {tuple(videos[0].shape)} (F, 3, H, W) the checkpoint cannot "
                             f"encode: {key}: {reason} (the loader fits targets to output_geometry() or to their "
                             "data.buckets entry; fit others the same way)")  # fmt: skip
        x = torch.stack(videos).to(self.vae.device)  # (B, F, 3, H, W)
        x = pixels_to_signed(x)
        return x.permute(0, 2, 1, 3, 4).contiguous(), starts

    def target_mel(self, audio: Any, start: float, what: str, seconds: float | None = None) -> Tensor:
        """One target's audio as the audio VAE's input (C, 4 L, M): cut to ``[start, start + seconds)`` on its clock
        (or to the ``4 L`` mel hops' span when that is longer and the source has it), converted to the VAE's channels
        and rate once, padded or trimmed to ``4 L`` mel hops, log-mel; ``L = audio_frames_for(seconds)``.

        Args:
            audio: a ``DecodedAudio`` (its ``clock_rate`` honours the manifest's ``sample_rate``) or a float
                (C, N) tensor already at the VAE's rate.
            start: the video clip's first second on the clip's clock (the audio is cut from the same instant).
            what: names the target in errors.
            seconds: the video clip's own clock, ``frames / frame_rate`` (a ``data.buckets`` clip's); ``None``: the
                adapter's clip, :attr:`duration`.

        One clock for both streams: ``start`` and the clip's duration are official seconds (the video's declared
        ``fps``), and the audio's sample ``n`` plays at ``n / clock_rate`` (its declared ``sample_rate``), both counted
        from their stream's first timestamp (a container's ``start_time`` is not a delay of the clip). The decoded
        waveform's own start (file seconds) is put on that clock too: ``start * sample_rate / clock_rate``.
        """
        cfg = self.audio_vae.config
        seconds = self.duration if seconds is None else seconds
        waveform, rate, offset = audio_on_clock(audio, cfg.sample_rate, what)
        frames = 4 * self.audio_frames_for(seconds)
        samples = frames * cfg.mel_hop_length
        # 4 L hops can run past the clip's clock (L = round(duration * latents per second) rounded up): cut that much
        # of the source when it has it, so only a source that really ends is padded with silence; a clip is still
        # rejected only when it falls short of the clip's own duration.
        window = clock_window(waveform, rate, start - offset, seconds, tolerance=_tolerance(self.audio_tolerance),
                              what=what, keep=max(seconds, samples / float(cfg.sample_rate)))  # fmt: skip
        x = to_model_rate(window, rate, int(cfg.sample_rate), int(cfg.in_channels), samples)
        mel = log_mel(x.to(self.audio_vae.device), sample_rate=int(cfg.sample_rate), n_fft=self.mel_n_fft,
                      hop_length=int(cfg.mel_hop_length), n_mels=int(cfg.mel_bins))  # fmt: skip
        return mel[:, :frames]  # centred STFT: 1 + samples / hop frames, the last one past the clip

    @torch.no_grad()
    def encode_output(
        self, media: list[list[Any]], condition: Condition, generator: torch.Generator | None = None
    ) -> LatentState:
        x, starts = self._videos(media)
        # The batch's own clip (the adapter's, or a data.buckets entry's): its audio is cut to its clock.
        seconds = x.shape[2] / self.frame_rate
        mels = torch.stack([self.target_mel(outputs[1], starts[i], f"media[{i}][1]", seconds)
                            for i, outputs in enumerate(media)])  # fmt: skip
        # The posteriors' modes (ltx-trainer, Flow-Factory), or samples drawn from `generator`, video first.
        video = self._latents(self.vae.encode(x.to(self.vae.dtype)).latent_dist, generator)
        audio = self._latents(self.audio_vae.encode(mels.to(self.audio_vae.dtype)).latent_dist, generator)
        audio = audio[:, :, : self.audio_frames_for(seconds)]
        dtype = self.transformer.dtype
        return self._clean_state(self.normalize_video(video.float()).to(dtype),
                                 self.normalize_audio(audio.float()).to(dtype), condition)  # fmt: skip

    def stored_latents(self, latents: dict[str, Tensor], condition: Condition) -> LatentState:
        """Stored (normalised) latents as :meth:`encode_output` returns them, through :meth:`_clean_state` (the
        first latent frame pinned where encoding pins it)."""
        state = super().stored_latents(latents, condition)
        return self._clean_state(state.components["video"], state.components["audio"], condition)

    def _clean_state(self, video: Tensor, audio: Tensor, condition: Condition) -> LatentState:
        """The clean training state of encoded (or stored) latents: as they are, with the first latent frame of the
        samples :meth:`prepare_condition` drew (``first_frame_pinned``) pinned: a video mask (B, 1, F', 1, 1), 0 on
        those frames, so they are not noised, not in the loss, and seen at timestep 0 (:meth:`_timesteps`), as
        ltx-trainer's ``TextToVideoStrategy.prepare_training_inputs`` keeps their clean latents (``torch.where``),
        gives them timestep 0 (``_create_per_token_timesteps``) and masks them out of the loss (``video_loss_mask``).
        The mask is set for every batch when ``first_frame_conditioning_p > 0`` (1 everywhere when none is drawn), so
        the video timestep's shape does not change from batch to batch; a one-frame latent is never pinned (it would
        leave nothing to learn: ltx-trainer's ``first_frame_end_idx < sequence_length``)."""
        pinned = condition.get("first_frame_pinned")
        if pinned is None or video.shape[2] < 2:
            return LatentState({"video": video, "audio": audio})
        mask = torch.ones(video.shape[0], 1, video.shape[2], 1, 1, device=video.device, dtype=video.dtype)
        mask[:, 0, 0] = (~pinned.to(video.device, torch.bool)).to(video.dtype)[:, None, None]
        return LatentState({"video": video, "audio": audio}, {"video": mask})

    def _latents(self, posterior: Any, generator: torch.Generator | None) -> Tensor:
        """``posterior.mode()``, or a sample from ``generator`` (``target_posterior="sample"``)."""
        return posterior.sample(generator=generator) if self.target_posterior == "sample" else posterior.mode()

    # -- the denoiser ----------------------------------------------------------------------------
    def _timesteps(self, t: Tensor, state: LatentState) -> tuple[Tensor, Tensor]:
        """(video, audio) timesteps: (B,) each; with a video mask (a pinned first latent frame: ``ltx2_i2av``'s
        condition, or ``first_frame_conditioning_p``) the video's per token, ``t * mask`` (B, tokens), 0 on the pinned
        tokens (ltx-trainer's ``_create_per_token_timesteps``, the I2V pipeline's ``timestep * (1 -
        conditioning_mask)``); the audio's stays (B,)."""
        mask = state.masks.get("video")
        if mask is None:
            return t, t
        b, _, f, h, w = state.components["video"].shape
        tokens = self.pack_video(mask.to(t.device, torch.float32).expand(b, 1, f, h, w))[..., 0]  # (B, tokens)
        return t[:, None] * tokens, t

    def velocity(self, state: LatentState, sigma: Tensor, condition: Condition) -> LatentState:
        video, audio = state.components["video"], state.components["audio"]
        # Timesteps stay fp32: sigma * 1000 in bf16 would round to whole steps.
        t = sigma.to(device=video.device, dtype=torch.float32) * self.scheduler.config.num_train_timesteps
        video_t, audio_t = self._timesteps(t, state)
        dtype = self.transformer.dtype
        p, pt = self.transformer.config.patch_size, self.transformer.config.patch_size_t
        mask = condition["prompt_attention_mask"]
        v_video, v_audio = self.transformer(
            hidden_states=self.pack_video(video).to(dtype), audio_hidden_states=self.pack_audio(audio).to(dtype),
            encoder_hidden_states=condition["video_prompt_embeds"],
            audio_encoder_hidden_states=condition["audio_prompt_embeds"], timestep=video_t, audio_timestep=audio_t,
            sigma=t, encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
            num_frames=video.shape[2] // pt, height=video.shape[3] // p, width=video.shape[4] // p,
            fps=self.frame_rate, audio_num_frames=audio.shape[2], use_cross_timestep=self.use_cross_timestep,
            return_dict=False,
        )  # fmt: skip
        return LatentState({"video": self.unpack_video(v_video, video), "audio": self.unpack_audio(v_audio, audio)},
                           dict(state.masks))  # fmt: skip

    # -- decoding --------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, state: LatentState) -> list[list[Tensor]]:
        """Per sample ``[video uint8 (F, 3, H, W), audio float32 (channels, samples) at the vocoder's rate]``
        (``VideoProcessor.postprocess_video``: [-1, 1] -> [0, 1] -> ``round(x * 255)``).

        The audio lasts exactly the clip's clock, ``round(frames / frame_rate * rate)`` samples (``frames``: the decoded
        clip's, the adapter's ``num_frames`` for sampled states, a bucket's for its latents): the pipeline's
        waveform (the causal audio decoder gives ``4 L - 3`` mel hops for ``L`` latent frames, 30 ms short of the
        clock at LTX-2's 16 kHz / hop 160) right-padded with silence, or trimmed, so that audio and video end together
        when muxed and logged."""
        z = self.denormalize_video(state.components["video"].to(self.vae.device, torch.float32)).to(self.vae.dtype)
        timestep = None
        if self.vae.config.timestep_conditioning:  # the pipeline's decode_timestep 0, decode_noise_scale 0
            timestep = torch.zeros(z.shape[0], device=z.device, dtype=z.dtype)
        video = self.vae.decode(z, timestep, return_dict=False)[0]  # (B, 3, F, H, W)
        video = signed_to_uint8(video)
        a = self.denormalize_audio(state.components["audio"].to(self.audio_vae.device, torch.float32))
        mel = self.audio_vae.decode(a.to(self.audio_vae.dtype), return_dict=False)[0]
        waveform = self.vocoder(mel.to(self.vocoder.dtype)).float().cpu()  # (B, channels, samples)
        samples = round(video.shape[2] / self.frame_rate * float(self.vocoder.config.output_sampling_rate))
        waveform = nn.functional.pad(waveform[..., :samples], (0, max(samples - waveform.shape[-1], 0)))
        return [[v.permute(1, 0, 2, 3).contiguous(), w] for v, w in zip(video, waveform)]

    # -- generation ------------------------------------------------------------------------------
    def initial_noise(self, condition: Condition, generator: torch.Generator | None = None) -> LatentState:
        from diffusers.utils.torch_utils import randn_tensor

        embeds = condition["video_prompt_embeds"]
        video_shape, audio_shape = self.latent_shapes(embeds.shape[0])
        # fp32 noise, video then audio, as LTX2Pipeline.prepare_latents / prepare_audio_latents draw it.
        video = randn_tensor(video_shape, generator=generator, device=embeds.device, dtype=torch.float32)
        audio = randn_tensor(audio_shape, generator=generator, device=embeds.device, dtype=torch.float32)
        return self._initial_state(video, audio, condition)

    def _initial_state(self, video: Tensor, audio: Tensor, condition: Condition) -> LatentState:
        return LatentState({"video": video, "audio": audio})

    def _video_tokens(self, state: LatentState | None) -> int:
        p, pt = self.transformer.config.patch_size, self.transformer.config.patch_size_t
        if state is None:
            shape = self.latent_shapes(1)[0]
        else:
            shape = state.components["video"].shape
        return shape[2] // pt * (shape[3] // p) * (shape[4] // p)

    def _mu(self, state: LatentState | None) -> float:
        """``calculate_shift(video tokens, ...)`` with the scheduler config's bounds (the pipeline's defaults)."""
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

        cfg = self.scheduler.config
        return float(calculate_shift(self._video_tokens(state), cfg.get("base_image_seq_len", 1024),
                                     cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.95),
                                     cfg.get("max_shift", 2.05)))  # fmt: skip

    def timestep_shift(self, state: LatentState | None = None) -> float:
        """The shift ``s`` of the schedule for latents shaped like ``state``: with dynamic shifting ``exp(mu)``
        (exponential time shift ``e^mu / (e^mu + 1/sigma - 1)`` is SD3's shift at ``s = e^mu``) or ``mu`` (linear),
        else the scheduler's ``shift``."""
        cfg = self.scheduler.config
        if not cfg.get("use_dynamic_shifting", False):
            return float(cfg.get("shift", 1.0))
        mu = self._mu(state)
        return float(torch.tensor(mu).exp()) if cfg.get("time_shift_type", "exponential") == "exponential" else mu

    def training_sigmas(self, state: LatentState | None = None) -> Tensor:
        """The checkpoint scheduler's own table (:func:`~ff_core.adapter.scheduler_sigma_table`, what diffusers'
        training scripts index; ``timesteps.schedule: adapter``): LTX-2's uses dynamic shifting, so it is the unshifted
        ``i / 1000``, the resolution-dependent shift applying only to sampling. The default continuous schedule draws
        with :meth:`timestep_shift` of the batch's geometry instead."""
        return scheduler_sigma_table(self.scheduler)

    def sampling_sigmas(self, num_steps: int, shift: float | None = None, state: LatentState | None = None) -> Tensor:
        """``LTX2Pipeline``'s sigmas: ``linspace(1, 1/N, N)`` through the scheduler's shift for ``state``'s video
        tokens, then 0; with ``shift``, that fixed shift instead (dynamic shifting off)."""
        import copy

        import numpy as np
        from diffusers import FlowMatchEulerDiscreteScheduler

        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if shift is not None:
            scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=self.scheduler.config.num_train_timesteps,
                                                        shift=shift)  # fmt: skip
            scheduler.set_timesteps(sigmas=sigmas, device="cpu")
        else:
            scheduler = copy.deepcopy(self.scheduler)
            kwargs = {"mu": self._mu(state)} if scheduler.config.get("use_dynamic_shifting", False) else {}
            scheduler.set_timesteps(sigmas=sigmas, device="cpu", **kwargs)
        return scheduler.sigmas.float().clone()

