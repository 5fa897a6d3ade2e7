"""`ff plugins new [--output image|video|video+audio]`: each generated skeleton installs into a throwaway environment,
registers through its entry point, passes the conformance kit (the video family's reference checks against
``WanPipeline`` included), trains a step through `ff fit`, and uninstalls cleanly; plus the names it derives and the
``FF_PLUGINS`` variable that loads a plugin module that is not installed."""

import importlib
import importlib.metadata
import importlib.util
import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ff_core
from ff_core.cli import main
from ff_core.cli.scaffold import OUTPUTS, PluginNames, new_plugin, template_files
from ff_core.plugins import ENTRY_POINT_GROUP, PLUGINS_ENV, PluginRegistry

REPO = Path(ff_core.__file__).resolve().parents[1]


def test_names_derive_from_the_family_name():
    names = PluginNames.from_name("my-family2")
    assert (names.adapter_name, names.dist, names.package, names.module, names.class_name) == (
        "my-family2", "ff-my-family2", "ff_my_family2", "my_family2", "MyFamily2Adapter")  # fmt: skip
    assert PluginNames.from_name("ff-toy") == PluginNames.from_name("toy")
    assert names.interface_version == ff_core.ADAPTER_INTERFACE_VERSION


def test_underscores_join_parts_as_adapter_names_do():
    """Adapter names use dashes and underscores (``sd3-5``, ``wan2_t2v``, docs/plugins.md "Conventions")."""
    names = PluginNames.from_name("wan2_t2v")
    assert (names.adapter_name, names.dist, names.package, names.module, names.class_name) == (
        "wan2_t2v", "ff-wan2_t2v", "ff_wan2_t2v", "wan2_t2v", "Wan2T2vAdapter")  # fmt: skip


def test_a_skeleton_with_an_underscore_name_is_valid(tmp_path):
    import tomllib

    folder = new_plugin("toy_fam", tmp_path)
    pyproject = tomllib.loads((folder / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"][ENTRY_POINT_GROUP] == {"toy_fam": "ff_toy_fam.plugin"}
    for path in folder.rglob("*.py"):
        compile(path.read_text(), str(path), "exec")
    assert 'name: ClassVar[str] = "toy_fam"' in (folder / "ff_toy_fam" / "adapter.py").read_text()


@pytest.mark.parametrize("bad", ["My-Family", "2fam", "fam--ily", "fam__ily", "fam-_ily", "_fam", "fam_", "fam-", ""])
def test_a_bad_name_is_refused_with_exit_2(bad, tmp_path, capsys):
    assert main(["plugins", "new", bad, "--dir", str(tmp_path)]) == 2
    assert "lowercase letters, digits and single dashes or underscores" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_an_existing_folder_is_never_overwritten(tmp_path, capsys):
    folder = new_plugin("toy", tmp_path)
    (folder / "mine.txt").write_text("keep")
    assert main(["plugins", "new", "toy", "--dir", str(tmp_path)]) == 2
    assert "exists already" in capsys.readouterr().err and (folder / "mine.txt").read_text() == "keep"


@pytest.mark.parametrize("output", list(OUTPUTS))
def test_the_skeleton_declares_the_entry_point_ff_reads(output, tmp_path):
    """Every output writes the same files (its own adapter, factory, kit test and recipe over the shared ones)."""
    folder = new_plugin("toy-fam", tmp_path, output=output)
    assert folder == tmp_path / "ff_toy_fam"
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert files == ["README.md", "configs/sft_tiny.yaml", "ff_toy_fam/__init__.py", "ff_toy_fam/adapter.py",
                     "ff_toy_fam/plugin.py", "ff_toy_fam/testing.py", "pyproject.toml",
                     "tests/test_toy_fam_conformance.py"]  # fmt: skip
    pyproject = (folder / "pyproject.toml").read_text()
    assert f'[project.entry-points.{ENTRY_POINT_GROUP}]\ntoy-fam = "ff_toy_fam.plugin"' in pyproject
    assert 'name = "ff-toy-fam"' in pyproject and f'"{OUTPUTS[output].diffusers}"' in pyproject
    recipe = (folder / "configs" / "sft_tiny.yaml").read_text()
    assert recipe.startswith("# ff fit --config configs/sft_tiny.yaml") and OUTPUTS[output].dataset_dir in recipe
    assert f"ff plugins new toy-fam --output {output}" in (folder / "README.md").read_text()
    assert "FAMILY:" in (folder / "ff_toy_fam" / "adapter.py").read_text()  # where a family's own maths goes
    for path in folder.rglob("*.py"):
        compile(path.read_text(), str(path), "exec")  # every placeholder substituted into valid Python
    # ff's own lint rules (STYLE 15) on the generated code, from its folder (its package first-party)
    for command in (["check", "--select", "E,F,I"], ["format", "--check"]):
        lint = subprocess.run([sys.executable, "-m", "ruff", *command, "--isolated", "--line-length", "120", "."],
                              cwd=folder, capture_output=True, text=True)  # fmt: skip
        assert lint.returncode == 0, lint.stdout + lint.stderr


def test_an_unknown_output_is_refused_with_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:  # argparse's choices: the valid ones listed
        main(["plugins", "new", "toy", "--dir", str(tmp_path), "--output", "audio"])
    assert exit_.value.code == 2 and "'video+audio'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--output must be one of image, video, video\\+audio, got 'audio'"):
        new_plugin("toy", tmp_path, output="audio")
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_ff_plugins_new_writes_the_output_asked_for(tmp_path, capsys):
    assert main(["plugins", "new", "toy-vid", "--dir", str(tmp_path), "--output", "video"]) == 0
    assert "wrote plugin ff_toy_vid" in capsys.readouterr().out
    assert "WanTransformer3DModel" in (tmp_path / "ff_toy_vid" / "ff_toy_vid" / "adapter.py").read_text()
    assert main(["plugins", "--help"]) == 0
    assert "--output {image,video,video+audio}" in capsys.readouterr().out


def test_the_tiny_builder_saves_through_the_reference_pipeline_once_one_is_named(tmp_path, monkeypatch):
    """As generated (``reference_pipeline = None``) the checkpoint is the bare components; with a pipeline class it is
    saved through the pipeline, so its ``from_pretrained`` (the kit's maths checks) loads it."""
    from diffusers import DiffusionPipeline

    class TinyPipeline(DiffusionPipeline):
        def __init__(self, transformer, vae, text_encoder, tokenizer, scheduler):
            super().__init__()
            self.register_modules(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                  scheduler=scheduler)  # fmt: skip

    new_plugin("toy-pipe", tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "ff_toy_pipe"))
    monkeypatch.syspath_prepend(str(tmp_path / "ff_toy_pipe" / "tests"))
    from ff_toy_pipe.adapter import ToyPipeAdapter
    from test_toy_pipe_conformance import TestToyPipeAdapterConformance as Kit

    bare = Kit().build_checkpoint(tmp_path / "bare")
    assert not (bare / "model_index.json").exists() and ToyPipeAdapter.from_pretrained(bare, resolution=32)
    monkeypatch.setattr(Kit, "reference_pipeline", TinyPipeline)
    saved = Kit().build_checkpoint(tmp_path / "saved")
    pipe = TinyPipeline.from_pretrained(saved)
    assert type(pipe.transformer).__name__ == "SD3Transformer2DModel" and pipe.tokenizer is not None
    assert ToyPipeAdapter.from_pretrained(saved, resolution=32)


@pytest.mark.parametrize("output", list(OUTPUTS))
def test_the_generated_adapter_loads_in_the_dtype_asked_for_and_keys_its_cache_by_it(output, tmp_path, monkeypatch):
    """``dtype`` (a real checkpoint in bfloat16: half the memory) and ``revision`` reach every component's
    ``from_pretrained``, and the condition cache's identity names both."""
    name = f"dt-{output.replace('+', '-')}"
    new_plugin(name, tmp_path, output=output)
    names = PluginNames.from_name(name)
    monkeypatch.syspath_prepend(str(tmp_path / names.package))
    monkeypatch.syspath_prepend(str(tmp_path / names.package / "tests"))
    adapter_cls = getattr(importlib.import_module(f"{names.package}.adapter"), names.class_name)
    kit = getattr(importlib.import_module(f"test_{names.module}_conformance"), f"Test{names.class_name}Conformance")()
    folder = kit.build_checkpoint(tmp_path / "tiny")
    full = adapter_cls.from_pretrained(folder, **kit.adapter_kwargs)
    half = adapter_cls.from_pretrained(folder, **kit.adapter_kwargs, dtype="bfloat16", revision=None)
    assert {p.dtype for p in full.parameters()} == {torch.float32}
    for name, component in half.named_children():  # bfloat16 but what a model keeps in float32 (Wan's norms)
        sizes = {dtype: sum(p.numel() for p in component.parameters() if p.dtype == dtype)
                 for dtype in (torch.bfloat16, torch.float32)}  # fmt: skip
        assert sizes[torch.bfloat16] > 4 * sizes[torch.float32], (name, sizes)
    assert half.preprocess_identity()["dtype"] == "bfloat16" and full.preprocess_identity()["dtype"] == "float32"
    assert half.preprocess_identity()["revision"] is None


def test_ff_plugins_env_loads_a_module_that_is_not_installed(tmp_path, monkeypatch):
    source = textwrap.dedent("""
        from ff_core.adapter import Adapter
        from ff_core.contracts import IMAGE_OUT, PipelineIOContract
        from ff_core.hookspecs import hookimpl

        class ToyEnv(Adapter):
            name = "toy-env"
            io_contract = PipelineIOContract(outputs=(IMAGE_OUT,))

        @hookimpl
        def ff_adapters():
            return [ToyEnv]
    """)
    (tmp_path / "toy_env_plugin.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("FF_DISABLE_PLUGIN_AUTOLOAD", "1")  # explicit plugins load even with autoload off
    monkeypatch.setenv(PLUGINS_ENV, " toy_env_plugin , missing_plugin_module")
    registry = PluginRegistry()
    info = registry.adapters()["toy-env"]
    assert (info.distribution, info.cls.__module__) == (PLUGINS_ENV, "toy_env_plugin")
    (failure,) = registry.failures  # a module that does not import is reported by name, the others still load
    assert failure.plugin == "missing_plugin_module" and "No module named" in failure.error


def run(cmd: list[str], env: dict[str, str], timeout: float = 240) -> str:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out.stdout


def backend_problem() -> str | None:
    """Why this environment cannot build the generated plugin offline (``--no-build-isolation`` takes the build
    backend from here: setuptools >= 68, the [test] extra), or ``None``."""
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return "setuptools is not installed: pip install -e '.[test]' (setuptools>=68)"
    major = int(version.split(".")[0])
    return None if major >= 68 else f"setuptools {version} < 68: pip install -e '.[test]' (setuptools>=68)"


def test_the_test_extra_names_the_build_backend_of_the_generated_plugin():
    """The offline build of the generated plugin needs setuptools here; the [test] extra must bring it, at a version
    the generated pyproject's build-system accepts."""
    import tomllib

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    template = template_files()[Path("pyproject.toml")].read_text().partition("[project]")[0]  # placeholders below
    generated = tomllib.loads(template)["build-system"]["requires"]
    assert "setuptools>=68" in extra and generated == ["setuptools>=68"], (extra, generated)


FAMILIES = {"image": "toy-fam", "video": "toy-vid", "video+audio": "toy-av"}
"""The family each output's acceptance test generates (one name per output: each installs beside the others)."""

REFERENCE_CHECKS = ("prompt_encoding", "sampling_sigmas", "training_sigmas", "denoiser_at_each_sigma",
                    "sampling_run", "sampling_run_with_cfg", "decoding", "encoding",
                    "lora_loads_through_load_lora_weights")  # fmt: skip
"""The kit's reference checks the generated video family passes against ``WanPipeline`` as generated."""


@pytest.fixture(scope="module")
def plugin_venv(tmp_path_factory):
    """A throwaway venv shared by the module's install tests: it sees this environment's packages through a ``.pth``
    (nothing is installed where the tests run); this checkout's ff_core first (the editable install's finder comes
    after PYTHONPATH); no network, no caches."""
    assert backend_problem() is None, backend_problem()
    venv = tmp_path_factory.mktemp("plugin-venv") / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], dict(os.environ))
    python = str(venv / "bin" / "python")
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       dict(os.environ)).strip())  # fmt: skip
    parents = [p for p in site.getsitepackages() if Path(p).is_dir()]
    addsitedirs = "; ".join(f"site.addsitedir({p!r})" for p in parents)
    (purelib / "_ff_parent_env.pth").write_text(f"import site; {addsitedirs}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PIP_NO_INDEX": "1", "PIP_NO_CACHE_DIR": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    env.pop(PLUGINS_ENV, None)
    env.pop("FF_DISABLE_PLUGIN_AUTOLOAD", None)
    return SimpleNamespace(python=python, purelib=purelib, parents=parents, env=env)


@pytest.mark.parametrize("output", list(FAMILIES))
def test_generated_plugin_installs_passes_the_kit_trains_and_uninstalls(output, tmp_path, plugin_venv):
    """The acceptance test of issues 14 and 31, per ``--output``: ``pip install --no-deps --no-build-isolation`` of the
    generated folder into the throwaway venv, ``ff plugins`` lists it, its conformance tests pass (for the video
    family the reference checks against ``WanPipeline`` run and pass; the image and audio+video families name no
    pipeline, so those are skipped), ``ff fit`` trains one step on a tiny dataset of the output's kind, ``pip
    uninstall`` removes it."""
    from ff_core.testing.tiny import write_tiny_dataset

    python, purelib, env = plugin_venv.python, plugin_venv.purelib, plugin_venv.env
    names = PluginNames.from_name(FAMILIES[output])
    plugin = new_plugin(names.adapter_name, tmp_path / "src", output=output)
    run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(plugin)], env)
    assert (purelib / names.package / "adapter.py").is_file()

    listing = run([python, "-m", "ff_core.cli", "plugins"], env)
    contract = {"image": "prompt -> image", "video": "prompt -> video(fps)",
                "video+audio": "prompt -> video(fps) + audio(sample_rate)"}[output]  # fmt: skip
    assert f"{names.adapter_name}  [{names.dist} 0.1.0]  {contract}; CFG" in listing, listing
    assert "FAILED" not in listing, listing

    kit = run([python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-W",
               "error::pytest.PytestDeprecationWarning", str(plugin / "tests")], env)  # fmt: skip
    # `-v` lines: "tests/test_x.py::TestX::test_name PASSED [  3%]" (SKIPPED with its reason)
    outcomes = {words[0].rsplit("::", 1)[-1]: words[1] for words in map(str.split, kit.splitlines())
                if len(words) > 1 and "::test_" in words[0]}  # fmt: skip
    reference = {name: outcome for name, outcome in outcomes.items() if name.startswith("test_reference_")}
    if output == "video":  # the template names WanPipeline: the maths checks run, and pass, as generated
        assert {f"test_reference_{c}" for c in REFERENCE_CHECKS} <= {n for n, o in reference.items() if o == "PASSED"}
    else:
        assert reference and set(reference.values()) == {"SKIPPED"}, kit[-3000:]
    assert outcomes["test_encode_output_takes_the_targets_training_delivers"] == "PASSED", kit[-3000:]
    assert "FAILED" not in outcomes.values() and "ERROR" not in outcomes.values(), kit[-3000:]

    # The generated tiny-checkpoint factory, run here (torch and diffusers are loaded already: ~15 s less).
    spec = importlib.util.spec_from_file_location(f"generated_{names.module}_testing",
                                                  plugin / names.package / "testing.py")  # fmt: skip
    factory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(factory)
    checkpoint = getattr(factory, f"build_tiny_{names.module}")(tmp_path / f"tiny-{names.adapter_name}")
    data = write_tiny_dataset(tmp_path / "data", output, n=4)
    datasets = f'[{{"name": "tiny", "dataset_dir": "{data}"}}]'
    run([python, "-m", "ff_core.cli", "fit", "--config", str(plugin / "configs" / "sft_tiny.yaml"),
         "--model.pretrained_model_name_or_path", str(checkpoint), "--data.datasets", datasets,
         "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path / "run")], env)  # fmt: skip
    assert list((tmp_path / "run").rglob("*.ckpt")), "ff fit wrote no checkpoint"

    run([python, "-m", "pip", "uninstall", "-q", "-y", names.dist], env)
    assert not (purelib / names.package).exists()
    # What ff's registry reads (ff_core/plugins.py), without importing torch for a whole `ff plugins` again.
    left = run([python, "-c", f"import importlib.metadata as m; print([e.value for e in m.entry_points("
                              f"group={ENTRY_POINT_GROUP!r})])"], env)  # fmt: skip
    assert f"{names.package}.plugin" not in left and "ff_sd3.plugin" in left, left
    for parent in plugin_venv.parents:  # the environment the tests run in never saw it
        assert not list(Path(parent).glob(f"{names.package}*")), parent
