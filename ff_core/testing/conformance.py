"""The adapter conformance kit: test mixins a plugin author subclasses to check an adapter against ff's contract.

A plugin's tests are a tiny-model config class plus one line (STYLE 9, after diffusers' model tests)::

    from diffusers import StableDiffusion3Pipeline
    from ff_core.testing.conformance import AdapterConformance

    class TestMyAdapterConformance(AdapterConformance):
        adapter_cls = MyAdapter
        adapter_kwargs = {"resolution": 32}
        reference_pipeline = StableDiffusion3Pipeline     # opt-in: the maths checks against diffusers

        def build_checkpoint(self, path):          # a tiny random checkpoint in the family's real layout
            return build_tiny_my_family(path)

Every check goes through ``from_pretrained`` on that saved folder, so the path a user's real checkpoint takes is
the path tested. Two groups of checks:

* **plumbing** (always): metadata without weights, registration, ``encode_output`` and an SFT loss on the targets
  training delivers, stage shapes, seeding, schedule, what trains, tensor rows, the condition cache key, releasing
  preprocessing components, the LoRA file format; frozen components in eval mode at any depth (a dropout left on
  makes conditions random); a contract that accepts negative prompts gives a different velocity with CFG on; with
  :meth:`AdapterConformance.build_trained_checkpoint`, encode -> decode on the family's trained tiny VAE round-trips
  within :attr:`~AdapterConformance.roundtrip_tolerance`.
* **maths** (with :attr:`~AdapterConformance.reference_pipeline`): the family's diffusers pipeline is built from the
  same tiny checkpoint and run from the adapter's own initial noise (:mod:`ff_core.testing.reference`); prompt
  encoding, the sampling sigmas, the training table (``training_sigmas``), one denoiser call at each sigma, a full
  sampling run (with and without CFG; at another embedded guidance), the decoding, the encoding (every latent
  component through the pipeline's own VAE path: the posterior the family's reference trainer takes,
  :attr:`~AdapterConformance.reference_posterior`, normalised as the pipeline's latents are), and the LoRA export
  loaded through ``load_lora_weights`` are compared with tolerances; the denoiser and encoding checks compare every
  latent component (LTX-2's and MiniMax H3's audio too). A failure says what differed, where, and what it looks
  like.

The checks themselves are :class:`~ff_core.testing.conformance_checks.ConformanceChecks` (a mixin of this class,
callable on any adapter); this module holds the hooks, fixtures and tests.

Conditions are built from the adapter's contract (:meth:`AdapterConformance.make_inputs`: the prompts, negative
prompts when the contract takes them, an image per required image slot), batches no larger than its
``max_batch_size``. Targets are what training delivers (:meth:`AdapterConformance.make_targets`,
:mod:`ff_core.testing.conformance_targets`): tiny PNG / MP4 / WAV files written for every output of the contract and
decoded by the training loader's own code, so ``encode_output`` gets ``uint8`` (3, H, W) images, ``DecodedVideo``
clips (frames ``uint8`` (F, H, W, 3)) and ``DecodedAudio`` waveforms, as in ``ff fit``. Guidance goes to the pipeline
arguments the kit is told (:attr:`AdapterConformance.reference_cfg_argument`,
:attr:`AdapterConformance.reference_embedded_guidance_argument`). Override the ``make_*`` and ``reference_*`` methods
for what the defaults cannot know (condition slots other than images, pipeline arguments for condition media, a
packed latent layout).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
from peft import LoraConfig
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor
from torch.utils.data import default_collate

from ff_core.adapter import Adapter, ConditionInput, LatentState, scheduler_sigma_table
from ff_core.contracts import MediaGeometry, MediaType, PipelineIOContract
from ff_core.lora import LoRAConfig, apply_lora, lora_config, lora_configs, lora_state_dict, lora_state_dicts
from ff_core.objectives import SFTObjective
from ff_core.plugins import get_adapter_class
from ff_core.sampling import guides
from ff_core.testing.conformance_checks import (
    ConformanceChecks,
    ReferenceCase,
    vae_posterior,
)
from ff_core.testing.conformance_checks import vae_posterior_sample as vae_posterior_sample  # for plugin tests
from ff_core.testing.conformance_targets import encoding_delivered, loader_targets
from ff_core.testing.conformance_targets import media_tensor as media_tensor  # for plugin tests' reference_encode
from ff_core.testing.reference import (
    LatentLayout,
    PipelineRun,
    run_pipeline,
)


class AdapterConformance(ConformanceChecks):
    """Checks every adapter must pass. Subclass it as ``Test...`` and set the class attributes below.

    Attributes:
        adapter_cls: the adapter class under test.
        adapter_kwargs: keyword arguments of its ``from_pretrained``.
        prompts: prompts of the conditions (two, so batching is exercised where the contract allows).
        negative_prompts: their negative prompts, used when the contract accepts negative prompts.
        reference_pipeline: the family's diffusers pipeline class (``StableDiffusion3Pipeline``); ``None`` turns
            the maths checks off.
        reference_layout: how the pipeline's latents map to the adapter's state (default: the same tensor).
        reference_steps: sampling steps of the reference runs.
        reference_cfg_argument: the pipeline ``__call__`` argument that carries ff's CFG scale (true classifier-free
            guidance: the negative branch combined with the conditional velocity): ``"guidance_scale"`` (default: SD3,
            Wan), ``"true_cfg_scale"`` (FLUX.1, HunyuanVideo), ``None`` (a pipeline without CFG: only runs at scale 1).
            Read by the default :meth:`reference_guidance_kwargs`.
        reference_embedded_guidance_argument: the pipeline argument that carries the embedded (distilled) guidance
            scale a guidance-embedded denoiser is conditioned on (``Adapter.embedded_guidance``): ``"guidance_scale"``
            in FLUX.1 and HunyuanVideo; ``None`` (default): the pipeline has none. Required, and distinct from
            :attr:`reference_cfg_argument`, when the adapter has embedded guidance: the kit refuses to guess which
            scale ``guidance_scale`` is (:meth:`~ff_core.testing.conformance_checks.ConformanceChecks.
            reference_guidance_arguments`). Read by the default :meth:`reference_embedded_guidance_kwargs`.
        reference_guidance: the CFG scale of the guided reference run.
        reference_component_guidance: ``(scales, rescales)``, per latent component, of one more guided reference run
            (``model.sampling.guidance_scale`` / ``guidance_rescale`` as mappings: LTX-2's per-stream scales and
            guidance rescale); :meth:`reference_component_guidance_kwargs` gives the pipeline's arguments. ``None``
            (default): not checked.
        reference_embedded_guidance: the distilled-guidance scale of the embedded-guidance run (adapters with
            ``embedded_guidance``; one more than the adapter's default when it equals it).
        condition_atol: tolerance of the prompt encoding against the pipeline's.
        velocity_atol: tolerance of one denoiser call (and relative tolerance, times 10).
        sample_atol: tolerance of the final latents of a full sampling run.
        media_atol: tolerance of decoded images and videos in uint8 units (rounding: 1).
        audio_atol: tolerance of decoded audio (float waveforms in [-1, 1]; 1e-4 is about 3 LSB of 16-bit PCM).
        encode_atol: tolerance of the clean latents ``encode_output`` gives against the pipeline's own VAE path
            (:meth:`reference_encode`), every component.
        reference_posterior: which posterior latent the family's reference trainer trains on, and so what
            :meth:`reference_encode` takes: ``"sample"`` (default; diffusers' ``train_dreambooth_sd3.py``:
            ``vae.encode(x).latent_dist.sample()``, drawn here from the kit's generator, the one ``encode_output``
            gets) or ``"mode"`` (``latent_dist.mode()``: ltx-trainer, the H3 SFT data flow). Read by the default
            :meth:`reference_encode` and by a plugin's own; never the adapter's setting.
        roundtrip_tolerance: largest mean |decode(encode(x)) - x| in uint8 units on the trained tiny VAE: coarse (a
            wrong pixel range, no decode), since a briefly trained tiny VAE reconstructs loosely (the SD3 one: about
            29 and 41 on the two held-out shapes); the latent normalisation is :meth:`check_encoding`'s to catch.
        target_sample_rate: the rate of the kit's WAV targets (each record's ``sample_rate``): ``encode_output``
            converts to its model's rate itself, as in training; set it to the audio VAE's for a
            :meth:`reference_encode` that takes the waveform as it is.
        target_audio_seconds: the length of the kit's audio targets; ``None``: the video file's beside it (its clip
            and one frame), else 1 s.
    """

    adapter_cls: ClassVar[type[Adapter]]
    adapter_kwargs: ClassVar[dict[str, Any]] = {}
    prompts: ClassVar[tuple[str, ...]] = ("a red circle on a white background", "a blue square")
    negative_prompts: ClassVar[tuple[str, ...]] = ("blurry", "a green triangle")
    reference_pipeline: ClassVar[Any] = None
    reference_layout: ClassVar[LatentLayout] = LatentLayout()
    reference_steps: ClassVar[int] = 3
    reference_cfg_argument: ClassVar[str | None] = "guidance_scale"
    reference_embedded_guidance_argument: ClassVar[str | None] = None
    reference_guidance: ClassVar[float] = 4.0
    reference_component_guidance: ClassVar[tuple[dict[str, float], dict[str, float]] | None] = None
    reference_embedded_guidance: ClassVar[float] = 1.5
    condition_atol: ClassVar[float] = 1e-5
    velocity_atol: ClassVar[float] = 1e-4
    sample_atol: ClassVar[float] = 1e-3
    media_atol: ClassVar[float] = 1.0
    audio_atol: ClassVar[float] = 1e-4
    encode_atol: ClassVar[float] = 1e-4
    reference_posterior: ClassVar[str] = "sample"
    roundtrip_tolerance: ClassVar[float] = 64.0
    target_sample_rate: ClassVar[int] = 16000
    target_audio_seconds: ClassVar[float | None] = None
    seed: ClassVar[int] = 7

    # -- to provide ---------------------------------------------------------------------------------------
    def build_checkpoint(self, path: Path) -> Path:
        """Write a tiny random-initialised checkpoint in the family's layout and return its folder."""
        raise NotImplementedError

    def build_trained_checkpoint(self, path: Path) -> Path | None:
        """The tiny checkpoint with its VAE trained briefly on the family's tiny data (e.g. ``build_tiny_image_vae``
        of :mod:`ff_core.testing.tiny` on the shapes), for the encode -> decode round trip; ``None``: skipped."""
        return None

    def make_inputs(self, adapter: Adapter, folder: Path) -> list[ConditionInput]:
        """The condition inputs of every check, from the adapter's contract: :attr:`prompts` (no more than its
        ``max_batch_size``), :attr:`negative_prompts` when it takes negative prompts, and a distinct random image
        (saved under ``folder``) bound to each required image slot. Override for other slot types."""
        contract = adapter.io_contract
        n = min(len(self.prompts), contract.max_batch_size or len(self.prompts))
        inputs = []
        for i in range(n):
            media = []
            for k, slot in enumerate(s for s in contract.slots if s.required):
                if slot.type is not MediaType.IMAGE:
                    raise NotImplementedError(f"slot {slot.name!r} takes {slot.type.value}: override make_inputs")
                media.append(self._slot_image(adapter, folder, slot.name, seed=100 * i + k))
            if contract.references is not None or contract.grouped is not None:
                raise NotImplementedError("references / grouped inputs: override make_inputs")
            negative = self.negative_prompts[i] if contract.uses_cfg else None
            inputs.append(ConditionInput(self.prompts[i], negative_prompt=negative, media=media))
        return inputs

    def make_targets(self, adapter: Adapter, n: int) -> list[list[Any]]:
        """The targets of ``n`` samples exactly as ``ff fit``'s loader hands them to ``encode_output``, in the
        contract's output order: a PNG, MP4 or WAV per output written with random content (a two-pitch stereo tone
        for audio) and decoded by the training loader's code, fitted to ``output_geometry()``
        (:func:`~ff_core.testing.conformance_targets.loader_targets`): images ``uint8`` (3, H, W), videos
        ``DecodedVideo`` (frames ``uint8`` (F, H, W, 3), ``fps``, ``timestamps``), audio ``DecodedAudio`` (waveform
        (C, N) at :attr:`target_sample_rate`). Every check that encodes targets (the SFT step, tensor rows, the
        encoding check, seeding) takes these; override only to feed other content in the same form."""
        return self._loader_targets(adapter, n, "random", seed=0)

    def make_roundtrip_targets(self, adapter: Adapter, n: int, folder: Path) -> list[list[Any]]:
        """Media of the trained VAE's domain, decoded as :meth:`make_targets`' are: held-out shapes images,
        moving-shapes clips (:mod:`ff_core.testing.shapes`, :mod:`ff_core.testing.moving_shapes`), tones; written
        under ``folder``."""
        return self._loader_targets(adapter, n, "shapes", seed=123, folder=folder / "roundtrip-targets")

    def load_reference_pipeline(self, pretrained: Path) -> Any:
        """The reference pipeline on the tiny checkpoint (default: ``reference_pipeline.from_pretrained``)."""
        return self.reference_pipeline.from_pretrained(pretrained)

    def reference_call_kwargs(self, adapter: Adapter, inputs: list[ConditionInput]) -> dict[str, Any]:
        """``__call__`` arguments of the pipeline besides prompts, guidance, steps, latents and output: the geometry
        (default: ``height`` / ``width`` [/ ``num_frames``] of ``output_geometry()``); add the condition media and
        what else the adapter fixes (``max_sequence_length``)."""
        (geometry, *_) = adapter.output_geometry()
        if geometry is None:
            return {}
        out = {"height": geometry.height, "width": geometry.width}
        return out if geometry.num_frames is None else {**out, "num_frames": geometry.num_frames}

    def reference_guidance_kwargs(self, guidance_scale: float) -> dict[str, Any]:
        """The pipeline's arguments for ff's CFG scale ``guidance_scale``: ``{reference_cfg_argument: scale}``
        (:attr:`reference_cfg_argument`; nothing at scale 1 for a pipeline without CFG). Override for several
        arguments (LTX-2: the same scale on ``guidance_scale`` and ``audio_guidance_scale``, its extra guidance terms
        off)."""
        argument = self.reference_cfg_argument
        if argument is not None:
            return {argument: guidance_scale}
        if guides(guidance_scale):
            raise AssertionError(f"{type(self).__name__}.reference_cfg_argument is None (the pipeline takes no CFG), "
                                 f"but a run at CFG scale {guidance_scale:g} was asked for")  # fmt: skip
        return {}

    def reference_component_guidance_kwargs(self, scales: dict[str, float], rescales: dict[str, float]
                                            ) -> dict[str, Any]:  # fmt: skip
        """The pipeline's arguments for per-component CFG ``scales`` and guidance ``rescales``
        (:attr:`reference_component_guidance`; LTX-2: ``guidance_scale`` / ``audio_guidance_scale``,
        ``guidance_rescale`` / ``audio_guidance_rescale``)."""
        raise NotImplementedError(f"{type(self).__name__} sets reference_component_guidance: name the pipeline's "
                                  "arguments in reference_component_guidance_kwargs")  # fmt: skip

    def reference_embedded_guidance_kwargs(self, scale: float) -> dict[str, Any]:
        """The pipeline's argument for the distilled-guidance scale ``scale``: ``{reference_embedded_guidance_argument:
        scale}`` (:attr:`reference_embedded_guidance_argument`; ``{}`` when it is ``None``, which the kit refuses for
        an adapter with embedded guidance)."""
        argument = self.reference_embedded_guidance_argument
        return {} if argument is None else {argument: scale}

    def reference_condition(self, pipe: Any, adapter: Adapter, inputs: list[ConditionInput],
                            run: PipelineRun) -> dict[str, Tensor]:  # fmt: skip
        """Reference tensors for keys of the adapter's prepared condition (default: the tensors the pipeline hands its
        step callback, ``prompt_embeds`` and the like, at guidance 1). Add condition-media encodings here."""
        return dict(run.tensors)

    def reference_encode(self, pipe: Any, adapter: Adapter, targets: list[list[Tensor]],
                         generator: torch.Generator) -> Tensor | dict[str, Tensor]:  # fmt: skip
        """The clean latents of ``targets`` through the pipeline's own VAE path, independent of the adapter, in the
        adapter's (unpacked) layout: one tensor for an adapter with one latent component, else a dict with every
        component by name (the check compares each). Default: ``pipe.vae``'s posterior as
        :attr:`reference_posterior` says (:func:`vae_posterior`: a sample drawn from ``generator``, or the mode),
        then ``(z - shift_factor) * scaling_factor`` from the VAE's config, the inverse of what the pipeline's
        decoding applies (SD3, FLUX.1: ``latents / scaling_factor + shift_factor``). Override for another
        normalisation (Wan: ``(z - latents_mean) / latents_std``) or several components (LTX-2, MiniMax H3: video and
        audio)."""
        z = vae_posterior(pipe.vae, targets, self.reference_posterior, generator)
        config = pipe.vae.config
        return (z - (getattr(config, "shift_factor", None) or 0.0)) * config.scaling_factor

    def reference_training_sigmas(self, pipe: Any) -> Tensor | None:
        """The table of training noise levels diffusers' training scripts index for this family
        (``noise_scheduler_copy.sigmas[indices]``): the pipeline scheduler's as built from its config
        (:func:`~ff_core.adapter.scheduler_sigma_table`); ``None`` skips the check."""
        return scheduler_sigma_table(pipe.scheduler)

    def reference_media(self, adapter: Adapter, output: Any) -> list[list[Tensor]]:
        """The pipeline's decoded output (``output_type="pt"``) as ff media per sample, float in uint8 units."""
        (media, *_) = output.to_tuple() if hasattr(output, "to_tuple") else output
        if len(adapter.io_contract.outputs) != 1:
            raise NotImplementedError("several outputs: override reference_media")
        return [[m.float().cpu() * 255] for m in media]  # images (3, H, W); videos (F, 3, H, W)

    def reference_run(self, pipe: Any, latents: Any, *, steps: int, denoisers: list[str], call_latents: Any = None,
                      **kwargs: Any) -> PipelineRun:  # fmt: skip
        """One recorded run of the reference pipeline (:func:`~ff_core.testing.reference.run_pipeline`'s arguments and
        result). Default: ``run_pipeline``, which records through ``callback_on_step_end``. Override it for a pipeline
        without one (a diffusers modular pipeline: record its denoising loop's blocks), filling the same
        :class:`~ff_core.testing.reference.PipelineRun` (and its ``stream_sigmas`` for streams on their own
        schedules)."""
        return run_pipeline(pipe, latents, steps=steps, denoisers=denoisers, call_latents=call_latents, **kwargs)

    def reference_levels(self, adapter: Adapter, case: ReferenceCase, k: int) -> float | dict[str, float]:
        """The noise level(s) of the reference run's step ``k`` at which the adapter's velocity is compared: the run's
        sigma (default), or per latent component when components step on their own schedules (from the run's
        ``stream_sigmas``; the adapter's ``component_velocity`` is then called)."""
        return float(case.run.sigmas[k])

    def load_reference_lora(self, pipe: Any, adapter: Adapter, folder: Path, files: dict[str, Path]) -> None:
        """Load the adapter's exported LoRA files into the pipeline the way a user does (``load_lora_weights``; a
        second network with ``load_into_<name>=True``, as diffusers' Wan2.2 loader)."""
        for network, file in files.items():
            extra = {} if network == adapter.lora_prefix else {f"load_into_{network}": True}
            pipe.load_lora_weights(folder, weight_name=file.name, **extra)

    # -- fixtures (class-scoped classmethods: one checkpoint per test class) -------------------------------------
    @pytest.fixture(scope="class")
    @classmethod
    def pretrained(cls, tmp_path_factory) -> Path:
        return cls().build_checkpoint(tmp_path_factory.mktemp(cls.adapter_cls.__name__))

    @pytest.fixture(scope="class")
    @classmethod
    def adapter(cls, pretrained) -> Adapter:
        return cls.adapter_cls.from_pretrained(pretrained, **cls.adapter_kwargs)

    @pytest.fixture(scope="class")
    @classmethod
    def inputs(cls, adapter, tmp_path_factory) -> list[ConditionInput]:
        return cls().make_inputs(adapter, tmp_path_factory.mktemp("inputs"))

    @pytest.fixture(scope="class")
    @classmethod
    def batch(cls, adapter, inputs) -> dict[str, Any]:
        """A training batch: the inputs' collated conditions, and targets as the loader delivers them
        (:meth:`make_targets`)."""
        conditions = adapter.preprocess(inputs)
        return {"condition": default_collate(conditions), "target": cls().make_targets(adapter, len(inputs))}

    @pytest.fixture(scope="class")
    @classmethod
    def trained_pretrained(cls, tmp_path_factory) -> Path:
        """The trained checkpoint (:meth:`build_trained_checkpoint`); override the fixture to share a session one."""
        path = cls().build_trained_checkpoint(tmp_path_factory.mktemp("trained"))
        if path is None:
            pytest.skip(f"{cls.__name__} builds no trained checkpoint (build_trained_checkpoint)")
        return path

    @pytest.fixture(scope="class")
    @classmethod
    def reference(cls, pretrained) -> Any:
        if cls.reference_pipeline is None:
            pytest.skip(f"{cls.__name__} names no reference_pipeline: the maths checks against diffusers are off")
        return cls().load_reference_pipeline(pretrained)

    @pytest.fixture(scope="class")
    @classmethod
    def reference_case(cls, adapter, reference, inputs) -> ReferenceCase:
        return cls().run_reference(adapter, reference, inputs, guidance_scale=1.0)

    # -- private helpers ------------------------------------------------------------------------------------------
    @staticmethod
    def _image_size(adapter: Adapter) -> tuple[int, int]:
        (geometry, *_) = adapter.output_geometry()
        if geometry is not None:
            return geometry.height, geometry.width
        size = getattr(adapter, "resolution", 32)  # the template's adapter_kwargs; an audio-only family: unused
        return size, size

    def _loader_targets(self, adapter: Adapter, n: int, content: str, seed: int, folder: Path | None = None
                        ) -> list[list[Any]]:  # fmt: skip
        contract = adapter.io_contract
        return loader_targets(contract.output_types, adapter.output_geometry(), n, size=self._image_size(adapter),
                              content=content, seed=seed, sample_rate=self.target_sample_rate,
                              audio_seconds=self.target_audio_seconds, folder=folder)  # fmt: skip

    def _slot_image(self, adapter: Adapter, folder: Path, slot: str, seed: int) -> dict[str, Any]:
        from PIL import Image

        height, width = self._image_size(adapter)
        image = torch.randint(0, 256, (3, height, width), generator=torch.Generator().manual_seed(seed),
                              dtype=torch.uint8)  # fmt: skip
        path = folder / f"{slot}_{seed}.png"
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(path)
        return {"type": "image", "data": image, "path": path, "slot": slot}

    # -- checks: the maths against the reference pipeline --------------------------------------------------------
    def test_reference_prompt_encoding(self, adapter, reference, reference_case):
        self.check_condition(adapter, reference, reference_case)

    def test_reference_sampling_sigmas(self, adapter, reference, reference_case):
        self.check_sigmas(adapter, reference, reference_case)

    def test_reference_training_sigmas(self, adapter, reference, reference_case):
        self.check_training_sigmas(adapter, reference, reference_case)

    def test_reference_denoiser_at_each_sigma(self, adapter, reference, reference_case):
        self.check_denoiser(adapter, reference, reference_case)

    def test_reference_sampling_run(self, adapter, reference, reference_case):
        self.check_sampling(adapter, reference, reference_case)

    def test_reference_sampling_run_with_cfg(self, adapter, reference, inputs):
        if not adapter.io_contract.uses_cfg:
            pytest.skip(f"{self.adapter_cls.__name__}'s contract takes no negative prompt (no CFG)")
        self.check_sampling(adapter, reference,
                            self.run_reference(adapter, reference, inputs, guidance_scale=self.reference_guidance))

    def test_reference_sampling_run_with_component_guidance(self, adapter, reference, inputs):
        if self.reference_component_guidance is None or not adapter.io_contract.uses_cfg:
            pytest.skip(f"{type(self).__name__} sets no reference_component_guidance (per-component CFG)")
        self.check_component_guidance(adapter, reference, inputs)

    def test_reference_embedded_guidance(self, adapter, reference, reference_case):
        if adapter.embedded_guidance is None:
            pytest.skip(f"{self.adapter_cls.__name__} on this checkpoint has no embedded guidance")
        self.check_embedded_guidance(adapter, reference, reference_case)

    def test_reference_decoding(self, adapter, reference, reference_case):
        self.check_decoding(adapter, reference, reference_case)

    def test_reference_encoding(self, adapter, reference, reference_case):
        self.check_encoding(adapter, reference, reference_case)

    def test_reference_lora_loads_through_load_lora_weights(self, pretrained, reference, inputs, tmp_path):
        self.check_lora_in_pipeline(pretrained, inputs, tmp_path / "lora")

    # -- checks: plumbing ----------------------------------------------------------------------------------------
    def test_frozen_components_are_in_eval_mode_at_any_depth(self, pretrained, inputs):
        adapter = self.adapter_cls.from_pretrained(pretrained, **self.adapter_kwargs)
        self.check_frozen_in_eval(adapter, "after from_pretrained")
        self.check_preprocess_is_deterministic(adapter, inputs)
        adapter.train()
        self.check_frozen_in_eval(adapter, "after .train()")

    def test_negative_prompts_change_the_guided_velocity(self, adapter, inputs):
        if not adapter.io_contract.uses_cfg:
            pytest.skip(f"{self.adapter_cls.__name__}'s contract takes no negative prompt (no CFG)")
        self.check_cfg(adapter, inputs)

    def test_encode_decode_round_trip_on_the_trained_vae(self, trained_pretrained, inputs, tmp_path):
        adapter = self.adapter_cls.from_pretrained(trained_pretrained, **self.adapter_kwargs)
        self.check_roundtrip(adapter, inputs, tmp_path)

    def test_metadata_is_readable_without_weights(self):
        cls = self.adapter_cls
        assert isinstance(cls.name, str) and cls.name
        assert isinstance(cls.io_contract, PipelineIOContract)
        assert cls.io_contract.describe()
        assert isinstance(cls.preprocess_version, str) and cls.preprocess_version
        assert all(isinstance(t, str) for t in cls.default_lora_targets)

    def test_registered_under_its_name(self):
        assert get_adapter_class(self.adapter_cls.name) is self.adapter_cls

    def test_denoiser_is_a_submodule(self, adapter):
        assert any(m is adapter.denoiser for m in adapter.modules())

    def test_sharding_blocks_are_repeated_blocks_of_each_network(self, adapter):
        """FSDP2's units (docs/scaling.md): for every trained network, distinct submodules of it, none inside another
        (several kinds are fine: FLUX.1's double- and single-stream blocks). At least one per network: empty would
        shard the network whole (correct, but gathered whole for every forward), which ff allows but the kit does not;
        a plugin whose network has no repeated blocks overrides this test, saying why."""
        blocks = adapter.sharding_blocks()
        assert set(blocks) <= set(adapter.denoisers())
        for name, network in adapter.denoisers().items():
            found = blocks.get(name, [])
            inside = {id(m) for m in network.modules() if m is not network}
            assert found and all(id(b) in inside for b in found), name
            assert len({id(b) for b in found}) == len(found), name
            nested = [b for b in found for other in found if other is not b and any(m is b for m in other.modules())]
            assert not nested, f"{name}: sharding blocks nested in other blocks: {[type(b).__name__ for b in nested]}"

    def test_preprocess_gives_per_sample_cpu_tensors(self, adapter, inputs):
        out = adapter.preprocess(inputs)
        assert len(out) == len(inputs) and out[0]
        assert all(o.keys() == out[0].keys() for o in out)
        for key, value in out[0].items():
            assert value.device.type == "cpu", key
            assert all(o[key].shape == value.shape for o in out), key
            assert not value.requires_grad, key

    def test_encode_output_takes_the_targets_training_delivers(self, adapter, inputs):
        """``encode_output`` of real files decoded by the training loader's code (``DecodedVideo`` clips, not tensors
        of the kit's making), and an SFT loss on them (:meth:`check_training_targets`)."""
        self.check_training_targets(adapter, inputs)

    def test_stages_agree_on_latent_geometry(self, adapter, batch, inputs):
        condition = adapter.prepare_condition(batch["condition"])
        with encoding_delivered(adapter, batch["target"]):
            clean = adapter.encode_output(batch["target"], condition)
        assert isinstance(clean, LatentState) and clean.batch_size == len(inputs)
        noise = adapter.initial_noise(condition, torch.Generator().manual_seed(0))
        assert list(noise.components) == list(clean.components)
        declared = type(adapter).latent_components  # what per-component config keys are checked against
        assert declared is None or list(declared) == list(clean.components), (
            f"latent_components declares {list(declared or ())}, the stages produce {list(clean.components)}")
        sigma = torch.full((clean.batch_size,), 0.5)
        velocity = adapter.velocity(clean, sigma, condition)
        for name, tensor in clean.components.items():
            assert noise.components[name].shape == tensor.shape, name
            assert velocity.components[name].shape == tensor.shape, name
            assert torch.isfinite(velocity.components[name]).all(), name

    def test_decode_follows_the_output_contract(self, adapter, batch, inputs):
        condition = adapter.prepare_condition(batch["condition"])
        with encoding_delivered(adapter, batch["target"]):
            clean = adapter.encode_output(batch["target"], condition)
        media = adapter.decode(clean)
        assert len(media) == len(inputs)
        for sample in media:
            assert len(sample) == len(adapter.io_contract.outputs)
            for item, spec in zip(sample, adapter.io_contract.outputs):
                if spec.type is MediaType.IMAGE:
                    assert item.dtype == torch.uint8 and item.ndim == 3 and item.shape[0] == 3

    def test_output_geometry_is_what_sampling_makes(self, adapter, batch):
        """One entry per output; training targets are fitted to the geometry the adapter samples at."""
        geometry = adapter.output_geometry()
        assert len(geometry) == len(adapter.io_contract.outputs)
        assert all(g is None or isinstance(g, MediaGeometry) for g in geometry)
        pickle.loads(pickle.dumps(geometry))  # it travels to the loader workers
        condition = adapter.prepare_condition(batch["condition"])
        sample = adapter.decode(adapter.initial_noise(condition, torch.Generator().manual_seed(0)))[0]
        for item, spec, g in zip(sample, adapter.io_contract.outputs, geometry):
            if g is not None and spec.type is MediaType.IMAGE:
                assert tuple(item.shape[1:]) == (g.height, g.width)

    def test_sampling_is_seeded(self, adapter, batch):
        condition = adapter.prepare_condition(batch["condition"])

        def run(seed):
            return adapter.sample(condition, num_steps=2, generator=torch.Generator().manual_seed(seed))

        a, b, c = run(0), run(0), run(1)
        for name in a.components:
            torch.testing.assert_close(a.components[name], b.components[name])
            assert not torch.equal(a.components[name], c.components[name])

    def test_encoding_is_seeded_by_its_generator(self, adapter, batch):
        """``encode_output`` draws its randomness (a VAE posterior sample) from the generator it is given, never the
        global RNG: training passes one per rank and micro-batch, so a resumed run encodes what the uninterrupted
        one did."""
        condition = adapter.prepare_condition(batch["condition"])
        state = torch.random.get_rng_state()

        def run(seed):
            with encoding_delivered(adapter, batch["target"]):
                return adapter.encode_output(batch["target"], condition, generator=torch.Generator().manual_seed(seed))

        a = run(0)
        torch.manual_seed(1234)  # another global state must not matter
        b = run(0)
        torch.random.set_rng_state(state)
        for name in a.components:
            torch.testing.assert_close(a.components[name], b.components[name], rtol=0, atol=0,
                                       msg=f"encode_output({name!r}) differs for the same generator seed")

    def test_noise_schedule_and_its_shift(self, adapter, batch):
        """Training's default shift is the one sampling uses; a sampling shift override gives a valid grid."""
        condition = adapter.prepare_condition(batch["condition"])
        with encoding_delivered(adapter, batch["target"]):
            clean = adapter.encode_output(batch["target"], condition)
        assert adapter.timestep_shift() > 0 and adapter.timestep_shift(clean) > 0
        for shift in (None, 1.0, 3.0):
            sigmas = adapter.sampling_sigmas(4, shift=shift)
            assert len(sigmas) == 5 and sigmas[-1] == 0 and sigmas[0] <= 1 and (sigmas.diff() < 0).all(), shift
        assert not torch.equal(adapter.sampling_sigmas(4, shift=1.0), adapter.sampling_sigmas(4, shift=3.0))

    def test_sft_step_trains_the_denoiser_only(self, pretrained, batch):
        """Every trained network (``denoisers()``: the denoiser, or each expert) and nothing else gets gradients."""
        adapter = self.adapter_cls.from_pretrained(pretrained, **self.adapter_kwargs)
        adapter.requires_grad_(False)
        networks = list(adapter.denoisers().values())
        assert networks[0] is adapter.denoiser, "denoisers() lists the denoiser first"
        for network in networks:
            network.requires_grad_(True)
        adapter.train()  # frozen components must stay in eval mode (no dropout in the conditions)
        assert {id(m) for m in adapter.trained_networks()} == {id(m) for m in networks}
        assert all(m.training for network in networks for m in network.modules())
        self.check_frozen_in_eval(adapter, "after .train() with its denoisers trainable")
        with encoding_delivered(adapter, batch["target"], "encode_output (in SFTObjective.training_loss)"):
            loss = SFTObjective().training_loss(adapter, batch).loss
        assert torch.isfinite(loss)
        loss.backward()
        trained = [p for network in networks for p in network.parameters()]
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trained)
        denoiser = {id(p) for p in trained}
        assert all(p.grad is None for p in adapter.parameters() if id(p) not in denoiser)

    def test_tensor_rows_round_trip(self, pretrained, adapter, batch, inputs):
        """With ``tensor_columns`` declared: the rows ``ff data preprocess-latents`` writes (``to_row`` of the
        preprocessed condition and the encoded latents), read back (``from_row``, collated, ``stored_latents``), are
        the condition and the clean state training would have computed, so SFT from shards equals SFT on the fly."""
        columns = self.adapter_cls.resolve_tensor_columns(pretrained, self.adapter_kwargs)  # the checkpoint's
        if columns is None:
            pytest.skip(f"{self.adapter_cls.__name__} declares no tensor_columns (no training from shards)")
        conditions = adapter.preprocess(inputs)
        condition = adapter.prepare_condition(default_collate(conditions))
        with encoding_delivered(adapter, batch["target"]):
            clean = adapter.encode_output(batch["target"], condition, generator=torch.Generator().manual_seed(0))
        rows = [columns.to_row(c, {k: v[i].cpu() for k, v in clean.components.items()})
                for i, c in enumerate(conditions)]
        assert set(columns.required) <= set(rows[0]), f"rows lack {set(columns.required) - set(rows[0])}"
        read = [columns.from_row(row) for row in rows]
        stored_condition = default_collate([c for c, _ in read])
        for key in stored_condition:
            torch.testing.assert_close(stored_condition[key], batch["condition"][key], rtol=0, atol=0, msg=key)
        state = adapter.stored_latents(default_collate([latents for _, latents in read]), condition)
        assert list(state.components) == list(clean.components)
        for name, tensor in clean.components.items():
            torch.testing.assert_close(state.components[name], tensor, rtol=0, atol=0, msg=name)
        assert state.masks.keys() == clean.masks.keys(), "stored_latents must set the masks encode_output sets"

    def test_preprocess_identity_keys_the_cache(self, pretrained):
        """Plain JSON data, the same for two loads of one checkpoint (else no condition cache is ever reused)."""
        identity = self.adapter_cls.from_pretrained(pretrained, **self.adapter_kwargs).preprocess_identity()
        assert isinstance(identity, dict) and json.loads(json.dumps(identity)) == identity
        assert self.adapter_cls.from_pretrained(pretrained, **self.adapter_kwargs).preprocess_identity() == identity

    def test_preprocessing_components_are_preprocessing_only(self, pretrained, batch, inputs):
        """Once conditions are cached FlowModule releases ``preprocessing_components``: training (loss and gradient),
        sampling and decoding must still work from the cached conditions alone."""
        adapter = self.adapter_cls.from_pretrained(pretrained, **self.adapter_kwargs)
        for name in adapter.preprocessing_components:
            assert isinstance(getattr(adapter, name, None), torch.nn.Module), f"{name} is not a module of the adapter"
        adapter.requires_grad_(False)
        for network in adapter.denoisers().values():
            network.requires_grad_(True)
        assert adapter.release_preprocessing() == list(adapter.preprocessing_components)
        assert adapter.preprocessing_released
        assert all(getattr(adapter, name) is None for name in adapter.preprocessing_components)
        with encoding_delivered(adapter, batch["target"], "encode_output (in SFTObjective.training_loss)"):
            loss = SFTObjective().training_loss(adapter, batch, torch.Generator().manual_seed(0)).loss
        loss.backward()
        trained = [p for network in adapter.denoisers().values() for p in network.parameters()]
        assert torch.isfinite(loss) and any(p.grad is not None for p in trained)
        condition = adapter.prepare_condition(batch["condition"])
        media = adapter.decode(adapter.sample(condition, num_steps=2, generator=torch.Generator().manual_seed(0)))
        assert len(media) == len(inputs)

    def test_lora_export_is_prefixed_safetensors(self, pretrained, tmp_path):
        adapter = self.adapter_cls.from_pretrained(pretrained, **self.adapter_kwargs)
        apply_lora(adapter, LoRAConfig(rank=2, alpha=6))  # alpha != rank: a file without it loads at scale 1
        state = lora_state_dict(adapter)
        assert state and all("lora_" in k for k in state)
        path = adapter.save_lora(tmp_path / "lora", state, lora_config(adapter))
        saved = load_file(path)
        assert set(saved) == {f"{adapter.lora_prefix}.{k}" for k in state}
        # The peft config round-trips through the header the way diffusers' load_lora_adapter rebuilds it.
        with safe_open(path, framework="pt") as f:
            header = json.loads(f.metadata()[LORA_ADAPTER_METADATA_KEY])
        prefix = f"{adapter.lora_prefix}."
        assert header and all(k.startswith(prefix) for k in header)
        config = LoraConfig(**{k.removeprefix(prefix): v for k, v in header.items()})
        assert (config.r, config.lora_alpha) == (2, 6)
        assert set(config.target_modules) == set(adapter.default_lora_targets)
        # Every trained network gets its own file, named by lora_file (one network: the same single file).
        files = adapter.save_loras(tmp_path / "loras", lora_state_dicts(adapter), lora_configs(adapter))
        assert list(files) == list(adapter.denoisers())
        for network, file in files.items():
            weight_name, key_prefix = adapter.lora_file(network)
            assert file.name == weight_name and file.is_file()
            assert load_file(file) and all(k.startswith(f"{key_prefix}.") for k in load_file(file))
