"""SFT from tensor-parquet shards with the tiny SD3 model: ``ff data preprocess-latents`` stores exactly what the
adapter computes, the loss of a batch read from shards is the in-memory loss without any VAE, and ``ff fit`` trains
from shards and resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import default_collate

from ff_core.adapter import LatentState
from ff_core.callbacks import SampleLog, read_sample_log
from ff_core.cli import main
from ff_core.cli.flow_cli import FlowCLI
from ff_core.cli.preprocess_latents import write_latent_shards
from ff_core.data.dataflow import derive_seed
from ff_core.data.datamodule import FlowDataModule
from ff_core.data.media.conditions import condition_input
from ff_core.data.records.sources import DatasetConfig, load_split
from ff_core.data.samples import ConditionedRecord, RecordProcessor
from ff_core.data.tensor_parquet import TensorParquetDataset
from ff_core.data.tensor_parquet.rows import TensorRowCollator, TensorRowProcessor, TensorRows
from ff_core.lora import LoRAConfig
from ff_core.module import FlowModule

REPO = Path(__file__).resolve().parents[1]
ROWS = 6  # rows compared; the fixture's shards hold all 24 records, encoded in one batch (preprocessing_batch_size 32)


@pytest.fixture(scope="module")
def reference(tiny_sd3, shapes_dir):
    """The adapter (LoRA on to_q) and, for the first records, what it computes in memory: the conditions
    ``preprocess`` returns and the latents ``encode_output`` returns with the command's generator (batch 0, seed 0)."""
    module = FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32},
                        lora=LoRAConfig(rank=2, target_modules=["to_q"]))
    module.configure_model()
    adapter = module.adapter
    records = load_split(DatasetConfig(name="shapes", dataset_dir=str(shapes_dir)), "train", "sft")
    conditions = adapter.preprocess([condition_input(r, adapter.io_contract) for r in records])
    processor = RecordProcessor(adapter.output_geometry())
    targets = [processor.process(ConditionedRecord(i, r, {}))["target"] for i, r in enumerate(records)]
    with torch.no_grad():
        latents = adapter.encode_output(targets, adapter.prepare_condition(default_collate(conditions)),
                                        generator=torch.Generator().manual_seed(derive_seed(0, 0)))
    return module, records, conditions, latents.components["latent"]


def shard_batch(root, adapter, rows=range(ROWS)):
    dataset = TensorParquetDataset(root, columns=[*adapter.tensor_columns.required, "prompt"])
    processor = TensorRowProcessor(TensorRows([dataset]), adapter.tensor_columns)
    return TensorRowCollator().collate([processor.process(i) for i in rows])


def test_preprocess_latents_stores_the_adapters_conditions_and_latents(shapes_latents_dir, reference):
    module, records, conditions, latents = reference
    dataset = TensorParquetDataset(shapes_latents_dir)
    assert len(dataset) == len(records) == 24 and len(dataset.files) == 3  # 10 rows per file, the last one partial
    assert set(dataset.tensor_names) == {"prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds",
                                         "negative_pooled_prompt_embeds", "latent"}
    for i in (0, 13, 23):
        row = dataset[i]
        assert row["prompt"] == records[i].prompt and row["source"] == f"{records[i].source}:{records[i].line}"
        for key, value in conditions[i].items():
            assert torch.equal(row[key], value), key
        assert torch.equal(row["latent"], latents[i]) and row["latent"].dtype == torch.float32


def test_sft_loss_from_shards_is_the_in_memory_loss_and_runs_no_vae(shapes_latents_dir, reference, tmp_path):
    """Same latents, same conditions, same generator: bitwise the same loss, and the VAE is gone. Stored in bf16
    (the card's storage), the loss moves by the rounding of latents and embeddings only (measured: 2e-4 relative
    here)."""
    module, records, conditions, latents = reference
    adapter, objective = module.adapter, module.objective
    bf16_root = tmp_path / "bf16"
    write_latent_shards(adapter, records[:ROWS], bf16_root, batch_size=ROWS, dtype=torch.bfloat16, progress=False)
    condition = adapter.prepare_condition(default_collate(conditions[:ROWS]))
    expected = objective.loss(adapter, LatentState({"latent": latents[:ROWS]}), condition,
                              torch.Generator().manual_seed(7))
    vae = adapter.vae
    adapter.vae = None  # any encode would fail now
    try:
        got = objective.training_loss(adapter, shard_batch(shapes_latents_dir, adapter),
                                      torch.Generator().manual_seed(7))
        bf16 = objective.training_loss(adapter, shard_batch(bf16_root, adapter), torch.Generator().manual_seed(7))
    finally:
        adapter.vae = vae
    assert torch.equal(got.per_sample, expected.per_sample) and torch.equal(got.sigma, expected.sigma)
    assert shard_batch(bf16_root, adapter)["latents"]["latent"].dtype == torch.bfloat16
    torch.testing.assert_close(bf16.per_sample, expected.per_sample, rtol=1e-3, atol=0)
    assert not torch.equal(bf16.per_sample, expected.per_sample)


def test_preprocess_latents_refuses_a_non_empty_output(tmp_path, capsys):
    out = tmp_path / "shards"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    assert main(["data", "preprocess-latents", "--output", str(out), "--config", "whatever.yaml"]) == 2
    assert capsys.readouterr().out.strip() == (
        f"ff data preprocess-latents: --output {out}: exists and is not empty; pass --overwrite to replace it")
    assert (out / "mine.txt").read_text() == "keep me"


def fit(tiny_sd3, shards, root, max_steps, ckpt_path=None, **data_kw):
    """24 rows, 4 per micro-batch, 2 micro-batches per step: 3 steps an epoch; checkpoints every 2 steps."""
    dm = FlowDataModule([{"name": "latents", "tensor_parquet_dir": str(shards)}], adapter="sd3-5",
                        per_device_batch_size=4, **data_kw)
    module = FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32},
                        lora=LoRAConfig(rank=2, target_modules=["to_q"]))
    ckpt = L.pytorch.callbacks.ModelCheckpoint(root / "ckpt", every_n_train_steps=2, save_top_k=-1)
    probe = EncoderProbe()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, accumulate_grad_batches=2, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[SampleLog(str(root / "ids"), outputs=("sigma", "noise_seed", "loss")), ckpt, probe])
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    assert probe.calls == 0 and module.adapter.text_encoder is None  # no VAE encode, text encoders released
    return read_sample_log(root / "ids" / "rank0.jsonl")


class EncoderProbe(L.Callback):
    """Counts forwards of the VAE's encoder during training."""

    def on_train_start(self, trainer, pl_module):
        self.calls = 0
        self.handle = pl_module.adapter.vae.encoder.register_forward_hook(lambda *_: setattr(self, "calls",
                                                                                              self.calls + 1))

    def on_train_end(self, trainer, pl_module):
        self.handle.remove()


def test_fit_from_shards_resumes_exactly(tiny_sd3, shapes_latents_dir, tmp_path):
    """Killed after step 2 (mid-epoch: 3 steps an epoch) and resumed from its checkpoint, without and with loader
    workers: the same rows, noise and losses, micro-batch for micro-batch, as the uninterrupted run; every epoch is
    one traversal of the 24 rows."""
    full = fit(tiny_sd3, shapes_latents_dir, tmp_path / "full", 6)
    assert sorted(i for r in full[:6] for i in r["ids"]) == list(range(24))
    assert sorted(i for r in full[6:] for i in r["ids"]) == list(range(24))
    (step2,) = (tmp_path / "full" / "ckpt").glob("*step=2.ckpt")
    resumed = fit(tiny_sd3, shapes_latents_dir, tmp_path / "resumed", 6, ckpt_path=step2)
    assert resumed == full[4:]
    # Loader workers hand the rows to the main process as file ranges (read into each batch there): same run.
    workers = fit(tiny_sd3, shapes_latents_dir, tmp_path / "workers", 6, ckpt_path=step2, num_workers=2)
    assert workers == full[4:]


def test_the_latents_recipe_trains_through_ff_fit(tiny_sd3, shapes_dir, shapes_latents_dir, tmp_path):
    datasets = [{"name": "latents", "tensor_parquet_dir": str(shapes_latents_dir)},
                {"name": "prompts", "dataset_dir": str(shapes_dir), "train": None, "eval": {}}]
    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(REPO / "configs" / "sd3" / "sft_latents_tiny.yaml"),
        "--model.pretrained_model_name_or_path", str(tiny_sd3), "--data.datasets", json.dumps(datasets),
        "--data.eval_batch_size", "6", "--model.sampling.num_steps", "2", "--trainer.max_steps", "3",
        "--trainer.val_check_interval", "3", "--trainer.log_every_n_steps", "1",
        "--trainer.default_root_dir", str(tmp_path)])  # fmt: skip
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 3 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    assert cli.model.adapter.text_encoder is None  # the evaluation prompts were cached, then the encoders released
    version = next((tmp_path / "lightning_logs").iterdir())
    assert (version / "samples" / "step_000003.png").stat().st_size > 0
    assert (version / "checkpoints" / "last.ckpt").exists()


def test_fit_shuffles_reference_layout_shards_by_row_group_window(tiny_sd3, shapes_latents_dir, tmp_path):
    """The same rows rewritten as the reference writer lays them out (one file, 8 rows per row group): with
    ``data.row_group_window: 2`` training visits them in the two-level order, and resumes in it exactly."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ff_core.data.tensor_parquet.order import GroupedSamplerDistributor

    table = pa.concat_tables([pq.read_table(f) for f in sorted(Path(shapes_latents_dir).rglob("*.parquet"))])
    grouped = tmp_path / "grouped" / "shard000" / "combined_parquet_dataset" / "worker_0" / "data_chunk_0.parquet"
    grouped.parent.mkdir(parents=True)
    pq.write_table(table, grouped, row_group_size=8)
    full = fit(tiny_sd3, tmp_path / "grouped", tmp_path / "full", 3, row_group_window=2)
    dm = FlowDataModule([{"name": "latents", "tensor_parquet_dir": str(tmp_path / "grouped")}], adapter="sd3-5")
    dm.setup("fit")
    order = GroupedSamplerDistributor(dm.train_rows, window=2, seed=0).rank_indices(0, 0, 1)
    assert [i for r in full for i in r["ids"]] == order
    (step2,) = (tmp_path / "full" / "ckpt").glob("*step=2.ckpt")
    assert fit(tiny_sd3, tmp_path / "grouped", tmp_path / "resumed", 3, ckpt_path=step2, row_group_window=2) == full[4:]


def test_offline_dpo_from_preference_shards_is_the_in_memory_loss(tiny_sd3, shapes_dpo_dir, tmp_path):
    """Preference records stored by ``ff data preprocess-latents`` (both arms encoded with the command's generators),
    read back: the DPO loss equals, bit for bit, the loss of the pairs encoded in memory, and needs no VAE."""
    from ff_core.objectives import DPOObjective

    module = FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32}, objective=DPOObjective(),
                        lora=LoRAConfig(rank=2, target_modules=["to_q"]))
    module.configure_model()
    adapter, objective = module.adapter, module.objective
    records = load_split(DatasetConfig(name="pairs", dataset_dir=str(shapes_dpo_dir)), "train", "offline-dpo")[:4]
    write_latent_shards(adapter, records, tmp_path / "pairs", batch_size=4, progress=False)
    conditions = adapter.preprocess([condition_input(r, adapter.io_contract) for r in records])
    condition = adapter.prepare_condition(default_collate(conditions))
    processor = RecordProcessor(adapter.output_geometry())
    samples = [processor.process(ConditionedRecord(i, r, {})) for i, r in enumerate(records)]
    arms = [adapter.encode_output([s[arm] for s in samples], condition,
                                  generator=torch.Generator().manual_seed(derive_seed(0, 0, k)))
            for k, arm in ((1, "chosen"), (2, "rejected"))]
    expected = objective.loss(adapter, *arms, condition, torch.Generator().manual_seed(3))

    dataset = TensorParquetDataset(tmp_path / "pairs", columns=list(adapter.tensor_columns.required_for("preference")))
    rows = TensorRowProcessor(TensorRows([dataset]), adapter.tensor_columns, supervision="preference")
    batch = TensorRowCollator().collate([rows.process(i) for i in range(4)])
    vae, adapter.vae = adapter.vae, None
    try:
        got = objective.training_loss(adapter, batch, torch.Generator().manual_seed(3))
    finally:
        adapter.vae = vae
    assert torch.equal(got.per_sample, expected.per_sample)
    assert not torch.equal(batch["chosen_latents"]["latent"], batch["rejected_latents"]["latent"])
    # The data module reads preference rows for offline DPO (and demonstration columns are not required).
    dm = FlowDataModule([{"name": "pairs", "tensor_parquet_dir": str(tmp_path / "pairs")}], adapter="sd3-5",
                        trainer_type="offline-dpo", per_device_batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["train/loss"])


def test_preprocess_latents_publishes_whole_datasets_only(reference, tmp_path, monkeypatch):
    """A failure half-way leaves neither shards nor temporary files; a completed run replaces what was there."""
    module, records, _, _ = reference
    adapter, out = module.adapter, tmp_path / "shards"
    out.mkdir()
    (out / "stale.parquet").write_bytes(b"old")
    encode, calls = adapter.encode_output, []

    def failing(*args, **kwargs):  # the second batch fails, after the first one's rows were written
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("disk full")
        return encode(*args, **kwargs)

    monkeypatch.setattr(adapter, "encode_output", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        write_latent_shards(adapter, records[:4], out, batch_size=2, rows_per_file=1, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards"] and (out / "stale.parquet").read_bytes() == b"old"
    monkeypatch.setattr(adapter, "encode_output", encode)
    assert write_latent_shards(adapter, records[:4], out, batch_size=2, rows_per_file=3, progress=False) == 4
    assert not (out / "stale.parquet").exists() and len(TensorParquetDataset(out)) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards"]
