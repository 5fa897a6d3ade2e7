"""The `ff` command itself: its help, unknown commands, quiet exits into closed pipes, and `ff fit` mistakes
that end with one line naming the config key instead of a traceback."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ff_core.cli import EXIT_BROKEN_PIPE, main
from ff_core.plugins import get_registry

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "sd3" / "sft_tiny.yaml"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
    [str(REPO), str(REPO / "plugins" / "ff_sd3"), os.environ.get("PYTHONPATH", "")])}


def test_help_describes_ff_and_lists_every_subcommand(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "usage: ff {fit,validate,test,predict} [--config recipe.yaml] [--section.key value ...]"
    assert lines[1:11] == ["       ff data {validate,inspect} DATASET_DIR [options]",
                           "       ff data preprocess --config recipe.yaml [--section.key value ...]",
                           "       ff data preprocess-latents --config recipe.yaml --output ROOT "
                           "[--section.key value ...]",
                           "       ff data smoke build OUT [--seed N] [--overwrite]",
                           "       ff data smoke prepare --algorithm {sft,offline-dpo} --profile NAME_OR_ALIAS "
                           "--world-size N [options]",
                           "       ff data smoke list",
                           "       ff plugins",
                           "       ff plugins new NAME [--dir DIR] [--output {image,video,video+audio}]",
                           "       ff rewards serve --reward NAME [--args JSON_OR_YAML] [--host 127.0.0.1] [--port 0] "
                           "[--device cpu]",
                           "       ff rewards list"]
    assert lines[12].startswith("ff post-trains flow-matching models on PyTorch Lightning.")
    block = lines[lines.index("commands:") + 1 : lines.index("", lines.index("commands:"))]
    assert [line[2:].split("  ")[0] for line in block] == [
        "fit", "validate", "test", "predict", "data validate", "data inspect", "data preprocess",
        "data preprocess-latents", "data smoke", "plugins", "plugins new", "rewards serve", "rewards list"]
    assert lines[-1] == "`ff COMMAND --help` shows a command's options (`ff fit --help` lists every config key)."
    assert main(["-h"]) == 0 and capsys.readouterr().out == out


def test_no_arguments_prints_the_help_and_fails(capsys):
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("usage: ff {fit,validate,test,predict}")


def test_unknown_command_names_the_closest(capsys):
    assert main(["dta", "validate", "x"]) == 2
    assert capsys.readouterr().err == (
        "ff: unknown command 'dta'; did you mean 'data'? (commands: fit, validate, test, predict, data, plugins,"
        " rewards; see ff --help)\n")


def test_plugins_takes_no_arguments_but_new(capsys):
    assert main(["plugins", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: ff plugins\n       ff plugins new NAME [--dir DIR] [--output "
                                              "{image,video,video+audio}]\n")
    assert main(["plugins", "sd3-5"]) == 2
    assert capsys.readouterr().err == ("usage: ff plugins [new NAME [--dir DIR]]\n"
                                       "ff plugins: takes no arguments but 'new', found 'sd3-5'\n")


@pytest.fixture(scope="module")
def many_rows(tmp_path_factory) -> Path:
    """A dataset whose report is far longer than a pipe's buffer: 3000 rows naming missing images."""
    root = tmp_path_factory.mktemp("many")
    (root / "train.jsonl").write_text("".join(json.dumps({"prompt": "p", "image": f"{i}.png"}) + "\n"
                                              for i in range(3000)))
    return root


@pytest.mark.parametrize("command", [
    ["data", "validate", "{dir}"], ["data", "inspect", "{dir}"], ["data", "inspect", "{dir}", "--json"],
    ["plugins"], ["--help"],
], ids=" ".join)
def test_a_closed_pipe_ends_quietly(command, many_rows):
    """`ff ... | head`: the reader goes away; ff stops with 141 (as if killed by SIGPIPE) and prints nothing more."""
    args = [a.format(dir=many_rows) for a in command]
    proc = subprocess.Popen([sys.executable, "-m", "ff_core.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=ENV)
    proc.stdout.close()  # closed before ff writes anything: every write meets a broken pipe
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == EXIT_BROKEN_PIPE, stderr
    assert stderr == ""


def fit_args(tmp_path, datasets, *extra):
    return ["fit", "--config", str(RECIPE), "--data.datasets", json.dumps(datasets),
            "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false", "--trainer.max_steps", "1",
            *extra]


def test_fit_with_an_unknown_adapter_prints_one_line(tmp_path):
    """The console script end to end: exit status 2 and the last stderr line names the key; no traceback."""
    args = fit_args(tmp_path, [{"name": "d", "dataset_dir": str(tmp_path)}], "--model.adapter", "sd3")
    result = subprocess.run([sys.executable, "-m", "ff_core.cli", *args], capture_output=True, text=True, env=ENV,
                            timeout=300)
    known = ", ".join(sorted(get_registry().adapters()))
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == (
        f"ff fit: model.adapter: unknown adapter 'sd3'; did you mean 'sd3-5'? (registered adapters: {known})")
    assert "Traceback" not in result.stderr


def test_fit_with_a_missing_checkpoint_prints_one_line(shapes_dir, tmp_path, capsys):
    """The data are read and checked first (they are fine here), then the checkpoint path fails: one line."""
    missing = tmp_path / "no-such-checkpoint"
    args = fit_args(tmp_path, [{"name": "shapes", "dataset_dir": str(shapes_dir)}],
                    "--model.pretrained_model_name_or_path", str(missing))
    assert main(args) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"ff fit: model.pretrained_model_name_or_path: {str(missing)!r} is neither a folder (no such directory: "
        f"{missing}) nor a hub id ('name' or 'org/name')")


def test_fit_with_an_uncached_hub_id_offline_prints_one_line(shapes_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = fit_args(tmp_path, [{"name": "shapes", "dataset_dir": str(shapes_dir)}],
                    "--model.pretrained_model_name_or_path", "build/tiny-sd3")
    assert main(args) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "ff fit: model.pretrained_model_name_or_path: 'build/tiny-sd3' is neither a folder (no such directory: "
        f"{tmp_path}/build/tiny-sd3) nor a hub id in the local hub cache (HF_HUB_OFFLINE is set, so the hub was not "
        "asked)")
