"""VLM judge: a vision-language model, asked how well each sample matches its prompt, answers with a score.

Two ways to read the answer (``score_mode``):

* ``logits`` (default; one forward pass, no sampling): the expected score under the model's next-token distribution at
  the answer position, restricted to the scores' spellings and renormalised, ``E = sum_v v P(v) / sum_v P(v)`` for
  ``v`` in ``min_score .. max_score`` (as Q-Align, Wu et al. 2024, scores: a softmax over the rating tokens' logits
  only, the score their probability-weighted mean). A score spelled in several tokens (``10`` = ``1``, ``0`` for
  Qwen's and Llama's tokenizers) gets ``P(1) P(0 | 1)``, and ``1`` itself ``P(1) (1 - P(0 | 1))``: the teacher-forced
  continuation is read from the same forward pass, the answer's common prefix (``1``) appended to the prompt.
* ``generate``: greedy decoding of ``max_new_tokens`` tokens; the first number in the answer, clamped to the range. An
  answer without a number scores ``fallback_score`` and is logged, not an error.

The score is normalised to [0, 1]: ``(s - min_score) / (max_score - min_score)``.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Literal

import torch
from torch import Tensor

from ff_core.rewards.base import RewardBatch
from ff_core.rewards.media import IMAGE_OR_VIDEO, score_in_batches, to_pil
from ff_core.rewards.models import ModelReward, from_pretrained

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = (
    'How well does this {media} match the description "{prompt}"? Consider the content, the composition and the '
    "quality. Rate it from {min_score} (not at all) to {max_score} (perfectly). Answer with the number only."
)
"""The question asked by default; ``{prompt}``, ``{media}`` (image / video), ``{min_score}``, ``{max_score}`` are
replaced (by ``str.replace``: other braces stay as written)."""

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def parse_score(answer: str, min_score: float, max_score: float) -> float | None:
    """The first number written in ``answer`` (``"8/10"`` -> 8, ``"Score: 7.5"`` -> 7.5), clamped to
    ``[min_score, max_score]``; ``None`` when there is none."""
    match = _NUMBER.search(answer)
    return None if match is None else min(max(float(match.group()), min_score), max_score)


def expected_score(values: list[int], spellings: list[list[int]], chain: list[int], log_probs: Tensor) -> Tensor:
    """The expected score of each row under its next-token distributions (see the module docstring).

    Args:
        values: the scores.
        spellings: each score's token ids.
        chain: the longest proper prefix of the spellings (every other proper prefix is a prefix of it).
        log_probs: (B, len(chain) + 1, V) log-probabilities of the token after the prompt followed by ``chain[:j]``.

    Returns:
        (B,) float ``sum_v v P(v) / sum_v P(v)``, ``P(v)`` the probability that the answer is exactly ``v``'s spelling.
    """
    probs = log_probs.float().exp()
    exact = []
    for spelling in spellings:
        p = torch.ones(len(probs), dtype=torch.float32, device=probs.device)
        for j, token in enumerate(spelling):
            p = p * probs[:, j, token]
        n = len(spelling)
        # A spelling that is also a prefix of longer ones ("1" of "10") ends here only if none of them continues it.
        following = {s[n] for s in spellings if len(s) > n and s[:n] == spelling}
        if following:
            p = p * (1 - probs[:, n, sorted(following)].sum(-1))
        exact.append(p)
    exact_t = torch.stack(exact, -1)
    return (exact_t * torch.tensor(values, dtype=torch.float32, device=probs.device)).sum(-1) / exact_t.sum(-1)


class VlmJudgeReward(ModelReward):
    """The score a vision-language model gives each sample for its prompt, normalised to [0, 1].

    The folder holds a transformers image-text-to-text model (``AutoModelForImageTextToText``: Qwen2.5-VL, Gemma 3,
    LLaVA, ...) and its ``AutoProcessor`` with a chat template, as ``save_pretrained`` writes them. The question is
    ``template`` with its placeholders filled, sent as one user turn holding the media, followed by the chat
    template's generation prompt and ``answer_prefix``. A video sends ``num_frames`` frames spread evenly over the clip:
    as a video (``videos=``) when the processor has a video processor (``video_input: auto`` or ``video``), else as
    that many images.

    Args:
        pretrained_model_name_or_path: local folder of the model and processor.
        template: the question (placeholders ``{prompt}``, ``{media}``, ``{min_score}``, ``{max_score}``).
        score_mode: ``logits`` (expected score from one forward pass) or ``generate`` (greedy answer, parsed).
        min_score: the lowest score the question allows (integer).
        max_score: the highest.
        answer_prefix: text the answer starts with (e.g. ``"Score: "``), appended after the generation prompt.
        max_new_tokens: ``generate`` only: tokens decoded.
        fallback_score: ``generate`` only: the normalised score (in [0, 1]) of an answer without a number.
        num_frames: frames sent per video.
        video_input: ``auto``, ``video`` (``videos=``) or ``images`` (the frames as images).
        batch_size: samples per forward pass.
        dtype: weights' dtype (``bfloat16``, ``float16``, ``float32``).
    """

    name = "vlm_judge"
    media_types = IMAGE_OR_VIDEO

    def __init__(
        self,
        pretrained_model_name_or_path: str,
        template: str = DEFAULT_TEMPLATE,
        score_mode: Literal["logits", "generate"] = "logits",
        min_score: int = 1,
        max_score: int = 10,
        answer_prefix: str = "",
        max_new_tokens: int = 8,
        fallback_score: float = 0.0,
        num_frames: int = 8,
        video_input: Literal["auto", "video", "images"] = "auto",
        batch_size: int = 4,
        dtype: str = "bfloat16",
    ) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        if score_mode not in ("logits", "generate"):
            raise ValueError(f"score_mode must be 'logits' or 'generate', got {score_mode!r}")
        if video_input not in ("auto", "video", "images"):
            raise ValueError(f"video_input must be 'auto', 'video' or 'images', got {video_input!r}")
        if not min_score < max_score:
            raise ValueError(f"min_score must be below max_score, got {min_score} and {max_score}")
        if not 0 <= fallback_score <= 1:
            raise ValueError(f"fallback_score is a normalised score in [0, 1], got {fallback_score}")
        super().__init__(dtype, num_frames=num_frames, batch_size=batch_size, max_new_tokens=max_new_tokens)
        path = pretrained_model_name_or_path
        # ValueError too: a folder of another kind of model.
        self.processor = from_pretrained(AutoProcessor, path, errors=(OSError, ValueError))
        self.model = from_pretrained(AutoModelForImageTextToText, path, errors=(OSError, ValueError), dtype=self.dtype)
        if getattr(self.processor, "chat_template", None) is None:
            raise ValueError(f"pretrained_model_name_or_path {path!r}: the processor has no chat template")
        self.freeze()
        self.tokenizer = self.processor.tokenizer
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.template, self.score_mode, self.answer_prefix = template, score_mode, answer_prefix
        self.min_score, self.max_score = int(min_score), int(max_score)
        self.max_new_tokens, self.fallback_score = max_new_tokens, fallback_score
        self.num_frames, self.batch_size = num_frames, batch_size
        has_video = getattr(self.processor, "video_processor", None) is not None
        if video_input == "video" and not has_video:
            raise ValueError(f"video_input 'video': the processor of {path!r} has no video processor")
        self.as_video = has_video and video_input != "images"
        self.values = list(range(self.min_score, self.max_score + 1))
        self.spellings, self.chain = self._spellings() if score_mode == "logits" else ([], [])

    def _spellings(self) -> tuple[list[list[int]], list[int]]:
        """Each score's token ids and their longest proper prefix, which must extend every other proper prefix (so
        one forward pass reads every needed distribution)."""
        spellings = [self.tokenizer.encode(str(v), add_special_tokens=False) for v in self.values]
        prefixes = sorted({tuple(s[:k]) for s in spellings for k in range(1, len(s))}, key=len)
        chain = list(prefixes[-1]) if prefixes else []
        if any(list(p) != chain[: len(p)] for p in prefixes):
            spelled = {v: self.tokenizer.convert_ids_to_tokens(s) for v, s in zip(self.values, spellings)}
            raise ValueError(f"score_mode 'logits': the scores {self.min_score}..{self.max_score} are spelled "
                             f"{spelled}, whose multi-token spellings do not share one prefix; use a range of "
                             "one-token scores (e.g. 0..9) or score_mode 'generate'")  # fmt: skip
        return spellings, chain

    def question(self, prompt: str, media: str) -> str:
        """``template`` with its placeholders filled."""
        out = self.template.replace("{prompt}", prompt).replace("{media}", media)
        return out.replace("{min_score}", str(self.min_score)).replace("{max_score}", str(self.max_score))

    def inputs(self, samples: list[Tensor], prompts: list[str], padding_side: str) -> Any:
        """The processor's batch for ``samples`` (uint8 image (3, H, W) / video (T, 3, H, W)) and their prompts."""
        texts, images, videos = [], [], []
        for x, prompt in zip(samples, prompts):
            frames = [x] if x.dim() == 3 else [x[i] for i in _spread(len(x), self.num_frames)]
            pil = to_pil(frames)
            if x.dim() == 4 and self.as_video:
                content: list[dict[str, Any]] = [{"type": "video"}]
                videos.append(pil)
            else:
                content = [{"type": "image"} for _ in pil]
                images.append(pil)
            content.append({"type": "text", "text": self.question(prompt, "image" if x.dim() == 3 else "video")})
            messages = [{"role": "user", "content": content}]
            text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            texts.append(text + self.answer_prefix)
        self.tokenizer.padding_side = padding_side
        media = {"images": images} if images else {}
        if videos:
            media["videos"] = videos
        return self.processor(text=texts, return_tensors="pt", padding=True, **media).to(self.device)

    def __call__(self, batch: RewardBatch) -> Tensor:
        samples = batch.outputs(self.media_types, self.name)
        score = self._logits if self.score_mode == "logits" else self._generate
        raw = score_in_batches(score, samples, batch.prompts, self.batch_size).cpu()
        return (raw - self.min_score) / (self.max_score - self.min_score)

    @torch.no_grad()
    def _logits(self, samples: list[Tensor], prompts: list[str]) -> Tensor:
        # Right padding: every row's tokens sit at positions 0..n-1 whatever the padding, and the answer's common
        # prefix (``chain``) is written after each row's last token; the logits are read at n - 1 + j.
        inputs = self.inputs(samples, prompts, "right")
        lengths = inputs["attention_mask"].sum(-1)
        k = len(self.chain)
        if k:
            rows, shape = torch.arange(len(lengths), device=lengths.device), inputs["input_ids"].shape
            for key, value in list(inputs.items()):  # per-token inputs (ids, mask, token types) get k more columns
                if isinstance(value, Tensor) and value.shape[:2] == shape:
                    pad = self.tokenizer.pad_token_id if key == "input_ids" else 0
                    inputs[key] = torch.cat([value, value.new_full((len(value), k), pad)], 1)
            for j, token in enumerate(self.chain):
                inputs["input_ids"][rows, lengths + j] = token
                inputs["attention_mask"][rows, lengths + j] = 1
        logits = self.model(**inputs).logits
        positions = lengths[:, None] - 1 + torch.arange(k + 1, device=lengths.device)
        picked = logits.gather(1, positions[..., None].expand(-1, -1, logits.shape[-1]))
        return expected_score(self.values, self.spellings, self.chain, picked.float().log_softmax(-1))

    @torch.no_grad()
    def _generate(self, samples: list[Tensor], prompts: list[str]) -> Tensor:
        inputs = self.inputs(samples, prompts, "left")
        out = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False,
                                  pad_token_id=self.tokenizer.pad_token_id)  # fmt: skip
        answers = self.tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        fallback = self.min_score + self.fallback_score * (self.max_score - self.min_score)
        scores = []
        for answer in answers:
            value = parse_score(answer, self.min_score, self.max_score)
            if value is None:
                log.warning("reward 'vlm_judge': no score in the answer %r; scoring %s", answer, self.fallback_score)
            scores.append(fallback if value is None else value)
        return torch.tensor(scores, dtype=torch.float32)


def _spread(length: int, count: int) -> list[int]:
    """``count`` indices spread evenly over ``range(length)``, first and last included (fewer if the clip is short)."""
    if count == 1 or length == 1:
        return [length // 2]
    return sorted({round(i * (length - 1) / (count - 1)) for i in range(count)})
