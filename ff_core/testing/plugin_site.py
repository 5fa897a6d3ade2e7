"""Installed-looking fake plugins for tests of plugin discovery: a module plus a ``dist-info`` with an ``ff`` entry
point in a folder on ``sys.path`` (``importlib.metadata`` finds it as it finds a pip-installed distribution)."""

from __future__ import annotations

import textwrap
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
