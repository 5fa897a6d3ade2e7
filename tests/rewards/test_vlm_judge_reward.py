"""vlm_judge with a tiny random LLaVA (CLIP vision tower, Qwen2 language model, llava-1.5's chat format) saved and
loaded back: the logits mode against the expected score computed by hand from the same model's logits, one sample at
a time and unpadded (two forward passes: after the prompt, and after the prompt and ``1``); videos as evenly spread
frames; the generate mode's parsing on controlled strings and through greedy decoding of the model."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from PIL import Image
from tiny_reward_models import build_tiny_llava
from torch.testing import assert_close

from ff_core.errors import ConfigError
from ff_core.objectives.rewards import Rewards
from ff_core.rewards import RewardBatch
from ff_core.rewards.vlm_judge import DEFAULT_TEMPLATE, VlmJudgeReward, expected_score, parse_score


@pytest.mark.parametrize(("answer", "expected"), [
    ("7", 7.0), (" 8/10", 8.0), ("Score: 7.5 out of 10", 7.5), ("I'd say 3, maybe 4", 3.0), ("42", 10.0),
    ("-3", 1.0), ("0", 1.0), ("ten", None), ("", None),
])  # fmt: skip
def test_parse_score(answer, expected):
    assert parse_score(answer, 1, 10) == expected


def test_expected_score_by_hand():
    """Scores 1..10 spelled ``1``..``9`` and ``1 0`` (token ids = digits). After the prompt: P(1) = 0.5, P(3) = 0.2,
    0.3 elsewhere (not a digit); after ``1``: P(0) = 0.4. So P(10) = 0.5 x 0.4 = 0.2, P(exactly 1) = 0.5 x 0.6 = 0.3,
    P(3) = 0.2: E = (1 x 0.3 + 3 x 0.2 + 10 x 0.2) / 0.7."""
    first, second = torch.full((12,), 1e-9), torch.full((12,), 1e-9)
    first[1], first[3], first[11] = 0.5, 0.2, 0.3
    second[0], second[11] = 0.4, 0.6
    log_probs = torch.stack([first, second]).log()[None]
    spellings = [[1], [2], [3], [4], [5], [6], [7], [8], [9], [1, 0]]
    out = expected_score(list(range(1, 11)), spellings, [1], log_probs)
    assert_close(out, torch.tensor([(0.3 + 0.6 + 2.0) / 0.7]), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = build_tiny_llava(tmp_path_factory.mktemp("tiny_llava"))
    return path, AutoModelForImageTextToText.from_pretrained(path).eval(), AutoProcessor.from_pretrained(path)


def judge(path, **args) -> Rewards:
    return Rewards([{"name": "vlm_judge", "args": {"pretrained_model_name_or_path": str(path), "dtype": "float32",
                                                   **args}}])  # fmt: skip


def pil(x: torch.Tensor) -> Image.Image:
    return Image.fromarray(x.permute(1, 2, 0).numpy())


def by_hand(model, processor, frames: list[torch.Tensor], prompt: str, media: str = "image") -> float:
    """The expected 1..10 score of one sample from the model's logits: the chat-formatted question (llava-1.5:
    ``USER: <image>\\n...\\nASSISTANT:``) through the processor alone (no padding); softmax at the last position, then
    again with the token ``1`` appended; ``P(v) = p1[v]`` for 2..9, ``P(10) = p1[1] p2[0]``, ``P(1) = p1[1] (1 -
    p2[0])``; ``E = sum v P(v) / sum P(v)``, normalised ``(E - 1) / 9``."""
    tok = processor.tokenizer
    question = (DEFAULT_TEMPLATE.replace("{prompt}", prompt).replace("{media}", media)
                .replace("{min_score}", "1").replace("{max_score}", "10"))  # fmt: skip
    text = "USER: " + "<image>\n" * len(frames) + question + "\nASSISTANT:"
    inputs = processor(text=[text], images=[[pil(f) for f in frames]], return_tensors="pt")
    digit = {d: tok.convert_tokens_to_ids(str(d)) for d in range(10)}
    with torch.no_grad():
        p1 = model(**inputs).logits[0, -1].softmax(-1)
        inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([[digit[1]]])], 1)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        p2 = model(**inputs).logits[0, -1].softmax(-1)
    prob = {v: p1[digit[v]].item() for v in range(2, 10)}
    prob[10] = p1[digit[1]].item() * p2[digit[0]].item()
    prob[1] = p1[digit[1]].item() * (1 - p2[digit[0]].item())
    expected = sum(v * p for v, p in prob.items()) / sum(prob.values())
    return (expected - 1) / 9


def test_logits_mode_matches_the_hand_computation(tiny_llava):
    """Two images with prompts of different lengths in one batch (right padding inside the reward), the 1..10 default
    question: each score equals the unpadded hand computation."""
    path, model, processor = tiny_llava
    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, 20, 24), dtype=torch.uint8, generator=g) for _ in range(2)]
    prompts = ["a red circle", "a big green square on a white background with a small blue triangle"]
    out = judge(path, batch_size=2)(RewardBatch(media=[[x] for x in images], prompts=prompts, metadata=[{}] * 2))
    expected = torch.tensor([by_hand(model, processor, [x], p) for x, p in zip(images, prompts)])
    assert_close(out.total, expected, atol=2e-6, rtol=0)
    assert ((0 <= out.total) & (out.total <= 1)).all()


def test_video_sends_evenly_spread_frames_as_images(tiny_llava):
    """LLaVA's processor has no video processor: a 7-frame clip with ``num_frames: 3`` is frames 0, 3 and 6 as three
    images, the question saying "video"."""
    path, model, processor = tiny_llava
    video = torch.randint(0, 256, (7, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    batch = RewardBatch(media=[[video]], prompts=["a moving square"], metadata=[{}], output_types=("video",),
                        rates=(8.0,))  # fmt: skip
    out = judge(path, num_frames=3)(batch).total
    expected = by_hand(model, processor, [video[0], video[3], video[6]], "a moving square", media="video")
    assert_close(out, torch.tensor([expected]), atol=2e-6, rtol=0)
    with pytest.raises(ConfigError, match="has no video processor"):
        judge(path, video_input="video")


def only(reward: VlmJudgeReward, keep: str) -> None:
    """Zero the output rows of every token but the characters in ``keep``: greedy decoding picks the largest of their
    random logits (when positive, as for the digits' scaled rows here) over the others' 0."""
    head = reward.model.get_output_embeddings().weight
    with torch.no_grad():
        mask = torch.ones(len(head), dtype=torch.bool)
        mask[[reward.tokenizer.convert_tokens_to_ids(c) for c in keep]] = False
        head[mask] = 0


def test_generate_mode_parses_the_greedy_answer(tiny_llava, caplog):
    """The one-token greedy answer is the digit of largest logit (computed here from the model); it is the score,
    clamped to 1..10 and normalised. An answer without a digit scores ``fallback_score``, logged."""
    path, model, processor = tiny_llava
    images = [torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(s))
              for s in range(3)]  # fmt: skip
    batch = RewardBatch(media=[[x] for x in images], prompts=["a circle", "a red square", "blue"], metadata=[{}] * 3)
    rewards = judge(path, score_mode="generate", max_new_tokens=1, batch_size=3)
    reward = rewards.rewards[0]
    only(reward, "0123456789")
    out = rewards(batch).total
    expected = []
    for x, prompt in zip(images, batch.prompts):
        inputs = reward.inputs([x], [prompt], "left")
        with torch.no_grad():
            token = reward.model(**inputs).logits[0, -1].argmax().item()
        answer = reward.tokenizer.decode([token])
        assert answer.isdigit()
        expected.append((min(max(int(answer), 1), 10) - 1) / 9)
    assert_close(out, torch.tensor(expected), atol=0, rtol=0)
    only(reward, "abc")
    reward.fallback_score = 0.25
    with caplog.at_level(logging.WARNING, logger="ff_core.rewards.vlm_judge"):
        out = rewards(batch).total
    assert_close(out, torch.full((3,), 0.25))
    assert "no score in the answer" in caplog.text


def test_judge_options_are_checked(tiny_llava, tmp_path):
    path = tiny_llava[0]
    with pytest.raises(ConfigError, match="spelled .* do not share one prefix"):
        judge(path, min_score=9, max_score=20)  # "1x" and "20": two prefixes
    with pytest.raises(ConfigError, match="min_score must be below max_score"):
        judge(path, min_score=5, max_score=5)
    with pytest.raises(ConfigError, match="pretrained_model_name_or_path"):
        judge(tmp_path / "nope")
    reward = judge(path, min_score=0, max_score=9).rewards[0]  # one token each: no continuation read
    assert reward.chain == [] and len(reward.spellings) == 10
    image = torch.zeros(3, 16, 16, dtype=torch.uint8)
    score = reward(RewardBatch(media=[[image]], prompts=["x"], metadata=[{}]))
    assert 0 <= score.item() <= 1 and math.isfinite(score.item())


def test_video_goes_as_a_video_when_the_processor_has_one(tiny_llava):
    """With a video processor (Qwen2-VL's kind; none can be built here without torchvision) a clip is one
    ``{"type": "video"}`` entry and ``videos=[frames]``: checked on a recording stand-in for the processor."""
    reward = judge(tiny_llava[0], num_frames=2).rewards[0]
    calls = []

    class Recording:
        video_processor = object()
        tokenizer = reward.tokenizer

        def apply_chat_template(self, messages, **kwargs):
            calls.append(messages)
            return "question"

        def __call__(self, **kwargs):
            calls.append(kwargs)
            raise RuntimeError("recorded")

    reward.processor, reward.as_video = Recording(), True
    video = torch.randint(0, 256, (5, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    with pytest.raises(RuntimeError, match="recorded"):
        reward(RewardBatch(media=[[video]], prompts=["a dog"], metadata=[{}], output_types=("video",)))
    messages, kwargs = calls
    assert [c["type"] for c in messages[0]["content"]] == ["video", "text"]
    assert "video" in messages[0]["content"][1]["text"] and "images" not in kwargs
    [frames] = kwargs["videos"]
    assert [list(f.getdata()) for f in frames] == [list(pil(video[i]).getdata()) for i in (0, 4)]
