"""Evaluation samples with the checkpoint's own scheduler, and Wan2.2 A14B's ``guidance_scale_2``, against diffusers'
``WanPipeline`` / ``WanImageToVideoPipeline`` run with the same seed (hence the same initial noise).

* Released Wan checkpoints ship ``UniPCMultistepScheduler(flow_prediction, use_flow_sigmas, flow_shift)``: ff's
  evaluation sample (``Adapter.sample``, what ``ff validate`` / ``ff predict`` and the validation grids call) is the
  pipeline's default output, pinned TI2V first frame and A14B experts included; ``scheduler: euler`` keeps Euler (the
  pipeline with a ``FlowMatchEulerDiscreteScheduler`` at the same shift); GRPO rollouts keep ff's Euler / SDE steps.
* Checkpoints shipping ``FlowMatchEulerDiscreteScheduler`` sample exactly as before, bit for bit.
* ``guidance_scale_2`` guides the low-noise expert's steps (``transformer_2`` below ``boundary_ratio``), as
  ``WanPipeline(guidance_scale=4.0, guidance_scale_2=3.0)`` (Wan2.2 T2V-A14B's recommended scales).
"""

from __future__ import annotations

import pytest
import torch
from ff_wan import WanI2VAdapter, WanT2VAdapter
from torch.testing import assert_close
from torch.utils.data import default_collate
from wan_geometry import ADAPTER_KWARGS, FRAMES, SIZE

from ff_core.adapter import ConditionInput
from ff_core.sampling import StochasticSampling, guided_velocity, sample_sde, step_log_prob

PROMPTS = ["a red square moving left", "a blue circle moving right"]
STEPS = 4
# fp32 on the CPU the two loops agree bit for bit (measured: every comparison below also passes at atol 0); ff's
# velocity takes sigma = t / 1000 and multiplies back, which may round once elsewhere: the tolerance allows it.
ATOL = 2e-5


def _condition(adapter: WanT2VAdapter, inputs: list[ConditionInput]):
    return adapter.prepare_condition(default_collate(adapter.preprocess(inputs)))


def _theirs(pipe, seed: int, **kwargs) -> torch.Tensor:
    """The pipeline's final latents (``output_type="latent"``: the normalised latents ff's sample returns)."""
    return pipe(num_inference_steps=STEPS, height=SIZE, width=SIZE, num_frames=FRAMES, output_type="latent",
                generator=torch.Generator().manual_seed(seed), max_sequence_length=16, **kwargs).frames  # fmt: skip


def _ours(adapter, condition, seed: int, **kwargs) -> torch.Tensor:
    return adapter.sample(condition, num_steps=STEPS, generator=torch.Generator().manual_seed(seed),
                          **kwargs).components["latent"]  # fmt: skip


# -- item 7: the checkpoint's scheduler ----------------------------------------------------------------------------
@pytest.mark.parametrize("guidance", [1.0, 5.0])
def test_unipc_checkpoint_samples_the_pipelines_default_output(tiny_wan_unipc, guidance):
    from diffusers import UniPCMultistepScheduler, WanPipeline

    path = tiny_wan_unipc("t2v")
    adapter = WanT2VAdapter.from_pretrained(path, **ADAPTER_KWARGS)
    assert type(adapter.scheduler) is UniPCMultistepScheduler and adapter.scheduler.config.use_flow_sigmas
    condition = _condition(adapter, [ConditionInput(p) for p in PROMPTS])
    ours = _ours(adapter, condition, 5, guidance_scale=guidance)
    theirs = _theirs(WanPipeline.from_pretrained(path), 5, prompt=PROMPTS, guidance_scale=guidance)
    assert_close(ours, theirs, rtol=0, atol=ATOL)
    euler = _ours(adapter, condition, 5, guidance_scale=guidance, scheduler="euler")
    assert (euler - theirs).abs().max() > 100 * ATOL  # today's Euler sampling is another sampler


def test_euler_option_keeps_euler_at_the_checkpoints_flow_shift(tiny_wan_unipc):
    """``model.sampling.scheduler: euler``: the pipeline with a ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)``
    in place of its UniPC (what ff sampled before)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    path = tiny_wan_unipc("t2v")
    adapter = WanT2VAdapter.from_pretrained(path, **ADAPTER_KWARGS)
    condition = _condition(adapter, [ConditionInput(p) for p in PROMPTS])
    pipe = WanPipeline.from_pretrained(path)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    theirs = _theirs(pipe, 5, prompt=PROMPTS, guidance_scale=5.0)
    assert_close(_ours(adapter, condition, 5, guidance_scale=5.0, scheduler="euler"), theirs, rtol=0, atol=ATOL)


def test_a_shift_override_sets_the_unipc_flow_shift(tiny_wan_unipc):
    from diffusers import UniPCMultistepScheduler, WanPipeline

    path = tiny_wan_unipc("t2v")
    adapter = WanT2VAdapter.from_pretrained(path, **ADAPTER_KWARGS)
    condition = _condition(adapter, [ConditionInput(PROMPTS[0])])
    pipe = WanPipeline.from_pretrained(path)
    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=7.0)  # diffusers' recipe
    theirs = _theirs(pipe, 2, prompt=PROMPTS[0], guidance_scale=1.0)
    assert_close(_ours(adapter, condition, 2, shift=7.0), theirs, rtol=0, atol=ATOL)


@pytest.mark.parametrize("variant", ["i2v", "ti2v", "a14b"])
def test_unipc_image_to_video_samples_the_pipelines_default_output(tiny_wan_unipc, variant):
    """Wan2.1 I2V (channel condition + CLIP), Wan2.2 TI2V (first latent frame pinned through the state's mask, per
    token timesteps) and I2V-A14B (two experts): each equals ``WanImageToVideoPipeline`` with its UniPC."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    path = tiny_wan_unipc(variant)
    adapter = WanI2VAdapter.from_pretrained(path, **ADAPTER_KWARGS)
    image = torch.randint(0, 256, (3, SIZE, SIZE), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    media = [{"type": "image", "data": image, "path": "first.png", "slot": "first_frame"}]
    condition = _condition(adapter, [ConditionInput(PROMPTS[0], media=media)])
    ours = _ours(adapter, condition, 3, guidance_scale=4.0)
    theirs = _theirs(WanImageToVideoPipeline.from_pretrained(path), 3, prompt=PROMPTS[0], guidance_scale=4.0,
                     image=Image.fromarray(image.permute(1, 2, 0).numpy()))  # fmt: skip
    if variant == "ti2v":  # the pipeline returns its first frame pinned to the image's latent, as ff keeps it
        assert_close(ours[:, :, :1], condition["first_frame_latent"][:, :, :1].float(), rtol=0, atol=0)
    assert_close(ours, theirs, rtol=0, atol=ATOL)


def test_euler_checkpoints_sample_exactly_as_before(tiny_wan):
    """A ``FlowMatchEulerDiscreteScheduler`` checkpoint: ``checkpoint`` is ff's Euler path, bit for bit (its pipeline
    parity: test_wan_t2v.py, test_wan_i2v.py, the conformance kit)."""
    adapter = WanT2VAdapter.from_pretrained(tiny_wan("t2v"), **ADAPTER_KWARGS)
    condition = _condition(adapter, [ConditionInput(p) for p in PROMPTS])
    state = adapter.initial_noise(condition, None)
    assert adapter.sampling_schedulers(state, STEPS) is None
    ours = _ours(adapter, condition, 4, guidance_scale=3.0)
    assert torch.equal(ours, _ours(adapter, condition, 4, guidance_scale=3.0, scheduler="euler"))


def test_grpo_rollouts_keep_ffs_euler_schedule_on_a_unipc_checkpoint(tiny_wan_unipc):
    """Rollouts step ff's SDE / ODE steps on the Euler sigmas (``sampling_sigmas``: FlowMatchEulerDiscreteScheduler at
    the UniPC's flow_shift), whatever scheduler the checkpoint ships."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    adapter = WanT2VAdapter.from_pretrained(tiny_wan_unipc("t2v"), **ADAPTER_KWARGS)
    condition = _condition(adapter, [ConditionInput(PROMPTS[0])])
    euler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    euler.set_timesteps(STEPS)
    with torch.no_grad():
        trajectory = sample_sde(adapter, condition, StochasticSampling(window=(0, STEPS)), num_steps=STEPS,
                                generator=torch.Generator().manual_seed(0))  # fmt: skip
    levels = [t.sigma for t in trajectory.transitions] + [trajectory.transitions[-1].sigma_next]
    assert_close(torch.tensor(levels, dtype=torch.float64), euler.sigmas.double(), rtol=0, atol=1e-6)


# -- item 6: guidance_scale_2 of Wan2.2 A14B -------------------------------------------------------------------
@pytest.mark.parametrize("scheduler", ["euler", "unipc"])
def test_a14b_guidance_scale_2_matches_wan_pipeline(tiny_wan, tiny_wan_unipc, scheduler):
    """T2V-A14B's recommended scales: 4.0 on the high-noise expert's steps, 3.0 on the low-noise expert's (the tiny
    checkpoint's boundary 0.875 falls between the steps of a 4-step run)."""
    from diffusers import WanPipeline

    path = (tiny_wan if scheduler == "euler" else tiny_wan_unipc)("t2v_a14b")
    adapter = WanT2VAdapter.from_pretrained(path, **ADAPTER_KWARGS)
    condition = _condition(adapter, [ConditionInput(p) for p in PROMPTS])
    ours = _ours(adapter, condition, 6, guidance_scale=4.0, guidance_scale_2=3.0)
    pipe = WanPipeline.from_pretrained(path)
    theirs = _theirs(pipe, 6, prompt=PROMPTS, guidance_scale=4.0, guidance_scale_2=3.0)
    assert_close(ours, theirs, rtol=0, atol=ATOL)
    one_scale = _theirs(pipe, 6, prompt=PROMPTS, guidance_scale=4.0)
    assert (one_scale - theirs).abs().max() > 100 * ATOL  # the second scale changes the low-noise steps


def _hand_cfg(network, state, sigma: float, condition, scale: float) -> torch.Tensor:
    """``v_neg + s (v - v_neg)`` with ``network`` (one expert) called directly at ``timestep = sigma * 1000``."""
    x = state.components["latent"]
    t = torch.full((x.shape[0],), sigma) * 1000

    def v(embeds: torch.Tensor) -> torch.Tensor:
        return network(hidden_states=x, timestep=t, encoder_hidden_states=embeds, return_dict=False)[0]

    cond, neg = v(condition["prompt_embeds"]), v(condition["negative_prompt_embeds"])
    return neg + scale * (cond - neg)


def test_grpo_rollouts_guide_the_low_noise_experts_steps_with_guidance_scale_2(tiny_wan):
    """``GRPOObjective(guidance_scale=4, guidance_scale_2=3)``: every transition of its rollout scores its ``x_next``
    under the velocity built by hand, above the boundary ``transformer`` at 4, below it ``transformer_2`` at 3; the
    replay (``transition_loss``'s guided velocity) is the same combination, so the first ratio is exactly 1."""
    from ff_core.objectives import GRPOObjective

    adapter = WanT2VAdapter.from_pretrained(tiny_wan("t2v_a14b"), **ADAPTER_KWARGS).eval()
    sampler = StochasticSampling(window=(0, STEPS))
    objective = GRPOObjective(rewards=[{"name": "colour", "args": {"target": [0, 255, 0]}}], group_size=2,
                              prompts_per_step=1, num_steps=STEPS, guidance_scale=4.0, guidance_scale_2=3.0,
                              sampler=sampler)  # fmt: skip
    batch = {"prompt": [PROMPTS[0]] * 2,
             "condition": default_collate(adapter.preprocess([ConditionInput(PROMPTS[0])] * 2))}  # fmt: skip
    [rollout] = objective.rollout(adapter, batch, torch.Generator().manual_seed(0))
    trajectory, condition = rollout.trajectory, rollout.condition
    experts = []
    with torch.no_grad():
        for t in trajectory.transitions:
            high = t.sigma >= adapter.boundary_ratio
            experts.append("transformer" if high else "transformer_2")
            network, scale = (adapter.transformer, 4.0) if high else (adapter.transformer_2, 3.0)
            v = t.state.map(lambda _: _hand_cfg(network, t.state, t.sigma, condition, scale))
            expected = step_log_prob(t.state, v, t.next, (t.sigma, t.sigma_next), sampler.kind, sampler.eta,
                                     trajectory.sigma_max)  # fmt: skip
            assert_close(t.log_prob, expected.log_prob, rtol=0, atol=1e-5)
            replay = guided_velocity(adapter, t.state, t.velocity_levels, condition, rollout.negative,
                                     objective.guidance_scale, scale_2=objective.guidance_scale_2)  # fmt: skip
            assert_close(replay.components["latent"], v.components["latent"], rtol=0, atol=1e-5)
    assert experts[0] == "transformer" and experts[-1] == "transformer_2"
    from ff_core.objectives.grpo import UpdateStats

    rollout.advantages = torch.ones(2)
    for t in trajectory.transitions:  # GRPO's own replay of every transition: the unchanged policy's ratio is 1
        stats = UpdateStats()
        objective.transition_loss(adapter, rollout, t, stats)
        assert_close(stats.first_ratio, torch.ones(2), rtol=0, atol=1e-6)


def test_guidance_scale_2_needs_two_experts(tiny_wan):
    adapter = WanT2VAdapter.from_pretrained(tiny_wan("t2v"), **ADAPTER_KWARGS)
    condition = _condition(adapter, [ConditionInput(PROMPTS[0])])
    with pytest.raises(ValueError, match=r"guidance_scale_2=3\.0: adapter 'wan2_t2v'.s checkpoint has no low-noise"):
        _ours(adapter, condition, 0, guidance_scale=4.0, guidance_scale_2=3.0)


# -- the FlowModule options: model.sampling.scheduler and guidance_scale_2 ------------------------------------------
@pytest.mark.parametrize("scheduler", ["checkpoint", "euler"])
def test_validation_and_predict_samples_are_the_pipelines_default_output(tiny_wan_unipc, scheduler):
    """``FlowModule.generate`` (what validation grids, ``ff validate`` and ``ff predict`` decode) at seed ``seed +
    batch_idx``: with ``checkpoint`` (default) the pipeline's default video for that seed, up to uint8 rounding; with
    ``euler`` another one (ff's Euler steps)."""
    from diffusers import WanPipeline

    from ff_core.module import FlowModule, SamplingConfig

    path = tiny_wan_unipc("t2v")
    module = FlowModule("wan2_t2v", str(path), adapter_kwargs=ADAPTER_KWARGS,
                        sampling=SamplingConfig(num_steps=STEPS, guidance_scale=5.0, seed=3, scheduler=scheduler))
    module.adapter = WanT2VAdapter.from_pretrained(path, **ADAPTER_KWARGS)
    batch = {"condition": default_collate(module.adapter.preprocess([ConditionInput(p) for p in PROMPTS])),
             "index": torch.tensor([0, 1]), "prompt": PROMPTS}  # fmt: skip
    ours = torch.stack([m[0] for m in module.generate(batch, batch_idx=1)["media"]])
    theirs = WanPipeline.from_pretrained(path)(
        PROMPTS, num_inference_steps=STEPS, guidance_scale=5.0, height=SIZE, width=SIZE, num_frames=FRAMES,
        output_type="pt", generator=torch.Generator().manual_seed(3 + 1), max_sequence_length=16).frames  # fmt: skip
    gap = (ours.float() - theirs * 255).abs().max()
    assert gap <= 0.5 + 1e-4 if scheduler == "checkpoint" else gap > 1


def test_sampling_options_are_checked_where_they_are_built(tiny_wan):
    from ff_core.errors import ConfigError
    from ff_core.module import FlowModule, SamplingConfig

    with pytest.raises(ValueError, match=r"model\.sampling\.scheduler must be one of \['checkpoint', 'euler'\]"):
        SamplingConfig(scheduler="unipc")
    with pytest.raises(ValueError, match=r"model\.sampling\.guidance_scale_2 must be a number in \[0, inf\]"):
        SamplingConfig(guidance_scale_2=-1.0)
    module = FlowModule("wan2_t2v", str(tiny_wan("t2v")), adapter_kwargs=ADAPTER_KWARGS,
                        sampling=SamplingConfig(guidance_scale=4.0, guidance_scale_2=3.0))
    with pytest.raises(ConfigError, match=r"model\.sampling\.guidance_scale_2: 3\.0 is set, but the 'wan2_t2v' "
                                          r"checkpoint .* has one denoiser"):  # fmt: skip
        module.configure_model()
    two = FlowModule("wan2_t2v", str(tiny_wan("t2v_a14b")), adapter_kwargs=ADAPTER_KWARGS,
                     sampling=SamplingConfig(guidance_scale=4.0, guidance_scale_2=3.0))
    two.configure_model()
    assert two.adapter.uses_second_expert(0.9) is False and two.adapter.uses_second_expert(0.5) is True
