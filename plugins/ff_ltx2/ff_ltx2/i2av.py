"""LTX-2 image-to-audio+video behind ff's stage methods: ``ltx2_i2av`` (``LTX2ImageToVideoPipeline``).

Everything but the condition image is :class:`~ff_ltx2.adapter.LTX2T2AVAdapter`'s; the image's latent is pinned as the
first latent frame of every video state (pipelines/ltx2/pipeline_ltx2_image2video.py, ``prepare_latents`` and the
denoising loop's ``timestep * (1 - conditioning_mask)``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import torch
from torch import Tensor

from ff_core.adapter import Condition, ConditionInput, LatentState
from ff_core.contracts import MediaGeometry, PipelineIOContract, TensorColumns
from ff_core.data.media.geometry import ConditionResize, fit_condition_image
from ff_core.errors import ConfigError
from ff_ltx2.adapter import I2AV_CONTRACT, KWARGS, T2AV_COLUMNS, LTX2T2AVAdapter


class LTX2I2AVAdapter(LTX2T2AVAdapter):
    """LTX-2 image-to-audio+video (``LTX2ImageToVideoPipeline``): the prompt and the required ``first_frame`` image.

    The image is optionally H.264 re-compressed (the pipeline's ``image_crf``: the compression LTX-2 was trained with),
    put on the canvas as the pipeline puts it (:attr:`condition_resize`: ``video_processor.preprocess(image, height,
    width)``, a BILINEAR stretch, aspect ratio not kept), VAE-encoded with the posterior *mode* and normalised, once,
    in :meth:`preprocess` (``first_frame_latent``, cached with the text). Every video state (training targets, initial
    noise) carries it as its first latent frame with mask 0 there: the pinned tokens are never noised, not in the
    loss, not stepped by the sampler, and the transformer sees them at timestep 0 (per-token video timesteps
    ``t * mask``, the pipeline's ``timestep * (1 - conditioning_mask)``); the audio stream is generated whole.
    """

    per_token_timesteps: ClassVar[bool] = True

    name: ClassVar[str] = "ltx2_i2av"
    io_contract: ClassVar[PipelineIOContract] = I2AV_CONTRACT
    #: ``stretch``: ``LTX2ImageToVideoPipeline``'s ``video_processor.preprocess`` (aspect ratio not kept); ``cover``:
    #: ff's rule before issue 23 (bilinear cover + centre crop). A subclass (``model.adapter: my_pkg.mod:Class``) may
    #: pick ``cover``.
    condition_resize: ClassVar[ConditionResize] = "stretch"
    #: The stretch's filter: the pipeline's ``VideoProcessor(..., resample="bilinear")``
    #: (pipelines/ltx2/pipeline_ltx2_image2video.py).
    condition_resample: ClassVar[str] = "bilinear"
    #: T2AV's columns plus the condition image's latent, (C, 1, h, w) (FastVideo's I2V name, ``first_frame_latent``).
    tensor_columns: ClassVar[TensorColumns] = dataclasses.replace(
        T2AV_COLUMNS, condition={**T2AV_COLUMNS.condition, "first_frame_latent": "first_frame_latent"})

    def __init__(self, *, image_crf: int | None = None, **kwargs: Any) -> None:
        """
        Args:
            image_crf: H.264 CRF the condition image is re-compressed at before encoding (0: not re-compressed);
                ``None``: the pipeline's default for the checkpoint's text encoder
                (``resolve_default_image_crf``: 33 for LTX-2 with Gemma-3).
            **kwargs: :class:`LTX2T2AVAdapter`'s arguments.
        """
        super().__init__(**kwargs)
        from diffusers.pipelines.ltx2.utils import resolve_default_image_crf

        self.image_crf = int(resolve_default_image_crf(self.text_encoder) if image_crf is None else image_crf)
        if self.image_crf < 0:
            raise ValueError(f"model.adapter_kwargs.image_crf must be >= 0, got {image_crf}")

    @classmethod
    def resolve_tensor_shapes(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """T2AV's, and ``first_frame_latent`` (C, 1, h, w): one latent frame of the video latent's channels and
        patch multiples."""
        from ff_core.data.tensor_parquet.checks import StoredShape

        shapes = super().resolve_tensor_shapes(pretrained_model_name_or_path, adapter_kwargs)
        if "vae_latent" in shapes:
            video = shapes["vae_latent"]
            shapes["first_frame_latent"] = StoredShape(4, {**video.sizes, 1: 1}, {2: video.multiples[2],
                                                       3: video.multiples[3]}, "(C, 1, h, w): the first latent frame")
        return shapes

    @classmethod
    def _check_values(cls, **values: Any) -> None:
        """T2AV's checks; ``first_frame_conditioning_p`` refused: every sample's first latent frame is the condition
        image's already."""
        super()._check_values(**values)
        if values.get("first_frame_conditioning_p"):
            raise ConfigError(f"{KWARGS}.first_frame_conditioning_p", f"{cls.name} pins its condition image's latent "
                              "as every sample's first latent frame; the option is ltx2_t2av's (leave it 0)")

    @classmethod
    def check_bucket(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any] | None,
        geometry: MediaGeometry,
    ) -> None:  # fmt: skip
        """T2AV's rules, and the adapter's canvas: :meth:`preprocess` encodes each condition image once, at
        ``adapter_kwargs``' height and width, and that latent is every clip's first latent frame, so only the frame
        count (and ``start``) may differ (as Wan2.2 TI2V's ``check_bucket``)."""
        video, _ = cls.resolve_output_geometry(pretrained_model_name_or_path, adapter_kwargs)
        if (geometry.height, geometry.width) != (video.height, video.width):
            raise ValueError(f"{cls.name} encodes its condition image once, at model.adapter_kwargs' "
                             f"{video.height}x{video.width}, so it trains on that canvas only, got "
                             f"{geometry.height}x{geometry.width}; give buckets of that canvas (any frame count)")
        super().check_bucket(pretrained_model_name_or_path, adapter_kwargs, geometry)

    @classmethod
    def _extra_kwargs(cls, image_crf: int | None) -> dict[str, Any]:
        if image_crf is not None and (isinstance(image_crf, bool) or not isinstance(image_crf, int) or image_crf < 0):
            raise ValueError(f"model.adapter_kwargs.image_crf: must be an integer >= 0 (0: no re-compression) or "
                             f"null (the pipeline's default), got {image_crf!r}")  # fmt: skip
        return {"image_crf": image_crf}

    def preprocess_identity(self) -> dict[str, Any]:
        """Besides the text settings, the canvas, the re-compression and how the image reaches the canvas: the
        condition latent is encoded at them (a change of rule never reuses cached conditions)."""
        return {**super().preprocess_identity(), "height": self.height, "width": self.width,
                "image_crf": self.image_crf,
                "condition_images": f"{self.condition_resize}:{self.condition_resample}"}  # fmt: skip

    def _first_frame(self, item: ConditionInput, index: int) -> Tensor:
        """The ``first_frame`` image (uint8 (3, H, W) at the file's size), checked against the contract."""
        bound = None
        for k, media in enumerate(item.media):
            where = f"inputs[{index}].media[{k}]"
            if media.get("type") != "image":
                raise ValueError(f"{where}: {self.name} takes one image, got {media.get('type')!r}")
            if media.get("slot", "first_frame") != "first_frame":
                raise ValueError(f"{where}: slot {media.get('slot')!r} is not accepted (slots: ['first_frame'])")
            if bound is not None:
                raise ValueError(f"{where}: slot 'first_frame' bound twice")
            bound = media["data"]
        if bound is None:
            raise ValueError(f"inputs[{index}]: {self.name} requires the 'first_frame' image slot")
        return bound

    @torch.no_grad()
    def condition_latent(self, image: Tensor) -> Tensor:
        """``LTX2ImageToVideoPipeline``'s first-frame latent of one image, (C, 1, h, w): CRF re-compression at the
        file's size, put on the canvas (:attr:`condition_resize`), [-1, 1], VAE posterior mode, normalised."""
        from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf

        if self.image_crf:
            array = apply_image_conditioning_crf(image.permute(1, 2, 0).contiguous().numpy(), self.image_crf)
            image = torch.from_numpy(array).permute(2, 0, 1)
        image = fit_condition_image(image, MediaGeometry(self.height, self.width), self.condition_resize,
                                    self.condition_resample)  # fmt: skip
        x = (image.float() / 127.5 - 1)[None, :, None].to(self.vae.device, self.vae.dtype)  # (1, 3, 1, H, W)
        z = self.vae.encode(x).latent_dist.mode()
        return self.normalize_video(z.float())[0]

    @torch.no_grad()
    def preprocess(self, inputs: list[ConditionInput]) -> list[dict[str, Tensor]]:
        images = [self._first_frame(item, i) for i, item in enumerate(inputs)]
        rows = self._text_rows(inputs)
        for row, image in zip(rows, images):
            row["first_frame_latent"] = self.condition_latent(image).cpu().clone()
        return rows

    def _pinned(self, video: Tensor, condition: Condition) -> tuple[Tensor, Tensor]:
        """``video`` with its first latent frame replaced by the condition's, and the mask (0 there, 1 elsewhere)."""
        cond = condition["first_frame_latent"].to(video.device, video.dtype)
        if cond.shape[0] != video.shape[0] or tuple(cond.shape[1:]) != (video.shape[1], 1, *video.shape[3:]):
            raise ValueError(f"first_frame_latent {tuple(cond.shape)} does not fit video latents "
                             f"{tuple(video.shape)}: {self.name} encodes its condition image at "
                             f"{self.height}x{self.width} (adapter_kwargs); train and sample at it")  # fmt: skip
        mask = torch.ones(1, 1, video.shape[2], 1, 1, device=video.device, dtype=video.dtype)
        mask[:, :, 0] = 0
        return torch.cat([cond, video[:, :, 1:]], dim=2), mask

    def _clean_state(self, video: Tensor, audio: Tensor, condition: Condition) -> LatentState:
        """Encoded or stored target latents with the condition's first latent frame pinned (mask 0 there)."""
        video, mask = self._pinned(video, condition)
        return LatentState({"video": video, "audio": audio}, {"video": mask})

    def _initial_state(self, video: Tensor, audio: Tensor, condition: Condition) -> LatentState:
        video, mask = self._pinned(video, condition)
        return LatentState({"video": video, "audio": audio}, {"video": mask})
