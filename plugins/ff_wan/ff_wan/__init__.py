"""ff plugin for Wan2.x video models: the ``wan2_t2v`` and ``wan2_i2v`` adapters and a tiny-checkpoint factory."""

from ff_wan.adapter import WanI2VAdapter, WanT2VAdapter

__all__ = ["WanI2VAdapter", "WanT2VAdapter"]
