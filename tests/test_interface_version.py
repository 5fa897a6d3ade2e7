"""Adapter-interface versioning: a plugin declares the version it targets (class attribute or plugin hook); ff refuses
one written for another major version or a newer minor one, naming both versions and the distribution, and one whose
stage methods cannot be called the way ff-core calls them (a missing stage, an override without an argument the base
declares), in one line at registration rather than inside training. An adapter written to interface 1.0 trains."""

import importlib.metadata as md
import json
import sys
from pathlib import Path

import pytest

import ff_core
from ff_core.callbacks.checkpoint import EXPORT_FILE
from ff_core.plugins import PluginRegistry, interface_problem, load_dotted_adapter
from ff_core.testing.plugin_site import install_fake_plugin

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "sd3" / "sft_tiny.yaml"
MAJOR, MINOR = (int(p) for p in ff_core.ADAPTER_INTERFACE_VERSION.split("."))

BY_ATTRIBUTE = """
from ff_core.hookspecs import hookimpl
from ff_core.testing.contracts import SUPPORT_TABLE
from ff_sd3 import SD3Adapter

class Toy(SD3Adapter):
    name = "toy-{tag}"
    io_contract = SUPPORT_TABLE["sd3-5"]
    interface_version = {version!r}

@hookimpl
def ff_adapters():
    return [Toy]
"""
BY_HOOK = """
from ff_core.hookspecs import hookimpl
from ff_core.testing.contracts import SUPPORT_TABLE
from ff_sd3 import SD3Adapter

class Toy(SD3Adapter):
    name = "toy-{tag}"
    io_contract = SUPPORT_TABLE["sd3-5"]

@hookimpl
def ff_adapters():
    return [Toy]

@hookimpl
def ff_adapter_interface_version():
    return {version!r}
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in list(sys.modules):
        if name.startswith("toy_"):
            del sys.modules[name]


def registry_of(site, source: str, version: str, tag: str = "a") -> PluginRegistry:
    install_fake_plugin(site, f"toy-{tag}", f"toy_{tag}", source.format(tag=tag, version=version), version="2.5")
    return PluginRegistry(entry_points=[ep for ep in md.entry_points(group="ff") if ep.name == f"toy-{tag}"])


def test_core_exposes_a_major_minor_version():
    assert MAJOR >= 1 and MINOR >= 0


@pytest.mark.parametrize("source", [BY_ATTRIBUTE, BY_HOOK], ids=["attribute", "hook"])
@pytest.mark.parametrize("version", [f"{MAJOR}.0", f"{MAJOR}.{MINOR}"])
def test_compatible_plugins_register_with_their_declared_version(site, source, version):
    registry = registry_of(site, source, version)
    assert registry.failures == []
    assert registry.adapters()["toy-a"].interface == version


@pytest.mark.parametrize("source", [BY_ATTRIBUTE, BY_HOOK], ids=["attribute", "hook"])
@pytest.mark.parametrize(
    "version, why",
    [
        (f"{MAJOR + 1}.0", "a different major version is incompatible"),
        (f"{MAJOR - 1}.9", "a different major version is incompatible"),
        (f"{MAJOR}.{MINOR + 1}", "an older minor version (upgrade ff-core"),
    ],
)
def test_incompatible_plugins_are_refused_naming_both_versions_and_the_distribution(site, source, version, why):
    registry = registry_of(site, source, version)
    assert "toy-a" not in registry.adapters()
    (failure,) = registry.failures
    assert (failure.plugin, failure.distribution) == ("toy-a", "toy-a")
    assert f"adapter Toy of plugin 'toy-a' (toy-a 2.5) targets ff adapter interface {version}" in failure.error
    assert f"provides adapter interface {ff_core.ADAPTER_INTERFACE_VERSION}" in failure.error
    assert why in failure.error
    with pytest.raises(KeyError, match="unknown adapter 'toy-a'(.|\n)*toy-a 2.5\\) targets ff adapter interface"):
        registry.adapter_class("toy-a")


def test_the_class_attribute_overrides_the_plugin_hook(site):
    source = BY_HOOK.replace('    io_contract = SUPPORT_TABLE["sd3-5"]\n',
                             f'    io_contract = SUPPORT_TABLE["sd3-5"]\n    interface_version = "{MAJOR}.0"\n')
    registry = registry_of(site, source, f"{MAJOR + 1}.0")
    assert registry.failures == [] and registry.adapters()["toy-a"].interface == f"{MAJOR}.0"


def test_malformed_and_undeclared_versions(site):
    (failure,) = registry_of(site, BY_ATTRIBUTE, "one", tag="b").failures
    assert "declares ff adapter interface 'one'; expected 'major.minor'" in failure.error
    undeclared = BY_ATTRIBUTE.replace("    interface_version = {version!r}\n", "")
    registry = registry_of(site, undeclared, "", tag="c")
    assert registry.failures == [] and registry.adapters()["toy-c"].interface is None


def test_an_undeclared_version_is_checked_as_1_0_and_shown_so(site, monkeypatch):
    """Undeclared is the first interface, 1.0: a core of another major version refuses it; ``ff plugins`` says so."""
    import io

    from ff_core import plugins
    from ff_core.cli import print_plugins

    undeclared = BY_ATTRIBUTE.replace("    interface_version = {version!r}\n", "")
    registry = registry_of(site, undeclared, "", tag="e")
    monkeypatch.setattr(plugins, "get_registry", lambda: registry)
    out = io.StringIO()
    print_plugins(out)
    assert "toy-e  [toy-e 2.5]" in out.getvalue() and "(adapter interface undeclared, assumed 1.0)" in out.getvalue()
    monkeypatch.setattr(plugins, "ADAPTER_INTERFACE_VERSION", "2.0")
    problem = interface_problem(None, "plugin 'toy-e'", registry.adapters()["toy-e"].cls)
    assert "(no interface version declared, assumed 1.0) targets ff adapter interface 1.0" in problem
    assert "a different major version is incompatible" in problem


def test_a_version_declared_as_a_number_is_refused_asking_for_a_string(site):
    registry = registry_of(site, BY_ATTRIBUTE.replace("{version!r}", "1.1"), "", tag="f")
    (failure,) = registry.failures
    assert "declares ff adapter interface 1.1, a float; declare it as a string 'major.minor' ('1.1'" in failure.error


def test_a_version_inherited_from_another_packages_base_does_not_declare(site):
    """A third party's subclass of another plugin's adapter is not written for that plugin's version: its hook (or
    nothing) declares it; a base in its own package does."""
    install_fake_plugin(site, "toy-g", "toy_g", BY_ATTRIBUTE.format(tag="g", version=f"{MAJOR}.{MINOR}"))
    sub = BY_HOOK.replace("class Toy(SD3Adapter):", "from toy_g import Toy as Base\n\nclass Toy(Base):")
    registry = registry_of(site, sub, f"{MAJOR}.0", tag="h")
    assert registry.failures == [] and registry.adapters()["toy-h"].interface == f"{MAJOR}.0"
    from ff_core.plugins import declared_interface

    base = sys.modules["toy_g"].Toy
    assert declared_interface(type("Own", (base,), {"__module__": "toy_g.more"})) == f"{MAJOR}.{MINOR}"
    assert declared_interface(type("Other", (base,), {"__module__": "elsewhere"})) is None


def test_dotted_paths_are_checked_too(site):
    install_fake_plugin(site, "toy-d", "toy_d", BY_ATTRIBUTE.format(tag="d", version=f"{MAJOR + 1}.0"))
    with pytest.raises(KeyError, match=r"'toy_d:Toy': adapter Toy of 'toy_d:Toy' targets ff adapter interface"):
        load_dotted_adapter("toy_d:Toy")


def test_the_bundled_plugins_declare_a_compatible_version():
    from ff_sd3 import SD3Adapter
    from ff_wan import WanT2VAdapter, plugin

    assert interface_problem(SD3Adapter.interface_version, "ff-sd3", SD3Adapter) is None
    assert interface_problem(plugin.ff_adapter_interface_version(), "ff-wan", WanT2VAdapter) is None


# -- stage methods ff-core calls ------------------------------------------------------------------------------------
WRITTEN_TO_1_0 = """
from ff_core.hookspecs import hookimpl
from ff_sd3 import SD3Adapter

CALLS = []

class Toy(SD3Adapter):
    name = "toy-{tag}"
    interface_version = "1.0"
{body}

@hookimpl
def ff_adapters():
    return [Toy]
"""
TAKEN = """
    @staticmethod
    def check_bucket(path, kwargs, geometry):  # a staticmethod takes what the classmethod is called with
        return None

    def timestep_shift(self, *args, **kwargs):  # a wrapper's signature takes anything
        return super().timestep_shift(*args, **kwargs)
"""


def test_overrides_that_take_what_ff_core_passes_register(site):
    registry = registry_of(site, WRITTEN_TO_1_0.replace("{body}", TAKEN), "", tag="t")
    assert registry.failures == [] and "toy-t" in registry.adapters()


AS_IN_1_0 = '''
    def sampling_sigmas(self, num_steps, shift=None):  # 1.0: no state
        CALLS.append(("sampling_sigmas", num_steps, shift))
        return super().sampling_sigmas(num_steps, shift)

    def encode_output(self, media, condition, generator=None):
        CALLS.append(("encode_output", generator is not None))
        return super().encode_output(media, condition, generator)

    def save_loras(self, directory, state_dicts, configs):  # 1.0: no extra_files
        CALLS.append(("save_loras", sorted(state_dicts)))
        return super().save_loras(directory, state_dicts, configs)
'''


@pytest.mark.parametrize(("body", "why"), [
    ("    def encode_output(self, media, condition):\n        return super().encode_output(media, condition)",
     "overrides encode_output(self, media, condition) without the argument generator=, which ff-core passes: declare "
     "it as the Adapter base does, encode_output(self, media: list[list[Tensor]], condition: Condition, generator: "
     "torch.Generator | None = None)"),
    ("    def sampling_sigmas(self, num_steps):\n        return super().sampling_sigmas(num_steps)",
     "overrides sampling_sigmas(self, num_steps) without the argument shift="),
    ("    def velocity(self, state, sigma):\n        return super().velocity(state, sigma, None)",
     "overrides velocity(self, state, sigma) without its 3. argument (condition)"),
    ("    @classmethod\n    def from_pretrained(cls):\n        return None",
     "overrides from_pretrained(cls) without its 1. argument (pretrained_model_name_or_path)"),
    ("    def initial_noise(self, condition, *, generator=None):\n        return super().initial_noise(condition)",
     "overrides initial_noise(self, condition, *, generator=None) without generator as its 2. argument, where ff-core "
     "may pass it"),
    ("    def velocity(self, state, sigma, condition, extra):\n        return None",
     "overrides velocity(self, state, sigma, condition, extra) requiring the argument extra, which ff-core never "
     "passes"),
    ("    def check_adapter_kwargs(self, path, kwargs):\n        return None",
     "overrides the classmethod check_adapter_kwargs with a plain method (ff-core calls it on the class, before any "
     "weight loads): add @classmethod"),
])  # fmt: skip
def test_an_override_ff_core_cannot_call_is_refused_at_registration_in_one_line(site, body, why):
    """What a plugin written from older or partial docs does (issue 31): the adapter is not registered; the failure
    names the method, the argument and the signature to declare, in one line (``ff plugins``, ``model.adapter``)."""
    registry = registry_of(site, WRITTEN_TO_1_0.replace("{body}", body), "", tag="s")
    assert "toy-s" not in registry.adapters()
    (failure,) = registry.failures
    assert why in failure.error and "\n" not in failure.error
    with pytest.raises(KeyError, match="Toy overrides"):
        load_dotted_adapter("toy_s:Toy")


def test_stages_are_not_required_at_registration(site):
    """A contract-only adapter (``ff data validate --model``) registers: the stages a run calls are checked per run."""
    source = BY_ATTRIBUTE.replace("from ff_sd3 import SD3Adapter", "from ff_core.adapter import Adapter").replace(
        "class Toy(SD3Adapter):", "class Toy(Adapter):")
    registry = registry_of(site, source, f"{MAJOR}.0", tag="m")
    assert registry.failures == [] and "toy-m" in registry.adapters()


def test_every_bundled_adapter_takes_what_ff_core_passes():
    from ff_core.plugins import get_registry, stage_problem

    adapters = get_registry().adapters()
    assert {"sd3-5", "wan2_t2v", "ltx2_t2av", "minimax-h3-t2va"} <= adapters.keys()
    assert {name: stage_problem(info.cls) for name, info in adapters.items()} == dict.fromkeys(adapters)


def fit_args(tiny_sd3, shapes_dir, root, adapter: str, *extra: str) -> list[str]:
    datasets = json.dumps([{"name": "shapes", "dataset_dir": str(shapes_dir), "eval": {}}])
    return ["fit", "--config", str(RECIPE), "--model.adapter", adapter, "--model.pretrained_model_name_or_path",
            str(tiny_sd3), "--data.datasets", datasets, "--data.eval_batch_size", "2", "--model.sampling.num_steps",
            "2", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
            "--trainer.default_root_dir", str(root), "--trainer.logger", "false", "--trainer.callbacks", "[]",
            "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false", *extra]  # fmt: skip


def test_an_adapter_written_to_interface_1_0_trains_and_samples(site, tiny_sd3, shapes_dir, tmp_path):
    """Declared 1.0, ``sampling_sigmas`` overridden as 1.0 defined it (no ``state``): ``ff fit`` trains (the
    posterior drawn from the step's generator) and validation samples on the override's schedule."""
    from ff_core.cli import main

    install_fake_plugin(site, "toy-o", "toy_o", WRITTEN_TO_1_0.replace("{body}", AS_IN_1_0).format(tag="o"))
    checkpoint = {"class_path": "ff_core.callbacks.FlowCheckpoint", "init_args": {"every_n_train_steps": 2}}
    args = fit_args(tiny_sd3, shapes_dir, tmp_path, "toy_o:Toy", "--trainer.enable_checkpointing", "true",
                    "--trainer.callbacks", json.dumps([checkpoint]))  # fmt: skip
    assert main(args) == 0
    calls = sys.modules["toy_o"].CALLS
    assert calls.count(("encode_output", True)) == 2
    assert ("sampling_sigmas", 2, None) in calls
    assert ("save_loras", ["transformer"]) in calls  # the LoRA export, its record written after the folder
    (record,) = tmp_path.rglob(EXPORT_FILE)
    assert json.loads(record.read_text())["step"] == 2 and (record.parent / "pytorch_lora_weights.safetensors").exists()


def test_stages_a_run_calls_are_checked_before_weights_load(site, tiny_sd3, shapes_dir, tmp_path, capsys):
    """Left to the base (which raises), a stage this run calls stops ``ff fit`` before anything loads, naming each
    and what calls it; ``preprocess_identity`` only with the condition cache: without it the run trains."""
    from ff_core.cli import main

    body = "\n".join(f"    {n} = Adapter.{n}" for n in ("preprocess_identity", "decode", "velocity"))
    source = WRITTEN_TO_1_0.replace("{body}", body).format(tag="p")
    install_fake_plugin(site, "toy-p", "toy_p", "from ff_core.adapter import Adapter\n" + source)
    missing = tmp_path / "no-such-checkpoint"  # the check comes first: nothing loads
    assert main(fit_args(missing, shapes_dir, tmp_path, "toy_p:Toy")) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "ff fit: model.adapter: 'toy-p' (Toy) does not implement velocity() (every step), decode() (sampling), "
        "preprocess_identity() (the condition cache (data.enable_preprocess: false keeps conditions in memory "
        "instead)), which this run calls (docs/plugins.md, 'Writing a plugin')")
    train_only = json.dumps([{"name": "shapes", "dataset_dir": str(shapes_dir), "eval": None}])  # no sampling
    source = source.replace("    velocity = Adapter.velocity", "")
    source = "from ff_core.adapter import Adapter\n" + source.replace("toy-p", "toy-q")
    install_fake_plugin(site, "toy-q", "toy_q", source)
    assert main([*fit_args(tiny_sd3, shapes_dir, tmp_path, "toy_q:Toy", "--data.enable_preprocess", "false"),
                 "--data.datasets", train_only]) == 0  # fmt: skip
