"""Review fixes of the MiniMax H3 plugin: FSDP2's input cast keeps H3's full-precision inputs, the clip geometry is
checked before any weight loads (``check_adapter_kwargs`` / ``resolve_output_geometry``), the pixel normalisation is
fp32 whatever the default dtype."""

from __future__ import annotations

import pytest
import torch
from ff_minimax import MiniMaxH3T2VAAdapter
from ff_minimax.testing import TINY_FRAMES, TINY_SIZE

from ff_core.adapter import Adapter, ConditionInput
from ff_core.data.cache.collation import collate_conditions
from ff_core.sharding import cast_forward_inputs

LONG_PROMPT = "a red square with a low tone " * 12  # enough text rows for rotary coordinates bf16 cannot hold


def _condition(adapter, prompt: str):
    rows = adapter.preprocess([ConditionInput(prompt, None, [])])
    return adapter.prepare_condition(collate_conditions(rows, adapter.condition_collation))


def test_fsdp2_input_cast_keeps_the_fp64_rotary_grid(tiny_minimax):
    """``model.sharding.param_dtype: bf16`` installs ff_core.sharding's cast hook on the transformer: H3's fp64
    ``position_ids`` (and fp32 timestep) pass through unchanged, so the velocity equals the unhooked one exactly; with
    only the base's names kept the rotary grid would be rounded to bf16 and the velocity would move."""
    assert set(MiniMaxH3T2VAAdapter.full_precision_inputs) == {"timestep", "position_ids"}
    seen = {}

    def run(keep):
        adapter = MiniMaxH3T2VAAdapter.from_pretrained(tiny_minimax("t2va"), height=TINY_SIZE, width=TINY_SIZE,
                                                       num_frames=TINY_FRAMES, dtype="bfloat16").eval()  # fmt: skip
        cond = _condition(adapter, LONG_PROMPT)
        x = adapter.initial_noise(cond, torch.Generator().manual_seed(0))
        sigmas = {"video": torch.tensor([0.6]), "audio": torch.tensor([0.6])}
        if keep is not None:
            cast_forward_inputs(adapter.transformer, torch.bfloat16, keep)
            adapter.transformer.register_forward_pre_hook(
                lambda m, a, kw: seen.__setitem__("dtype", kw["position_ids"].dtype), with_kwargs=True)
        with torch.no_grad():
            return adapter.component_velocity(x, sigmas, cond)

    ref = run(None)
    hooked = run(MiniMaxH3T2VAAdapter.full_precision_inputs)
    assert seen["dtype"] == torch.float64
    for k in ("video", "audio"):
        torch.testing.assert_close(hooked.components[k], ref.components[k], rtol=0, atol=0)
    rounded = run(Adapter.full_precision_inputs)  # what the base's names gave: the grid cast to bf16
    assert seen["dtype"] == torch.bfloat16
    assert max((rounded.components[k] - ref.components[k]).abs().max() for k in ("video", "audio")) > 1e-3


def test_pixel_normalisation_is_fp32_under_a_bf16_default_dtype(tiny_minimax):
    """Lightning's bf16-true runs the stages with ``torch.set_default_dtype(torch.bfloat16)``: the ImageNet pixel
    statistics must still be fp32 (bf16 rounds 0.485 to 0.484375), so target latents and decoded frames are what the
    fp32 default gives, bit for bit."""
    adapter = MiniMaxH3T2VAAdapter.from_pretrained(tiny_minimax("t2va"), height=TINY_SIZE, width=TINY_SIZE,
                                                   num_frames=TINY_FRAMES).eval()  # fmt: skip
    g = torch.Generator().manual_seed(0)
    video = torch.randint(0, 256, (TINY_FRAMES, 3, TINY_SIZE, TINY_SIZE), generator=g, dtype=torch.uint8)
    audio = torch.rand(2, adapter.audio_samples, generator=g) - 0.5
    encoded, decoded = [], []
    for default in (torch.float32, torch.bfloat16):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(default)
        try:
            encoded.append(adapter.encode_output([[video, audio]], {}, generator=torch.Generator().manual_seed(1)))
            decoded.append(adapter.decode(encoded[0])[0][0])
        finally:
            torch.set_default_dtype(previous)
    for k in ("video", "audio"):
        torch.testing.assert_close(encoded[1].components[k], encoded[0].components[k], rtol=0, atol=0)
    torch.testing.assert_close(decoded[1], decoded[0], rtol=0, atol=0)


def test_evaluation_draws_the_fl2va_prefix_from_the_sampling_seed(tiny_minimax):
    """``FlowModule.generate`` realises the noised keyframe prefix from ``sampling.seed``'s generator (before the
    noise, the pipeline's order: the FL2VA parity test checks that order against diffusers), so the global RNG does not
    change an evaluation sample: it equals prefix + sampling + decoding from one fresh generator seeded alike."""
    from ff_minimax.fl2va import MiniMaxH3FL2VAAdapter

    from ff_core.module import FlowModule, SamplingConfig

    module = FlowModule("minimax-h3-fl2va", str(tiny_minimax("fl2va")),
                        adapter_kwargs={"height": TINY_SIZE, "width": TINY_SIZE, "num_frames": TINY_FRAMES},
                        sampling=SamplingConfig(num_steps=2, seed=7))  # fmt: skip
    module.configure_model()
    adapter = module.adapter
    assert isinstance(adapter, MiniMaxH3FL2VAAdapter)
    image = torch.randint(0, 256, (3, 16, 16), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    rows = adapter.preprocess([ConditionInput("a red square", None,
                                              [{"type": "image", "data": image, "slot": "first_frame"}])])
    batch = {"condition": collate_conditions(rows, adapter.condition_collation), "index": torch.arange(1),
             "prompt": ["a red square"]}  # fmt: skip
    videos = []
    with torch.no_grad():
        for global_seed in (0, 1):
            torch.manual_seed(global_seed)
            videos.append(module.generate(batch, 0)["media"][0][0])
        g = torch.Generator().manual_seed(7)
        expected = adapter.decode(adapter.sample(adapter.prepare_condition(batch["condition"], generator=g),
                                                 num_steps=2, generator=g))[0][0]  # fmt: skip
    torch.testing.assert_close(videos[1], videos[0], rtol=0, atol=0)
    torch.testing.assert_close(videos[0], expected, rtol=0, atol=0)


def test_a_float_target_clip_is_refused(tiny_minimax):
    """``encode_output`` divides by 255: a float clip (already in [0, 1]) would encode a black video silently."""

    adapter = MiniMaxH3T2VAAdapter.from_pretrained(tiny_minimax("t2va"), height=TINY_SIZE, width=TINY_SIZE,
                                                   num_frames=TINY_FRAMES)  # fmt: skip
    video = torch.rand(TINY_FRAMES, 3, TINY_SIZE, TINY_SIZE)
    audio = torch.zeros(2, adapter.audio_samples)
    with pytest.raises(ValueError, match=r"media\[0\]\[0\]: expected a video \(DecodedVideo or uint8 \(F, 3, H, W\)\), "
                                         r"got torch\.float32 \(124, 3, 16, 16\)"):  # fmt: skip
        adapter.encode_output([[video, audio]], {})
