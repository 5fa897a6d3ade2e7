"""Tensor-parquet shards know what they were written for, and how small they may be stored.

* ``ff data preprocess-latents`` stores its provenance (adapter, contract, checkpoint component configs, output
  geometry, adapter_kwargs, storage) in every file's footer; ``ff fit`` refuses shards written for another geometry or
  checkpoint before any weight loads, warns on other differing kwargs, and trains from shards without provenance.
* Storage: bf16 by default (the card's), float32 on request, float8_e4m3fn for the latent columns (conditions then
  bf16), each read back and trained from; a latent FP8 cannot hold is refused naming its record and column.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from ff_core.cli import main
from ff_core.cli.preprocess_latents import FP8_MAX, StorageError, _stored, write_latent_shards
from ff_core.data.datamodule import FlowDataModule
from ff_core.data.records.sources import DatasetConfig, load_split
from ff_core.data.tensor_parquet import TensorParquetDataset
from ff_core.data.tensor_parquet.provenance import read_provenance, shard_provenance
from ff_core.data.tensor_parquet.rows import TensorRowCollator, TensorRowProcessor, TensorRows
from ff_core.errors import ConfigError
from ff_core.lora import LoRAConfig
from ff_core.module import FlowModule

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "sd3" / "sft_tiny.yaml"


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tiny_sd3, shapes_dir):
    """The shapes split written by the command with its defaults (bf16), 10 rows per file."""
    out = tmp_path_factory.mktemp("provenance") / "shards"
    assert main(["data", "preprocess-latents", "--output", str(out), "--rows-per-file", "10", "--no-progress",
                 "--config", str(RECIPE), "--model.pretrained_model_name_or_path", str(tiny_sd3),
                 "--data.datasets", json.dumps([{"name": "shapes", "dataset_dir": str(shapes_dir)}])]) == 0
    return out


def setup(shards, pretrained, **adapter_kwargs):
    dm = FlowDataModule([{"name": "latents", "tensor_parquet_dir": str(shards)}], adapter="sd3-5",
                        pretrained_model_name_or_path=str(pretrained),
                        adapter_kwargs={"resolution": 32, **adapter_kwargs})  # fmt: skip
    dm.setup("fit")
    return dm


def test_every_file_stores_the_provenance_and_bf16_is_the_default(shards, tiny_sd3):
    from ff_sd3 import SD3Adapter

    dataset = TensorParquetDataset(shards)
    assert len(dataset.files) == 3
    expected = shard_provenance(SD3Adapter, str(tiny_sd3), {"resolution": 32}, "demonstration",
                                {"dtype": "bfloat16", "seed": 0})  # fmt: skip
    assert {"vae", "text_encoder", "text_encoder_2", "text_encoder_3"} <= set(expected["checkpoint"])
    assert "transformer" not in expected["checkpoint"] and "scheduler" not in expected["checkpoint"]
    for file in dataset.files:
        assert read_provenance(file) == expected
    row = dataset[0]
    assert row["latent"].dtype == row["prompt_embeds"].dtype == torch.bfloat16


def test_shards_of_another_geometry_or_checkpoint_are_refused_before_weights_load(shards, tiny_sd3, tmp_path,
                                                                                   caplog):  # fmt: skip
    assert len(setup(shards, tiny_sd3).train_rows) == 24
    # The canvas: SD3's rows fix no latent size (any multiple of the patch trains), so only the provenance sees it.
    with pytest.raises(ConfigError, match=r"data\.datasets\[0\]\.tensor_parquet_dir: .*data_chunk_0\.parquet: "
                                          r"written for another run: model\.adapter_kwargs\.resolution: the shards "
                                          r"were written with 32, this run has 64 \(rewrite them"):  # fmt: skip
        setup(shards, tiny_sd3, resolution=64)
    # The same checkpoint with another VAE (its scaling factor: latents of the same shape, scaled otherwise).
    other = tmp_path / "other-vae"
    shutil.copytree(tiny_sd3, other)
    config = json.loads((other / "vae" / "config.json").read_text())
    config["scaling_factor"] = 0.5
    (other / "vae" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"checkpoint: the shards were computed by another vae"):
        setup(shards, other)
    # A copy of the same checkpoint elsewhere (another machine's path) is the same checkpoint.
    same = tmp_path / "copy"
    shutil.copytree(tiny_sd3, same)
    assert len(setup(shards, same).train_rows) == 24
    # Other kwargs are warned about, the training precision never.
    with caplog.at_level(logging.WARNING):
        setup(shards, tiny_sd3, max_sequence_length=8, dtype="bfloat16")
    warned = [r.getMessage() for r in caplog.records if "tensor_parquet_dir" in r.getMessage()]
    assert warned == ["data.datasets[0].tensor_parquet_dir: model.adapter_kwargs.max_sequence_length: the shards "
                      "were written with 256, this run has 8"]


def test_shards_without_provenance_train_unchecked(shapes_latents_dir, tiny_sd3):
    """Shards another tool wrote (here: ff's own, provenance stripped) open as before: columns and shapes only."""
    import pyarrow.parquet as pq

    plain = Path(str(shapes_latents_dir) + "_plain")
    if not plain.exists():
        for file in TensorParquetDataset(shapes_latents_dir).files:
            target = plain / file.relative_to(shapes_latents_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            table = pq.read_table(file)
            pq.write_table(table.replace_schema_metadata(None), target)
    assert read_provenance(next(plain.rglob("*.parquet"))) is None
    assert len(setup(plain, tiny_sd3, resolution=64).train_rows) == 24  # nothing to compare the canvas with


def test_fp8_latents_are_read_back_and_train_within_their_rounding(tiny_sd3, shapes_dir, tmp_path):
    """``--dtype float8_e4m3fn``: latent columns in FP8 (1 byte an element), conditions in bf16; the loss of a step
    from them stays within FP8's rounding of the latents (3 mantissa bits: <= 6.25 % per element)."""
    module = FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32},
                        lora=LoRAConfig(rank=2, target_modules=["to_q"]))  # fmt: skip
    module.configure_model()
    adapter, objective = module.adapter, module.objective
    records = load_split(DatasetConfig(name="shapes", dataset_dir=str(shapes_dir)), "train", "sft")[:6]
    write_latent_shards(adapter, records, tmp_path / "fp32", batch_size=6, progress=False)
    write_latent_shards(adapter, records, tmp_path / "fp8", batch_size=6, dtype=torch.float8_e4m3fn, progress=False)
    full, small = TensorParquetDataset(tmp_path / "fp32"), TensorParquetDataset(tmp_path / "fp8")
    row32, row8 = full[0], small[0]
    assert row8["latent"].dtype == torch.float8_e4m3fn and row8["prompt_embeds"].dtype == torch.bfloat16
    x, q = row32["latent"], row8["latent"].float()
    assert torch.all((q - x).abs() <= 2**-4 * x.abs() + 2**-9)  # E4M3: 3 mantissa bits, subnormal step 2^-9
    assert not torch.equal(q, x)

    def batch(root):
        processor = TensorRowProcessor(TensorRows([TensorParquetDataset(root)]), adapter.tensor_columns)
        return TensorRowCollator().collate([processor.process(i) for i in range(6)])

    loss32 = objective.training_loss(adapter, batch(tmp_path / "fp32"), torch.Generator().manual_seed(1))
    loss8 = objective.training_loss(adapter, batch(tmp_path / "fp8"), torch.Generator().manual_seed(1))
    assert batch(tmp_path / "fp8")["latents"]["latent"].dtype == torch.float8_e4m3fn
    torch.testing.assert_close(loss8.per_sample, loss32.per_sample, rtol=5e-2, atol=0)
    sizes = {root: sum(f.stat().st_size for f in (tmp_path / root).rglob("*.parquet")) for root in ("fp32", "fp8")}
    assert row8["latent"].element_size() == 1 and sizes["fp8"] < 0.6 * sizes["fp32"]  # text embeddings: bf16


def test_a_latent_fp8_cannot_hold_is_refused_with_its_record():
    assert _stored(torch.tensor([FP8_MAX]), torch.float8_e4m3fn, True, "train.jsonl:3", "latent").item() == FP8_MAX
    with pytest.raises(StorageError, match=r"train\.jsonl:3: latent reaches \|x\| = 500, beyond float8_e4m3fn's 448"):
        _stored(torch.tensor([1.0, -500.0]), torch.float8_e4m3fn, True, "train.jsonl:3", "latent")
    embeds = _stored(torch.tensor([1000.0]), torch.float8_e4m3fn, False, "train.jsonl:3", "prompt_embeds")
    assert embeds.dtype == torch.bfloat16 and embeds.item() == 1000.0  # conditions are never FP8


def test_ff_fit_trains_from_fp8_shards(tiny_sd3, shapes_dir, tmp_path):
    out = tmp_path / "fp8"
    assert main(["data", "preprocess-latents", "--output", str(out), "--no-progress", "--dtype", "float8_e4m3fn",
                 "--config", str(RECIPE), "--model.pretrained_model_name_or_path", str(tiny_sd3),
                 "--data.datasets", json.dumps([{"name": "shapes", "dataset_dir": str(shapes_dir)}])]) == 0
    assert read_provenance(next(out.rglob("*.parquet")))["storage"]["dtype"] == "float8_e4m3fn"
    assert main(["fit", "--config", str(REPO / "configs" / "sd3" / "sft_latents_tiny.yaml"),
                 "--model.pretrained_model_name_or_path", str(tiny_sd3),
                 "--data.datasets", json.dumps([{"name": "latents", "tensor_parquet_dir": str(out)}]),
                 "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false",
                 "--trainer.default_root_dir", str(tmp_path / "run")]) in (0, None)  # fmt: skip
    assert any((tmp_path / "run").rglob("last*"))

