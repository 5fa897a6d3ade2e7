"""Offline Diffusion-DPO against hand computations on tiny tensors (STYLE 6), and its reference policies.

The toy family below is an :class:`~ff_core.adapter.Adapter` whose denoiser has one weight ``a``:
``v(x, sigma) = a * x + sigma``. The reference is built by the real :class:`ReferenceModel` (a frozen deep copy for
full fine-tuning), so every test runs the objective's own code path; only the model is small enough to do by hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from ff_core.adapter import Adapter, LatentState
from ff_core.objectives import DPOObjective, TimestepSampler
from ff_core.objectives.dpo import PreferenceErrors, diffusion_dpo_loss, preference_errors
from ff_core.objectives.reference import ReferenceModel, lora_disabled


class Scale(nn.Module):
    def __init__(self, a: float) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(a))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a * x


@dataclass
class Call:
    """One denoiser forward as the toy saw it."""

    x: torch.Tensor
    sigma: torch.Tensor
    condition: object
    net: nn.Module


class ToyAdapter(Adapter):
    """``v = a x + sigma``; latents are the media themselves; records every stage call."""

    name = "toy-dpo"

    def __init__(self, a: float) -> None:
        super().__init__()
        self.net = Scale(a)
        self.calls: list[Call] = []
        self.prepared: list[object] = []
        self.encoded: list[object] = []

    @property
    def denoiser(self) -> nn.Module:
        return self.net

    def prepare_condition(self, batch):
        condition = {"prompt_embeds": batch["embeds"].clone()}
        self.prepared.append(condition)
        return condition

    def encode_output(self, media, condition, generator=None):
        self.encoded.append(condition)
        return LatentState({"latent": torch.stack([m[0] for m in media]).float()})

    def velocity(self, state, sigma, condition):
        x = state.components["latent"]
        self.calls.append(Call(x.detach().clone(), sigma.detach().clone(), condition, self.net))
        return LatentState({"latent": self.net(x) + sigma.reshape(-1, *([1] * (x.ndim - 1)))})


def toy(policy_a: float = 2.0, reference_a: float = 1.0, **kwargs) -> tuple[ToyAdapter, DPOObjective]:
    """A toy adapter whose reference (frozen copy taken at ``reference_a``) and policy (``policy_a``) differ, as after
    some training steps; the objective (beta 0.5, uniform sigma, ``kwargs``) is configured for full fine-tuning."""
    adapter = ToyAdapter(reference_a)
    objective = DPOObjective(beta=0.5, timesteps=TimestepSampler("uniform"), **kwargs)
    objective.configure_model(adapter, lora=False)
    with torch.no_grad():
        adapter.net.a.fill_(policy_a)
    return adapter, objective


def test_diffusion_dpo_loss_by_hand():
    """beta = 0.5; r = -beta/2 (e_theta - e_ref):
    sample 1: r_w = -0.25 (6.25 - 4.25) = -0.5, r_l = -0.25 (4.25 - 4.25) = 0; L = -log sigmoid(-0.5) = log(1 + e^0.5)
              = 0.974077; ranked wrong (r_w < r_l).
    sample 2: r_w = -0.25 (6.5 - 2.5) = -1, r_l = -0.25 (9 - 4) = -1.25; L = log(1 + e^-0.25) = 0.575939;
              ranked right."""
    errors = PreferenceErrors(policy_chosen=torch.tensor([6.25, 6.5]), policy_rejected=torch.tensor([4.25, 9.0]),
                              reference_chosen=torch.tensor([4.25, 2.5]), reference_rejected=torch.tensor([4.25, 4.0]))
    out = diffusion_dpo_loss(errors, beta=0.5)
    assert_close(out.reward_chosen, torch.tensor([-0.5, -1.0]))
    assert_close(out.reward_rejected, torch.tensor([0.0, -1.25]))
    assert_close(out.loss, torch.tensor([math.log1p(math.exp(0.5)), math.log1p(math.exp(-0.25))]))
    assert_close(out.accuracy, torch.tensor([0.0, 1.0]))
    # Policy = reference: every reward 0, the loss log 2 and the pair not (yet) ranked right.
    same = PreferenceErrors(*(torch.tensor([3.0]),) * 4)
    assert_close(diffusion_dpo_loss(same, 5000.0).loss, torch.tensor([math.log(2)]))
    # Large margins stay finite: -log sigmoid(x) is log1p(exp(-x)), not log(sigmoid(x)).
    far = PreferenceErrors(torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert_close(diffusion_dpo_loss(far, 5000.0).loss, torch.tensor([0.0]))
    assert_close(diffusion_dpo_loss(far, -5000.0).loss, torch.tensor([5000.0]))


def test_preference_errors_by_hand_with_shared_sigma_and_noise():
    """Policy v = 2 x + sigma, reference (frozen copy) v = x + sigma, e = mean over elements of (v - (eps - x0))^2.
    sample 1: sigma = 0.5, eps = [1, -1], x0_w = [1, 1], x0_l = [-1, 1]:
      x_w = 0.5 [1, 1] + 0.5 [1, -1] = [1, 0], target_w = eps - x0_w = [0, -2];
        e_theta(w) = ((2.5 - 0)^2 + (0.5 + 2)^2) / 2 = 6.25, e_ref(w) = ((1.5)^2 + (2.5)^2) / 2 = 4.25;
      x_l = [0, 0], target_l = [2, -2]: v = [0.5, 0.5] for both models, e_theta(l) = e_ref(l) = (1.5^2 + 2.5^2) / 2
        = 4.25.
    sample 2: sigma = 1 (x = eps = [1, 1] for both arms), x0_w = [0, 1], x0_l = [1, 1]: v_theta = [3, 3],
      v_ref = [2, 2]; target_w = [1, 0]: e_theta(w) = (4 + 9) / 2 = 6.5, e_ref(w) = (1 + 4) / 2 = 2.5;
      target_l = [0, 0]: e_theta(l) = 9, e_ref(l) = 4.
    These are the errors of test_diffusion_dpo_loss_by_hand; only the policy's weight gets a gradient."""
    adapter, objective = toy()
    chosen = LatentState({"latent": torch.tensor([[1.0, 1.0], [0.0, 1.0]])})
    rejected = LatentState({"latent": torch.tensor([[-1.0, 1.0], [1.0, 1.0]])})
    noise = LatentState({"latent": torch.tensor([[1.0, -1.0], [1.0, 1.0]])})
    sigma = torch.tensor([0.5, 1.0])
    errors = preference_errors(adapter, objective.reference, chosen, rejected, {}, sigma, noise)
    assert_close(errors.policy_chosen, torch.tensor([6.25, 6.5]))
    assert_close(errors.reference_chosen, torch.tensor([4.25, 2.5]))
    assert_close(errors.policy_rejected, torch.tensor([4.25, 9.0]))
    assert_close(errors.reference_rejected, torch.tensor([4.25, 4.0]))
    assert not errors.reference_chosen.requires_grad and errors.policy_chosen.requires_grad
    # Reference first (no graph kept while it runs), then the policy.
    (copy,) = objective.reference.copies()
    assert [c.net for c in adapter.calls] == [copy, copy, adapter.net, adapter.net] and copy is not adapter.net
    diffusion_dpo_loss(errors, 0.5).loss.mean().backward()
    assert adapter.net.a.grad is not None and copy.a.grad is None


def test_training_loss_draws_once_for_both_arms_and_both_models():
    """Two Monte-Carlo terms, uniform sigma. From the generator, per term: sigma ~ U(0, 1)^B, then eps ~ N(0, 1)^(B, 2)
    (the order SFT draws in), and nothing else. Every forward of a term (reference chosen, reference rejected, policy
    chosen, policy rejected) sees that sigma and that eps, recovered from its input as eps = (x_sigma - (1 - sigma) x0)
    / sigma; all of them, and both encodes, get the one prepared condition. The loss is the mean over terms and batch of
    log(1 + exp(beta/2 [(e_2(w) - e_1(w)) - (e_2(l) - e_1(l))])) with e_a(x0) = mean((a x_sigma + sigma - eps + x0)^2),
    computed here from the drawn numbers alone."""
    adapter, objective = toy(num_train_timesteps=2)
    (copy,) = objective.reference.copies()
    chosen = torch.tensor([[1.0, 2.0], [0.0, -1.0], [3.0, 0.5]])
    rejected = torch.tensor([[-1.0, 0.0], [2.0, 2.0], [0.0, 0.0]])
    batch = {"condition": {"embeds": torch.ones(3, 4)},
             "chosen": [[c] for c in chosen], "rejected": [[r] for r in rejected]}  # fmt: skip
    out = objective.training_loss(adapter, batch, torch.Generator().manual_seed(0))

    (condition,) = adapter.prepared
    assert adapter.encoded == [condition, condition] and all(c.condition is condition for c in adapter.calls)
    g, expected, accuracy = torch.Generator().manual_seed(0), [], []
    assert len(adapter.calls) == 8
    for term in range(2):
        sigma, eps = torch.rand(3, generator=g), torch.randn(3, 2, generator=g)
        calls = adapter.calls[4 * term : 4 * term + 4]
        assert [c.net for c in calls] == [copy, copy, adapter.net, adapter.net]
        for call, x0 in zip(calls, (chosen, rejected, chosen, rejected)):
            assert_close(call.sigma, sigma, rtol=0, atol=0)
            assert_close((call.x - (1 - sigma[:, None]) * x0) / sigma[:, None], eps)

        def e(a, x0):
            x = (1 - sigma[:, None]) * x0 + sigma[:, None] * eps
            return ((a * x + sigma[:, None] - (eps - x0)) ** 2).mean(1)

        margin = -0.25 * ((e(2, chosen) - e(1, chosen)) - (e(2, rejected) - e(1, rejected)))
        expected.append(torch.log1p(torch.exp(-margin)))
        accuracy.append((margin > 0).float())
    assert_close(out.per_sample, torch.stack(expected).mean(0))
    assert_close(out.loss, torch.stack(expected).mean())
    assert_close(out.metrics["implicit_accuracy"], torch.stack(accuracy).mean())
    assert out.sigma.shape == (2, 3) and set(out.metrics) >= {
        "implicit_accuracy", "reward_chosen", "reward_rejected", "error_policy_chosen", "error_policy_rejected",
        "error_reference_chosen", "error_reference_rejected"}  # fmt: skip


def test_objective_settings_and_batches_are_checked():
    with pytest.raises(ValueError, match=r"model\.objective\.beta must be > 0"):
        DPOObjective(beta=0)
    with pytest.raises(ValueError, match=r"model\.objective\.num_train_timesteps must be >= 1"):
        DPOObjective(num_train_timesteps=0)
    batch = {"condition": {"embeds": torch.ones(1, 4)}, "target": [[torch.zeros(2)]]}
    with pytest.raises(RuntimeError, match="no reference model"):
        DPOObjective().training_loss(ToyAdapter(1.0), batch)
    adapter, objective = toy()
    with pytest.raises(KeyError, match=r"needs preference batches \('chosen', 'rejected'\), got keys \['condition', "
                                       r"'target'\]"):
        objective.training_loss(adapter, batch)
    uneven = {"condition": {"embeds": torch.ones(1, 4)}, "chosen": [[torch.zeros(2)]], "rejected": [[torch.zeros(3)]]}
    with pytest.raises(ValueError, match="chosen and rejected latents differ"):
        objective.training_loss(adapter, uneven)


# -- the reference policies ---------------------------------------------------------------------------------
def test_full_copy_reference_is_restored_even_when_the_forward_raises():
    adapter, objective = toy(policy_a=2.0, reference_a=1.0)
    reference, policy = objective.reference, adapter.net
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), reference.active(adapter):
        assert adapter.denoiser is reference.copies()[0] and float(adapter.denoiser.a) == 1.0
        raise RuntimeError("boom")
    assert adapter.net is policy and adapter.denoiser is policy and adapter.net.a.item() == 2.0
    reference.train()
    assert not reference.training and not any(p.requires_grad for p in reference.parameters())


def test_offloaded_reference_gives_the_same_velocity_and_stays_out_of_the_state_dict():
    """accelerate's cpu_offload (execution device: the CPU here) keeps the copy out of the registered modules."""
    adapter, objective = toy()
    offloaded = ReferenceModel(ToyAdapter(1.0), lora=False, offload=True)  # the same toy's copy at a = 1
    state = LatentState({"latent": torch.tensor([[1.0, -2.0]])})
    with torch.no_grad():
        with objective.reference.active(adapter):
            kept = adapter.velocity(state, torch.tensor([0.3]), {}).components["latent"]
        with offloaded.active(adapter):
            streamed = adapter.velocity(state, torch.tensor([0.3]), {}).components["latent"]
    assert_close(streamed, kept) and assert_close(kept, torch.tensor([[1.3, -1.7]]))
    assert adapter.net.a.item() == 2.0
    assert not offloaded.state_dict() and objective.reference.state_dict().keys() == {"networks.0.a"}


def test_lora_reference_switches_the_lora_off_and_back_on_even_on_errors():
    """A peft LoRA on a linear layer, its B made non-zero (as after training): inside, the layer computes the base
    W x; outside, W x + (alpha / r) B A x again, with the LoRA weights still trainable and the base still frozen."""
    from peft import LoraConfig, inject_adapter_in_model

    net = nn.Sequential(nn.Linear(3, 3))
    base = net[0].weight.detach().clone(), net[0].bias.detach().clone()
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, target_modules=["0"]), net)
    for name, p in net.named_parameters():
        p.requires_grad_("lora_" in name)
    with torch.no_grad():
        net[0].lora_B["default"].weight.fill_(0.5)
    x = torch.tensor([[1.0, 2.0, -1.0]])
    a, b = net[0].lora_A["default"].weight, net[0].lora_B["default"].weight
    with_lora = x @ base[0].T + base[1] + 2.0 * (x @ a.T @ b.T)
    assert_close(net(x), with_lora)
    with torch.no_grad(), pytest.raises(RuntimeError, match="boom"), lora_disabled(net):
        assert_close(net(x), x @ base[0].T + base[1])
        raise RuntimeError("boom")
    assert_close(net(x), with_lora)
    assert {n: p.requires_grad for n, p in net.named_parameters()} == {
        "0.base_layer.weight": False, "0.base_layer.bias": False,
        "0.lora_A.default.weight": True, "0.lora_B.default.weight": True}  # fmt: skip
    with pytest.raises(ValueError, match="needs peft LoRA layers"):
        ReferenceModel(ToyAdapter(1.0), lora=True)


def test_component_weights_set_how_each_candidate_error_reduces():
    """Two streams, sigma 1 (x = eps): video x0 [0, 0], eps [1, 1]; audio x0 [0], eps [2]. Policy v = 2 x + 1: video
    error (3 - 1)^2 = 4 per element, audio (5 - 2)^2 = 9; reference v = x + 1: video 1, audio 1. Pooled by element
    count the policy's error is (4 + 4 + 9) / 3 = 17/3; with ``{video: 1, audio: 0}`` it is the video's 4 alone."""

    class TwoStreams(ToyAdapter):
        def velocity(self, state, sigma, condition):
            return state.map(lambda x: self.net(x) + sigma.reshape(-1, *([1] * (x.ndim - 1))))

    adapter = TwoStreams(1.0)
    objective = DPOObjective(beta=0.5, component_weights={"video": 1.0, "audio": 0.0})
    objective.configure_model(adapter, lora=False)
    with torch.no_grad():
        adapter.net.a.fill_(2.0)
    clean = LatentState({"video": torch.zeros(1, 2), "audio": torch.zeros(1, 1)})
    noise = LatentState({"video": torch.ones(1, 2), "audio": torch.full((1, 1), 2.0)})
    sigma = torch.tensor([1.0])
    pooled = preference_errors(adapter, objective.reference, clean, clean, {}, sigma, noise)
    assert_close(pooled.policy_chosen, torch.tensor([17 / 3])) and assert_close(pooled.reference_chosen, torch.ones(1))
    video = preference_errors(adapter, objective.reference, clean, clean, {}, sigma, noise, objective.component_weights)
    assert_close(video.policy_chosen, torch.tensor([4.0])) and assert_close(video.reference_rejected, torch.ones(1))
    # Weights sum the component means, unnormalised: {video: 1, audio: 1} 4 + 9 = 13 for the policy, 1 + 1 = 2 for the
    # reference; the implicit rewards (and so beta) see that scale, docs/objectives.md.
    both = preference_errors(adapter, objective.reference, clean, clean, {}, sigma, noise, {"video": 1.0, "audio": 1.0})
    assert_close(both.policy_chosen, torch.tensor([13.0])) and assert_close(both.reference_chosen, torch.tensor([2.0]))


def test_dpo_beta_sees_the_scale_of_the_component_weights():
    """The MiniMax H3 spec's "loss = mean over video + mean over audio" is {video: 1, audio: 1}; its beta is not
    interchangeable with that of {video: 0.5, audio: 0.5}. Policy v = 2 x + 1, reference v = x + 1, at sigma 1
    (x = eps), eps video [1, 1], audio [2]: an element's error is (eps + 1 + x0)^2 for the policy, (1 + x0)^2 for the
    reference. Chosen x0 = 0: policy video 4, audio 9; reference 1, 1. Rejected x0 video [1, 1], audio [0]: policy 9, 9;
    reference 4, 1. With {1, 1}: e = (13, 2, 18, 5), r_w - r_l = -beta/2 (11 - 13) = beta; with {0.5, 0.5} half that:
    at beta 0.5 the losses are log(1 + e^-0.5) and log(1 + e^-0.25), and {0.5, 0.5} at beta 1 is {1, 1} at 0.5."""

    class TwoStreams(ToyAdapter):
        def velocity(self, state, sigma, condition):
            return state.map(lambda x: self.net(x) + sigma.reshape(-1, *([1] * (x.ndim - 1))))

    adapter = TwoStreams(1.0)
    reference = DPOObjective(beta=0.5)
    reference.configure_model(adapter, lora=False)
    with torch.no_grad():
        adapter.net.a.fill_(2.0)
    chosen = LatentState({"video": torch.zeros(1, 2), "audio": torch.zeros(1, 1)})
    rejected = LatentState({"video": torch.ones(1, 2), "audio": torch.zeros(1, 1)})
    noise = LatentState({"video": torch.ones(1, 2), "audio": torch.full((1, 1), 2.0)})
    sigma = torch.tensor([1.0])

    def loss(weights, beta):
        errors = preference_errors(adapter, reference.reference, chosen, rejected, {}, sigma, noise, weights)
        return errors, diffusion_dpo_loss(errors, beta).loss

    errors, summed = loss({"video": 1.0, "audio": 1.0}, 0.5)
    assert_close(torch.stack([errors.policy_chosen, errors.reference_chosen, errors.policy_rejected,
                              errors.reference_rejected]).flatten(), torch.tensor([13.0, 2.0, 18.0, 5.0]))  # fmt: skip
    assert_close(summed, torch.tensor([math.log1p(math.exp(-0.5))]))
    assert_close(loss({"video": 0.5, "audio": 0.5}, 0.5)[1], torch.tensor([math.log1p(math.exp(-0.25))]))
    assert_close(loss({"video": 0.5, "audio": 0.5}, 1.0)[1], summed)


def test_diffusion_dpo_beta_maps_to_the_velocity_beta_by_one_minus_sigma_squared():
    """Diffusion-DPO (Wallace et al.'s train.py) scores epsilon predictions: ``model_losses = (model_pred -
    target).pow(2).mean(dims)``, target the noise, ``inside_term = -0.5 * beta_dpo * (model_diff - ref_diff)``,
    ``loss = -logsigmoid(inside_term).mean()``. Reading the epsilon prediction off the same velocities,
    ``eps_hat = x_sigma + (1 - sigma) v_hat``, its loss with beta_eps equals ff's on the velocity errors with
    ``velocity_beta(beta_eps, sigma) = beta_eps (1 - sigma)^2``, per sample sigma; not with beta_eps itself. At SD3.5's
    median training sigma (logit-normal median sigmoid(0) = 0.5, shift 3: 3 * 0.5 / (1 + 2 * 0.5) = 0.75) the factor
    is 1/16. flow_grpo's scripts/train_sd3_dpo.py scores velocities (``target = noise - model_input``) with the same
    ``-0.5 * beta * w_l_diff``: its beta (100) is ff's unchanged."""
    from ff_core.objectives.dpo import velocity_beta

    g = torch.Generator().manual_seed(0)
    x0 = {arm: torch.randn(3, 4, 2, 2, generator=g) for arm in ("w", "l")}
    eps = torch.randn(3, 4, 2, 2, generator=g)
    sigma = torch.tensor([0.2, 0.75, 0.9])
    s = sigma.view(-1, 1, 1, 1)
    x_sigma = {arm: (1 - s) * x0[arm] + s * eps for arm in x0}
    v = {(m, arm): eps - x0[arm] + 0.3 * torch.randn(3, 4, 2, 2, generator=g) for m in ("theta", "ref") for arm in x0}

    def velocity_error(m, arm):
        return ((v[m, arm] - (eps - x0[arm])) ** 2).mean(dim=[1, 2, 3])

    def epsilon_loss(m, arm):  # Wallace et al.: the epsilon prediction against the noise
        return ((x_sigma[arm] + (1 - s) * v[m, arm] - eps) ** 2).mean(dim=[1, 2, 3])

    beta_eps = 5000.0
    model_diff = epsilon_loss("theta", "w") - epsilon_loss("theta", "l")
    ref_diff = epsilon_loss("ref", "w") - epsilon_loss("ref", "l")
    wallace = -torch.nn.functional.logsigmoid(-0.5 * beta_eps * (model_diff - ref_diff))
    errors = PreferenceErrors(velocity_error("theta", "w"), velocity_error("theta", "l"), velocity_error("ref", "w"),
                              velocity_error("ref", "l"))  # fmt: skip
    assert_close(diffusion_dpo_loss(errors, velocity_beta(beta_eps, sigma)).loss, wallace)
    assert not torch.allclose(diffusion_dpo_loss(errors, beta_eps).loss, wallace)
    assert velocity_beta(5000.0, 0.75) == 5000.0 / 16
    # flow_grpo's SD3 DPO: inside_term = -0.5 * beta * ((theta_w - ref_w) - (theta_l - ref_l)) on velocity MSEs.
    w_l_diff = (errors.policy_chosen - errors.reference_chosen) - (errors.policy_rejected - errors.reference_rejected)
    assert_close(diffusion_dpo_loss(errors, 100.0).loss, -torch.nn.functional.logsigmoid(-0.5 * 100.0 * w_l_diff))
