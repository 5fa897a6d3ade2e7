"""H3 training on sampling's coupled schedules: one weighting draw ``u`` per sample, video noised at
``shift_sigma(u, 12)`` and audio at ``shift_sigma(u, 3)`` (``Adapter.timestep_shifts``), the transformer called with
the two timesteps; a recipe ``timesteps.shift`` puts both streams back on one level. Hand computations on the tiny
T2VA checkpoint."""

from __future__ import annotations

import pytest
import torch
from ff_minimax import MiniMaxH3T2VAAdapter
from ff_minimax.testing import TINY_FRAMES, TINY_SIZE

from ff_core.adapter import ConditionInput
from ff_core.data.cache.collation import collate_conditions
from ff_core.objectives.flow_matching import TimestepSampler
from ff_core.objectives.sft import SFTObjective


@pytest.fixture(scope="module")
def adapter(tiny_minimax):
    return MiniMaxH3T2VAAdapter.from_pretrained(tiny_minimax("t2va"), height=TINY_SIZE, width=TINY_SIZE,
                                                num_frames=TINY_FRAMES).eval()  # fmt: skip


def setup(adapter):
    rows = adapter.preprocess([ConditionInput("a red square with a low tone", None, [])])
    condition = adapter.prepare_condition(collate_conditions(rows))
    clean = adapter.initial_noise(condition, torch.Generator().manual_seed(3)).map(lambda x: 0.5 * x)
    return condition, clean


def recorded_timesteps(adapter):
    calls = []
    hook = adapter.transformer.register_forward_pre_hook(
        lambda module, args, kw: calls.append(kw["timestep"].detach().clone()), with_kwargs=True)  # fmt: skip
    return calls, hook


def test_sft_step_noises_each_stream_on_its_own_schedule_by_hand(adapter):
    assert adapter.timestep_shifts() == {"video": 12.0, "audio": 3.0}
    condition, clean = setup(adapter)
    objective = SFTObjective(timesteps=TimestepSampler(logit_mean=0.3, logit_std=1.2))
    calls, hook = recorded_timesteps(adapter)
    try:
        with torch.no_grad():
            out = objective.loss(adapter, clean, condition, torch.Generator().manual_seed(11))
    finally:
        hook.remove()
    # by hand: the generator's first draw is u (logit-normal), then the video noise, then the audio noise
    g = torch.Generator().manual_seed(11)
    u = torch.sigmoid(torch.randn(1, generator=g) * 1.2 + 0.3)
    sigma = {"video": 12 * u / (1 + 11 * u), "audio": 3 * u / (1 + 2 * u)}
    noise = {k: torch.randn(x.shape, generator=g) for k, x in clean.components.items()}
    noisy = clean.map(lambda x: x)
    for k, x in clean.components.items():
        noisy.components[k] = (1 - sigma[k]) * x + sigma[k] * noise[k]
    with torch.no_grad():
        pred = adapter.component_velocity(noisy, sigma, condition)  # parity with the pipeline: conformance tests
    expected = sum(((pred.components[k] - (noise[k] - clean.components[k])) ** 2).mean() for k in sigma)
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.sigma, sigma["video"][None])  # logged: the video's (first component's) level
    assert sigma["audio"] < sigma["video"]
    # the one transformer forward saw the two timesteps t = 1 - sigma (text rows at the video's)
    torch.testing.assert_close(calls[0].flatten().sort().values,
                               torch.cat([1 - sigma["video"], 1 - sigma["audio"]]).sort().values)  # fmt: skip


def test_recipe_shift_puts_both_streams_on_one_level(adapter):
    condition, clean = setup(adapter)
    objective = SFTObjective(timesteps=TimestepSampler(shift=5.0))
    calls, hook = recorded_timesteps(adapter)
    try:
        with torch.no_grad():
            out = objective.loss(adapter, clean, condition, torch.Generator().manual_seed(11))
    finally:
        hook.remove()
    u = torch.sigmoid(torch.randn(1, generator=torch.Generator().manual_seed(11)))
    torch.testing.assert_close(out.sigma, (5 * u / (1 + 4 * u))[None])
    assert calls[0].unique().numel() == 1  # one level for video, audio and text rows


def test_adapter_table_refuses_two_schedules(adapter):
    _, clean = setup(adapter)
    with pytest.raises(ValueError, match="per-component shifts.*schedule='continuous'"):
        TimestepSampler(schedule="adapter").resolve_shifts(adapter, clean)


def test_dpo_arms_and_reference_share_the_two_levels(tiny_minimax):
    """DPO: the policy and the reference, on the chosen and the rejected arm, all four forwards at the one draw's
    (1 - sigma_video, 1 - sigma_audio)."""
    from ff_core.objectives.dpo import DPOObjective

    adapter = MiniMaxH3T2VAAdapter.from_pretrained(tiny_minimax("t2va"), height=TINY_SIZE, width=TINY_SIZE,
                                                   num_frames=TINY_FRAMES).eval()  # fmt: skip
    objective = DPOObjective(beta=100.0)
    objective.configure_model(adapter, lora=False)  # a frozen copy of the transformer as the reference
    condition, chosen = setup(adapter)
    rejected = chosen.map(lambda x: -x)
    calls = []
    networks = [adapter.transformer, *objective.reference.copies()]
    hooks = [n.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["timestep"].flatten().sort().values),
                                         with_kwargs=True) for n in networks]  # fmt: skip
    try:
        with torch.no_grad():
            out = objective.loss(adapter, chosen, rejected, condition, torch.Generator().manual_seed(11))
    finally:
        for h in hooks:
            h.remove()
    u = torch.sigmoid(torch.randn(1, generator=torch.Generator().manual_seed(11)))
    levels = torch.cat([1 - 12 * u / (1 + 11 * u), 1 - 3 * u / (1 + 2 * u)]).sort().values
    assert len(calls) == 4 and torch.isfinite(out.loss)
    for t in calls:
        torch.testing.assert_close(t, levels)
