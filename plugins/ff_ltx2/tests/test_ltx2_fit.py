"""``ff fit`` SFT on the CPU with the LTX-2 recipe, from a generated MP4 + WAV dataset (22.05 kHz mono WAVs: the codec
converts channels and rate); V2 records that break the (video, audio) pair contract fail before weights load."""

from __future__ import annotations

import json
import re
import wave
from pathlib import Path

import pytest
import torch
from ff_ltx2.testing import write_av_clips, write_av_prompts
from ltx2_geometry import ADAPTER_KWARGS

from ff_core.cli import main
from ff_core.cli.flow_cli import FlowCLI
from ff_core.data.datamodule import FlowDataModule
from ff_core.module import FlowModule
from ff_core.testing.recipes import fit_tiny

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "configs" / "ltx2"


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return write_av_clips(tmp_path_factory.mktemp("ltx2-clips"), 4)


def fit(recipe: str, pretrained: Path, datasets: list[dict], root: Path, *extra: str) -> FlowCLI:
    return fit_tiny(CONFIGS / recipe, pretrained, datasets, root, *extra)


def test_t2av_recipe_trains_from_mp4_and_wav_pairs(tiny_ltx2, clips, tmp_path):
    # Evaluation samples guided per stream with the guidance rescale on (docs/ltx2.md, "Sampling").
    cli = fit("sft_tiny.yaml", tiny_ltx2("t2av"), [{"name": "clips", "dataset_dir": str(clips), "eval": {}}],
              tmp_path, "--data.per_device_batch_size", "2", "--model.sampling.guidance_scale",
              json.dumps({"video": 2.0, "audio": 4.0}), "--model.sampling.guidance_rescale", "0.5")  # fmt: skip
    assert cli.trainer.global_step == 2 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    assert cli.model.sampling.guidance_scale == {"video": 2.0, "audio": 4.0}
    version = next((tmp_path / "lightning_logs").iterdir())
    samples = version / "samples" / "step_000002"
    import av

    with av.open(str(samples / "00000.mp4")) as container:  # at the adapter's 8 fps, its audio muxed in
        assert float(container.streams.video[0].average_rate) == 8.0
        sound = container.streams.audio[0]
        assert (sound.rate, sound.channels) == (16000, 2)
        assert float(sound.duration * sound.time_base) == pytest.approx(9 / 8, abs=1e-3)  # the clip's clock
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 9 and frames[0].shape == (32, 32, 3)
    with wave.open(str(samples / "00000_1.wav")) as w:  # the waveform also as a WAV, at the vocoder's rate
        assert (w.getframerate(), w.getnchannels(), w.getnframes()) == (16000, 2, 18000)
    lora = version / "checkpoints" / "last.lora" / "pytorch_lora_weights.safetensors"
    assert lora.stat().st_size > 0


def test_frozen_audio_trains_the_video_alone_under_full_fine_tuning(tiny_ltx2, clips, tmp_path):
    """``model.frozen_components: [audio]`` without LoRA: after 2 steps every audio-stream parameter of the
    transformer is bit-identical to the checkpoint's, the video stream's changed; the audio parameters are neither
    in the optimiser nor in the checkpoint."""
    from diffusers import LTX2VideoTransformer3DModel

    base = LTX2VideoTransformer3DModel.from_pretrained(tiny_ltx2("t2av"), subfolder="transformer").state_dict()
    cli = fit("sft_tiny.yaml", tiny_ltx2("t2av"), [{"name": "clips", "dataset_dir": str(clips)}], tmp_path,
              "--data.per_device_batch_size", "2", "--model.lora", "null", "--model.frozen_components", "[audio]",
              "--trainer.callbacks", json.dumps([{"class_path": "ff_core.callbacks.FlowCheckpoint",
                                                  "init_args": {"save_last": True}}]))  # fmt: skip
    assert cli.trainer.global_step == 2
    transformer = cli.model.adapter.transformer
    audio = set(cli.model.adapter.component_parameters("audio")["transformer"])
    assert len(audio) > 20
    trained = dict(transformer.named_parameters())
    for name in audio:
        assert not trained[name].requires_grad and torch.equal(trained[name], base[name]), name
    video = [n for n in trained if n not in audio]
    assert all(trained[n].requires_grad for n in video)
    for name in ("proj_out.weight", "transformer_blocks.0.attn1.to_q.weight"):  # the video stream trained
        assert not torch.equal(trained[name], base[name]), name
    optimised = {id(p) for group in cli.trainer.optimizers[0].param_groups for p in group["params"]}
    assert optimised == {id(trained[n]) for n in video}
    [ckpt] = (tmp_path / "lightning_logs").glob("version_*/checkpoints/last.ckpt")
    keys = {k.removeprefix("adapter.transformer.") for k in torch.load(ckpt, weights_only=False)["state_dict"]}
    assert not keys & audio and set(video) <= keys


def test_i2av_recipe_trains_with_pinned_first_frames(tiny_ltx2, tmp_path):
    clips = write_av_clips(tmp_path / "clips", 2, i2av=True)
    cli = fit("i2av_sft_tiny.yaml", tiny_ltx2("i2av"), [{"name": "clips", "dataset_dir": str(clips), "eval": {}}],
              tmp_path / "run", "--data.per_device_batch_size", "2")
    assert cli.trainer.global_step == 2 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    assert cli.model.adapter.io_contract.slots[0].name == "first_frame" and cli.model.adapter.image_crf == 33


def test_i2av_records_without_a_first_frame_fail_before_weights_load(tiny_ltx2, clips, tmp_path, capsys,
                                                                   monkeypatch):  # fmt: skip
    from ff_ltx2 import LTX2I2AVAdapter

    assert main(["data", "validate", "--model", "ltx2_i2av", str(clips)]) != 0
    err = capsys.readouterr()
    assert "train.jsonl:1: input.media: required slot 'first_frame' (image) is not bound" in err.out + err.err

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the dataset was validated")

    monkeypatch.setattr(LTX2I2AVAdapter, "_components", classmethod(no_weights))
    with pytest.raises(Exception, match="required slot 'first_frame'"):
        fit("i2av_sft_tiny.yaml", tiny_ltx2("i2av"), [{"name": "clips", "dataset_dir": str(clips)}], tmp_path)


def test_offline_dpo_recipe_trains_on_audio_video_pairs(tiny_ltx2, tmp_path):
    pairs = write_av_clips(tmp_path / "pairs", 2, preference=True)
    record = json.loads((pairs / "train.jsonl").read_text().splitlines()[0])
    assert [m["type"] for m in record["supervision"]["rejected"]["media"]] == ["video", "audio"]
    # The two streams' mean errors weighed equally (docs/objectives.md, "Several latent components").
    cli = fit("offline_dpo_tiny.yaml", tiny_ltx2("t2av"), [{"name": "pairs", "dataset_dir": str(pairs), "eval": {}}],
              tmp_path / "run", "--data.per_device_batch_size", "2", "--model.objective.init_args.component_weights",
              json.dumps({"video": 1.0, "audio": 1.0}))  # fmt: skip
    assert cli.trainer.global_step == 2 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    assert cli.model.objective.component_weights == {"video": 1.0, "audio": 1.0}


def test_grpo_recipe_trains_on_its_own_audio_video_rollouts(tiny_ltx2, tmp_path):
    """Flow-GRPO through the adapter's sampler: SDE rollouts stepping both streams, a video reward and an audio reward,
    and the replayed log-probabilities equal the rollout's (ratio exactly 1 on the first update)."""
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "train.txt").write_text("a red square\na low tone\n")
    (prompts / "test.txt").write_text("a green square\n")
    cli = fit("grpo_tiny.yaml", tiny_ltx2("t2av"), [{"name": "prompts", "dataset_dir": str(prompts), "eval": {}}],
              tmp_path / "run", "--model.objective.init_args.num_steps", "3", "--model.objective.init_args.sampler",
              json.dumps({"kind": "flow_sde", "eta": 0.7, "window": [0, 2], "num_sde_steps": None}),
              "--model.objective.init_args.prompts_per_step", "2", "--model.objective.init_args.group_size", "2",
              "--model.objective.init_args.micro_batch_size", "4", "--data.eval_batch_size", "1")  # fmt: skip
    metrics = cli.trainer.callback_metrics
    assert cli.trainer.global_step == 2 and torch.isfinite(metrics["train/policy_loss"])
    assert float(metrics["train/ratio_first_max_dev"]) == 0.0
    [curve] = (tmp_path / "run").glob("lightning_logs/version_*/loss.csv")  # the recipe's LossCurve: mean rewards
    assert curve.read_text().splitlines()[0] == "step,reward_mean" and len(curve.read_text().splitlines()) == 3


def test_i2av_offline_dpo_and_grpo_recipes_train(tiny_ltx2, tmp_path, monkeypatch):
    """ltx2_i2av through the other two objectives: DPO pairs sharing a first frame, GRPO rollouts from prompt +
    first-frame rows (the pinned frame never stepped: every rollout's final video latent starts with the row's
    ``first_frame_latent`` exactly; its log-prob elements excluded: ratio exactly 1 first)."""
    from ff_core.objectives import GRPOObjective

    rollouts = []
    real_rollout = GRPOObjective.rollout

    def recording_rollout(self, *args, **kwargs):  # the real rollout, its results kept for the check below
        out = real_rollout(self, *args, **kwargs)
        rollouts.extend(out)
        return out

    monkeypatch.setattr(GRPOObjective, "rollout", recording_rollout)
    pairs = write_av_clips(tmp_path / "pairs", 2, i2av=True, preference=True)
    cli = fit("i2av_offline_dpo_tiny.yaml", tiny_ltx2("i2av"), [{"name": "pairs", "dataset_dir": str(pairs),
              "eval": {}}], tmp_path / "dpo", "--data.per_device_batch_size", "2")  # fmt: skip
    assert cli.trainer.global_step == 2 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    prompts = write_av_prompts(tmp_path / "prompts", 2)
    cli = fit("i2av_grpo_tiny.yaml", tiny_ltx2("i2av"), [{"name": "prompts", "dataset_dir": str(prompts),
              "eval": {}}], tmp_path / "grpo", "--model.objective.init_args.num_steps", "3",
              "--model.objective.init_args.sampler",
              json.dumps({"kind": "flow_sde", "eta": 0.7, "window": [0, 2], "num_sde_steps": None}),
              "--model.objective.init_args.prompts_per_step", "2", "--model.objective.init_args.group_size", "2",
              "--model.objective.init_args.micro_batch_size", "4", "--data.eval_batch_size", "1")  # fmt: skip
    metrics = cli.trainer.callback_metrics
    assert cli.trainer.global_step == 2 and torch.isfinite(metrics["train/policy_loss"])
    assert float(metrics["train/ratio_first_max_dev"]) == 0.0
    assert rollouts
    for r in rollouts:
        final, pinned = r.trajectory.final.components["video"][:, :, :1], r.condition["first_frame_latent"]
        torch.testing.assert_close(final, pinned.to(final.device, final.dtype), rtol=0, atol=0)


@pytest.mark.parametrize("recipe", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_ltx2_recipe_starts_with_its_command(recipe):
    """STYLE 4 (the SD3 recipes are checked in tests/test_fit.py): a recipe's first line is the command that runs it."""
    assert recipe.read_text().startswith(f"# ff fit --config configs/ltx2/{recipe.name}")


def _broken(clips: Path, root: Path, how: str) -> Path:
    """A copy of the first record of ``clips`` whose target breaks the (video(fps), audio(sample_rate)) pair."""
    import shutil

    record = json.loads((clips / "train.jsonl").read_text().splitlines()[0])
    video, audio = record["supervision"]["target"]["media"]
    media = {"audio_first": [audio, video], "video_only": [video], "no_fps": [{**video, "fps": None}, audio],
             "no_sample_rate": [video, {k: v for k, v in audio.items() if k != "sample_rate"}]}[how]
    record["supervision"]["target"]["media"] = [{k: v for k, v in m.items() if v is not None} for m in media]
    shutil.copytree(clips, root)
    (root / "train.jsonl").write_text(json.dumps(record) + "\n")
    return root


@pytest.mark.parametrize(("how", "message"), [
    ("audio_first", r"media: expected outputs \(video, audio\) in this order, found \(audio, video\)"),
    ("video_only", r"media: expected outputs \(video, audio\) in this order, found \(video\)"),
    ("no_fps", r"media\[0\]\.fps: required by this adapter's video output"),
    ("no_sample_rate", r"media\[1\]\.sample_rate: required by this adapter's audio output"),
])  # fmt: skip
def test_records_breaking_the_pair_contract_fail_before_weights_load(tiny_ltx2, clips, tmp_path, capsys, monkeypatch,
                                                                     how, message):  # fmt: skip
    """Spec: every LTX-2 candidate is an exact ordered (video, audio) pair with fps and sample_rate. ``ff data
    validate`` names the record, and ``ff fit`` fails on it before any weights load."""
    from ff_ltx2 import LTX2T2AVAdapter

    bad = _broken(clips, tmp_path / how, how)
    geometry = ["--adapter-kwargs", json.dumps(ADAPTER_KWARGS)]  # the recipe's clip (the clips are too short for 5 s)
    assert main(["data", "validate", "--model", "ltx2_t2av", str(clips), *geometry]) == 0
    capsys.readouterr()
    assert main(["data", "validate", "--model", "ltx2_t2av", str(bad), *geometry]) != 0
    err = capsys.readouterr()
    assert re.search(rf"train\.jsonl:1: supervision\.target\.{message}", err.out + err.err)

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the dataset was validated")

    monkeypatch.setattr(LTX2T2AVAdapter, "_components", classmethod(no_weights))
    with pytest.raises(Exception, match=message) as info:
        fit("sft_tiny.yaml", tiny_ltx2("t2av"), [{"name": "bad", "dataset_dir": str(bad)}], tmp_path / "run")
    assert "weights loaded" not in str(info.value)


def test_the_full_size_recipe_parses_and_its_geometry_is_valid(tmp_path):
    """configs/ltx2/ltx2_t2av.yaml is not run here; it parses, names the registered adapter and an LTX-2 clip geometry
    (``(num_frames - 1) % 8 == 0``, a canvas in multiples of 32: the released VAE's compression)."""
    from ff_ltx2 import LTX2T2AVAdapter

    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(CONFIGS / "ltx2_t2av.yaml"), "--trainer.accelerator", "cpu", "--trainer.precision", "32",
        "--trainer.default_root_dir", str(tmp_path)])  # fmt: skip
    assert cli.model.adapter_cls is LTX2T2AVAdapter
    kwargs = cli.model.adapter_kwargs
    assert (kwargs["num_frames"] - 1) % 8 == 0 and kwargs["height"] % 32 == 0 and kwargs["width"] % 32 == 0
