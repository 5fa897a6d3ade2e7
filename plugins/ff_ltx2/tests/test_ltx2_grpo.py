"""Flow-GRPO on ltx2_t2av: a step's log-probability weighs the video and the audio stream as the SFT / DPO error does
(docs/ltx2.md, "Objectives"): ``(mean_video + mean_audio) / 2`` by default, not pooled by element count, where the
audio would be a small share of log pi and of the ratio. Checked by hand through a real GRPO step of the tiny
checkpoint (rollout, then the replayed ratio and clipped loss after the LoRA moved), and through ``ff fit`` with the
audio stream frozen. Per-stream CFG with guidance rescale (``{video: 2, audio: 4}``, rescale 0.5) in the rollout,
the replay and the KL term, checked against LTX2Pipeline's guidance maths (diffusers' ``rescale_noise_cfg``)."""

from __future__ import annotations

import json

import pytest
import torch
from ff_ltx2 import LTX2T2AVAdapter
from ltx2_geometry import ADAPTER_KWARGS
from torch.testing import assert_close
from torch.utils.data import default_collate

from ff_core.adapter import ConditionInput
from ff_core.lora import LoRAConfig, apply_lora
from ff_core.objectives.grpo import GRPOObjective, UpdateStats
from ff_core.objectives.reference import lora_disabled
from ff_core.sampling import StochasticSampling, step_gaussian

PROMPTS = ["a red square with a low tone", "a red square with a low tone"]


@pytest.fixture(scope="module")
def adapter(tiny_ltx2):
    adapter = LTX2T2AVAdapter.from_pretrained(tiny_ltx2("t2av"), **ADAPTER_KWARGS)
    torch.manual_seed(0)  # peft draws lora_A from the global generator: the checks' margins are for these weights
    apply_lora(adapter, LoRAConfig(rank=2, alpha=2))
    return adapter


def grpo(**kwargs) -> GRPOObjective:
    """Two SDE steps of a 3-step schedule, one prompt x 2 samples (the recipe's colour reward; not scored here)."""
    return GRPOObjective(rewards=[{"name": "colour", "args": {"target": [0, 255, 0]}}], group_size=2,
                         prompts_per_step=1, num_steps=3, sampler=StochasticSampling(window=(0, 2)),
                         clip_range=0.2, **kwargs)  # fmt: skip


def by_hand(adapter, rollout, t, weights: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample, ``sum_k w_k m_k``, unnormalised (``m_k``: the mean Gaussian log-density of the stored ``x_next`` over
    component k's elements, torch.distributions), and the element-count pooling the core used before."""
    v = adapter.velocity(t.state, torch.full((2,), t.sigma), rollout.condition)
    dens = {}
    for name, (s, sn) in t.levels.items():
        mean, std = step_gaussian("flow_sde", t.state.components[name], v.components[name], s, sn, 0.7,
                                  rollout.trajectory.sigma_max[name])  # fmt: skip
        dens[name] = torch.distributions.Normal(mean, std).log_prob(t.next.components[name].float()).flatten(1)
    weighted = sum(w * dens[k].mean(1) for k, w in weights.items())
    pooled = torch.cat(list(dens.values()), 1).mean(1)
    return weighted, pooled


@pytest.mark.parametrize(("frozen", "weights"), [((), {"video": 0.5, "audio": 0.5}), (("audio",), {"video": 0.5})])
def test_grpo_step_weighs_the_streams_means(adapter, frozen, weights):
    """The rollout stores ``0.5 m_video + 0.5 m_audio`` (the adapter's default_component_weights; 320 video and 224
    audio latent elements at the test geometry, so the pooled value differs); after the LoRA moves, the replayed ratio
    ``exp(log pi - log pi_old)`` and the clipped surrogate equal the hand computation on the same weighting. With
    ``model.frozen_components: [audio]`` the audio's density leaves log pi: ``0.5 m_video`` alone."""
    objective = grpo()
    objective.freeze_components(frozen)
    inputs = [ConditionInput(p) for p in PROMPTS]
    batch = {"prompt": PROMPTS, "condition": default_collate(adapter.preprocess(inputs))}
    lora = {n: p for n, p in adapter.named_parameters() if "lora_B" in n}
    saved = {n: p.detach().clone() for n, p in lora.items()}
    adapter.eval()
    try:
        [rollout] = objective.rollout(adapter, batch, torch.Generator().manual_seed(0))
        t = rollout.trajectory.transitions[1]
        counts = {k: x[0].numel() for k, x in t.state.components.items()}
        assert counts == {"video": 320, "audio": 224}  # unequal streams: weighting and pooling differ
        with torch.no_grad():
            stored, pooled = by_hand(adapter, rollout, t, weights)
            g = torch.Generator().manual_seed(1)
            for p in lora.values():  # the policy moves (lora_B starts at zero)
                p.add_(0.02 * torch.randn(p.shape, generator=g))
        assert_close(t.log_prob, stored, rtol=1e-6, atol=1e-6)
        assert (t.log_prob - pooled).abs().min() > 1e-4
        rollout.advantages = torch.tensor([1.0, -0.5])
        stats = UpdateStats()
        loss = objective.transition_loss(adapter, rollout, t, stats)
        with torch.no_grad():
            new, _ = by_hand(adapter, rollout, t, weights)
        ratio = torch.exp(new - t.log_prob)
        assert (ratio - 1).abs().max() > 1e-4  # the policy moved (0.5 m_video halves the log-ratio: one sample ~5e-6)
        assert_close(stats.ratio[0], ratio, rtol=1e-5, atol=1e-6)
        clipped = ratio.clamp(1 - objective.clip_range, 1 + objective.clip_range)
        expected = torch.maximum(-rollout.advantages * ratio, -rollout.advantages * clipped).mean()
        assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        loss.backward()  # with gradient through the replayed velocity
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in lora.values())
    finally:
        with torch.no_grad():
            for n, p in lora.items():
                p.copy_(saved[n])
                p.grad = None


def test_grpo_with_frozen_audio_trains_the_video_alone(tiny_ltx2, tmp_path):
    """``model.frozen_components: [audio]`` under GRPO through ``ff fit`` with full fine-tuning (and GRPO's own
    ``component_weights`` from the command line, which keep the audio's log-density term: freezing is about
    parameters): every audio-stream parameter bit-identical to the checkpoint's after 2 iterations, video ones
    changed; the replayed log-prob equals the rollout's (first ratio exactly 1)."""
    from diffusers import LTX2VideoTransformer3DModel
    from test_ltx2_fit import fit

    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "train.txt").write_text("a red square\na low tone\n")
    (prompts / "test.txt").write_text("a green square\n")
    base = LTX2VideoTransformer3DModel.from_pretrained(tiny_ltx2("t2av"), subfolder="transformer").state_dict()
    cli = fit("grpo_tiny.yaml", tiny_ltx2("t2av"), [{"name": "prompts", "dataset_dir": str(prompts)}],
              tmp_path / "run", "--model.objective.init_args.num_steps", "3", "--model.objective.init_args.sampler",
              json.dumps({"kind": "flow_sde", "eta": 0.7, "window": [0, 2], "num_sde_steps": None}),
              "--model.objective.init_args.prompts_per_step", "2", "--model.objective.init_args.group_size", "2",
              "--model.objective.init_args.micro_batch_size", "4", "--model.lora", "null",
              "--model.frozen_components", "[audio]", "--trainer.limit_val_batches", "0",
              "--model.objective.init_args.component_weights", json.dumps({"video": 2.0, "audio": 1.0}))  # fmt: skip
    metrics = cli.trainer.callback_metrics
    assert cli.trainer.global_step == 2 and float(metrics["train/ratio_first_max_dev"]) == 0.0
    objective = cli.model.objective  # weights set in the config are honoured, the frozen audio's included
    assert objective.frozen_components == frozenset() and objective.component_weights == {"video": 2.0, "audio": 1.0}
    trained = dict(cli.model.adapter.transformer.named_parameters())
    audio = set(cli.model.adapter.component_parameters("audio")["transformer"])
    assert len(audio) > 20
    for name in audio:
        assert not trained[name].requires_grad and torch.equal(trained[name], base[name]), name
    assert not torch.equal(trained["proj_out.weight"], base["proj_out.weight"])  # the video stream trained


SCALES, RESCALE = {"video": 2.0, "audio": 4.0}, 0.5


def guided_by_hand(adapter, state, levels, condition, negative, scales=SCALES, rescale=RESCALE) -> dict:
    """One step's guided velocity as LTX2Pipeline forms it: each stream's conditional and unconditional velocities at
    the stream's own level turned into x0 (``x - sigma v``), combined in the pipeline's delta form ``x0 + (s_k - 1)
    (x0 - x0_neg)``, rescaled to the conditional x0 by diffusers' ``rescale_noise_cfg``, and back to a velocity."""
    from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

    sigmas = {k: torch.full((2,), s) for k, (s, _) in levels.items()}
    cond, uncond = (adapter.component_velocity(state, sigmas, c) for c in (condition, negative))
    out = {}
    for k, (s, _) in levels.items():
        x = state.components[k].float()
        x0, x0_neg = x - s * cond.components[k].float(), x - s * uncond.components[k].float()
        out[k] = (x - rescale_noise_cfg(x0 + (scales[k] - 1) * (x0 - x0_neg), x0, rescale)) / s
    return out


def test_grpo_guides_each_stream_with_its_scale_and_rescale(adapter):
    """``guidance_scale: {video: 2, audio: 4}`` and ``guidance_rescale: 0.5``: every rollout step's ``x_next`` is the
    flow-SDE step of the hand-guided velocity with the rollout generator's noise, its log-prob the hand density; the
    first replay's ratio is exactly 1 and the KL to the (LoRA-free) reference exactly 0; after the LoRA moves, the
    replayed ratio and the velocity KL equal the hand computation with the same guidance on both policies."""
    objective = grpo(guidance_scale=dict(SCALES), guidance_rescale=RESCALE, kl_beta=0.1, kl_on="velocity")
    objective.configure_model(adapter, lora=True)
    inputs = [ConditionInput(p) for p in PROMPTS]
    batch = {"prompt": PROMPTS, "condition": default_collate(adapter.preprocess(inputs))}
    lora = {n: p for n, p in adapter.named_parameters() if "lora_B" in n}
    saved = {n: p.detach().clone() for n, p in lora.items()}
    adapter.eval()
    try:
        [rollout] = objective.rollout(adapter, batch, torch.Generator().manual_seed(0))
        cond, neg, sigma_max = rollout.condition, rollout.negative, rollout.trajectory.sigma_max
        g = torch.Generator().manual_seed(0)  # the rollout's draws: initial noise, then each SDE step's noise
        with torch.no_grad():
            state = adapter.initial_noise(cond, g)
            for t in rollout.trajectory.transitions:
                for k, x in state.components.items():
                    assert torch.equal(t.state.components[k], x)
                v = guided_by_hand(adapter, t.state, t.levels, cond, neg)
                plain = guided_by_hand(adapter, t.state, t.levels, cond, neg, {"video": 2.0, "audio": 2.0}, 0.0)
                dens = {}
                for k, (s, sn) in t.levels.items():
                    mean, std = step_gaussian("flow_sde", t.state.components[k], v[k], s, sn, 0.7, sigma_max[k])
                    noise = torch.randn(mean.shape, generator=g)
                    assert_close(t.next.components[k], (mean + std * noise).to(t.next.components[k].dtype),
                                 rtol=1e-5, atol=1e-5)  # fmt: skip
                    assert (plain[k] - v[k]).abs().max() > 1e-3  # the per-stream scale and the rescale matter
                    dens[k] = torch.distributions.Normal(mean, std).log_prob(t.next.components[k].float())
                expected = 0.5 * dens["video"].flatten(1).mean(1) + 0.5 * dens["audio"].flatten(1).mean(1)
                assert_close(t.log_prob, expected, rtol=1e-5, atol=1e-5)
                state = t.next
        first = rollout.trajectory.transitions[0]
        rollout.advantages = torch.tensor([1.0, -0.5])
        stats = UpdateStats()
        objective.transition_loss(adapter, rollout, first, stats)
        assert torch.equal(stats.first_ratio, torch.ones(2)) and torch.equal(stats.kl[0], torch.zeros(2))
        with torch.no_grad():
            gen = torch.Generator().manual_seed(1)
            for p in lora.values():  # the policy moves (lora_B starts at zero)
                p.add_(0.02 * torch.randn(p.shape, generator=gen))
        stats = UpdateStats()
        objective.transition_loss(adapter, rollout, first, stats)
        with torch.no_grad():
            v = guided_by_hand(adapter, first.state, first.levels, cond, neg)
            with lora_disabled(adapter):
                v_ref = guided_by_hand(adapter, first.state, first.levels, cond, neg)
            dens = {}
            for k, (s, sn) in first.levels.items():
                mean, std = step_gaussian("flow_sde", first.state.components[k], v[k], s, sn, 0.7, sigma_max[k])
                dens[k] = torch.distributions.Normal(mean, std).log_prob(first.next.components[k].float())
        new = 0.5 * dens["video"].flatten(1).mean(1) + 0.5 * dens["audio"].flatten(1).mean(1)
        ratio = torch.exp(new - first.log_prob)
        assert (ratio - 1).abs().max() > 1e-5
        assert_close(stats.ratio[0], ratio, rtol=1e-5, atol=1e-6)
        kl = sum(0.5 * ((v[k] - v_ref[k]) ** 2).flatten(1).mean(1) for k in v)
        assert kl.min() > 0
        assert_close(stats.kl[0], kl, rtol=1e-4, atol=1e-9)
    finally:
        with torch.no_grad():
            for n, p in lora.items():
                p.copy_(saved[n])
                p.grad = None
