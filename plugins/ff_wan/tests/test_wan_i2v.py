"""wan2_i2v on tiny Wan2.1 I2V / FLF2V, Wan2.2 TI2V and I2V-A14B checkpoints: contracts resolved from the config alone,
slot rules, the condition encodings and one sampling run against diffusers' WanImageToVideoPipeline, the pinned first
frame and per-token timesteps of TI2V, and A14B's expert switch."""

from __future__ import annotations

import shutil

import pytest
import torch
from ff_wan import WanI2VAdapter, WanT2VAdapter
from ff_wan.adapter import wan_variant
from PIL import Image
from torch.utils.data import default_collate
from wan_geometry import ADAPTER_KWARGS, FRAMES, SIZE

from ff_core.adapter import ConditionInput, LatentState
from ff_core.testing.contracts import SUPPORT_TABLE

PROMPT = "a red square moving right"
I2V_VARIANTS = ("i2v", "flf2v", "ti2v", "a14b")
SPEC_ROW = {"i2v": "wan2_i2v-2.1", "flf2v": "wan2_i2v-flf2v", "ti2v": "wan2_i2v-ti2v", "a14b": "wan2_i2v-a14b"}


def _image(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (3, SIZE, SIZE), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


FIRST, LAST = _image(1), _image(2)


def _pil(t: torch.Tensor) -> Image.Image:
    return Image.fromarray(t.permute(1, 2, 0).numpy())


def _media(last: bool) -> list[dict]:
    media = [{"type": "image", "data": FIRST, "slot": "first_frame"}]
    return media + ([{"type": "image", "data": LAST, "slot": "last_frame"}] if last else [])


def _uses_last(variant: str) -> bool:
    return variant in ("flf2v", "a14b")


@pytest.fixture(scope="module")
def adapters(tiny_wan):
    return {v: WanI2VAdapter.from_pretrained(tiny_wan(v), **ADAPTER_KWARGS) for v in I2V_VARIANTS}


def _condition(adapter, last: bool):
    return adapter.prepare_condition(default_collate(adapter.preprocess([ConditionInput(PROMPT, media=_media(last))])))


# -- contracts from the config alone -----------------------------------------------------------------
@pytest.mark.parametrize("variant", I2V_VARIANTS)
def test_contract_resolved_from_config_files_alone(tiny_wan, tmp_path, variant):
    """Only the JSON files copied (no weights): the variant and its spec row are read from them."""
    configs = tmp_path / variant
    for src in tiny_wan(variant).rglob("*.json"):
        dst = configs / src.relative_to(tiny_wan(variant))
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, dst)
    assert not list(configs.rglob("*.safetensors"))
    assert wan_variant(configs) == variant
    assert WanI2VAdapter.resolve_contract(configs) == SUPPORT_TABLE[SPEC_ROW[variant]]
    columns = WanI2VAdapter.resolve_tensor_columns(configs)
    assert ("clip_feature" in columns.required) == (variant in ("i2v", "flf2v"))  # Wan2.2 has no image encoder
    assert {"text_embedding", "first_frame_latent", "vae_latent"} <= set(columns.required)


def test_without_a_checkpoint_the_contract_is_the_class_default():
    assert WanI2VAdapter.resolve_contract(None) == WanI2VAdapter.io_contract == SUPPORT_TABLE["wan2_i2v-2.1"]


def test_t2v_checkpoints_are_not_image_to_video(tiny_wan):
    assert wan_variant(tiny_wan("t2v")) == "t2v"
    with pytest.raises(ValueError, match="text-to-video checkpoint; wan2_i2v needs an image-to-video one"):
        WanI2VAdapter.resolve_contract(tiny_wan("t2v"))
    with pytest.raises(FileNotFoundError, match="no model_index.json"):
        wan_variant(tiny_wan("t2v") / "vae")


def test_loaded_adapters_carry_their_checkpoint_contract(adapters):
    for variant, adapter in adapters.items():
        assert adapter.variant == variant and adapter.io_contract == SUPPORT_TABLE[SPEC_ROW[variant]]
        assert adapter.io_contract.max_batch_size == 1
    assert WanI2VAdapter.io_contract == SUPPORT_TABLE["wan2_i2v-2.1"]  # the class default (no checkpoint known)
    assert (adapters["i2v"].image_encoder is not None) and (adapters["flf2v"].image_encoder is not None)
    assert adapters["ti2v"].image_encoder is None and adapters["a14b"].image_encoder is None
    assert adapters["a14b"].transformer_2 is not None and adapters["a14b"].boundary_ratio == 0.875


@pytest.mark.parametrize(
    ("variant", "media", "message"),
    [
        ("i2v", [], r"requires \['first_frame'\]"),
        ("flf2v", [{"type": "image", "data": FIRST, "slot": "first_frame"}], r"requires \['last_frame'\]"),
        ("i2v", [{"type": "image", "data": FIRST}, {"type": "image", "data": LAST, "slot": "last_frame"}],
         "slot 'last_frame' is not accepted by this i2v checkpoint"),
        ("ti2v", [{"type": "image", "data": FIRST}, {"type": "image", "data": LAST}], "slot None is not accepted"),
        ("a14b", [{"type": "image", "data": FIRST}, {"type": "image", "data": FIRST, "slot": "first_frame"}],
         "slot 'first_frame' bound twice"),
        ("a14b", [{"type": "video", "data": FIRST, "slot": "first_frame"}], "takes images, got 'video'"),
    ],
)  # fmt: skip
def test_preprocess_enforces_the_checkpoint_slots(adapters, variant, media, message):
    with pytest.raises(ValueError, match=message):
        adapters[variant].preprocess([ConditionInput(PROMPT, media=media)])


def test_a14b_last_frame_is_optional_and_unslotted_images_fill_slots_in_order(adapters):
    adapter = adapters["a14b"]
    (only_first,) = adapter.preprocess([ConditionInput(PROMPT, media=_media(False))])
    (both,) = adapter.preprocess([ConditionInput(PROMPT, media=[{"type": "image", "data": FIRST},
                                                                {"type": "image", "data": LAST}])])  # fmt: skip
    # The mask's 4 channels are the 4 pixel frames folded into each latent frame: the last pixel frame is channel 3.
    mask = adapter.temporal_stride
    assert (only_first["first_frame_latent"][:mask, -1] == 0).all()  # no last frame: its mask is 0
    assert (both["first_frame_latent"][mask - 1, -1] == 1).all()
    assert (both["first_frame_latent"][: mask - 1, -1] == 0).all()
    assert (both["first_frame_latent"][:mask, 0] == 1).all()  # the first frame, repeated over the stride
    assert not torch.equal(only_first["first_frame_latent"], both["first_frame_latent"])


def test_condition_images_are_fitted_to_the_canvas(adapters):
    adapter = adapters["ti2v"]
    big = torch.nn.functional.interpolate(FIRST[None].float(), size=(48, 64), mode="nearest")[0].to(torch.uint8)
    (row,) = adapter.preprocess([ConditionInput(PROMPT, media=[{"type": "image", "data": big}])])
    assert row["first_frame_latent"].shape == (4, 1, 4, 4)


def _off_canvas(height: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, height, width), generator=g, dtype=torch.uint8)


# -- off-canvas condition images against the pipeline's own preprocessing (issue 23, item 3) ---------
@pytest.mark.parametrize("variant", ["i2v", "flf2v", "ti2v"])
@pytest.mark.parametrize(("height", "width"), [(48, 64), (40, 24)])
def test_off_canvas_condition_images_are_prepared_as_the_pipeline_prepares_them(adapters, tiny_wan, variant, height,
                                                                                width):  # fmt: skip
    """A 48x64 (and a 40x24) image onto the 32x32 canvas: ``first_frame_latent`` is ``prepare_latents`` of
    ``video_processor.preprocess(image, height, width)`` (a LANCZOS stretch, no crop), and ``clip_feature`` is
    ``encode_image`` of the image as given (CLIP's processor sizes it), not of the canvas image."""
    from diffusers import WanImageToVideoPipeline

    adapter, last = adapters[variant], _uses_last(variant)
    first, final = _off_canvas(height, width, 3), _off_canvas(width, height, 4)  # the last one: the other aspect
    media = [{"type": "image", "data": first, "slot": "first_frame"}]
    media += [{"type": "image", "data": final, "slot": "last_frame"}] if last else []
    (row,) = adapter.preprocess([ConditionInput(PROMPT, media=media)])
    pipe = WanImageToVideoPipeline.from_pretrained(tiny_wan(variant))
    image = pipe.video_processor.preprocess(_pil(first), height=SIZE, width=SIZE)
    last_image = pipe.video_processor.preprocess(_pil(final), height=SIZE, width=SIZE) if last else None
    with torch.no_grad():
        out = pipe.prepare_latents(image, 1, 4, SIZE, SIZE, FRAMES, torch.float32, "cpu",
                                   torch.Generator().manual_seed(0), None, last_image)  # fmt: skip
    torch.testing.assert_close(row["first_frame_latent"], out[1][0])
    if variant in ("i2v", "flf2v"):
        with torch.no_grad():
            clip = pipe.encode_image([_pil(first), _pil(final)] if last else _pil(first), "cpu")
        torch.testing.assert_close(row["clip_feature"], clip)


def test_cover_keeps_the_old_rule_and_keys_another_cache(adapters, monkeypatch):
    """``condition_resize = "cover"`` (a subclass's class attribute) puts the image on the canvas by the target rule
    (ff before issue 23) and hands CLIP that canvas image; the rule is part of the condition cache's identity."""
    from ff_core.contracts import MediaGeometry
    from ff_core.data.media.geometry import fit_image

    adapter = adapters["i2v"]
    image = _off_canvas(48, 64, 3)
    old = fit_image(image, MediaGeometry(SIZE, SIZE))
    stretched = adapter.canvas_image(image)
    assert adapter.preprocess_identity()["condition_images"] == "stretch:lanczos"
    (new_row,) = adapter.preprocess([ConditionInput(PROMPT, media=[{"type": "image", "data": image}])])
    monkeypatch.setattr(adapter, "condition_resize", "cover")
    assert torch.equal(adapter.canvas_image(image), old) and not torch.equal(stretched, old)
    assert adapter.preprocess_identity()["condition_images"] == "cover:lanczos"
    (row,) = adapter.preprocess([ConditionInput(PROMPT, media=[{"type": "image", "data": image}])])
    torch.testing.assert_close(row["clip_feature"], adapter.encode_image([old]))
    assert not torch.allclose(row["first_frame_latent"], new_row["first_frame_latent"])


# -- condition encodings against the pipeline --------------------------------------------------------
@pytest.mark.parametrize("variant", I2V_VARIANTS)
def test_condition_encodings_match_the_pipeline(adapters, tiny_wan, variant):
    """``first_frame_latent`` is ``prepare_latents``' condition (posterior mode, normalised; with the mask channels
    for channel-concatenating checkpoints); ``clip_feature`` is ``encode_image`` of the image(s)."""
    from diffusers import WanImageToVideoPipeline

    adapter, last = adapters[variant], _uses_last(variant)
    (row,) = adapter.preprocess([ConditionInput(PROMPT, media=_media(last))])
    pipe = WanImageToVideoPipeline.from_pretrained(tiny_wan(variant))
    image = pipe.video_processor.preprocess(_pil(FIRST), height=SIZE, width=SIZE)
    last_image = pipe.video_processor.preprocess(_pil(LAST), height=SIZE, width=SIZE) if last else None
    with torch.no_grad():
        out = pipe.prepare_latents(image, 1, 4, SIZE, SIZE, FRAMES, torch.float32, "cpu",
                                   torch.Generator().manual_seed(0), None, last_image)  # fmt: skip
    expected = out[1][0]  # (TI2V: the first frame's latent; else mask + condition latents)
    torch.testing.assert_close(row["first_frame_latent"], expected)
    if variant in ("i2v", "flf2v"):
        with torch.no_grad():
            clip = pipe.encode_image([_pil(FIRST), _pil(LAST)] if last else _pil(FIRST), "cpu")
        torch.testing.assert_close(row["clip_feature"], clip)
    else:
        assert "clip_feature" not in row


# -- one full sampling run against WanImageToVideoPipeline ------------------------------------------
@pytest.mark.parametrize("variant", I2V_VARIANTS)
def test_sampling_matches_wan_image_to_video_pipeline(adapters, tiny_wan, variant):
    from diffusers import WanImageToVideoPipeline

    adapter, last = adapters[variant], _uses_last(variant)
    condition = _condition(adapter, last)
    state = adapter.sample(condition, num_steps=4, guidance_scale=3.0, generator=torch.Generator().manual_seed(7))
    ours = adapter.decode(state)[0][0]
    pipe = WanImageToVideoPipeline.from_pretrained(tiny_wan(variant))
    theirs = pipe(image=_pil(FIRST), last_image=_pil(LAST) if last else None, prompt=PROMPT, num_inference_steps=4,
                  guidance_scale=3.0, height=SIZE, width=SIZE, num_frames=FRAMES, output_type="pt",
                  generator=torch.Generator().manual_seed(7),
                  max_sequence_length=adapter.max_sequence_length).frames[0]  # fmt: skip
    assert ours.shape == theirs.shape == (FRAMES, 3, SIZE, SIZE)
    assert (ours.float() - theirs * 255).abs().max() <= 0.5 + 1e-4


# -- TI2V: pinned first frame, per-token timesteps ---------------------------------------------------
def test_ti2v_pins_the_first_latent_frame_and_gives_it_timestep_zero(adapters):
    adapter = adapters["ti2v"]
    condition = _condition(adapter, False)
    video = [[torch.randint(0, 256, (FRAMES, 3, SIZE, SIZE), generator=torch.Generator().manual_seed(0),
                            dtype=torch.uint8)]]  # fmt: skip
    clean = adapter.encode_output(video, condition, generator=torch.Generator().manual_seed(0))
    z, mask = clean.components["latent"], clean.masks["latent"]
    torch.testing.assert_close(z[:, :, :1], condition["first_frame_latent"], rtol=0, atol=0)
    assert mask.flatten().tolist() == [0.0, 1.0, 1.0]
    sigma = torch.tensor([0.6])
    v = adapter.velocity(clean, sigma, condition).components["latent"]
    tokens = torch.tensor([0.0] * 4 + [600.0] * 8)[None]  # 2x2 tokens per latent frame; frame 0 at t = 0
    expected = adapter.transformer(hidden_states=z, timestep=tokens, encoder_hidden_states=condition["prompt_embeds"],
                                   return_dict=False)[0]  # fmt: skip
    torch.testing.assert_close(v, expected)
    stored = adapter.stored_latents({"latent": z}, condition)
    assert stored.masks["latent"].flatten().tolist() == [0.0, 1.0, 1.0]


def test_t2v_adapter_on_a_ti2v_checkpoint_uses_expanded_timesteps(tiny_wan):
    from diffusers import WanPipeline

    adapter = WanT2VAdapter.from_pretrained(tiny_wan("ti2v"), **ADAPTER_KWARGS)
    assert adapter.expand_timesteps
    condition = adapter.prepare_condition(default_collate(adapter.preprocess([ConditionInput(PROMPT)])))
    ours = adapter.decode(adapter.sample(condition, num_steps=3, generator=torch.Generator().manual_seed(1)))[0][0]
    theirs = WanPipeline.from_pretrained(tiny_wan("ti2v"))(
        PROMPT, num_inference_steps=3, guidance_scale=1.0, height=SIZE, width=SIZE, num_frames=FRAMES,
        output_type="pt", generator=torch.Generator().manual_seed(1), max_sequence_length=16,
    ).frames[0]  # fmt: skip
    assert (ours.float() - theirs * 255).abs().max() <= 0.5 + 1e-4


# -- A14B: two experts switched at the boundary ------------------------------------------------------
def test_a14b_switches_experts_per_sample_at_the_boundary(adapters):
    adapter = adapters["a14b"]
    assert set(adapter.denoisers()) == {"transformer", "transformer_2"}
    condition = _condition(adapter, True)
    both = {k: torch.cat([v, v]) for k, v in condition.items()}
    x = torch.randn(2, 4, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.95, 0.3])  # t = 950 >= 875: transformer; t = 300: transformer_2
    v = adapter.velocity(LatentState({"latent": x}), sigma, both).components["latent"]
    inputs = torch.cat([x, both["first_frame_latent"]], dim=1)
    for i, (net, t) in enumerate(((adapter.transformer, 950.0), (adapter.transformer_2, 300.0))):
        expected = net(hidden_states=inputs[i : i + 1], timestep=torch.tensor([t]),
                       encoder_hidden_states=both["prompt_embeds"][i : i + 1], return_dict=False)[0]  # fmt: skip
        torch.testing.assert_close(v[i : i + 1], expected)
    other = adapter.transformer_2(hidden_states=inputs[:1], timestep=torch.tensor([950.0]),
                                  encoder_hidden_states=both["prompt_embeds"][:1], return_dict=False)[0]  # fmt: skip
    assert not torch.allclose(v[:1], other)


def test_a14b_sampling_runs_both_experts(adapters):
    adapter = adapters["a14b"]
    calls = {"transformer": 0, "transformer_2": 0}
    hooks = [net.register_forward_hook(lambda *a, n=name: calls.__setitem__(n, calls[n] + 1))
             for name, net in adapter.denoisers().items()]  # fmt: skip
    try:
        adapter.sample(_condition(adapter, False), num_steps=4, generator=torch.Generator().manual_seed(0))
    finally:
        for h in hooks:
            h.remove()
    assert calls["transformer"] > 0 and calls["transformer_2"] > 0, calls


# -- training step -----------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", I2V_VARIANTS)
def test_sft_step_trains_the_transformers_only(tiny_wan, variant):
    from ff_core.objectives import SFTObjective

    adapter = WanI2VAdapter.from_pretrained(tiny_wan(variant), **ADAPTER_KWARGS)
    adapter.requires_grad_(False)
    for net in adapter.denoisers().values():
        net.requires_grad_(True)
    rows = adapter.preprocess([ConditionInput(PROMPT, media=_media(_uses_last(variant)))])
    video = [[torch.randint(0, 256, (FRAMES, 3, SIZE, SIZE), dtype=torch.uint8)]]
    loss = SFTObjective().training_loss(adapter, {"condition": default_collate(rows), "target": video},
                                        torch.Generator().manual_seed(0)).loss  # fmt: skip
    loss.backward()
    assert torch.isfinite(loss)
    trained = {id(p) for net in adapter.denoisers().values() for p in net.parameters()}
    assert all(p.grad is None for p in adapter.parameters() if id(p) not in trained)
    assert any(p.grad is not None for p in adapter.transformer.parameters() if id(p) in trained) or (
        variant == "a14b" and any(p.grad is not None for p in adapter.transformer_2.parameters()))


# -- A14B LoRA: both experts exported, loaded by the pipeline ---------------------------------------
def test_a14b_loras_of_both_experts_load_into_the_pipeline(tiny_wan, tmp_path):
    """ff trains a LoRA on each expert and exports one file per network (``save_loras``); diffusers loads the first
    with ``load_lora_weights`` and the second with ``load_into_transformer_2=True``, and then generates what ff
    samples with both LoRAs."""
    from diffusers import WanImageToVideoPipeline

    from ff_core.lora import LoRAConfig, apply_lora, lora_configs, lora_state_dicts

    adapter = WanI2VAdapter.from_pretrained(tiny_wan("a14b"), **ADAPTER_KWARGS)
    apply_lora(adapter, LoRAConfig(rank=2, alpha=4))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for net in adapter.denoisers().values():
            for name, p in net.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    files = adapter.save_loras(tmp_path / "lora", lora_state_dicts(adapter), lora_configs(adapter))
    assert set(files) == {"transformer", "transformer_2"}

    pipe = WanImageToVideoPipeline.from_pretrained(tiny_wan("a14b"))
    pipe.load_lora_weights(tmp_path / "lora", weight_name=files["transformer"].name, adapter_name="high")
    pipe.load_lora_weights(tmp_path / "lora", weight_name=files["transformer_2"].name, adapter_name="low",
                           load_into_transformer_2=True)  # fmt: skip
    condition = _condition(adapter, False)
    ours = adapter.decode(adapter.sample(condition, num_steps=4, generator=torch.Generator().manual_seed(5)))[0][0]
    theirs = pipe(image=_pil(FIRST), prompt=PROMPT, num_inference_steps=4, guidance_scale=1.0, height=SIZE,
                  width=SIZE, num_frames=FRAMES, output_type="pt", generator=torch.Generator().manual_seed(5),
                  max_sequence_length=adapter.max_sequence_length).frames[0]  # fmt: skip
    assert (ours.float() - theirs * 255).abs().max() <= 0.5 + 1e-4
    plain = WanImageToVideoPipeline.from_pretrained(tiny_wan("a14b"))(
        image=_pil(FIRST), prompt=PROMPT, num_inference_steps=4, guidance_scale=1.0, height=SIZE, width=SIZE,
        num_frames=FRAMES, output_type="pt", generator=torch.Generator().manual_seed(5), max_sequence_length=16,
    ).frames[0]  # fmt: skip
    assert (plain - theirs).abs().max() > 1 / 255


def test_condition_latents_must_fit_the_target_geometry(adapters):
    """Condition latents are encoded at the adapter's clip geometry; a target of another one is a clear error."""
    # Wan2.1's condition spans every frame; TI2V's is the first latent frame only, so only its canvas must match.
    for variant, other in (("i2v", (5, 3, SIZE, SIZE)), ("ti2v", (FRAMES, 3, SIZE, 2 * SIZE))):
        adapter = adapters[variant]
        condition = _condition(adapter, False)
        other = [[torch.zeros(other, dtype=torch.uint8)]]
        with pytest.raises(ValueError, match=r"first_frame_latent .* does not fit latents"):
            state = adapter.encode_output(other, condition)
            adapter.velocity(state, torch.tensor([0.5]), condition)


@pytest.mark.parametrize("variant", ["i2v", "ti2v"])
def test_bfloat16_transformers_with_an_fp32_vae(tiny_wan, variant):
    adapter = WanI2VAdapter.from_pretrained(tiny_wan(variant), **ADAPTER_KWARGS, dtype="bfloat16")
    assert adapter.transformer.dtype == torch.bfloat16 and adapter.vae.dtype == torch.float32
    condition = _condition(adapter, False)
    assert condition["prompt_embeds"].dtype == torch.bfloat16
    video = [[torch.randint(0, 256, (FRAMES, 3, SIZE, SIZE), dtype=torch.uint8)]]
    clean = adapter.encode_output(video, condition, generator=torch.Generator().manual_seed(0))
    v = adapter.velocity(clean, torch.tensor([0.5]), condition).components["latent"]
    assert v.dtype == torch.bfloat16 and torch.isfinite(v.float()).all()
    out = adapter.decode(adapter.sample(condition, num_steps=2, generator=torch.Generator().manual_seed(0)))[0][0]
    assert out.dtype == torch.uint8 and out.shape == (FRAMES, 3, SIZE, SIZE)
