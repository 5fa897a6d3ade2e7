"""minimax-h3-ref2va on the tiny checkpoint (``transformer_ref/``): parity with diffusers' ``MiniMaxH3ModularPipeline``
(ordered image and audio references: presentation, reference latents and soundtrack rows, the packed layout, the
realised prefix, one denoiser call on both streams, a short sampling run from the same generator), the
``reference_manifest`` in the cached condition, one prefix per batch shared by both DPO arms and the policy and
reference forwards, the reference rows out of the loss and of GRPO log-probabilities (hand computations), and the
exported LoRA loaded by the pipeline into ``transformer_ref``."""

from __future__ import annotations

import json
import math
from unittest import mock

import pytest
import torch
from diffusers import ModularPipeline
from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3AudioReference, MiniMaxH3ImageReference
from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents
from ff_minimax.fl2va import to_pil
from ff_minimax.prefix import row_timesteps
from ff_minimax.ref2va import MiniMaxH3Ref2VAAdapter, video_references_available
from ff_minimax.references import canonical_manifest, manifest_text
from ff_minimax.testing import TINY_FRAMES, TINY_SIZE
from ff_minimax.text import load_processor
from test_minimax_fl2va import targets, unpatchify, unrow

from ff_core.adapter import ConditionInput, LatentState
from ff_core.data.cache.collation import collate_conditions
from ff_core.data.media.decode import DecodedAudio
from ff_core.objectives.dpo import DPOObjective
from ff_core.objectives.sft import flow_matching_error
from ff_core.sampling import StochasticSampling, sample_sde

LOADED = ("transformer_ref", "vae", "audio_vae", "scheduler", "audio_scheduler", "text_encoder", "tokenizer")
SHORT_EDGE = 16  # the tiny reference-image short edge (2048 released)
PROMPT = "a red square with a low tone"
ORDERS = {"audio_image_image": ("audio", "image", "image2"), "image_audio": ("image", "audio")}


@pytest.fixture(scope="module")
def adapter(tiny_minimax):
    return MiniMaxH3Ref2VAAdapter.from_pretrained(tiny_minimax("ref2va"), height=TINY_SIZE, width=TINY_SIZE,
                                                  num_frames=TINY_FRAMES, reference_image_short_edge=SHORT_EDGE).eval()


@pytest.fixture(scope="module")
def pipe(tiny_minimax):
    return build_pipe(tiny_minimax)


def build_pipe(tiny_minimax):
    path = tiny_minimax("ref2va")
    pipe = ModularPipeline.from_pretrained(str(path), workflow="ref2va")
    pipe.load_components(names=list(LOADED), torch_dtype=torch.float32)
    pipe.update_components(processor=load_processor(path))
    pipe.register_to_config(reference_image_short_edge=SHORT_EDGE)
    return pipe


def media(rate: int) -> dict:
    """Two images of other aspect ratios than the canvas and a 2 s stereo waveform at ``rate``."""
    g = torch.Generator().manual_seed(5)
    return {"image": torch.randint(0, 256, (3, 20, 28), generator=g, dtype=torch.uint8),
            "image2": torch.randint(0, 256, (3, 24, 16), generator=g, dtype=torch.uint8),
            "audio": torch.rand(2, 2 * rate, generator=g) * 1.6 - 0.8}  # fmt: skip


def item_for(adapter, order) -> ConditionInput:
    m = media(adapter.audio_rate)
    entries = []
    for k, name in enumerate(order):
        if name == "audio":
            data = DecodedAudio(m["audio"], adapter.audio_rate)
            entries.append({"type": "audio", "data": data, "path": f"/refs/{k}.wav",
                            "sample_rate": adapter.audio_rate})  # fmt: skip
        else:
            entries.append({"type": "image", "data": m[name], "path": f"/refs/{k}.png"})
    return ConditionInput(PROMPT, None, entries)


def pipeline_references(rate: int, order) -> list:
    m = media(rate)
    return [MiniMaxH3AudioReference(audio=m["audio"], sample_rate=rate) if name == "audio"
            else MiniMaxH3ImageReference(image=to_pil(m[name])) for name in order]  # fmt: skip


def run_pipeline(pipe, order, seed, steps):
    calls = []

    def record(module, args, kw):
        calls.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()})

    handle = pipe.transformer_ref.register_forward_pre_hook(record, with_kwargs=True)
    try:
        state = pipe(prompt=PROMPT, references=pipeline_references(pipe.audio_sampling_rate, order), height=TINY_SIZE,
                     width=TINY_SIZE, num_frames=TINY_FRAMES, num_inference_steps=steps + 1,
                     generator=torch.Generator().manual_seed(seed), output_type="pt")  # fmt: skip
    finally:
        handle.remove()
    return state, calls


def prepared(adapter, item):
    rows = adapter.preprocess([item])
    return rows, adapter.prepare_condition(collate_conditions(rows, adapter.condition_collation))


@pytest.mark.parametrize("order", list(ORDERS))
def test_parity_with_the_modular_pipeline(adapter, pipe, order):
    steps, seed = 2, 4
    state, calls = run_pipeline(pipe, ORDERS[order], seed, steps)
    rows, condition = prepared(adapter, item_for(adapter, ORDERS[order]))
    row = rows[0]
    torch.testing.assert_close(row["prompt_embeds"], state.get("prompt_embeds")[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(row["text_token_tags"], state.get("text_token_tags"))
    visual = adapter.visual_latents(row)
    assert [tuple(z.shape) for z in visual] == [tuple(z.shape) for z in state.get("condition_latents")]
    assert all(torch.equal(a, b) for a, b in zip(visual, state.get("condition_latents")))
    torch.testing.assert_close(row["reference_audio"], torch.cat(state.get("audio_condition_latents")), rtol=0, atol=0)
    one = adapter.sample_condition(condition, 0)
    like = adapter.initial_noise(condition)
    layout = adapter.packed_layout(one, like.components["video"][0], like.components["audio"][0])
    for key in ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices"):
        assert torch.equal(getattr(layout, key), state.get(key)), key
    assert (layout.condition_video_rows, layout.condition_audio_rows) == (
        state.get("num_condition_video_rows"), state.get("num_condition_audio_rows"))

    g = torch.Generator().manual_seed(seed)
    condition = adapter.realise(condition, generator=g)
    assert torch.equal(condition["prefix_video_rows"][0], state.get("condition_rows"))
    with torch.no_grad():
        final = adapter.sample(condition, num_steps=steps, generator=g)
    torch.testing.assert_close(final.components["video"], state.get("latents"), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final.components["audio"][0], state.get("audio_latents"), rtol=1e-4, atol=1e-4)

    kw = calls[0]
    n_v, n_a = layout.condition_video_rows, layout.condition_audio_rows
    assert torch.equal(kw["hidden_states"][0, :n_v], state.get("condition_rows"))
    assert torch.equal(kw["audio_hidden_states"][0, :n_a], row["reference_audio"])  # soundtracks ride clean
    with torch.no_grad():
        raw_v, raw_a = pipe.transformer_ref(**{**kw, "return_dict": False})
    target = LatentState({"video": unpatchify(kw["hidden_states"][0, n_v:], like.components["video"]),
                          "audio": unrow(kw["audio_hidden_states"][0, n_a:], like.components["audio"])})  # fmt: skip
    levels = {"video": torch.tensor([float(pipe.scheduler.sigmas[0])]),
              "audio": torch.tensor([float(pipe.audio_scheduler.sigmas[0])])}  # fmt: skip
    with torch.no_grad():
        ours = adapter.component_velocity(target, levels, condition)
    torch.testing.assert_close(ours.components["video"], unpatchify(-raw_v[0, n_v:], like.components["video"]),
                               rtol=1e-4, atol=1e-5)  # fmt: skip
    torch.testing.assert_close(ours.components["audio"], unrow(-raw_a[0, n_a:], like.components["audio"]),
                               rtol=1e-4, atol=1e-5)  # fmt: skip


def test_manifest_is_cached_in_order_and_canonical(adapter):
    (row,) = adapter.preprocess([item_for(adapter, ORDERS["audio_image_image"])])
    manifest = manifest_text(row["reference_manifest"])
    assert canonical_manifest(manifest) == manifest
    assert [e["type"] for e in json.loads(manifest)] == ["audio", "image", "image"]
    assert json.loads(manifest)[0] == {"type": "audio", "path": "/refs/0.wav", "sample_rate": float(adapter.audio_rate)}
    assert row["reference_kinds"].tolist() == [2, 0, 0] and row["reference_has_audio"].tolist() == [1, 0, 0]


def test_order_is_part_of_the_condition(adapter):
    """The same references in another order give another presentation, layout clock and manifest."""
    a = adapter.preprocess([item_for(adapter, ("image", "audio"))])[0]
    b = adapter.preprocess([item_for(adapter, ("audio", "image"))])[0]
    assert not torch.equal(a["text_token_tags"], b["text_token_tags"])  # "<Audio 1>: " moved ahead of the picture
    assert a["reference_kinds"].tolist() == [0, 2] and b["reference_kinds"].tolist() == [2, 0]
    assert manifest_text(a["reference_manifest"]) != manifest_text(b["reference_manifest"])


def test_one_realised_prefix_is_shared_by_both_dpo_arms_and_policy_and_reference(adapter):
    objective = DPOObjective(beta=100.0)
    objective.configure_model(adapter, lora=False)
    rows = adapter.preprocess([item_for(adapter, ORDERS["image_audio"])])
    chosen, rejected = targets(adapter)
    batch = {"condition": collate_conditions(rows, adapter.condition_collation), "chosen": [chosen],
             "rejected": [rejected]}  # fmt: skip
    prepared_conditions, prefixes, fronts = [], [], []
    original_prepare, original_prefix = adapter.prepare_condition, adapter.prefix_rows

    def prepare(b):
        prepared_conditions.append(original_prepare(b))
        return prepared_conditions[-1]

    def prefix(c):
        out = original_prefix(c)
        prefixes.append(out)
        return out

    def front(module, args, kw):
        fronts.append((module, kw["hidden_states"][0].clone(), kw["audio_hidden_states"][0].clone()))

    networks = [adapter.transformer, *objective.reference.copies()]
    handles = [n.register_forward_pre_hook(front, with_kwargs=True) for n in networks]
    try:
        with mock.patch.object(adapter, "prepare_condition", prepare), mock.patch.object(adapter, "prefix_rows",
                                                                                         prefix):  # fmt: skip
            out = objective.training_loss(adapter, batch, torch.Generator().manual_seed(0))
    finally:
        for h in handles:
            h.remove()
    assert torch.isfinite(out.loss) and len(prepared_conditions) == 1 and len(prefixes) == 4 and len(fronts) == 4
    video, sound = prepared_conditions[0]["prefix_video_rows"][0], prepared_conditions[0]["reference_audio"][0]
    assert all(v.data_ptr() == video.data_ptr() and a.data_ptr() == sound.data_ptr() for v, a in prefixes)
    assert {id(m) for m, _, _ in fronts} == {id(n) for n in networks}
    assert all(torch.equal(v[: len(video)], video) and torch.equal(a[: len(sound)], sound) for _, v, a in fronts)


def raw_velocity(adapter, condition, state, sigma_v, sigma_a) -> LatentState:
    """ff's target velocity by hand: prefix rows (realised video, clean soundtracks) in front, the pipeline's layout
    and row timesteps, one raw transformer call, data-ward output negated, reference-row predictions dropped."""
    one = adapter.sample_condition(condition, 0)
    video, audio = state.components["video"][0], state.components["audio"][0]
    layout = adapter.packed_layout(one, video, audio)
    layout_dict = {"video_indices": layout.video_indices, "audio_indices": layout.audio_indices,
                   "text_indices": layout.text_indices, "num_condition_video_rows": layout.condition_video_rows,
                   "num_condition_audio_rows": layout.condition_audio_rows}  # fmt: skip
    unique, indices = row_timesteps(layout_dict, 1 - sigma_v, 1 - sigma_a)
    n_v, n_a = layout.condition_video_rows, layout.condition_audio_rows
    rows = torch.cat([one["prefix_video_rows"], patchify_video_latents(video[None], (1, 2, 2))])
    audio_rows = torch.cat([one["reference_audio"], audio.permute(0, 2, 1).reshape(-1, audio.shape[1])])
    raw_v, raw_a = adapter.transformer(
        hidden_states=rows[None], audio_hidden_states=audio_rows[None],
        encoder_hidden_states=one["prompt_embeds"][None], timestep=unique, timestep_indices=indices,
        token_tags=layout.token_tags, position_ids=layout.position_ids, video_indices=layout.video_indices,
        audio_indices=layout.audio_indices, text_indices=layout.text_indices, return_dict=False)  # fmt: skip
    assert n_v > 0 and n_a > 0  # the hand computation exercises both prefixes
    return LatentState({"video": unpatchify(-raw_v[0, n_v:], state.components["video"]),
                        "audio": unrow(-raw_a[0, n_a:], state.components["audio"])})  # fmt: skip


def test_loss_by_hand_covers_target_rows_only(adapter):
    rows = adapter.preprocess([item_for(adapter, ORDERS["audio_image_image"])])
    condition = adapter.prepare_condition(collate_conditions(rows, adapter.condition_collation))
    clean = adapter.encode_output(targets(adapter, 1), condition, generator=torch.Generator().manual_seed(1))
    noise = clean.randn_like(torch.Generator().manual_seed(2))
    sigma = 0.35
    with torch.no_grad():
        ours = flow_matching_error(adapter, clean, condition, torch.tensor([sigma]), noise)
        noisy = clean.zip_map(noise, lambda x0, e: (1 - sigma) * x0 + sigma * e)
        v = raw_velocity(adapter, condition, noisy, sigma, sigma)
    errors = [((v.components[k] - (noise.components[k] - clean.components[k])) ** 2).mean() for k in ("video", "audio")]
    # the spec's "mean over video + mean over audio" (default_component_weights {video: 1, audio: 1}, literal)
    torch.testing.assert_close(ours, (errors[0] + errors[1])[None], rtol=1e-5, atol=1e-6)


def test_grpo_log_prob_by_hand_covers_target_elements_only(adapter):
    rows = adapter.preprocess([item_for(adapter, ORDERS["image_audio"])])
    condition = adapter.prepare_condition(collate_conditions(rows, adapter.condition_collation))
    sampler = StochasticSampling(kind="flow_sde", eta=0.7, window=(1, 2))
    with torch.no_grad():
        trajectory = sample_sde(adapter, condition, sampler, num_steps=3, generator=torch.Generator().manual_seed(5))
    (t,) = trajectory.transitions
    with torch.no_grad():
        v = raw_velocity(adapter, condition, t.state, t.levels["video"][0], t.levels["audio"][0])
    dens, count = [], 0
    for name, x in t.state.components.items():
        s, s_next = t.levels[name]
        dt, scale = s_next - s, 0.7 * math.sqrt(s / (1 - s))
        mean = x * (1 + scale**2 / (2 * s) * dt) + v.components[name] * (1 + scale**2 * (1 - s) / (2 * s)) * dt
        std = scale * math.sqrt(-dt)
        dens.append((-((t.next.components[name] - mean) ** 2) / (2 * std**2) - math.log(std)
                     - 0.5 * math.log(2 * math.pi)).sum())  # fmt: skip
        count += x.numel()
    torch.testing.assert_close(t.log_prob, (sum(dens) / count)[None], rtol=1e-4, atol=1e-4)


def test_exported_lora_loads_into_transformer_ref(adapter, tiny_minimax, tmp_path):
    """The LoRA file's keys are ``transformer_ref.``-prefixed: the pipeline's loader routes it to that component, and
    the fused weights equal the adapter's merged ones."""
    import copy

    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
    from safetensors.torch import load_file

    network = copy.deepcopy(adapter.transformer)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["to_q"], init_lora_weights=False)
    inject_adapter_in_model(config, network)
    path = adapter.save_lora(tmp_path / "lora", get_peft_model_state_dict(network), config)
    assert all(k.startswith("transformer_ref.") for k in load_file(path))
    reference = build_pipe(tiny_minimax)  # fresh: a used pipeline's weight-normed audio VAE cannot be deep-copied
    reference.load_lora_weights(str(tmp_path / "lora"))
    reference.fuse_lora()
    ours = dict(network.named_modules())["transformer_blocks.0.attn.to_q"]
    merged = ours.base_layer.weight + ours.scaling["default"] * ours.lora_B["default"].weight @ ours.lora_A[
        "default"].weight  # fmt: skip
    torch.testing.assert_close(reference.transformer_ref.transformer_blocks[0].attn.to_q.weight, merged)


def test_video_references_follow_the_environment(adapter):
    """A video reference needs Qwen3-VL's video processor (torchvision); without it the contract refuses it."""
    types = adapter.io_contract.references.types
    assert ("video" in {t.value for t in types}) == video_references_available()


def test_release_preprocessing_drops_the_blocks_text_encoder(tiny_minimax):
    adapter = MiniMaxH3Ref2VAAdapter.from_pretrained(tiny_minimax("ref2va"), height=TINY_SIZE, width=TINY_SIZE,
                                                     num_frames=TINY_FRAMES, reference_image_short_edge=SHORT_EDGE)
    adapter.preprocess([item_for(adapter, ("image",))])
    assert adapter._blocks().text_encoder is adapter.text_encoder is not None
    assert adapter.release_preprocessing() == ["text_encoder"]
    assert adapter.text_encoder is None and "_reference_blocks" not in adapter.__dict__
