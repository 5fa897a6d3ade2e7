"""Fixtures of the ff-minimax tests: tiny MiniMax H3 checkpoints built once per session on first use.

Installed (``pip install -e plugins/ff_minimax``, what scripts/setup.sh does) the plugin registers through its entry
point. Run from a source tree where it is not installed, the package goes on ``sys.path`` (and ``PYTHONPATH``, for
``ff fit`` subprocesses) and ``FF_PLUGINS=ff_minimax.plugin`` registers it the way the entry point would."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ff_core.testing.plugin_site import registered_from_source

PLUGIN_ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
for folder in (PLUGIN_ROOT, TESTS):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


@pytest.fixture(autouse=True, scope="module")
def minimax_plugin_registered():
    """Without the installed distribution, the registry sees ff_minimax.plugin for this module's tests, then forgets
    it."""
    with registered_from_source("ff_minimax.plugin", PLUGIN_ROOT, distribution="ff-minimax"):
        yield


@pytest.fixture(scope="session")
def tiny_minimax(tmp_path_factory):
    """``tiny_minimax(variant)``: the folder of a tiny checkpoint of that variant (ff_minimax.testing.VARIANTS)."""
    from ff_minimax.testing import build_tiny_minimax

    built: dict[str, Path] = {}

    def get(variant: str = "t2va") -> Path:
        if variant not in built:
            built[variant] = build_tiny_minimax(tmp_path_factory.mktemp(f"tiny-minimax-{variant}"), variant=variant)
        return built[variant]

    return get
