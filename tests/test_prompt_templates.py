"""Prompt templates with a crop (ff_core.prompt_templates) against diffusers' HunyuanVideo text path.

The reference is the pipeline's own ``_get_llama_prompt_embeds`` on a real ``HunyuanVideoPipeline`` holding the same
tiny LLaMA text encoder and tokenizer (the components it does not read are left out), with diffusers' released
template text; the tiny tokenizer spells that template with its own tokens, so both get the crop counted here.
"""

from __future__ import annotations

import pytest
import torch

from ff_core.prompt_templates import PromptTemplate, encode_with_template, template_crop_start
from ff_core.testing.tiny import VIDEO_WORDS, build_llama_tokenizer

PROMPTS = ["a red square moving left", "the big blue circle"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny LLaMA text encoder and its tokenizer, saved and loaded back as a checkpoint's would be."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaModel

    folder = tmp_path_factory.mktemp("llama")
    tokenizer = build_llama_tokenizer(1024, VIDEO_WORDS)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    LlamaModel(config).save_pretrained(folder / "text_encoder")
    tokenizer.save_pretrained(folder / "tokenizer")
    return (LlamaModel.from_pretrained(folder / "text_encoder").eval(),
            AutoTokenizer.from_pretrained(folder / "tokenizer"))  # fmt: skip


def reference(text_encoder, tokenizer, template: dict, max_sequence_length: int):
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline

    pipe = HunyuanVideoPipeline(text_encoder=text_encoder, tokenizer=tokenizer, transformer=None, vae=None,
                                scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder_2=None,
                                tokenizer_2=None)  # fmt: skip
    with torch.no_grad():
        return pipe._get_llama_prompt_embeds(PROMPTS, template, device=torch.device("cpu"), dtype=torch.float32,
                                             max_sequence_length=max_sequence_length)  # fmt: skip


def test_encoding_is_hunyuan_videos_llama_prompt_embeds(llama):
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    text_encoder, tokenizer = llama
    crop = template_crop_start(tokenizer, DEFAULT_PROMPT_TEMPLATE["template"])
    template = {"template": DEFAULT_PROMPT_TEMPLATE["template"], "crop_start": crop}
    with torch.no_grad():
        embeds, mask = encode_with_template(text_encoder, tokenizer, PROMPTS, PromptTemplate(**template),
                                            max_sequence_length=12)  # fmt: skip
    ref_embeds, ref_mask = reference(text_encoder, tokenizer, template, 12)
    assert embeds.shape == (2, 12, 16)
    torch.testing.assert_close(embeds, ref_embeds, rtol=0, atol=0)
    assert torch.equal(mask, ref_mask)
    # Counted (crop_start None) as given: the same tensors.
    with torch.no_grad():
        counted, _ = encode_with_template(text_encoder, tokenizer, PROMPTS,
                                          PromptTemplate(DEFAULT_PROMPT_TEMPLATE["template"]),
                                          max_sequence_length=12)  # fmt: skip
    torch.testing.assert_close(counted, embeds, rtol=0, atol=0)


def test_the_crop_removes_the_template_before_the_prompt_exactly(llama):
    """After the crop each row starts with its prompt's first token: the prompt, ``<|eot_id|>``, then padding (mask
    0). One token more would cut the prompt, one fewer keep a template token."""
    _, tokenizer = llama
    template = "<|start_header_id|>system<|end_header_id|>\n\nDescribe the video.<|eot_id|>" \
               "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"  # fmt: skip
    crop = template_crop_start(tokenizer, template)
    ids = tokenizer([template.format(p) for p in PROMPTS], padding="max_length", max_length=crop + 12).input_ids
    for row, prompt in zip(ids, PROMPTS):
        assert row[0] == tokenizer.bos_token_id
        assert tokenizer.decode(row[:crop]) == tokenizer.decode(tokenizer(template.split("{}")[0]).input_ids)
        kept = [t for t in row[crop:] if t != tokenizer.pad_token_id]
        assert tokenizer.decode(kept).strip() == prompt + "<|eot_id|>"


def test_a_left_padding_tokenizer_is_refused(llama):
    """With left padding the crop would drop padding and keep template tokens: refused, in one line."""
    text_encoder, _ = llama
    left = build_llama_tokenizer(1024, VIDEO_WORDS, padding_side="left")
    with pytest.raises(ValueError, match=r"must pad on the right; LlamaTokenizer pads on the 'left'") as info:
        encode_with_template(text_encoder, left, PROMPTS, PromptTemplate("{}"), max_sequence_length=4)
    assert len(str(info.value).splitlines()) == 1


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"template": "no placeholder"}, r"exactly one '\{\}'.*found 0"),
    ({"template": "{} and {}"}, r"found 2"),
    ({"template": "{}", "crop_start": -1}, r"crop_start must be an integer >= 0 or None, got -1"),
])  # fmt: skip
def test_a_malformed_template_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PromptTemplate(**kwargs)
