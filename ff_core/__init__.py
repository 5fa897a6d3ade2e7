"""ff: post-training of flow-matching generative models on Lightning."""

__version__ = "0.1.0"

ADAPTER_INTERFACE_VERSION = "1.9"
"""The version (``major.minor``) of the adapter interface this ff-core provides (:class:`ff_core.adapter.Adapter`, its
stage methods and class attributes, the hooks of :mod:`ff_core.hookspecs`). A plugin declares the version it targets
(:attr:`ff_core.adapter.Adapter.interface_version` or the ``ff_adapter_interface_version`` hook); ff refuses a plugin
that targets another major version or a newer minor one (:func:`ff_core.plugins.interface_problem`). Additions that
existing adapters need not implement bump the minor; a change that breaks an existing adapter bumps the major.

1.1: embedded (distilled) guidance (``Adapter.embedded_guidance``, ``with_embedded_guidance``), sampling sigmas for the
initial noise's geometry (``sampling_sigmas(..., state=)``), the training table ``training_sigmas``.
1.2: ``Adapter.component_parameters`` (``model.frozen_components``), ``default_component_weights``.
1.3: ``Adapter.component_velocity``: the velocity with each latent component at its own noise level (sampling and GRPO
replays call it when components step on their own schedules).
1.4: checks before weights load: ``Adapter.latent_components`` (per-component config keys), ``check_adapter_kwargs``,
``resolve_output_geometry`` (target spans from headers), ``check_bucket`` (``data.buckets``); ``sample``'s
``guidance_rescale`` (``FlowModule`` passes it only when a run rescales: an older ``sample`` override still works);
``Adapter.timestep_shifts`` (training draws one level per component on its own shift, as sampling steps them).
1.5: evaluation samples with the checkpoint's own scheduler (``Adapter.sampling_schedulers``, default: the adapter's
``scheduler`` unless it is an Euler one; ``sample``'s ``scheduler``), and ``Adapter.uses_second_expert`` with
``sample``'s ``guidance_scale_2`` (a two-expert checkpoint's low-noise CFG scale); ``FlowModule`` passes either only
when set.
1.8: ``Adapter.io_contract_variants`` (the contracts of a family's checkpoint variants, read without a checkpoint).
1.9: ``Adapter.clip_defaults`` (:class:`ff_core.contracts.ClipDefaults`: a video family's default canvas, frame count
and rate, declared once) and ``Adapter.resolve_clip``, which ``check_adapter_kwargs`` and ``resolve_output_geometry``
read by default.

Registration checks the stage methods besides the version (:func:`ff_core.plugins.stage_problem`): an override that
cannot take an argument the base passes is refused, so an adapter written to an older minor keeps working or is
refused in one line, never failing inside training."""

from ff_core import moved as _moved  # noqa: E402 - after the constants above, which plugins read first

_moved.install()  # old module paths (before the data layer's folders) keep importing: ff_core/moved.py
