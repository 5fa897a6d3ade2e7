"""ltx2_i2av on a tiny checkpoint against diffusers' LTX2ImageToVideoPipeline: the first-frame latent (H.264
re-compression, posterior mode, normalisation), the pinned tokens (never noised, not in the loss, not stepped, seen at
timestep 0), the denoiser at every step and sampling with and without CFG on both streams."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import LTX2ImageToVideoPipeline
from ff_ltx2 import LTX2I2AVAdapter
from ltx2_geometry import ADAPTER_KWARGS, AUDIO_LATENTS, FPS, FRAMES, PLAIN_GUIDANCE, SIZE
from PIL import Image
from torch.utils.data import default_collate

from ff_core.adapter import ConditionInput, LatentState
from ff_core.objectives.flow_matching import noise_state, per_sample_squared_error

PROMPTS = ["a red square with a low tone", "a blue square with a high tone"]
STEPS = 3
LATENT_FRAMES = (FRAMES - 1) // 2 + 1


@pytest.fixture(scope="module")
def i2av(tiny_ltx2):
    return tiny_ltx2("i2av")


@pytest.fixture(scope="module")
def adapter(i2av):
    return LTX2I2AVAdapter.from_pretrained(i2av, **ADAPTER_KWARGS)


@pytest.fixture(scope="module")
def pipe(i2av):
    return LTX2ImageToVideoPipeline.from_pretrained(i2av)


@pytest.fixture(scope="module")
def images():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (3, SIZE, SIZE), dtype=torch.uint8, generator=g) for _ in PROMPTS]


def inputs(images, n=2):
    return [ConditionInput(p, negative_prompt="", media=[{"type": "image", "data": im, "slot": "first_frame"}])
            for p, im in zip(PROMPTS[:n], images)]  # fmt: skip


@pytest.fixture(scope="module")
def condition(adapter, images):
    return adapter.prepare_condition(default_collate(adapter.preprocess(inputs(images, 1))))


def _pil(image):
    return Image.fromarray(image.permute(1, 2, 0).numpy())


def test_contract_is_the_spec_row():
    from ff_core.testing.contracts import SUPPORT_TABLE

    assert LTX2I2AVAdapter.io_contract == SUPPORT_TABLE["ltx2_i2av"]


@pytest.mark.parametrize("crf", [None, 0])
def test_first_frame_latent_is_the_pipeline_condition(i2av, pipe, images, crf):
    """``prepare_latents``' first latent frame: the image re-compressed at the checkpoint's CRF (33 for Gemma-3
    LTX-2; 0 skips it), preprocessed to [-1, 1], VAE posterior mode, normalised."""
    from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf

    adapter = LTX2I2AVAdapter.from_pretrained(i2av, **ADAPTER_KWARGS, image_crf=crf)
    assert adapter.image_crf == (33 if crf is None else 0)
    rows = adapter.preprocess(inputs(images))
    for row, image in zip(rows, images):
        pil = Image.fromarray(apply_image_conditioning_crf(np.array(_pil(image)), adapter.image_crf))
        x = pipe.video_processor.preprocess(pil, height=SIZE, width=SIZE)
        with torch.no_grad():
            latents, mask = pipe.prepare_latents(x, 1, 4, SIZE, SIZE, FRAMES, 0.0, torch.float32, "cpu",
                                                 torch.Generator().manual_seed(0), None)  # fmt: skip
        reference = LTX2ImageToVideoPipeline._unpack_latents(latents, LATENT_FRAMES, SIZE // 8, SIZE // 8)[:, :, :1]
        torch.testing.assert_close(row["first_frame_latent"], reference[0], rtol=0, atol=1e-6)
    assert not torch.equal(rows[0]["first_frame_latent"], rows[1]["first_frame_latent"])


@pytest.mark.parametrize(("height", "width"), [(48, 64), (40, 24)])
@pytest.mark.parametrize("crf", [None, 0])
def test_off_canvas_images_are_prepared_as_the_pipeline_prepares_them(i2av, pipe, height, width, crf):
    """A 48x64 (and a 40x24) image onto the 32x32 canvas (issue 23, item 3): the pipeline's own preprocessing, CRF
    re-compression at the image's size then ``video_processor.preprocess(image, height, width)`` (a BILINEAR stretch,
    no crop), then ``prepare_latents``' first latent frame."""
    from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf

    adapter = LTX2I2AVAdapter.from_pretrained(i2av, **ADAPTER_KWARGS, image_crf=crf)
    image = torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    media = [{"type": "image", "data": image, "slot": "first_frame"}]
    (row,) = adapter.preprocess([ConditionInput(PROMPTS[0], negative_prompt="", media=media)])
    pil = Image.fromarray(apply_image_conditioning_crf(np.array(_pil(image)), adapter.image_crf))
    x = pipe.video_processor.preprocess(pil, height=SIZE, width=SIZE)
    with torch.no_grad():
        latents, _ = pipe.prepare_latents(x, 1, 4, SIZE, SIZE, FRAMES, 0.0, torch.float32, "cpu",
                                          torch.Generator().manual_seed(0), None)  # fmt: skip
    reference = LTX2ImageToVideoPipeline._unpack_latents(latents, LATENT_FRAMES, SIZE // 8, SIZE // 8)[:, :, :1]
    torch.testing.assert_close(row["first_frame_latent"], reference[0], rtol=0, atol=1e-6)
    assert adapter.preprocess_identity()["condition_images"] == "stretch:bilinear"


def test_cover_keeps_the_old_rule(adapter, monkeypatch):
    """``condition_resize = "cover"``: the target rule (ff's condition rule before issue 23), keyed apart."""
    from ff_core.contracts import MediaGeometry
    from ff_core.data.media.geometry import fit_image

    monkeypatch.setattr(adapter, "image_crf", 0)
    image = torch.randint(0, 256, (3, 48, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    stretched = adapter.condition_latent(image)
    monkeypatch.setattr(adapter, "condition_resize", "cover")
    assert adapter.preprocess_identity()["condition_images"] == "cover:bilinear"
    torch.testing.assert_close(adapter.condition_latent(image),
                               adapter.condition_latent(fit_image(image, MediaGeometry(SIZE, SIZE))))  # fmt: skip
    assert not torch.allclose(adapter.condition_latent(image), stretched)


def test_the_first_frame_slot_is_required(adapter):
    with pytest.raises(ValueError, match=r"inputs\[0\]: ltx2_i2av requires the 'first_frame' image slot"):
        adapter.preprocess([ConditionInput("a red square")])
    with pytest.raises(ValueError, match="ltx2_t2av takes no condition image"):
        from ff_ltx2 import LTX2T2AVAdapter

        LTX2T2AVAdapter.from_pretrained("unused", image_crf=0)


def run_pipeline(pipe, adapter, init, image, guidance_scale, **guidance):
    calls = []
    handle = pipe.transformer.register_forward_pre_hook(lambda m, a, kw: calls.append(dict(kw)), with_kwargs=True)
    try:
        out = pipe(image=image, prompt=PROMPTS[:1], negative_prompt=[""], height=SIZE, width=SIZE, num_frames=FRAMES,
                   frame_rate=FPS, num_inference_steps=STEPS, guidance_scale=guidance_scale,
                   **{"audio_guidance_scale": guidance_scale, **PLAIN_GUIDANCE, **guidance}, max_sequence_length=16,
                   latents=adapter.denormalize_video(init.components["video"]),
                   audio_latents=adapter.denormalize_audio(init.components["audio"]), output_type="latent",
                   generator=torch.Generator().manual_seed(0), return_dict=False)  # fmt: skip
    finally:
        handle.remove()
    return out, calls


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
def test_sampling_matches_the_pipeline_and_keeps_the_first_frame(adapter, pipe, condition, images, guidance_scale):
    init = adapter.initial_noise(condition, torch.Generator().manual_seed(3))
    assert init.masks["video"].flatten().tolist() == [0.0] + [1.0] * (LATENT_FRAMES - 1)
    torch.testing.assert_close(init.components["video"][:, :, :1], condition["first_frame_latent"], rtol=0, atol=0)
    (video, audio), calls = run_pipeline(pipe, adapter, init, _pil(images[0]), guidance_scale)
    final = adapter.sample(condition, num_steps=STEPS, guidance_scale=guidance_scale,
                           generator=torch.Generator().manual_seed(3))  # fmt: skip
    torch.testing.assert_close(final.components["video"], adapter.normalize_video(video), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final.components["audio"], adapter.normalize_audio(audio), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final.components["video"][:, :, :1], condition["first_frame_latent"], rtol=0, atol=0)
    # The pipeline's per-token video timesteps: 0 on the first latent frame's 16 tokens, t elsewhere.
    timestep = calls[0]["timestep"][0]
    assert (timestep[:16] == 0).all() and (timestep[16:] == 1000).all()


def test_per_stream_guidance_and_rescale_match_the_pipeline(adapter, pipe, condition, images):
    """``LTX2ImageToVideoPipeline`` at its default guidance (video 3, audio 7, rescale 0.7; STG and modality guidance
    off): the same final latents, the pinned first frame (inside the rescale's standard deviation on both sides)
    kept exactly."""
    init = adapter.initial_noise(condition, torch.Generator().manual_seed(3))
    (video, audio), _ = run_pipeline(pipe, adapter, init, _pil(images[0]), 3.0, audio_guidance_scale=7.0,
                                     guidance_rescale=0.7, audio_guidance_rescale=0.7)  # fmt: skip
    final = adapter.sample(condition, num_steps=STEPS, guidance_scale={"video": 3.0, "audio": 7.0},
                           guidance_rescale=0.7, generator=torch.Generator().manual_seed(3))  # fmt: skip
    torch.testing.assert_close(final.components["video"], adapter.normalize_video(video), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final.components["audio"], adapter.normalize_audio(audio), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final.components["video"][:, :, :1], condition["first_frame_latent"], rtol=0, atol=0)


def test_velocity_is_the_pipeline_denoiser_with_per_token_timesteps(adapter, pipe, condition, images):
    init = adapter.initial_noise(condition, torch.Generator().manual_seed(3))
    _, calls = run_pipeline(pipe, adapter, init, _pil(images[0]), 1.0)
    sigmas = pipe.scheduler.sigmas
    for k, kw in enumerate(calls):
        video = LTX2ImageToVideoPipeline._unpack_latents(kw["hidden_states"], LATENT_FRAMES, SIZE // 8, SIZE // 8)
        audio = LTX2ImageToVideoPipeline._unpack_audio_latents(kw["audio_hidden_states"], AUDIO_LATENTS, 4)
        state = LatentState({"video": video, "audio": audio}, dict(init.masks))
        with torch.no_grad():
            theirs = pipe.transformer(**{**kw, "return_dict": False})
            ours = adapter.velocity(state, torch.full((1,), float(sigmas[k])), condition)
        reference = LTX2ImageToVideoPipeline._unpack_latents(theirs[0], LATENT_FRAMES, SIZE // 8, SIZE // 8)
        torch.testing.assert_close(ours.components["video"], reference, rtol=0, atol=1e-6)
        reference = LTX2ImageToVideoPipeline._unpack_audio_latents(theirs[1], AUDIO_LATENTS, 4)
        torch.testing.assert_close(ours.components["audio"], reference, rtol=0, atol=1e-6)


def test_pinned_tokens_are_never_noised_and_not_in_the_loss(adapter, condition):
    """Training: the target's first latent frame is the condition latent (mask 0); noising keeps it clean, and the
    per-sample error is the mean over the other video elements and every audio element, by hand."""
    t = torch.arange(round(FRAMES / FPS * 16000)) / 16000
    media = [[torch.full((FRAMES, 3, SIZE, SIZE), 128, dtype=torch.uint8), torch.sin(2 * np.pi * 440 * t).repeat(2, 1)]]
    clean = adapter.encode_output(media, condition, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(clean.components["video"][:, :, :1], condition["first_frame_latent"], rtol=0, atol=0)
    noise = clean.randn_like(torch.Generator().manual_seed(1))
    noisy = noise_state(clean, noise, torch.tensor([0.7]))
    torch.testing.assert_close(noisy.components["video"][:, :, :1], clean.components["video"][:, :, :1], rtol=0,
                               atol=0)  # fmt: skip
    pred = noise.map(lambda x: x * 0)  # error = target^2 per element
    target = LatentState({k: torch.randn_like(v) for k, v in clean.components.items()}, dict(clean.masks))
    target.components["video"][:, :, :1] = 1e6  # pinned: must not count
    video, audio = target.components["video"][:, :, 1:], target.components["audio"]
    expected = (video.pow(2).sum() + audio.pow(2).sum()) / (video.numel() + audio.numel())
    loss = per_sample_squared_error(LatentState(pred.components, dict(clean.masks)), target)
    torch.testing.assert_close(loss, expected[None], rtol=1e-5, atol=0)
