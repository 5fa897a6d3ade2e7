"""Entry point module of ff-flux (``[project.entry-points.ff] flux = "ff_flux.plugin"``)."""

from __future__ import annotations

from ff_core.hookspecs import hookimpl


@hookimpl
def ff_adapters():
    """The FLUX.1 adapter class; importing it loads no weights."""
    from ff_flux.adapter import FluxAdapter

    return [FluxAdapter]
