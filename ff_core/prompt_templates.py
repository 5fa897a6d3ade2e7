"""Prompt templates with a crop: an LLM text encoder reads each prompt inside a fixed template, and the template's
leading tokens are cropped from its output.

HunyuanVideo encodes a prompt with LLaVA-Llama-3 inside a chat turn whose system prompt asks for a video description
(``"<|start_header_id|>system<|end_header_id|>\\n\\nDescribe the video by detailing ...<|eot_id|>
<|start_header_id|>user<|end_header_id|>\\n\\n{}<|eot_id|>"``), takes a hidden layer two before the last, and drops
the first ``crop_start`` (95) positions, the template's tokens before the prompt: the denoiser sees the prompt, the
closing ``<|eot_id|>`` and the padding, with their attention mask. The reference is diffusers'
``HunyuanVideoPipeline._get_llama_prompt_embeds`` (``pipelines/hunyuan_video/pipeline_hunyuan_video.py``), which
:func:`encode_with_template` reproduces (tests/test_prompt_templates.py runs both on a tiny Llama).

The crop assumes the template's tokens come first in every row, so the tokenizer must pad on the right; with left
padding it would crop padding and leave template tokens. :func:`encode_with_template` refuses a left-padding tokenizer
rather than return such embeddings (a tokenizer saved after its ``padding_side`` was set on the attribute may reload
padding left: build it with the side, ``ff_core.testing.tiny``'s builders take ``padding_side``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

PLACEHOLDER = "{}"
"""Where the prompt goes in a template (``str.format``, as diffusers' templates)."""


@dataclass(frozen=True)
class PromptTemplate:
    """A prompt template and how many leading tokens of a templated prompt the encoder output loses.

    ``PromptTemplate(**DEFAULT_PROMPT_TEMPLATE)`` takes a diffusers pipeline's template dict as it is.

    Attributes:
        template: the text around the prompt, with one ``{}`` where the prompt goes.
        crop_start: the leading positions cropped from the encoder output and its mask; ``None``: the template's
            tokens before ``{}``, counted with the tokenizer (:func:`template_crop_start`). A released value is the
            released tokenizer's count (HunyuanVideo: 95); a tiny test tokenizer spells the template with other
            tokens, so a tiny checkpoint counts it (``None``) and passes the count to the reference pipeline.
    """

    template: str
    crop_start: int | None = None

    def __post_init__(self) -> None:
        if self.template.count(PLACEHOLDER) != 1:
            raise ValueError(f"PromptTemplate.template must hold exactly one {PLACEHOLDER!r} (where the prompt goes), "
                             f"found {self.template.count(PLACEHOLDER)}")  # fmt: skip
        crop = self.crop_start
        if crop is not None and (isinstance(crop, bool) or not isinstance(crop, int) or crop < 0):
            raise ValueError(f"PromptTemplate.crop_start must be an integer >= 0 or None, got {crop!r}")


def template_crop_start(tokenizer: Any, template: str) -> int:
    """How many tokens precede the prompt in ``template`` once tokenized: the special tokens the tokenizer puts in
    front (Llama's BOS) plus the tokens of the template's text before ``{}``.

    diffusers counts the same when a template dict has no ``crop_start`` by tokenizing the whole template and
    subtracting 2 (the ``{}`` and ``<|eot_id|>`` after it): equal where ``{}`` is one token, as in Llama 3's
    vocabulary. Counted here from the text before ``{}``, it holds for any vocabulary.

    Args:
        tokenizer: the text encoder's tokenizer (a ``transformers`` tokenizer).
        template: the template, with one ``{}``.
    """
    prefix = PromptTemplate(template).template.split(PLACEHOLDER)[0]
    probe = tokenizer("x").input_ids  # the special tokens in front: where the bare text starts
    front = probe.index(tokenizer("x", add_special_tokens=False).input_ids[0])
    return front + len(tokenizer(prefix, add_special_tokens=False).input_ids)


def encode_with_template(
    text_encoder: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    template: PromptTemplate,
    *,
    max_sequence_length: int = 256,
    num_hidden_layers_to_skip: int = 2,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Each prompt inside ``template``, tokenized to ``max_sequence_length`` plus the crop (padded on the right,
    truncated), encoded, its hidden state ``num_hidden_layers_to_skip`` layers before the last taken, and the crop's
    leading positions dropped: ``(prompt_embeds (B, max_sequence_length, D), attention_mask (B, max_sequence_length))``,
    as ``HunyuanVideoPipeline._get_llama_prompt_embeds`` returns them for one video per prompt.

    Args:
        text_encoder: a ``transformers`` model returning ``hidden_states`` with ``output_hidden_states=True``.
        tokenizer: its tokenizer; must pad on the right (``padding_side="right"``), else a ``ValueError``.
        prompts: the prompts.
        template: the template and its crop.
        max_sequence_length: tokens kept after the crop (diffusers' HunyuanVideo default: 256).
        num_hidden_layers_to_skip: which hidden state: ``hidden_states[-(n + 1)]`` (HunyuanVideo: 2).
        device: where the tokens go (default: the encoder's device).
        dtype: the embeddings' dtype (default: the encoder's).
    """
    if tokenizer.padding_side != "right":
        raise ValueError(f"encode_with_template crops the template's leading tokens, so the tokenizer must pad on the "
                         f"right; {type(tokenizer).__name__} pads on the {tokenizer.padding_side!r} (build or load it "
                         "with padding_side='right')")  # fmt: skip
    crop = template.crop_start if template.crop_start is not None else template_crop_start(tokenizer, template.template)
    tokens = tokenizer([template.template.format(p) for p in prompts], max_length=max_sequence_length + crop,
                       padding="max_length", truncation=True, return_tensors="pt")  # fmt: skip
    device = device if device is not None else text_encoder.device
    mask = tokens.attention_mask.to(device)
    hidden = text_encoder(input_ids=tokens.input_ids.to(device), attention_mask=mask, output_hidden_states=True)
    embeds = hidden.hidden_states[-(num_hidden_layers_to_skip + 1)]
    embeds = embeds.to(dtype=dtype if dtype is not None else text_encoder.dtype)
    return embeds[:, crop:], mask[:, crop:]
