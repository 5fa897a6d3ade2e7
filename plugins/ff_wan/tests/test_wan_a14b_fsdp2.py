"""Wan2.2 A14B (two routed experts) under FSDP2 (issue 26, item 2).

Each expert is sharded on its own, and each expert's forward all-gathers its blocks: every rank must run the same
expert at each step. ff's scheme (``model.objective.init_args.timesteps.expert_choice: per_micro_batch``, what
``auto`` resolves to under FSDP2): per micro-batch and draw, one level drawn from a generator every rank seeds alike
picks the expert, and each sample's level is drawn from the rank's own generator within that expert's range.

* The distribution: each sample's level keeps the reference's (``per_sample``) distribution, checked against
  ``per_sample`` draws (two-sample Kolmogorov-Smirnov) and against the closed form of the probability of the
  high-noise expert's range; every sample of a micro-batch, on every rank, routes to the picked expert.
* Training: real ``ff fit`` on 2 gloo processes, LoRA SFT of a tiny T2V-A14B checkpoint (both experts) under DDP
  with ``per_micro_batch`` and under FSDP2 (``auto``): the same samples, levels, noise and losses per rank and step,
  both experts used across the steps, each rank holding half of both experts, the same LoRA at the end.
* Flow-GRPO needs no choice: every rank samples the same schedule and replays the same window of transitions in the
  same order (a random ``num_sde_steps`` subset is refused), so both experts run on every rank in step; LoRA GRPO
  under FSDP2 equals DDP (rollouts, rewards, losses, final LoRA).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from ff_wan.adapter import WanT2VAdapter
from ff_wan.testing import write_moving_squares

from ff_core.errors import ConfigError
from ff_core.lora import LoRAConfig
from ff_core.module import FlowModule
from ff_core.objectives import GRPOObjective, SFTObjective
from ff_core.objectives.flow_matching import TimestepSampler, draw_within_one_expert
from ff_core.sampling import StochasticSampling
from ff_core.seeding import derive_seed
from tests.test_fsdp2 import REPO, assert_same_run, launch, report, rows, start, wait, weights
from tests.test_grpo_sharded import out, same_steps
from tests.test_sharding import trainer_with_mesh

RECIPE = REPO / "configs" / "wan" / "sft_tiny.yaml"
FSDP2 = json.dumps({"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                    "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1,
                                  "save_distributed_checkpoint": False}})  # fmt: skip
STEPS = 6
ADAPTER_KWARGS = {"height": 32, "width": 32, "num_frames": 9, "fps": 8}


@pytest.fixture(scope="module")
def experts(tiny_wan):
    return WanT2VAdapter.from_pretrained(tiny_wan("t2v_a14b"), **ADAPTER_KWARGS)


def high_noise_probability(sampler: TimestepSampler, shift: float, boundary: float) -> float:
    """P(sigma >= boundary) for sigma = shift(sigmoid(n)), n ~ N(mean, std): the shift is increasing, so sigma >= b
    exactly when u >= b / (shift - (shift - 1) b), i.e. n >= logit of that."""
    u = boundary / (shift - (shift - 1) * boundary)
    z = (math.log(u / (1 - u)) - sampler.logit_mean) / sampler.logit_std
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_per_micro_batch_choice_keeps_the_noise_level_distribution(experts):
    sampler = TimestepSampler()
    shift = sampler.resolve_shift(experts)
    boundary = experts.boundary_ratio
    batches, size = 3000, 2
    picked, per_sample = [], []
    for i in range(batches):
        shared = derive_seed(7, i)
        ranks = [draw_within_one_expert(sampler, experts, size, torch.Generator().manual_seed(derive_seed(r, i)),
                                        torch.Generator().manual_seed(shared), shift=shift)
                 for r in (0, 1)]  # fmt: skip
        routes = {experts.uses_second_expert(float(s)) for sigmas in ranks for s in sigmas}
        assert len(routes) == 1, (i, ranks)  # one expert for both ranks' samples
        picked.append(ranks[0])
        per_sample.append(sampler.sample(size, generator=torch.Generator().manual_seed(derive_seed(9, i)), shift=shift))
    picked, per_sample = torch.cat(picked), torch.cat(per_sample)
    n = len(picked)
    # Two-sample Kolmogorov-Smirnov: the largest gap of the empirical CDFs, against its 1 % critical value.
    grid = torch.cat([picked, per_sample]).sort().values
    cdf = lambda x: torch.searchsorted(x.sort().values, grid, right=True).float() / n  # noqa: E731
    ks = (cdf(picked) - cdf(per_sample)).abs().max().item()
    assert ks < 1.63 * math.sqrt(2 / n), ks
    # The high-noise expert's share against the closed form, within 4 standard errors.
    p = high_noise_probability(sampler, shift, boundary)
    assert 0.1 < p < 0.5  # both experts well represented at the tiny checkpoint's boundary and shift
    for draws in (picked, per_sample):
        share = (draws >= boundary).float().mean().item()
        assert abs(share - p) < 4 * math.sqrt(p * (1 - p) / n), (share, p)


def test_the_picked_expert_is_the_one_a_shared_draw_routes_to(experts):
    """The shared generator's first level decides; the rank's levels then fall in that expert's range."""
    sampler = TimestepSampler(weighting="uniform")
    for seed in range(20):
        (level,) = sampler.sample(1, generator=torch.Generator().manual_seed(seed), shift=3.0)
        sigmas = draw_within_one_expert(sampler, experts, 4, torch.Generator().manual_seed(100 + seed),
                                        torch.Generator().manual_seed(seed), shift=3.0)  # fmt: skip
        assert all(experts.uses_second_expert(float(s)) == experts.uses_second_expert(float(level)) for s in sigmas)


@pytest.mark.parametrize("setting, key", [
    ({"objective": SFTObjective(timesteps=TimestepSampler(expert_choice="per_sample"))}, "expert_choice"),
    ({"objective": GRPOObjective(rewards=[{"name": "brightness"}], num_steps=4,
                                 sampler=StochasticSampling(num_sde_steps=1))}, "num_sde_steps"),
])  # fmt: skip
def test_fsdp2_refuses_settings_that_let_ranks_run_different_experts(tiny_wan, fake_world, setting, key):
    fake_world(0)
    module = FlowModule("wan2_t2v", str(tiny_wan("t2v_a14b")), adapter_kwargs=ADAPTER_KWARGS,
                        lora=LoRAConfig(rank=2, alpha=2.0), **setting)  # fmt: skip
    module.trainer = trainer_with_mesh(2, 1)
    with pytest.raises(ConfigError, match=key):
        module.configure_model()


@pytest.fixture(scope="module")
def runs(tiny_wan, tmp_path_factory):
    base = tmp_path_factory.mktemp("a14b_fsdp2")
    squares = write_moving_squares(base / "squares", 4)
    checkpoint = tiny_wan("t2v_a14b")
    ddp, fsdp2 = base / "D", base / "F"
    per_micro_batch = ("--model.objective.init_args.timesteps", json.dumps({"expert_choice": "per_micro_batch"}))
    wait({**start(RECIPE, checkpoint, squares, ddp, STEPS, *per_micro_batch, ddp=True),
          **start(RECIPE, checkpoint, squares, fsdp2, STEPS, "--trainer.strategy", FSDP2, "--trainer.devices", "2")})
    return ddp, fsdp2, json.loads((checkpoint / "model_index.json").read_text())["boundary_ratio"]


def test_a14b_under_fsdp2_trains_as_ddp(runs):
    ddp, fsdp2, boundary = runs
    used = set()
    for step in range(1, STEPS + 1):
        # One row per step and rank: sigma per draw (num_train_timesteps: 1), per sample.
        sigmas = [s for rank in (0, 1) for r in rows(fsdp2, rank) if r["step"] == step for s in r["sigma"][0]]
        routes = {s >= boundary for s in sigmas}
        assert len(sigmas) == 4 and len(routes) == 1, (step, sigmas)  # both ranks ran one expert
        used |= routes
    assert used == {True, False}  # both experts trained
    for rank in (0, 1):
        assert_same_run(rows(fsdp2, rank), rows(ddp, rank))
        sharded, whole = report(fsdp2, rank), report(ddp, rank)
        assert sharded["trained_total"] == whole["trained_total"] == whole["trained_local"]
        assert sharded["trained_local"] == pytest.approx(whole["trained_total"] / 2, rel=0.05)
        assert sharded["unsharded"] == 0
    got, want = weights(fsdp2), weights(ddp)
    assert set(got) == set(want) and any("transformer_2" in k for k in want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-6, msg=key)


def grpo(checkpoint, prompts, root, strategy: str) -> dict:
    """Wan's GRPO recipe on the two-expert checkpoint, 2 steps on 2 ranks: a 3-step schedule whose SDE window (its
    first two steps, at sigma 1 and 0.857 with shift 3) spans both experts (boundary 0.875)."""
    root.mkdir()
    callbacks = [{"class_path": "tests.test_grpo_sharded.Record", "init_args": {"dirpath": str(root / "out")}}]
    return {root: launch(root, [
        "--config", str(REPO / "configs" / "wan" / "grpo_tiny.yaml"),
        "--model.pretrained_model_name_or_path", str(checkpoint),
        "--model.objective.init_args.num_steps", "3", "--model.objective.init_args.sampler",
        json.dumps({"kind": "flow_sde", "eta": 0.7, "window": [0, 2], "num_sde_steps": None}),
        "--model.objective.init_args.prompts_per_step", "2", "--model.objective.init_args.group_size", "2",
        "--model.objective.init_args.micro_batch_size", "1",
        "--data.datasets", json.dumps([{"name": "prompts", "dataset_dir": str(prompts)}]),
        "--trainer.strategy", strategy, "--trainer.devices", "2", "--trainer.max_steps", "2",
        "--trainer.limit_val_batches", "0", "--trainer.default_root_dir", str(root), "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.callbacks", json.dumps(callbacks),
    ])}  # fmt: skip


def test_a14b_grpo_under_fsdp2_equals_ddp(tiny_wan, tmp_path):
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "train.txt").write_text("a circle\na square\n")
    checkpoint = tiny_wan("t2v_a14b")
    wait({**grpo(checkpoint, prompts, tmp_path / "D", "ddp"), **grpo(checkpoint, prompts, tmp_path / "F", FSDP2)})
    ddp, fsdp2 = out(tmp_path / "D"), out(tmp_path / "F")
    assert fsdp2[0]["policy_sharded"] and not ddp[0]["policy_sharded"]
    for rank in (0, 1):
        assert [s["step"] for s in ddp[rank]["steps"]] == [1, 2]
        same_steps(ddp[rank]["steps"], fsdp2[rank]["steps"])
        # atol 1e-5 (lr 1e-3: each step moves a weight ~1e-3): AdamW's first steps divide each gradient entry by its
        # own size, so an entry near eps turns the reduce-scatter's rounding into ~1e-6 (seen on one LoRA entry).
        for name, w in ddp[rank]["weights"].items():
            torch.testing.assert_close(fsdp2[rank]["weights"][name], w, rtol=1e-4, atol=1e-5, msg=name)
    trained = ddp[0]["weights"]
    assert {n.split(".")[1] for n in trained} >= {"transformer", "transformer_2"}, sorted(trained)[:4]
