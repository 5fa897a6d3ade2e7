"""MiniMax H3 (T2VA, FL2VA, Ref2VA) from tensor-parquet shards (docs/minimax.md, "Training from shards").

``ff data preprocess-latents`` stores what a training step computes (the condition ``preprocess`` returns, the clean
latents ``encode_output`` returns); read back through the data module's row processor and collator, one sample's SFT
loss equals, bit for bit (fp32 storage), the loss of the same record read from its dataset folder under the same
generator (the same timestep, the same noise and, FL2VA / Ref2VA, the same prefix realised in ``prepare_condition``),
and needs neither the VAEs nor the text encoder. Offline DPO from preference shards likewise (T2VA). The shipped
``*_latents_tiny`` recipes train through ``ff fit`` from shards in fp32 and bf16 without a single VAE encode, and a row
of the wrong geometry is refused before any weight loads."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pyarrow as pa
import pytest
import torch
from ff_minimax.references import manifest_text
from ff_minimax.testing import write_av_clips, write_keyframe_clips, write_reference_clips

from ff_core.cli import main
from ff_core.cli.flow_cli import FlowCLI
from ff_core.cli.preprocess import read_recipe
from ff_core.data.datamodule import FlowDataModule
from ff_core.data.media.conditions import condition_input
from ff_core.data.samples import ConditionedRecord, RecordProcessor, SampleCollator
from ff_core.data.tensor_parquet import TensorParquetDataset, TensorParquetWriter, tensor_schema
from ff_core.data.tensor_parquet.rows import TensorRowCollator, TensorRowProcessor, TensorRows
from ff_core.errors import DatasetErrors
from ff_core.module import FlowModule

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "minimax"
# Per workflow: the folder recipe the shards are written with, the shards recipe, and its tiny dataset (FL2VA: first,
# last, first + last keyframes; Ref2VA: [image], [image, audio], [audio, image, image]: a row without soundtrack rows).
WORKFLOWS = {
    "t2va": ("t2va_sft_tiny.yaml", "t2va_sft_latents_tiny.yaml", lambda root: write_av_clips(root, 2)),
    "fl2va": ("fl2va_sft_tiny.yaml", "fl2va_sft_latents_tiny.yaml", lambda root: write_keyframe_clips(root, 3)),
    "ref2va": ("ref2va_sft_tiny.yaml", "ref2va_sft_latents_tiny.yaml", lambda root: write_reference_clips(root, 3)),
}
DPO = ("t2va_offline_dpo_tiny.yaml", "t2va_offline_dpo_latents_tiny.yaml",
       lambda root: write_av_clips(root, 2, preference=True))  # fmt: skip
SCALARS = ("prompt", "source")


def _cached(build):
    """``get(*key)``: ``build(*key)`` once per key for the module."""
    done: dict = {}

    def get(*key):
        if key not in done:
            done[key] = build(*key)
        return done[key]

    return get


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``folders(workflow)``: its dataset folder (``"dpo"``: T2VA preference pairs)."""
    return _cached(lambda w: (DPO if w == "dpo" else WORKFLOWS[w])[2](tmp_path_factory.mktemp(f"minimax-{w}")))


def _variant(workflow: str) -> str:
    return "t2va" if workflow == "dpo" else workflow


@pytest.fixture(scope="module")
def shards(tiny_minimax, folders, tmp_path_factory):
    """``shards(workflow, dtype)``: the root ``ff data preprocess-latents --dtype <dtype>`` writes from the folder."""

    def write(workflow: str, dtype: str = "float32") -> Path:
        out = tmp_path_factory.mktemp(f"shards-{workflow}-{dtype}") / "rows"
        recipe = (DPO if workflow == "dpo" else WORKFLOWS[workflow])[0]
        datasets = json.dumps([{"name": workflow, "dataset_dir": str(folders(workflow))}])
        assert main(["data", "preprocess-latents", "--output", str(out), "--no-progress", "--dtype", dtype,
                     "--config", str(CONFIGS / recipe), "--model.pretrained_model_name_or_path",
                     str(tiny_minimax(_variant(workflow))), "--data.datasets", datasets]) == 0  # fmt: skip
        return out

    return _cached(write)


@pytest.fixture(scope="module")
def loaded(tiny_minimax, folders, tmp_path_factory):
    """``loaded(workflow)``: ``(module, records, conditions)``: the folder recipe's FlowModule (adapter with its LoRA,
    objective), its training records as ``ff fit`` reads them, and each one's condition as ``preprocess`` computes it
    (B = 1, what the condition cache stores)."""

    def load(workflow: str):
        recipe = (DPO if workflow == "dpo" else WORKFLOWS[workflow])[0]
        recipe_run = read_recipe([
            "--config", str(CONFIGS / recipe), "--model.pretrained_model_name_or_path",
            str(tiny_minimax(_variant(workflow))), "--data.datasets",
            json.dumps([{"name": workflow, "dataset_dir": str(folders(workflow))}]),
            "--trainer.default_root_dir", str(tmp_path_factory.mktemp(f"run-{workflow}"))], out=None)  # fmt: skip
        _, data, module = recipe_run
        module.configure_model()
        adapter = module.adapter
        conditions = [adapter.preprocess([condition_input(r, adapter.io_contract)])[0] for r in data.train_records]
        return module, data.train_records, conditions

    return _cached(load)


def folder_batch(adapter, records, conditions, i: int) -> dict:
    """Record ``i`` as the data module serves it from a dataset folder: its cached condition, its targets decoded and
    fitted to ``output_geometry()`` (RecordProcessor), collated by the adapter's ``condition_collation``."""
    sample = RecordProcessor(adapter.output_geometry()).process(ConditionedRecord(i, records[i], conditions[i]))
    return SampleCollator(adapter.condition_collation).collate([sample])


def shard_batch(adapter, root: Path, i: int, supervision: str = "demonstration") -> dict:
    """Row ``i`` as the data module serves it from shards (its columns only, TensorRowProcessor, TensorRowCollator)."""
    columns = adapter.tensor_columns
    dataset = TensorParquetDataset(root, columns=[*columns.required_for(supervision), "prompt"])
    rows = TensorRowProcessor(TensorRows([dataset]), columns, supervision=supervision)
    return TensorRowCollator(condition_collation=adapter.condition_collation).collate([rows.process(i)])


class without_encoders:
    """The VAEs and the text encoder gone for the block: any encode or text encoding would fail."""

    NAMES = ("vae", "audio_vae", "text_encoder")

    def __init__(self, adapter) -> None:
        self.adapter = adapter

    def __enter__(self):
        self.kept = {name: getattr(self.adapter, name) for name in self.NAMES}
        for name in self.NAMES:
            setattr(self.adapter, name, None)

    def __exit__(self, *exc) -> None:
        for name, module in self.kept.items():
            setattr(self.adapter, name, module)


@pytest.mark.parametrize("workflow", list(WORKFLOWS))
def test_shards_store_the_preprocessed_condition_and_bf16_leaves_integers_alone(workflow, loaded, shards):
    """Every condition column is the tensor ``preprocess`` returns, in its dtype (int64 tags, anchors, shapes and
    codes; the manifest's uint8 bytes); ``--dtype bfloat16`` rounds the floating columns only."""
    module, records, conditions = loaded(workflow)
    columns = module.adapter.tensor_columns
    fp32, bf16 = TensorParquetDataset(shards(workflow)), TensorParquetDataset(shards(workflow, "bfloat16"))
    assert len(fp32) == len(bf16) == len(records)
    assert set(fp32.tensor_names) == set(columns.required) and set(fp32.scalar_names) == set(SCALARS)
    for i, record in enumerate(records):
        row, low = fp32[i], bf16[i]
        assert row["prompt"] == record.prompt and row["source"] == f"{record.source}:{record.line}"
        for column, key in columns.condition.items():
            assert torch.equal(row[column], conditions[i][key]) and row[column].dtype == conditions[i][key].dtype, key
            if row[column].is_floating_point():
                assert low[column].dtype == torch.bfloat16 and torch.equal(low[column], row[column].bfloat16())
            else:  # bit for bit, whatever --dtype says
                assert low[column].dtype == row[column].dtype and torch.equal(low[column], row[column]), column
        assert row["vae_latent"].dtype == row["audio_latent"].dtype == torch.float32
        assert row["text_embedding"].shape[0] == row["text_token_tags"].shape[0]  # unpadded: the prompt's own L
        if workflow == "ref2va":  # the canonical manifest, one entry per reference
            manifest = json.loads(manifest_text(low["reference_manifest"]))
            assert [e["type"] for e in manifest] == [("image", "video", "audio")[k] for k in row["reference_kinds"]]


@pytest.mark.parametrize("workflow", list(WORKFLOWS))
def test_sft_loss_from_shards_is_the_folder_loss_without_encoders(workflow, loaded, shards):
    """Per record, under one generator: the shard batch's condition is the folder batch's (text padding masks, the
    keyframes / references the prefix is realised from), its stored latents are ``encode_output``'s, and the SFT loss
    and its timestep are bit for bit the folder's, with the VAEs and the text encoder gone."""
    module, records, conditions = loaded(workflow)
    adapter, objective = module.adapter, module.objective
    root = shards(workflow)
    for i in range(len(records)):
        folder, stored = folder_batch(adapter, records, conditions, i), shard_batch(adapter, root, i)
        assert stored["condition"].keys() == folder["condition"].keys()
        for key, value in folder["condition"].items():
            torch.testing.assert_close(stored["condition"][key], value, rtol=0, atol=0, msg=key)
        with torch.no_grad():
            condition = adapter.prepare_condition(folder["condition"])
            clean = adapter.encode_output(folder["target"], condition)
            state = adapter.stored_latents(stored["latents"], condition)
        assert list(state.components) == ["video", "audio"] and not state.masks  # encode_output sets none either
        for name, tensor in clean.components.items():
            assert torch.equal(state.components[name], tensor), name
        expected = objective.training_loss(adapter, folder, torch.Generator().manual_seed(7 + i))
        with without_encoders(adapter):
            got = objective.training_loss(adapter, stored, torch.Generator().manual_seed(7 + i))
        assert torch.equal(got.per_sample, expected.per_sample) and torch.equal(got.sigma, expected.sigma), i


def test_offline_dpo_loss_from_preference_shards_is_the_folder_loss(loaded, shards):
    """T2VA preference rows (``chosen_vae_latent``, ``rejected_audio_latent``, ...): the Diffusion-DPO loss of each
    pair equals the folder's, bit for bit, without the VAEs or the text encoder."""
    module, records, conditions = loaded("dpo")
    adapter, objective = module.adapter, module.objective
    root = shards("dpo")
    assert set(TensorParquetDataset(root).tensor_names) == set(adapter.tensor_columns.required_for("preference"))
    for i in range(len(records)):
        folder = folder_batch(adapter, records, conditions, i)
        stored = shard_batch(adapter, root, i, "preference")
        assert not torch.equal(stored["chosen_latents"]["audio"], stored["rejected_latents"]["audio"])
        expected = objective.training_loss(adapter, folder, torch.Generator().manual_seed(3 + i))
        with without_encoders(adapter):
            got = objective.training_loss(adapter, stored, torch.Generator().manual_seed(3 + i))
        assert torch.equal(got.per_sample, expected.per_sample) and torch.isfinite(got.loss), i


class EncodeProbe(L.Callback):
    """Counts forwards of both VAE encoders and the text encoder during training batches (evaluation's condition
    caching and decoding are outside them)."""

    calls = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        adapter = pl_module.adapter
        modules = [adapter.vae.encoder, adapter.audio_vae.encoder, adapter.text_encoder]
        self.handles = [m.register_forward_hook(self._count) for m in modules if m is not None]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for handle in self.handles:
            handle.remove()

    def _count(self, *_) -> None:
        self.calls += 1


def fit_from_shards(recipe: str, pretrained: Path, shards: Path, folder: Path, root: Path) -> FlowCLI:
    """``recipe`` as shipped, its checkpoint and dataset paths pointed at the tiny ones, for two steps (evaluated and
    sampled at the second), with an :class:`EncodeProbe`: no encoder runs in a training step, and the text encoder
    is released once the evaluation prompts are cached."""
    datasets = [{"name": "latents", "tensor_parquet_dir": str(shards)},
                {"name": "prompts", "dataset_dir": str(folder), "train": None, "eval": {}}]  # fmt: skip
    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(CONFIGS / recipe), "--model.pretrained_model_name_or_path", str(pretrained),
        "--data.datasets", json.dumps(datasets), "--model.sampling.num_steps", "2", "--trainer.max_steps", "2",
        "--trainer.val_check_interval", "2", "--trainer.log_every_n_steps", "1",
        "--trainer.default_root_dir", str(root)])  # fmt: skip
    probe = EncodeProbe()
    cli.trainer.callbacks.append(probe)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 2 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    assert probe.calls == 0 and cli.model.adapter.text_encoder is None
    assert cli.datamodule.train_rows is not None and len(cli.datamodule.train_rows) == len(TensorParquetDataset(shards))
    return cli


@pytest.mark.parametrize(("workflow", "dtype"), [("t2va", "float32"), ("t2va", "bfloat16"), ("fl2va", "bfloat16"),
                                                 ("ref2va", "bfloat16")])  # fmt: skip
def test_sft_latents_recipe_trains_from_shards(workflow, dtype, tiny_minimax, folders, shards, tmp_path):
    cli = fit_from_shards(WORKFLOWS[workflow][1], tiny_minimax(workflow), shards(workflow, dtype), folders(workflow),
                          tmp_path)  # fmt: skip
    version = next((tmp_path / "lightning_logs").iterdir())
    assert (version / "checkpoints" / "last.lora" / "pytorch_lora_weights.safetensors").stat().st_size > 0
    assert (version / "samples" / "step_000002" / "00000.mp4").stat().st_size > 0
    assert cli.model.adapter.name == f"minimax-h3-{workflow}"


def test_offline_dpo_latents_recipe_trains_from_preference_shards(tiny_minimax, folders, shards, tmp_path):
    cli = fit_from_shards(DPO[1], tiny_minimax("t2va"), shards("dpo"), folders("dpo"), tmp_path)
    assert cli.model.objective.trainer_type == "offline-dpo"


def test_a_row_of_another_geometry_is_refused_before_weights_load(tiny_minimax, folders, shards, tmp_path,
                                                                  monkeypatch):  # fmt: skip
    """The checkpoint's configs fix the stored shapes (both VAEs' latent channels, the transformer's patch and text
    width: ``resolve_tensor_shapes``); a row whose video latent is stored (F', C, h, w), with the right byte count, is
    named by file, column and row before any weight loads."""
    from ff_minimax import MiniMaxH3T2VAAdapter
    from ff_minimax.fl2va import MiniMaxH3FL2VAAdapter
    from ff_minimax.ref2va import MiniMaxH3Ref2VAAdapter

    shapes = MiniMaxH3T2VAAdapter.resolve_tensor_shapes(tiny_minimax("t2va"))
    assert set(shapes) == {"text_embedding", "text_token_tags", "vae_latent", "audio_latent"}
    assert (dict(shapes["vae_latent"].sizes), dict(shapes["vae_latent"].multiples)) == ({0: 4}, {1: 1, 2: 2, 3: 2})
    assert dict(shapes["audio_latent"].sizes) == {0: 2, 1: 4} and dict(shapes["text_embedding"].sizes) == {-1: 16}
    fl2va = MiniMaxH3FL2VAAdapter.resolve_tensor_shapes(tiny_minimax("fl2va"))["keyframe_latents"]
    assert (dict(fl2va.sizes), dict(fl2va.multiples)) == ({1: 4, 2: 1}, {3: 2, 4: 2})
    ref2va = MiniMaxH3Ref2VAAdapter.resolve_tensor_shapes(tiny_minimax("ref2va"))
    assert set(ref2va) == set(MiniMaxH3Ref2VAAdapter.tensor_columns.required)  # transformer_ref/'s text width
    assert dict(ref2va["text_embedding"].sizes) == {-1: 16} and MiniMaxH3T2VAAdapter.resolve_tensor_shapes(None) == {}

    source = TensorParquetDataset(shards("t2va"))
    tensors = list(source.tensor_names)
    bad = tmp_path / "bad"
    with TensorParquetWriter(bad, tensor_schema({s: pa.string() for s in SCALARS}, tensors)) as writer:
        for i in range(len(source)):
            row = source[i]
            if i == 1:
                row["vae_latent"] = row["vae_latent"].transpose(0, 1).contiguous()
            writer.write(row)

    def refuse(*args, **kwargs):
        raise AssertionError("weights loaded before the rows were checked")

    monkeypatch.setattr(MiniMaxH3T2VAAdapter, "_components", classmethod(refuse))
    with pytest.raises(DatasetErrors) as info:
        fit_from_shards(WORKFLOWS["t2va"][1], tiny_minimax("t2va"), bad, folders("t2va"), tmp_path / "run")
    assert "vae_latent_shape: row 1 (dataset row 1): shape [37, 4, 4, 4]: axis 0 must be 4" in str(info.value)
