"""Plugins for tests of plugin discovery: installed-looking fake ones (a module plus a ``dist-info`` with an ``ff``
entry point in a folder on ``sys.path``: ``importlib.metadata`` finds it as it finds a pip-installed distribution),
and real ones registered from a source tree that is not installed (:func:`registered_from_source`)."""

from __future__ import annotations

import importlib.metadata
import os
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def install_fake_plugin(site: Path, dist: str, module: str, source: str, version: str = "0.3") -> None:
    """Write ``module.py`` (``source``, dedented) and a minimal ``dist-info`` of distribution ``dist`` at ``version``
    whose ``ff`` entry point (named ``dist``) is ``module``, into ``site`` (a folder on ``sys.path``).

    Args:
        site: the folder (prepend it to ``sys.path``, e.g. ``monkeypatch.syspath_prepend``).
        dist: distribution name (``toy-good``).
        module: module name (``toy_good``).
        source: the module's code.
        version: the distribution's version.
    """
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[ff]\n{dist} = {module}\n")


@contextmanager
def registered_from_source(plugin: str, source_root: Path, distribution: str | None = None) -> Iterator[None]:
    """Inside the block, ff's registry loads ``plugin`` (``pkg.plugin``) from a source tree that is not installed, the
    way its entry point would: ``FF_PLUGINS`` names it and ``source_root`` goes on ``PYTHONPATH`` (for ``ff fit``
    subprocesses; the caller puts it on ``sys.path``); after the block the registry forgets it. A plugin's test
    ``conftest.py`` wraps each module's tests in it. With ``distribution`` installed (``pip install -e``, what
    scripts/setup.sh does) nothing changes: its entry point registers it.

    Args:
        plugin: the module that implements the hooks (``ff_ltx2.plugin``).
        source_root: the folder ``plugin``'s package is importable from.
        distribution: the distribution that installs it (``ff-ltx2``); ``None``: always register from source.
    """
    if distribution is not None:
        try:
            importlib.metadata.distribution(distribution)
            yield
            return
        except importlib.metadata.PackageNotFoundError:
            pass
    import pytest

    from ff_core.plugins import PLUGINS_ENV, get_registry

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(PLUGINS_ENV, plugin)
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(source_root), os.environ.get("PYTHONPATH")])))
        get_registry.cache_clear()
        yield
    get_registry.cache_clear()
