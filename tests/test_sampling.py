"""ff_core.sampling: step formulas against hand computations and transcriptions of the references, log-prob replay
equality, SDE step windows, and the end of the adapter <-> objectives import circle."""

import math
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from ff_core.adapter import Adapter, LatentState
from ff_core.sampling import (
    StochasticSampling,
    gaussian_log_density,
    sample_ode,
    sample_sde,
    sde_step,
    step_gaussian,
    step_log_prob,
)


def test_importing_sampling_does_not_import_objectives():
    code = ("import sys, ff_core.sampling, ff_core.adapter; "
            "print(any(m.startswith('ff_core.objectives') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_flow_sde_mean_and_std_by_hand():
    """sigma = 0.5, sigma_next = 0.25 (dt = -0.25), eta = 0.5: s = 0.5 sqrt(0.5 / 0.5) = 0.5, s^2 = 0.25;
    mean = x (1 + 0.25 / 1 * -0.25) + v (1 + 0.25 * 0.5 / 1) * -0.25 = 0.9375 x - 0.28125 v; std = 0.5 * 0.5."""
    x, v = torch.tensor([[1.0, -2.0]]), torch.tensor([[0.5, 4.0]])
    mean, std = step_gaussian("flow_sde", x, v, 0.5, 0.25, eta=0.5)
    assert_close(mean, torch.tensor([[0.9375 - 0.140625, -1.875 - 1.125]]))
    assert std == pytest.approx(0.25)


def flow_grpo_sde_step(v, t, x, sigma_prev, noise_level, sigma_max):
    """Transcription of yifan123/flow_grpo's ``sde_step_with_logprob`` mean and std (sd3_sde_with_logprob.py)."""
    sigma = torch.tensor(t)
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, torch.tensor(sigma_max), sigma))) * noise_level
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, std_dev_t * torch.sqrt(-1 * dt)


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.7, 0.55), (0.2, 0.0)])
def test_flow_sde_matches_flow_grpo_transcription(sigma, sigma_next):
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    mean, std = step_gaussian("flow_sde", x, v, sigma, sigma_next, eta=0.7, sigma_max=0.9)
    ref_mean, ref_std = flow_grpo_sde_step(v, sigma, x, sigma_next, 0.7, 0.9)
    assert_close(mean, ref_mean)
    assert std == pytest.approx(float(ref_std))


def test_cps_mean_and_std_by_hand():
    """sigma = 0.5, sigma_next = 0.4, eta = 1/3: std = 0.4 sin(pi/6) = 0.2; x0 = x - 0.5 v, eps = x + 0.5 v,
    mean = 0.6 x0 + sqrt(0.16 - 0.04) eps. The coefficients are preserved: 1 - sigma_next on x0, and the noise's
    sqrt(0.12 + std^2) = 0.4 = sigma_next."""
    x, v = torch.tensor([2.0]), torch.tensor([1.0])
    mean, std = step_gaussian("cps", x, v, 0.5, 0.4, eta=1 / 3)
    assert std == pytest.approx(0.2)
    assert_close(mean, torch.tensor([0.6 * 1.5 + math.sqrt(0.12) * 2.5]))


def test_ode_kind_is_the_euler_step():
    x, v = torch.tensor([1.0]), torch.tensor([3.0])
    mean, std = step_gaussian("ode", x, v, 0.8, 0.6, eta=0.7)
    assert_close(mean, torch.tensor([1.0 - 0.6]))
    assert std == 0.0


def test_log_density_is_the_normal_log_pdf():
    x, mean = torch.tensor([0.3, -1.0]), torch.tensor([0.1, 0.5])
    expected = torch.distributions.Normal(mean, 0.4).log_prob(x)
    assert_close(gaussian_log_density(x, mean, 0.4), expected)


def state(*shape, dtype=torch.float32, seed=0, masks=None):
    g = torch.Generator().manual_seed(seed)
    return LatentState({"video": torch.randn(*shape, generator=g).to(dtype),
                        "audio": torch.randn(shape[0], 5, generator=g).to(dtype)}, masks or {})  # fmt: skip


def test_step_log_prob_pools_components_by_element_count_and_skips_pinned():
    """Two components on their own schedules; the mask pins video element 0. The log-prob is the mean of the 3 active
    video densities and the 5 audio ones (8 elements), each component under its own (sigma, sigma_next)."""
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    x, v = state(1, 4, masks={"video": mask}), state(1, 4, seed=1)
    sigmas = {"video": (0.8, 0.6), "audio": (0.5, 0.3)}
    out = sde_step(x, v, sigmas, "flow_sde", 0.7, torch.Generator().manual_seed(2))
    assert out.next.components["video"][0, 0] == x.components["video"][0, 0]  # pinned: unchanged
    dens = []
    for name, (s, sn) in sigmas.items():
        mean, std = step_gaussian("flow_sde", x.components[name], v.components[name], s, sn, 0.7)
        dens.append(torch.distributions.Normal(mean, std).log_prob(out.next.components[name]))
    expected = (dens[0][0, 1:].sum() + dens[1].sum()) / 8
    assert_close(out.log_prob, expected[None])


def _active_mean(values, mask=None):
    return values.sum() / values.numel() if mask is None else (values * mask).sum() / mask.sum()


def test_step_log_prob_weighs_each_components_own_mean():
    """docs/objectives.md, "Several latent components": with ``component_weights`` {video: 3, audio: 1} the log-prob is
    3 m_video + 1 m_audio (unnormalised), each m the mean log-density over that component's active elements (3 of 4
    video elements, the first pinned; 5 audio ones), each component under its own (sigma, sigma_next); the same
    weights the SFT error uses (``per_sample_squared_error`` reduces through the same ``component_mean``). A frozen
    component's density leaves it (3 m_video alone); replay with the same reduction is bitwise the rollout's."""
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 1.0]])
    x, v = state(2, 4, masks={"video": mask}), state(2, 4, seed=1)
    sigmas = {"video": (0.8, 0.6), "audio": (0.5, 0.3)}
    weights = {"video": 3.0, "audio": 1.0}
    out = sde_step(x, v, sigmas, "flow_sde", 0.7, torch.Generator().manual_seed(2), component_weights=weights)
    dens = {}
    for name, (s, sn) in sigmas.items():
        mean, std = step_gaussian("flow_sde", x.components[name], v.components[name], s, sn, 0.7)
        dens[name] = torch.distributions.Normal(mean, std).log_prob(out.next.components[name])
    video = torch.stack([_active_mean(dens["video"][i], mask[i]) for i in range(2)])
    audio = dens["audio"].mean(1)
    assert_close(out.log_prob, 3 * video + audio)
    pooled = step_log_prob(x, v, out.next, sigmas, "flow_sde", 0.7).log_prob  # no weights: 3 + 5 elements pooled
    assert_close(pooled, torch.stack([(dens["video"][i] * mask[i]).sum() + dens["audio"][i].sum() for i in range(2)])
                 / 8)  # fmt: skip
    assert not torch.allclose(pooled, out.log_prob)
    replay = step_log_prob(x, v, out.next, sigmas, "flow_sde", 0.7, component_weights=weights)
    assert torch.equal(replay.log_prob, out.log_prob)
    frozen = step_log_prob(x, v, out.next, sigmas, "flow_sde", 0.7, component_weights=weights,
                           frozen_components={"audio"})  # fmt: skip
    assert_close(frozen.log_prob, 3 * video)
    with pytest.raises(ValueError, match=r"component_weights: names \['video'\]; the latent components are "
                                         r"\['video', 'audio'\]"):  # fmt: skip
        step_log_prob(x, v, out.next, sigmas, "flow_sde", 0.7, component_weights={"video": 1.0})
    with pytest.raises(ValueError, match="freezes every latent component"):
        step_log_prob(x, v, out.next, sigmas, "flow_sde", 0.7, frozen_components={"audio", "video"})


def test_single_component_log_prob_is_the_element_mean_bit_for_bit():
    """SD3 / Wan (one component, no ``default_component_weights``): the log-prob is today's (before the component
    weighting) mean over active elements, bit for bit, and a weight of 1 on the only component changes nothing."""
    g = torch.Generator().manual_seed(4)
    x = LatentState({"latent": torch.randn(3, 4, 2, 5, generator=g)},
                    {"latent": (torch.rand(3, 1, 2, 5, generator=g) > 0.3).float()})  # fmt: skip
    v = LatentState({"latent": torch.randn(3, 4, 2, 5, generator=g)})
    out = sde_step(x, v, (0.7, 0.5), "flow_sde", 0.7, torch.Generator().manual_seed(5))
    mean, std = step_gaussian("flow_sde", x.components["latent"], v.components["latent"], 0.7, 0.5, 0.7)
    dens = gaussian_log_density(out.next.components["latent"], mean, std)
    mask = x.masks["latent"].expand_as(dens)
    assert torch.equal(out.log_prob, (dens * mask).flatten(1).sum(1) / mask.flatten(1).sum(1).clamp_min(1))
    weighted = step_log_prob(x, v, out.next, (0.7, 0.5), "flow_sde", 0.7, component_weights={"latent": 1.0})
    assert torch.equal(weighted.log_prob, out.log_prob)


@pytest.mark.parametrize("kind", ["flow_sde", "cps"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replayed_log_prob_equals_the_rollouts_exactly(kind, dtype):
    """The stored x_next is rounded to the storage dtype before it is scored, so replay (same velocity) recomputes
    the rollout's fp32 log-prob bit for bit, in fp32 and in bf16 storage."""
    x, v = state(3, 2, 4, dtype=dtype), state(3, 2, 4, dtype=dtype, seed=1)
    out = sde_step(x, v, (0.6, 0.45), kind, 0.7, torch.Generator().manual_seed(3))
    assert out.next.components["video"].dtype == dtype
    replay = step_log_prob(x, v, out.next, (0.6, 0.45), kind, 0.7)
    assert torch.equal(replay.log_prob, out.log_prob)
    assert out.log_prob.dtype == torch.float32


class LinearAdapter(Adapter):
    """A toy adapter: latents (B, 4), velocity a linear map of (x, sigma, condition)."""

    name = "toy-linear"

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(6, 4)

    @property
    def denoiser(self):
        return self.net

    def velocity(self, state, sigma, condition):
        x = state.components["latent"]
        return LatentState({"latent": self.net(torch.cat([x, sigma[:, None], condition["c"]], 1))})

    def initial_noise(self, condition, generator=None):
        return LatentState({"latent": torch.randn(condition["c"].shape[0], 4, generator=generator)})

    def sampling_sigmas(self, num_steps, shift=None, state=None):
        return torch.linspace(1.0, 0.0, num_steps + 1)


def test_sample_sde_stores_replayable_transitions_on_the_window():
    adapter, cond = LinearAdapter(), {"c": torch.randn(3, 1)}
    sampler = StochasticSampling(kind="flow_sde", eta=0.7, window=(0, 4), num_sde_steps=2)
    with torch.no_grad():
        traj = sample_sde(adapter, cond, sampler, num_steps=5, generator=torch.Generator().manual_seed(0))
    steps = [t.step for t in traj.transitions]
    assert len(steps) == 2 and all(0 <= s < 4 for s in steps) and steps == sorted(steps)
    assert traj.sigma_max["latent"] == pytest.approx(0.8)
    for t in traj.transitions:  # replay with gradient, as GRPO's update does
        v = adapter.velocity(t.state, torch.full((3,), t.sigma), cond)
        replay = step_log_prob(t.state, v, t.next, (t.sigma, t.sigma_next), "flow_sde", 0.7, traj.sigma_max)
        assert torch.equal(replay.log_prob.detach(), t.log_prob) and replay.log_prob.requires_grad


def test_sample_sde_with_every_step_ode_elsewhere_matches_ode_outside_the_window():
    """Before the window every step is Euler: the state entering the first SDE step equals the ODE sampler's."""
    adapter, cond = LinearAdapter(), {"c": torch.randn(2, 1)}
    with torch.no_grad():
        traj = sample_sde(adapter, cond, StochasticSampling(window=(2, 3)), num_steps=4,
                          generator=torch.Generator().manual_seed(5))  # fmt: skip
        ode2 = sample_ode(adapter, cond, num_steps=4, generator=torch.Generator().manual_seed(5))
    assert [t.step for t in traj.transitions] == [2]
    # the first two steps are the same Euler steps: replay them by hand
    x = adapter.initial_noise(cond, torch.Generator().manual_seed(5)).components["latent"]
    for s, sn in ((1.0, 0.75), (0.75, 0.5)):
        x = x + (sn - s) * adapter.velocity(LatentState({"latent": x}), torch.full((2,), s), cond).components["latent"]
    assert torch.equal(traj.transitions[0].state.components["latent"], x)
    assert not torch.equal(traj.final.components["latent"], ode2.components["latent"])


def test_window_errors_name_the_key():
    with pytest.raises(ValueError, match="sampler.window"):
        StochasticSampling(kind="cps", window=(0, 4)).candidate_steps(4)  # CPS onto sigma 0
    with pytest.raises(ValueError, match="num_sde_steps"):
        StochasticSampling(window=(0, 2), num_sde_steps=3).candidate_steps(4)
    with pytest.raises(ValueError, match="sampler.kind"):
        StochasticSampling(kind="ode")
    assert StochasticSampling(kind="cps").candidate_steps(4) == [0, 1, 2]


class VideoAudioAdapter(LinearAdapter):
    """Two components on their own schedules: ``video`` on the linear grid, ``audio`` on a shifted one (shift 3)."""

    name = "toy-video-audio"

    def velocity(self, state, sigma, condition):
        video = super().velocity(LatentState({"latent": state.components["video"]}), sigma, condition)
        return LatentState({"video": video.components["latent"], "audio": -0.5 * state.components["audio"]},
                           dict(state.masks))  # fmt: skip

    def initial_noise(self, condition, generator=None):
        n = condition["c"].shape[0]
        return LatentState({"video": torch.randn(n, 4, generator=generator),
                            "audio": torch.randn(n, 3, generator=generator)})  # fmt: skip

    def sampling_schedules(self, state, num_steps, shift=None):
        grid = torch.linspace(1.0, 0.0, num_steps + 1)
        return {"video": grid, "audio": 3 * grid / (1 + 2 * grid)}


def test_components_step_on_their_own_schedules_and_replay_exactly():
    """ODE: each component's Euler step uses its own (sigma, sigma_next), by hand; SDE: the transitions store each
    component's levels and replay gives the rollout's log-prob bit for bit."""
    adapter, cond = VideoAudioAdapter(), {"c": torch.randn(2, 1)}
    with torch.no_grad():
        out = sample_ode(adapter, cond, num_steps=2, generator=torch.Generator().manual_seed(0))
    x = adapter.initial_noise(cond, torch.Generator().manual_seed(0))
    video, audio = x.components["video"], x.components["audio"]
    a = [1.0, 0.75, 0.0]  # 3 * s / (1 + 2 s) at s = 1, 0.5, 0
    for i, s in enumerate((1.0, 0.5)):  # the velocity sees the first component's level
        v = adapter.velocity(LatentState({"video": video, "audio": audio}), torch.full((2,), s), cond)
        video = video - 0.5 * v.components["video"]  # the linear grid: dt = -0.5 both steps
        audio = audio + (a[i + 1] - a[i]) * v.components["audio"]
    assert_close(out.components["video"], video)
    assert_close(out.components["audio"], audio)
    with torch.no_grad():
        traj = sample_sde(adapter, cond, StochasticSampling(window=(0, 2)), num_steps=2,
                          generator=torch.Generator().manual_seed(1))  # fmt: skip
    assert traj.transitions[1].levels == {"video": (0.5, 0.0), "audio": (0.75, 0.0)}
    assert traj.sigma_max == {"video": 0.5, "audio": 0.75}
    for t in traj.transitions:
        v = adapter.velocity(t.state, torch.full((2,), t.sigma), cond)
        replay = step_log_prob(t.state, v, t.next, t.levels, "flow_sde", 0.7, traj.sigma_max)
        assert torch.equal(replay.log_prob, t.log_prob)


class PerStreamLevelAdapter(VideoAudioAdapter):
    """``component_velocity`` conditions each stream on its own level (the audio velocity is ``-sigma_audio * x``), as
    MiniMax H3 feeds its video and audio rows their own timesteps in one forward."""

    name = "toy-per-stream-level"

    def component_velocity(self, state, sigmas, condition):
        v = super().velocity(state, sigmas["video"], condition)
        audio = -sigmas["audio"][:, None] * state.components["audio"]
        return LatentState({"video": v.components["video"], "audio": audio}, dict(state.masks))


def test_sampling_and_replay_give_each_component_its_own_level():
    """``Adapter.component_velocity`` (interface 1.3): the ODE sampler and GRPO's replay
    (``Transition.velocity_levels``) evaluate the velocity with every component at its own schedule's level; the
    default is ``velocity`` at the first component's (VideoAudioAdapter above)."""
    from ff_core.sampling import guided_velocity

    adapter, cond = PerStreamLevelAdapter(), {"c": torch.randn(2, 1)}
    with torch.no_grad():
        out = sample_ode(adapter, cond, num_steps=2, generator=torch.Generator().manual_seed(0))
    x = adapter.initial_noise(cond, torch.Generator().manual_seed(0))
    video, audio = x.components["video"], x.components["audio"]
    a = [1.0, 0.75, 0.0]
    for i, s in enumerate((1.0, 0.5)):
        v = adapter.velocity(LatentState({"video": video, "audio": audio}), torch.full((2,), s), cond)
        video = video - 0.5 * v.components["video"]
        audio = audio + (a[i + 1] - a[i]) * (-a[i] * audio)  # at the audio's own level a[i], not the video's s
    assert_close(out.components["video"], video)
    assert_close(out.components["audio"], audio)
    with torch.no_grad():
        traj = sample_sde(adapter, cond, StochasticSampling(window=(0, 2)), num_steps=2,
                          generator=torch.Generator().manual_seed(1))  # fmt: skip
    for t in traj.transitions:
        assert t.velocity_levels == {k: s for k, (s, _) in t.levels.items()}
        v = guided_velocity(adapter, t.state, t.velocity_levels, cond, None, 1.0)
        replay = step_log_prob(t.state, v, t.next, t.levels, "flow_sde", 0.7, traj.sigma_max)
        assert torch.equal(replay.log_prob, t.log_prob)
    # The default component_velocity: velocity at the first component's level (what VideoAudioAdapter relies on).
    base, state = VideoAudioAdapter(), adapter.initial_noise(cond, torch.Generator().manual_seed(2))
    levels = {"video": torch.full((2,), 0.5), "audio": torch.full((2,), 0.9)}
    got = base.component_velocity(state, levels, cond)
    want = base.velocity(state, levels["video"], cond)
    assert all(torch.equal(got.components[k], want.components[k]) for k in want.components)
