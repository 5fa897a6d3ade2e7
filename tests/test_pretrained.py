"""`model.adapter` and `model.pretrained_model_name_or_path` mistakes are one ConfigError naming the key.

The checkpoint tests load a real diffusers scheduler config through `from_pretrained` (the first thing every
adapter's loader does), from a folder, a missing path, a file, an uncached hub id and a hub cache; nothing reaches
the network (the root conftest sets HF_HUB_OFFLINE=1).
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ff_core.adapter import Adapter
from ff_core.errors import ConfigError
from ff_core.module import FlowModule
from ff_core.plugins import get_registry
from ff_core.pretrained import load_pretrained
from ff_core.testing.contracts import SUPPORT_TABLE

KEY = "model.pretrained_model_name_or_path"
REVISION = "0123456789abcdef0123456789abcdef01234567"


class SchedulerOnly(Adapter):
    """Loads only the checkpoint's scheduler, with diffusers' own from_pretrained (weightless, fast)."""

    name = "scheduler-only"
    io_contract = SUPPORT_TABLE["sd3-5"]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_pretrained(pretrained_model_name_or_path, subfolder="scheduler")


def write_scheduler(folder: Path, shift: float = 3.0) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler

    FlowMatchEulerDiscreteScheduler(shift=shift).save_pretrained(folder / "scheduler")
    return folder


def test_unknown_adapter_names_the_key_and_the_closest_name():
    known = ", ".join(sorted(get_registry().adapters()))
    with pytest.raises(ConfigError) as err:
        FlowModule(adapter="sd3", pretrained_model_name_or_path="unused")
    assert str(err.value) == (f"model.adapter: unknown adapter 'sd3'; did you mean 'sd3-5'? "
                              f"(registered adapters: {known})")
    assert err.value.key == "model.adapter"


def test_a_checkpoint_folder_loads(tmp_path):
    assert load_pretrained(SchedulerOnly, write_scheduler(tmp_path / "ckpt"), {}).config.shift == 3.0


def test_a_missing_path_that_is_no_hub_id_fails_before_loading(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(ConfigError) as err:
        load_pretrained(SchedulerOnly, str(missing), {})
    assert str(err.value) == (f"{KEY}: {str(missing)!r} is neither a folder (no such directory: {missing}) "
                              "nor a hub id ('name' or 'org/name')")
    assert err.value.__cause__ is None  # decided without calling from_pretrained


def test_a_file_is_not_a_checkpoint(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as err:
        load_pretrained(SchedulerOnly, str(tmp_path / "model.safetensors"), {})
    assert str(err.value) == (f"{KEY}: {str(tmp_path / 'model.safetensors')!r} is a file; "
                              "expected a checkpoint folder (diffusers layout) or a hub id")


def test_a_folder_without_the_checkpoint_layout(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_pretrained(SchedulerOnly, str(tmp_path), {})
    detail = str(err.value.__cause__).splitlines()[0]  # diffusers' own words, e.g. "no file named ..."
    assert str(err.value) == (f"{KEY}: {str(tmp_path)!r} is a folder but not a scheduler-only checkpoint in the "
                              f"diffusers layout: {detail}")
    assert isinstance(err.value.__cause__, OSError)


def test_an_uncached_hub_id_offline(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_pretrained(SchedulerOnly, "ff-tests/not-cached", {})
    assert str(err.value) == (f"{KEY}: 'ff-tests/not-cached' is neither a folder (no such directory: "
                              f"{tmp_path}/ff-tests/not-cached) nor a hub id in the local hub cache "
                              "(HF_HUB_OFFLINE is set, so the hub was not asked)")


def test_an_unreachable_hub_id_online_keeps_the_hub_reason(tmp_path, monkeypatch):
    """Online, the library's first line says why (not found, gated, no network); simulated: no network here."""
    import huggingface_hub

    class Unreachable(SchedulerOnly):
        @classmethod
        def from_pretrained(cls, path, **kwargs):
            raise OSError(f"{path} is not a local folder and is not a valid model identifier\nmore detail")

    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_pretrained(Unreachable, "ff-tests/private", {})
    assert str(err.value) == (f"{KEY}: 'ff-tests/private' is neither a folder (no such directory: "
                              f"{tmp_path}/ff-tests/private) nor a reachable hub id: "
                              "ff-tests/private is not a local folder and is not a valid model identifier")


def test_a_cached_hub_id_still_loads_offline(tmp_path):
    """HF_HUB_OFFLINE=1 with the id in the hub cache: loaded from the cache, untouched by the checks."""
    cache = tmp_path / "hub"
    repo = cache / "models--ff-tests--cached"
    write_scheduler(repo / "snapshots" / REVISION, shift=2.5)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    script = textwrap.dedent("""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from ff_core.pretrained import load_pretrained

        class SchedulerOnly:
            name = "scheduler-only"
            from_pretrained = staticmethod(lambda path: FlowMatchEulerDiscreteScheduler.from_pretrained(
                path, subfolder="scheduler"))

        print(load_pretrained(SchedulerOnly, "ff-tests/cached", {}).config.shift)
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    # A subprocess: huggingface_hub reads HF_HUB_CACHE when it is imported.
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "2.5"
