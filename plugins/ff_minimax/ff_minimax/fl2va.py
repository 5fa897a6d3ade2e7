"""MiniMax H3 first/last-frame to video + audio behind ff's stage methods: ``minimax-h3-fl2va``.

Everything but the keyframes is :class:`~ff_minimax.adapter.MiniMaxH3Adapter`'s (the ``transformer/`` partition).
The keyframes follow diffusers' modular pipeline (``modular_pipelines/minimax_h3``) step for step:

* ``MiniMaxH3ResizeStep``: keyframes in packed order (first, then last; :func:`ff_minimax.keyframes.keyframes`); the
  first of them is stretched onto the canvas (PIL LANCZOS, what ``VaeImageProcessor.resize`` does), a follower is
  cover-cropped with the released rounding (:func:`fit_keyframes`).
* ``MiniMaxH3FL2VATextEncoderStep`` (:meth:`MiniMaxH3FL2VAAdapter.presentation`): per keyframe a ``"<Picture i>: "``
  label and a vision block (its rows tagged video), then the prompt verbatim; one Qwen3-VL call.
* ``MiniMaxH3KeyframeVaeEncoderStep``: each keyframe's latent (``encode_vae_condition``: ImageNet-normalised pixels,
  the posterior sampled under seed 42, rounded to fp16, normalised), cached as ``keyframe_latents`` (k, C, 1, h, w)
  with ``keyframe_anchors`` (k,) (0 first, 1 last), beside the prompt embeddings.
* ``MiniMaxH3PrepareConditionLatentsStep`` (:func:`ff_minimax.prefix.realise_prefix`): once per batch, in
  :meth:`MiniMaxH3FL2VAAdapter.prepare_condition`, every keyframe latent is noised to ``t = 0.999`` with its own draw
  and packed: ``prefix_video_rows``. Both offline-DPO candidates and the policy and reference forwards read this one
  tensor (spec support table: "Conditioned workflows realize one official prefix per batch").
* ``MiniMaxH3PrepareLayoutStep`` with the anchors: ``[text | keyframe rows | target audio | target video]``; the
  keyframe rows sit at ``max(t, 0.999)``, their predictions are discarded, and they are never part of ff's latent
  state: never noised by the objective, never stepped, never in the loss or a GRPO log-probability.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from ff_core.adapter import Condition, ConditionInput
from ff_core.contracts import MediaGeometry, PipelineIOContract, TensorColumns
from ff_core.data.media.geometry import fit_condition_pil
from ff_minimax.adapter import PIXEL_MEAN, PIXEL_STD, MiniMaxH3Adapter
from ff_minimax.keyframes import FL2VA_CONTRACT, keyframes
from ff_minimax.prefix import ANCHOR_CODES, TEXT_TAG, VIDEO_TAG, realise_prefix
from ff_minimax.shards import h3_columns

#: ``keyframe_encode_seed``: the conditioning posterior is sampled under its own fixed seed (the released recipe).
KEYFRAME_ENCODE_SEED = 42
_ANCHOR_NAMES = {code: name for name, code in ANCHOR_CODES.items()}


def to_pil(image: Tensor) -> Image.Image:
    """A decoded uint8 (3, H, W) image as an RGB PIL image (what the pipeline's keyframe inputs are)."""
    return Image.fromarray(np.ascontiguousarray(image.permute(1, 2, 0).cpu().numpy()), "RGB")


def fit_keyframes(images: list[Image.Image], height: int, width: int) -> list[Image.Image]:
    """Keyframes (in packed order) on the ``height`` x ``width`` canvas as ``MiniMaxH3ResizeStep`` puts them: the first
    stretched (``VaeImageProcessor.resize``: ``resize((width, height), LANCZOS)``, ff_core's
    :func:`~ff_core.data.media.geometry.fit_condition_pil`), a follower scaled to cover the canvas with the released
    rounding (``round``, centred at ``(src - size) // 2``: H3's own arithmetic, not ff_core's cover rule) and cropped;
    an image already at the canvas is kept as it is."""
    out = []
    for index, image in enumerate(images):
        if image.size == (width, height):
            out.append(image)
        elif index == 0:
            out.append(fit_condition_pil(image, MediaGeometry(height, width), "stretch", "lanczos"))
        else:
            scale = max(width / image.size[0], height / image.size[1])
            size = (max(width, round(image.size[0] * scale)), max(height, round(image.size[1] * scale)))
            left, top = max(0, (size[0] - width) // 2), max(0, (size[1] - height) // 2)
            out.append(image.resize(size, Image.Resampling.LANCZOS).crop((left, top, left + width, top + height)))
    return out


class MiniMaxH3FL2VAAdapter(MiniMaxH3Adapter):
    """``minimax-h3-fl2va``: a first-frame keyframe, a last-frame keyframe or both, plus the prompt, to joint video +
    audio (first-only, last-only and first-plus-last records; :mod:`ff_minimax.keyframes`)."""

    name: ClassVar[str] = "minimax-h3-fl2va"
    io_contract: ClassVar[PipelineIOContract] = FL2VA_CONTRACT
    preprocess_version: ClassVar[str] = "1"
    # One or two keyframes per record: a batch of several (GRPO rollouts) pads them, and so prepare_condition pads
    # the realised prefix rows (sample_condition cuts each sample back to its own).
    condition_collation: ClassVar[dict[str, str]] = {**MiniMaxH3Adapter.condition_collation, "keyframe_latents": "pad",
                                                     "keyframe_anchors": "pad", "prefix_video_rows": "pad"}
    # Shard rows carry the cached keyframe latents and anchors; the prefix is realised from them per batch.
    tensor_columns: ClassVar[TensorColumns] = h3_columns("keyframe_latents", "keyframe_anchors")

    # -- condition side --------------------------------------------------------------------------
    def preprocess_identity(self) -> dict[str, Any]:
        """Besides the checkpoint, the canvas: keyframes are fitted to it before they are encoded (and presented)."""
        return {**super().preprocess_identity(), "height": self.height, "width": self.width}

    def check_inputs(self, inputs: list[ConditionInput]) -> None:
        for i, item in enumerate(inputs):
            keyframes(item, i, self.name)

    def fitted_keyframes(self, item: ConditionInput, index: int = 0) -> tuple[list[str], list[Image.Image]]:
        """One sample's anchors and its keyframes on the canvas, in packed order."""
        pairs = keyframes(item, index, self.name)
        return [a for a, _ in pairs], fit_keyframes([to_pil(img) for _, img in pairs], self.height, self.width)

    def presentation(self, item: ConditionInput) -> tuple[list[int], list[int], dict[str, Tensor]]:
        """``MiniMaxH3FL2VATextEncoderStep``: per keyframe ``"<Picture i>: "`` (text) and a vision block of
        ``<|vision_start|> <|image_pad|> x n <|vision_end|>`` (tagged video), then the prompt verbatim; the vision
        tensors of all keyframes from the processor's image processor, batched."""
        _, images = self.fitted_keyframes(item)
        tok, processor = self.tokenizer, self.processor
        vision = processor.image_processor(images=images, return_tensors="pt")
        grid = vision["image_grid_thw"]
        merge = processor.image_processor.merge_size ** 2
        ids: list[int] = []
        tags: list[int] = []
        for k in range(len(images)):
            label = tok(f"<Picture {k + 1}>: ", add_special_tokens=False)["input_ids"]
            block = ([tok.convert_tokens_to_ids("<|vision_start|>")]
                     + [tok.convert_tokens_to_ids("<|image_pad|>")] * (int(grid[k].prod()) // merge)
                     + [tok.convert_tokens_to_ids("<|vision_end|>")])  # fmt: skip
            ids += list(label) + block
            tags += [TEXT_TAG] * len(label) + [VIDEO_TAG] * len(block)
        prompt = tok(item.prompt, add_special_tokens=False)["input_ids"]
        return ids + list(prompt), tags + [TEXT_TAG] * len(prompt), {
            "pixel_values": vision["pixel_values"], "image_grid_thw": grid}

    @torch.no_grad()
    def condition_rows(self, item: ConditionInput) -> dict[str, Tensor]:
        """``keyframe_latents`` (k, C, 1, h, w) float32 (``MiniMaxH3KeyframeVaeEncoderStep``) and
        ``keyframe_anchors`` (k,) int64 (0 first, 1 last)."""
        from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition

        anchors, images = self.fitted_keyframes(item)
        latents = []
        for image in images:
            pixels = torch.from_numpy(np.array(image)).to(self.vae.device).permute(2, 0, 1)[None, :, None]
            latents.append(encode_vae_condition(self.vae, pixels, PIXEL_MEAN, PIXEL_STD, KEYFRAME_ENCODE_SEED)[0])
        return {"keyframe_latents": torch.stack(latents).float(),
                "keyframe_anchors": torch.tensor([ANCHOR_CODES[a] for a in anchors], dtype=torch.int64)}

    def prepare_condition(self, batch: dict[str, Tensor], generator: torch.Generator | None = None) -> Condition:
        """The batch on the transformer's device, plus its realised prefix (:meth:`realise`), drawn once here from
        ``generator`` (the objective's seeded per-micro-batch stream; ``None``: the global generator)."""
        return self.realise(super().prepare_condition(batch), generator=generator, batch=batch)

    def realise(self, condition: Condition, generator: torch.Generator | None = None,
                batch: dict[str, Tensor] | None = None) -> Condition:  # fmt: skip
        """``condition`` with ``prefix_video_rows`` (B, N, C p_t p_h p_w): every sample's keyframe latents noised to
        ``t = 0.999`` (one draw per keyframe, in packed order) and packed (:func:`ff_minimax.prefix.realise_prefix`).

        Args:
            condition: a prepared condition.
            generator: draws the noise (``None``: the global generator, seeded per run by Lightning); a parity check
                passes the pipeline's, before the target noise is drawn from it, as the pipeline orders its draws.
            batch: the collated float32 batch, read instead of ``condition``'s (cast to the transformer's dtype).
        """
        source = batch or condition
        device = condition["prompt_embeds"].device
        rows = []
        for i in range(len(source["keyframe_latents"])):
            latents = self.sample_condition({k: source[k] for k in ("keyframe_latents", "keyframe_latents_mask")
                                             if k in source}, i)["keyframe_latents"]  # fmt: skip
            rows.append(realise_prefix([z[None].to(device, torch.float32) for z in latents], self.patch_size,
                                       self.scheduler, generator))  # fmt: skip
        # Padded when the batch mixes one- and two-keyframe records: its mask rides along for sample_condition.
        n = max(r.shape[0] for r in rows)
        prefix = torch.stack([torch.nn.functional.pad(r, (0, 0, 0, n - r.shape[0])) for r in rows])
        mask = torch.stack([torch.arange(n, device=device) < r.shape[0] for r in rows])
        return {**condition, "prefix_video_rows": prefix, "prefix_video_rows_mask": mask}

    # -- the packed sequence ---------------------------------------------------------------------
    def keyframe_anchors(self, condition: Condition) -> tuple[str, ...]:
        return tuple(_ANCHOR_NAMES[int(a)] for a in condition["keyframe_anchors"])

    def prefix_rows(self, condition: Condition) -> tuple[Tensor | None, Tensor | None]:
        if "prefix_video_rows" not in condition:
            raise ValueError(f"{self.name}: the condition has no realised prefix; build it with prepare_condition")
        return condition["prefix_video_rows"], None


__all__ = ["MiniMaxH3FL2VAAdapter", "fit_keyframes", "to_pil"]
