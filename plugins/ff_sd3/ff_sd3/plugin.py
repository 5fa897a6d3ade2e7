"""Entry point module of ff-sd3 (``[project.entry-points.ff] sd3 = "ff_sd3.plugin"``)."""

from __future__ import annotations

from ff_core.hookspecs import hookimpl


@hookimpl
def ff_adapters():
    """The SD3.5 adapter class; importing it loads no weights."""
    from ff_sd3.adapter import SD3Adapter

    return [SD3Adapter]
