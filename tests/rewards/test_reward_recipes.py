"""The new rewards inside Flow-GRPO runs through ``ff fit`` on the CPU: ``ocr`` in the tiny SD3 recipe
(configs/sd3/grpo_tiny.yaml) and ``clap`` on the audio of the tiny LTX-2 text-to-audio+video recipe
(configs/ltx2/grpo_tiny.yaml), one iteration each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_reward_models import build_tiny_clap

from ff_core.testing.recipes import fit_tiny

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def shrunk(*rewards: dict) -> list[str]:
    """One iteration of 2 prompts x 2 samples, 3 sampler steps (SDE on the first 2), no evaluation."""
    return ["--model.objective.init_args.rewards", json.dumps(list(rewards)),
            "--model.objective.init_args.group_size", "2", "--model.objective.init_args.prompts_per_step", "2",
            "--model.objective.init_args.num_steps", "3", "--model.objective.init_args.micro_batch_size", "4",
            "--model.objective.init_args.sampler", json.dumps({"kind": "flow_sde", "eta": 0.7, "window": [0, 2]}),
            "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0", "--trainer.callbacks", "[]",
            "--trainer.enable_progress_bar", "false"]  # fmt: skip


def prompts(folder: Path, lines: list[str]) -> list[dict]:
    folder.mkdir()
    for split in ("train", "test"):
        (folder / f"{split}.txt").write_text("\n".join(lines) + "\n")
    return [{"name": "prompts", "dataset_dir": str(folder)}]


def lora_moved(cli) -> bool:
    """Whether the LoRA's up-projections (zero when attached) moved: the step had a gradient."""
    return any(p.abs().sum() > 0 for n, p in cli.model.named_parameters() if "lora_B" in n)


def test_sd3_grpo_with_the_ocr_reward(tiny_sd3, tmp_path):
    """Text-rendering prompts; the OCR reads the 32 x 32 samples (the tiny model draws no text: ocr scores about 0)
    beside the colour reward (closeness), which gives the advantages a spread: one optimiser step moves the LoRA."""
    data = prompts(tmp_path / "prompts", ['a sign that says "OPEN"', 'a red "SALE" banner'])
    cli = fit_tiny(CONFIGS / "sd3" / "grpo_tiny.yaml", tiny_sd3, data, tmp_path / "run",
                   *shrunk({"name": "ocr"}, {"name": "colour"}))  # fmt: skip
    metrics = cli.trainer.callback_metrics
    assert cli.trainer.global_step == 1
    assert 0 <= float(metrics["train/reward/ocr_mean"]) <= 1
    assert lora_moved(cli)


@pytest.fixture(scope="module")
def tiny_ltx2_t2av(tmp_path_factory):
    from ff_ltx2.testing import build_tiny_ltx2

    return build_tiny_ltx2(tmp_path_factory.mktemp("tiny-ltx2-t2av"), variant="t2av")


def test_ltx2_grpo_with_the_clap_reward(tiny_ltx2_t2av, tmp_path):
    """The clap reward alone scores the audio of each (video, audio) sample (16 kHz stereo, resampled to the tiny
    CLAP's 8 kHz mono); its spread within each group drives one PPO step that moves the LoRA."""
    clap = build_tiny_clap(tmp_path / "clap")
    data = prompts(tmp_path / "prompts", ["a dog barks", "rain on a roof"])
    cli = fit_tiny(CONFIGS / "ltx2" / "grpo_tiny.yaml", tiny_ltx2_t2av, data, tmp_path / "run",
                   *shrunk({"name": "clap", "args": {"pretrained_model_name_or_path": str(clap)}}))  # fmt: skip
    metrics = cli.trainer.callback_metrics
    assert cli.trainer.global_step == 1
    assert -1 <= float(metrics["train/reward/clap_mean"]) <= 1 and float(metrics["train/reward/clap_std"]) > 0
    assert lora_moved(cli)
