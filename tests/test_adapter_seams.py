"""The Adapter's general sampling and training seams (docs/plugins.md, "Sampling seams"), each against a hand
computation: embedded (distilled) guidance as a denoiser input distinct from CFG, sampling sigmas that depend on the
latent geometry (a resolution-dependent shift), and training noise levels drawn from the adapter's table."""

import math

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from ff_core.adapter import Adapter, LatentState
from ff_core.contracts import IMAGE_OUT, PipelineIOContract
from ff_core.errors import ConfigError
from ff_core.module import FlowModule, SamplingConfig
from ff_core.objectives.flow_matching import TimestepSampler, monte_carlo_draws
from ff_core.sampling import guided_conditions, sample_ode, schedules, shift_sigma


def calculate_shift(seq_len, base_seq_len=256, max_seq_len=4096, base_shift=0.5, max_shift=1.15):
    """``mu`` linear in the token count through (base_seq_len, base_shift) and (max_seq_len, max_shift) (FLUX.1)."""
    return base_shift + (max_shift - base_shift) * (seq_len - base_seq_len) / (max_seq_len - base_seq_len)


class GuidedAdapter(Adapter):
    """A toy guidance-distilled adapter on (B, C, H, W) latents: ``v = x * g + c`` with ``g`` the embedded guidance
    and ``c`` the prompt's number; its shift is FLUX.1's ``exp(mu)`` of the token count ``H * W / 4``."""

    name = "toy-guided"
    io_contract = PipelineIOContract(outputs=(IMAGE_OUT,))

    def __init__(self, embedded_guidance: float | None = 3.5) -> None:
        super().__init__()
        self.net = nn.Linear(1, 1)  # something to train
        self.embedded_guidance = embedded_guidance
        self.side = 8

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        return cls(**kwargs)

    @property
    def denoiser(self):
        return self.net

    def preprocess(self, inputs):
        return [{"c": torch.tensor(float(len(i.prompt)))} for i in inputs]

    def encode_output(self, media, condition, generator=None):
        return LatentState({"latent": torch.stack([m[0] for m in media]).float()})

    def decode(self, state):
        return [[x] for x in state.components["latent"]]

    def velocity(self, state, sigma, condition):
        g = condition.get("embedded_guidance", self.embedded_guidance) or 0.0
        x = state.components["latent"]
        return LatentState({"latent": x * g + condition["c"][:, None, None, None]})

    def prepare_condition(self, batch):
        return dict(batch)

    def unconditional(self, condition):
        return {"c": torch.zeros_like(condition["c"])}

    def initial_noise(self, condition, generator=None):
        b = condition["c"].shape[0]
        return LatentState({"latent": torch.randn(b, 2, self.side, self.side, generator=generator)})

    def timestep_shift(self, state=None):
        h, w = (self.side, self.side) if state is None else state.components["latent"].shape[-2:]
        return math.exp(calculate_shift(h * w // 4))


# -- embedded guidance -------------------------------------------------------------------------------------------
def test_embedded_guidance_reaches_both_branches_and_is_not_cfg():
    """``v(g) = x g + c``: with embedded guidance 2 and CFG 3 (negative ``c = 0``), the guided velocity is
    ``x 2 + 0 + 3 (x 2 + c - x 2) = 2 x + 3 c``; embedded guidance alone keeps one branch: ``2 x + c``."""
    adapter, c = GuidedAdapter(), {"c": torch.tensor([1.0, -2.0])}
    x = LatentState({"latent": torch.randn(2, 2, 8, 8, generator=torch.Generator().manual_seed(0))})
    cond, neg = guided_conditions(adapter, c, guidance_scale=3.0, embedded_guidance=2.0)
    assert cond["embedded_guidance"] == 2.0 and neg["embedded_guidance"] == 2.0
    v, v_neg = adapter.velocity(x, None, cond).components["latent"], adapter.velocity(x, None, neg).components["latent"]
    assert_close(v_neg + 3.0 * (v - v_neg), 2 * x.components["latent"] + 3 * c["c"][:, None, None, None])
    cond, neg = guided_conditions(adapter, c, guidance_scale=1.0, embedded_guidance=2.0)
    assert neg is None and "embedded_guidance" not in c  # the caller's condition is not modified
    cond, neg = guided_conditions(adapter, c, guidance_scale=1.0, embedded_guidance=None)
    assert cond is c and neg is None  # the adapter's default (3.5) applies inside velocity


def test_sample_ode_with_embedded_guidance_is_the_hand_euler_loop():
    """Two Euler steps of ``v = g x + c`` on the adapter's sigmas: ``x <- x + (s' - s)(g x + c)``."""
    adapter, c = GuidedAdapter(), {"c": torch.tensor([0.5])}
    out = sample_ode(adapter, c, num_steps=2, generator=torch.Generator().manual_seed(1), embedded_guidance=1.5)
    x = torch.randn(1, 2, 8, 8, generator=torch.Generator().manual_seed(1))
    s = shift_sigma(torch.linspace(1, 0, 3), math.exp(calculate_shift(16))).tolist()
    for i in range(2):
        x = x + (s[i + 1] - s[i]) * (1.5 * x + 0.5)
    assert_close(out.components["latent"], x)
    default = sample_ode(adapter, c, num_steps=2, generator=torch.Generator().manual_seed(1))
    assert not torch.allclose(default.components["latent"], x)  # 3.5, the adapter's default, differs


def test_embedded_guidance_is_refused_without_a_guidance_embedding():
    adapter = GuidedAdapter(embedded_guidance=None)
    with pytest.raises(ValueError, match="toy-guided.*no guidance embedding.*2.0"):
        guided_conditions(adapter, {"c": torch.ones(1)}, 1.0, 2.0)
    module = FlowModule(f"{__name__}:GuidedAdapter", "unused", sampling=SamplingConfig(embedded_guidance=4.0))
    with pytest.raises(ConfigError, match=r"model\.sampling\.embedded_guidance: 4\.0 is set.*no guidance embedding"):
        module._check_embedded_guidance(adapter)
    module._check_embedded_guidance(GuidedAdapter(embedded_guidance=3.5))  # a guidance-embedded checkpoint: fine


# -- sampling sigmas that depend on the latent geometry ----------------------------------------------------------
@pytest.mark.parametrize("side,tokens", [(8, 16), (64, 1024)])
def test_sampling_schedule_follows_the_latent_geometry(side, tokens):
    """FLUX.1's ``mu`` at ``tokens`` image tokens: 0.5 + 0.65 (tokens - 256) / 3840 (16 tokens: 0.459375; 1024:
    0.63); the Euler sigmas are ``linspace(1, 0)`` shifted by ``exp(mu)``."""
    adapter = GuidedAdapter()
    mu = {16: 0.459375, 1024: 0.63}[tokens]
    assert calculate_shift(tokens) == pytest.approx(mu)
    state = LatentState({"latent": torch.zeros(1, 2, side, side)})
    got = schedules(adapter, state, 4, None)["latent"]
    levels = torch.linspace(1, 0, 5)
    expected = math.exp(mu) * levels / (1 + (math.exp(mu) - 1) * levels)
    assert_close(torch.tensor(got), expected)
    assert_close(adapter.sampling_sigmas(4, state=state), expected)
    assert_close(torch.tensor(schedules(adapter, state, 4, 1.0)["latent"]), levels)  # model.sampling.shift wins


def test_sample_ode_uses_the_schedule_of_the_noise_it_draws():
    """An adapter sampling at 64 x 64 latents steps on the 1024-token schedule, not its default 16-token one."""
    adapter, c = GuidedAdapter(embedded_guidance=0.0), {"c": torch.tensor([1.0])}
    adapter.side = 64
    out = sample_ode(adapter, c, num_steps=3, generator=torch.Generator().manual_seed(0))
    s = shift_sigma(torch.linspace(1, 0, 4), math.exp(0.63))
    x0 = torch.randn(1, 2, 64, 64, generator=torch.Generator().manual_seed(0))
    assert_close(out.components["latent"], x0 + (s[-1] - s[0]) * 1.0)  # v = c = 1 at g = 0


# -- training noise levels on the adapter's table ----------------------------------------------------------------
def test_default_training_table_is_the_shifted_scheduler_grid():
    """The default: ``i / 1000`` for ``i = 1000 .. 1`` shifted by the adapter's ``timestep_shift`` for the latent
    size (here ``exp(mu)``); a diffusers scheduler with ``use_dynamic_shifting`` builds its own table unshifted, so
    such a family returns ``scheduler_sigma_table`` (test_scheduler_table_of_a_dynamic_shift_is_unshifted)."""
    adapter = GuidedAdapter()
    state = LatentState({"latent": torch.zeros(1, 2, 8, 8)})
    table = adapter.training_sigmas(state)
    s = math.exp(0.459375)
    assert table.shape == (1000,)
    assert_close(table[[0, 499, 999]], torch.tensor([1.0, s * 0.501 / (1 + (s - 1) * 0.501),
                                                     s * 0.001 / (1 + (s - 1) * 0.001)]))  # fmt: skip


def test_scheduler_table_of_a_dynamic_shift_is_unshifted():
    """diffusers applies ``mu`` only in ``set_timesteps``: the built table is ``i / 1000``; a static shift shifts it.
    Read from a fresh copy: the live scheduler's ``sigmas`` are the last sampling grid."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from ff_core.adapter import scheduler_sigma_table

    levels = torch.arange(1000, 0, -1, dtype=torch.float32) / 1000
    dynamic = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0)
    dynamic.set_timesteps(4, mu=0.8)
    assert_close(scheduler_sigma_table(dynamic), levels)
    assert_close(scheduler_sigma_table(FlowMatchEulerDiscreteScheduler(shift=3.0)), shift_sigma(levels, 3.0))


def test_adapter_schedule_picks_table_levels_by_index():
    """``schedule: adapter`` with uniform ``u``: sigma = level ``floor(u * N)`` of the table sorted ascending."""
    adapter = GuidedAdapter()
    clean = LatentState({"latent": torch.zeros(5, 2, 8, 8)})
    sampler = TimestepSampler("uniform", schedule="adapter")
    (sigma, _), = monte_carlo_draws(sampler, adapter, clean, 1, torch.Generator().manual_seed(0))
    u = torch.rand(5, generator=torch.Generator().manual_seed(0))
    table = adapter.training_sigmas(clean)
    assert_close(sigma, table.flip(0)[(u * 1000).long()])
    continuous, = monte_carlo_draws(TimestepSampler("uniform"), adapter, clean, 1, torch.Generator().manual_seed(0))
    assert_close(continuous[0], shift_sigma(u, math.exp(0.459375)))  # the default: continuous, the adapter's shift
    with pytest.raises(ValueError, match="schedule='adapter'.*holds its own shift"):
        TimestepSampler(shift=3.0, schedule="adapter")


def test_logit_mean_means_noisier_on_both_schedules():
    """``logit_mean`` 2 puts the mass at high noise whether sigma is the draw (``continuous``) or indexes the
    adapter's table (``adapter``): the table is indexed ascending, the same direction."""
    adapter = GuidedAdapter()
    clean = LatentState({"latent": torch.zeros(4000, 2, 8, 8)})
    means = {}
    for schedule in ("continuous", "adapter"):
        sampler = TimestepSampler(logit_mean=2.0, shift=None if schedule == "adapter" else 1.0, schedule=schedule)
        (sigma, _), = monte_carlo_draws(sampler, adapter, clean, 1, torch.Generator().manual_seed(0))
        means[schedule] = float(sigma.mean())
    # E[sigmoid(n)], n ~ N(2, 1), is about 0.84; the table is shifted by exp(0.459375) (about 1.6): noisier still.
    assert 0.8 < means["continuous"] < 0.88 and 0.85 < means["adapter"] < 0.95, means


def test_a_sampling_sigmas_override_without_state_still_samples():
    """Adapters written for interface 1.0 override ``sampling_sigmas(num_steps, shift)``: their schedule is used."""

    class Old(GuidedAdapter):
        def sampling_sigmas(self, num_steps, shift=None):
            return torch.linspace(1.0, 0.0, num_steps + 1) ** 2

    state = LatentState({"latent": torch.zeros(1, 2, 8, 8)})
    assert_close(torch.tensor(schedules(Old(), state, 2, None)["latent"]), torch.tensor([1.0, 0.25, 0.0]))


def test_grpo_rollouts_and_replays_carry_the_embedded_guidance():
    """GRPO's ``embedded_guidance`` reaches the rollout (the trajectory is ``sample_sde``'s with it) and the stored
    conditions its replays recompute log-probs from; a checkpoint without a guidance embedding refuses it by key."""
    from ff_core.objectives import GRPOObjective
    from ff_core.sampling import StochasticSampling, sample_sde

    objective = GRPOObjective(rewards=[{"name": "brightness"}], group_size=2, prompts_per_step=1, num_steps=2,
                              embedded_guidance=1.5, guidance_scale=2.0)  # fmt: skip
    adapter, condition = GuidedAdapter(), {"c": torch.tensor([1.0, 1.0])}
    (rollout,) = objective.rollout(adapter, {"prompt": ["a", "a"], "condition": condition},
                                   torch.Generator().manual_seed(0))  # fmt: skip
    assert rollout.condition["embedded_guidance"] == rollout.negative["embedded_guidance"] == 1.5
    expected = sample_sde(adapter, condition, StochasticSampling(), num_steps=2, guidance_scale=2.0,
                          generator=torch.Generator().manual_seed(0), embedded_guidance=1.5)  # fmt: skip
    assert_close(rollout.trajectory.final.components["latent"], expected.final.components["latent"])
    module = FlowModule(f"{__name__}:GuidedAdapter", "unused", objective=objective)
    with pytest.raises(ConfigError, match=r"model\.objective\.embedded_guidance: 1\.5 is set"):
        module._check_embedded_guidance(GuidedAdapter(embedded_guidance=None))


def test_prepare_batch_condition_passes_the_objectives_stream_to_stochastic_conditions():
    """The objectives realise a batch's condition through prepare_batch_condition: an adapter whose prepare_condition
    takes ``generator`` draws from the seeded child stream (reproducible, whatever the global RNG did); any other is
    called with the batch alone, as before."""
    from ff_core.objectives.flow_matching import CONDITION_STREAM, child_generator, prepare_batch_condition

    class Fixed:
        def prepare_condition(self, batch):
            return dict(batch)

    class Drawn:
        def prepare_condition(self, batch, generator=None):
            return {**batch, "noise": torch.randn(3, generator=generator)}

    batch = {"x": torch.ones(1)}
    assert prepare_batch_condition(Fixed(), batch, torch.Generator().manual_seed(1)) == batch
    draws = []
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        stream = child_generator(torch.Generator().manual_seed(1), CONDITION_STREAM)
        draws.append(prepare_batch_condition(Drawn(), batch, stream)["noise"])
    assert torch.equal(draws[0], draws[1])
    expected = torch.randn(3, generator=child_generator(torch.Generator().manual_seed(1), CONDITION_STREAM))
    assert torch.equal(draws[0], expected)
