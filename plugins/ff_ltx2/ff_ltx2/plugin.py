"""Entry point module of ff-ltx2 (``[project.entry-points.ff] ltx2 = "ff_ltx2.plugin"``)."""

from __future__ import annotations

from ff_core.hookspecs import hookimpl


@hookimpl
def ff_adapters():
    """The LTX-2 adapter classes; importing them loads no weights."""
    from ff_ltx2.adapter import LTX2T2AVAdapter
    from ff_ltx2.i2av import LTX2I2AVAdapter

    return [LTX2T2AVAdapter, LTX2I2AVAdapter]


@hookimpl
def ff_adapter_interface_version():
    """The ff adapter-interface version the adapters are written for (``ff_core.ADAPTER_INTERFACE_VERSION``)."""
    # 1.2: component_parameters, default_component_weights; 1.4: checks before weights load; 1.6: context_parallel_plan;
    # 1.7: resolve_bucket_geometry, training_kwargs; 1.9: clip_defaults, resolve_clip
    return "1.9"
