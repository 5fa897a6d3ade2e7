"""Wan2.x behind ff's stage methods: ``wan2_t2v`` (text-to-video) and ``wan2_i2v`` (image-to-video).

The maths follows diffusers' ``WanPipeline`` (pipelines/wan/pipeline_wan.py) and ``WanImageToVideoPipeline``
(pipeline_wan_i2v.py) step for step, without instantiating them:

* text: ``prompt_clean`` (ftfy, html unescape, whitespace), UMT5 with its attention mask, last hidden state trimmed
  to each prompt's tokens and zero-padded to ``max_sequence_length`` (``_get_t5_prompt_embeds``). The negative
  prompt ("" when absent) is encoded the same way, for CFG.
* latents: the VAE posterior normalised per channel, ``(z - latents_mean) * (1 / latents_std)`` with the VAE
  config's lists; decoding inverts it (``latents / (1 / latents_std) + latents_mean``).
* denoiser: ``transformer(x, timestep=sigma * num_train_timesteps, encoder_hidden_states)`` predicts the velocity
  ``eps - x0``. Wan2.2 A14B switches to ``transformer_2`` below ``boundary_ratio * num_train_timesteps``; Wan2.2
  TI2V (``expand_timesteps``) gives every token its own timestep, 0 on the pinned first latent frame.
* image conditions (``wan2_i2v``): Wan2.1 I2V / FLF2V and Wan2.2 A14B concatenate ``[mask (4 ch), condition latents]``
  on channels, the condition latents being the VAE posterior *mode* of ``[first, zeros..., (last)]``; Wan2.1 adds
  the CLIP vision encoder's penultimate hidden states; Wan2.2 TI2V pins the first latent frame to the image's latent.
"""

from __future__ import annotations

import dataclasses
import os
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
)
from ff_core.contracts import (
    VIDEO_OUT,
    ClipDefaults,
    MediaGeometry,
    MediaType,
    PipelineIOContract,
    SlotSpec,
    TensorColumns,
)
from ff_core.data.media.geometry import ConditionResize, fit_condition_image
from ff_core.image_latents import pixels_to_signed, signed_to_uint8

FIRST = SlotSpec("first_frame", MediaType.IMAGE)
LAST = SlotSpec("last_frame", MediaType.IMAGE)
LAST_OPTIONAL = SlotSpec("last_frame", MediaType.IMAGE, required=False)

WAN_CLIP = ClipDefaults(height=480, width=832, num_frames=81, fps=16.0)
"""Wan's default clip (every variant): 81 frames of 480x832 at 16 fps, diffusers' ``WanPipeline`` defaults and
Wan2.1's rate (Wan2.2 generates 121 frames at 24 fps: set them in ``model.adapter_kwargs``)."""

# Spec dataset-guide, "Offline model support": the wan2_i2v contract depends on the checkpoint.
I2V_CONTRACTS: dict[str, PipelineIOContract] = {
    "ti2v": PipelineIOContract(outputs=(VIDEO_OUT,), slots=(FIRST,), max_batch_size=1),
    "i2v": PipelineIOContract(outputs=(VIDEO_OUT,), slots=(FIRST,), max_batch_size=1),
    "flf2v": PipelineIOContract(outputs=(VIDEO_OUT,), slots=(FIRST, LAST), max_batch_size=1),
    "a14b": PipelineIOContract(outputs=(VIDEO_OUT,), slots=(FIRST, LAST_OPTIONAL), max_batch_size=1),
}


def _config(pretrained: str | os.PathLike, filename: str, subfolder: str | None = None) -> dict[str, Any] | None:
    """One JSON config file of a checkpoint (:func:`ff_core.pretrained.read_config`: no weights); ``None`` if absent."""
    from ff_core.pretrained import read_config

    try:
        return read_config(pretrained, filename, subfolder)
    except FileNotFoundError:
        return None
    except OSError as exc:  # huggingface_hub's EntryNotFoundError for a hub file that does not exist
        if type(exc).__name__ in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
            return None
        raise


def wan_variant(pretrained: str | os.PathLike) -> str:
    """Which Wan checkpoint a folder holds, from ``model_index.json`` and ``transformer/config.json`` alone.

    ``ti2v`` (Wan2.2 TI2V: ``expand_timesteps``), ``flf2v`` (Wan2.1 FLF2V: a CLIP ``image_dim`` and
    ``pos_embed_seq_len`` for two images), ``i2v`` (Wan2.1 I2V: ``image_dim``), ``a14b`` (Wan2.2 I2V-A14B: an
    image-to-video pipeline with ``boundary_ratio``), else ``t2v`` (Wan2.1 T2V, Wan2.2 T2V-A14B).
    ``FileNotFoundError`` when ``model_index.json`` is missing.
    """
    index = _config(pretrained, "model_index.json")
    if index is None:
        raise FileNotFoundError(f"{pretrained}: no model_index.json (not a diffusers Wan checkpoint)")
    transformer = _config(pretrained, "config.json", "transformer") or {}
    if index.get("expand_timesteps"):
        return "ti2v"
    if transformer.get("image_dim") is not None:
        return "flf2v" if transformer.get("pos_embed_seq_len") is not None else "i2v"
    if index.get("_class_name") == "WanImageToVideoPipeline":
        return "a14b" if index.get("boundary_ratio") is not None else "i2v"
    return "t2v"


def _to_video(item: Any, index: int) -> Tensor:
    """One decoded target as ``uint8`` (F, 3, H, W): a ``DecodedVideo`` (frames (F, H, W, 3)) or such a tensor."""
    frames = getattr(item, "frames", None)
    if frames is not None:
        return frames.permute(0, 3, 1, 2)
    if isinstance(item, Tensor) and item.ndim == 4 and item.shape[1] == 3:
        return item
    shape = tuple(item.shape) if isinstance(item, Tensor) else type(item).__name__
    raise ValueError(f"media[{index}]: expected one video (DecodedVideo or uint8 (F, 3, H, W) tensor), got {shape}")


class WanT2VAdapter(Adapter):
    """Wan2.1 / Wan2.2 text-to-video (any checkpoint in diffusers' Wan layout; Wan2.2 A14B's two experts included).

    Build it with :meth:`from_pretrained`; the transformer(s) train, everything else is frozen.
    """

    name: ClassVar[str] = "wan2_t2v"
    io_contract: ClassVar[PipelineIOContract] = PipelineIOContract(outputs=(VIDEO_OUT,))
    preprocess_version: ClassVar[str] = "1"
    # diffusers' Wan LoRA training (examples/... and finetrainers): the attention projections of every block.
    default_lora_targets: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out.0")
    lora_prefix: ClassVar[str] = "transformer"
    preprocessing_components: ClassVar[tuple[str, ...]] = ("text_encoder",)
    # The one LatentState component its stages produce (I2V too): per-component config maps are checked before
    # weights load.
    latent_components: ClassVar[tuple[str, ...] | None] = ("latent",)
    # The diffusers pipelines of Wan2.1 / Wan2.2 checkpoints (diffusers/pipelines/__init__.py); others refused unloaded.
    checkpoint_classes: ClassVar[dict[str, tuple[str, ...]]] = {
        "_class_name": ("WanPipeline", "WanImageToVideoPipeline", "WanVideoToVideoPipeline", "WanModularPipeline",
                        "Wan22ModularPipeline", "WanImage2VideoModularPipeline", "Wan22Image2VideoModularPipeline"),
        "transformer": ("WanTransformer3DModel",), "transformer_2": ("WanTransformer3DModel",)}
    # The tensor-parquet card's column names (spec tensor-parquet-dataset-card, Wan): text_embedding, vae_latent.
    tensor_columns: ClassVar[TensorColumns] = TensorColumns(
        condition={"text_embedding": "prompt_embeds", "negative_text_embedding": "negative_prompt_embeds"},
        latents={"vae_latent": "latent"},
        optional=("negative_text_embedding",),
    )
    # The card stores text embeddings with their padding stripped ([L, D]); padded per batch (mask dropped: zero rows
    # are exactly the pipeline's padding), then to max_sequence_length in prepare_condition.
    condition_collation: ClassVar[dict[str, str]] = {"prompt_embeds": "pad", "negative_prompt_embeds": "pad"}
    # The default clip, once: from_pretrained's defaults, check_adapter_kwargs and resolve_output_geometry read it.
    clip_defaults: ClassVar[ClipDefaults] = WAN_CLIP

    def __init__(
        self,
        *,
        transformer: nn.Module,
        vae: nn.Module,
        scheduler: Any,
        text_encoder: nn.Module,
        tokenizer: Any,
        transformer_2: nn.Module | None = None,
        boundary_ratio: float | None = None,
        expand_timesteps: bool = False,
        height: int,
        width: int,
        num_frames: int,
        fps: float,
        max_sequence_length: int = 512,
    ) -> None:
        """
        Args:
            transformer: the ``WanTransformer3DModel`` (the high-noise expert of a two-expert checkpoint).
            vae: the ``AutoencoderKLWan``.
            scheduler: the checkpoint's scheduler (its shift sets the noise schedule).
            text_encoder: the ``UMT5EncoderModel``.
            tokenizer: its tokenizer.
            transformer_2: the low-noise expert (Wan2.2 A14B), or ``None``.
            boundary_ratio: the experts' switch, as a fraction of ``num_train_timesteps`` (model_index.json).
            expand_timesteps: Wan2.2 TI2V's per-token timesteps (model_index.json).
            height: pixel rows of sampled videos and training targets (multiple of VAE stride x patch).
            width: pixel columns, likewise.
            num_frames: frames per video; ``(num_frames - 1) % 4 == 0`` (the VAE's temporal stride).
            fps: the frame rate targets are resampled to and videos are written at (Wan2.1: 16, Wan2.2: 24).
            max_sequence_length: UMT5 tokens per prompt (diffusers' default 512; capped by the tokenizer).
        """
        super().__init__()
        self.transformer, self.transformer_2 = transformer, transformer_2
        self.vae, self.text_encoder, self.tokenizer, self.scheduler = vae, text_encoder, tokenizer, scheduler
        self.boundary_ratio, self.expand_timesteps = boundary_ratio, expand_timesteps
        self.temporal_stride = int(vae.config.scale_factor_temporal)
        self.spatial_stride = int(vae.config.scale_factor_spatial)
        if (num_frames - 1) % self.temporal_stride:
            raise ValueError(f"model.adapter_args.num_frames: (num_frames - 1) must be divisible by "
                             f"{self.temporal_stride} (the Wan VAE's temporal stride), got {num_frames}")  # fmt: skip
        _, p_h, p_w = transformer.config.patch_size
        for key, value, patch in (("height", height, p_h), ("width", width, p_w)):
            if value % (self.spatial_stride * patch):
                raise ValueError(f"model.adapter_args.{key} must be a multiple of {self.spatial_stride * patch} "
                                 f"(VAE stride x patch size), got {value}")  # fmt: skip
        if fps <= 0:
            raise ValueError(f"model.adapter_args.fps must be > 0, got {fps}")
        self.height, self.width, self.num_frames, self.fps = height, width, num_frames, float(fps)
        self.max_sequence_length = min(max_sequence_length, tokenizer.model_max_length)
        for frozen in (vae, text_encoder):
            frozen.requires_grad_(False).eval()

    @property
    def output_rates(self) -> tuple[float]:
        """The frame rate of the generated video (samples are logged and written at it)."""
        return (self.fps,)

    # -- loading ---------------------------------------------------------------------------------
    @classmethod
    def resolve_output_geometry(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any] | None = None
    ) -> None:
        """``None``: Wan's target clips are checked as they are decoded, not from their headers before weights load.
        The base's default would check them against :meth:`resolve_clip` (the ``clip_defaults`` clip), so that ``ff
        data validate --model wan2_*`` without ``adapter_kwargs`` would refuse every clip shorter than 81 frames at 16
        fps; Wan keeps its behaviour (returning ``super().resolve_output_geometry(...)`` would opt in)."""
        return None

    @classmethod
    def resolve_tensor_shapes(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The stored shapes the checkpoint's configs fix (``ff fit`` checks every shard row against them): a
        ``vae_latent`` (C, T, H, W) with C = the VAE's ``z_dim`` (``WanPipeline.prepare_latents``' channels; the I2V
        transformer's ``in_channels`` adds the condition's) and H, W multiples of the transformer's ``patch_size[1:]``
        (what WanTransformer3DModel patchifies), a ``text_embedding`` (L, ``text_dim``). Nothing without a
        checkpoint."""
        from ff_core.data.tensor_parquet.checks import StoredShape

        if pretrained_model_name_or_path is None:
            return {}
        shapes: dict[str, Any] = {}
        vae = _config(pretrained_model_name_or_path, "config.json", "vae") or {}
        transformer = _config(pretrained_model_name_or_path, "config.json", "transformer") or {}
        patch = list(transformer.get("patch_size") or (1, 2, 2))
        sizes = {0: int(vae["z_dim"])} if "z_dim" in vae else {}
        shapes["vae_latent"] = StoredShape(4, sizes, {2: int(patch[1]), 3: int(patch[2])},
                                           "(C, T, H, W): C = the VAE's z_dim, H and W multiples of the transformer's "
                                           "patch size")  # fmt: skip
        if "text_dim" in transformer:
            shapes["text_embedding"] = shapes["negative_text_embedding"] = StoredShape(
                2, {-1: int(transformer["text_dim"])}, meaning="(L, text_dim)")
        return shapes

    @classmethod
    def _components(cls, path: str, dt: torch.dtype, revision: str | None) -> dict[str, Any]:
        from diffusers import AutoencoderKLWan, WanTransformer3DModel
        from diffusers.schedulers import SchedulerMixin
        from transformers import AutoTokenizer, UMT5EncoderModel

        index = _config(path, "model_index.json") or {}
        out: dict[str, Any] = {
            "transformer": WanTransformer3DModel.from_pretrained(path, subfolder="transformer", torch_dtype=dt,
                                                                 revision=revision),
            # The Wan VAE stays fp32 (diffusers' model cards load it with torch_dtype=torch.float32).
            "vae": AutoencoderKLWan.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32,
                                                    revision=revision),
            "text_encoder": UMT5EncoderModel.from_pretrained(path, subfolder="text_encoder", dtype=dt,
                                                             revision=revision),
            "tokenizer": AutoTokenizer.from_pretrained(path, subfolder="tokenizer", revision=revision),
        }  # fmt: skip
        scheduler_cls = index.get("scheduler", [None, "FlowMatchEulerDiscreteScheduler"])[1]
        import diffusers

        scheduler_type = getattr(diffusers, scheduler_cls, None)
        if not (isinstance(scheduler_type, type) and issubclass(scheduler_type, SchedulerMixin)):
            raise ValueError(f"{path}: unknown scheduler class {scheduler_cls!r} in model_index.json")
        out["scheduler"] = scheduler_type.from_pretrained(path, subfolder="scheduler", revision=revision)
        if (index.get("transformer_2") or [None])[0] is not None:
            out["transformer_2"] = WanTransformer3DModel.from_pretrained(path, subfolder="transformer_2",
                                                                         torch_dtype=dt, revision=revision)
        out["boundary_ratio"] = index.get("boundary_ratio")
        out["expand_timesteps"] = bool(index.get("expand_timesteps", False))
        return out

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *,
        height: int = WAN_CLIP.height,
        width: int = WAN_CLIP.width,
        num_frames: int = WAN_CLIP.num_frames,
        fps: float = WAN_CLIP.fps,
        max_sequence_length: int = 512,
        dtype: str | torch.dtype = "float32",
        revision: str | None = None,
    ) -> WanT2VAdapter:
        """Load every component of a diffusers Wan checkpoint (local folder or hub id).

        Args:
            pretrained_model_name_or_path: folder in the diffusers layout (``model_index.json``), or a hub id.
            height: pixel rows of sampled videos and of training targets (resized and centre-cropped to it).
            width: pixel columns, likewise.
            num_frames: frames per video, ``(num_frames - 1) % 4 == 0`` (Wan2.1: 81 at 16 fps, Wan2.2: 121 at 24).
            fps: the frame rate targets are resampled to and generated videos are written at.
            (The defaults of these four are :data:`WAN_CLIP`, :attr:`clip_defaults`.)
            max_sequence_length: UMT5 tokens per prompt (capped by the tokenizer's ``model_max_length``).
            dtype: weights dtype of the transformer(s) and the text encoder (the VAE stays fp32).
            revision: hub revision.
        """
        path, dt = str(pretrained_model_name_or_path), resolve_dtype(dtype)
        adapter = cls._build(path, dt, revision, height=height, width=width, num_frames=num_frames, fps=fps,
                             max_sequence_length=max_sequence_length)  # fmt: skip
        local = Path(path).expanduser()
        adapter.source = {"checkpoint": str(local.resolve()) if local.exists() else path, "revision": revision,
                          "dtype": str(dt).removeprefix("torch.")}  # fmt: skip
        return adapter

    @classmethod
    def _build(cls, path: str, dt: torch.dtype, revision: str | None, **kwargs: Any) -> WanT2VAdapter:
        return cls(**cls._components(path, dt, revision), **kwargs)

    @property
    def denoiser(self) -> nn.Module:
        return self.transformer

    def denoisers(self) -> dict[str, nn.Module]:
        """Every trained network by its diffusers component name (Wan2.2 A14B: both experts)."""
        nets = {"transformer": self.transformer}
        if self.transformer_2 is not None:
            nets["transformer_2"] = self.transformer_2
        return nets

    def sharding_blocks(self) -> dict[str, list[nn.Module]]:
        """Each expert's transformer blocks: FSDP2's units (docs/scaling.md)."""
        return {name: list(network.blocks) for name, network in self.denoisers().items()}

    # -- condition side --------------------------------------------------------------------------
    def preprocess_identity(self) -> dict[str, Any]:
        """Checkpoint, revision, dtype and the token length: the text embeddings depend on nothing else."""
        source = getattr(self, "source", None)
        if source is None:
            raise ValueError(f"{self.name}: built without from_pretrained, so its checkpoint is unknown; set .source")
        return {**source, "max_sequence_length": self.max_sequence_length}

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str]) -> Tensor:
        """``WanPipeline._get_t5_prompt_embeds``: (B, max_sequence_length, D), zero past each prompt's tokens."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        inputs = self.tokenizer([prompt_clean(p) for p in prompts], padding="max_length",
                                max_length=self.max_sequence_length, truncation=True, add_special_tokens=True,
                                return_attention_mask=True, return_tensors="pt")  # fmt: skip
        ids, mask = inputs.input_ids, inputs.attention_mask
        device = self.text_encoder.device
        embeds = self.text_encoder(ids.to(device), mask.to(device)).last_hidden_state
        # Trim to the real tokens and zero the rest: padding positions carry no attention-masked garbage.
        keep = mask.to(device).gt(0).unsqueeze(-1)
        return torch.where(keep, embeds, torch.zeros_like(embeds)).to(self.text_encoder.dtype)

    def _text_rows(self, inputs: list[ConditionInput]) -> list[dict[str, Tensor]]:
        embeds = self.encode_prompt([item.prompt for item in inputs])
        negative = self.encode_prompt([item.negative_prompt or "" for item in inputs])
        return prompt_rows({"prompt_embeds": embeds}, {"prompt_embeds": negative})

    @torch.no_grad()
    def preprocess(self, inputs: list[ConditionInput]) -> list[dict[str, Tensor]]:
        reject_input_media(inputs, self.name)
        return self._text_rows(inputs)

    def prepare_condition(self, batch: dict[str, Tensor]) -> Condition:
        out = move_condition({k: v for k, v in batch.items() if not k.endswith("_embeds_mask")},
                             self.transformer.device, self.transformer.dtype)  # fmt: skip
        for key in ("prompt_embeds", "negative_prompt_embeds"):  # zero padding is the pipeline's: pad or trim to L
            if key in out and out[key].shape[1] != self.max_sequence_length:
                t = out[key][:, : self.max_sequence_length]
                out[key] = nn.functional.pad(t, (0, 0, 0, self.max_sequence_length - t.shape[1]))
        return out

    def unconditional(self, condition: Condition) -> Condition | None:
        if "negative_prompt_embeds" not in condition:
            return None
        return {**{k: v for k, v in condition.items() if "prompt_embeds" not in k},
                "prompt_embeds": condition["negative_prompt_embeds"]}  # fmt: skip

    # -- latent normalisation --------------------------------------------------------------------
    def _latent_stats(self, like: Tensor) -> tuple[Tensor, Tensor]:
        """``(latents_mean, 1 / latents_std)`` shaped (1, z, 1, 1, 1), as the pipelines build them."""
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(like.device, like.dtype)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(like.device, like.dtype)
        return mean, inv_std

    def normalize(self, z: Tensor) -> Tensor:
        mean, inv_std = self._latent_stats(z)
        return (z - mean) * inv_std

    def denormalize(self, latents: Tensor) -> Tensor:
        mean, inv_std = self._latent_stats(latents)
        return latents / inv_std + mean

    # -- target side -----------------------------------------------------------------------------
    def output_geometry(self) -> tuple[MediaGeometry | None, ...]:
        """The decode specification of the target video: ``num_frames`` frames on the ``fps`` grid of the clip's
        clock, each resized and centre-cropped to the canvas (the loader's workers decode only that window and
        reject clips too short for it; ff_core.data.media.geometry)."""
        return (MediaGeometry(self.height, self.width, num_frames=self.num_frames, fps=self.fps),)

    def check_clip(self, frames: int, height: int, width: int, what: str) -> None:
        """Raise a ValueError naming ``what`` unless a clip of this size fits the Wan VAE and patch grid."""
        _, p_h, p_w = self.transformer.config.patch_size
        multiple = (self.spatial_stride * p_h, self.spatial_stride * p_w)
        if (frames - 1) % self.temporal_stride or height % multiple[0] or width % multiple[1]:
            raise ValueError(
                f"{what}: a clip of {frames} frames at {height}x{width}; Wan needs (frames - 1) % "
                f"{self.temporal_stride} == 0 and a size in multiples of {multiple[0]}x{multiple[1]} (the training "
                "loader resamples targets to output_geometry() or their data.buckets geometry; fit others the same way)"
            )

    def denoiser_tokens(self, geometry: MediaGeometry) -> int | None:
        """Transformer tokens of one clip: ``(1 + (F - 1) / 4) * (H / 16) * (W / 16)`` (VAE strides x patch)."""
        _, p_h, p_w = self.transformer.config.patch_size
        frames = self.num_frames if geometry.num_frames is None else geometry.num_frames
        return ((frames - 1) // self.temporal_stride + 1) * (geometry.height // (self.spatial_stride * p_h)) * (
            geometry.width // (self.spatial_stride * p_w))

    def _videos(self, media: list[list[Any]]) -> Tensor:
        videos = []
        for i, outputs in enumerate(media):
            if len(outputs) != 1:
                raise ValueError(f"media[{i}]: expected one video, got {len(outputs)} item(s)")
            video = _to_video(outputs[0], i)
            self.check_clip(video.shape[0], video.shape[2], video.shape[3], f"media[{i}]")
            videos.append(video)
        if len({tuple(v.shape) for v in videos}) > 1:
            raise ValueError(f"videos of one batch must share a shape, got {sorted({tuple(v.shape) for v in videos})} "
                             "(data.buckets batches one geometry at a time)")  # fmt: skip
        x = torch.stack(videos).to(self.vae.device)  # (B, F, 3, H, W)
        x = pixels_to_signed(x)  # uint8 -> [-1, 1], once
        return x.permute(0, 2, 1, 3, 4).contiguous()  # (B, 3, F, H, W)

    @torch.no_grad()
    def encode_output(
        self, media: list[list[Any]], condition: Condition, generator: torch.Generator | None = None
    ) -> LatentState:
        x = self._videos(media)
        # A posterior sample drawn from `generator`, as diffusers' Wan training scripts take (latent_dist.sample()).
        z = self.vae.encode(x.to(self.vae.dtype)).latent_dist.sample(generator=generator)
        return self._clean_state(self.normalize(z.float()).to(self.transformer.dtype), condition)

    def _clean_state(self, latent: Tensor, condition: Condition) -> LatentState:
        return LatentState({"latent": latent})

    def velocity(self, state: LatentState, sigma: Tensor, condition: Condition) -> LatentState:
        x = state.components["latent"]
        # Timesteps stay fp32: sigma * 1000 in bf16 would round to whole steps.
        t = sigma.to(device=x.device, dtype=torch.float32) * self.scheduler.config.num_train_timesteps
        inputs = self._model_input(x, condition).to(self.transformer.dtype)
        timestep = self._timesteps(t, state, inputs)
        kwargs = {"encoder_hidden_states": condition["prompt_embeds"]}
        image = self._image_embeds(condition)
        if image is not None:
            kwargs["encoder_hidden_states_image"] = image
        v = self._forward(inputs, timestep, t, kwargs)
        return LatentState({"latent": v}, dict(state.masks))

    def _model_input(self, x: Tensor, condition: Condition) -> Tensor:
        return x

    def _image_embeds(self, condition: Condition) -> Tensor | None:
        return None

    def _timesteps(self, t: Tensor, state: LatentState, inputs: Tensor) -> Tensor:
        """(B,) timesteps, or with ``expand_timesteps`` (Wan2.2 TI2V) (B, tokens): ``mask * t`` per patch, 0 where
        the state pins a latent (the pipeline's ``first_frame_mask[0][0][:, ::2, ::2] * t``)."""
        if not self.expand_timesteps:
            return t
        _, p_h, p_w = self.transformer.config.patch_size
        b, _, f, h, w = inputs.shape
        mask = state.masks.get("latent")
        mask = torch.ones(b, 1, f, h, w, device=t.device) if mask is None else mask.to(t.device, torch.float32)
        mask = mask.expand(b, 1, f, h, w)[:, 0, :, ::p_h, ::p_w]
        return (mask * t.view(b, 1, 1, 1)).flatten(1)

    def uses_second_expert(self, sigma: float) -> bool | None:
        """Wan2.2 A14B: whether ``transformer_2`` predicts at ``sigma`` (``sigma * num_train_timesteps < boundary_ratio
        * num_train_timesteps``, in fp32 as :meth:`_forward` decides it), the steps ``WanPipeline`` guides with
        ``guidance_scale_2``; ``None`` for a checkpoint with one transformer."""
        if self.transformer_2 is None or self.boundary_ratio is None:
            return None
        n = self.scheduler.config.num_train_timesteps
        t = torch.tensor(float(sigma), dtype=torch.float32) * n
        return not bool(t >= self.boundary_ratio * n)

    def _forward(self, inputs: Tensor, timestep: Tensor, t: Tensor, kwargs: dict[str, Tensor]) -> Tensor:
        """The transformer, or per sample the expert its timestep selects (``t >= boundary``: ``transformer``)."""
        if self.transformer_2 is None or self.boundary_ratio is None:
            return self.transformer(hidden_states=inputs, timestep=timestep, return_dict=False, **kwargs)[0]
        high = t >= self.boundary_ratio * self.scheduler.config.num_train_timesteps
        out = None
        for net, rows in ((self.transformer, high), (self.transformer_2, ~high)):
            if not rows.any():
                continue
            part = net(hidden_states=inputs[rows], timestep=timestep[rows], return_dict=False,
                       **{k: v[rows] for k, v in kwargs.items()})[0]  # fmt: skip
            if out is None:
                out = part.new_zeros((inputs.shape[0], *part.shape[1:]))
            out = out.index_put((rows.nonzero()[:, 0],), part)
        return out

    @torch.no_grad()
    def decode(self, state: LatentState) -> list[list[Tensor]]:
        """Per sample one ``uint8`` (F, 3, H, W) video (``VideoProcessor.postprocess_video``: [-1, 1] -> [0, 1]
        -> ``round(x * 255)``)."""
        z = self.denormalize(state.components["latent"].to(self.vae.device, self.vae.dtype))
        video = self.vae.decode(z, return_dict=False)[0]  # (B, 3, F, H, W)
        video = signed_to_uint8(video)
        return [[v.permute(1, 0, 2, 3).contiguous()] for v in video]

    # -- generation ------------------------------------------------------------------------------
    def latent_shape(self, batch_size: int) -> tuple[int, ...]:
        """``WanPipeline.prepare_latents``: (B, z_dim, (F - 1) // 4 + 1, H // 8, W // 8)."""
        return (batch_size, self.vae.config.z_dim, (self.num_frames - 1) // self.temporal_stride + 1,
                self.height // self.spatial_stride, self.width // self.spatial_stride)  # fmt: skip

    def initial_noise(self, condition: Condition, generator: torch.Generator | None = None) -> LatentState:
        from diffusers.utils.torch_utils import randn_tensor

        embeds = condition["prompt_embeds"]
        # fp32 noise, as the pipelines keep their latents (the transformer input is cast to its dtype).
        noise = randn_tensor(self.latent_shape(embeds.shape[0]), generator=generator, device=embeds.device,
                             dtype=torch.float32)  # fmt: skip
        return self._initial_state(noise, condition)

    def _initial_state(self, noise: Tensor, condition: Condition) -> LatentState:
        return LatentState({"latent": noise})

    def timestep_shift(self, state: LatentState | None = None) -> float:
        """The scheduler's shift: ``shift`` (``FlowMatchEulerDiscreteScheduler``) or ``flow_shift`` (the
        ``UniPCMultistepScheduler`` Wan checkpoints ship)."""
        cfg = self.scheduler.config
        return float(cfg.get("shift", None) or cfg.get("flow_shift", None) or 1.0)

    def sampling_sigmas(self, num_steps: int, shift: float | None = None, state: LatentState | None = None) -> Tensor:
        """The Euler sigmas of ``FlowMatchEulerDiscreteScheduler`` at the checkpoint's shift (``set_timesteps``), or at
        ``shift``: GRPO rollouts' schedule, and evaluation's with ``model.sampling.scheduler: euler`` (evaluation
        otherwise steps with the checkpoint's own scheduler, released checkpoints' ``UniPCMultistepScheduler``, as
        ``WanPipeline``: :meth:`~ff_core.adapter.Adapter.sampling_schedulers`). Of a UniPC scheduler only its
        ``flow_shift`` is taken. Wan's shift does not depend on the clip's size (``state`` is not read)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = self.scheduler
        if shift is not None or not isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
            scheduler = FlowMatchEulerDiscreteScheduler(
                num_train_timesteps=self.scheduler.config.num_train_timesteps,
                shift=self.timestep_shift() if shift is None else shift,
            )
        scheduler.set_timesteps(num_steps, device="cpu")
        return scheduler.sigmas.float().clone()


class WanI2VAdapter(WanT2VAdapter):
    """Wan image-to-video: Wan2.1 I2V and FLF2V (CLIP image features), Wan2.2 TI2V (pinned first frame) and Wan2.2
    I2V-A14B (two experts). The input contract is the checkpoint's (:meth:`resolve_contract`), offline B=1.

    Conditions: the prompt and the condition image(s), put on the canvas and VAE-encoded with the posterior
    *mode* once, in :meth:`preprocess` (deterministic, so cached with the text embeddings): ``first_frame_latent``
    is the pipeline's channel condition ``[mask, latents of first, zeros..., (last)]``, or for TI2V the first frame's
    latent alone; ``clip_feature`` the CLIP vision encoder's penultimate hidden states (Wan2.1 I2V / FLF2V).

    Condition images are prepared as ``WanImageToVideoPipeline`` prepares them (:attr:`condition_resize`): the VAE's
    input is ``video_processor.preprocess(image, height, width)``, a LANCZOS stretch onto the canvas, and CLIP's
    image processor gets the image as it is (its own resize and centre crop), not the canvas image.
    """

    name: ClassVar[str] = "wan2_i2v"
    io_contract: ClassVar[PipelineIOContract] = I2V_CONTRACTS["i2v"]
    #: Every checkpoint variant's contract, read without a checkpoint (ff_core.data.smoke: ``wan-flf2v`` is ``flf2v``).
    io_contract_variants: ClassVar[dict[str, PipelineIOContract]] = I2V_CONTRACTS
    #: ``stretch``: ``WanImageToVideoPipeline``'s ``video_processor.preprocess`` (LANCZOS, aspect not kept) for the
    #: VAE and the raw image for CLIP; ``cover``: ff's rule before issue 23 (bilinear cover + centre crop, the same
    #: canvas image for CLIP). A subclass (``model.adapter: my_pkg.mod:Class``) may pick ``cover``.
    condition_resize: ClassVar[ConditionResize] = "stretch"
    #: The stretch's filter: ``VideoProcessor``'s default ``resample`` (pipelines/wan/pipeline_wan_i2v.py).
    condition_resample: ClassVar[str] = "lanczos"
    preprocessing_components: ClassVar[tuple[str, ...]] = ("text_encoder", "image_encoder")
    tensor_columns: ClassVar[TensorColumns] = TensorColumns(
        condition={"text_embedding": "prompt_embeds", "negative_text_embedding": "negative_prompt_embeds",
                   "first_frame_latent": "first_frame_latent", "clip_feature": "clip_feature"},
        latents={"vae_latent": "latent"},
        optional=("negative_text_embedding",),
    )  # fmt: skip

    def __init__(
        self,
        *,
        image_encoder: nn.Module | None = None,
        image_processor: Any = None,
        variant: str = "i2v",
        **kwargs: Any,
    ) -> None:
        """
        Args:
            image_encoder: Wan2.1's ``CLIPVisionModel`` (``None`` for Wan2.2).
            image_processor: its ``CLIPImageProcessor``.
            variant: ``i2v``, ``flf2v``, ``ti2v`` or ``a14b`` (:func:`wan_variant`); selects the contract.
            **kwargs: :class:`WanT2VAdapter`'s arguments.
        """
        super().__init__(**kwargs)
        if variant not in I2V_CONTRACTS:
            raise ValueError(f"{self.name}: a {variant!r} checkpoint is not an image-to-video Wan "
                             f"(expected one of {sorted(I2V_CONTRACTS)}); use wan2_t2v")  # fmt: skip
        self.variant = variant
        self.io_contract = I2V_CONTRACTS[variant]
        self.image_encoder, self.image_processor = image_encoder, image_processor
        if image_encoder is not None:
            image_encoder.requires_grad_(False).eval()
        else:  # Wan2.2: nothing to release beyond the text encoder (the kit's release check found the None)
            self.preprocessing_components = ("text_encoder",)

    @classmethod
    def _variant(cls, pretrained: str | os.PathLike | None) -> str:
        if pretrained is None:
            return "i2v"  # no checkpoint known: the class default (Wan2.1 I2V)
        variant = wan_variant(pretrained)
        if variant not in I2V_CONTRACTS:
            raise ValueError(f"{pretrained}: a Wan text-to-video checkpoint; wan2_i2v needs an image-to-video one "
                             "(Wan2.1 I2V / FLF2V, Wan2.2 TI2V / I2V-A14B)")  # fmt: skip
        return variant

    @classmethod
    def resolve_contract(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any] | None = None
    ) -> PipelineIOContract:
        """The checkpoint's input contract from its config files alone (no weights): spec dataset-guide,
        "Offline model support", ``wan2_i2v`` (:func:`wan_variant`)."""
        return I2V_CONTRACTS[cls._variant(pretrained_model_name_or_path)]

    @classmethod
    def resolve_tensor_columns(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any] | None = None
    ) -> TensorColumns:
        """Wan2.1 I2V / FLF2V rows need their ``clip_feature``; Wan2.2 checkpoints have no image encoder, so none."""
        if cls._variant(pretrained_model_name_or_path) in ("i2v", "flf2v"):
            return cls.tensor_columns
        condition = {k: v for k, v in cls.tensor_columns.condition.items() if k != "clip_feature"}
        return dataclasses.replace(cls.tensor_columns, condition=condition)

    @classmethod
    def check_bucket(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any] | None,
        geometry: MediaGeometry,
    ) -> None:  # fmt: skip
        """Refuse a ``data.buckets`` geometry whose targets the condition latents cannot fit (config files only, before
        weights load): :meth:`preprocess` encodes each record's condition image(s) once, at ``adapter_kwargs``'
        canvas and frame count (the pipeline's ``prepare_latents``: ``[mask, latents of first, zeros..., (last)]``
        over every latent frame), so a bucket with another canvas, or another frame count, would crash at the first
        forward. Wan2.2 TI2V's condition is the first frame's latent alone: there only the canvas must match.
        A bucket's ``fps`` and ``start`` change nothing the condition holds and pass.

        Args:
            pretrained_model_name_or_path: the checkpoint (its variant, from ``model_index.json``), or ``None``.
            adapter_kwargs: ``model.adapter_kwargs`` (``height``, ``width``, ``num_frames``; else the defaults).
            geometry: the bucket's geometry.
        """
        clip = cls.resolve_clip(adapter_kwargs)  # adapter_kwargs over the declared clip_defaults
        kw = {"height": clip.height, "width": clip.width, "num_frames": clip.num_frames}
        frames_matter = cls._variant(pretrained_model_name_or_path) != "ti2v"
        bucket_frames = geometry.num_frames if geometry.num_frames is not None else kw["num_frames"]
        if (geometry.height, geometry.width) == (kw["height"], kw["width"]) and (
                not frames_matter or bucket_frames == kw["num_frames"]):  # fmt: skip
            return
        ours = f"{kw['height']}x{kw['width']}" + (f", {kw['num_frames']} frames" if frames_matter else "")
        got = f"{geometry.height}x{geometry.width}" + (f", {bucket_frames} frames" if frames_matter else "")
        raise ValueError(f"{cls.name} encodes its condition image(s) once, at model.adapter_kwargs' {ours}, so it "
                         f"trains on that geometry only, got {got}; leave data.buckets unset or give that "
                         "geometry")  # fmt: skip

    @classmethod
    def _build(cls, path: str, dt: torch.dtype, revision: str | None, **kwargs: Any) -> WanI2VAdapter:
        from transformers import AutoImageProcessor, CLIPVisionModel

        variant = wan_variant(path)
        components = cls._components(path, dt, revision)
        if variant in ("i2v", "flf2v"):
            components["image_encoder"] = CLIPVisionModel.from_pretrained(path, subfolder="image_encoder", dtype=dt,
                                                                          revision=revision)  # fmt: skip
            components["image_processor"] = AutoImageProcessor.from_pretrained(path, subfolder="image_processor",
                                                                               revision=revision)  # fmt: skip
        return cls(**components, variant=variant, **kwargs)

    def preprocess_identity(self) -> dict[str, Any]:
        """Besides the text settings, the canvas and frame count (the condition latents are encoded at them) and how
        condition images reach the canvas and CLIP (a change of rule never reuses cached conditions)."""
        return {**super().preprocess_identity(), "height": self.height, "width": self.width,
                "num_frames": self.num_frames,
                "condition_images": f"{self.condition_resize}:{self.condition_resample}"}  # fmt: skip

    # -- condition side --------------------------------------------------------------------------
    def _bind(self, item: ConditionInput, index: int) -> dict[str, Tensor]:
        """The condition images by slot as given (uint8 (3, H, W) at the file's size), checked against the contract."""
        bound: dict[str, Tensor] = {}
        free = [s.name for s in self.io_contract.slots]
        for k, media in enumerate(item.media):
            slot = media.get("slot") or next((s for s in free if s not in bound), None)
            where = f"inputs[{index}].media[{k}]"
            if media.get("type") != "image":
                raise ValueError(f"{where}: {self.name} takes images, got {media.get('type')!r}")
            if slot not in free:
                raise ValueError(f"{where}: slot {slot!r} is not accepted by this {self.variant} checkpoint "
                                 f"(slots: {free})")  # fmt: skip
            if slot in bound:
                raise ValueError(f"{where}: slot {slot!r} bound twice")
            bound[slot] = media["data"]
        missing = [s.name for s in self.io_contract.slots if s.required and s.name not in bound]
        if missing:
            raise ValueError(f"inputs[{index}]: this {self.variant} checkpoint requires {missing}, got {sorted(bound)}")
        return bound

    def canvas_image(self, image: Tensor) -> Tensor:
        """A condition image on the canvas (uint8 (3, height, width)): :attr:`condition_resize` with
        :attr:`condition_resample` (:func:`ff_core.data.media.geometry.fit_condition_image`)."""
        return fit_condition_image(image, MediaGeometry(self.height, self.width), self.condition_resize,
                                   self.condition_resample)  # fmt: skip

    @torch.no_grad()
    def encode_image(self, images: list[Tensor]) -> Tensor:
        """``WanImageToVideoPipeline.encode_image``: CLIP vision penultimate hidden states, (n, tokens, D)."""
        from PIL import Image

        pil = [Image.fromarray(img.permute(1, 2, 0).numpy()) for img in images]
        pixels = self.image_processor(images=pil, return_tensors="pt").to(self.image_encoder.device)
        return self.image_encoder(**pixels, output_hidden_states=True).hidden_states[-2]

    @torch.no_grad()
    def condition_latents(self, first: Tensor, last: Tensor | None) -> Tensor:
        """``WanImageToVideoPipeline.prepare_latents``' condition for one sample, without its batch axis: TI2V
        ``normalize(mode(VAE(first)))`` (z, 1, h, w); else ``[mask (4, T, h, w), normalize(mode(VAE(first, zeros...,
        last)))]`` on channels."""
        image = first.float()[None, :, None] / 127.5 - 1  # (1, 3, 1, H, W)
        if self.expand_timesteps:
            video = image
        else:
            zeros = image.new_zeros(1, 3, self.num_frames - 1 - (last is not None), self.height, self.width)
            parts = [image, zeros] + ([last.float()[None, :, None] / 127.5 - 1] if last is not None else [])
            video = torch.cat(parts, dim=2)
        z = self.vae.encode(video.to(self.vae.device, self.vae.dtype)).latent_dist.mode()
        latent = self.normalize(z.float())
        if self.expand_timesteps:
            return latent[0]
        _, _, t, h, w = latent.shape
        mask = torch.zeros(1, 1, self.num_frames, h, w, device=latent.device)
        mask[:, :, 0] = 1
        if last is not None:
            mask[:, :, -1] = 1
        # The first frame's mask repeated over the VAE's temporal stride, then folded into 4 channels per latent frame.
        mask = torch.cat([mask[:, :, :1].repeat_interleave(self.temporal_stride, dim=2), mask[:, :, 1:]], dim=2)
        mask = mask.view(1, -1, self.temporal_stride, h, w).transpose(1, 2)
        return torch.cat([mask, latent], dim=1)[0]

    @torch.no_grad()
    def preprocess(self, inputs: list[ConditionInput]) -> list[dict[str, Tensor]]:
        bound = [self._bind(item, i) for i, item in enumerate(inputs)]
        rows = self._text_rows(inputs)
        for row, images in zip(rows, bound):
            raw = [images["first_frame"]] + ([images["last_frame"]] if "last_frame" in images else [])
            canvas = [self.canvas_image(image) for image in raw]
            row["first_frame_latent"] = self.condition_latents(canvas[0], canvas[1] if len(canvas) > 1 else None
                                                               ).cpu().clone()  # fmt: skip
            if self.image_encoder is not None:  # the pipeline's encode_image(image): CLIP sizes the raw image itself
                row["clip_feature"] = self.encode_image(raw if self.condition_resize == "stretch" else canvas
                                                        ).cpu().clone()  # fmt: skip
        return rows

    def _image_embeds(self, condition: Condition) -> Tensor | None:
        clip = condition.get("clip_feature")
        # (B, n, tokens, D) -> (B * n, tokens, D): FLF2V's image embedder folds the two images back per sample.
        return None if clip is None else clip.flatten(0, 1)

    def _condition_latent(self, x: Tensor, condition: Condition) -> Tensor:
        """The batch's ``first_frame_latent``, checked against the latents it conditions (it was encoded at the
        adapter's canvas and frame count, so targets must be too: no data.buckets with other geometries)."""
        cond = condition["first_frame_latent"].to(x.device, x.dtype)
        frames = 1 if self.expand_timesteps else x.shape[2]
        if cond.shape[0] != x.shape[0] or tuple(cond.shape[2:]) != (frames, *x.shape[3:]):
            raise ValueError(
                f"first_frame_latent {tuple(cond.shape)} does not fit latents {tuple(x.shape)}: {self.name} "
                f"encodes its condition images at {self.num_frames} frames of {self.height}x{self.width} "
                "(adapter_kwargs); train and sample at that geometry"
            )
        return cond

    def _model_input(self, x: Tensor, condition: Condition) -> Tensor:
        if self.expand_timesteps:  # the first latent frame is pinned in the state itself
            return x
        return torch.cat([x, self._condition_latent(x, condition)], dim=1)

    # -- pinned first frame (Wan2.2 TI2V) --------------------------------------------------------
    def _pinned(self, latent: Tensor, condition: Condition) -> LatentState:
        """The state with its first latent frame replaced by the condition's and masked out (mask 0)."""
        latent = torch.cat([self._condition_latent(latent, condition), latent[:, :, 1:]], dim=2)
        mask = torch.ones(1, 1, latent.shape[2], 1, 1, device=latent.device)
        mask[:, :, 0] = 0
        return LatentState({"latent": latent}, {"latent": mask})

    def _clean_state(self, latent: Tensor, condition: Condition) -> LatentState:
        return self._pinned(latent, condition) if self.expand_timesteps else LatentState({"latent": latent})

    def stored_latents(self, latents: dict[str, Tensor], condition: Condition) -> LatentState:
        state = super().stored_latents(latents, condition)
        return self._clean_state(state.components["latent"], condition)

    def _initial_state(self, noise: Tensor, condition: Condition) -> LatentState:
        return self._pinned(noise, condition) if self.expand_timesteps else LatentState({"latent": noise})
