"""A plugin that calls ``sys.exit`` while it loads is isolated like any broken plugin (issue 24 item 10).

``SystemExit`` is a ``BaseException``: an ``except Exception`` around a plugin's import lets it end ``ff plugins``,
``ff fit`` and ``ff data validate --model`` for every family. Fake installed plugins (a module plus a ``dist-info``,
no pip) as tests/test_plugins.py builds them.
"""

import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ff_core.plugins import PluginRegistry
from ff_core.testing.plugin_site import install_fake_plugin
from tests.test_plugins import GOOD  # one toy plugin for both files

EXIT_AT_IMPORT = "import sys\nsys.exit(3)\n"
EXIT_IN_HOOK = """
import sys
from ff_core.hookspecs import hookimpl

@hookimpl
def ff_adapters():
    sys.exit("no GPU here")
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in list(sys.modules):
        if name.startswith("toy_"):
            del sys.modules[name]


@pytest.mark.parametrize(
    "source, error",
    [
        (EXIT_AT_IMPORT, "SystemExit: the plugin called sys.exit(3) while loading"),
        (EXIT_IN_HOOK, "SystemExit: the plugin called sys.exit('no GPU here') while loading"),
    ],
)
def test_a_plugin_calling_sys_exit_is_reported_and_the_others_load(site, source, error):
    install_fake_plugin(site, "toy-good", "toy_good", GOOD)
    install_fake_plugin(site, "toy-exit", "toy_exit", source)
    eps = [ep for ep in md.entry_points(group="ff") if ep.name in ("toy-exit", "toy-good")]
    assert [ep.name for ep in eps if ep.name == "toy-exit"], "the fake entry point is visible"
    registry = PluginRegistry(entry_points=sorted(eps, key=lambda ep: ep.name != "toy-exit"))  # the bad one first
    assert registry.adapter_class("toy-t2v").__name__ == "ToyT2V"
    [failure] = registry.failures
    assert (failure.plugin, failure.distribution, failure.error) == ("toy-exit", "toy-exit", error)
    assert not registry.manager.has_plugin("toy-exit")


def test_ff_plugins_survives_a_plugin_calling_sys_exit(tmp_path):
    install_fake_plugin(tmp_path, "toy-exit", "toy_exit", EXIT_AT_IMPORT)
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    result = subprocess.run([sys.executable, "-m", "ff_core.cli", "plugins"], capture_output=True, text=True, env=env,
                            cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr)
    lines = result.stdout.splitlines()
    assert any(line.startswith("sd3-5  [ff-sd3") for line in lines), lines
    assert "FAILED plugin 'toy-exit' from toy-exit: SystemExit: the plugin called sys.exit(3) while loading" in lines
