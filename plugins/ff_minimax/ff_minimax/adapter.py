"""MiniMax H3 behind ff's stage methods: the shared base :class:`MiniMaxH3Adapter` and ``minimax-h3-t2va``.

The maths follows diffusers' ``MiniMaxH3ModularPipeline`` blocks (modular_pipelines/minimax_h3/) step for step,
without instantiating the pipeline:

* text (:meth:`MiniMaxH3Adapter.preprocess`): the prompt tokenized verbatim (no chat template, no special tokens),
  one Qwen3-VL call, ``hidden_states[50]`` (``get_qwen3vl_prompt_embeds``), plus each text row's modality tag
  (``text_token_tags``: 1 for text; a conditioned workflow's vision-block rows are tagged 0, video). Cached.
* latents: a two-component :class:`~ff_core.adapter.LatentState`, ``video`` (B, C, F', h, w) normalised per channel
  ``(z - latents_mean) / latents_std`` and ``audio`` (B, 2, C_a, L): the two stereo channels the mono audio VAE
  encodes as two batch items, normalised per latent channel likewise. Both unpacked.
* denoiser (:meth:`MiniMaxH3Adapter.component_velocity`): one packed sequence ``[text | condition prefix | target
  audio | target video]`` (the layout blocks' ``build_packed_sequence``: per-row modality tags, an fp64 (t, h, w)
  rotary grid, row indices); the target rows carry ``t = 1 - sigma`` of their own stream (video and audio on their
  own schedules), text rows the video's, condition rows their pinned level (:meth:`condition_timesteps`). The
  transformer predicts a **data-ward** velocity ``v_H3 = x0 - eps`` (``MiniMaxH3Scheduler``: ``x0 = x_t + sigma
  v``); ff's convention is ``v = eps - x0``, so the prediction is negated. Condition-row predictions are discarded.
* schedules: ``MiniMaxH3Scheduler`` with the checkpoint's shifts (video 12, audio 3): ``linspace(1, 0, N + 1)``
  shifted, N evaluations (the pipeline's ``num_inference_steps`` is ``N + 1`` sigma points). Its blend step
  ``x' = r x + (1 - r) x0`` (``r = sigma' / sigma``) is the Euler step ``x + (sigma' - sigma) v`` written otherwise.
* decode: ``latents * std + mean``, the video VAE, then undo the ImageNet pixel normalisation; the audio VAE per
  stereo channel, giving the pipeline's ``L * hop`` samples at the audio VAE's rate.
* targets (:meth:`MiniMaxH3Adapter.encode_output`): the video clip on the 24-fps grid fitted to the canvas (the
  loader, :meth:`output_geometry`), ImageNet-normalised, encoded to its posterior mode (Flow-Factory's
  ``encode_h3_target_video``: "the H3 SFT reference data flow", the mean in fp32; ``target_posterior="sample"``
  draws a posterior sample from the training generator instead); the audio cut from the clip's start, converted to
  stereo at the audio VAE's rate and trimmed or right-padded to exactly ``L * hop`` samples (the aligned latent
  duration, spec "H3 audio"), encoded to its posterior mean (H3's codec always consumes the mean:
  ``AutoencoderKLMiniMaxH3Audio.encode``; Flow-Factory's ``encode_h3_target_audio``).

Extending (FL2VA, Ref2VA): subclass :class:`MiniMaxH3Adapter` and fill the hooks: :meth:`presentation` (the
tokenized prompt with its labels and vision blocks), :meth:`condition_rows` (cached condition tensors of one sample),
:meth:`keyframe_anchors` / :meth:`packed_layout` (the layout of the packed sequence), :meth:`prefix_rows` (the
condition rows in front of the target rows) and :meth:`condition_timesteps`.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ff_core.adapter import Adapter, Condition, ConditionInput, LatentState, reject_input_media, resolve_dtype
from ff_core.audio import audio_on_clock, clip_clock_start, clock_window, to_model_rate
from ff_core.contracts import ClipDefaults, MediaGeometry, PipelineIOContract, TensorColumns
from ff_core.errors import ConfigError
from ff_minimax.prefix import AUDIO_TAG, NOISE_AUG, TEXT_TAG, VIDEO_TAG
from ff_minimax.rules import (
    AV_OUTPUTS,
    FPS,
    FRAME_RULE,
    H3_CONTRACT_LIMITS,
    LATENTS_PER_CHUNK,
    aligned_num_frames,
    check_clip,
)
from ff_minimax.shards import h3_columns, stored_shapes

log = logging.getLogger(__name__)

# How encode_output takes the target video latents from the VAE posterior (adapter_kwargs.target_posterior).
TARGET_POSTERIORS = ("mode", "sample")

T2VA_CONTRACT = PipelineIOContract(outputs=AV_OUTPUTS, **H3_CONTRACT_LIMITS)
"""``minimax-h3-t2va``: prompt only, an exact ordered (video, audio) pair out, B = 1, no CFG."""

# The modular pipeline's model facts (MiniMaxH3ModularPipeline properties): a checkpoint contract, not configuration.
H3_CLIP = ClipDefaults(height=768, width=1344, num_frames=124, fps=FPS, fps_key=None)
"""MiniMax H3's default clip: the released 768 x 1344 (16:9) canvas, 124 frames (the smallest aligned 5 s clip) at the
fixed 24 fps (no rate argument)."""
TEXT_ENCODER_LAYER = 50  # hidden_states[50] of Qwen3-VL conditions the transformer
PIXEL_MEAN, PIXEL_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # the video VAE's (ImageNet) pixel convention
AUDIO_CHANNELS = 2  # stereo, carried as two channel-major blocks of audio rows


def check_target_posterior(value: Any) -> str:
    """``adapter_kwargs.target_posterior`` is one of :data:`TARGET_POSTERIORS`, else a ``ConfigError`` naming it."""
    if value not in TARGET_POSTERIORS:
        raise ConfigError("model.adapter_kwargs.target_posterior",
                          f"must be one of {', '.join(TARGET_POSTERIORS)}, got {value!r}")  # fmt: skip
    return value


def pixel_stats(device: torch.device) -> tuple[Tensor, Tensor]:
    """:data:`PIXEL_MEAN` / :data:`PIXEL_STD` as fp32 (1, 3, 1, 1, 1) tensors: an explicit dtype, since under
    Lightning's bf16-true the default dtype is bf16 and would round them (0.485 -> 0.484375)."""
    def stat(values: tuple[float, ...]) -> Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).view(1, -1, 1, 1, 1)

    return stat(PIXEL_MEAN), stat(PIXEL_STD)


@dataclass
class PackedLayout:
    """The structure of one packed sequence, what the transformer reads by name besides the rows themselves.

    Attributes:
        position_ids: (S, 3) float64 (t, h, w) rotary coordinates of every row.
        token_tags: (S,) modality tag of every row (0 video, 1 text, 2 audio).
        video_indices: positions of the video rows, condition rows first.
        audio_indices: positions of the audio rows, reference rows first.
        text_indices: positions of the text rows.
        condition_video_rows: how many leading video rows are condition rows (never stepped, predictions discarded).
        condition_audio_rows: how many leading audio rows are reference rows.
    """

    position_ids: Tensor
    token_tags: Tensor
    video_indices: Tensor
    audio_indices: Tensor
    text_indices: Tensor
    condition_video_rows: int = 0
    condition_audio_rows: int = 0

    def to(self, device: torch.device) -> PackedLayout:
        return PackedLayout(self.position_ids.to(device), self.token_tags.to(device), self.video_indices.to(device),
                            self.audio_indices.to(device), self.text_indices.to(device), self.condition_video_rows,
                            self.condition_audio_rows)  # fmt: skip


class MiniMaxH3Adapter(Adapter):
    """The shared MiniMax H3 adapter (any checkpoint in ``MiniMaxH3ModularPipeline``'s layout); concrete workflows
    subclass it (:class:`MiniMaxH3T2VAAdapter`). Build it with :meth:`from_pretrained`; the transformer trains,
    everything else is frozen."""

    io_contract: ClassVar[PipelineIOContract] = T2VA_CONTRACT
    preprocess_version: ClassVar[str] = "1"
    # Every attention projection (the block stack's and the text refiner's): H3 has self-attention only.
    default_lora_targets: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out.0")
    lora_prefix: ClassVar[str] = "transformer"
    # FSDP2's param_dtype cast must leave the fp32 timestep and the fp64 rotary grid alone: the transformer embeds
    # both in full precision itself, and bf16 would move rotary time coordinates by up to a unit (H3 has no guidance).
    full_precision_inputs: ClassVar[tuple[str, ...]] = ("timestep", "position_ids")
    transformer_subfolder: ClassVar[str] = "transformer"
    """The checkpoint partition the workflow runs (``transformer`` for T2VA / FL2VA, ``transformer_ref`` for Ref2VA)."""
    preprocessing_components: ClassVar[tuple[str, ...]] = ("text_encoder",)
    # Spec support table / issue: "loss = mean over video + mean over audio", literally m_video + m_audio
    # (ff_core.sampling.component_mean sums w_k m_k, unnormalised). A config's component_weights still wins.
    default_component_weights: ClassVar[dict[str, float] | None] = {"video": 1.0, "audio": 1.0}
    # The LatentState components of every H3 workflow (T2VA, FL2VA, Ref2VA): per-component config maps
    # (guidance, component_weights, frozen_components) are checked before weights load.
    latent_components: ClassVar[tuple[str, ...] | None] = ("video", "audio")
    # The diffusers pipeline of MiniMax H3 checkpoints (modular_pipelines/minimax_h3): refused before weights load.
    checkpoint_classes: ClassVar[dict[str, tuple[str, ...]]] = {
        "_class_name": ("MiniMaxH3ModularPipeline",),
        "transformer": ("MiniMaxH3Transformer3DModel",), "transformer_ref": ("MiniMaxH3Transformer3DModel",)}
    # Prompts differ in token count; a GRPO rollout batch collates several (sample_condition cuts each back). The
    # same rules collate shard rows, so text embeddings are stored unpadded (L, D).
    condition_collation: ClassVar[dict[str, str]] = {"prompt_embeds": "pad", "text_token_tags": "pad"}
    # Tensor-parquet rows (ff_minimax.shards; docs/minimax.md, "Training from shards"): text_embedding and
    # text_token_tags, vae_latent -> video, audio_latent -> audio. encode_output sets no masks, so the default
    # stored_latents (cast to the denoiser's device and dtype) is encode_output's state.
    tensor_columns: ClassVar[TensorColumns] = h3_columns()
    # The default clip, once: from_pretrained's defaults (every workflow's), check_bucket and the checks before weights
    # load (_clip, resolve_output_geometry) read it.
    clip_defaults: ClassVar[ClipDefaults] = H3_CLIP

    def __init__(
        self,
        *,
        transformer: nn.Module,
        vae: nn.Module,
        audio_vae: nn.Module,
        scheduler: Any,
        audio_scheduler: Any,
        text_encoder: nn.Module,
        tokenizer: Any,
        processor: Any,
        height: int,
        width: int,
        num_frames: int,
        target_posterior: str = "mode",
    ) -> None:
        """
        Args:
            transformer: the ``MiniMaxH3Transformer3DModel`` of the workflow's partition.
            vae: the ``AutoencoderKLMiniMaxH3`` (video).
            audio_vae: the ``AutoencoderKLMiniMaxH3Audio`` (mono; stereo as two batch items).
            scheduler: the video ``MiniMaxH3Scheduler`` (shift 12 released).
            audio_scheduler: the audio ``MiniMaxH3Scheduler`` (shift 3 released).
            text_encoder: the Qwen3-VL conditioner (``Qwen3VLForConditionalGeneration``).
            tokenizer: its ``Qwen2TokenizerFast``.
            processor: its ``Qwen3VLProcessor`` (:func:`ff_minimax.text.load_processor`).
            height: pixel rows of the canvas (multiple of the VAE's spatial compression x the patch).
            width: pixel columns, likewise (the released canvas: 768 x 1344, 16:9).
            num_frames: frames per clip at 24 fps, rounded up to ``17 n + 5`` (5-15 s; 124 is the smallest).
            target_posterior: ``"mode"`` (default): the target video latents are the video VAE posterior's mode
                (Flow-Factory's ``encode_h3_target_video``, the released H3 SFT data flow); ``"sample"``: a posterior
                sample drawn from the training generator. The audio always takes its posterior's mean (H3's codec).
        """
        super().__init__()
        self.transformer, self.vae, self.audio_vae = transformer, vae, audio_vae
        self.scheduler, self.audio_scheduler = scheduler, audio_scheduler
        self.text_encoder, self.tokenizer, self.processor = text_encoder, tokenizer, processor
        self.spatial_stride = int(vae.spatial_compression_ratio)
        self.patch_size = tuple(int(p) for p in transformer.config.patch_size)
        aligned = check_clip(num_frames, height, width, self.spatial_stride * self.patch_size[2])
        if aligned != num_frames:  # as the pipeline's layout step does, with a warning
            log.warning("model.adapter_kwargs.num_frames: %d is not of the form 17 n + 5; rounded up to %d",
                        num_frames, aligned)  # fmt: skip
        self.height, self.width, self.num_frames = height, width, aligned
        self.target_posterior = check_target_posterior(target_posterior)
        self.hop_length = int(audio_vae.hop_length)
        self.audio_rate = int(audio_vae.config.sampling_rate)
        for frozen in (vae, audio_vae, text_encoder):
            frozen.requires_grad_(False).eval()

    # -- loading ---------------------------------------------------------------------------------
    @classmethod
    def _components(cls, path: str, dt: torch.dtype, revision: str | None) -> dict[str, Any]:
        from diffusers import (
            AutoencoderKLMiniMaxH3,
            AutoencoderKLMiniMaxH3Audio,
            MiniMaxH3Scheduler,
            MiniMaxH3Transformer3DModel,
        )
        from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

        from ff_minimax.text import load_processor

        kw = {"revision": revision}
        return {
            "transformer": MiniMaxH3Transformer3DModel.from_pretrained(path, subfolder=cls.transformer_subfolder,
                                                                       torch_dtype=dt, **kw),
            # The VAEs stay fp32: decoding and target encoding are not where memory goes.
            "vae": AutoencoderKLMiniMaxH3.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32, **kw),
            "audio_vae": AutoencoderKLMiniMaxH3Audio.from_pretrained(path, subfolder="audio_vae",
                                                                     torch_dtype=torch.float32, **kw),
            "scheduler": MiniMaxH3Scheduler.from_pretrained(path, subfolder="scheduler", **kw),
            "audio_scheduler": MiniMaxH3Scheduler.from_pretrained(path, subfolder="audio_scheduler", **kw),
            "text_encoder": Qwen3VLForConditionalGeneration.from_pretrained(path, subfolder="text_encoder", dtype=dt,
                                                                            **kw),
            "tokenizer": AutoTokenizer.from_pretrained(path, subfolder="tokenizer", **kw),
            "processor": load_processor(path, "processor", revision),
        }  # fmt: skip

    @classmethod
    def check_bucket(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any] | None,
        geometry: MediaGeometry,
    ) -> None:  # fmt: skip
        """Refuse a ``data.buckets`` clip other than ``adapter_kwargs``' canvas and length on H3's 24-fps grid (before
        weights load): a bucket replaces the video's geometry only, while every clip is encoded at the adapter's
        canvas and its audio cut to the adapter's aligned duration. A bucket's ``start`` is honoured (the audio is cut
        from the clip's start on its clock)."""
        kw = dict(zip(("num_frames", "height", "width"), cls._clip(adapter_kwargs)))
        kw["num_frames"] = aligned_num_frames(kw["num_frames"])  # the clip trains at the rounded count (17 n + 5)
        if (geometry.height, geometry.width, geometry.num_frames, geometry.fps) != (
                kw["height"], kw["width"], kw["num_frames"], float(FPS)):  # fmt: skip
            raise ValueError(f"{cls.name} trains on one clip, model.adapter_kwargs' {kw['height']}x{kw['width']}, "
                             f"{kw['num_frames']} frames at {FPS} fps, got {geometry.height}x{geometry.width}, "
                             f"{geometry.num_frames} frames at {geometry.fps} fps; leave data.buckets unset or give "
                             "those")  # fmt: skip

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *,
        height: int = H3_CLIP.height,
        width: int = H3_CLIP.width,
        num_frames: int = H3_CLIP.num_frames,
        target_posterior: str = "mode",
        dtype: str | torch.dtype = "float32",
        revision: str | None = None,
    ) -> MiniMaxH3Adapter:
        """Load every component of a diffusers MiniMax H3 checkpoint (local folder or hub id). The clip is checked
        against the spec's rules (:func:`ff_minimax.rules.check_clip`) before anything loads.

        Args:
            pretrained_model_name_or_path: folder in the modular pipeline's layout, or a hub id.
            height: see :class:`MiniMaxH3Adapter`.
            width: see :class:`MiniMaxH3Adapter`.
            num_frames: see :class:`MiniMaxH3Adapter`.
            target_posterior: see :class:`MiniMaxH3Adapter`.
            dtype: weights dtype of the transformer and the text encoder (the VAEs stay fp32; the transformer keeps
                its own fp32 modules, diffusers' ``_keep_in_fp32_modules``).
            revision: hub revision.
        """
        check_clip(num_frames, height, width)  # before any weight loads; the canvas multiple once the VAE is known
        check_target_posterior(target_posterior)
        path, dt = str(pretrained_model_name_or_path), resolve_dtype(dtype)
        adapter = cls(**cls._components(path, dt, revision), height=height, width=width, num_frames=num_frames,
                      target_posterior=target_posterior)  # fmt: skip
        local = Path(path).expanduser()
        adapter.source = {"checkpoint": str(local.resolve()) if local.exists() else path, "revision": revision,
                          "dtype": str(dt).removeprefix("torch.")}  # fmt: skip
        return adapter

    # -- checks before weights load (interface 1.4) ----------------------------------------------
    @classmethod
    def _clip(cls, adapter_kwargs: dict[str, Any] | None) -> tuple[Any, Any, Any]:
        """``(num_frames, height, width)`` of ``adapter_kwargs``, :attr:`clip_defaults` elsewhere (unchecked:
        :func:`~ff_minimax.rules.check_clip` checks them with H3's rules)."""
        kwargs, clip = adapter_kwargs or {}, cls.clip_defaults
        return tuple(kwargs.get(k, getattr(clip, k)) for k in ("num_frames", "height", "width"))

    @classmethod
    def canvas_multiple(cls, pretrained_model_name_or_path: str | os.PathLike) -> int:
        """What the canvas sides must be multiples of, from config files alone: the video VAE's spatial compression
        (``prod(spatial_downsample_factors)``, ``vae/config.json``) times the transformer's spatial patch
        (``transformer/config.json`` of the workflow's partition), as :meth:`__init__` computes it from the models."""
        from diffusers import AutoencoderKLMiniMaxH3, MiniMaxH3Transformer3DModel

        from ff_core.pretrained import read_config

        def default(model: type, key: str) -> Any:
            return inspect.signature(model.__init__).parameters[key].default

        vae = read_config(pretrained_model_name_or_path, subfolder="vae")
        transformer = read_config(pretrained_model_name_or_path, subfolder=cls.transformer_subfolder)
        factors = vae.get("spatial_downsample_factors", default(AutoencoderKLMiniMaxH3, "spatial_downsample_factors"))
        patch = transformer.get("patch_size", default(MiniMaxH3Transformer3DModel, "patch_size"))
        return math.prod(int(f) for f in factors) * int(patch[2])

    @classmethod
    def resolve_tensor_shapes(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The stored shapes the checkpoint's config files fix for this workflow's columns (both VAEs' latent
        channels, the transformer's patch and text width: :func:`ff_minimax.shards.stored_shapes`), so ``ff fit``
        refuses a shard row of another geometry, naming it, before weights load."""
        return stored_shapes(pretrained_model_name_or_path, cls.transformer_subfolder, cls.tensor_columns)

    @classmethod
    def check_adapter_kwargs(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any]
    ) -> None:
        """Before any weight loads (``ff fit`` set-up, ``ff data validate --model``): ``dtype`` and
        ``target_posterior`` known and the clip
        within the spec's rules (:func:`~ff_minimax.rules.check_clip`: 5-15 s after rounding to ``17 n + 5``); with
        the checkpoint, the canvas against :meth:`canvas_multiple`. Each a ``ConfigError`` naming the key."""
        resolve_dtype(adapter_kwargs.get("dtype", "float32"))
        check_target_posterior(adapter_kwargs.get("target_posterior", "mode"))
        multiple = None if pretrained_model_name_or_path is None else cls.canvas_multiple(pretrained_model_name_or_path)
        check_clip(*cls._clip(adapter_kwargs), multiple)

    @classmethod
    def resolve_output_geometry(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any] | None = None
    ) -> tuple[MediaGeometry, None]:
        """The video clip :meth:`output_geometry` decodes (the aligned ``num_frames`` on the 24-fps grid, fitted to
        the canvas), from ``adapter_kwargs`` alone, so a too-short target video is named from its header before any
        weight loads; the audio has no span: :meth:`target_waveform` right-pads a short soundtrack with silence (spec
        "H3 audio")."""
        aligned = check_clip(*cls._clip(adapter_kwargs))
        clip = cls.resolve_clip(adapter_kwargs)  # adapter_kwargs over clip_defaults, at its fixed 24 fps
        return (dataclasses.replace(clip, num_frames=aligned, frame_rule=FRAME_RULE), None)

    @property
    def denoiser(self) -> nn.Module:
        return self.transformer

    def sharding_blocks(self) -> dict[str, list[nn.Module]]:
        """The block stack and the text refiner's blocks (diffusers' ``_repeated_blocks``): the units FSDP2 shards one
        by one (``_no_split_modules`` also names the output norm, which is no repeated block)."""
        t = self.transformer
        return {self.lora_prefix: [*t.transformer_blocks, *t.token_refiner.refiner_blocks]}

    def component_parameters(self, component: str) -> dict[str, list[str]]:
        """``audio``: the audio stream's own parameters (its input and output projections, ``audio_proj_in`` /
        ``audio_proj_out``); ``video``: every other transformer parameter (the blocks are shared by every row)."""
        if component not in ("video", "audio"):
            raise ValueError(f"{self.name} has the latent components ['video', 'audio'], not {component!r}")
        names = [n for n, _ in self.transformer.named_parameters()]
        return {self.lora_prefix: [n for n in names if n.startswith("audio_") == (component == "audio")]}

    @property
    def output_rates(self) -> tuple[float, float]:
        """The generated video's frame rate (24) and the audio VAE's sample rate (samples are muxed at them)."""
        return (float(FPS), float(self.audio_rate))

    # -- condition side --------------------------------------------------------------------------
    def preprocess_identity(self) -> dict[str, Any]:
        """Checkpoint, revision and dtype: the prompt embeddings depend on nothing else (the canvas and the clip length
        do not change them; a conditioned workflow adds its condition geometry)."""
        source = getattr(self, "source", None)
        if source is None:
            raise ValueError(f"{self.name}: built without from_pretrained, so its checkpoint is unknown; set .source")
        return {**source, "text_encoder_layer": TEXT_ENCODER_LAYER}

    def presentation(self, item: ConditionInput) -> tuple[list[int], list[int], dict[str, Tensor]]:
        """MiniMax H3's presentation of one request: ``(token ids, per-token modality tags, vision inputs)``.

        T2VA (``MiniMaxH3TextEncoderStep``): the prompt verbatim, no chat template and no special tokens, every token
        tagged text. A conditioned workflow prepends a label and a vision block per condition image and passes its
        vision tensors (``pixel_values`` / ``image_grid_thw``)."""
        ids = self.tokenizer(item.prompt, add_special_tokens=False)["input_ids"]
        return list(ids), [TEXT_TAG] * len(ids), {}

    def check_inputs(self, inputs: list[ConditionInput]) -> None:
        """Reject input media this workflow does not take (T2VA: any)."""
        reject_input_media(inputs, self.name)

    def condition_rows(self, item: ConditionInput) -> dict[str, Tensor]:
        """Cached condition tensors of one sample besides its text (condition latents, layout data); T2VA: none."""
        return {}

    @torch.no_grad()
    def encode_prompt(self, item: ConditionInput) -> dict[str, Tensor]:
        """One request's ``prompt_embeds`` (L, D), the conditioner's ``hidden_states[50]``, and its
        ``text_token_tags`` (L,) (``get_qwen3vl_prompt_embeds``)."""
        from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds

        ids, tags, vision = self.presentation(item)
        embeds = get_qwen3vl_prompt_embeds(self.text_encoder, self.processor, ids, vision,
                                           text_encoder_layer=TEXT_ENCODER_LAYER, device=self.text_encoder.device,
                                           dtype=self.text_encoder.dtype)  # fmt: skip
        return {"prompt_embeds": embeds[0], "text_token_tags": torch.tensor(tags, dtype=torch.long)}

    @torch.no_grad()
    def preprocess(self, inputs: list[ConditionInput]) -> list[dict[str, Tensor]]:
        """Per request (H3 packs one request into one sequence, so each is encoded alone) its text and its
        :meth:`condition_rows`, as CPU tensors for the cache. No negative prompt: the checkpoint is guidance-distilled
        (the contract rejects one before this runs)."""
        self.check_inputs(inputs)
        rows = []
        for item in inputs:
            row = {**self.encode_prompt(item), **self.condition_rows(item)}
            rows.append({k: v.detach().cpu().clone() for k, v in row.items()})
        return rows

    def prepare_condition(self, batch: dict[str, Tensor]) -> Condition:
        """The batch on the transformer's device; floating tensors in its dtype, tags and indices as they are."""
        device, dtype = self.transformer.device, self.transformer.dtype
        return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else None) if isinstance(v, Tensor) else v
                for k, v in batch.items()}  # fmt: skip

    # -- geometry --------------------------------------------------------------------------------
    @property
    def num_latent_frames(self) -> int:
        """``5 n + 2`` latent frames of a ``17 n + 5``-frame clip (the pipeline's ``video_latent_num_frames``)."""
        tokens = int(self.vae.tokens_chunk_size)
        return (self.num_frames - LATENTS_PER_CHUNK) // int(self.vae.config.clip_length) * tokens + 2

    @property
    def num_audio_latents(self) -> int:
        """Audio latents per stereo channel covering the clip: ``round(num_frames / 24 * rate / hop)`` (the pipeline's
        ``audio_latent_num_frames``, 40 per second released)."""
        return int(round(self.num_frames / FPS * self.audio_rate / self.hop_length))

    @property
    def audio_samples(self) -> int:
        """The aligned latent duration in samples at the audio VAE's rate: ``num_audio_latents * hop``."""
        return self.num_audio_latents * self.hop_length

    def latent_shapes(self, batch_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The video (B, C, F', H', W') and audio (B, 2, C_a, L) latent shapes of one generated clip."""
        s = self.spatial_stride
        video = (batch_size, int(self.vae.config.latent_channels), self.num_latent_frames, self.height // s,
                 self.width // s)  # fmt: skip
        audio = (batch_size, AUDIO_CHANNELS, int(self.audio_vae.config.latent_channels), self.num_audio_latents)
        return video, audio

    def output_geometry(self) -> tuple[MediaGeometry | None, ...]:
        """The video's decode specification (``num_frames`` on the 24-fps grid, fitted to the canvas); the audio is
        decoded whole and cut to the aligned duration in :meth:`encode_output`."""
        return (MediaGeometry(self.height, self.width, num_frames=self.num_frames, fps=float(FPS),
                              frame_rule=FRAME_RULE), None)  # fmt: skip

    def denoiser_tokens(self, geometry: MediaGeometry) -> int | None:
        """Target rows of one clip: video ``F' h' w' / (p_h p_w)`` plus ``2 L`` audio rows (text rows vary)."""
        _, ph, pw = self.patch_size
        s = self.spatial_stride
        return (self.num_latent_frames * (geometry.height // (s * ph)) * (geometry.width // (s * pw))
                + AUDIO_CHANNELS * self.num_audio_latents)  # fmt: skip

    # -- latent normalisation --------------------------------------------------------------------
    def _video_stats(self, like: Tensor) -> tuple[Tensor, Tensor]:
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean, device=like.device, dtype=torch.float32).view(1, -1, 1, 1, 1)
        std = torch.tensor(cfg.latents_std, device=like.device, dtype=torch.float32).view(1, -1, 1, 1, 1)
        return mean, std

    def _audio_stats(self, like: Tensor) -> tuple[Tensor, Tensor]:
        cfg = self.audio_vae.config
        mean = torch.tensor(cfg.latents_mean, device=like.device, dtype=torch.float32).view(1, 1, -1, 1)
        std = torch.tensor(cfg.latents_std, device=like.device, dtype=torch.float32).view(1, 1, -1, 1)
        return mean, std

    # -- packing (inside the velocity only: the state is unpacked) -------------------------------
    def pack_video(self, x: Tensor) -> Tensor:
        """(C, F, H, W) -> (F/p_t * H/p_h * W/p_w, C p_t p_h p_w) rows, frame-major then row-major
        (``patchify_video_latents``)."""
        pt, ph, pw = self.patch_size
        c, f, h, w = x.shape
        x = x.reshape(c, f // pt, pt, h // ph, ph, w // pw, pw)
        return x.permute(1, 3, 5, 0, 2, 4, 6).reshape(-1, c * pt * ph * pw)

    def unpack_video(self, rows: Tensor, like: Tensor) -> Tensor:
        """Rows back to (C, F, H, W) (``MiniMaxH3AfterDenoiseStep``)."""
        pt, ph, pw = self.patch_size
        c, f, h, w = like.shape
        x = rows.reshape(f // pt, h // ph, w // pw, c, pt, ph, pw)
        return x.permute(3, 0, 4, 1, 5, 2, 6).reshape(c, f, h, w)

    @staticmethod
    def pack_audio(x: Tensor) -> Tensor:
        """(2, C, L) -> (2 L, C) rows, channel-major: every latent of the left channel, then the right's."""
        return x.permute(0, 2, 1).reshape(-1, x.shape[1])

    @staticmethod
    def unpack_audio(rows: Tensor, like: Tensor) -> Tensor:
        return rows.reshape(like.shape[0], like.shape[2], like.shape[1]).permute(0, 2, 1)

    # -- the packed sequence (hooks for conditioned workflows) -----------------------------------
    def keyframe_anchors(self, condition: Condition) -> tuple[str, ...]:
        """Which end of the clip each keyframe condition block is anchored to (``"first"`` / ``"last"``), in packed
        order; T2VA: none."""
        return ()

    def packed_layout(self, condition: Condition, video: Tensor, audio: Tensor) -> PackedLayout:
        """The layout of one sample's packed sequence ``[text | keyframe conditions | target audio | target video]``
        (``MiniMaxH3PrepareLayoutStep.build_packed_sequence``, with :meth:`keyframe_anchors`). Ref2VA overrides it.

        Args:
            condition: one sample's condition (its tensors without the batch axis).
            video: its target video latents (C, F', h, w).
            audio: its target audio latents (2, C_a, L).
        """
        from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

        built = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            condition["text_token_tags"].cpu(), video.shape[1], video.shape[2], video.shape[3], audio.shape[2],
            self.patch_size, AUDIO_CHANNELS, AUDIO_TAG, VIDEO_TAG, self.keyframe_anchors(condition))  # fmt: skip
        return PackedLayout(*built)

    def prefix_rows(self, condition: Condition) -> tuple[Tensor | None, Tensor | None]:
        """One sample's condition rows in front of its target rows: (video rows (N_v, C p_t p_h p_w), audio rows
        (N_a, C_a)), realised once per batch and shared by every forward of it; T2VA: none."""
        return None, None

    def condition_timesteps(self, video_t: float) -> tuple[float, float]:
        """``t`` of the condition rows when the target video is at ``video_t``: a visual anchor at
        ``max(t, 0.999)``, a reference soundtrack clean (``MiniMaxH3SetTimestepsStep``)."""
        return max(video_t, NOISE_AUG), 1.0

    def sample_condition(self, condition: Condition, index: int) -> Condition:
        """Sample ``index`` of a batched condition: its row of every tensor, a ``pad``-collated key
        (:attr:`condition_collation`) cut back to its own length by its ``<key>_mask`` (the masks themselves dropped).
        A GRPO rollout batch holds several prompts (of different token counts, different keyframe counts); each is
        still one packed sequence of its own."""
        padded = {k for k, rule in self.condition_collation.items() if rule == "pad"}
        masks = {f"{k}_mask" for k in padded}
        one = {}
        for key, value in condition.items():
            if key in masks:
                continue
            row = value[index] if isinstance(value, Tensor) else value
            if key in padded and f"{key}_mask" in condition:
                keep = condition[f"{key}_mask"][index].to(torch.bool)
                row = row if bool(keep.all()) else row[keep]  # a view when unpadded: forwards share the tensor
            one[key] = row
        return one

    # -- the denoiser ----------------------------------------------------------------------------
    def velocity(self, state: LatentState, sigma: Tensor, condition: Condition) -> LatentState:
        """Both streams at ``sigma`` (a recipe ``timesteps.shift`` trains both streams at one level)."""
        return self.component_velocity(state, {name: sigma for name in state.components}, condition)

    def component_velocity(self, state: LatentState, sigmas: dict[str, Tensor], condition: Condition) -> LatentState:
        """One transformer forward per sample (H3 packs one request into one sequence, B = 1): video rows at
        ``t = 1 - sigma["video"]``, audio rows at ``1 - sigma["audio"]``; ff's ``eps - x0`` is minus H3's data-ward
        prediction; condition rows' predictions are dropped."""
        video, audio = state.components["video"], state.components["audio"]
        outs_v, outs_a = [], []
        for i in range(video.shape[0]):
            one = self.sample_condition(condition, i)
            v, a = self._forward(one, video[i], audio[i], float(sigmas["video"][i]), float(sigmas["audio"][i]))
            outs_v.append(v)
            outs_a.append(a)
        return LatentState({"video": torch.stack(outs_v), "audio": torch.stack(outs_a)}, dict(state.masks))

    def _forward(self, condition: Condition, video: Tensor, audio: Tensor, sigma_v: float,
                 sigma_a: float) -> tuple[Tensor, Tensor]:  # fmt: skip
        from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

        device = video.device
        layout = self.packed_layout(condition, video, audio)
        t_v, t_a = 1.0 - sigma_v, 1.0 - sigma_a
        cond_v, cond_a = self.condition_timesteps(t_v)
        unique, indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            layout.video_indices, layout.audio_indices, layout.condition_video_rows, layout.condition_audio_rows,
            layout.text_indices.numel(), t_v, t_a, cond_v, cond_a)  # fmt: skip
        layout = layout.to(device)
        video_rows, audio_rows = self.pack_video(video), self.pack_audio(audio)
        prefix_v, prefix_a = self.prefix_rows(condition)
        if prefix_v is not None:
            video_rows = torch.cat([prefix_v.to(video_rows), video_rows])
        if prefix_a is not None:
            audio_rows = torch.cat([prefix_a.to(audio_rows), audio_rows])
        dtype = self.transformer.dtype
        out_v, out_a = self.transformer(
            hidden_states=video_rows[None].to(dtype), audio_hidden_states=audio_rows[None].to(dtype),
            encoder_hidden_states=condition["prompt_embeds"][None], timestep=unique.to(device),
            timestep_indices=indices.to(device), token_tags=layout.token_tags, position_ids=layout.position_ids,
            video_indices=layout.video_indices, audio_indices=layout.audio_indices,
            text_indices=layout.text_indices, return_dict=False,
        )  # fmt: skip
        # Data-ward (x0 - eps) to ff's eps - x0; the condition rows' predictions are discarded.
        v = -out_v[0, layout.condition_video_rows :]
        a = -out_a[0, layout.condition_audio_rows :]
        return self.unpack_video(v, video).to(video.dtype), self.unpack_audio(a, audio).to(audio.dtype)

    # -- schedules -------------------------------------------------------------------------------
    def timestep_shift(self, state: LatentState | None = None) -> float:
        """The video scheduler's shift (12 released): a recipe ``timesteps.shift`` replaces both streams' shifts."""
        return float(self.scheduler.config.shift)

    def timestep_shifts(self, state: LatentState | None = None) -> dict[str, float]:
        """Video on the video scheduler's shift (12), audio on the audio scheduler's (3): training draws one ``u`` per
        sample and noises each stream at its shifted level, the coupled (sigma_video, sigma_audio) that sampling's two
        schedules (:meth:`sampling_schedules`) meet."""
        return {"video": float(self.scheduler.config.shift), "audio": float(self.audio_scheduler.config.shift)}

    def _schedule(self, scheduler: Any, num_steps: int, shift: float | None) -> Tensor:
        from diffusers import MiniMaxH3Scheduler

        fresh = MiniMaxH3Scheduler(shift=float(scheduler.config.shift if shift is None else shift))
        fresh.set_timesteps(num_steps + 1, device="cpu")  # N + 1 sigma points, the terminal 0 included
        sigmas = fresh.sigmas.float().clone()
        if len(sigmas) != num_steps + 1:  # unique_consecutive collapsed a duplicate: not N steps any more
            raise ValueError(f"{self.name}: {num_steps} steps at shift {fresh.shift} give {len(sigmas) - 1} distinct "
                             "noise levels; use fewer steps")  # fmt: skip
        return sigmas

    def sampling_sigmas(self, num_steps: int, shift: float | None = None, state: LatentState | None = None) -> Tensor:
        """The video schedule: ``MiniMaxH3Scheduler`` at ``num_steps + 1`` points (``shift`` overrides its shift)."""
        return self._schedule(self.scheduler, num_steps, shift)

    def sampling_schedules(self, state: LatentState, num_steps: int, shift: float | None = None) -> dict[str, Tensor]:
        """Video on the video scheduler's schedule (``model.sampling.shift`` overrides its shift), audio on the audio
        scheduler's (its own shift, 3 released): the pipeline's two schedules."""
        return {"video": self._schedule(self.scheduler, num_steps, shift),
                "audio": self._schedule(self.audio_scheduler, num_steps, None)}  # fmt: skip

    # -- generation ------------------------------------------------------------------------------
    def initial_noise(self, condition: Condition, generator: torch.Generator | None = None) -> LatentState:
        """Per sample, fp32 video noise (1, C, F', h, w) then audio noise in row layout (2 L, C_a), in that order, as
        ``MiniMaxH3PrepareLatentsStep`` draws them."""
        from diffusers.utils.torch_utils import randn_tensor

        embeds = condition["prompt_embeds"]
        n, device = embeds.shape[0], embeds.device
        (_, c, f, h, w), (_, channels, ca, length) = self.latent_shapes(1)
        videos, audios = [], []
        for _ in range(n):
            videos.append(randn_tensor((1, c, f, h, w), generator=generator, device=device, dtype=torch.float32)[0])
            rows = randn_tensor((channels * length, ca), generator=generator, device=device, dtype=torch.float32)
            audios.append(rows.reshape(channels, length, ca).permute(0, 2, 1))
        return LatentState({"video": torch.stack(videos), "audio": torch.stack(audios)})

    # -- decoding --------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, state: LatentState) -> list[list[Tensor]]:
        """Per sample ``[video uint8 (F, 3, H, W), audio float32 (2, L * hop) at the audio VAE's rate]``
        (``MiniMaxH3VideoDecodeStep`` / ``MiniMaxH3AudioDecodeStep``; ``VideoProcessor.postprocess_video``'s
        ``round(x * 255)``)."""
        out = []
        for video, audio in zip(state.components["video"], state.components["audio"]):
            z = video[None].to(self.vae.device, torch.float32)
            mean, std = self._video_stats(z)
            pixels = self.vae.decode(z * std + mean, return_dict=False)[0].float()
            pmean, pstd = pixel_stats(pixels.device)
            pixels = (pixels * pstd + pmean).clamp(0, 1)
            frames = (pixels[0] * 255).round().to(torch.uint8).permute(1, 0, 2, 3).cpu()
            a = audio[None].to(self.audio_vae.device, torch.float32)
            amean, astd = self._audio_stats(a)
            waveform = self.audio_vae.decode((a * astd + amean)[0], return_dict=False)[0]  # (2, 1, N)
            out.append([frames.contiguous(), waveform[:, 0].float().cpu()])
        return out

    # -- target side -----------------------------------------------------------------------------
    def _video(self, item: Any, index: int) -> tuple[Tensor, float]:
        frames = getattr(item, "frames", None)
        if frames is not None:  # its start on the clip's clock (declared fps), where the audio is cut from
            video, start = frames.permute(0, 3, 1, 2), clip_clock_start(item)
        elif isinstance(item, Tensor) and item.ndim == 4 and item.shape[1] == 3 and item.dtype == torch.uint8:
            video, start = item, 0.0  # uint8 only: encode_output divides by 255 (a float clip in [0, 1] would go dark)
        else:
            shape = (f"{item.dtype} {tuple(item.shape)}" if isinstance(item, Tensor) else type(item).__name__)
            raise ValueError(f"media[{index}][0]: expected a video (DecodedVideo or uint8 (F, 3, H, W)), got {shape}")
        if tuple(video.shape) != (self.num_frames, 3, self.height, self.width):
            raise ValueError(f"media[{index}][0]: a clip of {tuple(video.shape)} (F, 3, H, W); {self.name} trains on "
                             f"{self.num_frames} frames of {self.height}x{self.width} at {FPS} fps (the loader fits "
                             "targets to output_geometry(); fit others the same way)")  # fmt: skip
        return video, start

    def target_waveform(self, audio: Any, start: float, what: str) -> Tensor:
        """One target's audio as the audio VAE's input, float32 (2, L * hop): cut from the video clip's first second
        on its clock, converted to stereo at the audio VAE's rate once, trimmed or right-padded with silence to
        exactly the aligned latent duration (spec "H3 audio"; :mod:`ff_core.audio`).

        Args:
            audio: a ``DecodedAudio`` (its ``clock_rate`` honours the manifest's ``sample_rate``) or a float (C, N)
                tensor already at the audio VAE's rate.
            start: the video clip's first second on the clip's clock (:func:`~ff_core.audio.clip_clock_start`).
            what: names the target in errors.

        One clock for both streams, as ff-ltx2's: ``start`` is official seconds (the video's declared ``fps``), and the
        decoded waveform's own start (file seconds) is put on the audio's clock (its declared ``sample_rate``) by
        :func:`~ff_core.audio.audio_clock_offset`.
        """
        waveform, rate, offset = audio_on_clock(audio, self.audio_rate, what)
        seconds = self.audio_samples / self.audio_rate
        window = clock_window(waveform, rate, start - offset, seconds, tolerance=math.inf, what=what)
        return to_model_rate(window, rate, self.audio_rate, AUDIO_CHANNELS, self.audio_samples)

    @torch.no_grad()
    def encode_output(
        self, media: list[list[Any]], condition: Condition, generator: torch.Generator | None = None
    ) -> LatentState:
        videos, starts = [], []
        for i, outputs in enumerate(media):
            if len(outputs) != 2:
                raise ValueError(f"media[{i}]: {self.name} trains on exact (video, audio) pairs, got "
                                 f"{len(outputs)} item(s)")  # fmt: skip
            video, start = self._video(outputs[0], i)
            videos.append(video)
            starts.append(start)
        x = torch.stack(videos).to(self.vae.device).permute(0, 2, 1, 3, 4).float() / 255.0  # (B, 3, F, H, W)
        pmean, pstd = pixel_stats(x.device)
        posterior = self.vae.encode((x - pmean) / pstd).latent_dist
        # The mode in fp32 (Flow-Factory's encode_h3_target_video), or a sample drawn from `generator`.
        z = (posterior.sample(generator=generator) if self.target_posterior == "sample" else posterior.mode()).float()
        mean, std = self._video_stats(z)
        waves = torch.stack([self.target_waveform(outputs[1], starts[i], f"media[{i}][1]")
                             for i, outputs in enumerate(media)]).to(self.audio_vae.device)  # (B, 2, N)  # fmt: skip
        posterior = self.audio_vae.encode(waves.reshape(-1, 1, waves.shape[-1])).latent_dist
        za = posterior.mode().float()[..., : self.num_audio_latents]
        za = za.reshape(waves.shape[0], AUDIO_CHANNELS, *za.shape[1:])
        amean, astd = self._audio_stats(za)
        dtype = self.transformer.dtype
        return LatentState({"video": ((z - mean) / std).to(dtype), "audio": ((za - amean) / astd).to(dtype)})


class MiniMaxH3T2VAAdapter(MiniMaxH3Adapter):
    """``minimax-h3-t2va``: text to joint video + audio (the ``transformer/`` partition; prompt-only records)."""

    name: ClassVar[str] = "minimax-h3-t2va"
    io_contract: ClassVar[PipelineIOContract] = T2VA_CONTRACT
