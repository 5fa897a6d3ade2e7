"""Context parallelism's core pieces (issue 27; the families' ``ff fit`` runs live in their plugins' tests).

* :class:`~ff_core.context_parallel.UlyssesAnythingAttention` (the backward diffusers 0.42 lacks) on 2 gloo processes,
  against ``scaled_dot_product_attention`` on the whole sequence in one: a token count and a head count the group
  does not divide (7 query tokens split 4 + 3, 5 key tokens 3 + 2, 3 heads), a key mask; the output and the gradients
  of queries, keys and values per rank's slice.
* A group's ranks score each sample's pointwise rewards once (every second sample each, scores all-gathered).
* The refusals, before any weight loads: SD3's transformer has no context-parallel plan; head counts Ulysses cannot
  spread over the group; a group of 1.
* :func:`cp_fit` and the assertions the families' runs share (:class:`Tokens`: each rank's attention holds its slice;
  :class:`Rollouts`: GRPO's per-sample final latents, log-probs and advantages).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from ff_core.errors import ConfigError
from ff_core.rewards.base import Reward, RewardBatch
from ff_core.strategies import ContextParallelStrategy
from tests.test_ddp_resume import free_port


class Tokens(L.Callback):
    """Per rank: the token count of every self-attention input of the first training step (the sequence each rank's
    attention activations are made of): the inputs of the trained networks' modules whose name matches ``pattern``
    (Wan's and LTX-2's ``attn1`` and ``audio_attn1``; H3's ``transformer_blocks.N.attn``)."""

    def __init__(self, dirpath: str, pattern: str = r"attn1$") -> None:
        self.dirpath, self.pattern, self.seen, self.handles = Path(dirpath), re.compile(pattern), set(), []

    def on_train_start(self, trainer, pl_module) -> None:
        def record(module, args, kwargs) -> None:
            self.seen.add(int((args[0] if args else kwargs["hidden_states"]).shape[1]))

        for network in pl_module.adapter.denoisers().values():
            for name, module in network.named_modules():
                if self.pattern.search(name):
                    self.handles.append(module.register_forward_pre_hook(record, with_kwargs=True))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def on_train_end(self, trainer, pl_module) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        (self.dirpath / f"rank{trainer.global_rank}.json").write_text(json.dumps(sorted(self.seen)))


class Rollouts(L.Callback):
    """Per rank, GRPO's rollouts as the update receives them: per micro-batch, each sample's final latents, each
    transition's rollout log-prob and each sample's advantage."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath, self.records = Path(dirpath), []

    def on_train_start(self, trainer, pl_module) -> None:
        objective = pl_module.objective
        if not hasattr(objective, "update"):
            return
        update = objective.update

        def recorded(module, adapter, rollouts, *rest):
            self.records.append([{"final": {k: v.detach().cpu() for k, v in r.trajectory.final.components.items()},
                                  "log_probs": [t.log_prob.detach().cpu() for t in r.trajectory.transitions],
                                  "advantages": r.advantages.detach().cpu()} for r in rollouts])  # fmt: skip
            return update(module, adapter, rollouts, *rest)

        objective.update = recorded

    def on_train_end(self, trainer, pl_module) -> None:
        if self.records:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            torch.save(self.records, self.dirpath / f"rank{trainer.global_rank}.pt")


def cp_fit(root: Path, recipe: Path, checkpoint: Path, ranks: int, dataset: Path, *extra: str,
           tokens: str = r"attn1$") -> dict:  # fmt: skip
    """``ff fit RECIPE`` on ``ranks`` processes (``launch``), its checkpoint and dataset replaced, a checkpoint every
    step, and the per-rank records the context-parallel tests compare: SampleLog (ids, sigma, noise seed, loss),
    :class:`Tokens`, ``tests.test_grpo_sharded.Record`` (GRPO's metrics and weights)."""
    from tests.test_fsdp2 import launch

    root.mkdir()
    callbacks = [
        {"class_path": "ff_core.callbacks.FlowCheckpoint",
         "init_args": {"every_n_train_steps": 1, "save_top_k": -1, "save_last": True, "dirpath": str(root / "ckpt")}},
        {"class_path": "ff_core.callbacks.SampleLog",
         "init_args": {"dirpath": str(root / "ids"), "outputs": ["sigma", "noise_seed", "loss"]}},
        {"class_path": "tests.test_context_parallel.Tokens",
         "init_args": {"dirpath": str(root / "tokens"), "pattern": tokens}},
        {"class_path": "tests.test_grpo_sharded.Record", "init_args": {"dirpath": str(root / "out")}},
        {"class_path": "tests.test_context_parallel.Rollouts", "init_args": {"dirpath": str(root / "rollouts")}},
    ]  # fmt: skip
    return {root: launch(root, [
        "--config", str(recipe), "--model.pretrained_model_name_or_path", str(checkpoint),
        "--data.datasets", json.dumps([{"name": "data", "dataset_dir": str(dataset)}]),
        "--trainer.devices", str(ranks), "--trainer.limit_val_batches", "0", "--trainer.default_root_dir", str(root),
        "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.callbacks", json.dumps(callbacks), *extra,
    ], ranks=ranks)}  # fmt: skip


CP2 = json.dumps({"class_path": "ff_core.strategies.ContextParallelStrategy",
                  "init_args": {"context_parallel_size": 2, "save_distributed_checkpoint": False}})  # fmt: skip
"""``trainer.strategy`` of a 2-process context-parallel group (one data-parallel rank)."""


def steps(n: int) -> tuple[str, ...]:
    return ("--trainer.max_steps", str(n))


def weights(root: Path) -> dict[str, torch.Tensor]:
    return torch.load(root / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]


def tokens(root: Path, rank: int) -> list[int]:
    return json.loads((root / "tokens" / f"rank{rank}.json").read_text())


def rows(root: Path, rank: int) -> list[dict]:
    from ff_core.callbacks import read_sample_log

    return read_sample_log(root / "ids" / f"rank{rank}.jsonl")


def same_weights(got: dict, want: dict, atol: float = 1e-6) -> None:
    assert got.keys() == want.keys() and want
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=atol, msg=key)


def assert_split(one: Path, cp: Path) -> None:
    """Each cp rank's attention inputs hold its slice (``tensor_split``) of every sequence the one process sees."""
    whole = tokens(one, 0)
    assert whole and tokens(cp, 0) == sorted(-(-n // 2) for n in whole)
    assert tokens(cp, 1) == sorted(n // 2 for n in whole)


def assert_same_training(one: Path, cp: Path, rel: float = 1e-5, atol: float = 1e-6) -> None:
    """Both cp ranks take the one process's samples, levels and noise, with its losses (within ``rel``), and end with
    its weights (within ``atol``)."""
    from tests.test_fsdp2 import assert_same_run

    for rank in (0, 1):
        assert len(rows(cp, rank)) == len(rows(one, 0))
        assert_same_run(rows(cp, rank), rows(one, 0), rel=rel)
    same_weights(weights(cp), weights(one), atol=atol)


def assert_same_grpo(one: Path, cp: Path) -> None:
    """Both cp ranks roll out the one process's samples (each sample's final latents, each transition's log-prob,
    each sample's advantage) and take its update (the logged rewards, losses, ratios and KL; the weights at the
    end)."""
    from tests.test_grpo_sharded import same_steps

    single = torch.load(one / "out" / "rank0.pt", weights_only=False)
    rollouts = torch.load(one / "rollouts" / "rank0.pt", weights_only=False)
    for rank in (0, 1):
        record = torch.load(cp / "out" / f"rank{rank}.pt", weights_only=False)
        assert record["steps"] and [s["step"] for s in record["steps"]] == [s["step"] for s in single["steps"]]
        same_steps(single["steps"], record["steps"])
        same_weights(record["weights"], single["weights"], atol=1e-5)
        theirs = torch.load(cp / "rollouts" / f"rank{rank}.pt", weights_only=False)
        assert len(theirs) == len(rollouts)
        for got_step, want_step in zip(theirs, rollouts):
            assert len(got_step) == len(want_step)
            for got, want in zip(got_step, want_step):
                for key, latent in want["final"].items():
                    torch.testing.assert_close(got["final"][key], latent, rtol=1e-4, atol=1e-5, msg=key)
                assert len(got["log_probs"]) == len(want["log_probs"]) > 0
                for a, b in zip(got["log_probs"], want["log_probs"]):
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(got["advantages"], want["advantages"], rtol=1e-4, atol=1e-5)


def _attention_rank(rank: int, port: int, out: str) -> None:
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from diffusers.models.attention_dispatch import _native_attention_backward_op, _native_attention_forward_op
    from torch.distributed.device_mesh import init_device_mesh

    from ff_core.context_parallel import UlyssesAnythingAttention

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("ring", "ulysses"))
    config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=2, ulysses_anything=True))
    config.setup(rank, 2, torch.device("cpu"), mesh=mesh)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 7, 3, 4, generator=g), torch.randn(2, 5, 3, 4, generator=g), torch.randn(2, 5, 3, 4,
                                                                                                   generator=g)
    mask = torch.rand(2, 1, 1, 5, generator=g) > 0.3
    mask[..., 0] = True
    slices = [x.tensor_split(2, dim=1)[rank].clone().requires_grad_(True) for x in (q, k, v)]
    local_mask = mask.tensor_split(2, dim=-1)[rank].contiguous()
    o = UlyssesAnythingAttention.apply(*slices, local_mask, 0.0, False, None, False, False,
                                       _native_attention_forward_op, _native_attention_backward_op, config)
    weight = torch.randn(2, 7, 3, 4, generator=g).tensor_split(2, dim=1)[rank]
    (o * weight).sum().backward()
    torch.save({"out": o.detach(), "grads": [x.grad for x in slices]}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_ulysses_anything_attention_has_the_whole_sequences_output_and_gradients(tmp_path):
    mp.start_processes(_attention_rank, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    g = torch.Generator().manual_seed(0)
    q, k, v = (x.requires_grad_(True) for x in (torch.randn(2, 7, 3, 4, generator=g), torch.randn(2, 5, 3, 4,
                                                generator=g), torch.randn(2, 5, 3, 4, generator=g)))  # fmt: skip
    mask = torch.rand(2, 1, 1, 5, generator=g) > 0.3
    mask[..., 0] = True
    whole = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), attn_mask=mask).transpose(1, 2)
    weight = torch.randn(2, 7, 3, 4, generator=g)
    (whole * weight).sum().backward()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    torch.testing.assert_close(torch.cat([r["out"] for r in ranks], dim=1), whole.detach())
    for i, x in enumerate((q, k, v)):
        torch.testing.assert_close(torch.cat([r["grads"][i] for r in ranks], dim=1), x.grad)


class Counted(Reward):
    """The mean of each image, and how many samples it scored (``scored``)."""

    name = "counted"
    scored = 0

    def __call__(self, batch):
        self.scored += len(batch.media)
        return torch.stack([m[0].float().mean() for m in batch.media])


def _score_rank(rank: int, port: int, out: str) -> None:
    from types import SimpleNamespace

    from ff_core.objectives.grpo import _score_once
    from ff_core.objectives.rewards import Rewards

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    batch = RewardBatch([[torch.full((3, 4, 4), float(i))] for i in range(5)], [f"p{i}" for i in range(5)],
                        [{}] * 5, torch.arange(5), ("image",), (None,))  # fmt: skip
    module = SimpleNamespace(_trainer=object(), context_parallel=(rank, 2, dist.group.WORLD))
    rewards = Rewards([{"name": "tests.test_context_parallel:Counted"}])
    scores = _score_once(rewards, batch, module)
    torch.save({"scores": scores, "scored": rewards.rewards[0].scored}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_a_context_parallel_group_scores_each_sample_once(tmp_path):
    """The group's ranks hold the same 5 samples: rank 0 scores 3, rank 1 scores 2, and both get all 5 scores."""
    mp.start_processes(_score_rank, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert [r["scored"] for r in ranks] == [3, 2]
    for r in ranks:
        (key,) = r["scores"]
        torch.testing.assert_close(r["scores"][key], torch.arange(5, dtype=torch.float32))


def test_a_denoiser_without_a_plan_is_refused_before_weights_load(tiny_sd3):
    from ff_core.module import FlowModule

    module = FlowModule("sd3-5", str(tiny_sd3))
    with pytest.raises(ConfigError, match=r"context_parallel_size.*SD3Transformer2DModel.*no context-parallel plan"):
        module._check_strategy(ContextParallelStrategy(context_parallel_size=2))
    assert module.adapter is None  # nothing loaded


@pytest.mark.parametrize("heads, size, ok", [(3, 2, True), (4, 4, True), (7, 4, True), (5, 4, False), (6, 4, False),
                                             (1, 2, False)])  # fmt: skip
def test_a_group_its_heads_cannot_spread_over_is_refused(tmp_path, heads, size, ok):
    from ff_core.context_parallel import check_heads

    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"audio_num_attention_heads": heads}))
    if ok:
        check_heads(tmp_path, ["transformer"], size)
    else:
        with pytest.raises(ConfigError, match=rf"context_parallel_size: {size}: transformer's {heads} attention heads"):
            check_heads(tmp_path, ["transformer"], size)


def test_a_group_of_one_is_refused():
    with pytest.raises(ConfigError, match="context_parallel_size"):
        ContextParallelStrategy(context_parallel_size=1)
