"""Non-finite losses and gradients: found before the optimiser step, so no poisoned weight is ever stepped or saved.

One NaN latent in one shard row makes the loss NaN, its gradient NaN, and every weight NaN after the next optimiser
step; every checkpoint from then on holds NaN weights, and the run ends with exit status 0. :class:`NonFiniteGuard`
looks at each optimiser step's losses and gradients before the step (docs/scaling.md, "Non-finite losses and
gradients"):

* each micro-batch's loss is folded into a flag on the loss's device (no host synchronisation per micro-batch);
* after the backward and before the optimiser step (Lightning's ``on_before_optimizer_step`` under automatic
  optimisation; GRPO's ``update`` before ``optimizer.step``) the gradients' largest magnitudes are taken in one fused
  ``torch._foreach_norm(grads, inf)`` (never overflows: a finite gradient has a finite largest magnitude), and each
  rank's flag is summed over the ranks in one all-reduce, so every rank decides alike and none waits on a
  collective the others left;
* ``stop`` (default): every rank raises :class:`~ff_core.errors.NonFiniteError`, one line naming the step, the
  rank(s) and the samples of the step (files and rows). The weights are still those of the last finite step:
  a checkpoint written on the exception (``ModelCheckpoint(save_on_exception=True)``, whose ``on_exception`` saves)
  holds step N-1's finite weights, with the loader position after the bad batch;
* ``skip``: the step's gradients are dropped (``None``: the optimiser leaves every parameter and its moments alone,
  as PyTorch's ``GradScaler`` skips an overflowing step), the step is counted (``train/nonfinite_skipped``) and
  listed in the run folder (``nonfinite_skipped.jsonl``), never silently. Refused under DeepSpeed
  (:func:`check_strategy`), whose engine keeps the gradients; there ``stop`` catches non-finite losses only.

Under a ``GradScaler`` (``trainer.precision: 16-mixed``) an infinite gradient is the scaler's overflow signal, which
it handles by skipping the step and lowering its scale, so only the losses are checked there.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch

from ff_core.errors import ConfigError, NonFiniteError

log = logging.getLogger(__name__)

NonFinitePolicy = Literal["stop", "skip"]


def check_strategy(policy: str, strategy: Any) -> None:
    """Refuse ``model.nonfinite: skip`` under DeepSpeed, where it could not drop the step.

    DeepSpeed keeps the gradients in its engine (``p.grad`` is ``None`` on the module's parameters), so ``skip``
    would neither see a non-finite gradient nor drop one: the NaN step would be applied. Under DeepSpeed ``stop``
    still catches a non-finite loss (docs/scaling.md, "Non-finite losses and gradients").

    Args:
        policy: ``model.nonfinite``.
        strategy: the trainer's strategy.
    """
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if policy == "skip" and isinstance(strategy, DeepSpeedStrategy):
        raise ConfigError("model.nonfinite", "skip is not supported under DeepSpeedStrategy (DeepSpeed keeps the "
                          "gradients in its engine, so the step cannot be dropped); use stop (it catches non-finite "
                          "losses under DeepSpeed) or another strategy")  # fmt: skip
SKIPPED_FILE = "nonfinite_skipped.jsonl"
"""The run folder's list of skipped steps, one JSON object a line: ``{"step", "what", "ranks", "samples"}``."""
LOSS, GRADIENT = 1, 2  # the flag bits: what was non-finite on a rank
SHOWN = 8  # samples named per rank in the one-line error (the skip list names them all)


def gradients_finite(parameters: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """Whether every gradient of ``parameters`` is finite, as a 0-dim bool tensor (no host synchronisation on an
    accelerator); ``None`` without any gradient. The gradients' largest magnitudes (``inf``-norms, fused per device
    and dtype): NaN or inf exactly when an element is, and finite for any finite gradient (a 2-norm overflows on huge
    finite values). On the CPU, where torch's inf-norm kernel is ~10x slower than its 2-norm and reading a result
    costs no synchronisation, the 2-norms decide first (finite 2-norm: every element finite) and the inf-norms run
    only when one is not (same answer, measured in benchmarks/RESULTS.md, "Per-step overhead"). FSDP2's gradients
    are checked on the rank's shard (``DTensor.to_local``).

    Args:
        parameters: the trained parameters.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        g = g.to_local() if hasattr(g, "to_local") else g
        if g.numel():
            groups.setdefault((g.device, g.dtype), []).append(g)
    if not groups:
        return None
    flags = []
    for (device, _), grads in groups.items():
        if device.type == "cpu" and bool(torch.stack(torch._foreach_norm(grads, 2.0)).isfinite().all()):
            flags.append(torch.tensor(True))
            continue
        flags.append(torch.stack(torch._foreach_norm(grads, float("inf"))).isfinite().all())
    first = flags[0]
    return torch.stack([f.to(first.device) for f in flags]).all() if len(flags) > 1 else first


class NonFiniteGuard:
    """Checks one optimiser step's losses and gradients (module docstring); ``FlowModule`` owns one.

    Args:
        policy: ``stop`` (raise :class:`~ff_core.errors.NonFiniteError`) or ``skip`` (drop the step's gradients,
            count and list it).

    Attributes:
        skipped: steps skipped so far (kept in checkpoints, so a resumed run keeps counting).
    """

    def __init__(self, policy: NonFinitePolicy = "stop") -> None:
        if policy not in ("stop", "skip"):
            raise ValueError(f"model.nonfinite must be 'stop' or 'skip', got {policy!r}")
        self.policy = policy
        self.skipped = 0
        self._ids: list[int] = []
        self._loss_bad: torch.Tensor | None = None
        self._stepped = True

    def observe_batch(self, ids: Any) -> None:
        """A micro-batch of this step starts: its sample indices (``batch["index"]``). The first after a step replaces
        the previous step's; the micro-batches of an accumulation window add up."""
        if self._stepped:
            self._ids, self._stepped = [], False
        self._ids += [int(i) for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Fold a loss (any shape) into the step's flag, on the loss's device (no synchronisation)."""
        bad = ~torch.isfinite(loss.detach()).all()
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad.to(self._loss_bad.device)

    def check(self, module: Any, optimizer: Any) -> bool:
        """Before the optimiser step, on every rank: ``False`` when the step may go on; ``True`` when it was skipped
        (``skip``: the gradients dropped, so the optimiser changes nothing); raises :class:`NonFiniteError`
        (``stop``). One all-reduce of a flag per rank.

        Args:
            module: the LightningModule (its trainer gives the rank, the step, the strategy, the run folder).
            optimizer: the optimiser about to step (its gradients are dropped on ``skip``).
        """
        trainer = module.trainer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        finite = None if scaler is not None else gradients_finite(params)  # the scaler's own overflow check
        device, world, rank = module.device, trainer.world_size, trainer.global_rank
        flags = torch.zeros(world, dtype=torch.int64, device=device)
        if self._loss_bad is not None:
            flags[rank] += self._loss_bad.to(device).long() * LOSS
        if finite is not None:
            flags[rank] += (~finite).to(device).long() * GRADIENT
        self._loss_bad, self._stepped = None, True
        if world > 1:
            flags = trainer.strategy.reduce(flags, reduce_op="sum")
        flags = flags.tolist()  # the one host synchronisation of the step
        if not any(flags):
            return False
        step = trainer.global_step + 1  # 1-based: the step that would have been taken
        samples = self._gather(module, world)
        # The ranks whose loss was non-finite, if any: DDP averages gradients before this check, so one rank's NaN
        # gradient shows on every rank; only a loss says where it came from.
        ranks = [r for r, f in enumerate(flags) if f & LOSS] or [r for r, f in enumerate(flags) if f]
        report = {"step": step, "what": _what(flags), "ranks": ranks, "samples": {str(r): samples[r] for r in ranks}}
        if self.policy == "stop":
            raise NonFiniteError(_message(report, world))
        for p in params:
            p.grad = None
        self.skipped += 1
        self._record(trainer, report)
        return True

    def _gather(self, module: Any, world: int) -> list[list[str]]:
        """Every rank's samples of the step, named (files and rows where the data module can say)."""
        names = sample_names(module, self._ids)
        if world == 1:
            return [names]
        import torch.distributed as dist

        out: list[Any] = [None] * world
        dist.all_gather_object(out, names)
        return out

    def _record(self, trainer: Any, report: dict[str, Any]) -> None:
        folder = trainer.log_dir or trainer.default_root_dir  # every rank: log_dir broadcasts
        log.warning("model.nonfinite: skip: %s", _message(report, trainer.world_size, skipped=True))
        if not trainer.is_global_zero or folder is None:
            return
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, SKIPPED_FILE), "a", encoding="utf-8") as f:
            f.write(json.dumps(report) + "\n")
            f.flush()
            os.fsync(f.fileno())


def sample_names(module: Any, ids: Sequence[int]) -> list[str]:
    """The data module's names of samples ``ids`` (``FlowDataModule.sample_names``: file and row), else the indices."""
    datamodule = getattr(module.trainer, "datamodule", None)
    namer = getattr(datamodule, "sample_names", None)
    if namer is not None:
        try:
            return list(namer(ids))
        except Exception:  # a name is a courtesy: never hide the non-finite value behind a naming failure
            log.debug("sample_names failed", exc_info=True)
    return [f"sample {i}" for i in ids]


def _what(flags: Sequence[int]) -> str:
    bits = 0
    for f in flags:
        bits |= f
    return "loss" if bits & LOSS else "gradient"


def _message(report: dict[str, Any], world: int, skipped: bool = False) -> str:
    ranks = report["ranks"]
    where = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {world}"
    parts = []
    for rank in ranks:
        names = report["samples"][str(rank)]
        shown = ", ".join(names[:SHOWN]) + (f", ... ({len(names)} in all)" if len(names) > SHOWN else "")
        parts.append(f"rank {rank}: [{shown}]")
    head = f"non-finite {report['what']} at step {report['step']} on {where}; samples of the step: {'; '.join(parts)}"
    if skipped:
        return f"{head}; step skipped (listed in {SKIPPED_FILE})"
    return (f"{head}. Stopped before the optimiser step: the weights and checkpoints are those of step "
            f"{report['step'] - 1}. Check those samples (ff data validate --check-media), or set model.nonfinite: "
            "skip to skip such steps")
