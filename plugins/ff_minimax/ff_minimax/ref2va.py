"""MiniMax H3 omni-reference to video + audio behind ff's stage methods: ``minimax-h3-ref2va``.

Spec dataset-guide, "Ref2VA adds an ordered-reference path"::

    references array -> validate and canonicalise as reference_manifest -> decode images / video / audio
      -> transient diffusers reference objects -> Ref2VA setup, text, reference-encoder (and layout) blocks, no-grad
      -> cache prompt embeddings, condition latents, layout geometry and the manifest

:meth:`MiniMaxH3Ref2VAAdapter.preprocess` runs diffusers' own blocks (``MiniMaxH3Ref2VASetupStep``,
``MiniMaxH3Ref2VATextEncoderStep``, ``MiniMaxH3Ref2VAReferenceEncoderStep``) on the adapter's components, one request
at a time, and caches per sample: ``prompt_embeds`` / ``text_token_tags``; the visual reference latents flattened in
packed order (``reference_latents``) with their (C, f, h, w) shapes (``reference_shapes``); the clean soundtrack rows
(``reference_audio``, channel-major, posterior mean: the pipeline never samples a soundtrack) with each one's row count
(``reference_audio_rows``); each reference's type code and whether it carries sound (``reference_kinds``,
``reference_has_audio``: the layout's geometry); and ``reference_manifest`` (:mod:`ff_minimax.references`). Reference
media never reach the cache.

"How Ref2VA references affect training": at every batch :meth:`MiniMaxH3Ref2VAAdapter.prepare_condition` realises the
visual references once as immutable prefix rows (noised to ``t = 0.999``, one draw per reference in packed order:
``MiniMaxH3PrepareConditionLatentsStep``); soundtrack rows ride clean at ``t = 1``. The packed sequence is
``[text | reference blocks | target audio | target video]`` (``build_ref2va_packed_sequence``); condition-row
predictions are discarded and only the target rows (ff's latent state) are noised, stepped, in the loss and in GRPO
log-probabilities. The transformer is the ``transformer_ref/`` partition; its LoRA exports as ``transformer_ref.``
keys, which ``MiniMaxH3LoraLoaderMixin.load_lora_weights`` routes to that component.

Two departures from the pipeline, both for the environment, both documented in docs/minimax.md:

* a soundtrack whose rate is not the audio VAE's is truncated on its own clock (as the pipeline does) and resampled
  once with PyAV (:func:`ff_core.audio.to_model_rate`) instead of torchaudio, which does not import beside the pinned
  torch; the pipeline then receives it at the VAE's rate (bit-exact with the pipeline only for audio at that rate).
* video references need Qwen3-VL's video processor, which needs torchvision; without it the contract
  (:meth:`MiniMaxH3Ref2VAAdapter.resolve_contract`) takes image and audio references only, so a video reference is
  refused with its record's line before any weights load.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from typing import Any, ClassVar

import torch
from torch import Tensor

from ff_core.adapter import Condition, ConditionInput
from ff_core.contracts import MediaType, PipelineIOContract, TensorColumns
from ff_core.errors import ConfigError
from ff_minimax.adapter import AUDIO_CHANNELS, H3_CLIP, MiniMaxH3Adapter, PackedLayout
from ff_minimax.fl2va import to_pil
from ff_minimax.prefix import Geometry, realise_prefix, ref2va_layout
from ff_minimax.references import REF2VA_CONTRACT, manifest_tensor, reference_manifest
from ff_minimax.rules import FPS
from ff_minimax.shards import h3_columns

KIND_CODES = {"image": 0, "video": 1, "audio": 2}
_KIND_NAMES = {code: name for name, code in KIND_CODES.items()}
#: Per-sample condition keys whose length varies with the references (padded in a batch, cut back per sample).
REFERENCE_KEYS = ("reference_latents", "reference_shapes", "reference_audio", "reference_audio_rows",
                  "reference_kinds", "reference_has_audio", "reference_manifest")  # fmt: skip


def video_references_available() -> bool:
    """Whether Qwen3-VL's video processor can be built here (it needs torchvision)."""
    return importlib.util.find_spec("torchvision") is not None


def contract_here() -> PipelineIOContract:
    """:data:`~ff_minimax.references.REF2VA_CONTRACT`, without video references when they cannot be presented."""
    if video_references_available():
        return REF2VA_CONTRACT
    spec = REF2VA_CONTRACT.references
    refs = dataclasses.replace(spec, types=frozenset({MediaType.IMAGE, MediaType.AUDIO}),
                               requires_one_of=frozenset({MediaType.IMAGE}),
                               max_per_type=tuple((t, n) for t, n in spec.max_per_type if t is not MediaType.VIDEO))
    return dataclasses.replace(REF2VA_CONTRACT, references=refs)


class MiniMaxH3Ref2VAAdapter(MiniMaxH3Adapter):
    """``minimax-h3-ref2va``: 1-12 globally ordered image / video / audio references plus the prompt to joint video +
    audio, on the ``transformer_ref/`` partition."""

    name: ClassVar[str] = "minimax-h3-ref2va"
    io_contract: ClassVar[PipelineIOContract] = REF2VA_CONTRACT
    preprocess_version: ClassVar[str] = "1"
    transformer_subfolder: ClassVar[str] = "transformer_ref"
    lora_prefix: ClassVar[str] = "transformer_ref"
    preprocessing_components: ClassVar[tuple[str, ...]] = ("text_encoder",)
    condition_collation: ClassVar[dict[str, str]] = {**MiniMaxH3Adapter.condition_collation,
                                                     **dict.fromkeys(REFERENCE_KEYS, "pad"),
                                                     "prefix_video_rows": "pad"}  # fmt: skip
    # Shard rows carry every cached reference tensor (the prefix's latents, its layout geometry, the manifest).
    tensor_columns: ClassVar[TensorColumns] = h3_columns(*REFERENCE_KEYS)

    reference_image_short_edge: int = 2048
    canvas_short_edge: int = 768
    canvas_max_pixels: int = 768 * 1344

    @classmethod
    def resolve_contract(cls, pretrained_model_name_or_path: str | os.PathLike | None,
                         adapter_kwargs: dict[str, Any] | None = None) -> PipelineIOContract:  # fmt: skip
        """The spec's contract; without torchvision (no Qwen3-VL video processor) image and audio references only."""
        return contract_here()

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *,
        reference_image_short_edge: int = 2048,
        canvas_short_edge: int = 768,
        canvas_max_pixels: int = 768 * 1344,
        height: int = H3_CLIP.height,
        width: int = H3_CLIP.width,
        num_frames: int = H3_CLIP.num_frames,
        target_posterior: str = "mode",
        dtype: str | torch.dtype = "float32",
        revision: str | None = None,
    ) -> MiniMaxH3Ref2VAAdapter:
        """Load as :meth:`MiniMaxH3Adapter.from_pretrained` (``height``, ``width``, ``num_frames``, ``dtype``,
        ``revision``), plus the reference geometry of the setup block (its pipeline config).

        Args:
            pretrained_model_name_or_path: folder in the modular pipeline's layout (``transformer_ref/``), or hub id.
            reference_image_short_edge: the short edge an image reference is encoded at (2048 released: thousands of
                condition rows; a tiny model uses a few dozen pixels).
            canvas_short_edge: the short edge a video reference is put on (its own aspect ratio; 768 released).
            canvas_max_pixels: the area cap of a video reference's canvas (768 x 1344 released).
            height: see :meth:`MiniMaxH3Adapter.from_pretrained`.
            width: likewise.
            num_frames: likewise.
            target_posterior: likewise.
            dtype: likewise.
            revision: likewise.
        """
        # Named, not **kwargs: ff_core.pretrained.check_adapter_kwargs refuses a misspelt key before weights load.
        cls._check_reference_geometry({"reference_image_short_edge": reference_image_short_edge,
                                       "canvas_short_edge": canvas_short_edge, "canvas_max_pixels": canvas_max_pixels})
        adapter = super().from_pretrained(pretrained_model_name_or_path, height=height, width=width,
                                          num_frames=num_frames, target_posterior=target_posterior, dtype=dtype,
                                          revision=revision)  # fmt: skip
        adapter.reference_image_short_edge = reference_image_short_edge
        adapter.canvas_short_edge, adapter.canvas_max_pixels = canvas_short_edge, canvas_max_pixels
        adapter.io_contract = contract_here()
        return adapter

    @staticmethod
    def _check_reference_geometry(adapter_kwargs: dict[str, Any]) -> None:
        for key in ("reference_image_short_edge", "canvas_short_edge", "canvas_max_pixels"):
            value = adapter_kwargs.get(key, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model.adapter_kwargs.{key}", f"must be a positive integer, got {value!r}")

    @classmethod
    def check_adapter_kwargs(
        cls, pretrained_model_name_or_path: str | os.PathLike | None, adapter_kwargs: dict[str, Any]
    ) -> None:
        """The clip and dtype (:meth:`MiniMaxH3Adapter.check_adapter_kwargs`, the canvas against the
        ``transformer_ref/`` patch) and the reference geometry, before any weight loads."""
        cls._check_reference_geometry(adapter_kwargs)
        super().check_adapter_kwargs(pretrained_model_name_or_path, adapter_kwargs)

    def preprocess_identity(self) -> dict[str, Any]:
        """Besides the checkpoint: the clip (video references are truncated to it, soundtracks to its duration) and
        the reference geometry the setup block normalises to."""
        return {**super().preprocess_identity(), "height": self.height, "width": self.width,
                "num_frames": self.num_frames, "reference_image_short_edge": self.reference_image_short_edge,
                "canvas_short_edge": self.canvas_short_edge, "canvas_max_pixels": self.canvas_max_pixels}  # fmt: skip

    # -- the pipeline's own preprocessing blocks ---------------------------------------------------
    def _blocks(self) -> Any:
        """``[setup, text encoder, reference encoder]`` as a modular pipeline over this adapter's components (built
        once; not a submodule)."""
        pipe = self.__dict__.get("_reference_blocks")
        if pipe is None:
            from diffusers.modular_pipelines import SequentialPipelineBlocks
            from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep
            from diffusers.modular_pipelines.minimax_h3.encoders import (
                MiniMaxH3Ref2VAReferenceEncoderStep,
                MiniMaxH3Ref2VATextEncoderStep,
            )

            blocks = SequentialPipelineBlocks.from_blocks_dict({
                "setup": MiniMaxH3Ref2VASetupStep(), "text_encoder": MiniMaxH3Ref2VATextEncoderStep(),
                "vae_encoder": MiniMaxH3Ref2VAReferenceEncoderStep()})  # fmt: skip
            pipe = blocks.init_pipeline()
            pipe.register_to_config(reference_image_short_edge=self.reference_image_short_edge,
                                    canvas_short_edge=self.canvas_short_edge,
                                    canvas_max_pixels=self.canvas_max_pixels)  # fmt: skip
            object.__setattr__(self, "_reference_blocks", pipe)
        pipe.update_components(text_encoder=self.text_encoder, tokenizer=self.tokenizer, processor=self.processor,
                               vae=self.vae, audio_vae=self.audio_vae)  # fmt: skip
        return pipe

    def release_preprocessing(self) -> list[str]:
        """Also drops the preprocessing blocks' pipeline, which holds the text encoder too."""
        self.__dict__.pop("_reference_blocks", None)
        return super().release_preprocessing()

    def _soundtrack(self, audio: Any) -> Tensor:
        """A reference soundtrack as the setup block's input at the audio VAE's rate: truncated to the clip's duration
        on its own clock (the block's order), converted to stereo and resampled once with PyAV (no torchaudio)."""
        waveform, rate = audio.waveform, float(audio.clock_rate)
        waveform = waveform[:, : int(self.num_frames / FPS * rate)]
        samples = math.ceil(waveform.shape[-1] * self.audio_rate / rate)  # torchaudio Resample's output length
        from ff_core.audio import to_model_rate

        return to_model_rate(waveform, rate, self.audio_rate, AUDIO_CHANNELS, samples)

    def references(self, item: ConditionInput, index: int = 0) -> list[Any]:
        """The sample's media as diffusers' reference objects, in record order (``MiniMaxH3ImageReference``,
        ``MiniMaxH3VideoReference`` at its declared or file frame rate with its soundtrack,
        ``MiniMaxH3AudioReference``), every waveform at the audio VAE's rate."""
        from diffusers.modular_pipelines.minimax_h3 import (
            MiniMaxH3AudioReference,
            MiniMaxH3ImageReference,
            MiniMaxH3VideoReference,
        )

        refs = []
        for k, media in enumerate(item.media):
            kind, data = media.get("type"), media.get("data")
            where = f"inputs[{index}].media[{k}]"
            if kind == "image":
                refs.append(MiniMaxH3ImageReference(image=to_pil(data)))
            elif kind == "audio":
                refs.append(MiniMaxH3AudioReference(audio=self._soundtrack(data), sample_rate=self.audio_rate))
            elif kind == "video":
                if getattr(self.processor, "video_processor", None) is None:
                    raise ValueError(f"{where}: a video reference needs Qwen3-VL's video processor, which needs "
                                     "torchvision (not installed here); use image and audio references")  # fmt: skip
                sound = None if data.audio is None else self._soundtrack(data.audio)
                refs.append(MiniMaxH3VideoReference(
                    frames=data.frames.cpu().numpy(), fps=float(data.clock_fps), audio=sound,
                    sample_rate=None if sound is None else self.audio_rate))  # fmt: skip
            else:
                raise ValueError(f"{where}: {self.name} takes image, video and audio references, got {kind!r}")
        problem = self.io_contract.references.count_problem([MediaType(r.kind) for r in refs])
        if problem:
            raise ValueError(f"inputs[{index}]: {problem}")
        return refs

    def check_inputs(self, inputs: list[ConditionInput]) -> None:
        for i, item in enumerate(inputs):
            if any("slot" in m for m in item.media):
                raise ValueError(f"inputs[{i}]: references bind by list order, not slots")

    @torch.no_grad()
    def encode_references(self, item: ConditionInput, index: int = 0) -> dict[str, Tensor]:
        """One request through the pipeline's setup, text-encoder and reference-encoder blocks: every cached tensor of
        the sample (the module docstring lists them)."""
        refs = self.references(item, index)
        state = self._blocks()(prompt=item.prompt, references=refs, height=self.height, width=self.width,
                               num_frames=self.num_frames, output=["prompt_embeds", "text_token_tags",
                               "condition_latents", "audio_condition_latents", "normalized_references"])  # fmt: skip
        visual, sound = state["condition_latents"], state["audio_condition_latents"]
        channels = int(self.audio_vae.config.latent_channels)
        return {
            "prompt_embeds": state["prompt_embeds"][0].to(self.text_encoder.dtype),
            "text_token_tags": state["text_token_tags"].to(torch.long),
            "reference_latents": torch.cat([z.reshape(-1) for z in visual]).float(),
            "reference_shapes": torch.tensor([list(z.shape[1:]) for z in visual], dtype=torch.int64),
            "reference_audio": (torch.cat(sound) if sound else torch.zeros(0, channels)).float(),
            "reference_audio_rows": torch.tensor([r.shape[0] for r in sound], dtype=torch.int64),
            "reference_kinds": torch.tensor([KIND_CODES[r.kind] for r in refs], dtype=torch.int64),
            "reference_has_audio": torch.tensor([int(r.has_audio) for r in refs], dtype=torch.int64),
            "reference_manifest": manifest_tensor(reference_manifest(item.media)),
        }

    @torch.no_grad()
    def preprocess(self, inputs: list[ConditionInput]) -> list[dict[str, Tensor]]:
        """Per request (B = 1: one packed sequence each) :meth:`encode_references`, as CPU tensors."""
        self.check_inputs(inputs)
        return [{k: v.detach().cpu().clone() for k, v in self.encode_references(item, i).items()}
                for i, item in enumerate(inputs)]  # fmt: skip

    # -- one realised prefix per batch ----------------------------------------------------------------
    @staticmethod
    def visual_latents(sample: Condition) -> list[Tensor]:
        """One sample's visual reference latents back to (1, C, f, h, w) each, in packed order."""
        out, offset = [], 0
        flat = sample["reference_latents"]
        for shape in sample["reference_shapes"].tolist():
            n = math.prod(shape)
            out.append(flat[offset : offset + n].reshape(1, *shape))
            offset += n
        return out

    def prepare_condition(self, batch: dict[str, Tensor], generator: torch.Generator | None = None) -> Condition:
        """The batch on the transformer's device, plus its realised prefix (:meth:`realise`), drawn once here from
        ``generator`` (the objective's seeded per-micro-batch stream; ``None``: the global generator)."""
        return self.realise(super().prepare_condition(batch), generator=generator, batch=batch)

    def realise(self, condition: Condition, generator: torch.Generator | None = None,
                batch: dict[str, Tensor] | None = None) -> Condition:  # fmt: skip
        """``condition`` with ``prefix_video_rows`` (B, N, C p_t p_h p_w): each sample's image and video reference
        latents noised to ``t = 0.999`` (one draw per reference, in packed order) and packed.

        Args:
            condition: a prepared condition.
            generator: draws the noise (``None``: the global generator); a parity check passes the pipeline's.
            batch: the collated float32 batch, read instead of ``condition``'s (cast to the transformer's dtype).
        """
        source = batch or condition
        device = condition["prompt_embeds"].device
        rows = []
        for i in range(len(source["reference_latents"])):
            one = self.sample_condition({k: v for k, v in source.items() if k.startswith("reference_")}, i)
            latents = [z.to(device, torch.float32) for z in self.visual_latents(one)]
            rows.append(realise_prefix(latents, self.patch_size, self.scheduler, generator))
        n = max(r.shape[0] for r in rows)
        prefix = torch.stack([torch.nn.functional.pad(r, (0, 0, 0, n - r.shape[0])) for r in rows])
        mask = torch.stack([torch.arange(n, device=device) < r.shape[0] for r in rows])
        return {**condition, "prefix_video_rows": prefix, "prefix_video_rows_mask": mask}

    # -- the packed sequence ------------------------------------------------------------------------
    def packed_layout(self, condition: Condition, video: Tensor, audio: Tensor) -> PackedLayout:
        """``[text | reference blocks | target audio | target video]`` (``build_ref2va_packed_sequence``), its
        reference geometry read from the cached shapes and row counts."""
        geometry = Geometry(video.shape[1], video.shape[2], video.shape[3], audio.shape[2], self.patch_size,
                            AUDIO_CHANNELS)  # fmt: skip
        visual = [torch.empty((1, *shape), device="meta") for shape in condition["reference_shapes"].tolist()]
        sound = [torch.empty((int(n), 1), device="meta") for n in condition["reference_audio_rows"].tolist()]
        kinds = [_KIND_NAMES[int(k)] for k in condition["reference_kinds"]]
        layout = ref2va_layout(condition["text_token_tags"].cpu(), geometry, kinds,
                               [bool(a) for a in condition["reference_has_audio"]], visual, sound)  # fmt: skip
        return PackedLayout(layout["position_ids"], layout["token_tags"], layout["video_indices"],
                            layout["audio_indices"], layout["text_indices"],
                            int(layout["num_condition_video_rows"]), int(layout["num_condition_audio_rows"]))

    def prefix_rows(self, condition: Condition) -> tuple[Tensor | None, Tensor | None]:
        if "prefix_video_rows" not in condition:
            raise ValueError(f"{self.name}: the condition has no realised prefix; build it with prepare_condition")
        sound = condition["reference_audio"]
        return condition["prefix_video_rows"], (sound if sound.shape[0] else None)


__all__ = ["MiniMaxH3Ref2VAAdapter", "REFERENCE_KEYS", "contract_here", "video_references_available"]
