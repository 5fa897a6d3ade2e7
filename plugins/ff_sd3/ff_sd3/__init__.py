"""ff plugin for Stable Diffusion 3 / 3.5: the ``sd3-5`` adapter and a tiny-checkpoint factory for tests."""

from ff_sd3.adapter import SD3Adapter

__all__ = ["SD3Adapter"]
