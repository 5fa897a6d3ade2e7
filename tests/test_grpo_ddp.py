"""Flow-GRPO under real 2-process DDP (gloo) through `ff fit`: each step's prompt groups split over the ranks, rewards
gathered into advantages, gradients averaged once per optimiser step (GRPO back-propagates once per replayed
transition inside DDP's forward, so it does the all-reduce itself; ff_core/objectives/grpo.py).

As in tests/test_ddp_resume.py, DDP never runs inside pytest: the run is a subprocess without the launcher variables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch

from tests.test_ddp_resume import LAUNCHER_VARS, free_port
from tests.test_grpo_fit import RECIPE

REPO = Path(__file__).resolve().parents[1]


class DumpRankState(L.Callback):
    """Saves, per rank, the trainable weights after training and the ids and groups of every batch it ran."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath, self.batches = Path(dirpath), []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append({"index": batch["index"].tolist(), "group": batch["group"].tolist(),
                             "reward_mean": None})  # fmt: skip

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches[-1]["reward_mean"] = float(trainer.callback_metrics["train/reward_mean"])

    def on_train_end(self, trainer, pl_module) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        weights = {n: p.detach().clone() for n, p in pl_module.named_parameters() if p.requires_grad}
        torch.save({"weights": weights, "batches": self.batches}, self.dirpath / f"rank{trainer.global_rank}.pt")


def run_two_ranks(tiny_sd3, tmp_path, *extra) -> list[dict]:
    """`ff fit` of the shrunk recipe on 2 gloo processes, 3 steps; each rank's DumpRankState."""
    from ff_core.testing.shapes import write_prompt_dataset

    prompts = write_prompt_dataset(tmp_path / "prompts")
    callbacks = [{"class_path": "tests.test_grpo_ddp.DumpRankState", "init_args": {"dirpath": str(tmp_path / "out")}}]
    cmd = [
        sys.executable, "-m", "ff_core.cli", "fit", "--config", str(RECIPE),
        "--model.pretrained_model_name_or_path", str(tiny_sd3),
        "--model.objective.init_args.group_size", "2", "--model.objective.init_args.prompts_per_step", "2",
        "--model.objective.init_args.num_steps", "3",
        "--model.objective.init_args.sampler", json.dumps({"kind": "flow_sde", "eta": 0.7, "window": [0, 2]}),
        "--model.objective.init_args.micro_batch_size", "2",
        "--data.datasets", json.dumps([{"name": "prompts", "dataset_dir": str(prompts)}]),
        "--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
        "--trainer.max_steps", "3", "--trainer.limit_val_batches", "0",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false", "--trainer.enable_progress_bar",
        "false", "--trainer.callbacks", json.dumps(callbacks), *extra,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(HF_HUB_OFFLINE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def test_two_process_steps_with_every_group_tied_change_nothing(tiny_sd3, tmp_path):
    """A reward every sample ties on: with ``filter_zero_std`` neither rank replays anything, the flat all-reduce
    (which carries each rank's count of trained terms) finds no rank trained, and both ranks leave their LoRA as
    peft initialised it (B still zero), in step, without hanging."""
    ranks = run_two_ranks(tiny_sd3, tmp_path, "--model.objective.init_args.rewards",
                          json.dumps([{"name": "tests.test_grpo_fit:Constant"}]), "--model.eval_rewards", "[]")
    for name, w in ranks[0]["weights"].items():
        assert torch.equal(w, ranks[1]["weights"][name]), name
        if "lora_B" in name:
            assert w.abs().sum() == 0, name


def test_two_process_grpo_keeps_the_ranks_in_step(tiny_sd3, tmp_path):
    """2 ranks, 2 prompts x 2 samples per step, 3 steps: each group is split over the ranks (sample-major deal: each
    rank one sample of both prompts), so the advantages need the gathered rewards; the ranks logged the same gathered
    reward mean and end with identical weights that differ from the start (the averaged gradients stepped both
    alike)."""
    ranks = run_two_ranks(tiny_sd3, tmp_path)
    for step in range(3):
        a, b = ranks[0]["batches"][step], ranks[1]["batches"][step]
        assert a["group"] == b["group"] == [2 * step, 2 * step + 1]  # the same prompts, their other samples
        assert a["index"] == b["index"]
        assert a["reward_mean"] == b["reward_mean"]  # gathered over both ranks
    base = torch.load(tmp_path / "out" / "rank0.pt", weights_only=False)["weights"]
    for name, w in ranks[0]["weights"].items():
        assert torch.equal(w, ranks[1]["weights"][name]), name
    lora_b = [n for n in base if "lora_B" in n]
    assert any(ranks[0]["weights"][n].abs().sum() > 0 for n in lora_b)  # peft starts B at zero: training moved it


def _average_on_two_ranks(rank: int, init_file: str, out: str) -> None:
    """One of 2 gloo ranks running :func:`ff_core.objectives.grpo._average_gradients` on a module of three
    parameters: ``a`` has a gradient on rank 0 only (its samples kept, rank 1's all filtered out), ``b`` on both,
    ``c`` on neither (Wan2.2 A14B's idle expert), then one AdamW step with weight decay."""
    import types

    import torch.distributed as dist

    from ff_core.objectives.grpo import _average_gradients

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        module = torch.nn.Module()
        for name in "abc":
            module.register_parameter(name, torch.nn.Parameter(torch.ones(3)))
        module._trainer = types.SimpleNamespace(world_size=2)
        if rank == 0:
            module.a.grad = torch.tensor([2.0, 4.0, 6.0])
        module.b.grad = torch.full((3,), float(rank + 1))
        total = _average_gradients(module, terms=3 if rank == 0 else 0)
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}
        torch.optim.AdamW(module.parameters(), lr=0.1, weight_decay=0.5).step()
        weights = {n: p.detach().clone() for n, p in module.named_parameters()}
        torch.save({"total": total, "grads": grads, "weights": weights}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_gradients_average_over_the_parameters_some_rank_trained(tmp_path):
    """Ranks that kept different numbers of samples (``filter_zero_std``: rank 1 none) or trained different
    parameters: each parameter's gradient is the sum over the ranks that have one divided by the world size (DDP's
    mean, a missing one counting as zero), the same on both ranks; a parameter no rank trained keeps no gradient, so
    AdamW's weight decay leaves it exactly as it was (a zero gradient would have decayed it, 1 -> 0.95); the returned
    count is both ranks' terms. By hand: a = (2, 4, 6) / 2, b = (1 + 2) / 2."""
    import torch.multiprocessing as mp

    mp.spawn(_average_on_two_ranks, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for r in ranks:
        assert r["total"] == 3
        torch.testing.assert_close(r["grads"]["a"], torch.tensor([1.0, 2.0, 3.0]), rtol=0, atol=0)
        torch.testing.assert_close(r["grads"]["b"], torch.full((3,), 1.5), rtol=0, atol=0)
        assert r["grads"]["c"] is None
        assert torch.equal(r["weights"]["c"], torch.ones(3))
        assert not torch.equal(r["weights"]["a"], torch.ones(3))
    for name in "abc":
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name
