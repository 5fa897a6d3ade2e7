"""Preemption: SIGTERM (what SLURM, Kubernetes and cloud schedulers send before they kill a job) saves a resumable
checkpoint at the next optimiser-step boundary, on every rank at the same step, then stops the run (exit 143).

Built on Lightning's ``_SignalConnector`` (it registers the SIGTERM handler when ``fit`` starts, keeps SLURM's
requeue handlers, and restores the previous handlers at the end), with its SIGTERM notifier replaced: Lightning's
(2.6) broadcasts a tensor from inside the signal handler and kills the launcher's children, so a signal that reaches
both ranks (SLURM signals every task) issues collectives that pair with whatever collective the other rank is in, and
its loop raises ``SIGTERMException`` without writing a checkpoint. ff's notifier only sets a flag. The training
loader's workers ignore SIGTERM (``ff_core.data.dataflow.loader``): a SIGTERM sent to every process of the job would
otherwise kill them (torch's worker handler) and fail the next fetch before the checkpoint.

At the end of each training batch that stepped the optimiser (``FlowModule.on_train_batch_end``, after every
callback, the checkpoint callbacks included, has seen the batch), the ranks agree on the flag with one all-reduce
(max: a signal to any rank stops all of them); when set, every rank takes part in saving through the run's checkpoint
callbacks, exactly as their ``every_n_train_steps`` trigger would at that step (``last.ckpt`` with ``save_last``, the
step's ``epoch=E-step=S.ckpt`` otherwise, and its ``.lora`` export): the mid-epoch kind, holding the data loader's
position after this batch, so ``--ckpt_path`` continues exactly. Then every rank raises :class:`Preempted`, which
``ff fit`` prints as one line naming the checkpoint and exits with 143 (128 + SIGTERM, the status of a process ended
by SIGTERM, so a scheduler sees the job did not finish).
"""

from __future__ import annotations

import signal
from types import FrameType

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

EXIT_PREEMPTED = 128 + signal.SIGTERM
"""143: the status a shell reports for a process ended by SIGTERM."""


class Preempted(SIGTERMException):
    """Raised on every rank once the preemption checkpoint is written; a ``SystemExit`` with status 143.

    Args:
        step: the optimiser step the checkpoint holds.
        rank: the global rank raising it.
        checkpoint: the checkpoint written (``None`` when the run has no checkpoint callback).
    """

    def __init__(self, step: int, rank: int, checkpoint: str | None) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.step, self.rank, self.checkpoint = step, rank, checkpoint

    @property
    def message(self) -> str:
        if self.checkpoint is None:
            return (f"stopped by SIGTERM after step {self.step}; no checkpoint saved (the run has no checkpoint "
                    "callback: trainer.enable_checkpointing is off)")
        return (f"stopped by SIGTERM after step {self.step}; saved {self.checkpoint}: resume with --ckpt_path "
                f"{self.checkpoint}")


class PreemptionGuard:
    """One fit's preemption state: the flag the SIGTERM handler sets and the last optimiser step checked."""

    def __init__(self) -> None:
        self.requested = False
        self.step_checked: int | None = None

    def install(self, trainer: L.Trainer) -> None:
        """Call before Lightning registers its signal handlers (``on_fit_start``): Lightning's SIGTERM notifier of
        this trainer becomes :meth:`notify`; the rest of its handling (SLURM requeue, restoring handlers) stays."""
        self.requested = False
        self.step_checked = None
        trainer._signal_connector._sigterm_notifier_fn = self.notify

    def notify(self, signum: int, frame: FrameType | None) -> None:
        """The SIGTERM handler: set the flag, nothing else (no collective, no I/O inside a signal handler)."""
        self.requested = True

    def start(self, trainer: L.Trainer) -> None:
        """``on_train_start`` (after a resume restored the step): the step the next boundary is counted from."""
        self.step_checked = trainer.global_step

    def check(self, trainer: L.Trainer) -> None:
        """At the end of a training batch: on an optimiser-step boundary, agree across ranks whether SIGTERM came;
        if so, save through the checkpoint callbacks and raise :class:`Preempted` on every rank."""
        step = trainer.global_step
        if step == self.step_checked:  # inside an accumulation window: the checkpoint would split it
            return
        self.step_checked = step
        flag = torch.tensor([1 if self.requested else 0], device=trainer.strategy.root_device)
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item() or (trainer.max_steps != -1 and step >= trainer.max_steps):
            return  # not signalled, or the run ends at this step anyway (its own end-of-training saves apply)
        raise Preempted(step, trainer.global_rank, save_now(trainer))


def save_now(trainer: L.Trainer) -> str | None:
    """Save through every checkpoint callback as its ``every_n_train_steps`` trigger would at this step (all ranks
    call this); returns the path written (``last.ckpt`` where one is kept), or ``None`` without a callback."""
    written = None
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        if callback._last_global_step_saved != trainer.global_step:
            candidates = callback._monitor_candidates(trainer)
            callback._save_topk_checkpoint(trainer, candidates)
            callback._save_last_checkpoint(trainer, candidates)
            if callback._last_global_step_saved != trainer.global_step:  # top-k kept none (save_top_k 0, monitor)
                callback._save_checkpoint(trainer, callback.format_checkpoint_name(candidates))
        written = written or callback._last_checkpoint_saved
    return written
