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

* **plumbing** (always): metadata without weights, registration, stage shapes, seeding, schedule, what trains,
  tensor rows, the condition cache key, releasing preprocessing components, the LoRA file format; frozen components in
  eval mode at any depth (a dropout left on makes conditions random); a contract that accepts negative prompts gives
  a different velocity with CFG on; with :meth:`AdapterConformance.build_trained_checkpoint`, encode -> decode on the
  family's trained tiny VAE round-trips within :attr:`~AdapterConformance.roundtrip_tolerance`.
* **maths** (with :attr:`~AdapterConformance.reference_pipeline`): the family's diffusers pipeline is built from the
  same tiny checkpoint and run from the adapter's own initial noise (:mod:`ff_core.testing.reference`); prompt
  encoding, the sampling sigmas, the training table (``training_sigmas``), one denoiser call at each sigma, a full
  sampling run (with and without CFG; at another embedded guidance), the decoding, the encoding (every latent
  component through the pipeline's own VAE path: the posterior the family's reference trainer takes,
  :attr:`~AdapterConformance.reference_posterior`, normalised as the pipeline's latents are), and the LoRA export
  loaded through ``load_lora_weights`` are compared with tolerances; the denoiser and encoding checks compare every
  latent component (LTX-2's and MiniMax H3's audio too). A failure says what differed, where, and what it looks
  like.

Conditions are built from the adapter's contract (:meth:`AdapterConformance.make_inputs`: the prompts, negative
prompts when the contract takes them, an image per required image slot), batches no larger than its
``max_batch_size``. Override the ``make_*`` and ``reference_*`` methods for what the defaults cannot know (outputs
other than images, pipeline arguments for condition media, a packed latent layout).
"""

from __future__ import annotations

import json
import os
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

from ff_core.adapter import Adapter, Condition, ConditionInput, LatentState, scheduler_sigma_table
from ff_core.contracts import MediaGeometry, MediaType, PipelineIOContract
from ff_core.lora import LoRAConfig, apply_lora, lora_config, lora_configs, lora_state_dict, lora_state_dicts
from ff_core.objectives import SFTObjective
from ff_core.plugins import get_adapter_class
from ff_core.sampling import guided_velocity, guides
from ff_core.testing.reference import (
    LatentLayout,
    PipelineRun,
    check_close,
    condition_differences,
    diagnose_velocity,
    differences,
    first_latents,
    run_pipeline,
    state_tensor,
    velocity_at,
)


class AdapterConformance:
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
    """

    adapter_cls: ClassVar[type[Adapter]]
    adapter_kwargs: ClassVar[dict[str, Any]] = {}
    prompts: ClassVar[tuple[str, ...]] = ("a red circle on a white background", "a blue square")
    negative_prompts: ClassVar[tuple[str, ...]] = ("blurry", "a green triangle")
    reference_pipeline: ClassVar[Any] = None
    reference_layout: ClassVar[LatentLayout] = LatentLayout()
    reference_steps: ClassVar[int] = 3
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

    def make_targets(self, adapter: Adapter, n: int) -> list[list[torch.Tensor]]:
        """Decoded target media per sample, in the contract's output order (default: images at the resolution)."""
        if adapter.io_contract.output_types != (MediaType.IMAGE,):
            raise NotImplementedError("override make_targets for non-image outputs")
        height, width = self._image_size(adapter)
        g = torch.Generator().manual_seed(0)
        return [[torch.randint(0, 256, (3, height, width), generator=g, dtype=torch.uint8)] for _ in range(n)]

    def make_roundtrip_targets(self, adapter: Adapter, n: int, folder: Path) -> list[list[torch.Tensor]]:
        """Media of the trained VAE's domain (default: held-out shapes images at the output geometry)."""
        from ff_core.testing.shapes import write_shapes_dataset
        from ff_core.testing.tiny import load_images

        if adapter.io_contract.output_types != (MediaType.IMAGE,):
            raise NotImplementedError("override make_roundtrip_targets for non-image outputs")
        height, width = self._image_size(adapter)
        root = write_shapes_dataset(folder / "roundtrip-shapes", n_train=n, n_test=6, size=max(height, width),
                                    seed=123)  # fmt: skip
        images = ((load_images(root / "images", max(height, width)) + 1) * 127.5).round().to(torch.uint8)
        return [[img[:, :height, :width]] for img in images]

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
        """The pipeline's CFG argument for ``guidance_scale`` (default ``guidance_scale``; FLUX.1: ``true_cfg_scale``
        with its embedded guidance beside it)."""
        return {"guidance_scale": guidance_scale}

    def reference_component_guidance_kwargs(self, scales: dict[str, float], rescales: dict[str, float]
                                            ) -> dict[str, Any]:  # fmt: skip
        """The pipeline's arguments for per-component CFG ``scales`` and guidance ``rescales``
        (:attr:`reference_component_guidance`; LTX-2: ``guidance_scale`` / ``audio_guidance_scale``,
        ``guidance_rescale`` / ``audio_guidance_rescale``)."""
        raise NotImplementedError(f"{type(self).__name__} sets reference_component_guidance: name the pipeline's "
                                  "arguments in reference_component_guidance_kwargs")  # fmt: skip

    def reference_embedded_guidance_kwargs(self, scale: float) -> dict[str, Any]:
        """The pipeline's argument for the distilled-guidance scale ``scale`` (default ``guidance_scale``, as
        ``FluxPipeline``'s)."""
        return {"guidance_scale": scale}

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

    # -- the maths checks, callable on any adapter (the kit's own tests feed it broken ones) ---------------------
    def run_reference(self, adapter: Adapter, pipe: Any, inputs: list[ConditionInput], *,
                      guidance_scale: float | dict[str, float], embedded_guidance: float | None = None,
                      guidance_rescale: dict[str, float] | None = None) -> ReferenceCase:  # fmt: skip
        """Prepare the adapter's condition and initial noise (seed :attr:`seed`) and run the pipeline from it (with
        the distilled-guidance scale ``embedded_guidance``, :meth:`reference_embedded_guidance_kwargs`; ``None``:
        the pipeline's default; per-component ``guidance_scale`` and ``guidance_rescale`` through
        :meth:`reference_component_guidance_kwargs`)."""
        condition = prepare(adapter, inputs)
        init = adapter.initial_noise(condition, torch.Generator().manual_seed(self.seed))
        per_component = isinstance(guidance_scale, dict) or guidance_rescale is not None
        guidance = (self.reference_component_guidance_kwargs(guidance_scale, guidance_rescale or {}) if per_component
                    else self.reference_guidance_kwargs(guidance_scale))  # fmt: skip
        kwargs = {"prompt": [c.prompt for c in inputs], "output_type": "pt",
                  "generator": torch.Generator().manual_seed(self.seed),
                  **guidance, **self.reference_call_kwargs(adapter, inputs)}
        if embedded_guidance is not None:
            kwargs.update(self.reference_embedded_guidance_kwargs(embedded_guidance))
        if adapter.io_contract.uses_cfg:
            kwargs["negative_prompt"] = [c.negative_prompt or "" for c in inputs]
        layout = self.reference_layout
        run = self.reference_run(pipe, layout.pipeline_latents(pipe, init),
                                 call_latents=layout.call_latents(pipe, init), steps=self.reference_steps,
                                 denoisers=list(adapter.denoisers()), **kwargs)  # fmt: skip
        return ReferenceCase(inputs, condition, init, run, guidance_scale, embedded_guidance, guidance_rescale)

    def check_condition(self, adapter: Adapter, pipe: Any, case: ReferenceCase) -> None:
        """Prompt encoding: the prepared condition against the pipeline's tensors of the same name
        (:meth:`reference_condition`); with negative prompts, the negative branch (``unconditional``) against the
        pipeline's tensors for the negative prompts (a second run that takes them as its prompts)."""
        reference = self.reference_condition(pipe, adapter, case.inputs, case.run)
        common = sorted(set(case.condition) & set(reference))
        assert common, (f"no key of the prepared condition {sorted(case.condition)} is among the pipeline's reference "
                        f"tensors {sorted(reference)}: name them alike or override reference_condition")  # fmt: skip
        problems = condition_differences(case.condition, reference, atol=self.condition_atol, rtol=1e-4)
        assert not problems, (f"prompt encoding differs from {type(pipe).__name__}'s (compared {common}): "
                              + "; ".join(problems))  # fmt: skip
        negative = adapter.unconditional(case.condition) if adapter.io_contract.uses_cfg else None
        if negative is None:
            return
        inputs = [ConditionInput(c.negative_prompt or "", c.negative_prompt, c.media) for c in case.inputs]
        run = self.run_reference(adapter, pipe, inputs, guidance_scale=1.0).run
        reference = self.reference_condition(pipe, adapter, inputs, run)
        common = sorted(set(negative) & set(reference))
        problems = condition_differences(negative, reference, atol=self.condition_atol, rtol=1e-4)
        assert common and not problems, (
            f"the negative branch (unconditional(condition), compared {common}) differs from "
            f"{type(pipe).__name__}'s encoding of the negative prompts: " + "; ".join(problems or ["no common key"]))

    def check_sigmas(self, adapter: Adapter, pipe: Any, case: ReferenceCase) -> None:
        """The sampling schedule: the adapter's noise levels are the pipeline scheduler's."""
        ours = adapter.sampling_schedules(case.init, self.reference_steps)[next(iter(case.init.components))]
        check_close(f"the sampling sigmas of {self.reference_steps} steps ({[round(float(s), 4) for s in ours]})",
                    ours.float().cpu(), case.run.sigmas, atol=1e-5,
                    hint=f"{type(pipe).__name__}'s scheduler steps through "
                         f"{[round(float(s), 4) for s in case.run.sigmas]}: check the schedule's shift.")  # fmt: skip

    def check_training_sigmas(self, adapter: Adapter, pipe: Any, case: ReferenceCase) -> None:
        """``timesteps.schedule: adapter``: the adapter's training table (``training_sigmas``) is the one the
        family's reference training indexes (:meth:`reference_training_sigmas`)."""
        theirs = self.reference_training_sigmas(pipe)
        if theirs is None:
            return
        ours = adapter.training_sigmas(case.init).detach().float().cpu()
        check_close(f"training_sigmas() ({len(ours)} levels, {[round(float(s), 4) for s in ours[:3]]}, ...)", ours,
                    theirs.float().cpu(), atol=1e-5,
                    hint=f"{type(pipe).__name__}'s scheduler, built from its config, holds "
                         f"{[round(float(s), 4) for s in theirs[:3]]}, ...: a scheduler with use_dynamic_shifting "
                         "keeps its table unshifted (return ff_core.adapter.scheduler_sigma_table(scheduler))."
                    )  # fmt: skip

    def check_denoiser(self, adapter: Adapter, pipe: Any, case: ReferenceCase, what: str = "") -> None:
        """One denoiser call at each sigma of the run: ``velocity`` at the pipeline's latents and sigma equals the
        pipeline's Euler update over that step."""
        layout = self.reference_layout
        for k in range(self.reference_steps):
            levels = self.reference_levels(adapter, case, k)
            state = layout.adapter_state(pipe, case.run.latents[k], case.init)
            with torch.no_grad():
                ours = velocity_at(adapter, state, levels, case.condition)
            theirs = layout.adapter_state(pipe, case.run.velocity(k), case.init)
            # Every component: a stream whose output alone is wrong (an audio unpack) leaves the others exact.
            for name, tensor in ours.components.items():
                problem = differences(tensor, theirs.components[name], atol=self.velocity_atol,
                                      rtol=self.velocity_atol * 10, mask=case.init.masks.get(name))  # fmt: skip
                if problem is None:
                    continue
                sigma = levels[name] if isinstance(levels, dict) else levels
                why = diagnose_velocity(pipe, case.run, k, tensor, theirs.components[name], layout, case.init,
                                        atol=self.velocity_atol, component=name)  # fmt: skip
                raise AssertionError(
                    f"velocity{what} at sigma {sigma:.4g} (step {k} of {self.reference_steps}) differs from "
                    f"{type(pipe).__name__}'s denoiser step at the same latents, component {name!r}: {problem}. {why}"
                )

    def check_sampling(self, adapter: Adapter, pipe: Any, case: ReferenceCase) -> None:
        """A full sampling run from the same seed: the adapter's final latents are the pipeline's."""
        generator = torch.Generator().manual_seed(self.seed)
        # guidance_rescale only when set: a sample() written before interface 1.4 may not take it (FlowModule alike).
        rescale = {"guidance_rescale": case.guidance_rescale} if case.guidance_rescale else {}
        final = adapter.sample(case.condition, num_steps=self.reference_steps, guidance_scale=case.guidance_scale,
                               generator=generator, embedded_guidance=case.embedded_guidance, **rescale)  # fmt: skip
        theirs = self.reference_layout.adapter_state(pipe, case.run.latents[-1], case.init)
        hint, what = "", ""
        if case.guidance_rescale:
            what = f" and guidance rescale {case.guidance_rescale}"
        if guides(case.guidance_scale) and adapter.unconditional(case.condition) is None:
            hint = "The adapter has no negative branch (unconditional() is None): CFG was skipped."
        if case.embedded_guidance is not None:
            what = f" and embedded guidance {case.embedded_guidance:g}"
            default = adapter.sample(case.condition, num_steps=self.reference_steps,
                                     guidance_scale=case.guidance_scale,
                                     generator=torch.Generator().manual_seed(self.seed))  # fmt: skip
            if all(torch.equal(t, default.components[n]) for n, t in final.components.items()):
                hint = (f"The adapter's result is the one at its default embedded guidance "
                        f"({adapter.embedded_guidance:g}): velocity ignores the condition's embedded guidance "
                        "(with_embedded_guidance sets condition['embedded_guidance']).")  # fmt: skip
        for name, tensor in final.components.items():
            check_close(f"the final {name!r} latents of {self.reference_steps}-step sampling at guidance "
                        f"{case.guidance_scale}{what}", tensor, theirs.components[name], atol=self.sample_atol,
                        rtol=self.sample_atol, mask=case.init.masks.get(name), hint=hint)  # fmt: skip

    def check_component_guidance(self, adapter: Adapter, pipe: Any, inputs: list[ConditionInput]) -> None:
        """Per-component CFG scales and guidance rescales (:attr:`reference_component_guidance`): a sampling run gives
        the pipeline's final latents at the same settings (:meth:`reference_component_guidance_kwargs`)."""
        scales, rescales = self.reference_component_guidance
        self.check_sampling(adapter, pipe, self.run_reference(adapter, pipe, inputs, guidance_scale=dict(scales),
                                                              guidance_rescale=dict(rescales)))  # fmt: skip

    def check_embedded_guidance(self, adapter: Adapter, pipe: Any, case: ReferenceCase) -> None:
        """Embedded (distilled) guidance, for an adapter with a default (:attr:`Adapter.embedded_guidance`): sampling
        with ``embedded_guidance=g`` at a scale other than the default (:attr:`reference_embedded_guidance`) gives
        the pipeline's final latents at that scale (:meth:`reference_embedded_guidance_kwargs`)."""
        if adapter.embedded_guidance is None:
            return
        scale = self.reference_embedded_guidance
        scale = scale + 1 if scale == adapter.embedded_guidance else scale
        self.check_sampling(adapter, pipe, self.run_reference(adapter, pipe, case.inputs, guidance_scale=1.0,
                                                              embedded_guidance=scale))  # fmt: skip

    def check_decoding(self, adapter: Adapter, pipe: Any, case: ReferenceCase) -> None:
        """Decoding the pipeline's final latents gives the pipeline's media (images and videos to uint8 rounding,
        audio waveforms to :attr:`audio_atol`)."""
        final = self.reference_layout.adapter_state(pipe, case.run.latents[-1], case.init)
        ours = adapter.decode(final)
        theirs = self.reference_media(adapter, case.run.output)
        kinds = adapter.io_contract.output_types
        for i, (a, b) in enumerate(zip(ours, theirs)):
            for j, (x, y) in enumerate(zip(a, b)):
                audio = kinds[j] is MediaType.AUDIO
                units, atol = ("waveform", self.audio_atol) if audio else ("uint8 units", self.media_atol)
                check_close(f"decoded output {j} of sample {i} ({units})", x.float(), y, atol=atol,
                            hint="The latents were the pipeline's, so decode differs: check the VAE latent "
                                 "normalisation (shift / scaling factors, latents_mean / latents_std) and the pixel "
                                 "range.")  # fmt: skip

    def check_encoding(self, adapter: Adapter, pipe: Any, case: ReferenceCase) -> None:
        """Encoding: ``encode_output`` of the targets (:meth:`make_targets`) with a seeded generator gives, in every
        latent component, the latents of the pipeline's own VAE path (:meth:`reference_encode`: the posterior the
        reference trainer takes, :attr:`reference_posterior`, a sample from the same generator or the mode,
        normalised as the pipeline's latents are). No trained VAE needed: a random one with a non-identity
        normalisation tells an ``encode_output`` that skips it (the decoding check sees only ``decode``'s side), and
        its posterior's spread tells a sample from the mode."""
        targets = self.make_targets(adapter, len(case.inputs))
        with torch.no_grad():
            ours = adapter.encode_output(targets, case.condition, generator=torch.Generator().manual_seed(self.seed))
            theirs = self.reference_encode(pipe, adapter, targets, torch.Generator().manual_seed(self.seed))
        if isinstance(theirs, Tensor):
            if len(ours.components) != 1:
                raise AssertionError(f"reference_encode gives one tensor, encode_output gives the components "
                                     f"{list(ours.components)}: return every component by name")  # fmt: skip
            theirs = {next(iter(ours.components)): theirs}
        missing = set(ours.components) ^ set(theirs)
        if missing:
            raise AssertionError(f"encode_output gives the components {list(ours.components)}, reference_encode "
                                 f"{list(theirs)}: every component is compared")  # fmt: skip
        posterior = ("sample drawn from the same generator" if self.reference_posterior == "sample"
                     else "mode (latent_dist.mode())")  # fmt: skip
        for name, tensor in ours.components.items():
            check_close(f"encode_output's clean {name!r} latents", tensor.float().cpu(), theirs[name].float().cpu(),
                        atol=self.encode_atol, rtol=self.encode_atol, mask=ours.masks.get(name),
                        hint=f"The reference is {type(pipe).__name__}'s VAE path taking the posterior's "
                             f"{posterior}, as the reference trainer does: check encode_output takes the same "
                             "posterior latent, applies the VAE's latent normalisation (shift / scaling factors, "
                             "latents_mean / latents_std) as decode inverts it, and the pipeline's pixel range / "
                             "audio preprocessing.")  # fmt: skip

    def check_cfg(self, adapter: Adapter, inputs: list[ConditionInput]) -> None:
        """A contract that accepts negative prompts has a negative branch, and CFG on changes the velocity."""
        if not adapter.io_contract.uses_cfg:
            return
        condition = prepare(adapter, inputs)
        negative = adapter.unconditional(condition)
        name = type(adapter).__name__
        assert negative is not None, (
            f"{name}.io_contract accepts negative prompts (negative_prompt=allowed) but unconditional(condition) "
            "returns None: sampling silently skips classifier-free guidance. Return the negative branch, or declare "
            "negative_prompt=NegativePrompt.REJECTED."
        )
        state = adapter.initial_noise(condition, torch.Generator().manual_seed(0))
        with torch.no_grad():
            plain = state_tensor(velocity_at(adapter, state, 0.7, condition))
            guided = state_tensor(guided_velocity(adapter, state, 0.7, condition, negative, self.reference_guidance))
        assert differences(guided, plain, atol=1e-6, rtol=0) is not None, (
            f"{name}: the velocity with CFG on (scale {self.reference_guidance:g}) equals the one with CFG off: the "
            "negative branch from unconditional() gives the positive condition's velocity (negative prompts unused?)"
        )

    def check_frozen_in_eval(self, adapter: Adapter, when: str) -> None:
        """Every module outside the trained networks is in eval mode, however deeply nested (leaf modules: what
        dropout and normalisation read)."""
        left = frozen_in_train_mode(adapter)
        under = ".".join(os.path.commonprefix([n.split(".") for n in left])) if left else ""
        assert not left, (
            f"{type(adapter).__name__} {when}: {len(left)} frozen module(s) outside the trained networks are in train "
            f"mode{f' under {under!r}' if under else ''} (dropout would randomise the conditions they compute): "
            f"{', '.join(left[:6])}"
            + (", ..." if len(left) > 6 else "") + ". Call .eval() on frozen components, wherever they are nested."
        )

    def check_preprocess_is_deterministic(self, adapter: Adapter, inputs: list[ConditionInput]) -> None:
        a, b = adapter.preprocess(inputs), adapter.preprocess(inputs)
        for i, (x, y) in enumerate(zip(a, b)):
            for key in x:
                assert torch.equal(x[key], y[key]), (
                    f"{type(adapter).__name__}.preprocess gives different {key!r} for sample {i} on a second call with "
                    "the same inputs: a frozen component in train mode (dropout)?"
                )

    def check_roundtrip(self, adapter: Adapter, inputs: list[ConditionInput], folder: Path) -> None:
        """encode -> decode on the trained tiny VAE within :attr:`roundtrip_tolerance` (mean, uint8 units)."""
        targets = self.make_roundtrip_targets(adapter, len(inputs), folder)
        condition = prepare(adapter, inputs)
        with torch.no_grad():
            clean = adapter.encode_output(targets, condition, generator=torch.Generator().manual_seed(0))
            media = adapter.decode(clean)
        for i, (ours, target) in enumerate(zip(media, targets)):
            for j, (x, y) in enumerate(zip(ours, target)):
                error = float((x.float() - y.float()).abs().mean())
                assert error <= self.roundtrip_tolerance, (
                    f"encode_output -> decode round trip of output {j} of sample {i} on the trained tiny VAE: mean "
                    f"|decoded - target| = {error:.1f} > {self.roundtrip_tolerance:g} (uint8 units): encode_output "
                    "and decode do not invert each other (VAE latent normalisation, pixel range [-1, 1])"
                )

    def check_lora_in_pipeline(self, pretrained: Path, inputs: list[ConditionInput], folder: Path,
                               adapter: Adapter | None = None) -> None:  # fmt: skip
        """A LoRA (random ``lora_B``: as if trained) exported by the adapter and loaded into the pipeline through
        ``load_lora_weights`` gives the adapter's denoiser calls, and changes them."""
        adapter = adapter or self.adapter_cls.from_pretrained(pretrained, **self.adapter_kwargs)
        apply_lora(adapter, LoRAConfig(rank=2, alpha=6))  # alpha != rank: a loader that drops alpha is caught
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in adapter.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        files = adapter.save_loras(folder, lora_state_dicts(adapter), lora_configs(adapter))
        pipe = self.load_reference_pipeline(pretrained)
        self.load_reference_lora(pipe, adapter, folder, files)
        case = self.run_reference(adapter, pipe, inputs, guidance_scale=1.0)
        self.check_denoiser(adapter, pipe, case, what=" with the exported LoRA loaded through load_lora_weights")
        base = self.run_reference(adapter, self.load_reference_pipeline(pretrained), inputs, guidance_scale=1.0)
        assert differences(first_latents(case.run.velocity(0)), first_latents(base.run.velocity(0)), atol=1e-4,
                           rtol=0) is not None, (  # fmt: skip
            f"the exported LoRA ({sorted(p.name for p in files.values())}) changes nothing in "
            f"{type(pipe).__name__} after load_lora_weights: its keys or prefix ({adapter.lora_prefix!r}) match no "
            "module"
        )

    def run_checks(self, adapter: Adapter, pretrained: Path, folder: Path, pipe: Any = None) -> dict[str, str]:
        """Every check of this kit that takes an adapter, run on ``adapter`` (loaded from ``pretrained``; ``pipe``:
        the reference pipeline, ``None`` for the plumbing ones only); returns each failed check's message by name.
        For debugging an adapter outside pytest, and for testing the kit itself on broken adapters."""
        inputs = self.make_inputs(adapter, folder)
        checks = {
            "frozen_in_eval": lambda: self.check_frozen_in_eval(adapter, "after from_pretrained"),
            "preprocess_deterministic": lambda: self.check_preprocess_is_deterministic(adapter, inputs),
            "cfg": lambda: self.check_cfg(adapter, inputs),
        }
        if pipe is not None:
            case = self.run_reference(adapter, pipe, inputs, guidance_scale=1.0)
            checks.update({
                "prompt_encoding": lambda: self.check_condition(adapter, pipe, case),
                "sampling_sigmas": lambda: self.check_sigmas(adapter, pipe, case),
                "training_sigmas": lambda: self.check_training_sigmas(adapter, pipe, case),
                "denoiser": lambda: self.check_denoiser(adapter, pipe, case),
                "sampling": lambda: self.check_sampling(adapter, pipe, case),
                "decoding": lambda: self.check_decoding(adapter, pipe, case),
                "encoding": lambda: self.check_encoding(adapter, pipe, case),
                "embedded_guidance": lambda: self.check_embedded_guidance(adapter, pipe, case),
            })  # fmt: skip
            if adapter.io_contract.uses_cfg:
                checks["sampling_with_cfg"] = lambda: self.check_sampling(
                    adapter, pipe, self.run_reference(adapter, pipe, inputs, guidance_scale=self.reference_guidance))
            if adapter.io_contract.uses_cfg and self.reference_component_guidance is not None:
                checks["sampling_with_component_guidance"] = lambda: self.check_component_guidance(adapter, pipe,
                                                                                                   inputs)
            checks["lora"] = lambda: self.check_lora_in_pipeline(
                pretrained, inputs, folder / "lora", type(adapter).from_pretrained(pretrained, **self.adapter_kwargs))
        checks["frozen_in_eval_after_train"] = lambda: self.check_frozen_in_eval(adapter.train(), "after .train()")
        failed = {}
        for name, check in checks.items():
            try:
                check()
            except AssertionError as exc:
                failed[name] = str(exc).split("\nassert ")[0]  # the message, without pytest's rewritten operands
        adapter.eval()
        return failed

    # -- private helpers ------------------------------------------------------------------------------------------
    @staticmethod
    def _image_size(adapter: Adapter) -> tuple[int, int]:
        (geometry, *_) = adapter.output_geometry()
        if geometry is not None:
            return geometry.height, geometry.width
        size = getattr(adapter, "resolution")
        return size, size

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

    def test_stages_agree_on_latent_geometry(self, adapter, batch, inputs):
        condition = adapter.prepare_condition(batch["condition"])
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
        media = adapter.decode(adapter.encode_output(batch["target"], condition))
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


class ReferenceCase:
    """One reference run and the adapter-side state it started from.

    Args:
        inputs: the condition inputs.
        condition: the adapter's prepared condition of them.
        init: the adapter's initial noise (seeded), the run's initial latents.
        run: the recorded pipeline run.
        guidance_scale: the CFG scale of the run (one, or per latent component).
        embedded_guidance: its distilled-guidance scale; ``None``: the pipeline's and the adapter's defaults.
        guidance_rescale: its guidance rescale per latent component; ``None``: off.
    """

    def __init__(self, inputs: list[ConditionInput], condition: Condition, init: LatentState, run: PipelineRun,
                 guidance_scale: float | dict[str, float], embedded_guidance: float | None = None,
                 guidance_rescale: dict[str, float] | None = None) -> None:  # fmt: skip
        self.inputs, self.condition, self.init, self.run = inputs, condition, init, run
        self.guidance_scale, self.embedded_guidance = guidance_scale, embedded_guidance
        self.guidance_rescale = guidance_rescale


def prepare(adapter: Adapter, inputs: list[ConditionInput]) -> Condition:
    """The adapter's prepared condition of ``inputs`` (preprocess, collate, prepare_condition)."""
    return adapter.prepare_condition(default_collate(adapter.preprocess(inputs)))


POSTERIORS = ("mode", "sample")
"""How target latents are taken from a VAE posterior: its mode (mean) or a sample from the training generator."""


def vae_posterior(vae: Any, media: list[list[Tensor]], posterior: str,
                  generator: torch.Generator | None = None) -> Tensor:  # fmt: skip
    """``vae.encode(x).latent_dist.mode()`` (``posterior="mode"``) or ``.sample(generator)`` (``"sample"``) of each
    sample's first output as one batch: uint8 images (3, H, W) or videos (F, 3, H, W, ff's media layout; the VAE takes
    (B, 3, F, H, W)), scaled to [-1, 1]."""
    if posterior not in POSTERIORS:
        raise ValueError(f"posterior must be one of {POSTERIORS}, got {posterior!r}")
    x = torch.stack([outputs[0] for outputs in media]).float() / 127.5 - 1
    if x.ndim == 5:
        x = x.permute(0, 2, 1, 3, 4)
    param = next(vae.parameters())
    dist = vae.encode(x.to(param.device, param.dtype)).latent_dist
    return dist.mode() if posterior == "mode" else dist.sample(generator=generator)


def vae_posterior_sample(vae: Any, media: list[list[Tensor]], generator: torch.Generator) -> Tensor:
    """:func:`vae_posterior` with ``posterior="sample"``."""
    return vae_posterior(vae, media, "sample", generator)


def frozen_in_train_mode(adapter: Adapter) -> list[str]:
    """Names of the leaf modules outside every trained network (``denoisers()``) that are in train mode."""
    inside = {id(m) for network in adapter.denoisers().values() for m in network.modules()}
    # Components taken out of the module tree (Adapter.detach_frozen, under a sharding strategy) still run.
    named = [*adapter.named_modules(), *((f"{detached}.{name}".rstrip("."), m)
             for detached, module in adapter.detached_modules().items() for name, m in module.named_modules())]
    return [name for name, m in named
            if name and id(m) not in inside and not list(m.children()) and m.training]  # fmt: skip
