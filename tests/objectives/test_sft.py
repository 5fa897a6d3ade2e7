"""SFT loss against hand computations on fixed tensors (STYLE 6)."""

import torch
from torch.testing import assert_close

from ff_core.adapter import LatentState
from ff_core.objectives import SFTObjective, TimestepSampler
from ff_core.objectives.flow_matching import add_noise, per_sample_squared_error, shift_sigma
from ff_core.objectives.sft import flow_matching_error


class LinearVelocity:
    """v(x, sigma) = a * x + sigma: a fixed function, so the loss can be computed by hand."""

    def __init__(self, a: float) -> None:
        self.a = a

    def velocity(self, state, sigma, condition):
        return state.map(lambda x: self.a * x + sigma.reshape(-1, *([1] * (x.ndim - 1))))


def test_flow_matching_error_by_hand():
    """x0 = [1, 2], eps = [3, -1], sigma = 0.25, v = 2 x + sigma:
    x_sigma = 0.75 [1, 2] + 0.25 [3, -1] = [1.5, 1.25]; target = eps - x0 = [2, -3];
    v = [3.25, 2.75]; error = [1.25^2, 5.75^2] = [1.5625, 33.0625]; mean = 17.3125.
    Sample 2: x0 = [0, 0], eps = [1, 1], sigma = 1: x = [1, 1], v = [3, 3], target [1, 1] -> mean 4."""
    clean = LatentState({"latent": torch.tensor([[1.0, 2.0], [0.0, 0.0]])})
    noise = LatentState({"latent": torch.tensor([[3.0, -1.0], [1.0, 1.0]])})
    sigma = torch.tensor([0.25, 1.0])
    got = flow_matching_error(LinearVelocity(2.0), clean, {}, sigma, noise)
    assert_close(got, torch.tensor([17.3125, 4.0]))


def test_error_pools_components_by_element_count_and_honours_masks():
    """video error 1 on 3 elements, audio error 4 on 1 element -> (3*1 + 1*4) / 4 = 1.75.
    With the last video element masked out: (2*1 + 4) / 3 = 2."""
    pred = LatentState({"video": torch.ones(1, 3), "audio": torch.full((1, 1), 2.0)})
    target = LatentState({"video": torch.zeros(1, 3), "audio": torch.zeros(1, 1)})
    assert_close(per_sample_squared_error(pred, target), torch.tensor([1.75]))
    pred.masks["video"] = torch.tensor([[1.0, 1.0, 0.0]])
    assert_close(per_sample_squared_error(pred, target), torch.tensor([2.0]))


def test_error_is_computed_in_fp32():
    pred = LatentState({"latent": torch.tensor([[1000.0, 1000.5]], dtype=torch.bfloat16)})
    target = LatentState({"latent": torch.zeros(1, 2, dtype=torch.bfloat16)})
    assert per_sample_squared_error(pred, target).dtype == torch.float32


def test_sd3_shift_and_noising():
    """shift 3 maps sigma 0.5 to 3 * 0.5 / (1 + 2 * 0.5) = 0.75; shift 1 is the identity."""
    assert_close(shift_sigma(torch.tensor([0.5, 0.0, 1.0]), 3.0), torch.tensor([0.75, 0.0, 1.0]))
    assert_close(shift_sigma(torch.tensor([0.3]), 1.0), torch.tensor([0.3]))
    x = add_noise(torch.ones(2, 2, 2), torch.zeros(2, 2, 2), torch.tensor([0.0, 1.0]))
    assert_close(x[0], torch.ones(2, 2)) and assert_close(x[1], torch.zeros(2, 2))


def test_timestep_sampler_distributions():
    g = torch.Generator().manual_seed(0)
    uniform = TimestepSampler("uniform").sample(20000, g)
    assert 0 <= uniform.min() and uniform.max() <= 1 and abs(uniform.mean() - 0.5) < 0.01
    ln = TimestepSampler("logit_normal", logit_mean=1.0, logit_std=0.5).sample(20000, g)
    logits = torch.log(ln / (1 - ln))
    assert abs(logits.mean() - 1.0) < 0.02 and abs(logits.std() - 0.5) < 0.02
    shifted = TimestepSampler("logit_normal", shift=3.0).sample(20000, torch.Generator().manual_seed(1))
    plain = TimestepSampler("logit_normal").sample(20000, torch.Generator().manual_seed(1))
    assert_close(shifted, shift_sigma(plain, 3.0))


def test_monte_carlo_terms_are_averaged():
    """K draws of (sigma, noise) in that order from one generator; the loss is their mean."""
    clean = LatentState({"latent": torch.randn(3, 4, generator=torch.Generator().manual_seed(7))})
    objective = SFTObjective(TimestepSampler("uniform"), num_train_timesteps=3)
    out = objective.loss(LinearVelocity(0.5), clean, {}, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    terms = []
    for _ in range(3):
        sigma = torch.rand(3, generator=g)
        noise = LatentState({"latent": torch.randn(3, 4, generator=g)})
        terms.append(flow_matching_error(LinearVelocity(0.5), clean, {}, sigma, noise))
    expected = torch.stack(terms).mean(0)
    assert_close(out.per_sample, expected)
    assert_close(out.loss, expected.mean())
    assert out.per_sample.shape == (3,)


def test_invalid_objective_settings_name_the_key():
    import pytest

    with pytest.raises(ValueError, match="num_train_timesteps"):
        SFTObjective(num_train_timesteps=0)
    with pytest.raises(ValueError, match="weighting"):
        TimestepSampler("cosine")
