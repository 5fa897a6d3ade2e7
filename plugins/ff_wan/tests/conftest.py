"""Fixtures of the ff-wan tests: tiny Wan checkpoints of every variant, built once per session on first use."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_wan(tmp_path_factory):
    """``tiny_wan(variant)``: the folder of a tiny checkpoint of that variant (ff_wan.testing.VARIANTS)."""
    from ff_wan.testing import build_tiny_wan

    built: dict[str, Path] = {}

    def get(variant: str = "t2v") -> Path:
        if variant not in built:
            built[variant] = build_tiny_wan(tmp_path_factory.mktemp(f"tiny-wan-{variant}"), variant=variant)
        return built[variant]

    return get


@pytest.fixture(scope="session")
def tiny_wan_unipc(tmp_path_factory):
    """``tiny_wan_unipc(variant)``: a tiny checkpoint of that variant saved with the ``UniPCMultistepScheduler``
    released Wan checkpoints ship (flow_prediction, use_flow_sigmas, flow_shift 3)."""
    from ff_wan.testing import build_tiny_wan

    built: dict[str, Path] = {}

    def get(variant: str = "t2v") -> Path:
        if variant not in built:
            built[variant] = build_tiny_wan(tmp_path_factory.mktemp(f"tiny-wan-unipc-{variant}"), variant=variant,
                                            scheduler="unipc")  # fmt: skip
        return built[variant]

    return get
