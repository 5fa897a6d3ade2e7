"""FlowDataModule on the dataflow loader: the batch format, the loader state in Lightning checkpoints, and an exact
mid-epoch resume in one process (the 2-process DDP resume through `ff fit` is tests/test_ddp_resume.py)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from ff_core.callbacks import SampleLog, read_sample_log
from ff_core.data.cache.identity import MediaDigests, records_identity
from ff_core.data.dataflow import DataflowLoader
from ff_core.data.datamodule import STAMP_KEY, FlowDataModule
from ff_core.data.records.sources import DatasetConfig, load_split
from ff_core.data.samples import ConditionedRecords, RecordProcessor, SampleCollator, process_and_collate
from ff_core.errors import DatasetErrors
from ff_core.lora import LoRAConfig
from ff_core.module import FlowModule

BATCH_KEYS = {"index", "prompt", "condition", "target", "metadata"}
REPO = Path(__file__).resolve().parents[1]


def datamodule(shapes_dir, **kw) -> FlowDataModule:
    return FlowDataModule([DatasetConfig(name="shapes", dataset_dir=str(shapes_dir))], adapter="sd3-5", **kw)


def module(tiny_sd3) -> FlowModule:
    return FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32},
                      lora=LoRAConfig(rank=2, target_modules=["to_q"]))


def test_record_processor_and_collator_keep_the_batch_format(shapes_dir):
    """Conditions stack, targets stay per-sample lists of decoded media, prompts a list, indices a tensor."""
    records = load_split(DatasetConfig(name="shapes", dataset_dir=str(shapes_dir)), "train", "sft")
    conditions = [{"embeds": torch.full((2, 3), float(i))} for i in range(len(records))]
    table = ConditionedRecords(records, conditions)
    samples = [RecordProcessor().process(table[i]) for i in (3, 7)]
    batch = SampleCollator().collate(samples)
    assert set(batch) == BATCH_KEYS
    assert batch["index"].tolist() == [3, 7] and batch["prompt"] == [records[3].prompt, records[7].prompt]
    torch.testing.assert_close(batch["condition"]["embeds"], torch.stack([conditions[3]["embeds"],
                                                                          conditions[7]["embeds"]]))
    assert [len(t) for t in batch["target"]] == [1, 1]
    assert batch["metadata"] == [records[3].metadata, records[7].metadata]  # reward metadata reaches the batch
    assert batch["target"][0][0].shape == (3, 32, 32) and batch["target"][0][0].dtype == torch.uint8
    assert process_and_collate([table[3], table[7]])["index"].tolist() == [3, 7]
    with pytest.raises(ValueError, match="24 records but 1 conditions"):
        ConditionedRecords(records, conditions[:1])


def test_missing_folder_is_reported_once_not_per_split(tmp_path):
    dm = FlowDataModule([DatasetConfig(name="gone", dataset_dir=str(tmp_path / "gone"), eval={})])
    with pytest.raises(DatasetErrors) as info:
        dm.setup("fit")
    assert [e.format() for e in info.value.errors] == [
        f"{tmp_path}/gone: dataset_dir: dataset 'gone': folder does not exist"]


def test_references_are_metadata_for_an_adapter_without_references(tmp_path, caplog):
    """Flow-Factory hands a pipeline only the columns it preprocesses: an SD3.5 run keeps a row's references as
    metadata (with a warning), never opens them, and never passes them to the adapter."""
    (tmp_path / "train.txt").write_text("a prompt\n")
    (tmp_path / "test.jsonl").write_text(json.dumps(
        {"prompt": "p", "references": [{"type": "image", "path": "gone.png"}], "tag": "t"}) + "\n")
    dm = FlowDataModule([DatasetConfig(name="refs", dataset_dir=str(tmp_path), eval={})], adapter="sd3-5",
                        trainer_type="grpo")
    with caplog.at_level("WARNING", logger="ff_core.data.datamodule"):
        dm.setup("fit")
    (record,) = dm.eval_records
    assert record.references == () and record.metadata == {
        "tag": "t", "references": [{"type": "image", "path": str(tmp_path / "gone.png")}]}
    assert f"{tmp_path}/test.jsonl:1: warning: references: kept as metadata, not a model input: adapter 'sd3-5' " \
           "takes no ordered references" in caplog.text


def test_preference_records_give_chosen_and_rejected_fitted_to_the_geometry(shapes_dpo_dir, shapes_dir):
    """A preference record's batch carries both arms (no ``target``), each decoded and fitted to the output geometry
    as a target is (the fitting itself is checked against Pillow in tests/data/test_geometry.py); a batch that mixes
    supervision types is refused."""
    from ff_core.contracts import MediaGeometry
    from ff_core.data.media.decode import decode_media
    from ff_core.data.media.geometry import fit_media

    records = load_split(DatasetConfig(name="pairs", dataset_dir=str(shapes_dpo_dir)), "train", "offline-dpo")
    table = ConditionedRecords(records, [{"embeds": torch.zeros(2)} for _ in records])
    geometry = MediaGeometry(16, 16)
    processor = RecordProcessor((geometry,))
    batch = SampleCollator().collate([processor.process(table[i]) for i in (0, 5)])
    assert set(batch) == {"index", "prompt", "condition", "chosen", "rejected", "metadata"}
    for arm, position in (("chosen", 0), ("rejected", 1)):
        for (image,), i in zip(batch[arm], (0, 5)):
            assert image.shape == (3, 16, 16)
            assert torch.equal(image, fit_media(decode_media(records[i].candidates[position][0]), geometry))
    assert not torch.equal(batch["chosen"][0][0], batch["rejected"][0][0])
    demonstrations = load_split(DatasetConfig(name="shapes", dataset_dir=str(shapes_dir)), "train", "sft")
    target = processor.process(ConditionedRecords(demonstrations, [{"embeds": torch.zeros(2)}] * 24)[7])
    with pytest.raises(ValueError, match=r"mixes supervision types: record 0 carries \['chosen', 'rejected'\], "
                                         r"record 7 \['target'\]"):
        SampleCollator().collate([processor.process(table[0]), target])


def test_negative_num_workers_is_refused(shapes_dir):
    with pytest.raises(ValueError, match=r"data\.num_workers must be >= 0, got -1"):
        datamodule(shapes_dir, num_workers=-1)


class Batches(L.Callback):
    """Keeps the batches the training loop ran (after on_before_batch_transfer)."""

    def __init__(self) -> None:
        self.batches: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(batch)


def fit(tiny_sd3, shapes_dir, root, max_steps, ckpt_path=None, **data_kw):
    dm, log, seen = datamodule(shapes_dir, per_device_batch_size=4, **data_kw), SampleLog(str(root / "ids")), Batches()
    ckpt = L.pytorch.callbacks.ModelCheckpoint(root / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[log, seen, ckpt])
    trainer.fit(module(tiny_sd3), datamodule=dm, ckpt_path=ckpt_path)  # torch's safe loading (LoRAConfig allowed)
    return dm, read_sample_log(root / "ids" / "rank0.jsonl"), seen.batches


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_yields_exactly_the_remaining_samples(tiny_sd3, shapes_dir, tmp_path, num_workers):
    """24 records, 4 per step: 6 steps an epoch. Uninterrupted: 7 steps. Resumed from the step-2 checkpoint: steps
    3..7, i.e. the other 16 records of epoch 0 then epoch 1's first 4 — no duplicate, no skip, and the same epoch
    numbers (Lightning's epoch would end after step 4 if the loader's length counted only the rest of the epoch)."""
    dm, full, batches = fit(tiny_sd3, shapes_dir, tmp_path / "full", 7, num_workers=num_workers)
    assert all(set(b) == BATCH_KEYS for b in batches)  # the stamp is consumed before the step
    assert dm.train_dataloader() is dm.train_dataloader()
    (step2,) = (tmp_path / "full" / "ckpt").glob("*step=2.ckpt")
    saved = torch.load(step2, weights_only=False)
    # Lightning saves the loader state; the datamodule keeps the same one (a resume on another number of ranks needs
    # the epoch's length before Lightning restores the loader).
    (state,) = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert state["mode"] == "epoch" and state["step"] == 2 and state["world"] == 1
    assert saved["FlowDataModule"] == {"train_loader": state}

    _, resumed, _ = fit(tiny_sd3, shapes_dir, tmp_path / "resumed", 7, ckpt_path=step2, num_workers=num_workers)
    assert resumed == full[2:]
    epoch0 = [i for r in full[:2] + resumed if r["epoch"] == 0 for i in r["ids"]]
    assert sorted(epoch0) == list(range(24))


def test_training_loader_is_a_stamped_dataflow_loader(tiny_sd3, shapes_dir, tmp_path):
    dm = datamodule(shapes_dir, per_device_batch_size=5, seed=7)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)
    model = module(tiny_sd3)
    trainer.strategy.connect(model)
    dm.trainer = trainer
    dm.setup("fit")
    model.configure_model()
    loader = dm.train_dataloader()
    assert isinstance(loader, DataflowLoader) and loader.mode == "epoch"
    identity = {"shapes": {"rows": 24, "sha256": records_identity(dm.train_records, MediaDigests())}}
    assert loader.distributor.fingerprint() == {"kind": "SamplerDistributor", "name": "train", "length": 24,
                                                "shuffle": True, "seed": 7, "records": identity}
    assert len(loader) == 5  # ceil(24 / 5): one complete traversal, the last batch partial
    batches = list(loader)
    assert set(batches[0]) == BATCH_KEYS | {STAMP_KEY} and [len(b["prompt"]) for b in batches] == [5, 5, 5, 5, 4]
    assert len(loader) == 5 and sorted(i for b in batches for i in b["index"].tolist()) == list(range(24))


def test_accumulation_must_divide_an_offline_epoch(tiny_sd3, shapes_dir, tmp_path):
    """24 records, 8 per step: 3 batches an epoch; accumulating 2 would end the epoch inside a window."""
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accumulate_grad_batches=2, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2 does not divide the 3 batches of an epoch"):
        trainer.fit(module(tiny_sd3), datamodule=datamodule(shapes_dir, per_device_batch_size=8))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accumulate_grad_batches=3, limit_val_batches=0,
                        default_root_dir=tmp_path)
    trainer.fit(module(tiny_sd3), datamodule=datamodule(shapes_dir, per_device_batch_size=8))
    assert trainer.global_step == 1


def test_ff_fit_epochs_are_complete_traversals(tiny_sd3, shapes_dir, tmp_path):
    """`ff fit` on 24 records, 5 per batch, 4 epochs: every epoch is 5 batches (5, 5, 5, 5, 4) that consume every
    record exactly once (before the fix, epoch 0's last batch took a record of epoch 1, so later epochs differed)."""
    from ff_core.cli import main

    datasets = json.dumps([{"name": "shapes", "dataset_dir": str(shapes_dir)}])
    callbacks = json.dumps([{"class_path": "ff_core.callbacks.SampleLog", "init_args": {"dirpath": str(tmp_path)}}])
    main(["fit", "--config", str(REPO / "configs" / "sd3" / "sft_tiny.yaml"),
          "--model.pretrained_model_name_or_path", str(tiny_sd3), "--data.datasets", datasets,
          "--data.per_device_batch_size", "5", "--trainer.max_epochs", "4", "--trainer.max_steps", "-1",
          "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false",
          "--trainer.enable_progress_bar", "false", "--trainer.callbacks", callbacks])
    rows = read_sample_log(tmp_path / "rank0.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 21))
    for epoch in range(4):
        batches = [r["ids"] for r in rows if r["epoch"] == epoch]
        assert [len(b) for b in batches] == [5, 5, 5, 5, 4], epoch
        assert sorted(i for b in batches for i in b) == list(range(24)), epoch


def test_accumulation_check_holds_in_every_epoch(tiny_sd3, shapes_dir, tmp_path):
    """24 records, 7 per batch: 4 batches (7, 7, 7, 3) in every epoch, so accumulating 4 closes a window exactly at
    each epoch's end. (Before the fix epoch 1 had 3 batches, and Lightning silently stepped on a partial window.)"""
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accumulate_grad_batches=4, limit_val_batches=0,
                        default_root_dir=tmp_path, callbacks=[SampleLog(str(tmp_path / "ids"))])
    trainer.fit(module(tiny_sd3), datamodule=datamodule(shapes_dir, per_device_batch_size=7))
    rows = read_sample_log(tmp_path / "ids" / "rank0.jsonl")
    assert [r["epoch"] for r in rows] == [0] * 4 + [1] * 4
    assert trainer.global_step == 2 and [r["step"] for r in rows] == [0, 0, 0, 1, 1, 1, 1, 2]
    for epoch in (0, 1):
        assert sorted(i for r in rows if r["epoch"] == epoch for i in r["ids"]) == list(range(24))


@pytest.mark.parametrize("change", ["target replaced in place", "prompt edited", "row removed"])
def test_resume_onto_changed_records_fails_naming_the_dataset(tiny_sd3, shapes_dir, tmp_path, change):
    """The resume fingerprint covers the records' identity (prompts and every media file's bytes, targets included):
    resuming onto a dataset changed since the checkpoint fails, saying which dataset and what kind of change, instead
    of silently continuing another order (spec: "Condition cache and target lifecycle")."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(shapes_dir, data)
    fit(tiny_sd3, data, tmp_path / "first", 2)
    (step2,) = (tmp_path / "first" / "ckpt").glob("*step=2.ckpt")
    lines = (data / "train.jsonl").read_text().splitlines()
    if change == "target replaced in place":
        first = json.loads(lines[0])["supervision"]["target"]["media"][0]["path"]
        shutil.copyfile(data / json.loads(lines[1])["supervision"]["target"]["media"][0]["path"], data / first)
        expected = r"'distributor\.records\.shapes\.sha256'.*records of dataset 'shapes' changed.*replaced in place"
    elif change == "prompt edited":
        lines[3] = lines[3].replace('"prompt":"a ', '"prompt":"one ', 1)
        assert lines[3] != (data / "train.jsonl").read_text().splitlines()[3]
        expected = r"'distributor\.records\.shapes\.sha256'.*records of dataset 'shapes' changed"
    else:
        lines = lines[:-1]
        expected = r"'distributor\.length' is 24 in the checkpoint but 23"
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=expected):
        fit(tiny_sd3, data, tmp_path / "resumed", 4, ckpt_path=step2)
