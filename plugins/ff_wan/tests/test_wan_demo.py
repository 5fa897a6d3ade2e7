"""The video demo's base checkpoint (ff_wan.demo_base): the unclamped training decode is diffusers' decode before its
clamp, the shape weights mark the saturated pixels, and the written folder loads through WanPipeline and wan2_t2v
with the VAE's per-channel latent statistics and 4x compression, its posterior starts narrow, and the demo recipe
trains from the shards ff data preprocess-latents writes with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ff_wan.demo_base import build_demo_base, decode_unclamped, load_clips, shape_weights

from ff_core.testing.moving_shapes import write_moving_shapes_dataset


@pytest.fixture(scope="module")
def clips_dir(tmp_path_factory):
    return write_moving_shapes_dataset(tmp_path_factory.mktemp("moving"), n_train=4, n_test=2)


@pytest.fixture(scope="module")
def demo_base(clips_dir, tmp_path_factory):
    return build_demo_base(tmp_path_factory.mktemp("demo-base"), clips_dir, vae_steps=2, vae_batch_size=2)


def test_unclamped_decode_is_the_pipeline_decode_before_its_clamp(demo_base):
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(demo_base, subfolder="vae").eval()
    z = 3 * torch.randn(2, vae.config.z_dim, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        raw, reference = decode_unclamped(vae, z), vae.decode(z).sample
    torch.testing.assert_close(raw.clamp(-1, 1), reference)
    assert raw.shape == (2, 3, 9, 32, 32)


def test_shape_weights_mark_the_saturated_pixels():
    x = -torch.ones(1, 3, 1, 2, 2)  # black
    x[0, 0, 0, 0, 0] = 1.0  # one red pixel
    x[0, :, 0, 1, 1] = 1.0  # one white pixel: not saturated
    torch.testing.assert_close(shape_weights(x, 9.0), torch.tensor([[[[[10.0, 1.0], [1.0, 1.0]]]]]))


def test_folder_loads_through_the_pipeline_and_the_adapter(demo_base, clips_dir):
    from diffusers import WanPipeline
    from ff_wan import WanT2VAdapter

    pipe = WanPipeline.from_pretrained(demo_base)
    cfg = pipe.vae.config
    assert (cfg.scale_factor_spatial, cfg.scale_factor_temporal, cfg.z_dim) == (4, 4, 8)
    assert pipe.transformer.config.in_channels == cfg.z_dim
    # latents_mean / latents_std are the per-channel statistics of the clips' posterior samples.
    data, prompts = load_clips(clips_dir, 9)
    assert data.shape == (4, 3, 9, 32, 32) and prompts[0] == json.loads(
        (clips_dir / "train.jsonl").read_text().splitlines()[0])["input"]["prompt"]
    torch.manual_seed(0)
    with torch.no_grad():
        z = pipe.vae.encode(data).latent_dist.sample()
    torch.testing.assert_close(torch.tensor(cfg.latents_mean), z.mean((0, 2, 3, 4)))
    torch.testing.assert_close(torch.tensor(cfg.latents_std), z.std((0, 2, 3, 4)))
    adapter = WanT2VAdapter.from_pretrained(demo_base, height=32, width=32, num_frames=9, fps=8)
    assert adapter.latent_shape(1) == (1, 8, 3, 8, 8)


def test_posterior_starts_narrow(demo_base, clips_dir):
    """vae_logvar_init=-6 (the default): the posterior std is near e^-3, not diffusers' near-1 init, so one stored
    posterior sample (ff data preprocess-latents) is close to the mode the decoder learned to decode."""
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(demo_base, subfolder="vae").eval()
    data, _ = load_clips(clips_dir, 9)
    with torch.no_grad():
        std = vae.encode(data).latent_dist.std
    assert 0.01 < std.mean() < 0.15, std.mean()


def test_demo_recipe_trains_from_the_demo_bases_shards(demo_base, clips_dir, tmp_path):
    """scripts/demo_video.sh's two steps on a 4-clip dataset: preprocess-latents with the demo recipe (its datasets
    swapped for the clip folder, as the script does), then the recipe trains from the shards and evaluates on the
    folder's prompts."""
    import yaml

    from ff_core.cli import main
    from ff_core.cli.flow_cli import FlowCLI
    from ff_core.data.datamodule import FlowDataModule
    from ff_core.data.tensor_parquet import TensorParquetDataset
    from ff_core.module import FlowModule

    recipe = Path(__file__).resolve().parents[3] / "configs" / "demo" / "wan_moving_shapes.yaml"
    train, prompts = yaml.safe_load(recipe.read_text())["data"]["datasets"]
    assert "tensor_parquet_dir" in train and prompts["train"] is None and "dataset_dir" in prompts
    shards = tmp_path / "shards"
    assert main(["data", "preprocess-latents", "--output", str(shards), "--no-progress", "--config", str(recipe),
                 "--model.pretrained_model_name_or_path", str(demo_base),
                 "--data.datasets", json.dumps([{"name": "clips", "dataset_dir": str(clips_dir)}])]) == 0  # fmt: skip
    rows = TensorParquetDataset(shards)
    assert len(rows) == 4 and rows[0]["vae_latent"].shape == (8, 3, 8, 8)
    datasets = [{**train, "tensor_parquet_dir": str(shards)}, {**prompts, "dataset_dir": str(clips_dir)}]
    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(recipe), "--model.pretrained_model_name_or_path", str(demo_base),
        "--data.datasets", json.dumps(datasets), "--data.per_device_batch_size", "2", "--model.sampling.num_steps",
        "2", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.default_root_dir",
        str(tmp_path / "run"), "--trainer.logger.init_args.save_dir", str(tmp_path / "run")])  # fmt: skip
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 2 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])
