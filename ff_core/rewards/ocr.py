"""OCR accuracy: how exactly an image spells the text its prompt asks for (Flow-GRPO's text-rendering reward).

Reference: flow_grpo (yifan123/flow_grpo) ``flow_grpo/ocr.py``, ``OcrScorer.__call__``: the target is the prompt's
first span between double quotes (``prompt.split('"')[1]``); PaddleOCR reads the image (no angle classifier); the texts
of the boxes it keeps are joined without separator; both strings lose their spaces and are lowercased; the distance is
0 when the target occurs in the recognised text, else their Levenshtein distance, capped at the target's length
("recognized many unrelated characters, only add one character penalty"); the reward is ``1 - dist / len(target)``,
so in [0, 1]. :func:`ocr_accuracy` is that formula; tests/rewards/test_ocr_reward.py holds it against the quoted
reference and the ``Levenshtein`` package.

Engine: RapidOCR (``rapidocr_onnxruntime`` 1.4.x: PaddleOCR's PP-OCRv4 detection and recognition models in ONNX,
inside the wheel), run with PaddleOCR 2.x's inference defaults (``det_limit_side_len`` 960, ``det_limit_type: max``,
drop score 0.5). What differs from the reference: the recognition model is PP-OCRv4's Chinese-English one, not
PaddleOCR's ``lang="en"`` model (scores on the same image may differ slightly); and the image reaches the engine in
the BGR channel order PaddleOCR's models were trained on, where flow_grpo hands PaddleOCR the RGB array unconverted
(PaddleOCR reads arrays as BGR). Nothing is downloaded: the 1.4 releases load only the models shipped in the wheel
(the newer ``rapidocr`` 2.x/3.x releases download every model but their default set at first use).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ff_core.rewards.base import Reward, RewardBatch

log = logging.getLogger(__name__)

PADDLEOCR_DEFAULTS: dict[str, Any] = {"det_limit_side_len": 960, "det_limit_type": "max", "text_score": 0.5}
"""PaddleOCR 2.x's inference defaults (``tools/infer/utility.py``: ``det_limit_side_len`` 960, ``det_limit_type``
max, ``drop_score`` 0.5), which RapidOCR 1.4's own config replaces with 736 / min (small images upscaled 3x: slower)."""


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions, each 1) between ``a`` and ``b``: Wagner-Fischer, one row.
    What ``Levenshtein.distance`` computes (the reference's import); the strings here are a few words."""
    if len(a) < len(b):
        a, b = b, a
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def ocr_accuracy(recognised: str, target: str) -> float:
    """flow_grpo's OCR reward of ``recognised`` text against ``target``, in [0, 1] (see the module docstring).

    Raises:
        ValueError: ``target`` has no character left after removing spaces (the reference divides by zero).
    """
    recognised = recognised.replace(" ", "").lower()
    target = target.replace(" ", "").lower()
    if not target:
        raise ValueError("the OCR target text is empty (after removing spaces)")
    dist = 0 if target in recognised else levenshtein(recognised, target)
    return 1 - min(dist, len(target)) / len(target)


def quoted_text(prompt: str) -> str | None:
    """The prompt's first span between straight double quotes, as flow_grpo takes it (``prompt.split('"')[1]``);
    ``None`` when the prompt has no double quote."""
    parts = prompt.split('"')
    return parts[1] if len(parts) > 1 else None


class OcrReward(Reward):
    """OCR accuracy of the rendered text, ``1 - min(lev(ocr, target), len(target)) / len(target)`` after removing
    spaces and lowercasing (flow_grpo's ``OcrScorer``; 1 when the target occurs in what the OCR reads), in [0, 1].

    The target is the record's ``metadata[text_field]`` when present (a string), else the prompt's first span between
    double quotes (``Write "OPEN 24 HOURS" on a neon sign`` -> ``OPEN 24 HOURS``); a sample with neither is an error.
    A video scores ``video_frames`` frames spread evenly over the clip (first and last included) and averages them:
    the text should be legible throughout. An image the engine fails on scores 0 (logged), as in the reference.

    Args:
        text_field: metadata field holding the target text (checked first); ``None``: the prompt's quotes only.
        video_frames: frames scored per video.
        engine_kwargs: extra ``RapidOCR(**kwargs)`` options over :data:`PADDLEOCR_DEFAULTS` (e.g.
            ``det_use_cuda: true`` with onnxruntime-gpu, ``rec_model_path`` / ``rec_keys_path`` for a local English
            model, ``text_score``).
    """

    name = "ocr"
    media_types = ("image", "video")

    def __init__(self, text_field: str | None = "text", video_frames: int = 4,
                 engine_kwargs: dict[str, Any] | None = None) -> None:  # fmt: skip
        super().__init__()
        if video_frames < 1:
            raise ValueError(f"video_frames must be >= 1, got {video_frames}")
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as exc:
            raise ValueError(f"reward 'ocr' needs rapidocr_onnxruntime 1.4 (pip install 'ff-core[rewards]'): {exc}") \
                from None  # fmt: skip
        # use_cls false: flow_grpo builds PaddleOCR with use_angle_cls=False and calls ocr(img, cls=False).
        self.engine = RapidOCR(**{**PADDLEOCR_DEFAULTS, **(engine_kwargs or {}), "use_cls": False})
        self.text_field = text_field
        self.video_frames = video_frames

    def target(self, prompt: str, metadata: dict[str, Any]) -> str:
        """The text sample ``(prompt, metadata)`` should render (see the class docstring)."""
        value = metadata.get(self.text_field) if self.text_field else None
        if isinstance(value, str) and value.strip():
            return value
        quoted = quoted_text(prompt)
        if quoted is None or not quoted.strip():
            field = f"no metadata.{self.text_field} and " if self.text_field else ""
            raise ValueError(f"reward 'ocr': {field}no text between double quotes in the prompt {prompt!r}")
        return quoted

    def recognise(self, image: np.ndarray) -> str:
        """The text RapidOCR reads in an RGB uint8 (H, W, 3) array: its kept boxes' texts in reading order, joined."""
        result, _ = self.engine(np.ascontiguousarray(image[..., ::-1]), use_cls=False)  # RGB -> BGR (cv2's order)
        return "".join(str(text) for _, text, score in (result or []) if float(score) > 0)

    def __call__(self, batch: RewardBatch) -> Tensor:
        scores = []
        for x, prompt, metadata in zip(batch.outputs(self.media_types, self.name), batch.prompts, batch.metadata):
            target = self.target(prompt, metadata)
            frames = x.unsqueeze(0) if x.dim() == 3 else x[_spread(len(x), self.video_frames)]
            scores.append(sum(self._score(f, target) for f in frames) / len(frames))
        return torch.tensor(scores, dtype=torch.float32)

    def _score(self, frame: Tensor, target: str) -> float:
        image = frame.detach().to("cpu", torch.uint8).permute(1, 2, 0).numpy()
        try:
            text = self.recognise(image)
        except Exception as exc:  # the reference's maximum penalty for an OCR failure
            log.warning("reward 'ocr': OCR failed (%s); scoring 0", exc)
            return 0.0
        return ocr_accuracy(text, target)


def _spread(length: int, count: int) -> list[int]:
    """``count`` indices spread evenly over ``range(length)``, first and last included (fewer if the clip is short)."""
    if count == 1 or length == 1:
        return [length // 2]
    return sorted({round(i * (length - 1) / (count - 1)) for i in range(count)})
