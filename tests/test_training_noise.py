"""Training noise: one CPU generator per (noise seed, data-parallel rank, optimiser step, micro-batch), so ranks draw
different noise, micro-batches of an accumulation window too, and a resumed run redraws the uninterrupted run's
noise. The 2-process DDP check (ranks differ, resume is exact) is tests/test_ddp_resume.py."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from ff_core.callbacks import SampleLog, read_sample_log
from ff_core.data.dataflow import derive_seed
from ff_core.data.datamodule import FlowDataModule
from ff_core.data.records.sources import DatasetConfig
from ff_core.lora import LoRAConfig
from ff_core.module import NOISE_SEED_KEY, FlowModule, micro_batch_seed


def test_micro_batch_seed_differs_by_rank_step_and_micro_batch_and_is_stable():
    seeds = {micro_batch_seed(0, rank, step, micro) for rank in range(4) for step in range(50) for micro in range(4)}
    assert len(seeds) == 4 * 50 * 4
    assert micro_batch_seed(0, 1, 2, 3) != micro_batch_seed(1, 1, 2, 3)  # the run's seed matters
    assert micro_batch_seed(7, 1, 2, 3) == micro_batch_seed(7, 1, 2, 3) == derive_seed(7, 1, 2, 3)
    # Pinned value: checkpoints from older runs resume onto the same noise only if this never changes.
    assert micro_batch_seed(0, 0, 0, 0) == 7177887840772116161
    assert all(0 <= s < 2**63 for s in seeds)  # valid torch.Generator seeds


def fit(tiny_sd3, shapes_dir, root, max_steps, ckpt_path=None, **module_kw):
    """24 records, 4 per micro-batch, 2 micro-batches per optimiser step: 3 steps an epoch."""
    dm = FlowDataModule([DatasetConfig(name="shapes", dataset_dir=str(shapes_dir))], adapter="sd3-5",
                        per_device_batch_size=4)  # fmt: skip
    module = FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32},
                        lora=LoRAConfig(rank=2, target_modules=["to_q"]), **module_kw)  # fmt: skip
    ckpt = L.pytorch.callbacks.ModelCheckpoint(root / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, accumulate_grad_batches=2, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[SampleLog(str(root / "ids")), ckpt])  # fmt: skip
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return read_sample_log(root / "ids" / "rank0.jsonl")


def test_noise_is_unique_per_micro_batch_and_resumes_exactly(tiny_sd3, shapes_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "5")  # what seed_everything(5) exports
    full = fit(tiny_sd3, shapes_dir, tmp_path / "full", 4)
    # Rows are logged after each micro-batch: ``step`` counts the optimiser steps taken by then.
    steps_before = [0, 0, 1, 1, 2, 2, 3, 3]
    assert [r["step"] for r in full] == [0, 1, 1, 2, 2, 3, 3, 4]
    assert [r["noise_seed"] for r in full] == [micro_batch_seed(5, 0, s, i % 2) for i, s in enumerate(steps_before)]
    assert len({r["noise_seed"] for r in full}) == 8
    # The sigmas logged are the ones the seeded generator draws first (logit-normal, the tiny scheduler's shift 1).
    for row in full:
        expected = torch.sigmoid(torch.randn(4, generator=torch.Generator().manual_seed(row["noise_seed"])))
        torch.testing.assert_close(torch.tensor(row["sigma"]), expected[None])

    (step2,) = (tmp_path / "full" / "ckpt").glob("*step=2.ckpt")
    assert torch.load(step2, weights_only=False)[NOISE_SEED_KEY] == 5
    monkeypatch.setenv("PL_GLOBAL_SEED", "6")  # a resumed run keeps the checkpoint's noise seed
    resumed = fit(tiny_sd3, shapes_dir, tmp_path / "resumed", 4, ckpt_path=step2)
    assert resumed == full[4:]  # ids, sigmas and seeds, micro-batch for micro-batch

    with pytest.raises(ValueError, match=r"model\.noise_seed=7, but the checkpoint .* noise seed 5"):
        fit(tiny_sd3, shapes_dir, tmp_path / "conflict", 4, ckpt_path=step2, noise_seed=7)
