"""Plugin discovery through real entry points: good, broken, faulty and conflicting plugins."""

import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path
from site import getsitepackages

import pytest

from ff_core.plugins import PluginRegistry, load_dotted_adapter
from ff_core.testing.plugin_site import install_fake_plugin

REPO = Path(__file__).resolve().parents[1]

GOOD = """
from ff_core.hookspecs import hookimpl
from ff_core.testing.contracts import SUPPORT_TABLE
from ff_wan import WanT2VAdapter

class ToyT2V(WanT2VAdapter):
    name = "toy-t2v"
    io_contract = SUPPORT_TABLE["wan2_t2v"]

@hookimpl
def ff_adapters():
    return [ToyT2V]
"""
BROKEN = "import a_module_that_does_not_exist\n"
FAULTY_HOOK = """
from ff_core.hookspecs import hookimpl

@hookimpl
def ff_adapters():
    raise RuntimeError("boom while registering")
"""
NOT_AN_ADAPTER = """
from ff_core.hookspecs import hookimpl

@hookimpl
def ff_adapters():
    return [dict]
"""
DUPLICATE = """
from ff_core.hookspecs import hookimpl
from toy_good import ToyT2V

class Again(ToyT2V):
    pass

@hookimpl
def ff_adapters():
    return [Again]
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in list(sys.modules):
        if name.startswith("toy_"):
            del sys.modules[name]


def test_good_plugin_is_registered_with_its_distribution(site):
    install_fake_plugin(site, "toy-good", "toy_good", GOOD)
    registry = PluginRegistry()
    info = registry.adapters()["toy-t2v"]
    assert (info.distribution, info.version) == ("toy-good", "0.3")
    assert info.summary == "prompt -> video(fps); CFG"
    assert registry.adapter_class("toy-t2v").__name__ == "ToyT2V"


@pytest.mark.parametrize(
    "source, error, unregistered",
    [
        (BROKEN, "ModuleNotFoundError: No module named 'a_module_that_does_not_exist'", True),
        (FAULTY_HOOK, "RuntimeError: boom while registering", True),
        (NOT_AN_ADAPTER, "is not a subclass of ff_core.adapter.Adapter", False),
    ],
)
def test_a_failing_plugin_is_reported_and_the_others_still_load(site, source, error, unregistered):
    install_fake_plugin(site, "toy-good", "toy_good", GOOD)
    install_fake_plugin(site, "toy-bad", "toy_bad", source)
    registry = PluginRegistry()
    assert "toy-t2v" in registry.adapters()
    [failure] = [f for f in registry.failures if f.distribution == "toy-bad"]
    assert error in failure.error and failure.plugin == "toy-bad"
    assert registry.manager.has_plugin("toy-bad") is not unregistered


def test_duplicate_adapter_names_are_a_reported_conflict(site):
    install_fake_plugin(site, "toy-good", "toy_good", GOOD)
    install_fake_plugin(site, "toy-dup", "toy_dup", DUPLICATE)
    registry = PluginRegistry()
    assert registry.adapters()["toy-t2v"].distribution == "toy-good"
    assert any("already provided by toy-good" in f.error for f in registry.failures)


def test_unknown_name_lists_known_adapters_and_failures(site):
    install_fake_plugin(site, "toy-good", "toy_good", GOOD)
    install_fake_plugin(site, "toy-bad", "toy_bad", BROKEN)
    with pytest.raises(KeyError, match=r"unknown adapter 'nope'.*toy-t2v(.|\n)*toy-bad"):
        PluginRegistry().adapter_class("nope")


def toy_registry(site) -> PluginRegistry:
    """A registry of the toy-good plugin only (the installed ff-sd3 left out, so messages are exact)."""
    install_fake_plugin(site, "toy-good", "toy_good", GOOD)
    return PluginRegistry(entry_points=[ep for ep in md.entry_points(group="ff") if ep.name == "toy-good"])


@pytest.mark.parametrize("typo", ["toy", "TOY-T2V", "toy_t2v", "toyt2v", "toy.t2v"])
def test_unknown_name_names_the_closest_registered_adapter(site, typo):
    with pytest.raises(KeyError) as err:
        toy_registry(site).adapter_class(typo)
    # `toy.t2v` reads as a dotted path too: the message says why that failed as well.
    why = " (not a registered name, nor an importable dotted path: No module named 'toy')" if "." in typo else ""
    assert err.value.args[0] == f"unknown adapter {typo!r}{why}; did you mean 'toy-t2v'? (registered adapters: toy-t2v)"


def test_unknown_name_without_a_close_match(site):
    registry = toy_registry(site)
    with pytest.raises(KeyError) as err:
        registry.adapter_class("stable-diffusion")
    assert err.value.args[0] == "unknown adapter 'stable-diffusion' (registered adapters: toy-t2v)"
    with pytest.raises(KeyError) as err:
        registry.adapter_class("toy_goodx:ToyT2V")
    # With ':' it is a dotted path, whatever name it resembles.
    assert err.value.args[0] == "cannot import adapter 'toy_goodx:ToyT2V': No module named 'toy_goodx'"


def test_dotted_path_fallback(site):
    install_fake_plugin(site, "toy-good", "toy_good", GOOD)
    assert PluginRegistry(entry_points=[]).adapter_class("toy_good:ToyT2V").name == "toy-t2v"
    assert load_dotted_adapter("toy_good.ToyT2V").name == "toy-t2v"
    with pytest.raises(KeyError, match="not a subclass"):
        load_dotted_adapter("collections:OrderedDict")


def test_autoload_can_be_disabled(site, monkeypatch):
    install_fake_plugin(site, "toy-good", "toy_good", GOOD)
    monkeypatch.setenv("FF_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert PluginRegistry().adapters() == {}


def ff(*args, env_extra=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "ff_core.cli", *args], capture_output=True, text=True, env=env)


def test_ff_plugins_lists_sd3_and_reports_a_broken_plugin(tmp_path):
    install_fake_plugin(tmp_path, "toy-bad", "toy_bad", BROKEN)
    result = ff("plugins", env_extra={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("sd3-5  [ff-sd3 0.1.0]  prompt -> image; CFG") for line in lines), lines
    assert any(line.startswith("FAILED plugin 'toy-bad' from toy-bad: ModuleNotFoundError") for line in lines), lines


def test_uninstalling_ff_sd3_removes_its_adapter(tmp_path):
    """``pip install -e plugins/ff_sd3`` lists ``sd3-5``; ``pip uninstall ff-sd3`` removes it. In a throwaway venv
    that sees this environment's packages, less ff-sd3's own install, through links (``site-view``): the shared
    environment is never changed, so the tests running beside this one (pytest-xdist) keep their plugins."""
    view, venv = tmp_path / "site-view", tmp_path / "venv"
    view.mkdir()
    own = ("ff_sd3-", "__editable__.ff_sd3-", "__editable___ff_sd3_")
    for parent in (Path(p) for p in getsitepackages() if Path(p).is_dir()):
        for entry in parent.iterdir():
            if not entry.name.startswith(own) and not (view / entry.name).exists():
                (view / entry.name).symlink_to(entry)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    Path(purelib, "_ff_site_view.pth").write_text(f"import site; site.addsitedir({str(view)!r})\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PIP_NO_INDEX": "1", "PIP_NO_CACHE_DIR": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}  # fmt: skip
    env.pop("FF_DISABLE_PLUGIN_AUTOLOAD", None)

    def run(*args: str) -> str:
        result = subprocess.run([python, *args], capture_output=True, text=True, env=env)
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert "sd3-5" not in run("-m", "ff_core.cli", "plugins")  # the view really lacks ff-sd3
    run("-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(REPO / "plugins" / "ff_sd3"))
    assert "sd3-5  [ff-sd3" in run("-m", "ff_core.cli", "plugins")
    run("-m", "pip", "uninstall", "-q", "-y", "ff-sd3")
    assert "sd3-5" not in run("-m", "ff_core.cli", "plugins")
