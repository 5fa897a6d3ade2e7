"""LTX-2 from tensor-parquet shards: ``ff data preprocess-latents`` stores what a training step computes (the
connectors' prompt embeddings, the first frame's condition latent, the video and audio posterior modes), a step read
from shards has the folder step's loss on the same sample, noise and timestep while running no VAE encode and no
text encoder, for SFT and offline DPO, and the latents recipes train as shipped."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from ff_ltx2.testing import write_av_clips
from ltx2_geometry import ADAPTER_KWARGS
from torch.utils.data import default_collate

from ff_core.cli import main
from ff_core.cli.flow_cli import FlowCLI
from ff_core.cli.preprocess_latents import write_latent_shards
from ff_core.data.datamodule import FlowDataModule
from ff_core.data.media.conditions import condition_input
from ff_core.data.records.sources import DatasetConfig, load_split
from ff_core.data.samples import ConditionedRecord, RecordProcessor
from ff_core.data.tensor_parquet import TensorParquetDataset
from ff_core.data.tensor_parquet.rows import TensorRowCollator, TensorRowProcessor, TensorRows
from ff_core.lora import LoRAConfig
from ff_core.module import FlowModule
from ff_core.objectives import DPOObjective

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "configs" / "ltx2"
ROWS = 4


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return write_av_clips(tmp_path_factory.mktemp("ltx2-clips"), ROWS)


@pytest.fixture(scope="module")
def clips_i2av(tmp_path_factory):
    return write_av_clips(tmp_path_factory.mktemp("ltx2-clips-i2av"), ROWS, i2av=True)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return write_av_clips(tmp_path_factory.mktemp("ltx2-pairs"), ROWS, preference=True)


def module(name, pretrained, objective=None):
    extra = {} if objective is None else {"objective": objective}
    m = FlowModule(name, str(pretrained), adapter_kwargs={**ADAPTER_KWARGS, "max_sequence_length": 16},
                   lora=LoRAConfig(rank=2, alpha=4, target_modules=["to_q"]), **extra)  # fmt: skip
    m.configure_model()
    return m


def folder_batch(adapter, folder, trainer="sft"):
    """The batch a folder step trains on: the records' cached conditions (``preprocess``) and their targets decoded
    and fitted by the training loader's processor; and the records."""
    records = load_split(DatasetConfig(name="clips", dataset_dir=str(folder)), "train", trainer)
    conditions = adapter.preprocess([condition_input(r, adapter.io_contract) for r in records])
    processor = RecordProcessor(adapter.output_geometry())
    samples = [processor.process(ConditionedRecord(i, r, {})) for i, r in enumerate(records)]
    batch = {"condition": default_collate(conditions)}
    for key in ("target", "chosen", "rejected"):
        if key in samples[0]:
            batch[key] = [s[key] for s in samples]
    return batch, records


def shard_batch(root, adapter, supervision="demonstration"):
    dataset = TensorParquetDataset(root)
    processor = TensorRowProcessor(TensorRows([dataset]), adapter.tensor_columns, supervision=supervision)
    collator = TensorRowCollator(condition_collation=adapter.condition_collation)
    return collator.collate([processor.process(i) for i in range(len(dataset))])


class Encoders:
    """Counts forwards of the video and audio VAE encoders and the text encoder while active."""

    def __init__(self, adapter):
        self.calls = 0
        modules = [adapter.vae.encoder, adapter.audio_vae.encoder, adapter.text_encoder, adapter.connectors]
        self.handles = [m.register_forward_hook(self._count) for m in modules if m is not None]

    def _count(self, *_):
        self.calls += 1

    def remove(self):
        for handle in self.handles:
            handle.remove()


@pytest.mark.parametrize("variant", ["t2av", "i2av"])
def test_sft_step_from_shards_is_the_folder_step_without_any_encoder(tiny_ltx2, clips, clips_i2av, variant,
                                                                       tmp_path):  # fmt: skip
    m = module(f"ltx2_{variant}", tiny_ltx2(variant))
    adapter, objective = m.adapter, m.objective
    batch, records = folder_batch(adapter, clips if variant == "t2av" else clips_i2av)
    expected = objective.training_loss(adapter, batch, torch.Generator().manual_seed(7))
    root = tmp_path / "shards"
    write_latent_shards(adapter, records, root, batch_size=ROWS, progress=False)  # float32: as computed
    stored = shard_batch(root, adapter)
    assert set(stored["latents"]) == {"video", "audio"}
    encoders = Encoders(adapter)
    try:
        got = objective.training_loss(adapter, stored, torch.Generator().manual_seed(7))
    finally:
        encoders.remove()
    assert encoders.calls == 0, "a step from shards ran a VAE encoder or the text encoder"
    assert torch.equal(got.sigma, expected.sigma)
    assert torch.equal(got.per_sample, expected.per_sample), (got.per_sample, expected.per_sample)
    # bf16 storage (the command's default) moves the loss by the rounding of latents and embeddings only.
    bf16 = tmp_path / "bf16"
    write_latent_shards(adapter, records, bf16, batch_size=ROWS, dtype=torch.bfloat16, progress=False)
    rounded = objective.training_loss(adapter, shard_batch(bf16, adapter), torch.Generator().manual_seed(7))
    torch.testing.assert_close(rounded.per_sample, expected.per_sample, rtol=2e-2, atol=0)


def test_i2av_shards_pin_the_stored_condition_latent(tiny_ltx2, clips_i2av, tmp_path):
    """The stored ``first_frame_latent`` is ``preprocess``'s, and the stored target's first latent frame is replaced
    by it with mask 0 (what ``encode_output`` does), so the pinned tokens are never noised from shards either."""
    adapter = module("ltx2_i2av", tiny_ltx2("i2av")).adapter
    batch, records = folder_batch(adapter, clips_i2av)
    write_latent_shards(adapter, records, tmp_path / "s", batch_size=ROWS, progress=False)
    stored = shard_batch(tmp_path / "s", adapter)
    assert torch.equal(stored["condition"]["first_frame_latent"], batch["condition"]["first_frame_latent"])
    condition = adapter.prepare_condition(stored["condition"])
    latents = dict(stored["latents"])
    latents["video"] = latents["video"].clone()
    latents["video"][:, :, 0] = 0  # whatever a row stores there (another writer's target frame), it is replaced
    state = adapter.stored_latents(latents, condition)
    video = state.components["video"]
    assert torch.equal(video[:, :, :1], condition["first_frame_latent"])
    assert torch.equal(video[:, :, 1:], stored["latents"]["video"][:, :, 1:])
    assert state.masks["video"][0, 0, :, 0, 0].tolist() == [0.0] + [1.0] * (video.shape[2] - 1)


def test_offline_dpo_step_from_preference_shards_is_the_folder_step(tiny_ltx2, pairs, tmp_path):
    m = module("ltx2_t2av", tiny_ltx2("t2av"), DPOObjective(beta=5000.0))
    adapter, objective = m.adapter, m.objective
    batch, records = folder_batch(adapter, pairs, "offline-dpo")
    expected = objective.training_loss(adapter, batch, torch.Generator().manual_seed(3))
    write_latent_shards(adapter, records, tmp_path / "pairs", batch_size=ROWS, progress=False)
    stored = shard_batch(tmp_path / "pairs", adapter, "preference")
    assert {"chosen_latents", "rejected_latents"} <= set(stored)
    names = set(TensorParquetDataset(tmp_path / "pairs").tensor_names)
    assert {"chosen_vae_latent", "rejected_vae_latent", "chosen_audio_latent", "rejected_audio_latent"} <= names
    encoders = Encoders(adapter)
    try:
        got = objective.training_loss(adapter, stored, torch.Generator().manual_seed(3))
    finally:
        encoders.remove()
    assert encoders.calls == 0
    assert torch.equal(got.loss, expected.loss) and torch.equal(got.per_sample, expected.per_sample)


class TrainingEncoders(L.Callback):
    """Counts VAE-encoder and text-encoder forwards from the first training batch on."""

    def on_train_start(self, trainer, pl_module):
        self.encoders = Encoders(pl_module.adapter)

    def on_train_end(self, trainer, pl_module):
        self.calls = self.encoders.calls
        self.encoders.remove()


@pytest.mark.parametrize(("recipe", "source", "variant"), [
    ("sft_latents_tiny.yaml", "sft_tiny.yaml", "t2av"),
    ("offline_dpo_latents_tiny.yaml", "offline_dpo_tiny.yaml", "t2av"),
    ("i2av_sft_latents_tiny.yaml", "i2av_sft_tiny.yaml", "i2av"),
])  # fmt: skip
def test_latents_recipes_train_as_shipped(tiny_ltx2, clips, clips_i2av, pairs, recipe, source, variant, tmp_path):
    """The recipe's own commands: ``ff data preprocess-latents`` with the folder recipe (bf16, the default), then
    ``ff fit`` with the latents recipe (its shard entry and evaluation folder pointed at them): 2 steps, no encoder
    in training, the text encoder released."""
    folder = {"sft_tiny.yaml": clips, "offline_dpo_tiny.yaml": pairs, "i2av_sft_tiny.yaml": clips_i2av}[source]
    shards = tmp_path / "shards"
    assert main(["data", "preprocess-latents", "--output", str(shards), "--no-progress", "--config",
                 str(CONFIGS / source), "--model.pretrained_model_name_or_path", str(tiny_ltx2(variant)),
                 "--data.datasets", json.dumps([{"name": "clips", "dataset_dir": str(folder)}])]) == 0  # fmt: skip
    first = TensorParquetDataset(shards)[0]
    assert first["vae_latent" if "dpo" not in recipe else "chosen_vae_latent"].dtype == torch.bfloat16
    assert first["prompt_attention_mask"].dtype == torch.int64  # integers are never cast
    datasets = [{"name": "latents", "tensor_parquet_dir": str(shards)},
                {"name": "prompts", "dataset_dir": str(folder), "train": None, "eval": {}}]
    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(CONFIGS / recipe), "--model.pretrained_model_name_or_path", str(tiny_ltx2(variant)),
        "--data.datasets", json.dumps(datasets), "--model.sampling.num_steps", "2", "--trainer.max_steps", "2",
        "--trainer.val_check_interval", "2", "--data.per_device_batch_size", "2",
        "--trainer.default_root_dir", str(tmp_path / "run")])  # fmt: skip
    probe = TrainingEncoders()
    cli.trainer.callbacks.append(probe)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 2 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    assert probe.calls == 0 and cli.model.adapter.text_encoder is None


def test_shards_of_another_clip_or_checkpoint_are_refused_before_weights_load(tiny_ltx2, clips, tmp_path):
    """Shards of 9-frame clips have latents a 17-frame recipe could not tell apart by shape alone (another frame count,
    the same channels); the i2av checkpoint's VAE differs from t2av's. Both are refused at set-up, naming the field."""
    from ff_core.errors import ConfigError

    shards = tmp_path / "shards"
    assert main(["data", "preprocess-latents", "--output", str(shards), "--no-progress", "--config",
                 str(CONFIGS / "sft_tiny.yaml"), "--model.pretrained_model_name_or_path", str(tiny_ltx2("t2av")),
                 "--data.datasets", json.dumps([{"name": "clips", "dataset_dir": str(clips)}])]) == 0  # fmt: skip

    def setup(pretrained, **kwargs):
        dm = FlowDataModule([{"name": "latents", "tensor_parquet_dir": str(shards)}], adapter="ltx2_t2av",
                            pretrained_model_name_or_path=str(pretrained),
                            adapter_kwargs={**ADAPTER_KWARGS, "max_sequence_length": 16, **kwargs})  # fmt: skip
        dm.setup("fit")
        return dm

    assert len(setup(tiny_ltx2("t2av")).train_rows) == ROWS
    with pytest.raises(ConfigError, match=r"data\.datasets\[0\]\.tensor_parquet_dir: .*output 0 num_frames: the "
                                          r"shards were written for 9, this run has 17"):  # fmt: skip
        setup(tiny_ltx2("t2av"), num_frames=17)
    with pytest.raises(ConfigError, match=r"checkpoint: the shards were computed by another vae"):
        setup(tiny_ltx2("i2av"))


def test_fit_from_audio_video_shards_resumes_exactly(tiny_ltx2, clips, tmp_path):
    """Killed after step 2 (mid-epoch: 4 rows in batches of 1, 2 micro-batches a step) and resumed from its
    checkpoint: the same rows, noise and losses as the uninterrupted run, micro-batch for micro-batch."""
    from ff_core.callbacks import SampleLog, read_sample_log

    m = module("ltx2_t2av", tiny_ltx2("t2av"))
    shards = tmp_path / "shards"
    _, records = folder_batch(m.adapter, clips)
    write_latent_shards(m.adapter, records, shards, batch_size=ROWS, dtype=torch.bfloat16, progress=False)

    def fit(root, ckpt_path=None):
        dm = FlowDataModule([{"name": "latents", "tensor_parquet_dir": str(shards)}], adapter="ltx2_t2av",
                            per_device_batch_size=1)  # fmt: skip
        ckpt = L.pytorch.callbacks.ModelCheckpoint(root / "ckpt", every_n_train_steps=2, save_top_k=-1)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, accumulate_grad_batches=2, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            callbacks=[SampleLog(str(root / "ids"), outputs=("sigma", "noise_seed", "loss")), ckpt])
        trainer.fit(module("ltx2_t2av", tiny_ltx2("t2av")), datamodule=dm, ckpt_path=ckpt_path)
        return read_sample_log(root / "ids" / "rank0.jsonl")

    full = fit(tmp_path / "full")
    assert sorted(i for r in full[:4] for i in r["ids"]) == list(range(ROWS))  # one epoch: every row once
    (step2,) = (tmp_path / "full" / "ckpt").glob("*step=2.ckpt")
    assert fit(tmp_path / "resumed", ckpt_path=step2) == full[4:]
