"""Weight-free image rewards against hand computations on tiny images."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image
from torch.testing import assert_close

from ff_core.objectives.rewards import Rewards
from ff_core.rewards import RewardBatch
from ff_core.rewards.image import BrightnessReward, ColourReward, JpegCompressibilityReward, hue_degrees


def pixels(*rgb) -> torch.Tensor:
    """A 1 x N uint8 image (3, 1, N) of the given RGB pixels."""
    return torch.tensor(rgb, dtype=torch.uint8).T.reshape(3, 1, len(rgb))


def batch(*images, types=("image",)) -> RewardBatch:
    return RewardBatch(media=[[x] for x in images], prompts=[""] * len(images), metadata=[{}] * len(images),
                       output_types=types)


def test_colour_closeness_by_hand():
    # Target green (0, 255, 0). Pixel (0, 255, 0): distance 0; (255, 255, 255): |255|+0+|255| = 510 of 3*255;
    # (0, 0, 0): 255 of 765. Mean L1 / 255 over 2 pixels x 3 channels.
    reward = ColourReward(target=(0, 255, 0))
    images = [pixels((0, 255, 0), (0, 255, 0)), pixels((0, 255, 0), (255, 255, 255)), pixels((0, 0, 0), (51, 204, 0))]
    expected = torch.tensor([1.0, 1 - 510 / 255 / 6, 1 - (255 + 51 + 51) / 255 / 6])
    assert_close(reward(batch(*images)), expected)


def test_colour_hue_fraction_by_hand():
    # Pixels: pure green (hue 120, counted); yellowish green (127, 255, 0): hue 60 x (2 - 127/255) = 90.1
    # (29.9 deg off: counted at tolerance 30); yellow (hue 60, not counted); dark green (0, 60, 0): value
    # 0.235 <= 0.3 (too dark to count);
    # pale green (200, 255, 200): chroma 55/255 < 0.5 x value (ignored).
    image = pixels((0, 255, 0), (127, 255, 0), (255, 255, 0), (0, 60, 0), (200, 255, 200))
    assert_close(ColourReward(measure="hue_fraction")(batch(image)), torch.tensor([2 / 5]))
    assert_close(ColourReward(measure="hue_fraction", hue_tolerance=10)(batch(image)), torch.tensor([1 / 5]))
    # Red wraps around 0/360: (255, 0, 40) has hue 350.6, 9.4 degrees from red.
    assert_close(ColourReward(target=(255, 0, 0), measure="hue_fraction", hue_tolerance=10)(
        batch(pixels((255, 0, 40), (255, 0, 0), (0, 0, 255)))), torch.tensor([2 / 3]))
    with pytest.raises(ValueError, match="not a saturated colour"):
        ColourReward(target=(128, 128, 128), measure="hue_fraction")


def test_hue_matches_colorsys():
    import colorsys

    rgb = torch.rand(50, 3)
    expected = torch.tensor([colorsys.rgb_to_hsv(*map(float, p))[0] * 360 for p in rgb])
    d = (hue_degrees(rgb) - expected).abs()
    assert torch.minimum(d, 360 - d).max() < 1e-3


def test_colour_scores_a_video_as_its_mean_frame():
    video = torch.stack([pixels((0, 255, 0)), pixels((0, 0, 0))])  # (T=2, 3, 1, 1)
    out = ColourReward()(batch(video, types=("video",)))
    assert_close(out, torch.tensor([(1.0 + (1 - 1 / 3)) / 2]))


def test_brightness_by_hand_and_against_pil():
    image = pixels((255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255))
    expected = (0.299 + 0.587 + 0.114 + 1) / 4
    assert_close(BrightnessReward()(batch(image)), torch.tensor([expected]))
    assert_close(BrightnessReward(target=0.25)(batch(image)), torch.tensor([1 - abs(expected - 0.25)]))
    rgb = torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8)
    pil = Image.fromarray(rgb.permute(1, 2, 0).numpy()).convert("L")
    luma = torch.tensor(list(pil.getdata()), dtype=torch.float32).mean() / 255
    assert abs(BrightnessReward()(batch(rgb)).item() - luma.item()) < 1 / 255  # PIL rounds each pixel


def test_jpeg_compressibility_is_minus_kilobytes_of_pillows_jpeg():
    flat = torch.full((3, 32, 32), 90, dtype=torch.uint8)
    noise = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    sizes = []
    for x in (flat, noise):
        buf = io.BytesIO()
        Image.fromarray(x.permute(1, 2, 0).numpy()).save(buf, format="JPEG", quality=80)
        sizes.append(len(buf.getvalue()))
    out = JpegCompressibilityReward(quality=80)(batch(flat, noise))
    assert_close(out, torch.tensor([-sizes[0] / 1000, -sizes[1] / 1000]))
    assert out[0] > out[1]
    normalised = JpegCompressibilityReward(quality=80, normalise=True)(batch(flat, noise))
    assert_close(normalised, torch.tensor([1 - sizes[0] / 3072, 1 - sizes[1] / 3072]))


def test_builtins_through_a_recipe_style_config():
    rewards = Rewards([{"name": "colour", "weight": 0.5}, {"name": "brightness", "weight": 2.0}])
    white = torch.full((3, 2, 2), 255, dtype=torch.uint8)
    scores = rewards(batch(white))
    assert_close(scores.per_reward["colour"], torch.tensor([1 - 2 / 3]))
    assert_close(scores.total, torch.tensor([0.5 * (1 - 2 / 3) + 2.0]))


def test_shapes_prompt_colour_reward_scores_drawn_shapes():
    import random

    from ff_core.testing.shapes import PromptColourReward, ShapeSpec, draw_shape

    def drawn(colour):
        image = draw_shape(ShapeSpec(colour, "square", "white"), 32, random.Random(0))
        return torch.from_numpy(__import__("numpy").asarray(image).copy()).permute(2, 0, 1)

    images = [drawn("red"), drawn("green"), drawn("blue")]
    prompts = ["a red square on a white background", "a blue square", "a square on a white background"]
    b = RewardBatch(media=[[x] for x in images], prompts=prompts, metadata=[{}] * 3)
    assert PromptColourReward()(b).tolist() == [1.0, 0.0, 0.0]
    assert PromptColourReward(default="blue")(b).tolist() == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="default must be a palette colour"):
        PromptColourReward(default="teal")
