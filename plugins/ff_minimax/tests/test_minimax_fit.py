"""``ff fit`` on the CPU with the MiniMax H3 T2VA recipes (SFT, offline DPO, GRPO) from generated MP4 + WAV datasets
(11.025 kHz mono WAVs: the codec converts them to stereo at the audio VAE's 8 kHz); the spec's H3 rules (B=1, no CFG,
the clip length, the (video, audio) pair) fail before weights load, naming the key or the record's file and line."""

from __future__ import annotations

import json
import re
import shutil
import wave
from pathlib import Path

import pytest
import torch
from ff_minimax.testing import write_av_clips

from ff_core.cli import main
from ff_core.cli.flow_cli import FlowCLI
from ff_core.data.datamodule import FlowDataModule
from ff_core.module import FlowModule
from ff_core.testing.recipes import fit_tiny

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "configs" / "minimax"


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return write_av_clips(tmp_path_factory.mktemp("minimax-clips"), 2)


def fit(recipe: str, pretrained: Path, datasets: list[dict], root: Path, *extra: str) -> FlowCLI:
    return fit_tiny(CONFIGS / recipe, pretrained, datasets, root, *extra)


def test_t2va_sft_recipe_trains_from_mp4_and_wav_pairs(tiny_minimax, clips, tmp_path):
    cli = fit("t2va_sft_tiny.yaml", tiny_minimax("t2va"), [{"name": "clips", "dataset_dir": str(clips), "eval": {}}],
              tmp_path)  # fmt: skip
    assert cli.trainer.global_step == 2 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    assert cli.model.objective.component_weights is None  # the adapter's default: one mean per stream
    version = next((tmp_path / "lightning_logs").iterdir())
    samples = version / "samples" / "step_000002"
    import av

    with av.open(str(samples / "00000.mp4")) as container:  # at 24 fps, its stereo audio muxed in
        assert float(container.streams.video[0].average_rate) == 24.0
        sound = container.streams.audio[0]
        assert (sound.rate, sound.channels) == (8000, 2)
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 124 and frames[0].shape == (16, 16, 3)
    with wave.open(str(samples / "00000_1.wav")) as w:  # 207 latents x hop 200 at 8 kHz
        assert (w.getframerate(), w.getnchannels(), w.getnframes()) == (8000, 2, 207 * 200)
    lora = version / "checkpoints" / "last.lora" / "pytorch_lora_weights.safetensors"
    assert lora.stat().st_size > 0


def test_frozen_audio_trains_the_video_alone_under_full_fine_tuning(tiny_minimax, clips, tmp_path):
    """``model.frozen_components: [audio]`` without LoRA: after 2 steps the audio stream's own layers (its input and
    output projections) are bit-identical to the checkpoint's and out of the optimiser; the shared blocks trained."""
    from diffusers import MiniMaxH3Transformer3DModel

    base = MiniMaxH3Transformer3DModel.from_pretrained(tiny_minimax("t2va"), subfolder="transformer").state_dict()
    cli = fit("t2va_sft_tiny.yaml", tiny_minimax("t2va"), [{"name": "clips", "dataset_dir": str(clips)}], tmp_path,
              "--model.lora", "null", "--model.frozen_components", "[audio]",
              "--trainer.callbacks", json.dumps([{"class_path": "ff_core.callbacks.FlowCheckpoint",
                                                  "init_args": {"save_last": True}}]))  # fmt: skip
    assert cli.trainer.global_step == 2
    trained = dict(cli.model.adapter.transformer.named_parameters())
    audio = set(cli.model.adapter.component_parameters("audio")["transformer"])
    assert audio == {"audio_proj_in.weight", "audio_proj_in.bias", "audio_proj_out.weight", "audio_proj_out.bias"}
    for name in audio:
        assert not trained[name].requires_grad and torch.equal(trained[name], base[name]), name
    shared = "transformer_blocks.0.attn.to_q.weight"
    assert not torch.equal(trained[shared], base[shared])
    optimised = {id(p) for group in cli.trainer.optimizers[0].param_groups for p in group["params"]}
    assert optimised == {id(p) for n, p in trained.items() if n not in audio}


def test_t2va_offline_dpo_recipe_trains_on_audio_video_pairs(tiny_minimax, tmp_path):
    pairs = write_av_clips(tmp_path / "pairs", 2, preference=True)
    record = json.loads((pairs / "train.jsonl").read_text().splitlines()[0])
    assert [m["type"] for m in record["supervision"]["rejected"]["media"]] == ["video", "audio"]
    cli = fit("t2va_offline_dpo_tiny.yaml", tiny_minimax("t2va"), [{"name": "pairs", "dataset_dir": str(pairs),
              "eval": {}}], tmp_path / "run")  # fmt: skip
    assert cli.trainer.global_step == 2 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])


def test_t2va_grpo_recipe_trains_on_its_own_audio_video_rollouts(tiny_minimax, tmp_path):
    """Flow-GRPO through the adapter's sampler: SDE rollouts stepping both streams on their own schedules, a video
    reward and an audio reward, and the replayed log-probabilities equal the rollout's (ratio exactly 1 first)."""
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "train.txt").write_text("a red square\na low tone\n")
    (prompts / "test.txt").write_text("a green square\n")
    cli = fit("t2va_grpo_tiny.yaml", tiny_minimax("t2va"), [{"name": "prompts", "dataset_dir": str(prompts),
              "eval": {}}], tmp_path / "run", "--model.objective.init_args.num_steps", "3",
              "--model.objective.init_args.sampler",
              json.dumps({"kind": "flow_sde", "eta": 0.7, "window": [0, 2], "num_sde_steps": None}))  # fmt: skip
    metrics = cli.trainer.callback_metrics
    assert cli.trainer.global_step == 2 and torch.isfinite(metrics["train/policy_loss"])
    assert float(metrics["train/ratio_first_max_dev"]) == 0.0


@pytest.mark.parametrize("recipe", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_minimax_recipe_starts_with_its_command(recipe):
    """STYLE 4: a recipe's first line is the command that runs it."""
    assert recipe.read_text().startswith(f"# ff fit --config configs/minimax/{recipe.name}")


def test_the_full_size_recipe_parses_and_its_clip_is_valid(tmp_path):
    """configs/minimax/minimax_h3_t2va.yaml is not run here; it parses, names the registered adapter and a valid H3
    clip."""
    from ff_minimax import MiniMaxH3T2VAAdapter
    from ff_minimax.rules import check_clip

    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(CONFIGS / "minimax_h3_t2va.yaml"), "--trainer.accelerator", "cpu", "--trainer.precision", "32",
        "--trainer.default_root_dir", str(tmp_path)])  # fmt: skip
    assert cli.model.adapter_cls is MiniMaxH3T2VAAdapter
    kwargs = cli.model.adapter_kwargs
    assert check_clip(kwargs["num_frames"], kwargs["height"], kwargs["width"], 32) == kwargs["num_frames"]


# -- the spec's rules, before any weight loads ---------------------------------------------------------------------
@pytest.fixture
def no_weights(monkeypatch):
    """Loading a component fails the test: every rule below must fire first."""
    from ff_minimax import MiniMaxH3T2VAAdapter

    def refuse(*args, **kwargs):
        raise AssertionError("weights loaded before the rules were checked")

    monkeypatch.setattr(MiniMaxH3T2VAAdapter, "_components", classmethod(refuse))


def _copy_with(clips: Path, root: Path, edit) -> Path:
    """A copy of ``clips`` whose first record is ``edit(record)``, alone."""
    record = json.loads((clips / "train.jsonl").read_text().splitlines()[0])
    edit(record)
    shutil.copytree(clips, root)
    (root / "train.jsonl").write_text(json.dumps(record) + "\n")
    return root


@pytest.mark.parametrize(("override", "message"), [
    (("--data.per_device_batch_size", "2"), r"data\.per_device_batch_size=2, but adapter 'minimax-h3-t2va' supports "
                                           r"at most 1 sample"),
    (("--data.eval_batch_size", "2"), r"data\.eval_batch_size=2, but adapter 'minimax-h3-t2va' supports at most 1"),
    (("--model.sampling.guidance_scale", "4.0"), r"model\.sampling\.guidance_scale.*no classifier-free guidance"),
    (("--model.adapter_kwargs", json.dumps({"height": 16, "width": 16, "num_frames": 100})),
     r"model\.adapter_kwargs\.num_frames: 100 frames, rounded up to 107 \(17 n \+ 5\), last 4\.458 s"),
    # A bucket replaces the video's geometry only; the audio is cut to adapter_kwargs' clip (Adapter.check_bucket).
    (("--data.buckets", json.dumps([{"height": 16, "width": 16, "num_frames": 124, "fps": 24.0, "start": 0.5},
                                    {"height": 16, "width": 16, "num_frames": 124, "fps": 12.0}])),
     r"data\.buckets\[1\]: minimax-h3-t2va trains on one clip, model\.adapter_kwargs' 16x16, 124 frames at 24 fps, "
     r"got 16x16, 124 frames at 12\.0 fps"),
])  # fmt: skip
def test_b1_cfg_and_clip_rules_fail_before_weights_load(tiny_minimax, clips, tmp_path, no_weights, override, message):
    """Spec "MiniMax H3 datasets": B=1 for training and evaluation, guidance_scale 1.0, 5-15 s at 24 fps; each
    violation is an error naming its key, raised before any weight loads."""
    with pytest.raises(Exception, match=message) as info:
        fit("t2va_sft_tiny.yaml", tiny_minimax("t2va"), [{"name": "clips", "dataset_dir": str(clips), "eval": {}}],
            tmp_path, *override)  # fmt: skip
    assert "weights loaded" not in str(info.value)


def test_grpo_guidance_scale_is_rejected_before_weights_load(tiny_minimax, tmp_path, no_weights):
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "train.txt").write_text("a red square\n")
    with pytest.raises(Exception, match=r"model\.objective\.init_args\.guidance_scale.*keep it 1\.0"):
        fit("t2va_grpo_tiny.yaml", tiny_minimax("t2va"), [{"name": "prompts", "dataset_dir": str(prompts)}],
            tmp_path / "run", "--model.objective.init_args.guidance_scale", "3.0")  # fmt: skip


@pytest.mark.parametrize("size", ["2", "null"])
def test_grpo_micro_batch_size_above_one_is_rejected_before_weights_load(tiny_minimax, tmp_path, no_weights, size):
    """B = 1 for the GRPO rollout and replay forwards too (``micro_batch_size``; unset means the rank's whole share)."""
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "train.txt").write_text("a red square\n")
    with pytest.raises(Exception, match=r"model\.objective\.init_args\.micro_batch_size: .*supports at most 1 sample"):
        fit("t2va_grpo_tiny.yaml", tiny_minimax("t2va"), [{"name": "prompts", "dataset_dir": str(prompts)}],
            tmp_path / "run", "--model.objective.init_args.micro_batch_size", size)  # fmt: skip


@pytest.mark.parametrize(("how", "message"), [
    ("negative_prompt", r"train\.jsonl:1: input\.negative_prompt: this adapter has no classifier-free guidance"),
    ("audio_first", r"train\.jsonl:1: supervision\.target\.media: expected outputs \(video, audio\) in this order, "
                    r"found \(audio, video\)"),
    ("video_only", r"train\.jsonl:1: supervision\.target\.media: expected outputs \(video, audio\) in this order"),
    ("no_sample_rate", r"train\.jsonl:1: supervision\.target\.media\[1\]\.sample_rate: required"),
])  # fmt: skip
def test_records_breaking_the_rules_fail_validation_and_fit_before_weights_load(tiny_minimax, clips, tmp_path,
                                                                                capsys, no_weights, how, message):
    """A negative prompt (no CFG) and a target that is not the exact ordered (video, audio) pair: ``ff data validate
    --model`` names the record's file, line and field, and ``ff fit`` fails on it before any weight loads."""

    def edit(record: dict) -> None:
        media = record["supervision"]["target"]["media"]
        if how == "negative_prompt":
            record["input"]["negative_prompt"] = "blurry"
        elif how == "audio_first":
            media.reverse()
        elif how == "video_only":
            del media[1]
        else:
            del media[1]["sample_rate"]

    bad = _copy_with(clips, tmp_path / how, edit)
    assert main(["data", "validate", "--model", "minimax-h3-t2va", str(clips)]) == 0
    capsys.readouterr()
    assert main(["data", "validate", "--model", "minimax-h3-t2va", str(bad)]) != 0
    err = capsys.readouterr()
    assert re.search(message, err.out + err.err), err.out + err.err
    with pytest.raises(Exception, match=message.split(": ", 1)[1]) as info:
        fit("t2va_sft_tiny.yaml", tiny_minimax("t2va"), [{"name": "bad", "dataset_dir": str(bad)}], tmp_path / "run")
    assert "weights loaded" not in str(info.value)


def test_a_target_shorter_than_the_clip_is_rejected_naming_the_record(tiny_minimax, tmp_path, capsys, no_weights):
    """Spec: the target video must cover the configured 24-fps duration (never stretched): 100 frames cannot give the
    124-frame clip. Reported from the file's header before any weight loads (``resolve_output_geometry``: loading a
    component fails this test), by ``ff fit`` and ``ff data validate --model`` alike."""
    short = write_av_clips(tmp_path / "short", 2, frames=100)
    message = (r"train\.jsonl:1: supervision\.target\.media\[0\]\.path: .*000\.mp4: video too short: 124 frames at "
               r"24 fps from 0 s, but the file holds 4\.167 s")  # fmt: skip
    with pytest.raises(Exception, match=message) as info:
        fit("t2va_sft_tiny.yaml", tiny_minimax("t2va"), [{"name": "short", "dataset_dir": str(short)}],
            tmp_path / "run")  # fmt: skip
    assert "weights loaded" not in str(info.value)
    capsys.readouterr()
    assert main(["data", "validate", "--model", "minimax-h3-t2va", "--adapter-kwargs",
                 json.dumps({"height": 16, "width": 16}), str(short)]) != 0  # fmt: skip
    err = capsys.readouterr()
    assert re.search(message, err.out + err.err), err.out + err.err


def test_adapter_kwargs_are_refused_before_weights_load(tiny_minimax, tmp_path, capsys):
    """``num_frames`` outside 5-15 s (``ff data validate --model``), a canvas off the VAE x patch grid (read from the
    config files) and a misspelt key (Ref2VA too) are ``ConfigError``s naming the key."""
    from ff_minimax import MiniMaxH3T2VAAdapter
    from ff_minimax.fl2va import MiniMaxH3FL2VAAdapter
    from ff_minimax.ref2va import MiniMaxH3Ref2VAAdapter

    from ff_core.errors import ConfigError
    from ff_core.pretrained import check_adapter_kwargs

    short = write_av_clips(tmp_path / "clips", 2)
    assert main(["data", "validate", "--model", "minimax-h3-t2va", "--adapter-kwargs", '{"num_frames": 100}',
                 str(short)]) == 2  # fmt: skip
    out = capsys.readouterr()
    assert "model.adapter_kwargs.num_frames: 100 frames, rounded up to 107" in out.out + out.err
    with pytest.raises(ConfigError, match=r"model\.adapter_kwargs\.width: must be a multiple of 8 .* got 20"):
        check_adapter_kwargs(MiniMaxH3T2VAAdapter, tiny_minimax("t2va"), {"height": 16, "width": 20})
    check_adapter_kwargs(MiniMaxH3T2VAAdapter, tiny_minimax("t2va"), {"height": 16, "width": 24})
    for cls in (MiniMaxH3FL2VAAdapter, MiniMaxH3Ref2VAAdapter):
        with pytest.raises(ConfigError, match=r"model\.adapter_kwargs\.num_frame: .* takes no such argument"):
            check_adapter_kwargs(cls, None, {"num_frame": 141})
    with pytest.raises(ConfigError, match=r"model\.adapter_kwargs\.canvas_short_edge: must be a positive integer"):
        check_adapter_kwargs(MiniMaxH3Ref2VAAdapter, None, {"canvas_short_edge": 0})
    with pytest.raises(ConfigError, match=r"model\.adapter_kwargs\.dtype: unknown dtype 'fp8'"):
        check_adapter_kwargs(MiniMaxH3T2VAAdapter, None, {"dtype": "fp8"})
