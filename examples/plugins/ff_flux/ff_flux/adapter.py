"""FluxAdapter: FLUX.1 (dev, schnell and their fine-tunes) behind ff's stage methods.

The maths follows diffusers' ``FluxPipeline`` (pipelines/flux/pipeline_flux.py) step for step, without instantiating
the pipeline:

* text: the CLIP text encoder's pooled output (``_get_clip_prompt_embeds``) and the T5 encoder's last hidden state
  padded to ``max_sequence_length`` (``_get_t5_prompt_embeds``); text position ids are zeros. A negative prompt
  ("" when absent) is encoded the same way, for true CFG (the pipeline's ``true_cfg_scale``; ff's ``guidance_scale``).
* latents: ``(z - shift_factor) * scaling_factor`` of the VAE posterior sample, kept **unpacked** (B, C, h, w) in
  the :class:`~ff_core.adapter.LatentState`; :meth:`FluxAdapter.velocity` packs 2 x 2 patches into tokens
  (``_pack_latents``) with their ``(0, row, col)`` position ids (``_prepare_latent_image_ids``) and unpacks the
  prediction (``_unpack_latents``), so objectives, masks and decoders see image-shaped latents.
* denoiser: ``transformer(tokens, timestep=sigma, guidance=g, ...)``: the transformer scales both by 1000 itself, so
  ``sigma`` goes in as it is (the pipeline passes ``t / 1000``). A guidance-distilled checkpoint (``guidance_embeds``,
  FLUX.1-dev) gets the embedded guidance ``g`` (ff's ``model.sampling.embedded_guidance``, default 3.5 as the
  pipeline's ``guidance_scale``); a guidance-free one (FLUX.1-schnell) none.
* noise schedule: the scheduler shifts dynamically, by ``exp(mu)`` with ``mu`` linear in the image token count
  (``calculate_shift``): sampling sigmas are ``linspace(1, 1 / n, n)`` shifted for the initial noise's token count,
  and training draws its noise levels with the same resolution-dependent shift.
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
from ff_core.errors import ConfigError
from ff_core.image_latents import decode_images, encode_images, stack_image_targets

DEFAULT_EMBEDDED_GUIDANCE = 3.5
"""``FluxPipeline.__call__``'s default ``guidance_scale`` (diffusers' FLUX training scripts' ``--guidance_scale``)."""

class FluxAdapter(Adapter):
    """FLUX.1 text-to-image adapter (any checkpoint in the diffusers ``FluxPipeline`` layout).

    Build it with :meth:`from_pretrained`; only the transformer is trainable.
    """

    name: ClassVar[str] = "flux1"
    interface_version: ClassVar[str] = "1.1"  # embedded guidance, geometry-dependent sampling sigmas
    io_contract: ClassVar[PipelineIOContract] = PipelineIOContract(outputs=(IMAGE_OUT,))
    preprocess_version: ClassVar[str] = "1"
    default_lora_targets: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out.0")
    lora_prefix: ClassVar[str] = "transformer"  # FluxLoraLoaderMixin.transformer_name
    preprocessing_components: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2")
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
        tokenizer: Any,
        tokenizer_2: Any,
        resolution: int = 1024,
        max_sequence_length: int = 512,
        embedded_guidance: float | None = None,
    ) -> None:
        super().__init__()
        self.transformer = transformer
        self.vae = vae
        self.text_encoder = text_encoder
        self.text_encoder_2 = text_encoder_2
        self.scheduler = scheduler
        self.tokenizer, self.tokenizer_2 = tokenizer, tokenizer_2
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        multiple = self.vae_scale_factor * 2  # latents are packed in 2 x 2 patches
        if resolution % multiple:
            raise ValueError(f"model.adapter_kwargs.resolution must be a multiple of {multiple} (vae scale x 2), "
                             f"got {resolution}")  # fmt: skip
        self.resolution = resolution
        # T5 is padded to max_sequence_length; a tokenizer trained on shorter text cannot go further.
        self.max_sequence_length = min(max_sequence_length, tokenizer_2.model_max_length)
        if transformer.config.guidance_embeds:
            default = DEFAULT_EMBEDDED_GUIDANCE if embedded_guidance is None else embedded_guidance
            self.embedded_guidance = float(default)
        elif embedded_guidance is not None:  # a ConfigError: `ff fit` prints it as one line naming the key
            raise ConfigError("model.adapter_kwargs.embedded_guidance", f"{embedded_guidance} is set, but this "
                              "checkpoint's transformer has no guidance embedding (guidance_embeds: false, a "
                              "schnell-like model); leave it unset")  # fmt: skip
        for frozen in (vae, text_encoder, text_encoder_2):
            frozen.requires_grad_(False).eval()

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *,
        resolution: int = 1024,
        max_sequence_length: int = 512,
        embedded_guidance: float | None = None,
        dtype: str | torch.dtype = "float32",
        revision: str | None = None,
    ) -> FluxAdapter:
        """Load every component of a diffusers FLUX.1 checkpoint (local folder or hub id).

        Args:
            pretrained_model_name_or_path: folder with the ``model_index.json`` layout, or a hub id.
            resolution: side in pixels of sampled images and of training targets (resized, shorter side first, and
                centre-cropped to it in the loader workers); a multiple of 16 for the released VAE.
            max_sequence_length: T5 tokens per prompt (the pipeline's default 512; capped by the tokenizer).
            embedded_guidance: the distilled-guidance scale training conditions a guidance-embedded transformer on
                (and sampling, unless ``model.sampling.embedded_guidance`` says otherwise); ``None``: 3.5. An error for
                a checkpoint without a guidance embedding.
            dtype: weights dtype of every component (``float32``, ``bfloat16``, ``float16``).
            revision: hub revision.
        """
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

        path, dt = str(pretrained_model_name_or_path), resolve_dtype(dtype)
        # diffusers models take torch_dtype, transformers 5 models take dtype.
        models = {
            "transformer": FluxTransformer2DModel.from_pretrained(path, subfolder="transformer", torch_dtype=dt,
                                                                  revision=revision),
            "vae": AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=dt, revision=revision),
            "text_encoder": CLIPTextModel.from_pretrained(path, subfolder="text_encoder", dtype=dt, revision=revision),
            "text_encoder_2": T5EncoderModel.from_pretrained(path, subfolder="text_encoder_2", dtype=dt,
                                                             revision=revision),
        }  # fmt: skip
        tokenizers = {k: AutoTokenizer.from_pretrained(path, subfolder=k, revision=revision)
                      for k in ("tokenizer", "tokenizer_2")}  # fmt: skip
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler", revision=revision)
        adapter = cls(**models, **tokenizers, scheduler=scheduler, resolution=resolution,
                      max_sequence_length=max_sequence_length, embedded_guidance=embedded_guidance)  # fmt: skip
        local = Path(path).expanduser()
        adapter.source = {"checkpoint": str(local.resolve()) if local.exists() else path, "revision": revision,
                          "dtype": str(dt).removeprefix("torch.")}  # fmt: skip
        return adapter

    @property
    def denoiser(self) -> nn.Module:
        return self.transformer

    # -- condition side --------------------------------------------------------------------------
    def preprocess_identity(self) -> dict[str, Any]:
        """Checkpoint, revision, dtype and the token lengths: the text embeddings depend on nothing else."""
        source = getattr(self, "source", None)
        if source is None:
            raise ValueError(f"{self.name}: built without from_pretrained, so its checkpoint is unknown; set .source")
        return {**source, "max_sequence_length": self.max_sequence_length,
                "clip_max_length": self.tokenizer.model_max_length}  # fmt: skip

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """``(prompt_embeds (B, L_t5, D_t5), pooled_prompt_embeds (B, D_clip))`` as ``FluxPipeline.encode_prompt``."""
        ids = self.tokenizer(prompts, padding="max_length", max_length=self.tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").input_ids  # fmt: skip
        pooled = self.text_encoder(ids.to(self.text_encoder.device), output_hidden_states=False).pooler_output
        ids_2 = self.tokenizer_2(prompts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                                 return_tensors="pt").input_ids  # fmt: skip
        embeds = self.text_encoder_2(ids_2.to(self.text_encoder_2.device), output_hidden_states=False)[0]
        return embeds.to(self.text_encoder_2.dtype), pooled.to(self.text_encoder.dtype)

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
        """Targets are square ``resolution`` images, as in diffusers' train_dreambooth_lora_flux.py."""
        return (MediaGeometry(self.resolution, self.resolution),)

    @torch.no_grad()
    def encode_output(
        self, media: list[list[Tensor]], condition: Condition, generator: torch.Generator | None = None
    ) -> LatentState:
        # FLUX.1's VAE has both shift_factor and scaling_factor (0.1159, 0.3611)
        z = encode_images(self.vae, stack_image_targets(media), generator)
        return LatentState({"latent": z.to(self.transformer.dtype)})

    # -- the denoiser ----------------------------------------------------------------------------
    def velocity(self, state: LatentState, sigma: Tensor, condition: Condition) -> LatentState:
        from diffusers import FluxPipeline

        x = state.components["latent"]
        b, c, h, w = x.shape
        tokens = FluxPipeline._pack_latents(x, b, c, h, w)
        img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, x.device, x.dtype)
        embeds = condition["prompt_embeds"]
        txt_ids = torch.zeros(embeds.shape[1], 3, device=x.device, dtype=x.dtype)
        guidance = None
        if self.transformer.config.guidance_embeds:
            scale = condition.get("embedded_guidance", self.embedded_guidance)
            guidance = torch.full((b,), float(scale), device=x.device, dtype=torch.float32)
        v = self.transformer(
            hidden_states=tokens,
            timestep=sigma.to(device=x.device, dtype=x.dtype),  # the transformer multiplies by 1000 itself
            guidance=guidance,
            pooled_projections=condition["pooled_prompt_embeds"],
            encoder_hidden_states=embeds,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        v = FluxPipeline._unpack_latents(v, h * self.vae_scale_factor, w * self.vae_scale_factor, self.vae_scale_factor)
        return LatentState({"latent": v}, dict(state.masks))

    @torch.no_grad()
    def decode(self, state: LatentState) -> list[list[Tensor]]:
        return decode_images(self.vae, state.components["latent"])  # VaeImageProcessor.postprocess to uint8

    # -- generation ------------------------------------------------------------------------------
    def initial_noise(self, condition: Condition, generator: torch.Generator | None = None) -> LatentState:
        """The pipeline's ``prepare_latents`` noise, drawn unpacked (B, C, h, w) from ``generator``: the same draw."""
        from diffusers.utils.torch_utils import randn_tensor

        embeds = condition["prompt_embeds"]
        side = 2 * (self.resolution // (self.vae_scale_factor * 2))
        shape = (embeds.shape[0], self.transformer.config.in_channels // 4, side, side)
        return LatentState({"latent": randn_tensor(shape, generator=generator, device=embeds.device,
                                                   dtype=embeds.dtype)})  # fmt: skip

    def _image_tokens(self, state: LatentState | None) -> int:
        """Packed image tokens of latents shaped like ``state`` (``None``: the sampling resolution)."""
        if state is None:
            h = w = 2 * (self.resolution // (self.vae_scale_factor * 2))
        else:
            h, w = state.components["latent"].shape[-2:]
        return (h // 2) * (w // 2)

    def _mu(self, state: LatentState | None) -> float:
        """``calculate_shift`` of ``FluxPipeline`` for this geometry's token count."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        cfg = self.scheduler.config
        return calculate_shift(self._image_tokens(state), cfg.get("base_image_seq_len", 256),
                               cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                               cfg.get("max_shift", 1.15))  # fmt: skip

    def timestep_shift(self, state: LatentState | None = None) -> float:
        """``exp(mu)`` for this latent size when the scheduler shifts dynamically (``_time_shift_exponential``:
        ``e^mu / (e^mu + 1/t - 1)`` is SD3's shift of ``t`` by ``e^mu``; ``mu`` itself for the linear kind), else
        the scheduler's static ``shift``."""
        cfg = self.scheduler.config
        if not cfg.get("use_dynamic_shifting", False):
            return float(cfg.shift)
        mu = self._mu(state)
        return math.exp(mu) if cfg.get("time_shift_type", "exponential") == "exponential" else mu

    def training_sigmas(self, state: LatentState | None = None) -> Tensor:
        """The table train_dreambooth_lora_flux.py indexes: the scheduler's levels as built
        (:func:`~ff_core.adapter.scheduler_sigma_table`): shifted by a static ``shift``, unshifted ``i / 1000``
        with ``use_dynamic_shifting`` (FLUX.1: the resolution-dependent ``mu`` applies only when sampling), whatever
        ``state``'s size."""
        return scheduler_sigma_table(self.scheduler)

    def sampling_sigmas(self, num_steps: int, shift: float | None = None, state: LatentState | None = None) -> Tensor:
        """``FluxPipeline``'s schedule: ``linspace(1, 1 / n, n)`` through the scheduler's ``set_timesteps`` with
        ``mu`` for ``state``'s token count (then a final 0); ``shift`` uses a copy of the scheduler with that static
        shift instead."""
        import numpy as np

        scheduler, kwargs = self.scheduler, {}
        if shift is not None:
            scheduler = type(scheduler).from_config(scheduler.config, shift=shift, use_dynamic_shifting=False)
        elif scheduler.config.get("use_dynamic_shifting", False):
            kwargs["mu"] = self._mu(state)
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        scheduler.set_timesteps(num_steps, device="cpu", sigmas=sigmas, **kwargs)
        return scheduler.sigmas.float().clone()
