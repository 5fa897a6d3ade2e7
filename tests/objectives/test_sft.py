"""SFT loss against hand computations on fixed tensors (STYLE 6)."""

import pytest
import torch
from torch.testing import assert_close

from ff_core.adapter import Adapter, LatentState
from ff_core.objectives import SFTObjective, TimestepSampler
from ff_core.objectives.flow_matching import (
    add_noise,
    euler_step,
    noise_state,
    per_sample_squared_error,
    shift_sigma,
    velocity_target,
)
from ff_core.objectives.sft import flow_matching_error


class LinearVelocity:
    """v(x, sigma) = a * x + sigma: a fixed function, so the loss can be computed by hand."""

    def __init__(self, a: float) -> None:
        self.a = a

    def velocity(self, state, sigma, condition):
        return state.map(lambda x: self.a * x + sigma.reshape(-1, *([1] * (x.ndim - 1))))

    def timestep_shift(self, state=None):
        return 1.0


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
    with pytest.raises(ValueError, match="shift must be > 0"):
        TimestepSampler(shift=0.0)


# -- precision and masks ------------------------------------------------------------------------------
def test_noising_is_fp32_and_cast_once():
    """bf16 latents: x_sigma = ((1 - s) x0 + s eps) in fp32 with the fp32 sigma, rounded to bf16 once. The old path
    rounded sigma itself to bf16 (0.3 -> 0.30078125) and did the arithmetic in bf16."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(4, 256, generator=g).to(torch.bfloat16)
    eps = torch.randn(4, 256, generator=g).to(torch.bfloat16)
    sigma = torch.tensor([0.3, 0.517, 0.9001, 0.05])
    got = add_noise(x0, eps, sigma)
    s = sigma[:, None]
    expected = ((1 - s) * x0.float() + s * eps.float()).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert_close(got, expected, rtol=0, atol=0)
    s_bf16 = sigma.to(torch.bfloat16)[:, None]
    assert not torch.equal(got, (1 - s_bf16) * x0 + s_bf16 * eps)  # the old rounding
    # The regression target noise - x0 is not rounded to bf16 either.
    assert_close(velocity_target(x0, eps), eps.float() - x0.float(), rtol=0, atol=0)


class RecordingVelocity(LinearVelocity):
    """LinearVelocity that keeps the state it was called on."""

    def velocity(self, state, sigma, condition):
        self.seen = state
        return super().velocity(state, sigma, condition)


def test_pinned_elements_enter_the_denoiser_clean_and_leave_the_loss():
    """x0 = [1, 2, 3] with the last element pinned (mask 0), eps = [3, -1, 5], sigma = 0.5, v = 2 x + sigma:
    x_sigma = [0.5 + 1.5, 1 - 0.5, 3 (clean, not 0.5 * 3 + 0.5 * 5 = 4)] = [2, 0.5, 3];
    v = [4.5, 1.5, 6.5]; target = eps - x0 = [2, -3, 2]; error over the two generated elements only:
    (2.5^2 + 4.5^2) / 2 = (6.25 + 20.25) / 2 = 13.25."""
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    clean = LatentState({"latent": torch.tensor([[1.0, 2.0, 3.0]])}, {"latent": mask})
    noise = LatentState({"latent": torch.tensor([[3.0, -1.0, 5.0]])})
    denoiser = RecordingVelocity(2.0)
    got = flow_matching_error(denoiser, clean, {}, torch.tensor([0.5]), noise)
    assert_close(denoiser.seen.components["latent"], torch.tensor([[2.0, 0.5, 3.0]]))
    assert denoiser.seen.masks["latent"] is not None
    assert_close(got, torch.tensor([13.25]))
    # A broadcastable mask (per frame of a (B, C, T) latent) pins whole frames: the first frame stays clean.
    x0 = torch.arange(12.0).reshape(1, 2, 6)
    frames = torch.tensor([0.0, 1, 1, 1, 1, 1]).reshape(1, 1, 6)
    noisy = noise_state(LatentState({"v": x0}, {"v": frames}), LatentState({"v": torch.zeros(1, 2, 6)}),
                        torch.tensor([1.0]))
    assert_close(noisy.components["v"][..., 0], x0[..., 0]) and (noisy.components["v"][..., 1:] == 0).all()


class PinnedToyAdapter(Adapter):
    """A toy family whose initial state pins its first element (a condition latent) and whose velocity is 1
    everywhere (NaN at the pinned element, which sampling must never read into the state)."""

    name = "toy-pinned"

    def initial_noise(self, condition, generator=None):
        x = torch.tensor([[7.0, 0.5, -0.5]])
        return LatentState({"latent": x}, {"latent": torch.tensor([[0.0, 1.0, 1.0]])})

    def velocity(self, state, sigma, condition):
        v = torch.ones_like(state.components["latent"])
        v[:, 0] = float("nan")
        return LatentState({"latent": v}, dict(state.masks))


def test_euler_sampling_leaves_pinned_elements_unchanged():
    """One Euler step 1 -> 0.5 with v = 1: generated elements move by -0.5, the pinned one keeps 7.
    Full sampling (sigmas 1 -> 0, v = 1) moves generated elements by -1 in total."""
    state = PinnedToyAdapter().initial_noise({})
    step = euler_step(state, PinnedToyAdapter().velocity(state, torch.tensor([1.0]), {}), 1.0, 0.5)
    assert_close(step.components["latent"], torch.tensor([[7.0, 0.0, -1.0]]))
    assert_close(step.masks["latent"], state.masks["latent"])
    out = PinnedToyAdapter().sample({}, num_steps=4)
    assert_close(out.components["latent"], torch.tensor([[7.0, -0.5, -1.5]]))


# -- the shift follows the adapter unless the recipe sets it --------------------------------------------
class ShiftedVelocity(LinearVelocity):
    def timestep_shift(self, state=None):
        return 3.0


def test_default_shift_is_the_adapters_and_the_recipe_wins():
    """TimestepSampler.shift None draws sigma = shift_sigma(sigmoid(n), adapter's 3); shift: 1.0 overrides it."""
    clean = LatentState({"latent": torch.zeros(5, 2)})
    default = SFTObjective().loss(ShiftedVelocity(1.0), clean, {}, generator=torch.Generator().manual_seed(0))
    plain = torch.sigmoid(torch.randn(5, generator=torch.Generator().manual_seed(0)))
    assert_close(default.sigma, shift_sigma(plain, 3.0)[None])
    override = SFTObjective(TimestepSampler(shift=1.0)).loss(
        ShiftedVelocity(1.0), clean, {}, generator=torch.Generator().manual_seed(0)
    )
    assert_close(override.sigma, plain[None])
    assert TimestepSampler().shift is None and TimestepSampler().resolve_shift(ShiftedVelocity(1.0), clean) == 3.0


def test_a_micro_batch_loss_is_a_function_of_its_generator_alone(tiny_sd3, shapes_dir):
    """Every random draw of an SFT step (the VAE posterior sample of the targets, the noise levels, the noise) comes
    from the step's generator: the same seed gives the same loss whatever the global RNG, so a resumed run and an
    uninterrupted one compute the same step; another seed gives another loss."""
    from torch.utils.data import default_collate

    from ff_core.adapter import ConditionInput
    from ff_core.data.media.decode import decode_media
    from ff_core.data.records.sources import DatasetConfig, load_split
    from ff_core.module import FlowModule

    records = load_split(DatasetConfig(name="shapes", dataset_dir=str(shapes_dir)), "train", "sft")[:3]
    module = FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32})
    module.configure_model()
    adapter = module.adapter
    batch = {"condition": default_collate(adapter.preprocess([ConditionInput(r.prompt) for r in records])),
             "target": [[decode_media(m) for m in r.candidates[0]] for r in records]}
    losses = []
    for global_seed, seed in ((0, 11), (1, 11), (0, 12)):
        torch.manual_seed(global_seed)
        with torch.no_grad():
            losses.append(module.objective.training_loss(adapter, batch, torch.Generator().manual_seed(seed)).loss)
    assert_close(losses[0], losses[1], rtol=0, atol=0)
    assert not torch.equal(losses[0], losses[2])


def test_component_weights_sum_each_component_mean_unnormalised():
    """video error 1 on 3 elements, audio error 4 on 1 element: pooled 1.75; weights sum the weighted component means,
    unnormalised (docs/objectives.md): {video: 1, audio: 1} 1 + 4 = 5 (MiniMax H3's "mean over video + mean over
    audio"); {video: 0.5, audio: 0.5} 2.5 (LTX-2's default); {video: 1, audio: 3} 1 + 12 = 13; audio 0: the video's 1
    alone. Masks still apply inside a component: the masked video element (error 9) counts in neither. A frozen
    component drops its term; weights leaving every kept component at 0 are refused."""
    pred = LatentState({"video": torch.tensor([[1.0, 1.0, 1.0, 3.0]]), "audio": torch.full((1, 1), 2.0)},
                       {"video": torch.tensor([[1.0, 1.0, 1.0, 0.0]])})  # fmt: skip
    target = LatentState({"video": torch.zeros(1, 4), "audio": torch.zeros(1, 1)})
    assert_close(per_sample_squared_error(pred, target), torch.tensor([1.75]))
    assert_close(per_sample_squared_error(pred, target, {"video": 1.0, "audio": 1.0}), torch.tensor([5.0]))
    assert_close(per_sample_squared_error(pred, target, {"video": 0.5, "audio": 0.5}), torch.tensor([2.5]))
    assert_close(per_sample_squared_error(pred, target, {"video": 1.0, "audio": 3.0}), torch.tensor([13.0]))
    assert_close(per_sample_squared_error(pred, target, {"video": 1.0, "audio": 0.0}), torch.tensor([1.0]))
    assert_close(per_sample_squared_error(pred, target, {"video": 0.5, "audio": 0.5}, {"audio"}), torch.tensor([0.5]))
    with pytest.raises(ValueError, match=r"component_weights: names \['video'\]; the latent components are"):
        per_sample_squared_error(pred, target, {"video": 1.0})
    with pytest.raises(ValueError, match=r"component_weights: the latent components kept in the loss \(frozen and "
                                         r"left out: \['video'\]\) need finite weights >= 0, at least one > 0"):
        per_sample_squared_error(pred, target, {"video": 1.0, "audio": 0.0}, {"video"})


@pytest.mark.parametrize("weights", [{}, {"video": -1.0}, {"video": 0.0, "audio": 0.0}, {"video": float("nan")}])
def test_component_weights_are_checked_where_the_objective_is_built(weights):
    from ff_core.objectives import DPOObjective

    for objective in (SFTObjective, DPOObjective):
        with pytest.raises(ValueError, match=r"model\.objective\.init_args\.component_weights must map latent "):
            objective(component_weights=weights)


def test_sft_loss_with_component_weights_by_hand():
    """v = 2 x + sigma on a two-component state at sigma 1 (x = eps): video x0 0, eps 1 -> v 3, target 1, error 4;
    audio x0 0, eps 2 -> v 5, target 2, error 9. {video: 1, audio: 0} trains on the video's 4 alone; {video: 1,
    audio: 1} on 4 + 9 = 13, {video: 0.5, audio: 0.5} on 6.5."""
    clean = LatentState({"video": torch.zeros(1, 2), "audio": torch.zeros(1, 1)})
    noise = LatentState({"video": torch.ones(1, 2), "audio": torch.full((1, 1), 2.0)})
    sigma = torch.tensor([1.0])
    assert_close(flow_matching_error(LinearVelocity(2.0), clean, {}, sigma, noise), torch.tensor([17 / 3]))
    got = flow_matching_error(LinearVelocity(2.0), clean, {}, sigma, noise, {"video": 1.0, "audio": 0.0})
    assert_close(got, torch.tensor([4.0]))
    # An adapter's default_component_weights apply when none are given (4 + 9, not pooled 17 / 3); given ones win.
    per_stream = LinearVelocity(2.0)
    per_stream.default_component_weights = {"video": 1.0, "audio": 1.0}
    assert_close(flow_matching_error(per_stream, clean, {}, sigma, noise), torch.tensor([13.0]))
    assert_close(flow_matching_error(per_stream, clean, {}, sigma, noise, {"video": 0.5, "audio": 0.5}),
                 torch.tensor([6.5]))
    assert_close(flow_matching_error(per_stream, clean, {}, sigma, noise, {"video": 1.0, "audio": 0.0}),
                 torch.tensor([4.0]))


def test_default_weights_that_leave_no_term_after_freezing_fail_before_weights_load():
    """``check_components`` (run as ``FlowModule`` is built): unset ``component_weights`` take the adapter's default
    minus the frozen components; a default whose kept weights are all 0 would train nothing (the loss a sum of zero
    terms) and is refused, naming the key and the frozen components. Weights set in the config keep every component."""
    from ff_core.errors import ConfigError
    from ff_core.module import check_components

    class VideoOnlyByDefault(Adapter):
        name = "toy-av"
        latent_components = ("video", "audio")
        default_component_weights = {"video": 1.0, "audio": 0.0}

        def component_parameters(self, component):
            return {}

    check_components(VideoOnlyByDefault, [], None)
    check_components(VideoOnlyByDefault, ["video"], {"video": 1.0, "audio": 1.0})
    message = (r"component_weights \(unset: toy-av's default_component_weights\): the latent components kept in the "
               r"loss \(frozen and left out: \['video'\]\) need finite weights >= 0, at least one > 0")
    with pytest.raises(ConfigError, match=message):
        check_components(VideoOnlyByDefault, ["video"], None)


def test_one_component_without_weights_is_the_masked_element_mean_bit_for_bit():
    """SD3 / Wan (one ``latent`` component, no ``default_component_weights``): the error is the mean over active
    elements, bit for bit the masked mean computed directly, and ``{latent: 1}`` (``1 * m``) changes no bit."""
    g = torch.Generator().manual_seed(7)
    mask = (torch.rand(3, 1, 2, 5, generator=g) > 0.3).float()
    pred = LatentState({"latent": torch.randn(3, 4, 2, 5, generator=g)}, {"latent": mask})
    target = LatentState({"latent": torch.randn(3, 4, 2, 5, generator=g)})
    sq, full = (pred.components["latent"] - target.components["latent"]) ** 2, mask.expand(3, 4, 2, 5)
    direct = (sq * full).flatten(1).sum(1) / full.flatten(1).sum(1)
    assert torch.equal(per_sample_squared_error(pred, target), direct)
    assert torch.equal(per_sample_squared_error(pred, target, {"latent": 1.0}), direct)


def test_an_adapter_without_per_component_shifts_trains_as_before_bit_for_bit(tiny_sd3):
    """``Adapter.timestep_shifts`` None (SD3; Wan and LTX-2 keep the default too): the SFT loss is the one-shift
    draw's bit for bit: sigma = shift_sigma(u, the adapter's shift) for every component, then ``velocity`` at it."""
    from ff_sd3 import SD3Adapter
    from torch.utils.data import default_collate

    from ff_core.adapter import ConditionInput
    from ff_core.objectives.flow_matching import randn_like

    adapter = SD3Adapter.from_pretrained(str(tiny_sd3), resolution=32).eval()
    assert adapter.timestep_shifts() is None and TimestepSampler().resolve_shifts(adapter) is None
    condition = adapter.prepare_condition(default_collate(adapter.preprocess([ConditionInput("a red square")])))
    clean = adapter.initial_noise(condition, torch.Generator().manual_seed(3)).map(lambda x: 0.5 * x)
    with torch.no_grad():
        got = SFTObjective().loss(adapter, clean, condition, torch.Generator().manual_seed(11))
        g = torch.Generator().manual_seed(11)
        u = torch.sigmoid(torch.randn(1, generator=g))
        sigma = shift_sigma(u, adapter.timestep_shift(clean))
        noise = clean.map(lambda x: randn_like(x, g))
        noisy = clean.zip_map(noise, lambda x0, e: ((1 - sigma) * x0.float() + sigma * e.float()).to(x0.dtype))
        pred = adapter.velocity(noisy, sigma, condition)
    expected = per_sample_squared_error(pred, clean.zip_map(noise, velocity_target))
    assert_close(got.sigma, sigma[None], rtol=0, atol=0)
    assert_close(got.per_sample, expected, rtol=0, atol=0)
