"""SD3Adapter: Stable Diffusion 3 / 3.5 (MMDiT on rectified flow) behind ff's stage methods.

The maths follows diffusers' ``StableDiffusion3Pipeline`` (pipelines/stable_diffusion_3/
pipeline_stable_diffusion_3.py) step for step, without instantiating the pipeline:

* text: CLIP-L and CLIP-G penultimate hidden states, concatenated on features and zero-padded to the T5 width,
  then concatenated with the T5 states along the sequence; pooled = both CLIP ``text_embeds`` concatenated
  (``encode_prompt``). The negative prompt ("" when absent) is encoded the same way, for CFG.
* latents: ``(z - shift_factor) * scaling_factor`` of the VAE posterior sample; decoding inverts it.
* denoiser: ``transformer(x, timestep=sigma * num_train_timesteps, encoder_hidden_states, pooled_projections)``
  predicts the velocity ``eps - x0``; sampling sigmas come from the checkpoint's scheduler (its shift included).
"""

from __future__ import annotations

import math
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
    scheduler_sigma_table,
)
from ff_core.contracts import IMAGE_OUT, MediaGeometry, PipelineIOContract, TensorColumns
from ff_core.image_latents import decode_images, encode_images, stack_image_targets


class SD3Adapter(Adapter):
    """Stable Diffusion 3.5 text-to-image adapter (any SD3-family checkpoint in the diffusers layout).

    Build it with :meth:`from_pretrained`; only the transformer is trainable.
    """

    name: ClassVar[str] = "sd3-5"
    io_contract: ClassVar[PipelineIOContract] = PipelineIOContract(outputs=(IMAGE_OUT,))
    preprocess_version: ClassVar[str] = "1"
    default_lora_targets: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out.0")
    lora_prefix: ClassVar[str] = "transformer"
    interface_version: ClassVar[str] = "1.1"
    preprocessing_components: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2", "text_encoder_3")
    # The one LatentState component its stages produce: per-component config maps are checked before weights load.
    latent_components: ClassVar[tuple[str, ...] | None] = ("latent",)
    # The diffusers pipelines of SD3 / SD3.5 checkpoints (diffusers/pipelines/__init__.py); others refused unloaded.
    checkpoint_classes: ClassVar[dict[str, tuple[str, ...]]] = {
        "_class_name": ("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline",
                        "StableDiffusion3InpaintPipeline", "StableDiffusion3PAGPipeline",
                        "StableDiffusion3ModularPipeline"),
        "transformer": ("SD3Transformer2DModel",)}
    # Shards hold preprocess's keys under their own names and the scaled VAE latent; the negative prompt's
    # embeddings only serve CFG at sampling time, so shards may leave them out.
    tensor_columns: ClassVar[TensorColumns] = TensorColumns(
        condition=("prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds", "negative_pooled_prompt_embeds"),
        latents=("latent",),
        optional=("negative_prompt_embeds", "negative_pooled_prompt_embeds"),
    )

    def __init__(
        self,
        *,
        transformer: nn.Module,
        vae: nn.Module,
        scheduler: Any,
        text_encoder: nn.Module,
        text_encoder_2: nn.Module,
        text_encoder_3: nn.Module,
        tokenizer: Any,
        tokenizer_2: Any,
        tokenizer_3: Any,
        resolution: int = 1024,
        max_sequence_length: int = 256,
    ) -> None:
        super().__init__()
        self.transformer = transformer
        self.vae = vae
        self.text_encoder = text_encoder
        self.text_encoder_2 = text_encoder_2
        self.text_encoder_3 = text_encoder_3
        self.scheduler = scheduler
        self.tokenizer, self.tokenizer_2, self.tokenizer_3 = tokenizer, tokenizer_2, tokenizer_3
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        multiple = self.vae_scale_factor * transformer.config.patch_size
        if resolution % multiple:
            raise ValueError(f"resolution must be a multiple of {multiple} (vae scale x patch size), got {resolution}")
        self.resolution = resolution
        # diffusers pads T5 to max_sequence_length; a tokenizer trained on shorter text cannot go further.
        self.max_sequence_length = min(max_sequence_length, tokenizer_3.model_max_length)
        for frozen in (vae, text_encoder, text_encoder_2, text_encoder_3):
            frozen.requires_grad_(False).eval()

    @classmethod
    def resolve_tensor_shapes(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The stored shapes the transformer's config fixes (``ff fit`` checks every shard row against them): a
        ``latent`` (C, H, W) with C = ``in_channels`` and H, W multiples of ``patch_size`` (what SD3Transformer2DModel
        patchifies, diffusers transformer_sd3.py), ``pooled_prompt_embeds`` (``pooled_projection_dim``,) and
        ``prompt_embeds`` (L, ``joint_attention_dim``). Nothing without a checkpoint."""
        from ff_core.data.tensor_parquet.checks import StoredShape
        from ff_core.pretrained import read_config

        if pretrained_model_name_or_path is None:
            return {}
        config = read_config(pretrained_model_name_or_path, subfolder="transformer")
        patch = int(config.get("patch_size", 2))
        shapes = {"latent": StoredShape(3, {0: int(config.get("in_channels", 16))}, {1: patch, 2: patch},
                                        "(C, H, W): C = the transformer's in_channels, H and W multiples of its "
                                        "patch_size")}
        if "joint_attention_dim" in config:
            shapes["prompt_embeds"] = shapes["negative_prompt_embeds"] = StoredShape(
                2, {-1: int(config["joint_attention_dim"])}, meaning="(L, joint_attention_dim)")
        if "pooled_projection_dim" in config:
            shapes["pooled_prompt_embeds"] = shapes["negative_pooled_prompt_embeds"] = StoredShape(
                1, {0: int(config["pooled_projection_dim"])}, meaning="(pooled_projection_dim,)")
        return shapes

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *,
        resolution: int = 1024,
        max_sequence_length: int = 256,
        dtype: str | torch.dtype = "float32",
        revision: str | None = None,
    ) -> SD3Adapter:
        """Load every component of a diffusers SD3 checkpoint (local folder or hub id).

        Args:
            pretrained_model_name_or_path: folder with ``model_index.json`` layout, or a hub id.
            resolution: side in pixels of sampled images (``initial_noise``) and of training targets (any image is
                resized, shorter side first, and centre-cropped to it in the loader workers).
            max_sequence_length: T5 tokens per prompt (diffusers' default 256; capped by the tokenizer).
            dtype: weights dtype of every component (``float32``, ``bfloat16``, ``float16``).
            revision: hub revision.
        """
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
        from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

        path, dt = str(pretrained_model_name_or_path), resolve_dtype(dtype)
        # diffusers models take torch_dtype, transformers 5 models take dtype.
        diffusers_models = {"transformer": SD3Transformer2DModel, "vae": AutoencoderKL}
        text_models = {"text_encoder": CLIPTextModelWithProjection, "text_encoder_2": CLIPTextModelWithProjection,
                       "text_encoder_3": T5EncoderModel}  # fmt: skip
        models = {
            **{k: c.from_pretrained(path, subfolder=k, torch_dtype=dt, revision=revision)
               for k, c in diffusers_models.items()},
            **{k: c.from_pretrained(path, subfolder=k, dtype=dt, revision=revision) for k, c in text_models.items()},
        }  # fmt: skip
        tokenizers = {k: AutoTokenizer.from_pretrained(path, subfolder=k, revision=revision)
                      for k in ("tokenizer", "tokenizer_2", "tokenizer_3")}  # fmt: skip
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler", revision=revision)
        adapter = cls(**models, **tokenizers, scheduler=scheduler, resolution=resolution,
                      max_sequence_length=max_sequence_length)  # fmt: skip
        # A local folder is known by its absolute path, a hub checkpoint by its id and revision.
        local = Path(path).expanduser()
        adapter.source = {"checkpoint": str(local.resolve()) if local.exists() else path, "revision": revision,
                          "dtype": str(dt).removeprefix("torch.")}  # fmt: skip
        return adapter

    @property
    def denoiser(self) -> nn.Module:
        return self.transformer

    def sharding_blocks(self) -> dict[str, list[nn.Module]]:
        """The MMDiT's joint transformer blocks: FSDP2's units (docs/scaling.md)."""
        return {"transformer": list(self.transformer.transformer_blocks)}

    # -- condition side --------------------------------------------------------------------------
    def preprocess_identity(self) -> dict[str, Any]:
        """Checkpoint, revision and dtype (``source``, set by :meth:`from_pretrained`) and the token lengths: the
        text embeddings depend on nothing else; ``resolution`` only shapes targets and samples."""
        source = getattr(self, "source", None)
        if source is None:
            raise ValueError(f"{self.name}: built without from_pretrained, so its checkpoint is unknown; set .source")
        return {**source, "max_sequence_length": self.max_sequence_length,
                "clip_max_length": self.tokenizer.model_max_length}  # fmt: skip

    def _clip_embeds(self, prompts: list[str], index: int) -> tuple[Tensor, Tensor]:
        """``_get_clip_prompt_embeds``: penultimate hidden states and projected pooled output."""
        tokenizer = self.tokenizer if index == 0 else self.tokenizer_2
        encoder = self.text_encoder if index == 0 else self.text_encoder_2
        ids = tokenizer(prompts, padding="max_length", max_length=self.tokenizer.model_max_length, truncation=True,
                        return_tensors="pt").input_ids  # fmt: skip
        out = encoder(ids.to(encoder.device), output_hidden_states=True)
        return out.hidden_states[-2].to(self.text_encoder.dtype), out[0]

    def _t5_embeds(self, prompts: list[str]) -> Tensor:
        """``_get_t5_prompt_embeds``: T5 last hidden state, padded to ``max_sequence_length``."""
        ids = self.tokenizer_3(prompts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                               add_special_tokens=True, return_tensors="pt").input_ids  # fmt: skip
        return self.text_encoder_3(ids.to(self.text_encoder_3.device))[0].to(self.text_encoder_3.dtype)

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """``(prompt_embeds (B, 2*L_clip + L_t5, D_t5), pooled_prompt_embeds (B, P_l + P_g))`` as diffusers."""
        clip_l, pooled_l = self._clip_embeds(prompts, 0)
        clip_g, pooled_g = self._clip_embeds(prompts, 1)
        t5 = self._t5_embeds(prompts)
        clip = torch.cat([clip_l, clip_g], dim=-1)
        clip = nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return torch.cat([clip, t5], dim=-2), torch.cat([pooled_l, pooled_g], dim=-1)

    @torch.no_grad()
    def preprocess(self, inputs: list[ConditionInput]) -> list[dict[str, Tensor]]:
        reject_input_media(inputs, self.name)
        embeds, pooled = self.encode_prompt([item.prompt for item in inputs])
        neg_embeds, neg_pooled = self.encode_prompt([item.negative_prompt or "" for item in inputs])
        return prompt_rows({"prompt_embeds": embeds, "pooled_prompt_embeds": pooled},
                           {"prompt_embeds": neg_embeds, "pooled_prompt_embeds": neg_pooled})  # fmt: skip

    def prepare_condition(self, batch: dict[str, Tensor]) -> Condition:
        return move_condition(batch, self.transformer.device, self.transformer.dtype)

    def unconditional(self, condition: Condition) -> Condition | None:
        if "negative_prompt_embeds" not in condition:
            return None
        return {
            "prompt_embeds": condition["negative_prompt_embeds"],
            "pooled_prompt_embeds": condition["negative_pooled_prompt_embeds"],
        }

    # -- target side -----------------------------------------------------------------------------
    def output_geometry(self) -> tuple[MediaGeometry | None, ...]:
        """Targets are square ``resolution`` images, as in diffusers' train_dreambooth_lora_sd3.py."""
        return (MediaGeometry(self.resolution, self.resolution),)

    @torch.no_grad()
    def encode_output(
        self, media: list[list[Tensor]], condition: Condition, generator: torch.Generator | None = None
    ) -> LatentState:
        # A posterior sample, as diffusers' SD3 training scripts take (latent_dist.sample()), drawn from `generator`.
        z = encode_images(self.vae, stack_image_targets(media), generator)
        return LatentState({"latent": z.to(self.transformer.dtype)})

    def velocity(self, state: LatentState, sigma: Tensor, condition: Condition) -> LatentState:
        x = state.components["latent"]
        # Timesteps stay fp32: sigma * 1000 in bf16 would round to whole steps.
        timestep = sigma.to(device=x.device, dtype=torch.float32) * self.scheduler.config.num_train_timesteps
        v = self.transformer(
            hidden_states=x,
            encoder_hidden_states=condition["prompt_embeds"],
            pooled_projections=condition["pooled_prompt_embeds"],
            timestep=timestep,
            return_dict=False,
        )[0]
        return LatentState({"latent": v}, dict(state.masks))

    @torch.no_grad()
    def decode(self, state: LatentState) -> list[list[Tensor]]:
        return decode_images(self.vae, state.components["latent"])  # VaeImageProcessor.postprocess to uint8

    # -- generation ------------------------------------------------------------------------------
    def initial_noise(self, condition: Condition, generator: torch.Generator | None = None) -> LatentState:
        from diffusers.utils.torch_utils import randn_tensor

        embeds = condition["prompt_embeds"]
        side = self.resolution // self.vae_scale_factor
        shape = (embeds.shape[0], self.transformer.config.in_channels, side, side)
        noise = randn_tensor(shape, generator=generator, device=embeds.device, dtype=embeds.dtype)
        return LatentState({"latent": noise})

    def _mu(self, state: LatentState | None) -> float:
        """``calculate_shift`` of diffusers' SD3 pipeline: the dynamic-shifting ``mu`` for this latent size."""
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

        cfg, patch = self.scheduler.config, self.transformer.config.patch_size
        if state is None:
            height = width = self.resolution // self.vae_scale_factor
        else:
            height, width = state.components["latent"].shape[-2:]
        seq_len = (height // patch) * (width // patch)
        return calculate_shift(seq_len, cfg.base_image_seq_len, cfg.max_image_seq_len, cfg.base_shift, cfg.max_shift)

    def training_sigmas(self, state: LatentState | None = None) -> Tensor:
        """The table train_dreambooth_lora_sd3.py indexes: the scheduler's levels as built
        (:func:`~ff_core.adapter.scheduler_sigma_table`): shifted by a static ``shift``, unshifted ``i / 1000``
        with ``use_dynamic_shifting`` (SD3.5 keeps it static), whatever ``state``'s size."""
        return scheduler_sigma_table(self.scheduler)

    def timestep_shift(self, state: LatentState | None = None) -> float:
        """The scheduler's ``shift``; with ``use_dynamic_shifting``, the one its ``time_shift`` applies for this latent
        size: ``exp(mu)`` (exponential) or ``mu`` (linear), since ``e^mu / (e^mu + 1/t - 1)`` is SD3's shift of ``t``
        by ``e^mu`` (diffusers' FlowMatchEulerDiscreteScheduler ``_time_shift_exponential``)."""
        cfg = self.scheduler.config
        if not cfg.get("use_dynamic_shifting", False):
            return float(self.scheduler.shift)
        mu = self._mu(state)
        return math.exp(mu) if cfg.get("time_shift_type", "exponential") == "exponential" else mu

    def sampling_sigmas(self, num_steps: int, shift: float | None = None, state: LatentState | None = None) -> Tensor:
        """The checkpoint scheduler's sigmas (``set_timesteps``, with ``mu`` for ``state``'s latent size when it shifts
        dynamically, as the pipeline); ``shift`` builds a copy of that scheduler with this static shift
        (``from_config``)."""
        scheduler, kwargs = self.scheduler, {}
        if shift is not None:
            scheduler = type(scheduler).from_config(scheduler.config, shift=shift, use_dynamic_shifting=False)
        elif scheduler.config.get("use_dynamic_shifting", False):
            kwargs["mu"] = self._mu(state)
        scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
        return scheduler.sigmas.float().clone()
