"""``ff fit`` SFT on the CPU with the Wan recipes: from generated MP4 datasets (T2V and I2V) and from tensor-parquet
shards written by ``ff data preprocess-latents`` with the Wan adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ff_wan.testing import write_moving_squares

from ff_core.cli import main
from ff_core.cli.flow_cli import FlowCLI
from ff_core.data.datamodule import FlowDataModule
from ff_core.data.tensor_parquet import TensorParquetDataset
from ff_core.module import FlowModule
from ff_core.testing.recipes import fit_tiny

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "configs" / "wan"


@pytest.fixture(scope="module")
def squares(tmp_path_factory):
    return write_moving_squares(tmp_path_factory.mktemp("wan-squares"), 4)


@pytest.fixture(scope="module")
def squares_i2v(tmp_path_factory):
    return write_moving_squares(tmp_path_factory.mktemp("wan-squares-i2v"), 2, i2v=True)


def fit(recipe: str, pretrained: Path, datasets: list[dict], root: Path, *extra: str) -> FlowCLI:
    return fit_tiny(CONFIGS / recipe, pretrained, datasets, root, *extra)


def test_t2v_recipe_trains_from_mp4_clips(tiny_wan, squares, tmp_path):
    cli = fit("sft_tiny.yaml", tiny_wan("t2v"), [{"name": "squares", "dataset_dir": str(squares), "eval": {}}],
              tmp_path, "--data.per_device_batch_size", "2")
    assert cli.trainer.global_step == 2 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    version = next((tmp_path / "lightning_logs").iterdir())
    assert (version / "samples" / "step_000002.png").stat().st_size > 0
    import av

    with av.open(str(version / "samples" / "step_000002" / "00000.mp4")) as container:  # at the adapter's 8 fps
        assert float(container.streams.video[0].average_rate) == 8.0
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 9 and frames[0].shape == (32, 32, 3)
    lora = version / "checkpoints" / "last.lora" / "pytorch_lora_weights.safetensors"
    assert lora.stat().st_size > 0


def test_i2v_recipe_trains_from_mp4_clips_with_first_frames(tiny_wan, squares_i2v, tmp_path):
    cli = fit("i2v_sft_tiny.yaml", tiny_wan("i2v"),
              [{"name": "squares", "dataset_dir": str(squares_i2v), "eval": {}}], tmp_path)
    assert cli.trainer.global_step == 2 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    assert cli.model.adapter.io_contract.slots[0].name == "first_frame"
    version = next((tmp_path / "lightning_logs").iterdir())
    assert (version / "samples" / "step_000002.png").stat().st_size > 0


def test_i2v_records_violating_the_checkpoint_contract_fail_before_weights_load(tiny_wan, squares_i2v, tmp_path,
                                                                              capsys, monkeypatch):
    """The FLF2V checkpoint requires last_frame: the first-frame-only dataset is rejected, naming each record, from the
    config files alone, by ``ff data validate`` and by ``ff fit`` before any weights load."""
    from ff_wan import WanI2VAdapter

    flf2v = str(tiny_wan("flf2v"))
    assert main(["data", "validate", "--model", "wan2_i2v", "--pretrained", str(tiny_wan("i2v")),
                 str(squares_i2v)]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["data", "validate", "--model", "wan2_i2v", "--pretrained", flf2v, str(squares_i2v)]) != 0
    err = capsys.readouterr()
    assert "train.jsonl:1: input.media: required slot 'last_frame' (image) is not bound" in err.out + err.err

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the dataset was validated")

    monkeypatch.setattr(WanI2VAdapter, "_components", classmethod(no_weights))
    with pytest.raises(Exception, match="required slot 'last_frame'"):
        fit("i2v_sft_tiny.yaml", flf2v, [{"name": "squares", "dataset_dir": str(squares_i2v)}], tmp_path)


def test_preprocess_latents_then_sft_from_shards(tiny_wan, squares, tmp_path):
    out = tmp_path / "shards"
    datasets = json.dumps([{"name": "squares", "dataset_dir": str(squares)}])
    assert main(["data", "preprocess-latents", "--output", str(out), "--no-progress",
                 "--config", str(CONFIGS / "sft_tiny.yaml"), "--model.pretrained_model_name_or_path",
                 str(tiny_wan("t2v")), "--data.datasets", datasets]) == 0  # fmt: skip
    shards = TensorParquetDataset(out)
    assert len(shards) == 4
    assert {"text_embedding", "vae_latent"} <= set(shards.tensor_names)
    assert shards[0]["vae_latent"].shape == (4, 3, 4, 4) and shards[0]["text_embedding"].shape == (16, 32)
    cli = fit("sft_tiny.yaml", tiny_wan("t2v"), [{"name": "latents", "tensor_parquet_dir": str(out)},
              {"name": "prompts", "dataset_dir": str(squares), "train": None, "eval": {}}], tmp_path / "run",
              "--data.per_device_batch_size", "2")  # fmt: skip
    assert cli.trainer.global_step == 2 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])


def test_offline_dpo_recipe_trains_on_video_pairs(tiny_wan, tmp_path):
    pairs = write_moving_squares(tmp_path / "pairs", 2, preference=True)
    record = json.loads((pairs / "train.jsonl").read_text().splitlines()[0])
    assert record["supervision"]["type"] == "preference"
    cli = fit("offline_dpo_tiny.yaml", tiny_wan("t2v"), [{"name": "pairs", "dataset_dir": str(pairs), "eval": {}}],
              tmp_path / "run", "--data.per_device_batch_size", "2")
    assert cli.trainer.global_step == 2 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])


@pytest.mark.parametrize("recipe", ["wan2_1_t2v_1_3b.yaml", "wan2_1_i2v_14b.yaml", "wan2_2_ti2v_5b.yaml",
                                    "wan2_2_i2v_a14b.yaml"])  # fmt: skip
def test_full_size_recipes_parse_and_their_geometry_is_valid(recipe, tmp_path):
    """The full-size recipes are not run here; they parse, name a registered adapter and a valid Wan clip geometry."""
    from ff_wan import WanT2VAdapter

    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(CONFIGS / recipe), "--trainer.accelerator", "cpu", "--trainer.precision", "32",
        "--trainer.default_root_dir", str(tmp_path)])  # fmt: skip
    assert issubclass(cli.model.adapter_cls, WanT2VAdapter)
    kwargs = cli.model.adapter_kwargs
    assert (kwargs["num_frames"] - 1) % 4 == 0 and kwargs["height"] % 16 == 0 and kwargs["width"] % 16 == 0
    assert cli.datamodule.per_device_batch_size == 1


def test_i2v_preprocess_latents_then_sft_from_shards(tiny_wan, squares_i2v, tmp_path):
    """wan2_i2v shards hold the card's columns, the condition latents and CLIP features included; training from them
    runs neither the text encoder, the image encoder nor a VAE encode."""
    out = tmp_path / "shards"
    datasets = json.dumps([{"name": "squares", "dataset_dir": str(squares_i2v)}])
    assert main(["data", "preprocess-latents", "--output", str(out), "--no-progress",
                 "--config", str(CONFIGS / "i2v_sft_tiny.yaml"), "--model.pretrained_model_name_or_path",
                 str(tiny_wan("i2v")), "--data.datasets", datasets]) == 0  # fmt: skip
    shards = TensorParquetDataset(out)
    assert {"text_embedding", "first_frame_latent", "clip_feature", "vae_latent"} <= set(shards.tensor_names)
    assert shards[0]["first_frame_latent"].shape == (8, 3, 4, 4) and shards[0]["clip_feature"].shape == (1, 5, 8)
    cli = fit("i2v_sft_tiny.yaml", tiny_wan("i2v"), [{"name": "latents", "tensor_parquet_dir": str(out)},
              {"name": "prompts", "dataset_dir": str(squares_i2v), "train": None, "eval": {}}], tmp_path / "run")
    assert cli.trainer.global_step == 2 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])


def test_grpo_recipe_trains_on_its_own_videos(tiny_wan, tmp_path):
    """Flow-GRPO through the adapter's sampler: SDE rollouts of videos, the colour reward on every frame, and the
    replayed log-probabilities equal the rollout's (ratio exactly 1 on the first update)."""
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "train.txt").write_text("a circle\na square\n")
    (prompts / "test.txt").write_text("a triangle\n")
    cli = fit("grpo_tiny.yaml", tiny_wan("t2v"), [{"name": "prompts", "dataset_dir": str(prompts), "eval": {}}],
              tmp_path / "run", "--model.objective.init_args.num_steps", "3", "--model.objective.init_args.sampler",
              json.dumps({"kind": "flow_sde", "eta": 0.7, "window": [0, 2], "num_sde_steps": None}),
              "--model.objective.init_args.prompts_per_step", "2", "--model.objective.init_args.group_size", "2",
              "--model.objective.init_args.micro_batch_size", "4", "--data.eval_batch_size", "1")  # fmt: skip
    metrics = cli.trainer.callback_metrics
    assert cli.trainer.global_step == 2 and torch.isfinite(metrics["train/policy_loss"])
    assert float(metrics["train/ratio_first_max_dev"]) == 0.0
    assert 0.0 <= float(metrics["val/reward"]) <= 1.0


@pytest.mark.parametrize("recipe", [*sorted(CONFIGS.glob("*.yaml")), *sorted(CONFIGS.parent.glob("demo/wan_*.yaml"))],
                         ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_wan_recipe_starts_with_its_command(recipe):
    """STYLE 4 (the SD3 recipes are checked in tests/test_fit.py): a recipe's first line is the command that runs it."""
    assert recipe.read_text().startswith(f"# ff fit --config configs/{recipe.parent.name}/{recipe.name}")


def test_sft_from_shards_with_workers_repeats_the_main_process_run(tiny_wan, squares, tmp_path, monkeypatch):
    """Wan's collation rules (text embeddings padded per batch, with a mask) over rows two loader workers hand over
    as file ranges, padded where the main process reads them: the run equals the ``num_workers=0`` one bit for bit
    (same losses, same trained weights)."""
    from ff_core.data.dataflow.lazy import LazyPadded

    padded_here = []  # text embeddings padded as the main process read them (not in a worker)
    original = LazyPadded.materialize_into
    monkeypatch.setattr(LazyPadded, "materialize_into", lambda self, out: (padded_here.append(self.shape),
                                                                           original(self, out))[1])
    out = tmp_path / "shards"
    datasets = json.dumps([{"name": "squares", "dataset_dir": str(squares)}])
    assert main(["data", "preprocess-latents", "--output", str(out), "--no-progress",
                 "--config", str(CONFIGS / "sft_tiny.yaml"), "--model.pretrained_model_name_or_path",
                 str(tiny_wan("t2v")), "--data.datasets", datasets]) == 0  # fmt: skip
    # The card stores text embeddings with their padding stripped: rows of 16, 13, 10 and 7 tokens.
    import pyarrow.parquet as pq

    from ff_core.data.tensor_parquet import TensorParquetWriter

    src, ragged = TensorParquetDataset(out), tmp_path / "ragged"
    with TensorParquetWriter(ragged, pq.read_schema(src.files[0]), rows_per_file=2) as writer:
        for i in range(len(src)):
            row = src[i]
            writer.write({**row, "text_embedding": row["text_embedding"][: 16 - 3 * i].clone()})
    runs = {}
    for workers in ("0", "2"):
        cli = fit("sft_tiny.yaml", tiny_wan("t2v"), [{"name": "latents", "tensor_parquet_dir": str(ragged)},
                  {"name": "prompts", "dataset_dir": str(squares), "train": None, "eval": {}}], tmp_path / workers,
                  "--data.per_device_batch_size", "2", "--data.num_workers", workers)  # fmt: skip
        trained = {k: v.detach().clone() for k, v in cli.model.named_parameters() if v.requires_grad}
        runs[workers] = cli.trainer.callback_metrics["train/loss"].item(), trained
    assert sorted(r["text_embedding"].shape[0] for r in TensorParquetDataset(ragged)) == [7, 10, 13, 16]
    assert padded_here  # only the run with workers hands values over
    assert runs["0"][0] == runs["2"][0]
    assert runs["0"][1].keys() == runs["2"][1].keys() and runs["0"][1]
    assert all(torch.equal(runs["0"][1][k], runs["2"][1][k]) for k in runs["0"][1])
