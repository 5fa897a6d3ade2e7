"""ff-minimax: MiniMax H3 joint video + audio adapters for ff (``minimax-h3-t2va``; FL2VA and Ref2VA build on it)."""

from ff_minimax.adapter import MiniMaxH3Adapter, MiniMaxH3T2VAAdapter

__all__ = ["MiniMaxH3Adapter", "MiniMaxH3T2VAAdapter"]
