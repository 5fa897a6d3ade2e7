"""ff-flux's tests run from the source tree, without installing the distribution (the repository's `pytest` collects
examples/plugins: pyproject.toml ``testpaths``): the package goes on ``sys.path`` (and on ``PYTHONPATH``, for `ff fit`
subprocesses), and, per test module, ``FF_PLUGINS=ff_flux.plugin`` registers its ``flux1`` adapter the way the
installed entry point would (ff_core/plugins.py), leaving every other test's registry as it was."""

import sys
from pathlib import Path

import pytest

from ff_core.testing.plugin_site import registered_from_source

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


@pytest.fixture(autouse=True, scope="module")
def flux_plugin_registered():
    """The registry (built once per process) sees ff_flux.plugin for this module's tests, then forgets it."""
    with registered_from_source("ff_flux.plugin", HERE):
        yield


@pytest.fixture(scope="session")
def tiny_flux_dev(tmp_path_factory):
    """A guidance-distilled (FLUX.1-dev-like) tiny checkpoint, random VAE with FLUX.1's shift and scale."""
    from ff_flux.testing import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("tiny-flux-dev"), guidance_embeds=True)


@pytest.fixture(scope="session")
def tiny_flux_schnell(tmp_path_factory):
    """A guidance-free (FLUX.1-schnell-like) tiny checkpoint."""
    from ff_flux.testing import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("tiny-flux-schnell"), guidance_embeds=False)
