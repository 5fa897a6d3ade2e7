"""SD3Adapter on a tiny checkpoint: every stage, parity with diffusers' pipeline, LoRA export, discovery."""

from __future__ import annotations

import json
import math

import pytest
import torch
from ff_sd3 import SD3Adapter
from torch import nn
from torch.utils.data import default_collate

from ff_core.adapter import ConditionInput, LatentState
from ff_core.plugins import PluginRegistry, get_adapter_class
from ff_core.testing.shapes import BACKGROUNDS, PALETTE, SHAPES

RES = 32
PROMPTS = ["a red circle on a white background", "a blue square on a black background"]


@pytest.fixture(scope="module")
def adapter(tiny_sd3):
    return SD3Adapter.from_pretrained(tiny_sd3, resolution=RES)


@pytest.fixture(scope="module")
def condition(adapter):
    rows = adapter.preprocess([ConditionInput(p) for p in PROMPTS])
    return adapter.prepare_condition(default_collate(rows))


@pytest.fixture(scope="module")
def pipe(tiny_sd3):
    from diffusers import StableDiffusion3Pipeline

    return StableDiffusion3Pipeline.from_pretrained(tiny_sd3)


def _images(n: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 256, (3, RES, RES), generator=g, dtype=torch.uint8)] for _ in range(n)]


# -- discovery and loading ---------------------------------------------------------------------------
def test_discovered_through_the_real_entry_point(monkeypatch):
    monkeypatch.delenv("FF_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    info = PluginRegistry().adapters()["sd3-5"]
    assert info.cls is SD3Adapter and info.distribution == "ff-sd3"
    assert get_adapter_class("sd3-5") is SD3Adapter
    assert "CFG" in info.summary and "image" in info.summary


def test_from_pretrained_freezes_all_but_the_transformer(adapter, tiny_sd3):
    assert adapter.denoiser is adapter.transformer
    trainable = {n.split(".")[0] for n, p in adapter.named_parameters() if p.requires_grad}
    assert trainable == {"transformer"}
    assert adapter.resolution == RES and adapter.vae_scale_factor == 4
    assert adapter.max_sequence_length == 16  # 256 requested, capped by the tiny T5 tokenizer
    index = json.loads((tiny_sd3 / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    loaded = get_adapter_class("sd3-5").from_pretrained(tiny_sd3, resolution=RES)
    assert isinstance(loaded, SD3Adapter)


def test_resolution_must_fit_the_latent_grid(tiny_sd3):
    with pytest.raises(ValueError, match="multiple of 4"):
        SD3Adapter.from_pretrained(tiny_sd3, resolution=30)


def test_demo_words_tokenize_distinctly(adapter):
    words = [*PALETTE, *SHAPES, *BACKGROUNDS]
    for tok in (adapter.tokenizer, adapter.tokenizer_2, adapter.tokenizer_3):
        ids = [tuple(tok(w, add_special_tokens=False).input_ids) for w in words]
        assert len(set(ids)) == len(words)
        assert all(len(i) == 1 for i in ids)  # one token per demo word
        assert tok.unk_token_id not in {i[0] for i in ids}


# -- condition side ----------------------------------------------------------------------------------
def test_preprocess_matches_diffusers_encode_prompt(adapter, pipe):
    rows = adapter.preprocess([ConditionInput(p, negative_prompt="blurry") for p in PROMPTS])
    pe, ne, pp, npp = pipe.encode_prompt(
        PROMPTS, None, None, negative_prompt="blurry", max_sequence_length=adapter.max_sequence_length, device="cpu"
    )
    for i, row in enumerate(rows):
        assert set(row) == {"prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds",
                            "negative_pooled_prompt_embeds"}  # fmt: skip
        assert row["prompt_embeds"].shape == (16 + 16, 64) and row["pooled_prompt_embeds"].shape == (64,)
        assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in row.values())
        torch.testing.assert_close(row["prompt_embeds"], pe[i])
        torch.testing.assert_close(row["pooled_prompt_embeds"], pp[i])
        torch.testing.assert_close(row["negative_prompt_embeds"], ne[i])
        torch.testing.assert_close(row["negative_pooled_prompt_embeds"], npp[i])


def test_preprocess_is_deterministic_and_prompt_dependent(adapter):
    a, b = adapter.preprocess([ConditionInput(PROMPTS[0]), ConditionInput(PROMPTS[1])])
    again = adapter.preprocess([ConditionInput(PROMPTS[0])])[0]
    torch.testing.assert_close(a["prompt_embeds"], again["prompt_embeds"], rtol=0, atol=0)
    assert not torch.allclose(a["prompt_embeds"], b["prompt_embeds"])
    # A missing negative prompt is "" (diffusers' default), the same for every sample.
    empty = adapter.preprocess([ConditionInput(PROMPTS[0], negative_prompt="")])[0]
    torch.testing.assert_close(a["negative_prompt_embeds"], empty["negative_prompt_embeds"])
    torch.testing.assert_close(a["negative_prompt_embeds"], b["negative_prompt_embeds"])


def test_preprocess_survives_unknown_text(adapter):
    (row,) = adapter.preprocess([ConditionInput("a purple zébra, très jolie!! " * 8)])
    assert torch.isfinite(row["prompt_embeds"]).all()


def test_preprocess_rejects_input_media(adapter):
    with pytest.raises(ValueError, match="no input media"):
        adapter.preprocess([ConditionInput("x", media=[{"type": "image", "data": torch.zeros(3, 4, 4)}])])


def test_prepare_condition_and_unconditional(adapter, condition):
    assert condition["prompt_embeds"].shape == (2, 32, 64)
    assert condition["pooled_prompt_embeds"].dtype == adapter.transformer.dtype
    neg = adapter.unconditional(condition)
    assert set(neg) == {"prompt_embeds", "pooled_prompt_embeds"}
    assert neg["prompt_embeds"] is condition["negative_prompt_embeds"]
    positive_only = {k: condition[k] for k in ("prompt_embeds", "pooled_prompt_embeds")}
    assert adapter.unconditional(positive_only) is None


# -- target side and denoiser ------------------------------------------------------------------------
def test_encode_output_scales_vae_latents(adapter, condition):
    media = _images(2)
    torch.manual_seed(0)
    state = adapter.encode_output(media, condition)
    z = state.components["latent"]
    assert list(state.components) == ["latent"] and z.shape == (2, 4, 8, 8) and z.dtype == torch.float32
    torch.manual_seed(0)
    x = torch.stack([m[0] for m in media]).float() / 127.5 - 1
    raw = adapter.vae.encode(x).latent_dist.sample()
    cfg = adapter.vae.config
    torch.testing.assert_close(z, (raw - cfg.shift_factor) * cfg.scaling_factor)
    with pytest.raises(ValueError, match=r"media\[0\]"):
        adapter.encode_output([[torch.zeros(3, RES, RES), torch.zeros(3, RES, RES)]], condition)


def test_encode_output_draws_the_posterior_sample_from_the_generator(adapter, condition):
    """The posterior sample comes from the given generator (diffusers' ``latent_dist.sample(generator=...)``), not
    the global RNG: the same seed gives the same latents whatever the global state, and the global state is
    untouched, so training (which passes one generator per rank and micro-batch) is reproducible on resume."""
    media = _images(2)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = adapter.encode_output(media, condition, generator=torch.Generator().manual_seed(4)).components["latent"]
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.manual_seed(321)
    b = adapter.encode_output(media, condition, generator=torch.Generator().manual_seed(4)).components["latent"]
    c = adapter.encode_output(media, condition, generator=torch.Generator().manual_seed(5)).components["latent"]
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, c)
    x = torch.stack([m[0] for m in media]).float() / 127.5 - 1
    raw = adapter.vae.encode(x).latent_dist.sample(generator=torch.Generator().manual_seed(4))
    cfg = adapter.vae.config
    torch.testing.assert_close(a, (raw - cfg.shift_factor) * cfg.scaling_factor)


def test_velocity_is_the_transformer_at_sigma_times_1000(adapter, condition):
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.25, 0.9])
    v = adapter.velocity(LatentState({"latent": x}), sigma, condition).components["latent"]
    expected = adapter.transformer(
        hidden_states=x, encoder_hidden_states=condition["prompt_embeds"],
        pooled_projections=condition["pooled_prompt_embeds"], timestep=torch.tensor([250.0, 900.0]),
    ).sample  # fmt: skip
    torch.testing.assert_close(v, expected)
    assert v.shape == x.shape and v.requires_grad  # trainable path
    v.sum().backward()
    assert adapter.transformer.pos_embed.proj.weight.grad is not None
    assert all(p.grad is None for p in adapter.text_encoder_3.parameters())
    adapter.zero_grad(set_to_none=True)


def test_bfloat16_loading(tiny_sd3):
    bf = SD3Adapter.from_pretrained(tiny_sd3, resolution=RES, dtype="bfloat16")
    cond = bf.prepare_condition(default_collate(bf.preprocess([ConditionInput(PROMPTS[0])])))
    assert cond["prompt_embeds"].dtype == torch.bfloat16
    state = bf.encode_output(_images(1), cond)
    assert state.components["latent"].dtype == torch.bfloat16
    v = bf.velocity(state, torch.tensor([0.5]), cond)
    assert v.components["latent"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        SD3Adapter.from_pretrained(tiny_sd3, dtype="float8")


# -- generation --------------------------------------------------------------------------------------
def test_initial_noise_and_sigmas(adapter, condition):
    a = adapter.initial_noise(condition, torch.Generator().manual_seed(3)).components["latent"]
    b = adapter.initial_noise(condition, torch.Generator().manual_seed(3)).components["latent"]
    assert a.shape == (2, 4, RES // 4, RES // 4)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    sigmas = adapter.sampling_sigmas(4)
    adapter.scheduler.set_timesteps(4)
    torch.testing.assert_close(sigmas, adapter.scheduler.sigmas.float())
    assert len(sigmas) == 5 and sigmas[0] == 1.0 and sigmas[-1] == 0.0 and (sigmas.diff() < 0).all()


def test_decode_gives_uint8_images(adapter, condition):
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    images = adapter.decode(LatentState({"latent": latents}))
    assert len(images) == 2 and all(len(m) == 1 for m in images)
    assert all(m[0].dtype == torch.uint8 and m[0].shape == (3, RES, RES) for m in images)


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_sampling_matches_the_diffusers_pipeline(adapter, condition, pipe, guidance):
    """Same noise, sigmas, CFG and VAE decode as ``StableDiffusion3Pipeline.__call__``."""
    state = adapter.sample(condition, num_steps=3, guidance_scale=guidance, generator=torch.Generator().manual_seed(7))
    ours = torch.stack([m[0] for m in adapter.decode(state)])
    theirs = pipe(
        PROMPTS, num_inference_steps=3, guidance_scale=guidance, height=RES, width=RES, output_type="pt",
        generator=torch.Generator().manual_seed(7), max_sequence_length=adapter.max_sequence_length,
    ).images  # fmt: skip
    assert (ours.float() - theirs * 255).abs().max() <= 1.0  # rounding to uint8 only


def test_cfg_changes_the_sample(adapter, condition):
    plain = adapter.sample(condition, num_steps=2, guidance_scale=1.0, generator=torch.Generator().manual_seed(0))
    guided = adapter.sample(condition, num_steps=2, guidance_scale=4.0, generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(plain.components["latent"], guided.components["latent"])


# -- LoRA export -------------------------------------------------------------------------------------
def test_saved_lora_loads_into_diffusers(tiny_sd3, tmp_path):
    from diffusers import StableDiffusion3Pipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    adapter = SD3Adapter.from_pretrained(tiny_sd3, resolution=RES)
    torch.manual_seed(0)
    targets = list(SD3Adapter.default_lora_targets)
    config = LoraConfig(r=4, lora_alpha=4, target_modules=targets, init_lora_weights=False)
    adapter.transformer.add_adapter(config)
    saved = get_peft_model_state_dict(adapter.transformer)
    assert saved and all(k.endswith(("lora_A.weight", "lora_B.weight")) for k in saved)
    adapter.save_lora(tmp_path / "lora", saved, config)

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3)
    pipe.load_lora_weights(tmp_path / "lora", adapter_name="ff")
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name="ff")
    assert set(loaded) == set(saved)
    for k, v in saved.items():
        torch.testing.assert_close(loaded[k], v, rtol=0, atol=0)
    # Same LoRA, same input -> same transformer output.
    x, t = torch.randn(1, 4, 8, 8), torch.tensor([500.0])
    ctx, pooled = torch.randn(1, 32, 64), torch.randn(1, 64)
    with torch.no_grad():
        ours = adapter.transformer(x, ctx, pooled, t).sample
        theirs = pipe.transformer(x, ctx, pooled, t).sample
    torch.testing.assert_close(ours, theirs)


def lora_merged_by_hand(transformer: torch.nn.Module, scale: float) -> dict[str, torch.Tensor]:
    """The weights a LoRA-wrapped transformer computes with: ``W + scale * B @ A`` per wrapped layer, keyed as in the
    plain transformer's state dict (a hand computation, independent of peft's and diffusers' merge code)."""
    merged = {}
    for name, module in transformer.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            merged[f"{name}.weight"] = module.base_layer.weight + scale * b @ a
            merged[f"{name}.bias"] = module.base_layer.bias
    return merged


@pytest.mark.parametrize(
    ("rank", "alpha", "targets"),
    [
        (4, 16, None),  # the adapter's default targets, update 4x larger than at scale 1
        (8, 2, ["to_q", "add_k_proj", "ff.net.2", "proj_out"]),  # alpha < rank; targets beyond the defaults
        (3, 7.5, ["to_v", "to_add_out", "ff_context.net.0.proj", "context_embedder"]),
    ],
)
def test_exported_lora_fuses_in_diffusers_to_the_trained_weights(tiny_sd3, tmp_path, rank, alpha, targets):
    """STYLE 16: ff's LoRA export, loaded and fused by ``StableDiffusion3Pipeline``, gives the weights ff trained
    (``W + alpha / rank * B @ A``), not the update at scale 1 that a file without its alpha would give."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    from ff_core.lora import LoRAConfig, apply_lora, lora_config, lora_state_dict

    adapter = SD3Adapter.from_pretrained(tiny_sd3, resolution=RES)
    apply_lora(adapter, LoRAConfig(rank=rank, alpha=alpha, target_modules=targets))
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():  # a trained LoRA: lora_B is zero at initialisation
        for name, p in adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        expected = lora_merged_by_hand(adapter.transformer, alpha / rank)
    wrapped = {k.removesuffix(".weight") for k in expected if k.endswith(".weight")}
    for target in targets or SD3Adapter.default_lora_targets:
        assert any(n == target or n.endswith(f".{target}") for n in wrapped), target
    adapter.save_lora(tmp_path / "lora", lora_state_dict(adapter), lora_config(adapter))

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3)
    pipe.load_lora_weights(tmp_path / "lora")
    pipe.fuse_lora()
    pipe.unload_lora_weights()  # keeps the fused weights, drops the LoRA layers: plain state-dict keys again
    fused = pipe.transformer.state_dict()
    base = SD3Transformer2DModel.from_pretrained(tiny_sd3, subfolder="transformer").state_dict()
    assert fused.keys() == base.keys()
    for key, value in fused.items():
        torch.testing.assert_close(value, expected.get(key, base[key]), msg=lambda m: f"{key}: {m}")


# -- train / eval modes ------------------------------------------------------------------------------
class SD3WithContainers(SD3Adapter):
    """SD3 plus networks kept in containers: a trained and a frozen head in one ``nn.ModuleDict`` (as two experts
    of which one trains would be), and frozen modules in an ``nn.ModuleList``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.heads = nn.ModuleDict({"trained": nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)),
                                    "frozen": nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))})  # fmt: skip
        self.extras = nn.ModuleList([nn.Dropout(0.1), nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))])


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_train_switches_the_trained_networks_and_keeps_nested_frozen_modules_in_eval(tiny_sd3, lora):
    from ff_core.lora import LoRAConfig, apply_lora

    adapter = SD3WithContainers.from_pretrained(tiny_sd3, resolution=RES)
    adapter.requires_grad_(False)
    if lora:  # only the LoRA layers hold trainable parameters; the whole transformer trains, base layers included
        apply_lora(adapter, LoRAConfig(rank=2, alpha=4, dropout=0.1))
    else:
        adapter.transformer.requires_grad_(True)
    adapter.heads["trained"].requires_grad_(True)
    trained = [adapter.transformer, adapter.heads["trained"]]
    inside = {id(m) for net in trained for m in net.modules()}
    holders = {id(adapter), id(adapter.heads)}  # hold a trained network: they follow the mode
    frozen = [m for m in adapter.modules() if id(m) not in inside | holders]
    assert len(frozen) > 10 and adapter.heads["frozen"][1] in frozen and adapter.extras[1][1] in frozen

    adapter.train()
    assert all(m.training for net in trained for m in net.modules())
    assert not any(m.training for m in frozen)
    assert adapter.training and adapter.heads.training
    adapter.train(False)
    assert not any(m.training for m in adapter.modules())
    adapter.train()
    assert all(m.training for net in trained for m in net.modules()) and not any(m.training for m in frozen)
    assert adapter.trained_networks() == trained


# -- VAE trained on the shapes dataset ---------------------------------------------------------------
def test_trained_vae_reconstructs_held_out_shapes(trained_sd3, tiny_sd3, shapes_dirs):
    from ff_core.testing.tiny import load_images

    held = ((load_images(shapes_dirs[1] / "images", RES) + 1) * 127.5).round().to(torch.uint8)
    media = [[img] for img in held]
    errors = {}
    for name, path in (("trained", trained_sd3), ("random", tiny_sd3)):
        ad = SD3Adapter.from_pretrained(path, resolution=RES)
        torch.manual_seed(0)
        state = ad.encode_output(media, {})
        if name == "trained":  # shift/scale were fitted so the latents are standardised (SD3 convention)
            z = state.components["latent"]
            assert abs(float(z.mean())) < 0.25 and 0.8 < float(z.std()) < 1.2
        recon = torch.stack([m[0] for m in ad.decode(state)])
        errors[name] = float((recon.float() - held.float()).abs().mean())
    # Measured in uint8 units on 48 held-out images: 100 steps (this fixture) ~34, random VAE ~105;
    # the CLI default (300 steps on 384 images) reaches ~16.5.
    assert errors["trained"] < 50, errors
    assert errors["trained"] < errors["random"] / 2.5, errors


# -- noise-schedule shift: training and sampling follow the checkpoint's scheduler ---------------------
@pytest.fixture(scope="module")
def shift3_dir(tmp_path_factory):
    """The tiny checkpoint (same weights as ``tiny_sd3``) with SD3.5's scheduler shift 3."""
    from ff_sd3.testing import build_tiny_sd3

    return build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3_shift3"), num_layers=2, scheduler_shift=3.0)


def _pipeline_sigmas(pipe, num_steps: int) -> torch.Tensor:
    """The sigmas ``StableDiffusion3Pipeline.__call__`` integrates over (read from its scheduler mid-run)."""
    seen = {}

    def grab(pipeline, step, timestep, kwargs):
        seen["sigmas"] = pipeline.scheduler.sigmas.clone()
        return kwargs

    pipe(PROMPTS[0], num_inference_steps=num_steps, height=RES, width=RES, output_type="latent",
         generator=torch.Generator().manual_seed(0), max_sequence_length=16, callback_on_step_end=grab)  # fmt: skip
    return seen["sigmas"].float()


def test_training_shift_and_sampling_sigmas_follow_the_checkpoint_scheduler(shift3_dir, tiny_sd3):
    """Default: training draws sigma = shift_sigma(sigmoid(n), 3) and sampling uses the pipeline's sigmas; the
    recipe's timesteps.shift / sampling.shift win (shift 1 on the shift-3 checkpoint samples on exactly the grid
    diffusers' pipeline uses for the shift-1 checkpoint)."""
    from diffusers import StableDiffusion3Pipeline

    from ff_core.objectives import SFTObjective, TimestepSampler
    from ff_core.objectives.flow_matching import shift_sigma

    adapter = SD3Adapter.from_pretrained(shift3_dir, resolution=RES)
    assert adapter.scheduler.config.shift == 3.0 and adapter.timestep_shift() == 3.0
    shift3 = _pipeline_sigmas(StableDiffusion3Pipeline.from_pretrained(shift3_dir), 4)
    shift1 = _pipeline_sigmas(StableDiffusion3Pipeline.from_pretrained(tiny_sd3), 4)
    torch.testing.assert_close(adapter.sampling_sigmas(4), shift3, rtol=0, atol=0)
    torch.testing.assert_close(adapter.sampling_sigmas(4, shift=1.0), shift1, rtol=0, atol=0)
    torch.testing.assert_close(adapter.sampling_sigmas(4), shift3, rtol=0, atol=0)  # the adapter's scheduler is intact

    clean = LatentState({"latent": torch.zeros(3, 4, 8, 8)})
    plain = torch.sigmoid(torch.randn(3, generator=torch.Generator().manual_seed(0)))
    zero = type("Zero", (), {"velocity": lambda self, s, sigma, c: s, "timestep_shift": adapter.timestep_shift})()
    default = SFTObjective().loss(zero, clean, {}, torch.Generator().manual_seed(0))
    torch.testing.assert_close(default.sigma, shift_sigma(plain, 3.0)[None])
    override = SFTObjective(TimestepSampler(shift=1.0)).loss(zero, clean, {}, torch.Generator().manual_seed(0))
    torch.testing.assert_close(override.sigma, plain[None])


def test_dynamic_shifting_trains_on_the_resolution_dependent_shift(tiny_sd3):
    """With ``use_dynamic_shifting`` the pipeline warps sigmas by ``exp(mu)`` with ``mu = calculate_shift(seq_len)``;
    the training shift is that ``exp(mu)`` for the batch's latent size, so shift_sigma(unshifted grid, shift)
    reproduces the pipeline's grid."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    from ff_core.objectives.flow_matching import shift_sigma

    dynamic = dict(use_dynamic_shifting=True, base_image_seq_len=16, max_image_seq_len=256, base_shift=0.5,
                   max_shift=1.15)  # fmt: skip
    adapter = SD3Adapter.from_pretrained(tiny_sd3, resolution=RES)
    adapter.scheduler = FlowMatchEulerDiscreteScheduler.from_config(adapter.scheduler.config, **dynamic)
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, **dynamic)
    expected = _pipeline_sigmas(pipe, 4)
    torch.testing.assert_close(adapter.sampling_sigmas(4), expected, rtol=0, atol=0)
    # 8x8 latents (64 tokens): mu = 0.5 + (1.15 - 0.5) / (256 - 16) * (64 - 16) = 0.63
    shift = adapter.timestep_shift()
    assert shift == pytest.approx(math.exp(0.63))
    unshifted = FlowMatchEulerDiscreteScheduler(shift=1.0)
    unshifted.set_timesteps(4)
    torch.testing.assert_close(shift_sigma(unshifted.sigmas.double(), shift).float(), expected)
    # Larger training images shift more (16x16 latents: 256 tokens, mu = max_shift).
    assert adapter.timestep_shift(LatentState({"latent": torch.zeros(1, 4, 16, 16)})) == pytest.approx(math.exp(1.15))


def test_sampling_shift_override_reaches_generation(shift3_dir, tiny_sd3):
    """``model.sampling.shift: 1`` on the shift-3 checkpoint generates what diffusers' pipeline generates from the
    shift-1 checkpoint (same weights, same seed: batch 0 is seeded with ``sampling.seed``)."""
    from diffusers import StableDiffusion3Pipeline

    from ff_core.module import FlowModule, SamplingConfig

    module = FlowModule("sd3-5", str(shift3_dir), adapter_kwargs={"resolution": RES},
                        sampling=SamplingConfig(num_steps=3, seed=5, shift=1.0))  # fmt: skip
    module.configure_model()
    rows = module.adapter.preprocess([ConditionInput(p) for p in PROMPTS])
    batch = {"condition": default_collate(rows), "index": torch.arange(2), "prompt": PROMPTS}
    ours = torch.stack([m[0] for m in module.generate(batch, 0)["media"]])
    theirs = StableDiffusion3Pipeline.from_pretrained(tiny_sd3)(
        PROMPTS, num_inference_steps=3, guidance_scale=1.0, height=RES, width=RES, output_type="pt",
        generator=torch.Generator().manual_seed(5), max_sequence_length=module.adapter.max_sequence_length,
    ).images  # fmt: skip
    assert (ours.float() - theirs * 255).abs().max() <= 1.0
    with pytest.raises(ValueError, match=r"model\.sampling\.shift must be > 0"):
        SamplingConfig(shift=-1.0)
