"""DiffusionNFT's maths against transcriptions of its official trainer (NVlabs/DiffusionNFT,
scripts/train_nft_sd3.py) and GDPO's against Flow-Factory's (src/flow_factory/advantage/advantage_processor.py)."""

import numpy as np
import pytest
import torch

from ff_core.objectives import NFTObjective
from ff_core.objectives.advantages import gdpo_advantages, group_advantages
from ff_core.objectives.nft_loss import nft_policy_loss, old_policy_decay, optimality_probability


def official_nft_loss(forward_prediction, old_prediction, x0, xt, t, advantages, beta, adv_clip_max):
    """scripts/train_nft_sd3.py, the policy loss of one timestep, transcribed (adv_mode "all")."""
    t_expanded = t.view(-1, *([1] * (len(x0.shape) - 1)))
    advantages_clip = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    normalized_advantages_clip = (advantages_clip / adv_clip_max) / 2.0 + 0.5
    r = torch.clamp(normalized_advantages_clip, 0, 1)
    positive_prediction = beta * forward_prediction + (1 - beta) * old_prediction.detach()
    implicit_negative_prediction = (1.0 + beta) * old_prediction.detach() - beta * forward_prediction
    x0_prediction = xt - t_expanded * positive_prediction
    with torch.no_grad():
        weight_factor = (torch.abs(x0_prediction.double() - x0.double())
                         .mean(dim=tuple(range(1, x0.ndim)), keepdim=True).clip(min=0.00001))
    positive_loss = ((x0_prediction - x0) ** 2 / weight_factor).mean(dim=tuple(range(1, x0.ndim)))
    negative_x0_prediction = xt - t_expanded * implicit_negative_prediction
    with torch.no_grad():
        negative_weight_factor = (torch.abs(negative_x0_prediction.double() - x0.double())
                                  .mean(dim=tuple(range(1, x0.ndim)), keepdim=True).clip(min=0.00001))
    negative_loss = ((negative_x0_prediction - x0) ** 2 / negative_weight_factor).mean(dim=tuple(range(1, x0.ndim)))
    ori_policy_loss = r * positive_loss / beta + (1.0 - r) * negative_loss / beta
    return ori_policy_loss * adv_clip_max  # per sample; the official mean()s it


def official_return_decay(step, decay_type):
    """scripts/train_nft_sd3.py, return_decay, transcribed."""
    if decay_type == 0:
        flat, uprate, uphold = 0, 0.0, 0.0
    elif decay_type == 1:
        flat, uprate, uphold = 0, 0.001, 0.5
    elif decay_type == 2:
        flat, uprate, uphold = 75, 0.0075, 0.999
    if step < flat:
        return 0.0
    return min((step - flat) * uprate, uphold)


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_policy_loss_and_gradient_equal_the_official_trainer(beta):
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(4, 3, 5, 6, generator=g)
    noise = torch.randn(4, 3, 5, 6, generator=g)
    t = torch.tensor([0.9, 0.5, 0.2, 0.7])
    xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
    old = torch.randn(4, 3, 5, 6, generator=g)
    advantages = torch.tensor([7.0, 1.3, -0.4, -6.0])  # clipped at both ends
    v_ref = (old + 0.1 * torch.randn(4, 3, 5, 6, generator=g)).requires_grad_(True)
    v_ours = v_ref.detach().clone().requires_grad_(True)
    want = official_nft_loss(v_ref, old, x0, xt, t, advantages, beta, 5.0)
    r = optimality_probability(advantages, 5.0)
    got = nft_policy_loss({"x": v_ours}, {"x": old}, {"x": xt}, {"x": x0}, {"x": t}, r, beta, 5.0).loss
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)
    want.mean().backward()
    got.mean().backward()
    torch.testing.assert_close(v_ours.grad, v_ref.grad, rtol=1e-5, atol=1e-7)


def test_masked_elements_leave_the_loss_and_its_weight():
    """A pinned condition frame (mask 0) is not part of the sample: the loss equals the loss of the unmasked part."""
    g = torch.Generator().manual_seed(1)
    x0, xt, v, old = (torch.randn(2, 4, 3, 3, generator=g) for _ in range(4))
    mask = torch.ones(2, 4, 3, 3)
    mask[:, 0] = 0
    t, r = torch.tensor([0.5, 0.3]), torch.tensor([0.9, 0.2])
    masked = nft_policy_loss({"x": v}, {"x": old}, {"x": xt}, {"x": x0}, {"x": t}, r, 1.0, 5.0, {"x": mask}).loss
    part = nft_policy_loss({"x": v[:, 1:]}, {"x": old[:, 1:]}, {"x": xt[:, 1:]}, {"x": x0[:, 1:]}, {"x": t}, r,
                           1.0, 5.0).loss  # fmt: skip
    torch.testing.assert_close(masked, part)


def test_a_better_sample_pulls_the_policy_towards_it():
    """At v = v_old, one gradient step on a sample with r = 1 lowers the x0 error of the trained velocity, one with
    r = 0 raises it: the update goes towards good samples and away from bad ones."""
    g = torch.Generator().manual_seed(2)
    x0, noise, old = (torch.randn(1, 8, generator=g) for _ in range(3))
    t = torch.tensor([0.6])
    xt = (1 - t) * x0 + t * noise
    for r, sign in ((torch.ones(1), -1), (torch.zeros(1), 1)):
        v = old.clone().requires_grad_(True)
        nft_policy_loss({"x": v}, {"x": old}, {"x": xt}, {"x": x0}, {"x": t}, r, 1.0, 5.0).loss.sum().backward()
        error = lambda u: ((xt - t * u - x0) ** 2).mean()  # noqa: E731
        assert sign * (error(old - 1e-3 * v.grad) - error(old)) > 0


@pytest.mark.parametrize("decay_type, args", [(0, (0, 0.0, 0.0)), (1, (0, 0.001, 0.5)), (2, (75, 0.0075, 0.999))])
def test_old_policy_decay_equals_the_official_schedules(decay_type, args):
    for step in (0, 1, 10, 74, 75, 76, 200, 499, 500, 1000, 5000):
        assert old_policy_decay(step, *args) == pytest.approx(official_return_decay(step, decay_type))


def test_optimality_probability_modes():
    a = torch.tensor([-7.0, -2.5, 0.0, 2.5, 7.0])
    torch.testing.assert_close(optimality_probability(a, 5.0), torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]))
    p = lambda mode: optimality_probability(a, 5.0, mode)  # noqa: E731
    torch.testing.assert_close(p("positive_only"), torch.tensor([0.5, 0.5, 0.5, 0.75, 1.0]))
    torch.testing.assert_close(p("negative_only"), torch.tensor([0.0, 0.25, 0.5, 0.5, 0.5]))
    torch.testing.assert_close(optimality_probability(a, 5.0, "binary"), torch.tensor([0.4, 0.4, 0.5, 0.6, 0.6]))
    with pytest.raises(ValueError, match="adv_mode"):
        optimality_probability(a, 5.0, "sometimes")


def flow_factory_gdpo(rewards: dict, weights: dict, group_indices: np.ndarray) -> np.ndarray:
    """Flow-Factory's AdvantageProcessor.compute_gdpo on gathered rewards, transcribed."""
    all_reward_advantages = []
    for key, reward_array in rewards.items():
        reward_adv = np.zeros_like(reward_array, dtype=np.float64)
        for group_id in np.unique(group_indices):
            mask = group_indices == group_id
            group_rewards = reward_array[mask]
            mean = np.mean(group_rewards)
            std = max(np.std(group_rewards), 1e-6)
            reward_adv[mask] = (group_rewards - mean) / std
        all_reward_advantages.append(reward_adv * weights[key])
    combined_advantages = np.sum(all_reward_advantages, axis=0)
    mean, std = float(np.mean(combined_advantages)), max(float(np.std(combined_advantages)), 1e-6)
    return (combined_advantages - mean) / std


def test_gdpo_equals_flow_factory_and_keeps_a_small_reward_heard():
    """Each reward normalised in its group, weighted, summed and batch-normalised, as Flow-Factory's; a reward on a
    scale 1000x smaller still moves the ranking, where the weighted sum lets the large one decide alone."""
    g = torch.Generator().manual_seed(3)
    groups = torch.arange(4).repeat_interleave(4)
    big = torch.randn(16, generator=g) * 1000  # e.g. JPEG bytes
    small = torch.rand(16, generator=g)  # e.g. an aesthetic score in [0, 1]
    weights = {"big": 1.0, "small": 1.0}
    got = gdpo_advantages({"big": big, "small": small}, weights, groups)
    want = flow_factory_gdpo({"big": big.double().numpy(), "small": small.double().numpy()}, weights, groups.numpy())
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    summed = group_advantages(big + small, groups, global_std=True)
    only_big = group_advantages(big, groups, global_std=True)
    torch.testing.assert_close(summed, only_big, rtol=1e-3, atol=1e-3)  # the small reward is drowned
    assert (got - gdpo_advantages({"big": big, "small": small}, {"big": 1.0, "small": 0.0}, groups)).abs().max() > 0.3


def test_gdpo_leaves_groups_tied_in_every_reward_at_zero():
    groups = torch.tensor([0, 0, 1, 1])
    a = gdpo_advantages({"x": torch.tensor([1.0, 1.0, 0.0, 2.0]), "y": torch.tensor([0.3, 0.3, 0.1, 0.5])},
                        {"x": 1.0, "y": 2.0}, groups)  # fmt: skip
    assert a[0] == 0 and a[1] == 0 and a[2] < 0 < a[3]


def test_settings_are_checked():
    rewards = [{"name": "colour"}]
    for bad in ({"nft_beta": 0}, {"timestep_fraction": 0}, {"decay_max": 1.0}, {"adv_mode": "x"},
                {"reward_aggregation": "mean"}, {"group_size": 1}):
        with pytest.raises(ValueError):
            NFTObjective(rewards, **bad)
    assert NFTObjective(rewards, num_steps=10).train_timesteps == 9  # the official 0.99 of 10 steps
    assert NFTObjective(rewards, num_steps=10, timestep_fraction=0.5).train_timesteps == 5
