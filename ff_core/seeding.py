"""Seeds derived from integers, identical in every process: what the loader (shuffles, mixtures) and the objectives
(per-step timesteps and noise) share, so neither imports the other for it."""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that depends only on ``parts`` (splitmix64 chain), identical in every process.

    Args:
        parts: Integers such as (seed, epoch) or (seed, step).
    """
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x + (int(p) & _MASK64) + 0x9E3779B97F4A7C15) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return x >> 1
