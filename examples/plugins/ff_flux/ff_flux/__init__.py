"""ff plugin for FLUX.1 (dev, schnell): the ``flux1`` adapter and a tiny-checkpoint factory for tests."""

from ff_flux.adapter import FluxAdapter

__all__ = ["FluxAdapter"]
