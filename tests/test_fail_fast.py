"""One line, at once, instead of a traceback or a long wait (issue 24 item 11, in part): a missing local checkpoint
path, GRPO with DataLoader workers, a manifest that is not UTF-8."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ff_core.errors import ConfigError
from ff_core.pretrained import checkpoint_problem, load_pretrained

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "sd3" / "sft_tiny.yaml"
KEY = "model.pretrained_model_name_or_path"


def online_env(**extra) -> dict[str, str]:
    """The environment of a user with the hub switched on but unreachable (a closed local port, no DNS wait): where
    huggingface_hub retries five times (1 + 2 + 4 + 8 + 8 s) before giving up."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    return {**env, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_ETAG_TIMEOUT": "1", **extra}


class SchedulerOnly:
    name = "scheduler-only"

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        raise AssertionError("the hub must not be asked")


def test_a_missing_folder_under_an_existing_one_is_a_local_path_offline(tmp_path, monkeypatch):
    """``build/tiny-sd3`` with ``build/`` here under HF_HUB_OFFLINE: a local folder that was not built, refused."""
    import huggingface_hub

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: True)
    (tmp_path / "build").mkdir()
    problem = ("'build/tiny-sd3' is not a folder (no such directory: {}/build/tiny-sd3; 'build/' is a folder here and "
               "HF_HUB_OFFLINE is set, so this names a local path, not a cached hub id)").format(tmp_path)
    assert checkpoint_problem("build/tiny-sd3") == problem
    with pytest.raises(ConfigError) as err:
        load_pretrained(SchedulerOnly, "build/tiny-sd3", {})
    assert str(err.value) == f"{KEY}: {problem}"
    # Without the local folder it may be a hub id (org 'ff-tests'): left to the hub, as before.
    assert checkpoint_problem("ff-tests/tiny-sd3") is None


def test_an_org_name_hub_id_is_left_to_the_hub_online_even_with_an_org_folder_here(tmp_path, monkeypatch):
    """Online, ``org/name`` is a hub id although a folder ``org/`` happens to exist here (review of issue 24): the
    hub is asked (before, it was refused as a missing local folder). A path written as local still fails at once."""
    import huggingface_hub

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: False)
    (tmp_path / "stabilityai").mkdir()
    assert checkpoint_problem("stabilityai/stable-diffusion-3.5-medium") is None
    for local in ("./stabilityai/sd3", "../stabilityai/sd3", f"{tmp_path}/stabilityai/sd3", "~/no-such-ff-folder"):
        assert "is neither a folder" in checkpoint_problem(local), local


def test_ff_fit_with_a_missing_local_checkpoint_fails_at_once_online(shapes_dir, tmp_path):
    """A real ``ff fit`` with the hub switched on and a path written as local: before, ~30 s of hub retries, then
    'nor a reachable hub id'."""
    (tmp_path / "build").mkdir()
    datasets = json.dumps([{"name": "s", "dataset_dir": str(shapes_dir)}])
    args = ["fit", "--config", str(RECIPE), "--data.datasets", datasets,
            "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.logger", "false", "--trainer.max_steps",
            "1", "--model.pretrained_model_name_or_path", "./build/tiny-sd3"]
    result = subprocess.run([sys.executable, "-m", "ff_core.cli", *args], capture_output=True, text=True,
                            env=online_env(), cwd=tmp_path, timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == (
        f"ff fit: {KEY}: './build/tiny-sd3' is neither a folder (no such directory: {tmp_path}/build/tiny-sd3) nor "
        "a hub id ('name' or 'org/name')")
    # Before: "Retrying in 1s [Retry 1/5]" ... (1 + 2 + 4 + 8 + 8 s of back-off) before the error.
    assert "Retrying" not in result.stderr and "127.0.0.1:9" not in result.stderr


def latin1_line(path: Path, line: int, old: str, new: str) -> bytes:
    """Replace ``old`` by ``new`` on 1-based ``line`` of ``path``, that line encoded as Latin-1 (what an editor set to
    cp1252 writes); return the line's bytes."""
    lines = path.read_bytes().split(b"\n")
    lines[line - 1] = lines[line - 1].decode("utf-8").replace(old, new).encode("latin-1")
    path.write_bytes(b"\n".join(lines))
    return lines[line - 1]


def test_a_latin1_line_of_train_jsonl_is_named_by_ff_fit(shapes_dir, tmp_path, capsys):
    import shutil

    from ff_core.cli import main

    data = tmp_path / "data"
    shutil.copytree(shapes_dir, data)
    raw = latin1_line(data / "train.jsonl", 3, "a ", "un café ")
    # The reference: Python's own UTF-8 decoder on the line alone (0xe9 'é' followed by a space: not a continuation).
    with pytest.raises(UnicodeDecodeError) as ref:
        raw.decode("utf-8")
    args = ["fit", "--config", str(RECIPE), "--data.datasets", json.dumps([{"name": "s", "dataset_dir": str(data)}]),
            "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.logger", "false"]
    assert main(args) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"{data / 'train.jsonl'}:3: not UTF-8 text: {ref.value.reason} (byte 0xe9 at column {ref.value.start + 1}); "
        "save the file as UTF-8")


def test_every_cp1252_line_of_train_txt_is_named(tmp_path, capsys):
    from ff_core.cli import main

    (tmp_path / "train.txt").write_bytes("a red circle\nun café noir\n\nune crème\na square\n".encode("cp1252"))
    assert main(["data", "validate", str(tmp_path), "--trainer", "grpo"]) != 0
    out = capsys.readouterr().out
    path = tmp_path / "train.txt"
    assert f"{path}:2: not UTF-8 text: invalid continuation byte (byte 0xe9 at column 7); save the file as UTF-8" in out
    assert f"{path}:4: not UTF-8 text: invalid continuation byte (byte 0xe8 at column 7); save the file as UTF-8" in out
    assert ":1:" not in out and ":5:" not in out


def test_grpo_with_two_workers_is_one_line_before_weights_load(tmp_path):
    """Today a ValueError traceback from the data module's constructor; now ``ff fit: data.num_workers: ...``. That it
    comes before any weight loads: the checkpoint named does not exist, and its error would come first otherwise."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    args = ["fit", "--config", str(REPO / "configs" / "sd3" / "grpo_tiny.yaml"), "--data.num_workers", "2",
            "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.logger", "false",
            "--model.pretrained_model_name_or_path", str(tmp_path / "weights-never-read")]
    result = subprocess.run([sys.executable, "-m", "ff_core.cli", *args], capture_output=True, text=True, env=env,
                            cwd=REPO, timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == (
        "ff fit: data.num_workers: 2 with grpo: an online step holds whole prompt groups, served by one stream per "
        "rank, and workers would split them; use 0 or 1 (prompts need no decoding)")
