"""Entry point module of ff-minimax (``[project.entry-points.ff] minimax = "ff_minimax.plugin"``)."""

from __future__ import annotations

from ff_core.hookspecs import hookimpl


@hookimpl
def ff_adapters():
    """The MiniMax H3 adapter classes; importing them loads no weights."""
    from ff_minimax.adapter import MiniMaxH3T2VAAdapter
    from ff_minimax.fl2va import MiniMaxH3FL2VAAdapter
    from ff_minimax.ref2va import MiniMaxH3Ref2VAAdapter

    return [MiniMaxH3T2VAAdapter, MiniMaxH3FL2VAAdapter, MiniMaxH3Ref2VAAdapter]


@hookimpl
def ff_adapter_interface_version():
    """The ff adapter-interface version the adapters are written for (``ff_core.ADAPTER_INTERFACE_VERSION``)."""
    # 1.3: component_velocity; 1.4: check_adapter_kwargs, resolve_output_geometry; 1.9: clip_defaults, resolve_clip
    return "1.9"
