"""ff-ltx2: LTX-2 text-to-audio+video (``ltx2_t2av``) and image-to-audio+video (``ltx2_i2av``) adapters for ff."""

from ff_ltx2.adapter import LTX2T2AVAdapter
from ff_ltx2.i2av import LTX2I2AVAdapter

__all__ = ["LTX2I2AVAdapter", "LTX2T2AVAdapter"]
