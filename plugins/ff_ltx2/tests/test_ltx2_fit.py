"""``ff fit`` SFT on the CPU with the LTX-2 recipe, from a generated MP4 + WAV dataset (22.05 kHz mono WAVs: the codec
converts channels and rate); V2 records that break the (video, audio) pair contract fail before weights load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ff_ltx2.testing import write_av_clips

from ff_core.cli import main
from ff_core.data.datamodule import FlowDataModule
from ff_core.lightning_cli import FlowCLI
from ff_core.module import FlowModule

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "configs" / "ltx2"


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return write_av_clips(tmp_path_factory.mktemp("ltx2-clips"), 4)


def fit(recipe: str, pretrained: Path, datasets: list[dict], root: Path, *extra: str) -> FlowCLI:
    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(CONFIGS / recipe), "--model.pretrained_model_name_or_path", str(pretrained),
        "--data.datasets", json.dumps(datasets), "--model.sampling.num_steps", "2", "--trainer.max_steps", "2",
        "--trainer.val_check_interval", "2", "--trainer.log_every_n_steps", "1", "--data.num_workers", "0",
        "--trainer.default_root_dir", str(root), *extra])  # fmt: skip
    cli.trainer.fit(cli.model, cli.datamodule)
    return cli


def test_t2av_recipe_trains_from_mp4_and_wav_pairs(tiny_ltx2, clips, tmp_path):
    cli = fit("sft_tiny.yaml", tiny_ltx2("t2av"), [{"name": "clips", "dataset_dir": str(clips), "eval": {}}],
              tmp_path, "--data.per_device_batch_size", "2")
    assert cli.trainer.global_step == 2 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    version = next((tmp_path / "lightning_logs").iterdir())
    samples = version / "samples" / "step_000002"
    import av

    with av.open(str(samples / "00000.mp4")) as container:  # at the adapter's 8 fps
        assert float(container.streams.video[0].average_rate) == 8.0
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 9 and frames[0].shape == (32, 32, 3)
    lora = version / "checkpoints" / "last.lora" / "pytorch_lora_weights.safetensors"
    assert lora.stat().st_size > 0
