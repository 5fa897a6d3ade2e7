"""Flow-GRPO: advantages and the clipped loss by hand; rollout/replay and the first ratio on a toy adapter."""

import math

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from ff_core.adapter import Adapter, LatentState
from ff_core.contracts import IMAGE_OUT, PipelineIOContract
from ff_core.objectives.grpo import GRPOObjective, UpdateStats, slice_batch
from ff_core.objectives.grpo_loss import clipped_policy_loss, group_advantages
from ff_core.rewards.base import Reward
from ff_core.sampling import StochasticSampling, step_gaussian


def test_group_advantages_by_hand():
    """Groups {1, 2} and {3, 5}: means 1.5 and 4, population stds 0.5 and 1, eps 1e-4."""
    rewards, groups = torch.tensor([1.0, 3.0, 2.0, 5.0]), torch.tensor([7, 9, 7, 9])
    expected = torch.tensor([-0.5 / 0.5001, -1 / 1.0001, 0.5 / 0.5001, 1 / 1.0001])
    assert_close(group_advantages(rewards, groups), expected)
    # global std: the population std of all four rewards, sqrt(((1-2.75)^2 + ... ) / 4) = sqrt(2.1875)
    centred = torch.tensor([-0.5, -1.0, 0.5, 1.0])
    assert_close(group_advantages(rewards, groups, global_std=True), centred / (math.sqrt(2.1875) + 1e-4))
    # a group of equal rewards teaches nothing
    assert_close(group_advantages(torch.tensor([2.0, 2.0]), torch.tensor([0, 0])), torch.zeros(2))


def test_clipped_loss_by_hand():
    """clip 0.2. ratio 1.5: A=+1 -> max(-1.5, -1.2) = -1.2 (clipped: no gain beyond 1.2); A=-1 -> max(1.5, 1.2) = 1.5.
    ratio 0.5: A=+1 -> max(-0.5, -0.8) = -0.5; A=-1 -> max(0.5, 0.8) = 0.8. A=10 is clipped to adv_clip_max=5."""
    old = torch.zeros(5)
    new = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5, 1.0]))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 10.0])
    terms = clipped_policy_loss(new, old, adv, clip_range=0.2, adv_clip_max=5.0)
    assert_close(terms.loss, torch.tensor([-1.2, 1.5, -0.5, 0.8, -5.0]))
    assert_close(terms.ratio, torch.tensor([1.5, 1.5, 0.5, 0.5, 1.0]))
    assert terms.clipped_high.tolist() == [1, 1, 0, 0, 0] and terms.clipped_low.tolist() == [0, 0, 1, 1, 0]


def test_clipped_loss_gradient_is_minus_advantage_times_ratio_inside_the_clip():
    lp = torch.tensor([0.05], requires_grad=True)
    clipped_policy_loss(lp, torch.zeros(1), torch.tensor([2.0]), 0.2, 5.0).loss.sum().backward()
    assert_close(lp.grad, torch.tensor([-2.0 * math.exp(0.05)]))


class ToyAdapter(Adapter):
    """Latents (B, 3, 2, 2) mapped to images; velocity a linear map of (x, sigma, condition)."""

    name = "toy-grpo"
    io_contract = PipelineIOContract(outputs=(IMAGE_OUT,))

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(12 + 1 + 2, 12)

    @property
    def denoiser(self):
        return self.net

    def prepare_condition(self, batch):
        return {"c": batch["c"]}

    def velocity(self, state, sigma, condition):
        x = state.components["latent"].flatten(1)
        v = self.net(torch.cat([x, sigma[:, None], condition["c"]], 1))
        return LatentState({"latent": v.view(-1, 3, 2, 2)})

    def initial_noise(self, condition, generator=None):
        return LatentState({"latent": torch.randn(condition["c"].shape[0], 3, 2, 2, generator=generator)})

    def sampling_sigmas(self, num_steps, shift=None, state=None):
        return torch.linspace(1.0, 0.0, num_steps + 1)

    def decode(self, state):
        x = state.components["latent"]
        return [[((img.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)] for img in x]


class RedReward(Reward):
    name = "red"

    def __call__(self, batch):
        return torch.stack([img.float()[0].mean() / 255 for img in batch.outputs(("image",))])


class Host:
    """What GRPO asks of the LightningModule in one process (the optimiser calls, logging): not the model path."""

    device = torch.device("cpu")

    def __init__(self, adapter, lr=1e-2):
        self.adapter = adapter
        self.optimizer = torch.optim.SGD(adapter.net.parameters(), lr=lr)
        self.logged = {}

    def optimizers(self):
        return self.optimizer

    def lr_schedulers(self):
        return None

    def manual_backward(self, loss):
        loss.backward()

    def clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm):
        torch.nn.utils.clip_grad_norm_(self.adapter.net.parameters(), gradient_clip_val)

    def log(self, name, value, **kwargs):
        self.logged[name] = value


def objective(**kwargs):
    args = dict(rewards=[{"name": "tests.objectives.test_grpo:RedReward", "label": "red"}], group_size=2,
                prompts_per_step=2, num_steps=4, sampler=StochasticSampling(window=(0, 3)), micro_batch_size=2,
                clip_range=0.2)
    return GRPOObjective(**{**args, **kwargs})


def batch():
    return {"prompt": ["a", "a", "b", "b"], "metadata": [{}] * 4, "index": torch.tensor([0, 0, 1, 1]),
            "group": torch.tensor([0, 0, 1, 1]), "condition": {"c": torch.tensor([[0.0, 1], [0, 1], [1, 0], [1, 0]])}}


def test_first_ratio_is_exactly_one_and_the_update_follows_the_advantages():
    """The first replayed transition of an unchanged policy has ratio exactly 1 (same micro-batches, eval mode, the
    stored x_next); the advantages are the per-group normalised rewards of the decoded samples; later inner epochs
    see the changed policy; every optimiser step changes the weights."""
    adapter, obj = ToyAdapter(), objective(num_inner_epochs=2, mini_batches=2)
    host = Host(adapter)
    before = adapter.net.weight.detach().clone()
    obj.training_step(host, batch(), torch.Generator().manual_seed(0))
    assert host.logged["train/ratio_first_max_dev"] == 0
    assert host.logged["train/ratio"] != 1  # 4 optimiser steps: later ratios move
    assert not torch.equal(adapter.net.weight, before)
    assert adapter.training  # mode restored


@pytest.mark.parametrize("global_std", [True, False])
def test_advantages_are_group_normalised_decoded_rewards(global_std):
    """Centred per group, divided by the std of all the step's rewards (``global_std``, the default) or the group's."""
    adapter, obj = ToyAdapter(), objective(global_std=global_std)
    b = batch()
    rollouts = obj.rollout(adapter, b, torch.Generator().manual_seed(1))
    assert [len(r.trajectory.transitions) for r in rollouts] == [3, 3]
    metrics = obj.score(adapter, None, b, rollouts)
    media = [m for r in rollouts for m in adapter.decode(r.trajectory.final)]
    rewards = torch.stack([m[0].float()[0].mean() / 255 for m in media])
    expected = group_advantages(rewards, b["group"], global_std)
    assert_close(torch.cat([r.advantages for r in rollouts]), expected)
    assert_close(metrics["reward/red_mean"], rewards.mean())


def test_kl_to_the_lora_free_reference_is_zero_before_training_and_has_gradient():
    """kl_beta > 0 with a frozen copy (full fine-tuning): the first transition's KL is 0 (policy = reference) and
    the loss's gradient still flows; on the velocity and on the step mean alike."""
    for kl_on in ("mean", "velocity"):
        adapter, obj = ToyAdapter(), objective(kl_beta=0.5, kl_on=kl_on)
        adapter.requires_grad_(True)
        obj.configure_model(adapter, lora=False)
        b = batch()
        rollouts = obj.rollout(adapter, b, torch.Generator().manual_seed(2))
        obj.score(adapter, None, b, rollouts)
        from ff_core.objectives.grpo import UpdateStats

        stats = UpdateStats()
        loss = obj.transition_loss(adapter, rollouts[0], rollouts[0].trajectory.transitions[0], stats)
        assert stats.kl[0].abs().max() == 0
        loss.backward()
        assert adapter.net.weight.grad.abs().sum() > 0


class ToyVideoAudio(ToyAdapter):
    """Two components of unequal sizes: ``video`` (B, 3, 2, 2), 12 elements, and ``audio`` (B, 2), whose velocity
    reads the video's (as LTX-2's audio stream attends to the video); the streams weigh equally by default."""

    name = "toy-grpo-av"
    default_component_weights = {"video": 1.0, "audio": 1.0}

    def velocity(self, state, sigma, condition):
        video = super().velocity(LatentState({"latent": state.components["video"]}), sigma, condition)
        video = video.components["latent"]
        audio = -0.5 * state.components["audio"] + video.flatten(1)[:, :2]
        return LatentState({"video": video, "audio": audio})

    def initial_noise(self, condition, generator=None):
        n = condition["c"].shape[0]
        return LatentState({"video": torch.randn(n, 3, 2, 2, generator=generator),
                            "audio": torch.randn(n, 2, generator=generator)})  # fmt: skip


@pytest.mark.parametrize(("weights", "frozen", "expected"), [
    (None, (), {"video": 1.0, "audio": 1.0}),  # the adapter's default_component_weights
    ({"video": 1.0, "audio": 3.0}, (), {"video": 1.0, "audio": 3.0}),  # the objective's win
    ({"video": 0.5, "audio": 0.5}, (), {"video": 0.5, "audio": 0.5}),  # half the log-prob: the ratio's log halves
    (None, ("audio",), {"video": 1.0}),  # model.frozen_components: the audio's terms leave log-prob and KL
])  # fmt: skip
def test_log_prob_ratio_and_kl_weigh_each_components_mean(weights, frozen, expected):
    """docs/objectives.md, "Several latent components": the rollout's stored log-prob of a transition is each
    component's mean log-density times its weight, summed (unnormalised), as ``component_weights`` say (else the
    adapter's default), by hand; after a
    change of the policy the replayed ratio and the velocity-KL to the reference reduce the same way, by hand."""
    adapter, obj = ToyVideoAudio(), objective(component_weights=weights, kl_beta=0.5, kl_on="velocity")
    obj.freeze_components(frozen)
    adapter.requires_grad_(True)
    obj.configure_model(adapter, lora=False)  # the reference: a frozen copy of the untrained policy
    [r, _] = obj.rollout(adapter, batch(), torch.Generator().manual_seed(1))
    t = r.trajectory.transitions[1]

    def reduce(per_component):  # sum_k w_k mean_k, unnormalised
        return sum(w * per_component[k].flatten(1).mean(1) for k, w in expected.items())

    def log_prob(v):
        dens = {}
        for name, (s, sn) in t.levels.items():
            mean, std = step_gaussian("flow_sde", t.state.components[name], v.components[name], s, sn, 0.7,
                                      r.trajectory.sigma_max[name])  # fmt: skip
            dens[name] = torch.distributions.Normal(mean, std).log_prob(t.next.components[name])
        return reduce(dens)

    with torch.no_grad():
        v_old = adapter.velocity(t.state, torch.full((2,), t.sigma), r.condition)
        assert_close(t.log_prob, log_prob(v_old))
        step = torch.randn(adapter.net.weight.shape, generator=torch.Generator().manual_seed(3))
        adapter.net.weight.add_(0.05 * step)
        v_new = adapter.velocity(t.state, torch.full((2,), t.sigma), r.condition)
    r.advantages = torch.tensor([1.0, -0.5])
    stats = UpdateStats()
    loss = obj.transition_loss(adapter, r, t, stats)
    ratio = torch.exp(log_prob(v_new) - t.log_prob)
    assert_close(stats.ratio[0], ratio)
    assert (ratio - 1).abs().min() > 1e-3  # the policy moved
    kl = reduce({k: (v_new.components[k] - v_old.components[k]) ** 2 for k in v_new.components})
    assert_close(stats.kl[0], kl)
    clipped = ratio.clamp(1 - obj.clip_range, 1 + obj.clip_range)
    assert_close(loss, (torch.maximum(-r.advantages * ratio, -r.advantages * clipped) + 0.5 * kl).mean())


def test_bad_settings_name_the_key():
    with pytest.raises(ValueError, match="model.objective.group_size must be >= 1"):
        objective(group_size=0)
    with pytest.raises(ValueError, match=r"model.objective.group_size must be >= 2 \(advantages compare"):
        objective(group_size=1)  # one sample per group: every advantage would be 0
    with pytest.raises(ValueError, match="model.objective.kl_on"):
        objective(kl_on="logits")
    with pytest.raises(ValueError, match=r"sampler.window \[0, 5\) reaches past step 3"):
        objective(sampler=StochasticSampling(window=(0, 5)))


def test_settings_the_run_cannot_honour_fail_before_weights_load():
    """``mini_batches`` above the rank's micro-batches would silently give fewer optimiser steps; a batch without
    group ids would make every advantage 0."""
    from ff_core.errors import ConfigError

    objective(mini_batches=2).check_run(dp_world_size=1)  # 4 samples in micro-batches of 2: 2 runs
    with pytest.raises(ConfigError, match=r"model.objective.mini_batches: 2 optimiser steps per pass, but each rank "
                                          r"trains on only 1 micro-batch\(es\) \(2 samples per rank"):
        objective(mini_batches=2).check_run(dp_world_size=2)
    with pytest.raises(ValueError, match="do not divide over 3 data-parallel ranks"):
        objective().check_run(dp_world_size=3)
    adapter, obj = ToyAdapter(), objective()
    b = batch()
    rollouts = obj.rollout(adapter, b, torch.Generator().manual_seed(1))
    del b["group"]
    with pytest.raises(ValueError, match="GRPO: the batch carries no `group` ids"):
        obj.score(adapter, None, b, rollouts)


def test_slice_batch_cuts_nested_collated_conditions():
    value = {"a": torch.arange(4), "b": [torch.arange(8).view(4, 2)], "n": 3}
    out = slice_batch(value, slice(1, 3))
    assert out["a"].tolist() == [1, 2] and out["b"][0].tolist() == [[2, 3], [4, 5]] and out["n"] == 3


def test_rollout_progress_shows_on_the_rich_bar_and_clears():
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import RichProgressBar
    from lightning.pytorch.callbacks.progress.rich_progress import CustomProgress

    from ff_core.objectives.grpo import _progress

    bar = RichProgressBar()
    bar.progress = CustomProgress(disable=True)  # what the bar builds when training starts
    bar.train_progress_bar_id = bar.progress.add_task("Epoch 0/9", total=4)
    module = SimpleNamespace(_trainer=SimpleNamespace(is_global_zero=True, progress_bar_callback=bar))
    _progress(module, 8, 32)
    assert bar.progress.tasks[0].description == "Epoch 0/9 · rollout 8/32"
    _progress(module, 16, 32)
    assert bar.progress.tasks[0].description == "Epoch 0/9 · rollout 16/32"
    _progress(module, 32, 32)
    assert bar.progress.tasks[0].description == "Epoch 0/9"
