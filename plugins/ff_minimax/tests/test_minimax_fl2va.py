"""minimax-h3-fl2va on the tiny checkpoint: parity with diffusers' ``MiniMaxH3ModularPipeline`` (first-only,
last-only and first-plus-last keyframes: presentation and prompt embeddings, keyframe latents, the realised prefix, one
denoiser call on both streams, a short sampling run from the same generator), one realised prefix per batch shared by
both DPO arms and the policy and reference forwards, and the keyframe rows kept out of the loss and of GRPO
log-probabilities (hand computations with the raw transformer)."""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
import torch
from diffusers import ModularPipeline
from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents
from ff_minimax.fl2va import MiniMaxH3FL2VAAdapter, to_pil
from ff_minimax.prefix import keyframe_layout, row_timesteps
from ff_minimax.testing import TINY_FRAMES, TINY_SIZE
from ff_minimax.text import load_processor
from PIL import Image

from ff_core.adapter import ConditionInput, LatentState
from ff_core.data.cache.collation import collate_conditions
from ff_core.objectives.dpo import DPOObjective
from ff_core.objectives.sft import flow_matching_error
from ff_core.sampling import StochasticSampling, sample_sde

LOADED = ("transformer", "vae", "audio_vae", "scheduler", "audio_scheduler", "text_encoder", "tokenizer")
KEYFRAMES = {"first": ("first_frame",), "last": ("last_frame",), "both": ("first_frame", "last_frame")}
PIPE_ARG = {"first_frame": "image", "last_frame": "last_image"}


@pytest.fixture(scope="module")
def adapter(tiny_minimax):
    return MiniMaxH3FL2VAAdapter.from_pretrained(tiny_minimax("fl2va"), height=TINY_SIZE, width=TINY_SIZE,
                                                 num_frames=TINY_FRAMES).eval()  # fmt: skip


@pytest.fixture(scope="module")
def pipe(tiny_minimax):
    path = tiny_minimax("fl2va")
    pipe = ModularPipeline.from_pretrained(str(path), workflow="fl2va")
    pipe.load_components(names=list(LOADED), torch_dtype=torch.float32)
    pipe.update_components(processor=load_processor(path))
    return pipe


def images() -> dict[str, torch.Tensor]:
    """A first keyframe of another aspect ratio than the canvas (stretched) and a last one (cover-cropped)."""
    g = torch.Generator().manual_seed(7)
    return {"first_frame": torch.randint(0, 256, (3, 20, 28), generator=g, dtype=torch.uint8),
            "last_frame": torch.randint(0, 256, (3, 24, 18), generator=g, dtype=torch.uint8)}  # fmt: skip


def item_for(slots: tuple[str, ...], prompt: str = "a red square with a low tone") -> ConditionInput:
    imgs = images()
    # Written last-first for "both": the packed order comes from the slots, never from the list order.
    return ConditionInput(prompt, None, [{"type": "image", "data": imgs[s], "slot": s} for s in reversed(slots)])


def run_pipeline(pipe, slots, seed: int, steps: int):
    """The pipeline from a seeded generator; its transformer calls recorded (inputs cloned)."""
    calls = []

    def record(module, args, kw):
        calls.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()})

    imgs = images()
    handle = pipe.transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        state = pipe(prompt="a red square with a low tone", height=TINY_SIZE, width=TINY_SIZE, num_frames=TINY_FRAMES,
                     num_inference_steps=steps + 1, generator=torch.Generator().manual_seed(seed), output_type="pt",
                     **{PIPE_ARG[s]: to_pil(imgs[s]) for s in slots})  # fmt: skip
    finally:
        handle.remove()
    return state, calls


def prepared(adapter, item):
    rows = adapter.preprocess([item])
    return rows, adapter.prepare_condition(collate_conditions(rows))


@pytest.mark.parametrize("which", list(KEYFRAMES))
def test_parity_with_the_modular_pipeline(adapter, pipe, which):
    slots = KEYFRAMES[which]
    steps, seed = 2, 3
    state, calls = run_pipeline(pipe, slots, seed, steps)
    rows, condition = prepared(adapter, item_for(slots))
    # Presentation and prompt embeddings (labels, vision blocks, the prompt), keyframe latents, anchors.
    torch.testing.assert_close(rows[0]["prompt_embeds"], state.get("prompt_embeds")[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(rows[0]["text_token_tags"], state.get("text_token_tags"))
    torch.testing.assert_close(rows[0]["keyframe_latents"], torch.cat(state.get("condition_latents")), rtol=0, atol=0)
    assert adapter.keyframe_anchors({k: v[0] for k, v in condition.items()}) == state.get("keyframe_anchors")

    # A short sampling run from the pipeline's generator: the prefix drawn first, then the video and audio noise.
    g = torch.Generator().manual_seed(seed)
    condition = adapter.realise(condition, generator=g)
    n_cond = int(state.get("num_condition_video_rows"))
    assert torch.equal(condition["prefix_video_rows"][0], state.get("condition_rows"))
    assert n_cond == 4 * len(slots)  # one 2x2-patch row per 4x4 latent patch of each keyframe
    with torch.no_grad():
        final = adapter.sample(condition, num_steps=steps, generator=g)
    torch.testing.assert_close(final.components["video"], state.get("latents"), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final.components["audio"][0], state.get("audio_latents"), rtol=1e-4, atol=1e-4)

    # One denoiser call: the recorded first forward, its target rows as our state, both streams at their levels.
    kw = calls[0]
    assert torch.equal(kw["hidden_states"][0, :n_cond], state.get("condition_rows"))  # the prefix rode unchanged
    with torch.no_grad():
        raw_v, raw_a = pipe.transformer(**{**kw, "return_dict": False})
    like = adapter.initial_noise(condition)
    target = LatentState({"video": unpatchify(kw["hidden_states"][0, n_cond:], like.components["video"]),
                          "audio": unrow(kw["audio_hidden_states"][0], like.components["audio"])})  # fmt: skip
    levels = {"video": torch.tensor([float(pipe.scheduler.sigmas[0])]),
              "audio": torch.tensor([float(pipe.audio_scheduler.sigmas[0])])}  # fmt: skip
    with torch.no_grad():
        ours = adapter.component_velocity(target, levels, condition)
    theirs_v = unpatchify(-raw_v[0, n_cond:], like.components["video"])  # data-ward -> ff's eps - x0, rows dropped
    torch.testing.assert_close(ours.components["video"], theirs_v, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.components["audio"], unrow(-raw_a[0], like.components["audio"]), rtol=1e-4,
                               atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("which", list(KEYFRAMES))
@pytest.mark.parametrize(("first", "last"), [((48, 64), (40, 24)), ((40, 24), (48, 64))])
def test_off_canvas_keyframes_are_put_on_the_canvas_as_the_resize_step_does(adapter, which, first, last):
    """48x64 and 40x24 keyframes onto the 32x32 canvas (issue 23, item 3) against diffusers' ``MiniMaxH3ResizeStep``
    run on its own: the first keyframe stretched with PIL LANCZOS, a follower cover-cropped with H3's rounding; the
    pixels ff presents to Qwen3-VL and VAE-encodes are the step's, bit for bit."""
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3ResizeStep

    g = torch.Generator().manual_seed(5)
    imgs = {"first_frame": torch.randint(0, 256, (3, *first), generator=g, dtype=torch.uint8),
            "last_frame": torch.randint(0, 256, (3, *last), generator=g, dtype=torch.uint8)}  # fmt: skip
    slots = KEYFRAMES[which]
    item = ConditionInput("p", None, [{"type": "image", "data": imgs[s], "slot": s} for s in slots])
    anchors, ours = adapter.fitted_keyframes(item)
    step = MiniMaxH3ResizeStep().init_pipeline()
    theirs = step(height=TINY_SIZE, width=TINY_SIZE, output=["keyframes", "keyframe_anchors"],
                  **{PIPE_ARG[s]: to_pil(imgs[s]) for s in slots})  # fmt: skip
    assert tuple(anchors) == theirs["keyframe_anchors"]
    for mine, ref in zip(ours, theirs["keyframes"], strict=True):
        assert mine.size == ref.size == (TINY_SIZE, TINY_SIZE)
        assert np.array_equal(np.asarray(mine), np.asarray(ref))
    # The first keyframe is stretched, never cropped: PIL LANCZOS onto the canvas.
    stretched = to_pil(imgs[slots[0]]).resize((TINY_SIZE, TINY_SIZE), Image.Resampling.LANCZOS)
    assert np.array_equal(np.asarray(ours[0]), np.asarray(stretched))


def unpatchify(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Rows (frame-major, then row-major 2x2 patches) back to (1, C, F, h, w), as MiniMaxH3AfterDenoiseStep does."""
    _, c, f, h, w = like.shape
    x = rows.reshape(1, f, h // 2, w // 2, c, 1, 2, 2).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return x.reshape(1, c, f, h, w)


def unrow(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Channel-major audio rows (2 L, C_a) back to (1, 2, C_a, L)."""
    _, channels, ca, length = like.shape
    return rows.reshape(channels, length, ca).permute(0, 2, 1)[None]


def targets(adapter, n: int = 2) -> list[list]:
    g = torch.Generator().manual_seed(11)
    t = torch.arange(adapter.audio_samples) / adapter.audio_rate
    return [[torch.randint(0, 256, (TINY_FRAMES, 3, TINY_SIZE, TINY_SIZE), generator=g, dtype=torch.uint8),
             (0.3 * torch.sin(2 * math.pi * 220.0 * (i + 1) * t)).repeat(2, 1)] for i in range(n)]  # fmt: skip


def test_one_realised_prefix_is_shared_by_both_dpo_arms_and_policy_and_reference(adapter):
    """prepare_condition runs once per batch; all four forwards (policy and reference, chosen and rejected) read the
    one prefix tensor it realised, and put exactly its rows in front of their target rows."""
    objective = DPOObjective(beta=100.0)
    objective.configure_model(adapter, lora=False)  # a frozen copy of the transformer as the reference
    rows = adapter.preprocess([item_for(KEYFRAMES["both"])])
    chosen, rejected = targets(adapter)
    batch = {"condition": collate_conditions(rows), "chosen": [chosen], "rejected": [rejected]}
    prepared_conditions, prefixes, fronts = [], [], []
    original_prepare, original_prefix = adapter.prepare_condition, adapter.prefix_rows

    def prepare(b):
        prepared_conditions.append(original_prepare(b))
        return prepared_conditions[-1]

    def prefix(c):
        out = original_prefix(c)
        prefixes.append(out[0])
        return out

    def front(module, args, kw):
        fronts.append((module, kw["hidden_states"][0, :8].clone()))

    networks = [adapter.transformer, *objective.reference.copies()]
    handles = [n.register_forward_pre_hook(front, with_kwargs=True) for n in networks]
    try:
        with mock.patch.object(adapter, "prepare_condition", prepare), mock.patch.object(adapter, "prefix_rows",
                                                                                         prefix):  # fmt: skip
            out = objective.training_loss(adapter, batch, torch.Generator().manual_seed(0))
    finally:
        for h in handles:
            h.remove()
    assert torch.isfinite(out.loss)
    assert len(prepared_conditions) == 1 and len(prefixes) == 4 and len(fronts) == 4
    realised = prepared_conditions[0]["prefix_video_rows"][0]
    assert all(p.data_ptr() == realised.data_ptr() and torch.equal(p, realised) for p in prefixes)
    assert {id(m) for m, _ in fronts} == {id(n) for n in networks}  # both the policy and the reference ran
    assert all(torch.equal(rows, realised) for _, rows in fronts)


def raw_target_velocity(adapter, condition, state: LatentState, sigma: float) -> LatentState:
    """ff's velocity of the target rows by hand: the packed sequence built from the pipeline's own layout and
    timestep functions, the realised prefix in front, one raw transformer call, the data-ward output negated and the
    keyframe rows' predictions dropped."""
    one = {k: v[0] for k, v in condition.items()}
    video, audio = state.components["video"][0], state.components["audio"][0]
    layout = keyframe_layout(one["text_token_tags"], _geometry(adapter), adapter.keyframe_anchors(one))
    unique, indices = row_timesteps(layout, 1 - sigma, 1 - sigma)
    n_cond = int(layout["num_condition_video_rows"])
    prefix = one["prefix_video_rows"]
    rows = torch.cat([prefix, patchify_video_latents(video[None], (1, 2, 2))])
    audio_rows = audio.permute(0, 2, 1).reshape(-1, audio.shape[1])
    raw_v, raw_a = adapter.transformer(
        hidden_states=rows[None], audio_hidden_states=audio_rows[None],
        encoder_hidden_states=one["prompt_embeds"][None],
        timestep=unique, timestep_indices=indices, token_tags=layout["token_tags"], position_ids=layout["position_ids"],
        video_indices=layout["video_indices"], audio_indices=layout["audio_indices"],
        text_indices=layout["text_indices"], return_dict=False)  # fmt: skip
    assert torch.equal(rows[:n_cond], prefix)  # the keyframe rows enter as realised: never noised
    return LatentState({"video": unpatchify(-raw_v[0, n_cond:], state.components["video"]),
                        "audio": unrow(-raw_a[0], state.components["audio"])})  # fmt: skip


def _geometry(adapter):
    from ff_minimax.prefix import Geometry

    (_, _, f, h, w), (_, _, _, length) = adapter.latent_shapes(1)
    return Geometry(f, h, w, length, adapter.patch_size)


def test_loss_by_hand_covers_target_rows_only(adapter):
    """The SFT term: mean over video of (v - (eps - x0))^2 plus the mean over audio, where v comes from the
    raw transformer with the keyframe rows in front; the keyframe rows are neither noised nor in either mean."""
    rows = adapter.preprocess([item_for(KEYFRAMES["both"])])
    condition = adapter.prepare_condition(collate_conditions(rows))
    clean = adapter.encode_output(targets(adapter, 1), condition, generator=torch.Generator().manual_seed(1))
    noise = clean.randn_like(torch.Generator().manual_seed(2))
    sigma = 0.6
    with torch.no_grad():
        ours = flow_matching_error(adapter, clean, condition, torch.tensor([sigma]), noise)
        noisy = clean.zip_map(noise, lambda x0, e: (1 - sigma) * x0 + sigma * e)
        v = raw_target_velocity(adapter, condition, noisy, sigma)
    errors = [((v.components[k] - (noise.components[k] - clean.components[k])) ** 2).mean() for k in ("video", "audio")]
    # the spec's "mean over video + mean over audio" (default_component_weights {video: 1, audio: 1}, literal)
    torch.testing.assert_close(ours, (errors[0] + errors[1])[None], rtol=1e-5, atol=1e-6)
    assert clean.components["video"].shape[2] == adapter.num_latent_frames  # the state holds target frames only


def test_grpo_log_prob_by_hand_covers_target_elements_only(adapter):
    """A Flow-GRPO SDE step's stored log-probability is the mean Gaussian log-density over the target's video and audio
    elements only, the mean taken from the hand-built velocity; the prefix rows are fixed observations."""
    rows = adapter.preprocess([item_for(KEYFRAMES["last"])])
    condition = adapter.prepare_condition(collate_conditions(rows))
    sampler = StochasticSampling(kind="flow_sde", eta=0.7, window=(1, 2))
    with torch.no_grad():
        trajectory = sample_sde(adapter, condition, sampler, num_steps=3, generator=torch.Generator().manual_seed(5))
    (t,) = trajectory.transitions
    with torch.no_grad():
        v = raw_target_velocity_levels(adapter, condition, t.state, t.levels)
    dens, count = [], 0
    for name, x in t.state.components.items():
        (s, s_next) = t.levels[name]
        dt = s_next - s
        noise_scale = 0.7 * math.sqrt(s / (1 - s))
        # Flow-GRPO's SDE step (ff_core.sampling docstring), written out.
        mean = x * (1 + noise_scale**2 / (2 * s) * dt) + v.components[name] * (1 + noise_scale**2 * (1 - s) / (2 * s)) \
            * dt
        std = noise_scale * math.sqrt(-dt)
        d = -((t.next.components[name] - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
        dens.append(d.sum())
        count += x.numel()
    assert count == t.state.components["video"].numel() + t.state.components["audio"].numel()
    torch.testing.assert_close(t.log_prob, (sum(dens) / count)[None], rtol=1e-4, atol=1e-4)


def raw_target_velocity_levels(adapter, condition, state, levels) -> LatentState:
    """As :func:`raw_target_velocity`, with video and audio at their own noise levels (a sampling step)."""
    one = {k: v[0] for k, v in condition.items()}
    layout = keyframe_layout(one["text_token_tags"], _geometry(adapter), adapter.keyframe_anchors(one))
    unique, indices = row_timesteps(layout, 1 - levels["video"][0], 1 - levels["audio"][0])  # (sigma, sigma_next)
    video, audio = state.components["video"][0], state.components["audio"][0]
    n_cond = int(layout["num_condition_video_rows"])
    rows = torch.cat([one["prefix_video_rows"], patchify_video_latents(video[None], (1, 2, 2))])
    raw_v, raw_a = adapter.transformer(
        hidden_states=rows[None], audio_hidden_states=audio.permute(0, 2, 1).reshape(-1, audio.shape[1])[None],
        encoder_hidden_states=one["prompt_embeds"][None], timestep=unique, timestep_indices=indices,
        token_tags=layout["token_tags"], position_ids=layout["position_ids"], video_indices=layout["video_indices"],
        audio_indices=layout["audio_indices"], text_indices=layout["text_indices"], return_dict=False)  # fmt: skip
    return LatentState({"video": unpatchify(-raw_v[0, n_cond:], state.components["video"]),
                        "audio": unrow(-raw_a[0], state.components["audio"])})  # fmt: skip


def test_keyframes_follow_the_slots_not_the_list_order(adapter):
    """A last-only record packs one block anchored last; writing first/last in either order gives one presentation."""
    a = adapter.preprocess([item_for(KEYFRAMES["both"])])[0]
    imgs = images()
    b = adapter.preprocess([ConditionInput("a red square with a low tone", None, [
        {"type": "image", "data": imgs[s], "slot": s} for s in ("first_frame", "last_frame")])])[0]
    assert all(torch.equal(a[k], b[k]) for k in a)
    last = adapter.preprocess([item_for(KEYFRAMES["last"])])[0]
    assert last["keyframe_anchors"].tolist() == [1] and last["keyframe_latents"].shape[0] == 1
    assert np.array_equal(a["keyframe_anchors"].numpy(), [0, 1])


def test_the_prefix_is_drawn_from_the_objectives_seeded_stream(adapter):
    """prepare_condition takes the objective's per-micro-batch generator (ff_core prepare_batch_condition, child
    stream 3): the same micro-batch seed gives the same prefix and loss whatever the global RNG did (a resumed run
    repeats them), another seed another prefix."""
    from ff_core.objectives.sft import SFTObjective

    rows = adapter.preprocess([item_for(KEYFRAMES["both"])])
    batch = {"condition": collate_conditions(rows, adapter.condition_collation), "target": targets(adapter, 1)}
    realised, original = [], adapter.prepare_condition

    def prepare(b, generator=None):
        condition = original(b, generator=generator)
        realised.append(condition["prefix_video_rows"])
        return condition

    objective = SFTObjective()
    losses = []
    with mock.patch.object(adapter, "prepare_condition", prepare):
        for global_seed, seed in ((0, 5), (123, 5), (0, 6)):
            torch.manual_seed(global_seed)
            with torch.no_grad():
                losses.append(objective.training_loss(adapter, batch, torch.Generator().manual_seed(seed)).loss)
    assert torch.equal(realised[0], realised[1]) and torch.equal(losses[0], losses[1])
    assert not torch.equal(realised[0], realised[2])
