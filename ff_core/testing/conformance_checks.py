"""The conformance kit's checks: each one compares an adapter with ff's contract or its family's diffusers pipeline
and raises :class:`AssertionError` saying what differed, where, and what it looks like.

:class:`ConformanceChecks` is the half of :class:`~ff_core.testing.conformance.AdapterConformance` that does the work
(the kit's own tests call the checks on deliberately broken adapters); the other half declares the hooks a plugin
author overrides, the fixtures and the pytest tests that call these checks.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import default_collate

from ff_core.adapter import Adapter, Condition, ConditionInput, LatentState
from ff_core.contracts import MediaType
from ff_core.lora import LoRAConfig, apply_lora, lora_configs, lora_state_dicts
from ff_core.objectives import SFTObjective
from ff_core.sampling import guided_velocity, guides
from ff_core.testing.conformance_targets import describe_targets, encoding_delivered, media_tensor
from ff_core.testing.reference import (
    PipelineRun,
    check_close,
    condition_differences,
    denoiser_guidance,
    diagnose_velocity,
    differences,
    first_latents,
    state_tensor,
    velocity_at,
)


class ConformanceChecks:
    """The checks of the conformance kit, on any adapter; the hooks they call (``make_*``, ``reference_*``, settings)
    are :class:`~ff_core.testing.conformance.AdapterConformance`'s."""

    def run_reference(self, adapter: Adapter, pipe: Any, inputs: list[ConditionInput], *,
                      guidance_scale: float | dict[str, float], embedded_guidance: float | None = None,
                      guidance_rescale: dict[str, float] | None = None) -> ReferenceCase:  # fmt: skip
        """Prepare the adapter's condition and initial noise (seed :attr:`seed`) and run the pipeline from it, with the
        guidance arguments :meth:`reference_guidance_arguments` maps ff's scales to (``embedded_guidance``: the
        distilled-guidance scale; ``None``: the adapter's default; per-component ``guidance_scale`` and
        ``guidance_rescale`` through :meth:`reference_component_guidance_kwargs`)."""
        scales = (guidance_scale, embedded_guidance, guidance_rescale)
        cfg, embedded = self.reference_guidance_arguments(adapter, pipe, *scales)
        condition = prepare(adapter, inputs)
        init = adapter.initial_noise(condition, torch.Generator().manual_seed(self.seed))
        kwargs = {"prompt": [c.prompt for c in inputs], "output_type": "pt",
                  "generator": torch.Generator().manual_seed(self.seed),
                  **cfg, **embedded, **self.reference_call_kwargs(adapter, inputs)}  # fmt: skip
        if adapter.io_contract.uses_cfg:
            kwargs["negative_prompt"] = [c.negative_prompt or "" for c in inputs]
        layout = self.reference_layout
        run = self.reference_run(pipe, layout.pipeline_latents(pipe, init),
                                 call_latents=layout.call_latents(pipe, init), steps=self.reference_steps,
                                 denoisers=list(adapter.denoisers()), **kwargs)  # fmt: skip
        note = guidance_note(pipe, guidance_scale, cfg, embedded, run)
        return ReferenceCase(inputs, condition, init, run, guidance_scale, embedded_guidance, guidance_rescale, note)

    def reference_guidance_arguments(self, adapter: Adapter, pipe: Any, guidance_scale: float | dict[str, float],
                                     embedded_guidance: float | None = None,
                                     guidance_rescale: dict[str, float] | None = None,
                                     ) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
        """The pipeline's guidance arguments of one reference run, ``(CFG arguments, embedded-guidance arguments)``,
        each ff scale on the argument declared for it:

        * ff's CFG scale (``model.sampling.guidance_scale``: two velocities combined, the negative branch from
          ``unconditional``) on :attr:`reference_cfg_argument` (:meth:`reference_guidance_kwargs`; per component:
          :meth:`reference_component_guidance_kwargs`);
        * for an adapter with a guidance-embedded denoiser (``embedded_guidance`` not ``None``), the distilled scale
          (``embedded_guidance``, else the adapter's default, passed explicitly: never the two sides' defaults) on
          :attr:`reference_embedded_guidance_argument` (:meth:`reference_embedded_guidance_kwargs`).

        Refused with a message saying which scale went to which argument: a guidance-embedded adapter whose pipeline
        argument for the embedded guidance is not declared (FLUX.1's and HunyuanVideo's ``guidance_scale`` is the
        embedded guidance: mapping ff's CFG onto it conditions the pipeline's denoiser on the CFG scale), one argument
        declared for both, and an argument the pipeline's ``__call__`` does not take."""
        per_component = isinstance(guidance_scale, dict) or guidance_rescale is not None
        cfg = (self.reference_component_guidance_kwargs(guidance_scale, guidance_rescale or {}) if per_component
               else self.reference_guidance_kwargs(guidance_scale))  # fmt: skip
        pipeline, adapter_name = type(pipe).__name__, type(adapter).__name__
        where = _arguments(cfg)
        embedded: dict[str, Any] = {}
        if adapter.embedded_guidance is not None:
            scale = adapter.embedded_guidance if embedded_guidance is None else embedded_guidance
            embedded = self.reference_embedded_guidance_kwargs(scale)
            if not embedded:
                raise AssertionError(
                    f"{adapter_name} has a guidance-embedded denoiser (embedded_guidance {adapter.embedded_guidance:g})"
                    f", but the kit names no {pipeline} argument for the embedded guidance "
                    f"(reference_embedded_guidance_argument is None), while ff's CFG scale {_scale(guidance_scale)} "
                    f"goes to {where} (reference_cfg_argument). In a guidance-distilled pipeline (FLUX.1, "
                    "HunyuanVideo) `guidance_scale` is the embedded guidance and true CFG is `true_cfg_scale`: declare "
                    "both, reference_cfg_argument = 'true_cfg_scale' and reference_embedded_guidance_argument = "
                    f"'guidance_scale' (or what {pipeline} calls them; reference_cfg_argument = None if it has no CFG)."
                )
            shared = sorted(set(cfg) & set(embedded))
            if shared:
                raise AssertionError(
                    f"ambiguous guidance mapping: ff's CFG scale {_scale(guidance_scale)} (reference_cfg_argument) and "
                    f"{adapter_name}'s embedded guidance {scale:g} (reference_embedded_guidance_argument) both go to "
                    f"{pipeline}'s {', '.join(shared)}: one argument cannot carry both. Name the pipeline's true-CFG "
                    "argument in reference_cfg_argument (FLUX.1: 'true_cfg_scale'; None if it has none) and its "
                    "embedded-guidance argument in reference_embedded_guidance_argument (FLUX.1, HunyuanVideo: "
                    "'guidance_scale')."
                )
        unknown = _unknown_arguments(pipe, [*cfg, *embedded])
        if unknown:
            also = f", the embedded guidance to {_arguments(embedded)}" if embedded else ""
            raise AssertionError(
                f"{pipeline}.__call__ takes no {', '.join(unknown)}: ff's CFG scale {_scale(guidance_scale)} was to go "
                f"to {where}{also}. Its guidance arguments: {', '.join(_guidance_parameters(pipe)) or 'none'} (set "
                "reference_cfg_argument / reference_embedded_guidance_argument)."
            )
        return cfg, embedded

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
                    f"{type(pipe).__name__}'s denoiser step at the same latents, component {name!r}: {problem}. {why} "
                    f"{case.guidance_note}".rstrip()
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
                        rtol=self.sample_atol, mask=case.init.masks.get(name),
                        hint=f"{hint} {case.guidance_note}".strip())  # fmt: skip

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
        """Encoding: ``encode_output`` of the targets (:meth:`make_targets`: what training's loader delivers, decoded
        from real files) with a seeded generator gives, in every latent component, the latents of the pipeline's own
        VAE path (:meth:`reference_encode`: the posterior the reference trainer takes, :attr:`reference_posterior`, a
        sample from the same generator or the mode, normalised as the pipeline's latents are). No trained VAE needed:
        a random one with a non-identity normalisation tells an ``encode_output`` that skips it (the decoding check
        sees only ``decode``'s side), and its posterior's spread tells a sample from the mode."""
        targets = self.make_targets(adapter, len(case.inputs))
        with torch.no_grad(), encoding_delivered(adapter, targets):
            ours = adapter.encode_output(targets, case.condition, generator=torch.Generator().manual_seed(self.seed))
        with torch.no_grad():
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
        """encode -> decode on the trained tiny VAE within :attr:`roundtrip_tolerance` (mean, uint8 units), images and
        videos (:meth:`make_roundtrip_targets`, decoded as training decodes them)."""
        targets = self.make_roundtrip_targets(adapter, len(inputs), folder)
        condition = prepare(adapter, inputs)
        with torch.no_grad(), encoding_delivered(adapter, targets):
            clean = adapter.encode_output(targets, condition, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            media = adapter.decode(clean)
        kinds = adapter.io_contract.output_types
        for i, (ours, target) in enumerate(zip(media, targets)):
            for j, (x, y) in enumerate(zip(ours, target)):
                if kinds[j] is MediaType.AUDIO:  # uint8 units: pictures only (an audio target is at its file's rate)
                    continue
                error = float((x.float() - media_tensor(y).float()).abs().mean())
                assert error <= self.roundtrip_tolerance, (
                    f"encode_output -> decode round trip of output {j} of sample {i} on the trained tiny VAE: mean "
                    f"|decoded - target| = {error:.1f} > {self.roundtrip_tolerance:g} (uint8 units): encode_output "
                    "and decode do not invert each other (VAE latent normalisation, pixel range [-1, 1])"
                )

    def check_training_targets(self, adapter: Adapter, inputs: list[ConditionInput]) -> None:
        """``encode_output`` takes the targets ``ff fit``'s loader delivers (real files decoded by the loader's code,
        :mod:`~ff_core.testing.conformance_targets`; never a plugin's :meth:`make_targets` override, which older kits
        wrote as tensors), giving one clean latent per sample, and an SFT loss on them is finite: an adapter written for
        another form fails here, naming the form it was given, instead of at the first training step."""
        targets = self._loader_targets(adapter, len(inputs), "random", seed=0)
        condition = prepare(adapter, inputs)
        with torch.no_grad(), encoding_delivered(adapter, targets):
            clean = adapter.encode_output(targets, condition, generator=torch.Generator().manual_seed(0))
        assert isinstance(clean, LatentState) and clean.batch_size == len(inputs), (
            f"{type(adapter).__name__}.encode_output of {describe_targets(targets)} gives {type(clean).__name__} "
            f"of batch size {getattr(clean, 'batch_size', '?')}, expected a LatentState of {len(inputs)}"
        )
        batch = {"condition": default_collate(adapter.preprocess(inputs)), "target": targets}
        with torch.no_grad(), encoding_delivered(adapter, targets, "encode_output (in SFTObjective.training_loss)"):
            loss = SFTObjective().training_loss(adapter, batch, torch.Generator().manual_seed(0)).loss
        assert torch.isfinite(loss), f"the SFT loss on {describe_targets(targets)} is {float(loss)}"

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
            "training_targets": lambda: self.check_training_targets(adapter, inputs),
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



class ReferenceCase:
    """One reference run and the adapter-side state it started from.

    Args:
        inputs: the condition inputs.
        condition: the adapter's prepared condition of them.
        init: the adapter's initial noise (seeded), the run's initial latents.
        run: the recorded pipeline run.
        guidance_scale: the CFG scale of the run (one, or per latent component).
        embedded_guidance: its distilled-guidance scale; ``None``: the adapter's default (passed to the pipeline).
        guidance_rescale: its guidance rescale per latent component; ``None``: off.
        guidance_note: which pipeline argument each ff scale went to, and the guidance input its denoiser received
            (:func:`guidance_note`), for failure messages.
    """

    def __init__(self, inputs: list[ConditionInput], condition: Condition, init: LatentState, run: PipelineRun,
                 guidance_scale: float | dict[str, float], embedded_guidance: float | None = None,
                 guidance_rescale: dict[str, float] | None = None, guidance_note: str = "") -> None:  # fmt: skip
        self.inputs, self.condition, self.init, self.run = inputs, condition, init, run
        self.guidance_scale, self.embedded_guidance = guidance_scale, embedded_guidance
        self.guidance_rescale, self.guidance_note = guidance_rescale, guidance_note


def prepare(adapter: Adapter, inputs: list[ConditionInput]) -> Condition:
    """The adapter's prepared condition of ``inputs`` (preprocess, collate, prepare_condition)."""
    return adapter.prepare_condition(default_collate(adapter.preprocess(inputs)))


def guidance_note(pipe: Any, guidance_scale: float | dict[str, float], cfg: dict[str, Any], embedded: dict[str, Any],
                  run: PipelineRun) -> str:  # fmt: skip
    """Where each ff scale went in one reference run (``cfg``, ``embedded``: :meth:`ConformanceChecks.
    reference_guidance_arguments`' result) and the guidance input the pipeline's denoiser received: a scale on the wrong
    argument looks like a wrong denoiser, so the denoiser and sampling checks' failures say it."""
    note = f"Guidance: ff's CFG scale {_scale(guidance_scale)} went to {type(pipe).__name__}'s {_arguments(cfg)}"
    if embedded:
        note += f", the embedded guidance to {_arguments(embedded)}"
    received = denoiser_guidance(run)
    if received:
        note += "; its denoiser received " + ", ".join(f"{k}={v:g}" for k, v in received.items())
    return note + "."


def _scale(scale: float | dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in scale.items()) if isinstance(scale, dict) else f"{scale:g}"


def _arguments(kwargs: dict[str, Any]) -> str:
    """``guidance_scale=4, audio_guidance_scale=4`` (``no argument`` when empty)."""
    return ", ".join(f"{k}={v:g}" if isinstance(v, (int, float)) else f"{k}={v!r}" for k, v in kwargs.items()
                     ) or "no argument"  # fmt: skip


def _call_parameters(pipe: Any) -> dict[str, inspect.Parameter] | None:
    """The named parameters of ``pipe.__call__``; ``None`` when it takes ``**kwargs`` (any name goes)."""
    params = inspect.signature(pipe.__call__).parameters
    return None if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) else dict(params)


def _unknown_arguments(pipe: Any, names: list[str]) -> list[str]:
    params = _call_parameters(pipe)
    return [] if params is None else [n for n in names if n not in params]


def _guidance_parameters(pipe: Any) -> list[str]:
    return [n for n in _call_parameters(pipe) or {} if "guidance" in n or "cfg" in n]


POSTERIORS = ("mode", "sample")
"""How target latents are taken from a VAE posterior: its mode (mean) or a sample from the training generator."""


def vae_posterior(vae: Any, media: list[list[Tensor]], posterior: str,
                  generator: torch.Generator | None = None) -> Tensor:  # fmt: skip
    """``vae.encode(x).latent_dist.mode()`` (``posterior="mode"``) or ``.sample(generator)`` (``"sample"``) of each
    sample's first output as one batch: uint8 images (3, H, W) or videos (a ``DecodedVideo``, as training delivers it,
    or frames (F, 3, H, W); :func:`~ff_core.testing.conformance_targets.media_tensor`; the VAE takes (B, 3, F, H, W)),
    scaled to [-1, 1]."""
    if posterior not in POSTERIORS:
        raise ValueError(f"posterior must be one of {POSTERIORS}, got {posterior!r}")
    x = torch.stack([media_tensor(outputs[0]) for outputs in media]).float() / 127.5 - 1
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
