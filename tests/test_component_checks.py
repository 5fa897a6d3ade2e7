"""Per-component configuration checked as the module is built, before any weight loads (docs/plugins.md, "Checks
before weights load"): every shipped adapter declares its ``latent_components``, so a per-component guidance map with
a misspelled or an extra name is one ConfigError naming the key; freezing every component is refused; and
``guidance_rescale`` reaches ``Adapter.sample`` only when it rescales (an adapter overriding ``sample`` without it
keeps working). GRPO's ``guidance_scale`` / ``guidance_rescale`` take the same forms, checked alike; a single-float
GRPO config rolls out and replays bit for bit as plain CFG did."""

from __future__ import annotations

import pytest
import torch
from ff_sd3.adapter import SD3Adapter
from torch.utils.data import default_collate

from ff_core.adapter import ConditionInput, LatentState
from ff_core.errors import ConfigError
from ff_core.module import FlowModule, SamplingConfig
from ff_core.objectives.grpo import GRPOObjective, UpdateStats
from ff_core.plugins import get_adapter_class
from ff_core.sampling import StochasticSampling, sde_step

NOWHERE = "/nonexistent/checkpoint"  # nothing is read: the checks need the class alone
COMPONENTS = {"sd3-5": ["latent"], "wan2_t2v": ["latent"], "wan2_i2v": ["latent"], "ltx2_t2av": ["video", "audio"],
              "ltx2_i2av": ["video", "audio"], "minimax-h3-t2va": ["video", "audio"],
              "minimax-h3-fl2va": ["video", "audio"], "minimax-h3-ref2va": ["video", "audio"]}  # fmt: skip


@pytest.mark.parametrize("adapter", sorted(COMPONENTS))
def test_every_shipped_adapter_declares_its_latent_components(adapter):
    assert list(get_adapter_class(adapter).latent_components) == COMPONENTS[adapter]


@pytest.mark.parametrize("adapter", ["sd3-5", "wan2_t2v", "minimax-h3-t2va", "minimax-h3-ref2va"])
@pytest.mark.parametrize("key", ["guidance_scale", "guidance_rescale"])
@pytest.mark.parametrize("how", ["misspelled", "extra"])
def test_a_per_component_guidance_map_names_exactly_the_components(adapter, key, how):
    names = COMPONENTS[adapter]
    value = 1.0 if key == "guidance_scale" else 0.5  # MiniMax H3 has no CFG: scale 1 passes its own check
    mapping = {n: value for n in names}
    if how == "misspelled":
        mapping[names[0] + "s"] = mapping.pop(names[0])
    else:
        mapping["speech"] = value
    with pytest.raises(ConfigError, match=rf"model\.sampling\.{key}: names .*; {adapter}'s latent components are"):
        FlowModule(adapter, NOWHERE, sampling=SamplingConfig(**{key: mapping}))
    FlowModule(adapter, NOWHERE, sampling=SamplingConfig(**{key: {n: value for n in names}}))  # exact: accepted


@pytest.mark.parametrize("adapter", ["ltx2_t2av", "minimax-h3-t2va"])
def test_freezing_every_component_is_refused_before_weights_load(adapter):
    """Every branch frozen leaves nothing to train (``configure_optimizers`` would fail after weights load)."""
    with pytest.raises(ConfigError, match=r"model\.frozen_components: \['audio', 'video'\] freezes every latent "
                                          rf"component of {adapter} \(\['video', 'audio'\]\): nothing would train"):
        FlowModule(adapter, NOWHERE, frozen_components=["video", "audio"])
    FlowModule(adapter, NOWHERE, frozen_components=["audio"])


class NoRescaleSD3(SD3Adapter):
    """An adapter written against interface 1.1: it overrides ``sample`` without ``guidance_rescale``."""

    def sample(self, condition, *, num_steps=20, guidance_scale=1.0, generator=None, shift=None,
               embedded_guidance=None):  # fmt: skip
        return super().sample(condition, num_steps=num_steps, guidance_scale=guidance_scale, generator=generator,
                              shift=shift, embedded_guidance=embedded_guidance)  # fmt: skip


def test_guidance_rescale_reaches_sample_only_when_it_rescales(tiny_sd3):
    prompts = ["a red square", "a blue circle"]
    media = {}
    for adapter in ("test_component_checks:NoRescaleSD3", "sd3-5"):
        module = FlowModule(adapter, str(tiny_sd3), adapter_kwargs={"resolution": 32},
                            sampling=SamplingConfig(num_steps=2, guidance_scale=2.0, seed=3))  # fmt: skip
        module.setup("validate")
        module.configure_model()
        rows = module.adapter.preprocess([ConditionInput(p) for p in prompts])
        batch = {"condition": default_collate(rows), "index": torch.arange(2), "prompt": prompts}
        media[adapter] = torch.stack([m[0] for m in module.generate(batch, 0)["media"]])
    torch.testing.assert_close(media["sd3-5"], media["test_component_checks:NoRescaleSD3"], rtol=0, atol=0)
    # Asked for, it is refused before any weight loads rather than as a TypeError at the first validation.
    module = FlowModule("test_component_checks:NoRescaleSD3", str(tiny_sd3), adapter_kwargs={"resolution": 32},
                        sampling=SamplingConfig(guidance_rescale=0.7))  # fmt: skip
    with pytest.raises(ConfigError, match=r"model\.sampling\.guidance_rescale: 0\.7, but adapter 'sd3-5' overrides "
                                          r"sample\(\) without a guidance_rescale argument"):
        module.setup("validate")


def grpo(**guidance) -> GRPOObjective:
    return GRPOObjective(rewards=[{"name": "brightness"}], group_size=2, prompts_per_step=1, num_steps=3,
                         sampler=StochasticSampling(window=(0, 2)), **guidance)  # fmt: skip


@pytest.mark.parametrize("key", ["guidance_scale", "guidance_rescale"])
def test_grpo_guidance_maps_name_the_components_before_weights_load(key):
    """GRPO's per-component guidance is checked as ``model.sampling``'s: a misspelled stream is one ConfigError naming
    ``model.objective.init_args.<key>`` (nothing is read); an out-of-range value fails as the objective is built."""
    value = 2.0 if key == "guidance_scale" else 0.5
    with pytest.raises(ConfigError, match=rf"model\.objective\.init_args\.{key}: names \['audios', 'video'\]; "
                                          r"ltx2_t2av's latent components are \['video', 'audio'\]"):
        FlowModule("ltx2_t2av", NOWHERE, objective=grpo(**{key: {"video": value, "audios": value}}))
    FlowModule("ltx2_t2av", NOWHERE, objective=grpo(**{key: {"video": value, "audio": value}}))  # exact: accepted
    with pytest.raises(ValueError, match=r"model\.objective\.init_args\.guidance_rescale must be a number in "
                                         r"\[0, 1\] or a mapping"):
        grpo(guidance_rescale={"video": 1.5, "audio": 0.5})


def test_single_float_grpo_guidance_rolls_out_and_replays_as_plain_cfg(tiny_sd3):
    """Tiny SD3, ``guidance_scale: 2.0``: every stored transition is bitwise the one drawn by hand from plain CFG
    ``v_neg + 2 (v - v_neg)`` (today's combination, no rescale) with the rollout generator; ``{latent: 2.0}`` and a
    zero ``guidance_rescale`` (one or per component) give the same bits; the first replay's ratio is exactly 1."""
    adapter = SD3Adapter.from_pretrained(str(tiny_sd3), resolution=32)
    adapter.eval()
    prompts = ["a red square", "a red square"]
    batch = {"prompt": prompts, "condition": default_collate(adapter.preprocess([ConditionInput(p) for p in prompts]))}
    forms = [{"guidance_scale": 2.0}, {"guidance_scale": {"latent": 2.0}, "guidance_rescale": 0.0},
             {"guidance_scale": 2.0, "guidance_rescale": {"latent": 0.0}}]  # fmt: skip
    objectives = [grpo(**form) for form in forms]
    rollouts = [objective.rollout(adapter, batch, torch.Generator().manual_seed(0))[0] for objective in objectives]
    first = rollouts[0]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        state = adapter.initial_noise(first.condition, g)
        for i, t in enumerate(first.trajectory.transitions):
            assert torch.equal(t.state.components["latent"], state.components["latent"])
            sigma = torch.full((2,), t.sigma)
            v, v_neg = (adapter.velocity(t.state, sigma, c).components["latent"] for c in (first.condition,
                                                                                          first.negative))  # fmt: skip
            out = sde_step(t.state, LatentState({"latent": v_neg + 2.0 * (v - v_neg)}), t.levels, "flow_sde", 0.7, g,
                           first.trajectory.sigma_max)  # fmt: skip
            for other in rollouts:
                o = other.trajectory.transitions[i]
                assert torch.equal(o.next.components["latent"], out.next.components["latent"])
                assert torch.equal(o.log_prob, out.log_prob)
            state = t.next
    for objective, rollout in zip(objectives, rollouts):
        rollout.advantages = torch.tensor([1.0, -1.0])
        stats = UpdateStats()
        objective.transition_loss(adapter, rollout, rollout.trajectory.transitions[0], stats)
        assert torch.equal(stats.first_ratio, torch.ones(2))
