"""``first_frame_conditioning_p`` on ltx2_t2av (docs/ltx2.md, "First-frame conditioning"): ltx-trainer's text-to-video
option (``training_strategies/text_to_video.py``, ``base_strategy.py`` ``_create_first_frame_conditioning_mask``):
per sample a Bernoulli(p) draw; a drawn sample's first latent frame keeps its clean latent, its tokens get timestep 0
and leave the loss; the audio is untouched.

Held here against hand computations on the tiny checkpoint: the noised state and the timesteps the transformer gets,
the loss; ``p = 0`` is the training without the option, bit for bit; the draws' share and their seeding; the same
decisions for VAE-encoded and stored (tensor-parquet) latents; sampling and GRPO never pin.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import LTX2Pipeline
from ff_ltx2 import LTX2T2AVAdapter
from ltx2_geometry import ADAPTER_KWARGS, FPS, FRAMES, SIZE
from torch.utils.data import default_collate

from ff_core.adapter import ConditionInput
from ff_core.errors import ConfigError
from ff_core.module import FlowModule
from ff_core.objectives import SFTObjective
from ff_core.objectives.flow_matching import CONDITION_STREAM, child_generator, prepare_batch_condition
from ff_core.objectives.sft import flow_matching_error

PROMPTS = ["a red square with a low tone", "a blue square with a high tone"]
LATENT_FRAMES, TOKENS_PER_FRAME = (FRAMES - 1) // 2 + 1, (SIZE // 8) ** 2


@pytest.fixture(scope="module")
def adapter(tiny_ltx2):
    """``p = 1``; tests set ``first_frame_conditioning_p`` on it for other shares (restored)."""
    return LTX2T2AVAdapter.from_pretrained(tiny_ltx2("t2av"), **ADAPTER_KWARGS, first_frame_conditioning_p=1.0)


@pytest.fixture
def share(adapter):
    def set_share(p: float) -> LTX2T2AVAdapter:
        adapter.first_frame_conditioning_p = p
        return adapter

    yield set_share
    adapter.first_frame_conditioning_p = 1.0


def targets(n: int = 2) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    t = torch.arange(round(FRAMES / FPS * 16000)) / 16000
    return [[torch.randint(0, 256, (FRAMES, 3, SIZE, SIZE), dtype=torch.uint8, generator=g),
             (0.3 * torch.sin(2 * torch.pi * 220.0 * (i + 1) * t)).repeat(2, 1)] for i in range(n)]  # fmt: skip


@pytest.fixture(scope="module")
def batch(adapter):
    conditions = adapter.preprocess([ConditionInput(p) for p in PROMPTS])
    return {"prompt": PROMPTS, "condition": default_collate(conditions), "target": targets(), "rows": conditions}


class Calls:
    """The transformer's inputs (and outputs) of every forward while attached (a hook, the model runs for real)."""

    def __init__(self, transformer):
        self.inputs, self.outputs = [], []
        self.handle = transformer.register_forward_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs, output):
        self.inputs.append({k: v.detach().clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
        self.outputs.append(tuple(o.detach().clone() for o in output))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def test_p1_pins_every_first_latent_frame_clean_at_timestep_0_and_out_of_the_loss(adapter, batch):
    """By hand, at sigma (0.7, 0.4): the video state the transformer gets is ``(1 - s) x + s n`` except the first
    latent frame, ``x`` itself (packed by LTX2Pipeline's ``_pack_latents``); its timestep is ``1000 s`` per token and 0
    on the first frame's 16 tokens, the audio's ``1000 s`` (B,); the loss is ``0.5 mean_video + 0.5 mean_audio`` of
    the squared errors with the video mean over frames 1.. only."""
    condition = adapter.prepare_condition(batch["condition"], generator=torch.Generator().manual_seed(0))
    assert condition["first_frame_pinned"].tolist() == [True, True]
    clean = adapter.encode_output(batch["target"], condition)
    mask = torch.ones(2, 1, LATENT_FRAMES, 1, 1)
    mask[:, :, 0] = 0
    torch.testing.assert_close(clean.masks["video"], mask, rtol=0, atol=0)
    sigma = torch.tensor([0.7, 0.4])
    noise = clean.randn_like(torch.Generator().manual_seed(1))
    with Calls(adapter.transformer) as calls:
        loss = flow_matching_error(adapter, clean, condition, sigma, noise)
    [got], [(v_out, a_out)] = calls.inputs, calls.outputs

    x, n = clean.components["video"], noise.components["video"]
    s = sigma.view(2, 1, 1, 1, 1)
    noisy = (1 - s) * x + s * n
    noisy[:, :, 0] = x[:, :, 0]  # the pinned frame: the clean latent
    torch.testing.assert_close(got["hidden_states"], LTX2Pipeline._pack_latents(noisy, 1, 1), rtol=0, atol=1e-7)
    xa, na = clean.components["audio"], noise.components["audio"]
    noisy_audio = (1 - sigma.view(2, 1, 1, 1)) * xa + sigma.view(2, 1, 1, 1) * na
    torch.testing.assert_close(got["audio_hidden_states"], LTX2Pipeline._pack_audio_latents(noisy_audio), rtol=0,
                               atol=1e-7)  # fmt: skip
    timestep = (1000 * sigma)[:, None].repeat(1, LATENT_FRAMES * TOKENS_PER_FRAME)
    timestep[:, :TOKENS_PER_FRAME] = 0
    torch.testing.assert_close(got["timestep"], timestep, rtol=0, atol=0)
    torch.testing.assert_close(got["audio_timestep"], 1000 * sigma, rtol=0, atol=0)

    video = LTX2Pipeline._unpack_latents(v_out, LATENT_FRAMES, SIZE // 8, SIZE // 8, 1, 1)
    audio = LTX2Pipeline._unpack_audio_latents(a_out, xa.shape[2], xa.shape[3])
    video_error = (video - (n - x)).pow(2)[:, :, 1:].flatten(1).mean(1)
    audio_error = (audio - (na - xa)).pow(2).flatten(1).mean(1)
    torch.testing.assert_close(loss, 0.5 * video_error + 0.5 * audio_error, rtol=1e-6, atol=0)
    # A one-frame latent (a 1-frame bucket) is never pinned: nothing would be left to learn (ltx-trainer's
    # first_frame_end_idx < sequence_length).
    assert adapter._clean_state(x[:, :, :1], xa, condition).masks == {}


def test_p0_trains_as_without_the_option_bit_for_bit(share, batch):
    """``p = 0``: no draw, no mask, a (B,) timestep; the SFT loss is the one of conditions prepared without the
    objective's generator (how every LTX-2 run trained before the option: ``prepare_condition(batch)``), bit for bit,
    and the generator handed over is left untouched."""
    adapter = share(0.0)
    g = torch.Generator().manual_seed(7)
    state = g.get_state()
    condition = adapter.prepare_condition(batch["condition"], generator=g)
    assert "first_frame_pinned" not in condition and torch.equal(g.get_state(), state)
    with Calls(adapter.transformer) as calls:
        ours = SFTObjective().training_loss(adapter, batch, torch.Generator().manual_seed(3))
    assert calls.inputs[0]["timestep"].shape == (2,)
    generator = torch.Generator().manual_seed(3)
    child_generator(generator, CONDITION_STREAM)  # (the stream SFT hands prepare_condition; it draws nothing)
    plain = adapter.prepare_condition(batch["condition"])
    clean = adapter.encode_output(batch["target"], plain, generator=child_generator(generator, 1))
    assert clean.masks == {}
    before = SFTObjective().loss(adapter, clean, plain, generator)
    torch.testing.assert_close(ours.loss, before.loss, rtol=0, atol=0)
    torch.testing.assert_close(ours.per_sample, before.per_sample, rtol=0, atol=0)


def test_half_the_samples_are_pinned_and_the_draws_repeat_with_the_seed(share, batch):
    """4000 samples at ``p = 0.5``: the pinned share within 0.03 of 0.5 (4 standard deviations); the same seed draws
    the same samples, another seed others; the caller's generator does not move (evaluation samples from it next)."""
    adapter = share(0.5)
    many = {k: v[:1].expand(4000, *v.shape[1:]) for k, v in batch["condition"].items()}

    def draw(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        state = g.get_state()
        pinned = adapter.prepare_condition(many, generator=g)["first_frame_pinned"]
        assert torch.equal(g.get_state(), state)
        return pinned

    a, b, c = draw(0), draw(0), draw(1)
    assert a.dtype == torch.bool and a.shape == (4000,)
    assert abs(a.float().mean().item() - 0.5) < 0.03
    assert torch.equal(a, b) and not torch.equal(a, c)
    # The objectives hand it their seeded condition stream (prepare_batch_condition sees the keyword).
    assert "first_frame_pinned" in prepare_batch_condition(adapter, many, torch.Generator().manual_seed(0))
    assert "first_frame_pinned" not in prepare_batch_condition(adapter, many)


def test_encoded_and_stored_latents_pin_the_same_samples(share, tiny_ltx2):
    """The kit's round trip (``ff data preprocess-latents`` rows, read back through ``stored_latents``) with pins: the
    decisions live in the condition, so VAE-encoded and stored latents of a batch get the same mask."""
    adapter = share(0.5)
    columns = LTX2T2AVAdapter.resolve_tensor_columns(tiny_ltx2("t2av"), ADAPTER_KWARGS)
    conditions = adapter.preprocess([ConditionInput(f"a red square {i}") for i in range(4)])
    seed = next(s for s in range(100) if 0 < adapter.prepare_condition(
        default_collate(conditions), generator=torch.Generator().manual_seed(s))["first_frame_pinned"].sum() < 4)
    condition = adapter.prepare_condition(default_collate(conditions), generator=torch.Generator().manual_seed(seed))
    clean = adapter.encode_output(targets(4), condition)
    rows = [columns.to_row(c, {k: v[i].cpu() for k, v in clean.components.items()}) for i, c in enumerate(conditions)]
    read = [columns.from_row(row) for row in rows]
    stored = adapter.stored_latents(default_collate([latents for _, latents in read]), condition)
    for name, tensor in clean.components.items():
        torch.testing.assert_close(stored.components[name], tensor, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(stored.masks["video"], clean.masks["video"], rtol=0, atol=0)
    assert clean.masks["video"][:, 0, 0, 0, 0].eq(0).tolist() == condition["first_frame_pinned"].tolist()


def test_sampling_and_grpo_rollouts_never_pin(share, batch):
    """Evaluation prepares its condition with its sampling generator, GRPO with a child of its own: the draw may sit
    in the condition, but only targets are pinned. At ``p = 1`` sampling gives the ``p = 0`` samples bit for bit, no
    state carries a mask and every timestep is (B,)."""
    from ff_core.objectives.grpo import GRPOObjective
    from ff_core.sampling import StochasticSampling

    def sample(p: float):
        adapter = share(p)
        g = torch.Generator().manual_seed(5)
        condition = prepare_batch_condition(adapter, batch["condition"], g)
        with Calls(adapter.transformer) as calls:
            state = adapter.sample(condition, num_steps=2, generator=g)
        return condition, state, calls

    condition, pinned, calls = sample(1.0)
    assert condition["first_frame_pinned"].all() and pinned.masks == {}
    assert all(c["timestep"].shape == (2,) for c in calls.inputs)
    _, plain, _ = sample(0.0)
    for name, tensor in plain.components.items():
        torch.testing.assert_close(pinned.components[name], tensor, rtol=0, atol=0, msg=name)

    adapter = share(1.0)
    objective = GRPOObjective(rewards=[{"name": "colour", "args": {"target": [0, 255, 0]}}], group_size=2,
                              prompts_per_step=1, num_steps=2, sampler=StochasticSampling(window=(0, 1)))  # fmt: skip
    with Calls(adapter.transformer) as calls:
        [rollout] = objective.rollout(adapter, {"prompt": PROMPTS, "condition": batch["condition"]},
                                      torch.Generator().manual_seed(0))  # fmt: skip
    assert rollout.trajectory.transitions and all(t.state.masks == {} for t in rollout.trajectory.transitions)
    assert calls.inputs and all(c["timestep"].shape == (2,) for c in calls.inputs)


def test_the_context_parallel_plan_splits_a_per_token_timestep(adapter, tiny_ltx2):
    """With ``p > 0`` the video timestep is (B, tokens) in training: the adapter marks its transformer, and T2AV's plan
    then splits the timestep with the tokens (dim 1, as I2AV's); at ``p = 0`` the (B,) timestep stays out of the plan
    (diffusers' hook would warn that it does not split it). tests/test_ltx2_context_parallel.py trains both ways."""
    timestep = LTX2T2AVAdapter.context_parallel_plan(adapter.transformer)[""]["timestep"]
    assert (timestep.split_dim, timestep.expected_dims) == (1, 2)
    plain = LTX2T2AVAdapter.from_pretrained(tiny_ltx2("t2av"), **ADAPTER_KWARGS)
    assert "timestep" not in LTX2T2AVAdapter.context_parallel_plan(plain.transformer)[""]


@pytest.mark.parametrize(("adapter_name", "p", "message"), [
    ("ltx2_t2av", 1.5, r"model\.adapter_kwargs\.first_frame_conditioning_p: must be a probability, 0 <= p <= 1, got "
                       r"1\.5"),
    ("ltx2_t2av", -0.1, r"first_frame_conditioning_p: must be a probability"),
    ("ltx2_t2av", "0.5", r"first_frame_conditioning_p: must be a probability, 0 <= p <= 1, got '0\.5'"),
    ("ltx2_i2av", 0.5, r"model\.adapter_kwargs\.first_frame_conditioning_p: ltx2_i2av pins its condition image's "
                       r"latent as every sample's first latent frame"),
])  # fmt: skip
def test_out_of_range_shares_fail_as_the_module_is_built(adapter_name, p, message):
    """Checked with the other ``adapter_kwargs`` before any weight loads (the checkpoint does not exist)."""
    with pytest.raises(ConfigError, match=message):
        FlowModule(adapter_name, "/nonexistent/ltx2",
                   adapter_kwargs={**ADAPTER_KWARGS, "first_frame_conditioning_p": p})
