"""Flow-GRPO's conventions against transcriptions of the reference trainers (issue 23, items 9-14), on the toy
adapter of tests/objectives/test_grpo.py (a real ``nn.Linear`` velocity, not a mock of the maths under test):

* the KL term's scale (flow_grpo scripts/train_sd3.py ``kl_loss``; scripts/train_wan2_1.py for the exact one),
* the default SDE window (Flow-Factory src/flow_factory/hparams/args.py ``_resolve_scheduler_sde_defaults``),
* tied groups' advantages and ``zero_std_ratio`` (flow_grpo/stat_tracking.py ``PerPromptStatTracker``,
  scripts/train_sd3.py ``calculate_zero_std_ratio`` and its zero-advantage filter), also across two ranks,
* CPS log-probabilities (IamCreateAI/FlowCPS flow_grpo/diffusers_patch/sd3_sde_with_logprob.py),
* the gradient of the guided velocity in replays (flow_grpo scripts/train_sd3.py ``compute_log_prob``).

The ``flow_grpo_*`` helpers below transcribe the references' formulas (tensors, per-sample sigmas, element means)
and never call ff's sampling code.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from ff_core.objectives.grpo import UpdateStats
from ff_core.objectives.grpo_loss import group_advantages, zero_std_ratio
from ff_core.rewards.base import Reward
from ff_core.sampling import StochasticSampling, sample_sde
from tests.objectives.test_grpo import Host, ToyAdapter, ToyVideoAudio, batch, objective


# -- transcriptions of the references ---------------------------------------------------------------------------------
def flow_grpo_step(sample, model_output, sigma, sigma_prev, sigma_max, noise_level, prev_sample, sde_type="sde"):
    """flow_grpo/diffusers_patch/sd3_sde_with_logprob.py, ``sde_step_with_logprob`` with ``prev_sample`` given:
    returns (log_prob, prev_sample_mean, std_dev_t, sqrt(-dt)). ``sde_type='cps'`` is FlowCPS's step."""
    model_output, sample, prev_sample = model_output.float(), sample.float(), prev_sample.float()
    shape = (-1, *([1] * (sample.ndim - 1)))
    sigma = torch.full((sample.shape[0],), sigma, dtype=torch.float32).view(shape)
    sigma_prev = torch.full((sample.shape[0],), sigma_prev, dtype=torch.float32).view(shape)
    dt = sigma_prev - sigma
    if sde_type == "sde":
        std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
        prev_sample_mean = (sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
                            + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt)  # fmt: skip
        log_prob = (-((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
                    - torch.log(std_dev_t * torch.sqrt(-1 * dt)) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    else:  # cps
        std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)
        pred_original_sample = sample - sigma * model_output
        noise_estimate = sample + model_output * (1 - sigma)
        prev_sample_mean = pred_original_sample * (1 - sigma_prev) + noise_estimate * torch.sqrt(
            sigma_prev**2 - std_dev_t**2)
        log_prob = -((prev_sample.detach() - prev_sample_mean) ** 2)  # "remove all constants"
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return log_prob, prev_sample_mean, std_dev_t, torch.sqrt(-1 * dt)


def flow_grpo_kl(mean, mean_ref, std_dev_t):
    """scripts/train_sd3.py (and train_flux.py): ``((mean - mean_ref) ** 2).mean(dims) / (2 * std_dev_t ** 2)``,
    per sample (before its batch mean)."""
    dims = tuple(range(1, mean.ndim))
    return (((mean - mean_ref) ** 2).mean(dim=dims, keepdim=True) / (2 * std_dev_t**2)).flatten()


def flow_grpo_advantages(prompts, rewards, global_std=False):
    """flow_grpo/stat_tracking.py, ``PerPromptStatTracker.update(..., type='grpo')`` for one step (fresh tracker)."""
    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    advantages = np.empty_like(rewards) * 0.0
    for prompt in np.unique(prompts):
        prompt_rewards = rewards[prompts == prompt]
        mean = np.mean(prompt_rewards, axis=0, keepdims=True)
        std = (np.std(rewards, axis=0, keepdims=True) if global_std else np.std(prompt_rewards, axis=0, keepdims=True)
               ) + 1e-4  # fmt: skip
        advantages[prompts == prompt] = (prompt_rewards - mean) / std
    return advantages


def flow_grpo_zero_std_ratio(prompts, rewards):
    """scripts/train_sd3.py, ``calculate_zero_std_ratio`` (its first return value)."""
    _, inverse, counts = np.unique(np.array(prompts), return_inverse=True, return_counts=True)
    grouped = np.asarray(rewards)[np.argsort(inverse)]
    groups = np.split(grouped, np.cumsum(counts)[:-1])
    stds = np.array([np.std(g) for g in groups])
    return np.count_nonzero(stds == 0) / len(stds)


def flow_grpo_policy_loss(log_prob, old_log_prob, advantages, clip_range, adv_clip_max):
    """scripts/train_sd3.py: the clipped surrogate, ``torch.mean`` over the (kept) batch."""
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.mean(torch.maximum(unclipped_loss, clipped_loss))


# -- helpers ----------------------------------------------------------------------------------------------------------
class MetadataReward(Reward):
    """The reward a row's metadata names (``metadata["r"]``): rewards set by the test, whatever was sampled."""

    name = "metadata_reward"

    def __call__(self, batch):
        return torch.tensor([float(m["r"]) for m in batch.metadata])


class GuidedToy(ToyAdapter):
    """The toy adapter with a CFG branch: the unconditional condition is a zero vector."""

    def unconditional(self, condition):
        return {"c": torch.zeros_like(condition["c"])}


def velocity(adapter, state, sigma, condition):
    return adapter.velocity(state, torch.full((state.batch_size,), sigma), condition).components["latent"]


def moved_policy(adapter, obj, seed=1):
    """A rollout of the untrained toy policy (the reference: a frozen copy), then the weights moved a little."""
    adapter.requires_grad_(True)
    obj.configure_model(adapter, lora=False)
    rollouts = obj.rollout(adapter, batch(), torch.Generator().manual_seed(seed))
    old = {k: v.detach().clone() for k, v in adapter.net.state_dict().items()}
    with torch.no_grad():
        step = torch.randn(adapter.net.weight.shape, generator=torch.Generator().manual_seed(3))
        adapter.net.weight.add_(0.05 * step)
    return rollouts, old


# -- item 9: the KL term's scale ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kl_scale", [None, "flow_grpo", "exact_gaussian"])
@pytest.mark.parametrize("step", [0, 2])  # step 0 starts at sigma = 1: 1 - sigma taken at sigma_max
def test_kl_on_the_step_means_is_flow_grpos_kl_loss_by_default(kl_scale, step):
    """``kl_on: mean``: by default flow_grpo's SD3 ``kl_loss``, ``|mu - mu_ref|^2 / (2 std_dev_t^2)`` with
    ``std_dev_t = eta sqrt(sigma / (1 - sigma))`` (no ``sqrt(|dt|)``); ``kl_scale: exact_gaussian`` divides by the
    step's variance ``(std_dev_t sqrt(|dt|))^2``, flow_grpo's Wan2.1 ``kl_loss``: ``1 / |dt|`` times the default."""
    extra = {} if kl_scale is None else {"kl_scale": kl_scale}
    adapter, obj = ToyAdapter(), objective(kl_beta=0.5, **extra)
    rollouts, old = moved_policy(adapter, obj)
    r, t = rollouts[0], rollouts[0].trajectory.transitions[step]
    r.advantages = torch.tensor([1.0, -1.0])
    stats = UpdateStats()
    obj.transition_loss(adapter, r, t, stats)
    x, nxt = t.state.components["latent"], t.next.components["latent"]
    with torch.no_grad():
        v = velocity(adapter, t.state, t.sigma, r.condition)
        ref = ToyAdapter()
        ref.net.load_state_dict(old)
        v_ref = velocity(ref, t.state, t.sigma, r.condition)
    sigma_max = r.trajectory.sigma_max["latent"]
    _, mean, std_dev_t, sqrt_dt = flow_grpo_step(x, v, t.sigma, t.sigma_next, sigma_max, 0.7, nxt)
    _, mean_ref, _, _ = flow_grpo_step(x, v_ref, t.sigma, t.sigma_next, sigma_max, 0.7, nxt)
    expected = flow_grpo_kl(mean, mean_ref, std_dev_t if kl_scale != "exact_gaussian" else std_dev_t * sqrt_dt)
    assert expected.abs().min() > 0  # the policy moved
    assert_close(stats.kl[0], expected)


def test_kl_of_cps_steps_is_the_gaussian_kl_under_both_scales():
    """flow_grpo's ``std_dev_t`` of a CPS step is the step's std (``sigma_next sin(eta pi / 2)``): both scales give
    its ``kl_loss``."""
    kls = []
    for kl_scale in ("flow_grpo", "exact_gaussian"):
        adapter, obj = ToyAdapter(), objective(kl_beta=0.5, kl_scale=kl_scale,
                                               sampler=StochasticSampling(kind="cps", window=(0, 3)))  # fmt: skip
        rollouts, old = moved_policy(adapter, obj)
        r, t = rollouts[0], rollouts[0].trajectory.transitions[1]
        r.advantages = torch.zeros(2)
        stats = UpdateStats()
        obj.transition_loss(adapter, r, t, stats)
        x, nxt = t.state.components["latent"], t.next.components["latent"]
        with torch.no_grad():
            ref = ToyAdapter()
            ref.net.load_state_dict(old)
            _, mean, std_dev_t, _ = flow_grpo_step(x, velocity(adapter, t.state, t.sigma, r.condition), t.sigma,
                                                   t.sigma_next, None, 0.7, nxt, "cps")  # fmt: skip
            _, mean_ref, _, _ = flow_grpo_step(x, velocity(ref, t.state, t.sigma, r.condition), t.sigma,
                                               t.sigma_next, None, 0.7, nxt, "cps")  # fmt: skip
        assert_close(stats.kl[0], flow_grpo_kl(mean, mean_ref, std_dev_t))
        kls.append(stats.kl[0])
    assert_close(kls[0], kls[1])


# -- item 10: the default SDE window -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["flow_sde", "cps"])
def test_default_window_is_every_step_but_the_last(kind):
    """Flow-Factory's ``sde_steps: null`` resolves to ``list(range(max(0, num_inference_steps - 1)))``; flow_grpo's
    SD3 recipes train the first ``int(10 * 0.99) = 9`` of 10 steps."""
    for num_steps in (2, 3, 10, 40):
        assert StochasticSampling(kind=kind).candidate_steps(num_steps) == list(range(max(0, num_steps - 1)))
    assert len(StochasticSampling().candidate_steps(10)) == int(10 * 0.99)
    assert StochasticSampling(window=(0, 10)).candidate_steps(10) == list(range(10))  # the old default, by window
    with pytest.raises(ValueError, match=r"model.objective.sampler.window: the default window .* 1-step schedule"):
        StochasticSampling().candidate_steps(1)


def test_default_rollout_ends_with_an_euler_step_onto_clean_latents():
    """The last step, onto sigma = 0, is an ODE step: the final latents are the last transition's sample moved by
    ``x + (0 - sigma) v`` (diffusers' FlowMatchEulerDiscreteScheduler.step), no noise added."""
    adapter, cond = ToyAdapter(), {"c": torch.tensor([[0.0, 1], [1, 0]])}
    with torch.no_grad():
        traj = sample_sde(adapter, cond, StochasticSampling(), num_steps=4, generator=torch.Generator().manual_seed(0))
        assert [t.step for t in traj.transitions] == [0, 1, 2]
        last = traj.transitions[-1]
        x = last.next.components["latent"]
        expected = x + (0.0 - last.sigma_next) * velocity(adapter, last.next, last.sigma_next, cond)
    assert_close(traj.final.components["latent"], expected)


# -- item 11: tied groups ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("group_size", [8, 24])
@pytest.mark.parametrize("global_std", [False, True])
def test_tied_groups_get_exactly_zero_advantage(group_size, global_std):
    """Rewards at JPEG-kB scales (22.37, -58.1), fp32 as rewards return them: flow_grpo's float64 tracker gives a
    tied group exactly 0 (fp32 arithmetic left rounding residue / 1e-4, up to 0.1, one sign per group); the others
    match the tracker."""
    spread = torch.linspace(-3.0, 4.0, group_size)
    rewards = torch.cat([torch.full((group_size,), 22.37), torch.full((group_size,), -58.1), 10 + spread])
    groups = torch.arange(3).repeat_interleave(group_size)
    prompts = [f"p{int(g)}" for g in groups]
    adv = group_advantages(rewards, groups, global_std)
    assert adv.dtype == torch.float32
    assert (adv[: 2 * group_size] == 0).all()
    expected = flow_grpo_advantages(prompts, rewards.numpy(), global_std)
    assert (expected[: 2 * group_size] == 0).all()
    assert_close(adv, torch.from_numpy(expected).float())


# -- item 12: zero-std groups, logged over every rank and filtered from the update ------------------------------------
def meta_batch(rewards, groups):
    b = batch()
    b["metadata"], b["group"] = [{"r": r} for r in rewards], torch.tensor(groups)
    return b


def meta_objective(**kwargs):
    return objective(rewards=[{"name": "tests.objectives.test_grpo_conventions:MetadataReward", "label": "m"}],
                     **kwargs)  # fmt: skip


class TwoRankHost(Host):
    """Rank 0 of two data-parallel ranks: ``all_gather`` stacks this rank's tensor with rank 1's (given), as
    Lightning's ``all_gather`` does; ``_trainer`` is what ``GRPOObjective.score`` reads of the trainer."""

    def __init__(self, adapter, other_groups, other_rewards):
        super().__init__(adapter)
        self._trainer = SimpleNamespace(world_size=2, global_rank=0, is_global_zero=True)
        self.other = {torch.long: torch.tensor(other_groups), torch.float32: torch.tensor(other_rewards)}

    def all_gather(self, x):
        return torch.stack([x, self.other[x.dtype].to(x)])


def test_zero_std_ratio_counts_the_groups_of_every_rank():
    """Group 0's samples on rank 0 are tied (3, 3) but rank 1's are not (3, 5): over the step it has a spread; group
    1 is tied on both ranks. ``zero_std_ratio`` = 1/2 = flow_grpo's ``calculate_zero_std_ratio`` over the gathered
    rewards (rank 0 alone would say 1), and the advantages are the gathered tracker's with flow_grpo's default
    ``global_std: True`` (config/base.py), ff's default too."""
    adapter, obj = ToyAdapter(), meta_objective()
    host = TwoRankHost(adapter, other_groups=[0, 0, 1, 1], other_rewards=[3.0, 5.0, 2.0, 2.0])
    b = meta_batch([3.0, 3.0, 2.0, 2.0], [0, 0, 1, 1])
    rollouts = obj.rollout(adapter, b, torch.Generator().manual_seed(0))
    metrics = obj.score(adapter, host, b, rollouts)
    prompts, rewards = ["a", "a", "b", "b"] * 2, [3.0, 3.0, 2.0, 2.0, 3.0, 5.0, 2.0, 2.0]
    assert metrics["zero_std_ratio"] == flow_grpo_zero_std_ratio(prompts, rewards) == 0.5
    expected = torch.from_numpy(flow_grpo_advantages(prompts, rewards, global_std=True)[:4]).float()
    assert_close(torch.cat([r.advantages for r in rollouts]), expected)
    assert rollouts[0].keep is None and rollouts[1].keep.tolist() == [False, False]  # group 1 leaves the update
    assert zero_std_ratio(torch.tensor(rewards[:4]), torch.tensor([0, 0, 1, 1])) == 1.0  # what one rank would log


class RecordingSGD(torch.optim.SGD):
    """SGD that records each step's gradients (``None`` where a parameter has none)."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.seen = []

    def step(self, closure=None):
        self.seen.append([None if p.grad is None else p.grad.clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


@pytest.mark.parametrize("filter_zero_std", [True, False])
def test_filtered_update_is_flow_grpos_loss_over_the_kept_samples(filter_zero_std):
    """Group 0 rewards (1, 2), group 1 (5, 5), tied. flow_grpo drops the samples with zero advantage and averages its
    clipped surrogate over the rest, accumulating over the trained timesteps (accelerate divides by their number):
    the gradient is that of ``mean_j mean_{kept i} max(-A r, -A clip(r))``; ``filter_zero_std: false`` keeps the tied
    samples at advantage 0 in the mean (half the gradient here)."""
    adapter, obj = ToyAdapter(), meta_objective(filter_zero_std=filter_zero_std)
    host = Host(adapter)
    host.optimizer = RecordingSGD(adapter.net.parameters(), lr=0.0)
    b = meta_batch([1.0, 2.0, 5.0, 5.0], [0, 0, 1, 1])
    obj.training_step(host, b, torch.Generator().manual_seed(4))
    assert host.logged["train/zero_std_ratio"] == 0.5
    # The reference: rebuild the same rollout, then flow_grpo's loss on the samples it keeps.
    ref_obj = meta_objective()
    rollouts = ref_obj.rollout(adapter, b, torch.Generator().manual_seed(4))
    adv = torch.from_numpy(flow_grpo_advantages(["a", "a", "b", "b"], [1.0, 2.0, 5.0, 5.0], global_std=True)).float()
    keep = adv != 0 if filter_zero_std else torch.ones(4, dtype=torch.bool)
    samples = [(r, i) for r in rollouts for i in range(2) if keep[r.rows.start + i]]
    adapter.net.zero_grad()
    transitions = rollouts[0].trajectory.transitions
    for j in range(len(transitions)):
        log_probs, olds = [], []
        for r, i in samples:
            t = r.trajectory.transitions[j]
            v = velocity(adapter, t.state, t.sigma, r.condition)
            lp, _, _, _ = flow_grpo_step(t.state.components["latent"], v, t.sigma, t.sigma_next,
                                         r.trajectory.sigma_max["latent"], 0.7, t.next.components["latent"])
            log_probs.append(lp[i])
            olds.append(t.log_prob[i])
        a = torch.stack([adv[r.rows.start + i] for r, i in samples])
        loss = flow_grpo_policy_loss(torch.stack(log_probs), torch.stack(olds), a, obj.clip_range, obj.adv_clip_max)
        (loss / len(transitions)).backward()
    [grads] = host.optimizer.seen
    assert_close(grads[0], adapter.net.weight.grad, rtol=1e-4, atol=1e-7)
    assert_close(grads[1], adapter.net.bias.grad, rtol=1e-4, atol=1e-7)


def test_a_step_with_every_group_tied_leaves_the_weights_and_optimiser_alone():
    """Nothing to learn: no replay, no gradient; the optimiser step (counted by Lightning) updates nothing, also with
    momentum and weight decay."""
    adapter, obj = ToyAdapter(), meta_objective()
    host = Host(adapter)
    host.optimizer = torch.optim.AdamW(adapter.net.parameters(), lr=1e-2, weight_decay=0.1)
    before = {k: v.clone() for k, v in adapter.net.state_dict().items()}
    obj.training_step(host, meta_batch([1.0, 1.0, 7.0, 7.0], [0, 0, 1, 1]), torch.Generator().manual_seed(0))
    assert host.logged["train/zero_std_ratio"] == 1.0
    for k, v in adapter.net.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not host.optimizer.state  # AdamW never saw a gradient


# -- item 13: CPS log-probabilities ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cps_log_prob", [None, "flow_cps", "gaussian"])
def test_cps_log_prob_is_flowcps_by_default(cps_log_prob):
    """A CPS rollout's stored log-prob is FlowCPS's ``-mean (x' - mu)^2`` by default; ``cps_log_prob: gaussian`` the
    normalised Gaussian density's element mean, whose log-ratios are ``1 / (2 s^2)`` times FlowCPS's."""
    extra = {} if cps_log_prob is None else {"cps_log_prob": cps_log_prob}
    adapter, cond = ToyAdapter(), {"c": torch.tensor([[0.0, 1], [1, 0]])}
    with torch.no_grad():
        traj = sample_sde(adapter, cond, StochasticSampling(kind="cps", **extra), num_steps=4,
                          generator=torch.Generator().manual_seed(0))  # fmt: skip
        for t in traj.transitions:
            v = velocity(adapter, t.state, t.sigma, cond)
            x, nxt = t.state.components["latent"], t.next.components["latent"]
            flow_cps, mean, std, _ = flow_grpo_step(x, v, t.sigma, t.sigma_next, None, 0.7, nxt, "cps")
            if cps_log_prob == "gaussian":
                expected = torch.distributions.Normal(mean, std.flatten()[0]).log_prob(nxt).flatten(1).mean(1)
            else:
                expected = flow_cps
            assert_close(t.log_prob, expected)


def test_cps_replay_with_the_flowcps_log_prob_starts_at_ratio_one():
    adapter, obj = ToyAdapter(), objective(sampler=StochasticSampling(kind="cps", window=(0, 3)))
    host = Host(adapter)
    obj.training_step(host, batch(), torch.Generator().manual_seed(0))
    assert host.logged["train/ratio_first_max_dev"] == 0


# -- item 14: CFG in replays -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg_replay", [None, "full", "detached_uncond"])
def test_replay_gradient_through_the_guided_velocity(cfg_replay):
    """``full`` (default): flow_grpo's ``compute_log_prob`` with ``train.cfg``, ``uncond + s (text - uncond)``, the
    gradient through both branches; ``detached_uncond``: the unconditional prediction detached, so only the
    conditional branch carries the gradient. The first replayed ratio is exactly 1 either way."""
    extra = {} if cfg_replay is None else {"cfg_replay": cfg_replay}
    adapter, obj = GuidedToy(), objective(guidance_scale=3.0, **extra)
    adapter.requires_grad_(True)
    rollouts = obj.rollout(adapter, batch(), torch.Generator().manual_seed(0))
    r, t = rollouts[0], rollouts[0].trajectory.transitions[1]
    r.advantages = torch.tensor([1.0, -0.5])
    stats = UpdateStats()
    adapter.net.zero_grad()
    obj.transition_loss(adapter, r, t, stats).backward()
    assert stats.first_ratio.eq(1).all()
    got = adapter.net.weight.grad.clone()

    adapter.net.zero_grad()
    sigmas = torch.full((2,), t.sigma)
    text = adapter.velocity(t.state, sigmas, r.condition).components["latent"]
    uncond = adapter.velocity(t.state, sigmas, r.negative).components["latent"]
    if cfg_replay == "detached_uncond":
        uncond = uncond.detach()
    noise_pred = uncond + 3.0 * (text - uncond)
    lp, _, _, _ = flow_grpo_step(t.state.components["latent"], noise_pred, t.sigma, t.sigma_next,
                                 r.trajectory.sigma_max["latent"], 0.7, t.next.components["latent"])
    flow_grpo_policy_loss(lp, t.log_prob, r.advantages, obj.clip_range, obj.adv_clip_max).backward()
    assert_close(got, adapter.net.weight.grad)
    if cfg_replay == "detached_uncond":  # the other convention's gradient differs
        adapter.net.zero_grad()
        full = objective(guidance_scale=3.0)
        full.transition_loss(adapter, r, t, UpdateStats()).backward()
        assert not torch.allclose(got, adapter.net.weight.grad)


def test_bad_convention_names_name_the_key():
    for key in ("kl_scale", "cfg_replay"):
        with pytest.raises(ValueError, match=f"model.objective.{key} must be one of"):
            objective(**{key: "other"})
    with pytest.raises(ValueError, match="model.objective.sampler.cps_log_prob must be one of"):
        StochasticSampling(kind="cps", cps_log_prob="other")


class OwnSchedules(ToyVideoAudio):
    """Video + audio with the audio on its own, shifted schedule (as MiniMax H3's audio, shift 3)."""

    def sampling_schedules(self, state, num_steps, shift=None):
        s = torch.linspace(1.0, 0.0, num_steps + 1)
        return {"video": s, "audio": 3 * s / (1 + 2 * s)}


@pytest.mark.parametrize("kl_scale", ["flow_grpo", "exact_gaussian"])
def test_kl_of_components_on_their_own_schedules_uses_each_ones_scale(kl_scale):
    """Per component ``k`` at its own (sigma_k, sigma_k'), flow_grpo's ``kl_loss`` of that component (its own
    ``std_dev_t``, the sigma = 1 step with its own sigma_max), then ``sum_k w_k kl_k`` as the log-prob reduces."""
    adapter, obj = OwnSchedules(), objective(kl_beta=0.5, kl_scale=kl_scale)
    rollouts, old = moved_policy(adapter, obj)
    r = rollouts[0]
    r.advantages = torch.zeros(2)
    ref = OwnSchedules()
    ref.net.load_state_dict(old)
    for step in (0, 2):
        t = r.trajectory.transitions[step]
        stats = UpdateStats()
        obj.transition_loss(adapter, r, t, stats)
        with torch.no_grad():
            levels = {k: torch.full((2,), s) for k, (s, _) in t.levels.items()}
            v = adapter.component_velocity(t.state, levels, r.condition).components
            v_ref = ref.component_velocity(t.state, levels, r.condition).components
        expected = 0
        for name, (sigma, sigma_next) in t.levels.items():
            x, nxt, sigma_max = t.state.components[name], t.next.components[name], r.trajectory.sigma_max[name]
            _, mean, std_dev_t, sqrt_dt = flow_grpo_step(x, v[name], sigma, sigma_next, sigma_max, 0.7, nxt)
            _, mean_ref, _, _ = flow_grpo_step(x, v_ref[name], sigma, sigma_next, sigma_max, 0.7, nxt)
            scale = std_dev_t if kl_scale == "flow_grpo" else std_dev_t * sqrt_dt
            expected = expected + 1.0 * flow_grpo_kl(mean, mean_ref, scale)  # default weights {video: 1, audio: 1}
        assert t.levels["video"] != t.levels["audio"]
        assert_close(stats.kl[0], expected)
