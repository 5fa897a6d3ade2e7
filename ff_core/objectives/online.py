"""What the online objectives (Flow-GRPO, DiffusionNFT) share: prompt groups dealt over the data-parallel ranks, the
rewards of each iteration's samples gathered into group-relative advantages, and manual optimiser steps whose
gradients are averaged over the ranks once per step.

One Lightning training step is one iteration on the rank's share of the step's prompt groups (``P`` prompts x ``K``
samples over ``W`` ranks, :class:`~ff_core.data.dataflow.GroupedDistributor`): :meth:`OnlineObjective.rollout` samples
(no_grad), :meth:`OnlineObjective.score` decodes, scores and sets the advantages (``reward_aggregation``: flow_grpo's
weighted sum or Flow-Factory's GDPO, :mod:`ff_core.objectives.advantages`), :meth:`OnlineObjective.update` runs
``num_inner_epochs * mini_batches`` optimiser steps, each finished by :meth:`OnlineObjective.optimizer_step`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from ff_core.errors import ConfigError
from ff_core.groups import check_grouping
from ff_core.objectives.advantages import gdpo_advantages, group_advantages, tied_groups, zero_std_ratio
from ff_core.objectives.base import LossOutput, Objective
from ff_core.objectives.flow_matching import check_component_weights, resolve_component_weights
from ff_core.objectives.reference import ReferenceModel
from ff_core.objectives.rewards import Rewards
from ff_core.rewards.base import RewardBatch

if TYPE_CHECKING:
    import lightning as L

    from ff_core.adapter import Adapter

REWARD_AGGREGATIONS = ("gdpo", "sum")


class OnlineObjective(Objective):
    """The shared part of an online objective (module docstring). Subclasses call :meth:`setup_online` from their
    ``__init__`` and implement :meth:`rollout` (returning objects with ``rows``, ``trajectory.final`` and the
    ``advantages`` / ``keep`` / ``kept_anywhere`` fields :meth:`score` fills) and :meth:`update`."""

    method: ClassVar[str] = "online"  # how errors name it: "GRPO", "DiffusionNFT"
    automatic_optimization = False
    curve_metric = "reward_mean"  # it logs no single "loss": LossCurve draws the batch's mean reward
    # Under DDP the objective all-reduces its accumulated gradients itself (the wrapper's per-backward sync off);
    # under FSDP2 and DeepSpeed each backward's reduction does, every rank running every backward (_gradient_sync).
    sharding_strategies = frozenset({"fsdp2", "deepspeed"})

    def setup_online(
        self,
        rewards: list[dict[str, Any]],
        group_size: int,
        prompts_per_step: int,
        num_steps: int,
        micro_batch_size: int | None,
        num_inner_epochs: int,
        mini_batches: int,
        adv_clip_max: float,
        global_std: bool,
        kl_beta: float,
        max_grad_norm: float | None,
        reference_offload: bool,
        component_weights: dict[str, float] | None,
        filter_zero_std: bool,
        reward_aggregation: str,
        shift: float | None,
    ) -> None:
        """Check and keep the settings every online objective has (the subclass's ``Args``)."""
        for key, value in (("group_size", group_size), ("prompts_per_step", prompts_per_step),
                           ("num_steps", num_steps), ("num_inner_epochs", num_inner_epochs),
                           ("mini_batches", mini_batches), ("micro_batch_size", micro_batch_size or 1)):
            if value < 1:
                raise ValueError(f"model.objective.{key} must be >= 1, got {value}")
        if not adv_clip_max > 0:
            raise ValueError(f"model.objective.adv_clip_max must be > 0, got {adv_clip_max}")
        if kl_beta < 0:
            raise ValueError(f"model.objective.kl_beta must be >= 0, got {kl_beta}")
        if reward_aggregation not in REWARD_AGGREGATIONS:
            raise ValueError(f"model.objective.reward_aggregation must be one of {list(REWARD_AGGREGATIONS)}, got "
                             f"{reward_aggregation!r}")  # fmt: skip
        if group_size < 2:  # one sample per group: every advantage is 0 and the policy never moves
            raise ValueError(f"model.objective.group_size must be >= 2 (advantages compare a prompt's samples), "
                             f"got {group_size}")  # fmt: skip
        if not rewards:
            raise ValueError(f"model.objective.rewards: {self.method} needs at least one reward")
        self.rewards = Rewards(rewards, config_key="model.objective.rewards")
        self.group_size, self.prompts_per_step = group_size, prompts_per_step
        self.num_steps, self.shift = num_steps, shift
        self.micro_batch_size = micro_batch_size
        self.num_inner_epochs, self.mini_batches = num_inner_epochs, mini_batches
        self.adv_clip_max, self.global_std, self.reward_aggregation = adv_clip_max, global_std, reward_aggregation
        self.kl_beta, self.max_grad_norm = kl_beta, max_grad_norm
        self.filter_zero_std = filter_zero_std
        self.reference_offload = reference_offload
        self.component_weights = check_component_weights(component_weights)
        self.reference: ReferenceModel | None = None
        self._rewards_device: torch.device | None = None
        self._sync: Literal["none", "manual", "strategy"] = "none"  # set per step: _gradient_sync

    @property
    def grouping(self) -> tuple[int, int]:
        """``(prompts_per_step, group_size)``: what the data module needs to deal prompt groups (linked)."""
        return self.prompts_per_step, self.group_size

    def check_run(self, dp_world_size: int) -> None:
        """``mini_batches`` must not exceed the rollout micro-batches of a rank (``P * K / W`` samples in runs of
        ``micro_batch_size``): each optimiser step trains on at least one micro-batch, and ``global_step`` counts
        ``num_inner_epochs * mini_batches`` per iteration."""
        per_rank = check_grouping(self.prompts_per_step, self.group_size, dp_world_size)
        micro_batches = math.ceil(per_rank / (self.micro_batch_size or per_rank))
        if self.mini_batches > micro_batches:
            raise ConfigError(
                "model.objective.mini_batches",
                f"{self.mini_batches} optimiser steps per pass, but each rank trains on only {micro_batches} "
                f"micro-batch(es) ({per_rank} samples per rank in runs of model.objective.micro_batch_size="
                f"{self.micro_batch_size}); lower it or set a smaller micro_batch_size",
            )

    def configure_model(self, adapter: Adapter, lora: bool) -> nn.Module | None:
        if self.kl_beta > 0:
            self.reference = ReferenceModel(adapter, lora=lora, offload=self.reference_offload)
        return self.reference

    def training_rewards(self) -> Rewards:
        """The rewards maximised: ``FlowModule.setup`` refuses training rows lacking a metadata field they read."""
        return self.rewards

    def default_eval_rewards(self) -> Rewards:
        """Validation scores the training rewards (the same instances: a reward model loads once) unless the recipe
        sets ``model.eval_rewards``."""
        return self.rewards

    def reduction(self, adapter: Adapter) -> dict[str, Any]:
        """How per-element terms reduce over the latent components: ``component_weights`` (or the adapter's default)
        and ``frozen_components``, for :func:`~ff_core.sampling.component_mean`."""
        return {"component_weights": resolve_component_weights(adapter, self.component_weights),
                "frozen_components": self.frozen_components}

    def training_loss(self, adapter, batch, generator=None) -> LossOutput:
        raise RuntimeError(f"{type(self).__name__} optimises manually: FlowModule.training_step calls its "
                           "training_step")  # fmt: skip

    # -- one iteration ---------------------------------------------------------------------------------------------
    def training_step(self, module: L.LightningModule, batch: dict[str, Any], generator: torch.Generator) -> None:
        """Rollout, rewards, advantages and ``num_inner_epochs * mini_batches`` optimiser steps, the networks in eval
        mode throughout (no dropout: rollouts and the updates' forwards see the same function).

        Args:
            module: the FlowModule (optimiser, ``manual_backward``, ``clip_gradients``, logging, ``all_gather``).
            batch: the rank's share of the step's (prompt, sample) pairs, with their ``group`` ids.
            generator: the rollout noise generator of this rank and step.
        """
        adapter = module.adapter
        self._sync = _gradient_sync(module)
        if self._rewards_device != module.device:  # reward models score where the policy runs
            self.rewards.to(module.device)
            self._rewards_device = module.device
        was_training = adapter.training
        adapter.eval()
        try:
            with self.sampling_policy(module):
                rollouts = self.rollout(adapter, batch, generator, progress=lambda d, n: _progress(module, d, n))
            rewards = self.score(adapter, module, batch, rollouts)
            stats = self.update(module, adapter, rollouts, generator)
        finally:
            adapter.train(was_training)
        bs = len(batch["prompt"])
        for name, value in {**rewards, **stats.means()}.items():
            module.log(f"train/{name}", value.detach().float(), batch_size=bs, prog_bar=name == "reward_mean")

    @contextlib.contextmanager
    def sampling_policy(self, module: Any) -> Iterator[None]:
        """The weights rollouts sample with: the trained ones (on-policy; DiffusionNFT swaps in its old policy)."""
        yield

    def rollout(self, adapter: Adapter, batch: dict[str, Any], generator: torch.Generator | None,
                progress=None) -> list[Any]:  # fmt: skip
        raise NotImplementedError

    def update(self, module: Any, adapter: Adapter, rollouts: list[Any], generator: torch.Generator | None) -> Any:
        raise NotImplementedError

    def score(self, adapter: Adapter, module: Any, batch: dict[str, Any], rollouts: list[Any]) -> dict[str, Tensor]:
        """Decode, score, gather every rank's scores and set each rollout's advantages; returns reward metrics."""
        media = [m for r in rollouts for m in adapter.decode(r.trajectory.final)]
        groups = batch.get("group")
        if groups is None:  # each sample its own group would make every advantage 0: never train on that silently
            raise ValueError(f"{self.method}: the batch carries no `group` ids; online batches come from "
                             "the data module's GroupedDistributor (data.grouping, linked from model.objective)")
        types = tuple(str(t.value) for t in adapter.io_contract.output_types)
        rates = tuple(getattr(adapter, "output_rates", None) or (None,) * len(types))  # as FlowModule.generate
        reward_batch = RewardBatch(media, list(batch["prompt"]), list(batch["metadata"]), groups.cpu(), types, rates)
        per_reward = _score_once(self.rewards, reward_batch, module)
        gather = _gatherer(module)
        all_groups = gather(groups.to(torch.long))
        if self.rewards.has_groupwise:  # needs whole groups: every rank scores the gathered step alike
            gathered = _gather_objects(module, reward_batch)
            whole = RewardBatch([m for b in gathered for m in b.media], [p for b in gathered for p in b.prompts],
                                [d for b in gathered for d in b.metadata], all_groups.cpu(),
                                reward_batch.output_types, reward_batch.rates)  # fmt: skip
            all_scores = {k: gather(v) for k, v in per_reward.items()} | self.rewards.groupwise(whole)
        else:
            all_scores = {k: gather(v) for k, v in per_reward.items()}
        total = self.rewards.combine(all_scores).total
        all_groups = all_groups.to(total.device)
        advantages = self.advantages(all_scores, total, all_groups)
        tied = tied_groups(total, all_groups)  # over every rank's groups, as the advantages
        rank, n = _rank(module), len(batch["prompt"])
        local, local_tied = advantages[rank * n : (rank + 1) * n], tied[rank * n : (rank + 1) * n]
        for r in rollouts:
            device = next(iter(r.trajectory.final.components.values())).device
            r.advantages = local[r.rows].to(device)
            r.keep = (~local_tied[r.rows]).to(device) if self.filter_zero_std and local_tied[r.rows].any() else None
            r.kept_anywhere = not self.filter_zero_std or not bool(tied.view(-1, n)[:, r.rows].all())
        metrics = {"reward_mean": total.mean(), "reward_std": total.std(correction=0),
                   "zero_std_ratio": zero_std_ratio(total, all_groups)}  # fmt: skip
        for key, scores in all_scores.items():
            metrics[f"reward/{key}_mean"], metrics[f"reward/{key}_std"] = scores.mean(), scores.std(correction=0)
        clipped = advantages.clamp(-self.adv_clip_max, self.adv_clip_max)  # what the loss uses
        metrics["advantage_abs_mean"] = clipped.abs().mean()
        return metrics

    def advantages(self, per_reward: dict[str, Tensor], total: Tensor, groups: Tensor) -> Tensor:
        """Every sample's advantage (before clipping): GDPO when ``reward_aggregation: gdpo`` and two or more rewards
        carry weight; otherwise the weighted total's group advantage (flow_grpo's, ``global_std``)."""
        weighted = {s.key: s.weight for s in self.rewards.specs if s.weight != 0}
        if self.reward_aggregation == "gdpo" and len(weighted) >= 2:
            return gdpo_advantages({k: per_reward[k] for k in weighted}, weighted, groups)
        return group_advantages(total, groups, self.global_std)

    def optimizer_step(self, module: Any, optimizer: Any, scheduler: Any, terms: int) -> None:
        """Finish one optimiser step whose backwards are done: average the gradients over the ranks, skip the step
        when no rank back-propagated anything (or the non-finite guard drops it), clip to ``max_grad_norm``, step,
        zero the gradients and step the lr scheduler.

        Args:
            terms: this rank's (sample, term) count back-propagated for the step.
        """
        guard = getattr(module, "nonfinite_guard", None)  # ff_core.nonfinite: model.nonfinite
        if _average_gradients(module, terms, self._sync) == 0:  # no rank kept a sample (filter_zero_std)
            _count_step_without_stepping(optimizer)
        elif guard is not None and _nonfinite_skip(module, guard, optimizer):  # before any weight moves
            _count_step_without_stepping(optimizer)
        else:
            if self.max_grad_norm is not None:
                module.clip_gradients(optimizer, gradient_clip_val=self.max_grad_norm,
                                      gradient_clip_algorithm="norm")  # fmt: skip
            optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()


def slice_batch(value: Any, rows: slice) -> Any:
    """Rows ``rows`` of a collated value (tensors along dim 0; dicts, lists and tuples recursively)."""
    if isinstance(value, Tensor):
        return value[rows]
    if isinstance(value, dict):
        return {k: slice_batch(v, rows) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(slice_batch(v, rows) for v in value)
    return value


def _split(items: list, parts: int) -> list[list]:
    """``items`` in ``parts`` contiguous runs, as even as possible (the first ones longer)."""
    q, r = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + q + (i < r)
        out.append(items[start:end])
        start = end
    return out


def _data_parallel(module: Any) -> tuple[int, int, Any]:
    """``(rank, size, group)`` of the data-parallel dimension (``FlowModule.data_parallel``): the ranks of one
    context-parallel group (ff's ``ContextParallelStrategy``) roll out the same samples, so rewards, advantages and
    counts are gathered over the data-parallel replicas only; ``(0, 1, None)`` outside a trainer."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        return 0, 1, None
    coords = getattr(module, "data_parallel", None)
    if coords is None:  # a host that is not a FlowModule: every process is a data-parallel rank
        return trainer.global_rank, trainer.world_size, None
    return coords.rank, coords.world_size, coords.group


def _rank(module: Any) -> int:
    return _data_parallel(module)[0]


def _gatherer(module: Any):
    """``tensor -> every data-parallel rank's tensor, concatenated in rank order`` (the tensor itself on one)."""
    _, size, group = _data_parallel(module)
    if size == 1:
        return lambda x: x
    if group is None:  # every process: Lightning's all_gather
        return lambda x: module.all_gather(x.to(module.device)).flatten(0, 1).cpu()
    import torch.distributed as dist

    def gather(x: Tensor) -> Tensor:
        # Through the module's device (NCCL gathers device tensors only), back to the CPU, where rewards return scores.
        x = x.to(module.device).contiguous()
        out = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(out, x, group=group)
        return torch.cat(out).cpu()

    return gather


def _gather_objects(module: Any, obj: Any) -> list[Any]:
    _, size, group = _data_parallel(module)
    if size == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def _score_once(rewards: Any, batch: RewardBatch, module: Any) -> dict[str, Tensor]:
    """The pointwise rewards of the rank's samples. The ranks of a context-parallel group hold the same samples: each
    scores every ``size``-th one (rank ``r``: samples ``r, r + size, ...``) and the group all-gathers the scores, so a
    sample is scored once per group, not once per rank."""
    trainer = getattr(module, "_trainer", None)
    rank, size, group = getattr(module, "context_parallel", (0, 1, None)) if trainer is not None else (0, 1, None)
    if size == 1:
        return rewards.pointwise(batch)
    import torch.distributed as dist

    mine = list(range(rank, len(batch.prompts), size))
    pick = lambda xs: [xs[i] for i in mine]  # noqa: E731
    groups = batch.groups[mine] if batch.groups is not None else None
    part = RewardBatch(pick(batch.media), pick(batch.prompts), pick(batch.metadata), groups, batch.output_types,
                       batch.rates)  # fmt: skip
    scores = {k: v.cpu() for k, v in rewards.pointwise(part).items()} if mine else None
    parts: list[Any] = [None] * size
    dist.all_gather_object(parts, scores, group=group)
    some = next(p for p in parts if p is not None)
    out = {}
    for key in some:
        whole = torch.empty(len(batch.prompts), dtype=some[key].dtype)
        for r, p in enumerate(parts):
            if p is not None:
                whole[r::size] = p[key]
        out[key] = whole
    return out


def _gradient_sync(module: Any) -> Literal["none", "manual", "strategy"]:
    """Who averages the replayed gradients over the data-parallel ranks: ``none`` (one process), ``manual`` (DDP:
    :func:`_average_gradients`, once per optimiser step) or ``strategy`` (FSDP2, DeepSpeed: each backward's reduction,
    ``FlowModule.strategy_reduces_gradients``).

    Under DDP, the wrapper's per-backward all-reduce is turned off: under manual optimisation Lightning re-arms DDP's
    reducer before every ``manual_backward``, so each replayed transition would all-reduce the whole gradient; GRPO
    accumulates over every transition of a run first (as Flow-GRPO does under accelerate's ``accumulate``), so it sets
    DDP's ``require_backward_grad_sync`` off (the flag ``no_sync`` sets, which Lightning's ``prepare_for_backward``
    honours) and averages the accumulated gradients in one flat all-reduce.

    Under FSDP2 each backward reduce-scatters the gradients of the blocks it ran into the rank's shards, which
    accumulate over the step's transitions: the mean over ranks of each rank's accumulated gradient, as DDP's, without
    a full gradient ever held whole (``set_requires_gradient_sync(False)`` would save the communication at the cost of
    an unsharded gradient per rank). DeepSpeed ZeRO-2 reduces each backward's gradients into the rank's partition
    likewise (its engine's ``backward``) and clips in its ``step`` (``FlowModule`` writes ``max_grad_norm`` into its
    config). Every rank must then run the same forwards and backwards (:meth:`GRPOObjective.update`).
    """
    trainer = getattr(module, "_trainer", None)
    if trainer is None or trainer.world_size == 1:
        return "none"
    from torch.nn.parallel import DistributedDataParallel

    if getattr(module, "strategy_reduces_gradients", False):  # FSDP2, DeepSpeed
        return "strategy"
    wrapper = getattr(trainer.strategy, "model", None)
    if not isinstance(wrapper, DistributedDataParallel):
        raise ValueError(f"GRPO runs on one device, under DDP (trainer.strategy: ddp) or FSDP2; got "
                         f"{type(trainer.strategy).__name__}")  # fmt: skip
    wrapper.require_backward_grad_sync = False
    return "manual"


def _average_gradients(module: Any, terms: int, sync: Literal["none", "manual", "strategy"] = "manual") -> int:
    """Average the trainable parameters' gradients over the data-parallel ranks; returns the (sample, transition)
    terms back-propagated for the step on all ranks together (``terms`` on one process).

    ``terms``: this rank's. With ``filter_zero_std`` ranks may have trained on different numbers of samples, none at
    all, or (Wan2.2 A14B, LoRA on both experts) on different experts, so the set of parameters holding a gradient can
    differ between ranks. One small all-reduce first sums, per parameter, whether a rank has its gradient (and the
    terms); the gradients are then averaged over exactly the parameters some rank trained (a rank without one adds
    zeros), in one flat all-reduce of the same tensors on every rank. A parameter no rank trained keeps no gradient
    (``None``), so the optimiser leaves it and its state alone, as on one process: a zero gradient would not (AdamW's
    weight decay and momentum still move it). Under ``sync="strategy"`` (FSDP2, :func:`_gradient_sync`) the shards
    are already averaged: only the terms are summed.
    """
    trainer = getattr(module, "_trainer", None)
    if trainer is None or trainer.world_size == 1:
        return terms
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    if sync == "strategy":  # the shards' reduce-scatter averaged them: only the count remains
        count = torch.tensor([float(terms)], device=module.device)
        dist.all_reduce(count, group=_data_parallel(module)[2])
        return int(count.item())
    params = [p for p in module.parameters() if p.requires_grad]
    flags = torch.tensor([float(p.grad is not None) for p in params] + [float(terms)], device=params[0].device)
    dist.all_reduce(flags)
    trained = [p for p, had in zip(params, flags[:-1].tolist()) if had > 0]
    for p in trained:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if trained:
        grads = [p.grad for p in trained]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat /= trainer.world_size
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)
    return int(flags[-1].item())


def _nonfinite_skip(module: Any, guard: Any, optimizer: Any) -> bool:
    """The non-finite check of one optimiser step (:class:`ff_core.nonfinite.NonFiniteGuard`), on the averaged
    gradients, on every rank alike: raises under ``stop``; ``True`` when ``skip`` dropped the step's gradients."""
    skipped = guard.check(module, optimizer)
    log_nonfinite = getattr(module, "log_nonfinite", None)
    if log_nonfinite is not None:
        log_nonfinite()
    return skipped


def _count_step_without_stepping(optimizer: Any) -> None:
    """Count an optimiser step in Lightning's loop (``trainer.global_step``, hence ``max_steps`` and the schedules)
    without calling the optimiser: nothing was back-propagated on any rank, and a step with no gradient would trip a
    ``GradScaler`` (``trainer.precision: 16-mixed``: "No inf checks were recorded"). These are the two hooks
    ``LightningOptimizer.step`` runs around the strategy's step under manual optimisation (a bare torch optimiser,
    outside a Trainer, has no step counter to advance)."""
    for hook in ("_on_before_step", "_on_after_step"):
        if callable(getattr(optimizer, hook, None)):
            getattr(optimizer, hook)()


def _progress(module: Any, done: int, total: int) -> None:
    """``rollout done/total`` on rank 0's training progress bar while an iteration samples: appended to the task's
    description of Lightning's rich bar (removed when the rollout ends), the postfix of its tqdm bar."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None or not trainer.is_global_zero:
        return
    bar, text = trainer.progress_bar_callback, f"rollout {done}/{total}" if done < total else ""
    task_id, progress = getattr(bar, "train_progress_bar_id", None), getattr(bar, "progress", None)
    if task_id is not None and progress is not None:  # RichProgressBar
        base = progress.tasks[task_id].description.split(" · rollout")[0]
        progress.update(task_id, description=f"{base} · {text}" if text else base)
        bar.refresh()
        return
    tqdm_bar = getattr(bar, "train_progress_bar", None)
    if tqdm_bar is not None and hasattr(tqdm_bar, "set_postfix_str"):
        tqdm_bar.set_postfix_str(text, refresh=True)
