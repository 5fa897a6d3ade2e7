"""ltx2_t2av on a tiny checkpoint: loading, parity with diffusers' LTX2Pipeline (prompt encoding through the
connectors, the denoiser call at every step, a sampling run with and without CFG, decoding to frames and waveform),
the video VAE's compression ratios, and the LoRA export loaded by the pipeline.

Besides the conformance kit's maths checks (test_ltx2_conformance.py), these record the transformer's own inputs at
every step (a forward pre-hook) and compare both streams at 1e-6, each unpacked with the pipeline's own
``_unpack_latents`` / ``_unpack_audio_latents``."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from diffusers import LTX2Pipeline
from ff_ltx2 import LTX2T2AVAdapter
from ltx2_geometry import ADAPTER_KWARGS, AUDIO_LATENTS, FPS, FRAMES, PLAIN_GUIDANCE, SIZE
from torch.utils.data import default_collate

from ff_core.adapter import ConditionInput, LatentState
from ff_core.contracts import MediaGeometry

PROMPTS = ["a red square with a low tone", "  a blue square moving left with a high beep "]
NEGATIVE = ["blurry", "a green humming"]
STEPS = 3


@pytest.fixture(scope="module")
def t2av(tiny_ltx2):
    return tiny_ltx2("t2av")


@pytest.fixture(scope="module")
def adapter(t2av):
    return LTX2T2AVAdapter.from_pretrained(t2av, **ADAPTER_KWARGS)


@pytest.fixture(scope="module")
def pipe(t2av):
    return LTX2Pipeline.from_pretrained(t2av)


@pytest.fixture(scope="module")
def condition(adapter):
    inputs = [ConditionInput(p, negative_prompt=n) for p, n in zip(PROMPTS, NEGATIVE)]
    return adapter.prepare_condition(default_collate(adapter.preprocess(inputs)))


def run_pipeline(pipe, adapter, init: LatentState, guidance_scale: float, output_type: str = "latent", **guidance):
    """The pipeline from the adapter's initial noise (passed denormalised: ``prepare_latents`` normalises 5-D video
    and 4-D audio latents), recording every transformer call's inputs; ``guidance`` overrides the plain-CFG arguments
    (``audio_guidance_scale``, ``guidance_rescale``, ...)."""
    calls = []
    handle = pipe.transformer.register_forward_pre_hook(lambda m, a, kw: calls.append(dict(kw)), with_kwargs=True)
    try:
        out = pipe(prompt=PROMPTS, negative_prompt=NEGATIVE, height=SIZE, width=SIZE, num_frames=FRAMES,
                   frame_rate=FPS, num_inference_steps=STEPS, guidance_scale=guidance_scale,
                   **{"audio_guidance_scale": guidance_scale, **PLAIN_GUIDANCE, **guidance},
                   max_sequence_length=adapter.max_sequence_length,
                   latents=adapter.denormalize_video(init.components["video"]),
                   audio_latents=adapter.denormalize_audio(init.components["audio"]), output_type=output_type,
                   generator=torch.Generator().manual_seed(0), return_dict=False)  # fmt: skip
    finally:
        handle.remove()
    return out, calls


def _video(pipe, tokens):
    return LTX2Pipeline._unpack_latents(tokens, (FRAMES - 1) // 2 + 1, SIZE // 8, SIZE // 8)


def _audio(pipe, tokens):
    return LTX2Pipeline._unpack_audio_latents(tokens, AUDIO_LATENTS, num_mel_bins=pipe.audio_vae.config.mel_bins // 4)


def _state(pipe, kw) -> LatentState:
    """The (unpacked) latent state a recorded transformer call saw."""
    return LatentState({"video": _video(pipe, kw["hidden_states"]), "audio": _audio(pipe, kw["audio_hidden_states"])})


# -- discovery and loading ---------------------------------------------------------------------------
def test_discovered_through_the_entry_point(monkeypatch):
    try:
        importlib.metadata.distribution("ff-ltx2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("ff-ltx2 is not installed (pip install -e plugins/ff_ltx2 --no-deps)")
    from ff_core.plugins import PluginRegistry

    monkeypatch.delenv("FF_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    adapters = PluginRegistry().adapters()
    assert adapters["ltx2_t2av"].cls is LTX2T2AVAdapter and adapters["ltx2_t2av"].distribution == "ff-ltx2"


def test_contract_is_the_spec_row():
    from ff_core.testing.contracts import SUPPORT_TABLE

    assert LTX2T2AVAdapter.io_contract == SUPPORT_TABLE["ltx2_t2av"]
    video, audio = LTX2T2AVAdapter.io_contract.outputs
    assert video.requires_fps and audio.requires_sample_rate


def test_from_pretrained_freezes_all_but_the_transformer(adapter):
    assert adapter.denoiser is adapter.transformer
    assert {n.split(".")[0] for n, p in adapter.named_parameters() if p.requires_grad} == {"transformer"}
    assert adapter.max_sequence_length == 16  # 1024 requested, capped by the tiny tokenizer
    assert (adapter.spatial_stride, adapter.temporal_stride) == (8, 2)
    assert adapter.audio_latent_frames == AUDIO_LATENTS == round(FRAMES / FPS * 16000 / 160 / 4)
    assert adapter.output_rates == (FPS, 16000.0)
    assert adapter.output_geometry() == (MediaGeometry(SIZE, SIZE, num_frames=FRAMES, fps=FPS), None)
    assert adapter.denoiser_tokens(adapter.output_geometry()[0]) == 5 * 4 * 4 + AUDIO_LATENTS


def test_video_vae_compression_is_derived_from_its_blocks(adapter):
    """The tiny VAE halves frames in one block only: its own formula (``patch_t * 2 ** scaled blocks``) says 4x
    temporal, the encoder does 2x; the factory stores the derived ratios, which the pipeline then reads."""
    from diffusers import AutoencoderKLLTX2Video
    from ff_ltx2.adapter import video_vae_compression

    config = {k: v for k, v in dict(adapter.vae.config).items()
              if k not in ("spatial_compression_ratio", "temporal_compression_ratio")}  # fmt: skip
    assert video_vae_compression(config) == (8, 2)
    default = AutoencoderKLLTX2Video(**{k: v for k, v in config.items() if not k.startswith("_")})
    assert (default.spatial_compression_ratio, default.temporal_compression_ratio) == (8, 4)  # misreported
    with torch.no_grad():
        z = adapter.vae.encode(torch.zeros(1, 3, FRAMES, SIZE, SIZE)).latent_dist.mode()
    assert tuple(z.shape[2:]) == ((FRAMES - 1) // 2 + 1, SIZE // 8, SIZE // 8)
    assert (adapter.vae.spatial_compression_ratio, adapter.vae.temporal_compression_ratio) == (8, 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_frames": 10}, r"num_frames: \(num_frames - 1\) must be divisible by 2"),
        ({"height": 36}, "height: must be a multiple of 8"),
        ({"frame_rate": 0}, "frame_rate: must be a number > 0"),
    ],
)
def test_geometry_arguments_are_checked(t2av, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LTX2T2AVAdapter.from_pretrained(t2av, **{**ADAPTER_KWARGS, **kwargs})


# -- condition side: LTX2Pipeline.encode_prompt + connectors ---------------------------------------------
def test_preprocess_matches_the_pipeline_prompt_encoding(adapter, pipe, condition):
    with torch.no_grad():
        pe, pm, ne, nm = pipe.encode_prompt(PROMPTS, NEGATIVE, max_sequence_length=16, device="cpu")
        ours = {"": pipe.connectors(pe, pm, padding_side="left"), "negative_": pipe.connectors(ne, nm, "left")}
    for prefix, (video, audio, mask) in ours.items():
        torch.testing.assert_close(condition[f"{prefix}video_prompt_embeds"], video, rtol=0, atol=0)
        torch.testing.assert_close(condition[f"{prefix}audio_prompt_embeds"], audio, rtol=0, atol=0)
        torch.testing.assert_close(condition[f"{prefix}prompt_attention_mask"], mask, rtol=0, atol=0)
    assert not torch.equal(condition["video_prompt_embeds"][0], condition["video_prompt_embeds"][1])


def test_missing_negative_prompt_is_the_empty_string(adapter):
    a, b = adapter.preprocess([ConditionInput(PROMPTS[0]), ConditionInput(PROMPTS[1], negative_prompt="")])
    torch.testing.assert_close(a["negative_video_prompt_embeds"], b["negative_video_prompt_embeds"], rtol=0, atol=0)


def test_preprocess_rejects_input_media(adapter):
    with pytest.raises(ValueError, match="no input media"):
        adapter.preprocess([ConditionInput("x", media=[{"type": "image", "data": torch.zeros(3, 8, 8)}])])


# -- the denoiser, sampling and decoding against the pipeline ------------------------------------------
def test_sampling_sigmas_are_the_pipeline_schedule(adapter, pipe, condition):
    init = adapter.initial_noise(condition, torch.Generator().manual_seed(3))
    run_pipeline(pipe, adapter, init, 1.0)
    schedules = adapter.sampling_schedules(init, STEPS)
    torch.testing.assert_close(schedules["video"], pipe.scheduler.sigmas.float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(schedules["audio"], schedules["video"], rtol=0, atol=0)  # the pipeline's copy
    # The resolution-dependent shift: exp(mu) for 80 video tokens, SD3's shift form of the exponential time shift.
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    s = float(torch.tensor(calculate_shift(80, 1024, 4096, 0.95, 2.05)).exp())
    assert adapter.timestep_shift(init) == pytest.approx(s)
    torch.testing.assert_close(schedules["video"][1], torch.tensor(s * 2 / 3 / (1 + (s - 1) * 2 / 3)), rtol=1e-5,
                               atol=0)  # fmt: skip


def test_velocity_is_the_pipeline_denoiser_at_every_step(adapter, pipe, condition):
    """At each step, ``velocity`` of the pipeline's (unpacked) latents at the step's sigma is the transformer's output
    for both streams: packing, the x1000 timestep, fps, the cross-modal timestep and the prompt embeddings agree."""
    init = adapter.initial_noise(condition, torch.Generator().manual_seed(3))
    _, calls = run_pipeline(pipe, adapter, init, 1.0)
    assert len(calls) == STEPS
    sigmas = pipe.scheduler.sigmas
    for k, kw in enumerate(calls):
        state = _state(pipe, kw)
        with torch.no_grad():
            theirs = pipe.transformer(**{**kw, "return_dict": False})
            ours = adapter.velocity(state, torch.full((2,), float(sigmas[k])), condition)
        torch.testing.assert_close(ours.components["video"], _video(pipe, theirs[0]), rtol=0, atol=1e-6)
        torch.testing.assert_close(ours.components["audio"], _audio(pipe, theirs[1]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
def test_sampling_run_matches_the_pipeline(adapter, pipe, condition, guidance_scale):
    init = adapter.initial_noise(condition, torch.Generator().manual_seed(3))
    (video, audio), calls = run_pipeline(pipe, adapter, init, guidance_scale)
    assert calls[0]["hidden_states"].shape[0] == (4 if guidance_scale > 1 else 2)  # CFG batch on the pipeline side
    final = adapter.sample(condition, num_steps=STEPS, guidance_scale=guidance_scale,
                           generator=torch.Generator().manual_seed(3))  # fmt: skip
    torch.testing.assert_close(final.components["video"], adapter.normalize_video(video), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final.components["audio"], adapter.normalize_audio(audio), rtol=1e-4, atol=1e-5)
    assert not torch.equal(final.components["audio"], init.components["audio"])


@pytest.mark.parametrize(("ours", "theirs"), [
    # Per-stream scales, no rescale.
    ({"guidance_scale": {"video": 2.0, "audio": 4.0}}, {"guidance_scale": 2.0, "audio_guidance_scale": 4.0}),
    # Per-stream scales and rescales (the pipeline falls back to the video's rescale for an audio rescale of 0).
    ({"guidance_scale": {"video": 2.0, "audio": 4.0}, "guidance_rescale": {"video": 0.7, "audio": 0.5}},
     {"guidance_scale": 2.0, "audio_guidance_scale": 4.0, "guidance_rescale": 0.7, "audio_guidance_rescale": 0.5}),
    # LTX2Pipeline's defaults (video 3, audio 7, rescale 0.7 on both), STG and modality guidance off.
    ({"guidance_scale": {"video": 3.0, "audio": 7.0}, "guidance_rescale": 0.7},
     {"guidance_scale": 3.0, "audio_guidance_scale": 7.0, "guidance_rescale": 0.7, "audio_guidance_rescale": 0.7}),
])  # fmt: skip
def test_per_stream_guidance_and_rescale_match_the_pipeline(adapter, pipe, condition, ours, theirs):
    """``model.sampling.guidance_scale`` per stream and ``guidance_rescale`` (docs/ltx2.md, "Sampling"): a sampling
    run equals ``LTX2Pipeline`` with ``audio_guidance_scale`` != ``guidance_scale`` and its x0-space guidance rescale
    on, from the same initial noise; the rescale changes the result (it is not a no-op here)."""
    init = adapter.initial_noise(condition, torch.Generator().manual_seed(3))
    (video, audio), _ = run_pipeline(pipe, adapter, init, **theirs)
    final = adapter.sample(condition, num_steps=STEPS, generator=torch.Generator().manual_seed(3), **ours)
    torch.testing.assert_close(final.components["video"], adapter.normalize_video(video), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final.components["audio"], adapter.normalize_audio(audio), rtol=1e-4, atol=1e-5)
    plain = adapter.sample(condition, num_steps=STEPS, generator=torch.Generator().manual_seed(3),
                           guidance_scale=ours["guidance_scale"])  # fmt: skip
    for name in ("video", "audio"):  # differs from plain CFG exactly when a rescale is on
        assert torch.equal(final.components[name], plain.components[name]) == ("guidance_rescale" not in ours)


def test_decode_matches_the_pipeline(adapter, pipe, condition):
    init = adapter.initial_noise(condition, torch.Generator().manual_seed(3))
    (video, audio), _ = run_pipeline(pipe, adapter, init, 1.0, output_type="pt")
    (latent_video, latent_audio), _ = run_pipeline(pipe, adapter, init, 1.0)
    final = LatentState({"video": adapter.normalize_video(latent_video),
                         "audio": adapter.normalize_audio(latent_audio)})  # fmt: skip
    media = adapter.decode(final)
    for i, (frames, waveform) in enumerate(media):
        assert frames.dtype == torch.uint8 and frames.shape == (FRAMES, 3, SIZE, SIZE)
        torch.testing.assert_close(frames.float(), video[i].float() * 255, rtol=0, atol=1.0)
        # The pipeline's waveform: (4 L - 3) mel hops of 160 samples; ff's lasts the clip's clock, padded with silence.
        assert audio[i].shape == (2, (4 * AUDIO_LATENTS - 3) * 160)
        assert waveform.dtype == torch.float32 and waveform.shape == (2, round(FRAMES / FPS * 16000))
        n = audio[i].shape[1]
        torch.testing.assert_close(waveform[:, :n], audio[i].float(), rtol=1e-4, atol=1e-5)
        assert (waveform[:, n:] == 0).all()


def test_lora_export_loads_through_load_lora_weights(t2av, adapter, condition, tmp_path):
    """A LoRA (random lora_B: as if trained) exported by ff, loaded by ``LTX2Pipeline.load_lora_weights``, gives the
    adapter's velocity on both streams, and changes it."""
    from ff_core.lora import LoRAConfig, apply_lora, lora_config, lora_state_dict

    tuned = LTX2T2AVAdapter.from_pretrained(t2av, **ADAPTER_KWARGS)
    apply_lora(tuned, LoRAConfig(rank=2, alpha=6))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    tuned.save_lora(tmp_path / "lora", lora_state_dict(tuned), lora_config(tuned))
    pipe = LTX2Pipeline.from_pretrained(t2av)
    pipe.load_lora_weights(tmp_path / "lora")
    init = tuned.initial_noise(condition, torch.Generator().manual_seed(3))
    _, calls = run_pipeline(pipe, tuned, init, 1.0)
    kw = calls[1]
    state = _state(pipe, kw)
    sigma = torch.full((2,), float(pipe.scheduler.sigmas[1]))
    with torch.no_grad():
        theirs = pipe.transformer(**{**kw, "return_dict": False})
        ours = tuned.velocity(state, sigma, condition)
        base = adapter.velocity(state, sigma, condition)
    torch.testing.assert_close(ours.components["video"], _video(pipe, theirs[0]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.components["audio"], _audio(pipe, theirs[1]), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(ours.components["audio"], base.components["audio"], atol=1e-4)
    assert not torch.allclose(ours.components["video"], base.components["video"], atol=1e-4)


def test_the_audio_stream_can_be_frozen(t2av, condition):
    """docs/ltx2.md, "Freezing the audio stream": LoRA on VIDEO_LORA_TARGETS wraps no layer of the audio stream, and
    with ``component_weights: {video: 1, audio: 0}`` the audio prediction's error is out of the loss: the audio
    output projection (which feeds nothing but the audio prediction) gets an exactly zero gradient; pooled, it does
    not. (The video prediction still reads the noisy audio through audio-to-video attention, as at inference.)"""
    from ff_ltx2.adapter import VIDEO_LORA_TARGETS

    from ff_core.lora import LoRAConfig, apply_lora
    from ff_core.objectives import SFTObjective

    adapter = LTX2T2AVAdapter.from_pretrained(t2av, **ADAPTER_KWARGS)
    apply_lora(adapter, LoRAConfig(rank=2, alpha=2, target_modules=list(VIDEO_LORA_TARGETS)))
    wrapped = {n.split(".lora_")[0] for n, _ in adapter.named_parameters() if "lora_" in n}
    assert wrapped and all(w.split(".")[3] in ("attn1", "attn2", "audio_to_video_attn") for w in wrapped), wrapped
    adapter.transformer.audio_proj_out.requires_grad_(True)
    g = torch.Generator().manual_seed(0)
    video = torch.randint(0, 256, (FRAMES, 3, SIZE, SIZE), dtype=torch.uint8, generator=g)
    audio = (torch.sin(2 * torch.pi * 220 * torch.arange(18000) / 16000) * 0.5).repeat(2, 1)
    one = {k: v[:1] for k, v in condition.items()}
    clean = adapter.encode_output([[video, audio]], one, generator=torch.Generator().manual_seed(0))
    for weights, frozen in (({"video": 1.0, "audio": 0.0}, True), (None, False)):
        adapter.zero_grad(set_to_none=True)
        objective = SFTObjective(component_weights=weights)
        objective.loss(adapter, clean, one, torch.Generator().manual_seed(1)).loss.backward()
        grad = adapter.transformer.audio_proj_out.weight.grad
        assert (grad == 0).all() if frozen else grad.abs().sum() > 0
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in adapter.named_parameters() if "lora_" in n)


def test_frozen_audio_leaves_the_audio_out_of_lora_and_the_loss(t2av, condition):
    """``model.frozen_components: [audio]`` (docs/ltx2.md, "Freezing the audio stream"): no audio-stream module gets a
    LoRA, and the SFT loss is the video stream's term alone, ``0.5 m_video`` (the default weights, 0.5 each, minus
    the frozen audio's term: the loss is sum_k w_k m_k, unnormalised), computed here by hand from the same sigma and
    noise draws."""
    from ff_core.lora import LoRAConfig, apply_lora, frozen_parameters
    from ff_core.objectives import SFTObjective
    from ff_core.objectives.flow_matching import monte_carlo_draws, noise_state, velocity_target

    adapter = LTX2T2AVAdapter.from_pretrained(t2av, **ADAPTER_KWARGS)
    frozen = frozen_parameters(adapter, ["audio"])
    assert "audio_proj_out.weight" in frozen["transformer"]
    assert "transformer_blocks.0.video_to_audio_attn.to_q.weight" in frozen["transformer"]
    assert "transformer_blocks.0.audio_to_video_attn.to_q.weight" not in frozen["transformer"]  # the video reads
    apply_lora(adapter, LoRAConfig(rank=2, alpha=2), frozen)
    wrapped = {n.split(".lora_")[0].removeprefix("transformer.") for n, _ in adapter.named_parameters() if "lora_" in n}
    assert wrapped and not any(f"{w}.base_layer.weight" in frozen["transformer"] or f"{w}.weight" in
                               frozen["transformer"] for w in wrapped)  # fmt: skip
    assert {w.split(".")[2] for w in wrapped} == {"attn1", "attn2", "audio_to_video_attn"}
    g = torch.Generator().manual_seed(0)
    video = torch.randint(0, 256, (FRAMES, 3, SIZE, SIZE), dtype=torch.uint8, generator=g)
    audio = (torch.sin(2 * torch.pi * 220 * torch.arange(18000) / 16000) * 0.5).repeat(2, 1)
    one = {k: v[:1] for k, v in condition.items()}
    clean = adapter.encode_output([[video, audio]], one, generator=torch.Generator().manual_seed(0))
    objective = SFTObjective()  # no component_weights: the frozen audio leaves the loss (the default)
    objective.freeze_components(["audio"])
    with torch.no_grad():
        loss = objective.loss(adapter, clean, one, torch.Generator().manual_seed(1)).loss
        [(sigma, noise)] = monte_carlo_draws(objective.timesteps, adapter, clean, 1, torch.Generator().manual_seed(1))
        pred = adapter.velocity(noise_state(clean, noise, sigma), sigma, one).components["video"]
        by_hand = ((pred.float() - velocity_target(clean.components["video"], noise.components["video"])) ** 2).mean()
    torch.testing.assert_close(loss, 0.5 * by_hand, rtol=1e-6, atol=0)


def test_freezing_is_about_parameters_and_the_loss_follows_component_weights(t2av, condition):
    """docs/ltx2.md, "Freezing the audio stream": with ``model.frozen_components: [audio]`` the audio parameters stay
    frozen whatever the weights; ``component_weights`` set in the config decide the loss, frozen components included:
    ``{video: 1, audio: 1}`` is the sum of both streams' mean errors (by hand), and ``{video: 0, audio: 1}`` (the audio
    error alone) still trains the video stream's LoRA through the cross-modal path (``video_to_audio_attn``, frozen
    with the audio, reads the video's hidden states), while no audio parameter gets a gradient."""
    from ff_core.lora import LoRAConfig, apply_lora, frozen_parameters
    from ff_core.objectives import DPOObjective, SFTObjective
    from ff_core.objectives.flow_matching import monte_carlo_draws, noise_state, velocity_target

    adapter = LTX2T2AVAdapter.from_pretrained(t2av, **ADAPTER_KWARGS)
    frozen = frozen_parameters(adapter, ["audio"])
    apply_lora(adapter, LoRAConfig(rank=2, alpha=2), frozen)
    g = torch.Generator().manual_seed(0)
    video = torch.randint(0, 256, (FRAMES, 3, SIZE, SIZE), dtype=torch.uint8, generator=g)
    audio = (torch.sin(2 * torch.pi * 220 * torch.arange(18000) / 16000) * 0.5).repeat(2, 1)
    one = {k: v[:1] for k, v in condition.items()}
    clean = adapter.encode_output([[video, audio]], one, generator=torch.Generator().manual_seed(0))
    for cls in (SFTObjective, DPOObjective):  # configured weights keep a frozen component's term; unset, it leaves
        configured, default = cls(component_weights={"video": 1.0, "audio": 1.0}), cls()
        configured.freeze_components(["audio"])
        default.freeze_components(["audio"])
        assert configured.frozen_components == frozenset() and default.frozen_components == {"audio"}
    objective = SFTObjective(component_weights={"video": 1.0, "audio": 1.0})
    objective.freeze_components(["audio"])
    with torch.no_grad():
        loss = objective.loss(adapter, clean, one, torch.Generator().manual_seed(1)).loss
        [(sigma, noise)] = monte_carlo_draws(objective.timesteps, adapter, clean, 1, torch.Generator().manual_seed(1))
        pred = adapter.velocity(noise_state(clean, noise, sigma), sigma, one)
        errors = [((pred.components[k].float() - velocity_target(clean.components[k], noise.components[k])) ** 2
                   ).mean() for k in ("video", "audio")]  # fmt: skip
    torch.testing.assert_close(loss, errors[0] + errors[1], rtol=1e-6, atol=0)
    audio_only = SFTObjective(component_weights={"video": 0.0, "audio": 1.0})
    audio_only.freeze_components(["audio"])
    audio_only.loss(adapter, clean, one, torch.Generator().manual_seed(1)).loss.backward()
    params = dict(adapter.transformer.named_parameters())
    lora = {n: p for n, p in params.items() if "lora_" in n}
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in lora.values())  # the video LoRA learns
    assert all(not params[n].requires_grad and params[n].grad is None for n in frozen["transformer"])


def test_the_default_loss_weighs_each_stream_by_its_mean(t2av, condition):
    """Without ``component_weights`` the SFT loss is the adapter's ``default_component_weights`` reduction: the video
    stream's mean squared error and the audio stream's, 0.5 each (one mean per stream, as the LTX-2 trainers, at
    half their sum), by hand from the same sigma and noise draws; not the element-count pooling, which would weigh
    the audio by its share of the latent elements."""
    from ff_core.objectives import SFTObjective
    from ff_core.objectives.flow_matching import monte_carlo_draws, noise_state, velocity_target

    adapter = LTX2T2AVAdapter.from_pretrained(t2av, **ADAPTER_KWARGS)
    g = torch.Generator().manual_seed(0)
    video = torch.randint(0, 256, (FRAMES, 3, SIZE, SIZE), dtype=torch.uint8, generator=g)
    audio = (torch.sin(2 * torch.pi * 220 * torch.arange(18000) / 16000) * 0.5).repeat(2, 1)
    one = {k: v[:1] for k, v in condition.items()}
    clean = adapter.encode_output([[video, audio]], one, generator=torch.Generator().manual_seed(0))
    objective = SFTObjective()
    with torch.no_grad():
        loss = objective.loss(adapter, clean, one, torch.Generator().manual_seed(1)).loss
        [(sigma, noise)] = monte_carlo_draws(objective.timesteps, adapter, clean, 1, torch.Generator().manual_seed(1))
        pred = adapter.velocity(noise_state(clean, noise, sigma), sigma, one)
        err = {k: (pred.components[k].float() - velocity_target(clean.components[k], noise.components[k])) ** 2
               for k in ("video", "audio")}  # fmt: skip
    by_hand = 0.5 * err["video"].mean() + 0.5 * err["audio"].mean()
    pooled = (err["video"].sum() + err["audio"].sum()) / (err["video"].numel() + err["audio"].numel())
    torch.testing.assert_close(loss, by_hand, rtol=1e-6, atol=0)
    assert not torch.allclose(loss, pooled, rtol=1e-3, atol=0)


def test_the_plugin_declares_a_compatible_interface_version():
    from ff_ltx2 import LTX2I2AVAdapter, plugin

    from ff_core.plugins import interface_problem

    for cls in (LTX2T2AVAdapter, LTX2I2AVAdapter):
        assert interface_problem(plugin.ff_adapter_interface_version(), "ff-ltx2", cls) is None
    assert [c.name for c in plugin.ff_adapters()] == ["ltx2_t2av", "ltx2_i2av"]
