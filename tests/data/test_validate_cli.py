"""``ff data validate`` on the repo's example datasets and on broken copies of them."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from data_helpers import EXAMPLES, REPO

from ff_core.data.commands import main

# example folder -> (support-table adapter, extra arguments)
EXAMPLE_MODELS = {
    "t2i_prompts": ("sd3-5", ["--trainer", "grpo"]),
    "sd3_sft": ("sd3-5", ["--trainer", "sft"]),
    "sd3_dpo": ("sd3-5", ["--trainer", "offline-dpo"]),
    "wan_i2v_sft": ("wan2_i2v-2.1", []),
    "h3_t2va_sft": ("minimax-h3-t2va", []),
    "h3_fl2va": ("minimax-h3-fl2va", ["--image-dir", "{dir}"]),
    "h3_ref2va_dpo": ("minimax-h3-ref2va", []),
}


def run(*argv) -> tuple[int, str]:
    out = io.StringIO()
    code = main([str(a) for a in argv], out=out)
    return code, out.getvalue()


def test_every_example_is_listed():
    assert sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))) == sorted(
        EXAMPLE_MODELS)


@pytest.mark.parametrize("name", sorted(EXAMPLE_MODELS))
def test_examples_validate_against_their_adapter(examples, table_registry, name):
    model, extra = EXAMPLE_MODELS[name]
    directory = examples / name
    code, out = run("validate", directory, "--model", model, "--check-media",
                    *[a.format(dir=directory) for a in extra])
    assert code == 0, out
    assert out.splitlines()[0] == f"{directory}: OK against {model!r}"
    assert "train." in out and "decoded video" in out


def test_summary_counts(examples):
    code, out = run("validate", examples / "h3_ref2va_dpo", "--check-media")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].endswith("OK (format only: pass --model to check an adapter's contract)")
    assert lines[1].startswith("  train.jsonl: 1 row, preference; media: image 1, video 2, audio 3;"
                               " decoded video 1.00 s")
    assert lines[2].startswith("  test.jsonl: 2 rows, generation; media: image 1, video 2, audio 2;"
                               " decoded video 1.50 s")
    code, out = run("validate", examples / "sd3_sft", "--split", "train")
    assert out.splitlines()[1:] == ["  train.jsonl: 2 rows, demonstration; media: image 2"]


def test_broken_rows_print_every_diagnostic(broken, table_registry):
    d = broken("sd3_sft")
    lines = (d / "train.jsonl").read_text().splitlines()
    bad = ['{"schema_version": 2, "input": {"prompt": ""}, "supervision": {"type": "demonstration"}}',
           lines[0].replace('"image"', '"picture"'), "", "{not json"]
    (d / "train.jsonl").write_text("\n".join(lines + bad) + "\n")
    code, out = run("validate", d)
    assert code == 2
    assert out.splitlines() == [
        f"{d}/train.jsonl:3: input.prompt: must not be empty",
        f"{d}/train.jsonl:4: supervision.target.media[0].type: unknown media type 'picture' (image, video or audio)",
        f"{d}/train.jsonl:5: blank line (every line must hold one JSON object)",
        f"{d}/train.jsonl:6: invalid JSON: Expecting property name enclosed in double quotes at column 2",
        f"ff data validate: 4 problem(s) in {d}",
    ]


def test_missing_train_split(broken):
    d = broken("sd3_dpo")
    (d / "train.jsonl").unlink()
    code, out = run("validate", d)
    assert code == 2
    assert f"{d}:0: dataset 'sd3_dpo': no training split (neither train.jsonl nor train.txt exists)" in out


def test_missing_and_corrupt_media(broken):
    d = broken("h3_ref2va_dpo")
    (d / "references" / "ambience.wav").unlink()
    (d / "pairs" / "chosen.mp4").write_bytes((d / "pairs" / "chosen.mp4").read_bytes()[:300])
    code, out = run("validate", d)  # without --check-media: existence only
    assert code == 2
    assert f"{d}/train.jsonl:1: input.media[1].path: {d}/references/ambience.wav: file not found" in out
    assert f"{d}/test.jsonl:1: references[2].path: {d}/references/ambience.wav: file not found" in out
    assert f"{d}/test.jsonl:2: references[0].audio_path: {d}/references/ambience.wav: file not found" in out
    assert "chosen.mp4" not in out
    code, out = run("validate", d, "--check-media")
    assert code == 2
    assert f"{d}/train.jsonl:1: supervision.chosen.media[0].path: {d}/pairs/chosen.mp4: cannot decode video" in out


def test_contract_and_trainer_mismatch(examples, table_registry):
    code, out = run("validate", examples / "h3_t2va_sft", "--model", "sd3-5")
    assert code == 2
    assert ("train.jsonl:1: supervision.target.media: expected outputs (image) in this order, found (video, audio)"
            in out)
    code, out = run("validate", examples / "sd3_sft", "--trainer", "offline-dpo", "--split", "train")
    assert code == 2 and out.count("supervision.type: this trainer needs 'preference' records") == 2
    code, out = run("validate", examples / "h3_fl2va", "--model", "minimax-h3-fl2va", "--split", "test",
                    "--image-dir", examples / "h3_fl2va")
    assert code == 0, out
    code, out = run("validate", examples / "t2i_prompts", "--model", "minimax-h3-t2va")
    assert code == 2 and out.count("negative_prompt: this adapter has no classifier-free guidance") == 2


def test_usage_errors(examples, table_registry, capsys):
    code, out = run("validate", examples / "sd3_sft", "--model", "no-such-adapter")
    assert code == 2 and "--model: unknown adapter 'no-such-adapter'" in out
    code, out = run("validate", examples / "t2i_prompts", "--split", "test")
    assert code == 0
    code, out = run("validate", examples / "wan_i2v_sft", "--split", "test", "--image-dir", "/nowhere")
    assert code == 2 and "test.jsonl:1: image.path: /nowhere/first.png: file not found" in out
    (examples / "empty").mkdir(exist_ok=True)
    (examples / "empty" / "train.txt").write_text("a prompt\n")
    code, out = run("validate", examples / "empty", "--split", "test")
    assert code == 2 and "no evaluation split" in out
    assert run("validate", "--trainer", "ppo", "x")[0] == 2
    assert run()[0] == 2
    capsys.readouterr()


def test_subprocess_with_dotted_adapter_path(broken, tmp_path):
    (tmp_path / "my_adapters.py").write_text(
        "from ff_core.adapter import Adapter\n"
        "from ff_core.testing.contracts import SUPPORT_TABLE\n"
        "class Ref2VA(Adapter):\n"
        "    name = 'my-ref2va'\n"
        "    io_contract = SUPPORT_TABLE['minimax-h3-ref2va']\n"
    )
    d = broken("h3_ref2va_dpo")
    with (d / "test.jsonl").open("a") as f:
        f.write('{"prompt": "audio only", "negative_prompt": "x",'
                ' "references": [{"type": "audio", "path": "a.wav"}]}\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]), "FF_DISABLE_PLUGIN_AUTOLOAD": "1"}
    # `python -m ff_core.data.commands` is `ff data` without the Lightning CLI imports (seconds faster).
    proc = subprocess.run([sys.executable, "-m", "ff_core.data.commands", "validate", str(d), "--model",
                           "my_adapters:Ref2VA"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        f"{d}/test.jsonl:3: negative_prompt: this adapter has no classifier-free guidance; remove negative_prompt",
        f"{d}/test.jsonl:3: references: needs at least one image or video reference (found only audio)",
        f"{d}/test.jsonl:3: references[0].path: {d}/a.wav: file not found",
        f"ff data validate: 3 problem(s) in {d}",
    ]
