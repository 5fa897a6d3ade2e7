"""``ff data validate`` on the repo's example datasets and on broken copies of them."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from data_helpers import EXAMPLES, REPO, make_media

from ff_core.cli.data import main
from ff_core.data.records.sources import DatasetConfig, load_split

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
    bad = ['{"schema_version": 2, "input": {"prompt": null}, "supervision": {"type": "demonstration"}}',
           lines[0].replace('"image"', '"picture"'), "", "{not json"]
    (d / "train.jsonl").write_text("\n".join(lines + bad) + "\n")
    code, out = run("validate", d)
    assert code == 2
    assert out.splitlines() == [
        f"{d}/train.jsonl:3: input.prompt: expected a string, found null",
        f"{d}/train.jsonl:4: supervision.target.media[0].type: unknown media type 'picture' (image, video or audio)",
        f"{d}/train.jsonl:5: blank line (every line must hold one JSON object)",
        f"{d}/train.jsonl:6: invalid JSON: Expecting property name enclosed in double quotes at column 2",
        f"ff data validate: 4 problem(s) in {d}",
    ]


def test_missing_train_split(broken):
    d = broken("sd3_dpo")
    (d / "train.jsonl").unlink()
    code, out = run("validate", d)
    assert out.splitlines() == [
        f"{d}: dataset 'sd3_dpo': no training split (neither train.jsonl nor train.txt exists)",
        f"ff data validate: 1 problem(s) in {d}",
    ] and code == 2


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
    assert code == 2 and "test.jsonl:1: image: /nowhere/first.png: file not found" in out  # the column as written
    (examples / "empty").mkdir(exist_ok=True)
    (examples / "empty" / "train.txt").write_text("a prompt\n")
    code, out = run("validate", examples / "empty", "--split", "test")
    assert code == 2 and f"{examples / 'empty'}: dataset 'empty': no evaluation split" in out
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
        f.write('{"prompt": "no cfg", "negative_prompt": "x", "references": [{"type": "image", "path": "a.png"}]}\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]), "FF_DISABLE_PLUGIN_AUTOLOAD": "1"}
    # `python -m ff_core.cli.data` is `ff data` without the Lightning CLI imports (seconds faster).
    proc = subprocess.run([sys.executable, "-m", "ff_core.cli.data", "validate", str(d), "--model",
                           "my_adapters:Ref2VA"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        f"{d}/test.jsonl:3: negative_prompt: this adapter has no classifier-free guidance; remove negative_prompt",
        f"{d}/test.jsonl:3: references[0].path: {d}/a.png: file not found",
        f"ff data validate: 2 problem(s) in {d}",
    ]


# --- Flow-Factory prompt sets: reward metadata columns ----------------------------------------------------------
GENEVAL = [  # GenEval-style: the reward reads tag / include / exclude (written as JSON text, as GenEval ships it)
    {"tag": "color_attr", "include": '[{"class": "bench", "count": 1, "color": "blue"}]', "exclude": "[]",
     "prompt": "a photo of a blue bench"},
    {"tag": "counting", "include": '[{"class": "cat", "count": 2}]', "exclude": '[{"class": "cat", "count": 3}]',
     "prompt": "a photo of two cats"},
]
SUDOKU = [  # Sudoku-style: a condition image plus the puzzle the reward checks the generated grid against
    {"prompt": "Generate an image showing the solved Sudoku grid.", "image": "clue70_0026.png", "clue": 70,
     "puzzle": "4090001000081" + "0" * 68, "solution": "4793861255381" + "9" * 68},
    {"prompt": "Generate an image showing the solved Sudoku grid.", "image": "clue30_0063.png", "clue": 30,
     "puzzle": "7385691249412" + "0" * 68, "solution": "7385691249412" + "1" * 68},
]


def prompt_set(root: Path, rows: list[dict], images: tuple[str, ...] = ()) -> Path:
    root.mkdir(parents=True)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in images:
        make_media.write_png(root / "images" / name, size=(8, 8), colour=(0, 0, 0))
    return root


def test_geneval_and_sudoku_prompt_sets_keep_their_metadata(tmp_path, table_registry):
    geneval = prompt_set(tmp_path / "geneval", GENEVAL)
    sudoku = prompt_set(tmp_path / "sudoku", SUDOKU, ("clue70_0026.png", "clue30_0063.png"))
    code, out = run("validate", geneval, "--trainer", "grpo", "--model", "sd3-5")
    assert code == 0, out
    assert out.splitlines() == [
        f"{geneval}: OK against 'sd3-5'",
        "  train.jsonl: 2 rows, generation; media: none",
        "    metadata: exclude (2 rows), include (2 rows), tag (2 rows)",
    ]
    code, out = run("validate", sudoku, "--trainer", "grpo", "--model", "flux1-kontext", "--check-media")
    assert code == 0, out
    assert out.splitlines()[1:] == [
        "  train.jsonl: 2 rows, generation; media: image 2; decoded video 0.00 s, audio 0.00 s",
        "    metadata: clue (2 rows), puzzle (2 rows), solution (2 rows)",
    ]
    records = load_split(DatasetConfig(name="sudoku", dataset_dir=str(sudoku)), "train", "grpo")
    assert [r.metadata for r in records] == [{k: v for k, v in row.items() if k not in ("prompt", "image")}
                                             for row in SUDOKU]
    assert [r.inputs[0].path for r in records] == [sudoku / "images" / row["image"] for row in SUDOKU]
    records = load_split(DatasetConfig(name="geneval", dataset_dir=str(geneval)), "train", "grpo")
    assert records[0].metadata == {"tag": "color_attr", "include": GENEVAL[0]["include"], "exclude": "[]"}


def test_misspelt_columns_are_listed_with_the_closest_known_column(tmp_path):
    d = prompt_set(tmp_path / "typos", [{"prompt": "p", "negativ_prompt": "blurry", "imgae": "a.png", "tag": "x"},
                                        {"prompt": "q", "tag": "y"}])
    code, out = run("validate", d)
    assert code == 0, out
    assert out.splitlines()[2] == ("    metadata: imgae (1 row; did you mean 'image'?), negativ_prompt (1 row; "
                                   "did you mean 'negative_prompt'?), tag (2 rows)")
    (d / "train.jsonl").write_text('{"promt": "a hill"}\n')
    code, out = run("validate", d)
    assert out.splitlines()[0] == (f"{d}/train.jsonl:1: prompt: required key is missing "
                                   "(is 'promt' a misspelling of it?)")


def test_references_for_an_adapter_without_references_are_metadata_with_a_warning(examples, table_registry):
    d = examples / "h3_ref2va_dpo"
    code, out = run("validate", d, "--model", "sd3-5", "--split", "test")
    assert code == 0, out
    assert out.splitlines() == [
        f"{d}: OK against 'sd3-5'",
        "  test.jsonl: 2 rows, generation; media: none",
        "    metadata: references (2 rows)",
        f"{d}/test.jsonl:1: warning: references: kept as metadata, not a model input: adapter 'sd3-5' takes no "
        "ordered references (2 rows: lines 1, 2)",
    ]


def test_reference_rules_apply_to_the_column_without_a_model(broken):
    d = broken("h3_ref2va_dpo")
    with (d / "test.jsonl").open("a") as f:
        f.write('{"prompt": "audio only", "references": [{"type": "audio", "path": "references/ambience.wav"}]}\n')
        f.write(json.dumps({"prompt": "too many", "references": [{"type": "image", "path": "a.png"}] * 13}) + "\n")
    code, out = run("validate", d, "--split", "test")
    assert code == 2
    assert out.splitlines() == [
        f"{d}/test.jsonl:3: references: needs at least one image or video reference (found only audio)",
        f"{d}/test.jsonl:4: references: needs 1-12 references, found 13",
        f"ff data validate: 2 problem(s) in {d}",
    ]


def test_missing_folder_reported_once(tmp_path):
    d = tmp_path / "nope"
    for split in ([], ["--split", "test"]):
        code, out = run("validate", d, *split)
        assert code == 2 and out.splitlines() == [
            f"{d}: dataset_dir: dataset 'nope': folder does not exist",
            f"ff data validate: 1 problem(s) in {d}",
        ]


def test_check_media_reports_a_missing_video_and_its_missing_audio_path(broken):
    d = broken("h3_ref2va_dpo")
    (d / "references" / "motion.mp4").unlink()
    (d / "references" / "ambience.wav").unlink()
    code, out = run("validate", d, "--split", "test", "--check-media")
    assert code == 2
    assert out.splitlines() == [
        f"{d}/test.jsonl:1: references[1].path: {d}/references/motion.mp4: file not found",
        f"{d}/test.jsonl:1: references[2].path: {d}/references/ambience.wav: file not found",
        f"{d}/test.jsonl:2: references[0].path: {d}/references/motion.mp4: file not found",
        f"{d}/test.jsonl:2: references[0].audio_path: {d}/references/ambience.wav: file not found",
        f"ff data validate: 4 problem(s) in {d}",
    ]
