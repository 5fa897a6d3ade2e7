"""Lightning saves a stateful train loader in its checkpoints (fit_loop "combined_loader"): a run resumed from a
mid-epoch step checkpoint continues the uninterrupted sample sequence (single process; DDP is phase 2)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from dataflow_helpers import records
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from ff_core.data.dataflow import DataflowLoader, IdentityProcessor, MapDistributor


class Recorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        self.seen += batch["id"].tolist()
        return self.layer(batch["id"].float()[:, None]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class Commit(Callback):
    def __init__(self, loader: DataflowLoader) -> None:
        self.loader = loader

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.loader.commit(batch["seq"])


@pytest.mark.parametrize("stamp_key", [None, "seq"])
def test_resume_from_step_checkpoint_continues_the_sequence(tmp_path, stamp_key):
    def loader():
        return DataflowLoader(MapDistributor(records(20), seed=3), IdentityProcessor(), batch_size=3,
                              stamp_key=stamp_key)

    def callbacks(dl):
        return [Commit(dl)] if stamp_key else []

    kw = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, max_steps=12)
    first, dl = Recorder(), loader()
    ckpt = ModelCheckpoint(tmp_path, every_n_train_steps=5, save_top_k=-1)
    L.Trainer(callbacks=[ckpt, *callbacks(dl)], **kw).fit(first, train_dataloaders=dl)
    (path,) = [p for p in tmp_path.iterdir() if "step=5" in p.name]
    resumed, dl2 = Recorder(), loader()
    L.Trainer(callbacks=callbacks(dl2), enable_checkpointing=False, **kw).fit(resumed, train_dataloaders=dl2,
                                                                              ckpt_path=path)
    assert first.seen[:15] + resumed.seen == first.seen
