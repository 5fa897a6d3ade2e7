"""Entry point module of ff-wan (``[project.entry-points.ff] wan = "ff_wan.plugin"``)."""

from __future__ import annotations

from ff_core.hookspecs import hookimpl


@hookimpl
def ff_adapters():
    """The Wan text-to-video and image-to-video adapter classes; importing them loads no weights."""
    from ff_wan.adapter import WanI2VAdapter, WanT2VAdapter

    return [WanT2VAdapter, WanI2VAdapter]
