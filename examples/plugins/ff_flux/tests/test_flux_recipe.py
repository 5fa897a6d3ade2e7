"""ff-flux's tiny SFT recipe through `ff fit`: it starts with its command, trains a few LoRA steps on the shapes,
validates with embedded guidance, and exports a LoRA that ``FluxPipeline.load_lora_weights`` loads."""

import csv
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from ff_core.cli import main

HERE = Path(__file__).resolve().parents[1]
REPO = HERE.parents[2]
RECIPE = HERE / "configs" / "sft_tiny.yaml"


@pytest.fixture(autouse=True)
def ff_argv(monkeypatch):
    """`ff fit` as the console script sees it (LightningCLI warns when pytest's own arguments are in sys.argv)."""
    monkeypatch.setattr(sys, "argv", ["ff"])


def test_sft_tiny_recipe_trains_through_ff_fit(tiny_flux_dev, shapes_dir, tmp_path):
    from diffusers import FluxPipeline

    assert RECIPE.read_text().startswith(f"# ff fit --config {RECIPE.relative_to(REPO)}")
    datasets = json.dumps([{"name": "shapes", "dataset_dir": str(shapes_dir), "eval": {}}])
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger",
              "init_args": {"save_dir": str(tmp_path), "name": "logs", "version": 0}}  # fmt: skip
    status = main(["fit", "--config", str(RECIPE), "--model.pretrained_model_name_or_path", str(tiny_flux_dev),
                   "--data.datasets", datasets, "--data.eval_batch_size", "6", "--model.sampling.num_steps", "2",
                   "--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.log_every_n_steps", "1",
                   "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", json.dumps(logger)])  # fmt: skip
    assert status == 0
    rows = list(csv.DictReader(open(tmp_path / "logs" / "version_0" / "metrics.csv")))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert any(r.get("val/reward") for r in rows)  # validation sampled (embedded guidance 3.5) and scored
    lora = tmp_path / "logs" / "version_0" / "checkpoints" / "last.lora"  # the recipe exports every 10 steps and last
    pipe = FluxPipeline.from_pretrained(tiny_flux_dev)
    pipe.load_lora_weights(lora)
    assert any("lora_A" in name for name, _ in pipe.transformer.named_parameters())
    image = pipe("a red circle", num_inference_steps=2, height=32, width=32, max_sequence_length=16,
                 output_type="pt", generator=torch.Generator().manual_seed(0)).images  # fmt: skip
    assert image.shape == (1, 3, 32, 32) and torch.isfinite(image).all()


@pytest.mark.parametrize(("overrides", "message"), [
    ([], "ff fit: model.adapter_kwargs.embedded_guidance: 3.5 is set, but this checkpoint's transformer has no "
         "guidance embedding"),
    (["--model.adapter_kwargs.embedded_guidance", "null"],
     "ff fit: model.sampling.embedded_guidance: 3.5 is set, but the 'flux1' checkpoint"),
])  # fmt: skip
def test_the_dev_recipe_on_a_schnell_checkpoint_fails_naming_the_key(tiny_flux_schnell, shapes_dir, tmp_path, capsys,
                                                                     overrides, message):
    """Embedded guidance asked of a checkpoint without a guidance embedding is one line naming the key, exit 2,
    before any step."""
    datasets = json.dumps([{"name": "shapes", "dataset_dir": str(shapes_dir)}])
    status = main(["fit", "--config", str(RECIPE), "--model.pretrained_model_name_or_path", str(tiny_flux_schnell),
                   "--data.datasets", datasets, "--trainer.default_root_dir", str(tmp_path), *overrides])
    assert status == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.ckpt"))
