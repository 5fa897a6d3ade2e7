"""ff_core.sampling.schedulers: evaluation sampling with the checkpoint's own diffusers scheduler, generic over families
(one copy per latent component, pinned elements kept), against the pipelines' denoising loop transcribed with
diffusers' own schedulers; Euler checkpoints keep ff's Euler path bit for bit."""

from __future__ import annotations

import pytest
import torch
from diffusers import (
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
    FlowMatchHeunDiscreteScheduler,
    MiniMaxH3Scheduler,
    UniPCMultistepScheduler,
)
from torch import nn
from torch.testing import assert_close

from ff_core.adapter import Adapter, LatentState
from ff_core.sampling import sample_ode
from ff_core.sampling.schedulers import _note_not_flow, checkpoint_schedulers, is_euler_scheduler


def unipc(**kwargs) -> UniPCMultistepScheduler:
    """The scheduler released Wan checkpoints ship (scheduler_config.json: flow_prediction, use_flow_sigmas)."""
    return UniPCMultistepScheduler(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True,
                                   flow_shift=3.0, **kwargs)  # fmt: skip


class VideoAudio(Adapter):
    """Two components: ``video`` (B, 4), its element 0 pinned (mask 0) as a condition frame would be, and ``audio``
    (B, 3); the velocity is a fixed nonlinear map of both and the noise level (as a denoiser's)."""

    name = "toy-scheduler"

    def __init__(self, scheduler) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 7))
        self.scheduler = scheduler

    @property
    def denoiser(self):
        return self.net

    def velocity(self, state, sigma, condition):
        x = torch.cat([state.components["video"], state.components["audio"], sigma[:, None]], 1)
        out = self.net(x) * condition["c"]
        return LatentState({"video": out[:, :4], "audio": out[:, 4:]}, dict(state.masks))

    def initial_noise(self, condition, generator=None):
        n = condition["c"].shape[0]
        mask = torch.tensor([[0.0, 1, 1, 1]])
        return LatentState({"video": torch.randn(n, 4, generator=generator),
                            "audio": torch.randn(n, 3, generator=generator)}, {"video": mask})  # fmt: skip

    def sampling_sigmas(self, num_steps, shift=None, state=None):
        return torch.linspace(1.0, 0.0, num_steps + 1)


def pipeline_loop(adapter: VideoAudio, cond, steps: int, seed: int) -> dict[str, torch.Tensor]:
    """The pipelines' loop (diffusers pipeline_wan.py / pipeline_wan_i2v.py), with one scheduler per stream (as
    LTX2Pipeline deep-copies its scheduler for the audio): ``set_timesteps``; per ``t`` the denoiser at ``t`` on the
    input with the pinned elements replaced by their condition values, ``scheduler.step`` on the *unmasked* latents
    (the pinned ones evolve inside the scheduler, as WanImageToVideoPipeline's TI2V loop lets them), and the condition
    written back at the end."""
    state = adapter.initial_noise(cond, torch.Generator().manual_seed(seed))
    pinned, mask = state.components["video"].clone(), state.masks["video"].bool()
    latents = dict(state.components)
    schedulers = {k: type(adapter.scheduler).from_config(adapter.scheduler.config) for k in latents}
    for s in schedulers.values():
        s.set_timesteps(steps)
    for i, t in enumerate(schedulers["video"].timesteps):
        model_input = {"video": torch.where(mask, latents["video"], pinned), "audio": latents["audio"]}
        v = adapter.velocity(LatentState(model_input), torch.full((2,), float(t)) / 1000, cond)
        latents = {k: schedulers[k].step(v.components[k], schedulers[k].timesteps[i], x, return_dict=False)[0]
                   for k, x in latents.items()}  # fmt: skip
    latents["video"] = torch.where(mask, latents["video"], pinned)
    return latents


@pytest.mark.parametrize("steps", [3, 6])
def test_a_non_euler_checkpoint_scheduler_samples_as_the_pipelines_loop(steps):
    adapter, cond = VideoAudio(unipc()), {"c": torch.tensor([[1.0], [-0.5]])}
    ours = sample_ode(adapter, cond, num_steps=steps, generator=torch.Generator().manual_seed(4))
    theirs = pipeline_loop(adapter, cond, steps, 4)
    for name in ("video", "audio"):
        assert_close(ours.components[name], theirs[name], rtol=0, atol=1e-6)
    initial = adapter.initial_noise(cond, torch.Generator().manual_seed(4))
    assert torch.equal(ours.components["video"][:, 0], initial.components["video"][:, 0])  # pinned: never moved
    euler = sample_ode(adapter, cond, num_steps=steps, generator=torch.Generator().manual_seed(4), scheduler="euler")
    assert (euler.components["audio"] - theirs["audio"]).abs().max() > 1e-3


def test_each_component_steps_with_its_own_copy():
    """A multistep scheduler keeps a history of model outputs: one shared instance would mix the streams' histories
    (and advance its step index twice a step). The copies are fresh: the adapter's own scheduler is never stepped."""
    adapter = VideoAudio(unipc())
    state = adapter.initial_noise({"c": torch.ones(2, 1)})
    copies = checkpoint_schedulers(adapter.scheduler, state, 4)
    assert list(copies) == ["video", "audio"] and copies["video"] is not copies["audio"]
    assert all(s is not adapter.scheduler and len(s.timesteps) == 4 for s in copies.values())
    assert adapter.scheduler.timesteps is None or adapter.scheduler.num_inference_steps is None


@pytest.mark.parametrize("scheduler", [FlowMatchEulerDiscreteScheduler(shift=3.0), MiniMaxH3Scheduler(shift=3.0),
                                       None])  # fmt: skip
def test_euler_checkpoints_keep_ffs_euler_path_bit_for_bit(scheduler):
    """SD3, FLUX.1, LTX-2 (FlowMatchEulerDiscreteScheduler) and MiniMax H3 (MiniMaxH3Scheduler, a rectified-flow Euler
    step) pipelines sample with Euler already: ``checkpoint`` is today's sampler, exactly."""
    adapter, cond = VideoAudio(scheduler), {"c": torch.tensor([[1.0], [-0.5]])}
    assert scheduler is None or is_euler_scheduler(scheduler)
    assert adapter.sampling_schedulers(adapter.initial_noise(cond), 4) is None
    a = sample_ode(adapter, cond, num_steps=4, generator=torch.Generator().manual_seed(1))
    b = sample_ode(adapter, cond, num_steps=4, generator=torch.Generator().manual_seed(1), scheduler="euler")
    for name in a.components:
        assert torch.equal(a.components[name], b.components[name])


def test_what_the_checkpoint_path_cannot_honour_is_refused():
    from diffusers import DDIMScheduler

    state = VideoAudio(None).initial_noise({"c": torch.ones(1, 1)})
    with pytest.raises(ValueError, match=r"model\.sampling\.scheduler: checkpoint: the checkpoint's "
                                         r"UniPCMultistepScheduler thresholds whole samples.*scheduler: euler"):
        checkpoint_schedulers(unipc(thresholding=True), state, 4)
    with pytest.raises(ValueError, match=r"model\.sampling\.shift: the checkpoint's DDIMScheduler has no shift"):
        checkpoint_schedulers(DDIMScheduler(prediction_type="flow_prediction"), state, 4, shift=2.0)
    with pytest.raises(ValueError, match=r"model\.sampling\.scheduler must be one of"):
        sample_ode(VideoAudio(None), {"c": torch.ones(1, 1)}, num_steps=2, scheduler="heun")


@pytest.mark.parametrize("scheduler", [
    UniPCMultistepScheduler(prediction_type="epsilon"),
    UniPCMultistepScheduler(prediction_type="v_prediction", use_flow_sigmas=True, flow_shift=3.0),
    DPMSolverMultistepScheduler(prediction_type="epsilon"),
    DPMSolverMultistepScheduler(prediction_type="v_prediction"),
])  # fmt: skip
def test_a_scheduler_that_takes_no_velocity_keeps_ffs_euler_path(scheduler, caplog):
    """An epsilon / v-prediction scheduler's ``step`` reads its model output as noise (or v): fed ff's velocity it
    would give garbage silently. It keeps ff's Euler steps, bit for bit, and one info line says why."""
    _note_not_flow.cache_clear()
    adapter, cond = VideoAudio(scheduler), {"c": torch.tensor([[1.0], [-0.5]])}
    with caplog.at_level("INFO", logger="ff_core.sampling.schedulers"):
        assert adapter.sampling_schedulers(adapter.initial_noise(cond), 4) is None
        assert adapter.sampling_schedulers(adapter.initial_noise(cond), 4, shift=2.0) is None  # Euler takes the shift
    lines = [r.getMessage() for r in caplog.records if r.name == "ff_core.sampling.schedulers"]
    assert len(lines) == 1 and type(scheduler).__name__ in lines[0] and "not a flow scheduler" in lines[0]
    assert scheduler.config.prediction_type in lines[0]
    a = sample_ode(adapter, cond, num_steps=4, generator=torch.Generator().manual_seed(1))
    b = sample_ode(adapter, cond, num_steps=4, generator=torch.Generator().manual_seed(1), scheduler="euler")
    for name in a.components:
        assert torch.equal(a.components[name], b.components[name])


@pytest.mark.parametrize("scheduler", [
    unipc(),
    DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0),
    FlowMatchHeunDiscreteScheduler(shift=3.0),
])  # fmt: skip
def test_flow_schedulers_sample_as_the_pipelines_loop(scheduler):
    """``flow_prediction`` UniPC / DPM-Solver (Wan's) and a ``FlowMatch*`` class (Heun: two evaluations a step,
    timesteps interleaved, its second-order stage keeping the first stage's sample) step as diffusers' loop does."""
    adapter, cond = VideoAudio(scheduler), {"c": torch.tensor([[1.0], [-0.5]])}
    copies = adapter.sampling_schedulers(adapter.initial_noise(cond), 3)
    assert copies is not None and list(copies) == ["video", "audio"]
    ours = sample_ode(adapter, cond, num_steps=3, generator=torch.Generator().manual_seed(4))
    theirs = pipeline_loop(adapter, cond, 3, 4)
    for name in ("video", "audio"):
        assert_close(ours.components[name], theirs[name], rtol=0, atol=1e-6)
    euler = sample_ode(adapter, cond, num_steps=3, generator=torch.Generator().manual_seed(4), scheduler="euler")
    assert (euler.components["audio"] - theirs["audio"]).abs().max() > 1e-4


def test_heun_is_heuns_method():
    """FlowMatchHeunDiscreteScheduler through the loop is Heun's method on dx/dsigma = v (hand transcription: Euler
    predictor to sigma_next, corrector with the mean of both slopes; the last step, to sigma 0, Euler) on the grid
    diffusers' scheduling_flow_match_heun_discrete.py ``set_timesteps`` builds: ``linspace(1, sigma_min, N)`` shifted,
    ``sigma_min`` the training table's last level ``shift(1/1000)``, then 0."""
    steps, shift = 3, 3.0
    adapter, cond = VideoAudio(FlowMatchHeunDiscreteScheduler(shift=shift)), {"c": torch.tensor([[1.0], [-0.5]])}
    ours = sample_ode(adapter, cond, num_steps=steps, generator=torch.Generator().manual_seed(2))
    state = adapter.initial_noise(cond, torch.Generator().manual_seed(2))
    pinned, keep = state.components["video"].clone(), state.masks["video"].bool()
    x = dict(state.components)
    def shifted(s):
        return shift * s / (1 + (shift - 1) * s)

    sig = [float(shifted(s)) for s in torch.linspace(1.0, shifted(1e-3), steps).double()] + [0.0]

    def vel(x, sigma):
        inp = {"video": torch.where(keep, x["video"], pinned), "audio": x["audio"]}
        return adapter.velocity(LatentState(inp), torch.full((2,), sigma), cond).components

    for i in range(steps):
        d1 = vel(x, sig[i])
        pred = {k: x[k] + (sig[i + 1] - sig[i]) * d1[k] for k in x}
        if sig[i + 1] == 0:
            x = pred
            continue
        d2 = vel(pred, sig[i + 1])
        x = {k: x[k] + (sig[i + 1] - sig[i]) * (d1[k] + d2[k]) / 2 for k in x}
    x["video"] = torch.where(keep, x["video"], pinned)
    for name in ("video", "audio"):
        assert_close(ours.components[name], x[name], rtol=0, atol=1e-5)
