"""Entry point module of ff-wan (``[project.entry-points.ff] wan = "ff_wan.plugin"``)."""

from __future__ import annotations

from ff_core.hookspecs import hookimpl


@hookimpl
def ff_adapters():
    """The Wan text-to-video and image-to-video adapter classes; importing them loads no weights."""
    from ff_wan.adapter import WanI2VAdapter, WanT2VAdapter

    return [WanT2VAdapter, WanI2VAdapter]


@hookimpl
def ff_adapter_interface_version():
    """The ff adapter-interface version both adapters are written for (``ff_core.ADAPTER_INTERFACE_VERSION``)."""
    # 1.4: check_bucket (wan2_i2v); 1.5: uses_second_expert (guidance_scale_2); 1.8: io_contract_variants;
    # 1.9: clip_defaults, resolve_clip
    return "1.9"
