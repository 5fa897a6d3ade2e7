"""The tiny tokenizer builders (ff_core.testing.tiny) keep what they were built with through ``save_pretrained`` ->
``AutoTokenizer.from_pretrained``, the path every tiny checkpoint's ``tokenizer/`` folder takes: the padding side above
all, which a pipeline sharing the adapter's tokenizer object cannot reveal (transformers 5 reloads a Gemma or Llama
tokenizer padding on the left unless the side was saved)."""

from __future__ import annotations

import pytest

from ff_core.testing.tiny import (
    LLAMA_SPECIAL_TOKENS,
    QWEN_SPECIAL_TOKENS,
    VIDEO_WORDS,
    build_clip_tokenizer,
    build_gemma_tokenizer,
    build_llama_tokenizer,
    build_qwen2_tokenizer,
    build_t5_tokenizer,
)

BUILDERS = {"clip": build_clip_tokenizer, "t5": build_t5_tokenizer, "gemma": build_gemma_tokenizer,
            "qwen2": build_qwen2_tokenizer, "llama": build_llama_tokenizer}  # fmt: skip
RELEASED_SIDE = {"clip": "right", "t5": "right", "gemma": "left", "qwen2": "right", "llama": "right"}
BATCH = ["a red", "the big blue circle moving left, 42 zebras!"]


def reloaded(tokenizer, folder):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_padding_side_survives_save_and_reload(kind, side, tmp_path):
    """Built on ``side``, saved, loaded back: the same side, and a padded batch gives the same ids and mask, its
    padding on that side of the short prompt."""
    built = BUILDERS[kind](16, VIDEO_WORDS, padding_side=side)
    loaded = reloaded(built, tmp_path)
    assert (built.padding_side, loaded.padding_side) == (side, side)
    ours = built(BATCH, padding="max_length", max_length=16, truncation=True)
    theirs = loaded(BATCH, padding="max_length", max_length=16, truncation=True)
    assert theirs.input_ids == ours.input_ids and theirs.attention_mask == ours.attention_mask
    mask = theirs.attention_mask[0]
    assert 0 < sum(mask) < 16
    assert mask == sorted(mask, reverse=side == "right")  # right: 1 ... 1 0 ... 0; left: 0 ... 0 1 ... 1
    padded = [i for i, m in zip(theirs.input_ids[0], mask) if not m]
    assert set(padded) == {loaded.pad_token_id}


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_the_default_side_is_the_released_tokenizers(kind, tmp_path):
    assert reloaded(BUILDERS[kind](16), tmp_path).padding_side == RELEASED_SIDE[kind]


def test_a_side_set_after_building_is_saved_too(tmp_path):
    """The builders pass the side to the constructor, so transformers saves the attribute's value from then on."""
    tokenizer = build_gemma_tokenizer(16)
    tokenizer.padding_side = "right"
    assert reloaded(tokenizer, tmp_path).padding_side == "right"


def test_an_unknown_side_is_refused():
    with pytest.raises(ValueError, match=r"padding_side must be one of \('left', 'right'\), got 'middle'"):
        build_llama_tokenizer(padding_side="middle")


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_llm_tokenizers_spell_each_word_as_one_token(kind, tmp_path):
    tokenizer = reloaded(BUILDERS[kind](16, VIDEO_WORDS), tmp_path)
    special = set(tokenizer.all_special_ids)
    for word in VIDEO_WORDS:
        for text in (word, f"a {word}"):  # the first word and a later one
            ids = [i for i in tokenizer(text).input_ids if i not in special]
            assert len(ids) == len(text.split()), (kind, text, tokenizer.convert_ids_to_tokens(ids))


@pytest.mark.parametrize(("kind", "specials"), [("qwen2", QWEN_SPECIAL_TOKENS[1:]), ("llama", LLAMA_SPECIAL_TOKENS)])
def test_chat_markers_are_one_token_each(kind, specials, tmp_path):
    """A chat template's markers are single special tokens, as in the released vocabularies."""
    tokenizer = reloaded(BUILDERS[kind](64), tmp_path)
    for token in specials:
        marker = tokenizer.convert_tokens_to_ids(token)
        assert tokenizer(token, add_special_tokens=False).input_ids == [marker], token
        assert marker in tokenizer(f"red{token}blue", add_special_tokens=False).input_ids, token  # never split


def test_llama_prepends_begin_of_text_and_falls_back_to_bytes(tmp_path):
    """Llama 3's ``<|begin_of_text|>`` first; a character outside the vocabulary is its UTF-8 bytes, never
    ``<unk>``, and decodes back."""
    tokenizer = reloaded(build_llama_tokenizer(64), tmp_path)
    ids = tokenizer("a red circle: ü\n").input_ids
    assert ids[0] == tokenizer.bos_token_id == tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    assert tokenizer.unk_token_id not in ids
    assert {"<0xC3>", "<0xBC>", "<0x0A>"} <= set(tokenizer.convert_ids_to_tokens(ids))
    assert tokenizer.decode(ids, skip_special_tokens=True).strip() == "a red circle: ü"
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|end_of_text|>", "<pad>")
