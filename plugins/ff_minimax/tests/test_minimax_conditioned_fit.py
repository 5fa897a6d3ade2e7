"""``ff fit`` on the CPU with the conditioned MiniMax H3 recipes (FL2VA keyframes, Ref2VA references; SFT, offline DPO,
GRPO; 2 steps each) from generated datasets, and their inputs refused before weights load with the record's line."""

from __future__ import annotations

import json
import re

import pytest
import torch
from ff_minimax.ref2va import video_references_available
from ff_minimax.testing import (
    write_keyframe_clips,
    write_keyframe_prompts,
    write_reference_clips,
    write_reference_prompts,
)
from test_minimax_fit import CONFIGS, fit

from ff_core.cli import main


def test_fl2va_sft_recipe_trains_on_first_last_and_both_keyframe_records(tiny_minimax, tmp_path):
    data = write_keyframe_clips(tmp_path / "keyframes", 3)
    slots = [[m["slot"] for m in json.loads(line)["input"]["media"]]
             for line in (data / "train.jsonl").read_text().splitlines()]  # fmt: skip
    assert slots == [["first_frame"], ["last_frame"], ["first_frame", "last_frame"]]
    cli = fit("fl2va_sft_tiny.yaml", tiny_minimax("fl2va"), [{"name": "keyframes", "dataset_dir": str(data),
              "eval": {}}], tmp_path / "run", "--trainer.max_steps", "3")  # fmt: skip
    assert cli.trainer.global_step == 3 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    version = next((tmp_path / "run" / "lightning_logs").iterdir())
    assert (version / "checkpoints" / "last.lora" / "pytorch_lora_weights.safetensors").stat().st_size > 0


def test_fl2va_offline_dpo_recipe_trains_on_pairs(tiny_minimax, tmp_path):
    data = write_keyframe_clips(tmp_path / "pairs", 2, preference=True)
    cli = fit("fl2va_offline_dpo_tiny.yaml", tiny_minimax("fl2va"), [{"name": "pairs", "dataset_dir": str(data),
              "eval": {}}], tmp_path / "run")  # fmt: skip
    assert cli.trainer.global_step == 2 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])


def test_fl2va_grpo_recipe_trains_on_its_rollouts(tiny_minimax, tmp_path):
    data = write_keyframe_prompts(tmp_path / "prompts", 2)
    assert [len(json.loads(r)["images"]) for r in (data / "train.jsonl").read_text().splitlines()] == [1, 2]
    cli = fit("fl2va_grpo_tiny.yaml", tiny_minimax("fl2va"), [{"name": "prompts", "dataset_dir": str(data),
              "eval": {}}], tmp_path / "run", "--model.objective.init_args.num_steps", "3",
              "--model.objective.init_args.sampler",
              json.dumps({"kind": "flow_sde", "eta": 0.7, "window": [0, 2], "num_sde_steps": None}))  # fmt: skip
    metrics = cli.trainer.callback_metrics
    assert cli.trainer.global_step == 2 and torch.isfinite(metrics["train/policy_loss"])
    assert float(metrics["train/ratio_first_max_dev"]) == 0.0  # replay of the rollouts' target-only log-probs


@pytest.fixture
def no_fl2va_weights(monkeypatch):
    from ff_minimax.fl2va import MiniMaxH3FL2VAAdapter

    def refuse(*args, **kwargs):
        raise AssertionError("weights loaded before the records were checked")

    monkeypatch.setattr(MiniMaxH3FL2VAAdapter, "_components", classmethod(refuse))


@pytest.mark.parametrize(("rows", "message"), [
    ([{"prompt": "p", "images": ["000_first.png"] * 3}], r"train\.jsonl:1: images\[2\]: 3 condition item\(s\), but "
                                                         r"this adapter takes at most 2"),
    ([{"prompt": "p", "images": ["000_first.png"]}, {"prompt": "q"}], r"train\.jsonl:2: images: bind at least 1"),
    ([{"prompt": "p", "images": ["000_first.png"], "negative_prompt": "x"}],
     r"train\.jsonl:1: negative_prompt: this adapter has no classifier-free guidance"),
])  # fmt: skip
def test_fl2va_rows_breaking_the_slot_rules_fail_before_weights_load(tiny_minimax, tmp_path, capsys, no_fl2va_weights,
                                                                     rows, message):
    data = write_keyframe_prompts(tmp_path / "prompts", 1)
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["data", "validate", "--model", "minimax-h3-fl2va", "--split", "train", str(data)]) != 0
    err = capsys.readouterr()
    assert any(re.search(message, s) for s in (err.out, err.err)), err.out + err.err
    with pytest.raises(Exception, match=message.split(": ", 1)[1]) as info:
        fit("fl2va_grpo_tiny.yaml", tiny_minimax("fl2va"), [{"name": "p", "dataset_dir": str(data)}], tmp_path / "r")
    assert "weights loaded" not in str(info.value)


def test_recipes_exist_for_every_conditioned_cell():
    names = {p.stem for p in CONFIGS.glob("*_tiny.yaml")}
    assert {f"{w}_{o}_tiny" for w in ("fl2va", "ref2va") for o in ("sft", "offline_dpo", "grpo")} <= names


def test_ref2va_sft_recipe_trains_on_ordered_references(tiny_minimax, tmp_path):
    data = write_reference_clips(tmp_path / "references", 3)
    kinds = [[m["type"] for m in json.loads(line)["input"]["media"]]
             for line in (data / "train.jsonl").read_text().splitlines()]  # fmt: skip
    assert kinds == [["image"], ["image", "audio"], ["audio", "image", "image"]]
    cli = fit("ref2va_sft_tiny.yaml", tiny_minimax("ref2va"), [{"name": "references", "dataset_dir": str(data),
              "eval": {}}], tmp_path / "run", "--trainer.max_steps", "3")  # fmt: skip
    assert cli.trainer.global_step == 3 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    version = next((tmp_path / "run" / "lightning_logs").iterdir())
    lora = version / "checkpoints" / "last.lora" / "pytorch_lora_weights.safetensors"
    from safetensors.torch import load_file

    assert all(k.startswith("transformer_ref.") for k in load_file(lora))


def test_ref2va_offline_dpo_recipe_trains_on_pairs(tiny_minimax, tmp_path):
    data = write_reference_clips(tmp_path / "pairs", 2, preference=True)
    cli = fit("ref2va_offline_dpo_tiny.yaml", tiny_minimax("ref2va"), [{"name": "pairs", "dataset_dir": str(data),
              "eval": {}}], tmp_path / "run")  # fmt: skip
    assert cli.trainer.global_step == 2 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])


def test_ref2va_grpo_recipe_trains_on_its_rollouts(tiny_minimax, tmp_path):
    data = write_reference_prompts(tmp_path / "prompts", 2)
    cli = fit("ref2va_grpo_tiny.yaml", tiny_minimax("ref2va"), [{"name": "prompts", "dataset_dir": str(data),
              "eval": {}}], tmp_path / "run", "--model.objective.init_args.num_steps", "3",
              "--model.objective.init_args.sampler",
              json.dumps({"kind": "flow_sde", "eta": 0.7, "window": [0, 2], "num_sde_steps": None}))  # fmt: skip
    metrics = cli.trainer.callback_metrics
    assert cli.trainer.global_step == 2 and torch.isfinite(metrics["train/policy_loss"])
    assert float(metrics["train/ratio_first_max_dev"]) == 0.0


@pytest.mark.parametrize(("refs", "message"), [
    ([{"type": "audio", "path": "references/000_0.png"}], r"train\.jsonl:1: references: needs at least one image"),
    ([{"type": "image", "path": "references/000_0.png"}] * 10, r"train\.jsonl:1: references: takes at most 9 image"),
    ([{"type": "image", "path": "references/000_0.png", "slot": "first_frame"}], r"train\.jsonl:1: references\[0\]"
                                                                                 r"\.slot: unknown key"),
])  # fmt: skip
def test_ref2va_rows_breaking_the_reference_rules_fail_before_weights_load(tiny_minimax, tmp_path, capsys,
                                                                           monkeypatch, refs, message):
    from ff_minimax.ref2va import MiniMaxH3Ref2VAAdapter

    def refuse(*args, **kwargs):
        raise AssertionError("weights loaded before the records were checked")

    monkeypatch.setattr(MiniMaxH3Ref2VAAdapter, "_components", classmethod(refuse))
    data = write_reference_prompts(tmp_path / "prompts", 1)
    (data / "train.jsonl").write_text(json.dumps({"prompt": "p", "references": refs}) + "\n")
    assert main(["data", "validate", "--model", "minimax-h3-ref2va", "--split", "train", str(data)]) != 0
    err = capsys.readouterr()
    assert any(re.search(message, s) for s in (err.out, err.err)), err.out + err.err
    with pytest.raises(Exception, match=message.split(": ", 1)[1]) as info:
        fit("ref2va_grpo_tiny.yaml", tiny_minimax("ref2va"), [{"name": "p", "dataset_dir": str(data)}], tmp_path / "r")
    assert "weights loaded" not in str(info.value)


@pytest.mark.skipif(video_references_available(), reason="torchvision is installed: video references are presented")
def test_ref2va_video_reference_is_refused_here_before_weights_load(tmp_path, capsys):
    """Without torchvision (no Qwen3-VL video processor) the contract takes image and audio references only."""
    data = write_reference_prompts(tmp_path / "prompts", 1)
    (data / "train.jsonl").write_text(json.dumps({"prompt": "p", "references": [
        {"type": "image", "path": "references/000_0.png"}, {"type": "video", "path": "clip.mp4"}]}) + "\n")
    assert main(["data", "validate", "--model", "minimax-h3-ref2va", "--split", "train", str(data)]) != 0
    err = capsys.readouterr()
    assert "train.jsonl:1: references[1].type: video is not a reference type here (audio, image)" in err.out + err.err


@pytest.mark.parametrize("workflow", ["fl2va", "ref2va"])
def test_the_full_size_conditioned_recipes_parse(workflow, tmp_path):
    """configs/minimax/minimax_h3_{fl2va,ref2va}.yaml are not run here; they parse, name the registered adapter and a
    valid H3 clip on the released canvas."""
    from ff_minimax.fl2va import MiniMaxH3FL2VAAdapter
    from ff_minimax.ref2va import MiniMaxH3Ref2VAAdapter
    from ff_minimax.rules import check_clip

    from ff_core.cli.flow_cli import FlowCLI
    from ff_core.data.datamodule import FlowDataModule
    from ff_core.module import FlowModule

    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(CONFIGS / f"minimax_h3_{workflow}.yaml"), "--trainer.accelerator", "cpu",
        "--trainer.precision", "32", "--trainer.default_root_dir", str(tmp_path)])  # fmt: skip
    assert cli.model.adapter_cls is {"fl2va": MiniMaxH3FL2VAAdapter, "ref2va": MiniMaxH3Ref2VAAdapter}[workflow]
    kwargs = cli.model.adapter_kwargs
    assert check_clip(kwargs["num_frames"], kwargs["height"], kwargs["width"], 32) == kwargs["num_frames"] == 124
