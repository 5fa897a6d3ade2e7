"""Fixtures of the ff-ltx2 tests: tiny LTX-2 checkpoints built once per session on first use.

Installed (``pip install -e plugins/ff_ltx2``, what scripts/setup.sh does) the plugin registers through its entry
point. Run from a source tree where it is not installed, the package goes on ``sys.path`` (and ``PYTHONPATH``, for
``ff fit`` subprocesses) and ``FF_PLUGINS=ff_ltx2.plugin`` registers it the way the entry point would."""

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
def ltx2_plugin_registered():
    """Without the installed distribution, the registry sees ff_ltx2.plugin for this module's tests, then forgets it."""
    with registered_from_source("ff_ltx2.plugin", PLUGIN_ROOT, distribution="ff-ltx2"):
        yield


@pytest.fixture(scope="session")
def tiny_ltx2(tmp_path_factory):
    """``tiny_ltx2(variant)``: the folder of a tiny checkpoint of that variant (ff_ltx2.testing.VARIANTS)."""
    from ff_ltx2.testing import build_tiny_ltx2

    built: dict[str, Path] = {}

    def get(variant: str = "t2av") -> Path:
        if variant not in built:
            built[variant] = build_tiny_ltx2(tmp_path_factory.mktemp(f"tiny-ltx2-{variant}"), variant=variant)
        return built[variant]

    return get
