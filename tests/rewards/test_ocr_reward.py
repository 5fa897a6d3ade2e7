"""ocr: the distance normalisation against flow_grpo's ``OcrScorer`` (transcribed below) and the ``Levenshtein``
package it imports; the target text from metadata or the prompt's quotes; RapidOCR end to end on text Pillow renders
(read back: score near 1; blank or other text: low), offline."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageDraw, ImageFont
from torch.testing import assert_close

from ff_core.objectives.rewards import Rewards
from ff_core.rewards import RewardBatch
from ff_core.rewards.ocr import OcrReward, levenshtein, ocr_accuracy, quoted_text


def flow_grpo_reward(recognized_text: str, prompt: str) -> float:
    """yifan123/flow_grpo, ``flow_grpo/ocr.py``, ``OcrScorer.__call__`` (after OCR), verbatim but for the function
    frame (``prompt`` is already the quoted span; ``distance`` is ``Levenshtein.distance``)::

        recognized_text = recognized_text.replace(' ', '').lower()
        prompt = prompt.replace(' ', '').lower()
        if prompt in recognized_text:
            dist = 0
        else:
            dist = distance(recognized_text, prompt)
        # Recognized many unrelated characters, only add one character penalty
        if dist > len(prompt):
            dist = len(prompt)
        ...
        reward = 1-dist/(len(prompt))
    """
    from Levenshtein import distance

    recognized_text = recognized_text.replace(" ", "").lower()
    prompt = prompt.replace(" ", "").lower()
    if prompt in recognized_text:
        dist = 0
    else:
        dist = distance(recognized_text, prompt)
    if dist > len(prompt):
        dist = len(prompt)
    return 1 - dist / (len(prompt))


CASES = [
    ("Hello World", "Hello World", 1.0),
    ("HELLOWORLD", "hello world", 1.0),  # spaces and case ignored
    ("Big sale: HELLO WORLD today", "Hello World", 1.0),  # the target occurs in the text: no penalty
    ("Helo World", "Hello World", 0.9),  # one deletion over 10 characters
    ("Hxllo Wxrld", "Hello World", 0.8),
    ("", "OPEN", 0.0),  # nothing read: distance 4, the whole target
    ("completely unrelated words", "OPEN", 0.0),  # distance > len(target): capped
    ("OPEM", "OPEN", 0.75),
]


@pytest.mark.parametrize(("recognised", "target", "expected"), CASES)
def test_accuracy_against_flow_grpo(recognised, target, expected):
    assert ocr_accuracy(recognised, target) == pytest.approx(expected)
    assert ocr_accuracy(recognised, target) == flow_grpo_reward(recognised, target)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abAB c1", max_size=12), st.text(alphabet="abAB c1", min_size=1, max_size=8))
def test_accuracy_and_distance_match_the_reference_on_random_strings(recognised, target):
    from Levenshtein import distance

    assert levenshtein(recognised, target) == distance(recognised, target)
    if target.replace(" ", ""):
        assert ocr_accuracy(recognised, target) == flow_grpo_reward(recognised, target)
    else:  # the reference divides by zero; ff names the problem
        with pytest.raises(ValueError, match="target text is empty"):
            ocr_accuracy(recognised, target)


def test_target_from_metadata_then_quotes():
    assert quoted_text('A neon sign saying "OPEN 24 HOURS" at night') == "OPEN 24 HOURS"
    assert quoted_text('two "a" and "b"') == "a"  # the first span, as prompt.split('"')[1]
    assert quoted_text("no quotes") is None
    reward = OcrReward.__new__(OcrReward)  # target() needs no engine
    reward.text_field = "text"
    assert reward.target('a sign "A"', {"text": "B"}) == "B"
    assert reward.target('a sign "A"', {}) == "A"
    assert reward.target('a sign "A"', {"text": ""}) == "A"
    with pytest.raises(ValueError, match=r"no metadata.text and no text between double quotes in the prompt 'a sign'"):
        reward.target("a sign", {})
    reward.text_field = None
    assert reward.target('a sign "A"', {"text": "B"}) == "A"


def render(text: str, size: tuple[int, int] = (256, 96), font_size: int = 32) -> torch.Tensor:
    """``text`` in black on white with Pillow's built-in font, as a uint8 (3, H, W) tensor."""
    image = Image.new("RGB", size, "white")
    if text:
        ImageDraw.Draw(image).text((10, size[1] // 3), text, fill="black", font=ImageFont.load_default(font_size))
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()


@pytest.fixture(scope="module")
def ocr():
    return Rewards([{"name": "ocr"}])


def test_rendered_text_is_read_back(ocr):
    """PP-OCRv4 (from the wheel) reads Pillow's text: the right text scores ~1; a blank image 0; other text low."""
    images = [render("Hello World"), render(""), render("Goodbye")]
    prompts = ['A sign that says "Hello World"'] * 3
    out = ocr(RewardBatch(media=[[x] for x in images], prompts=prompts, metadata=[{}] * 3)).total
    assert out[0] >= 0.9 and out[1] == 0 and out[2] < 0.5, out
    # The target from metadata.text wins over the prompt's quotes.
    out = ocr(RewardBatch(media=[[images[2]]], prompts=['says "Hello World"'], metadata=[{"text": "Goodbye"}])).total
    assert out[0] >= 0.9


def test_video_averages_evenly_spread_frames(ocr):
    """4 frames scored of 7 (0, 2, 4, 6); the text on frames 0-3 only: frames 0 and 2 read it, 4 and 6 are blank."""
    text, blank = render("OPEN"), render("")
    video = torch.stack([text] * 4 + [blank] * 3)
    batch = RewardBatch(media=[[video]], prompts=['"OPEN"'], metadata=[{}], output_types=("video",), rates=(8.0,))
    out = ocr(batch).total
    assert_close(out, torch.tensor([0.5]), atol=0.05, rtol=0)


def test_engine_runs_offline_from_the_wheel(monkeypatch):
    """No connection is opened while the engine loads its models and reads an image (rapidocr_onnxruntime 1.4 ships
    its ONNX models inside the package)."""
    import rapidocr_onnxruntime

    def refuse(*args, **kwargs):
        raise AssertionError("the OCR engine tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    models = sorted(p.name for p in (Path(rapidocr_onnxruntime.__file__).parent / "models").glob("*.onnx"))
    assert models == ["ch_PP-OCRv4_det_infer.onnx", "ch_PP-OCRv4_rec_infer.onnx", "ch_ppocr_mobile_v2.0_cls_infer.onnx"]
    reward = OcrReward()
    batch = RewardBatch(media=[[render("FLOW")]], prompts=['"flow"'], metadata=[{}])
    assert reward(batch).item() == pytest.approx(1.0)
