"""Tiny random-initialised reward models of the real transformers classes, built offline and saved with
``save_pretrained`` (the rewards load them back with ``from_pretrained``): CLAP (``ClapModel`` + ``ClapProcessor``) and
a LLaVA-architecture VLM judge (``LlavaForConditionalGeneration`` + ``LlavaProcessor`` with a chat template)."""

from __future__ import annotations

from pathlib import Path

import torch

CLAP_RATE = 8000
"""The tiny CLAP feature extractor's sampling rate (LAION's checkpoints: 48 kHz); 1 s of audio at most."""

LLAVA_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | upper }}: {% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<image>\n{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
"""llava-1.5's turn format (``USER: <image>\\n... ASSISTANT:``) as a Jinja chat template."""


def byte_tokenizer_vocab(specials: tuple[str, ...]) -> dict[str, int]:
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {t: i for i, t in enumerate(specials)}
    for token in sorted(ByteLevel.alphabet()):
        vocab.setdefault(token, len(vocab))
    return vocab


def build_tiny_clap(path: Path, seed: int = 0) -> Path:
    """A 1-layer text tower and a 2-stage HTSAT audio tower (16 mel bins, 64 x 64 spectrogram image), 8-dim
    projections; a byte-level RoBERTa tokenizer (no merges) and an unfused feature extractor at :data:`CLAP_RATE`."""
    from transformers import ClapConfig, ClapFeatureExtractor, ClapModel, ClapProcessor, RobertaTokenizer

    vocab = byte_tokenizer_vocab(("<s>", "<pad>", "</s>", "<unk>", "<mask>"))
    tokenizer = RobertaTokenizer(vocab=vocab, merges=[], model_max_length=32)
    extractor = ClapFeatureExtractor(feature_size=16, sampling_rate=CLAP_RATE, hop_length=80, max_length_s=1,
                                     fft_window_size=256, frequency_max=CLAP_RATE // 2, truncation="rand_trunc")
    config = ClapConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=40, projection_dim=8),
        audio_config=dict(num_mel_bins=16, window_size=4, spec_size=64, patch_size=2, patch_stride=2, hidden_size=32,
                          patch_embeds_hidden_size=16, projection_dim=8, depths=[1, 1], num_attention_heads=[2, 2],
                          num_hidden_layers=2, intermediate_size=32),
        projection_dim=8,
    )  # fmt: skip
    torch.manual_seed(seed)
    ClapModel(config).save_pretrained(path)
    ClapProcessor(feature_extractor=extractor, tokenizer=tokenizer).save_pretrained(path)
    return path


def build_tiny_llava(path: Path, seed: int = 0) -> Path:
    """LLaVA with a 2-layer CLIP vision tower (16 x 16 images, 8 x 8 patches: 4 image tokens) and a 1-layer Qwen2
    language model, the output rows of the digits scaled up; the Qwen2 byte-level tokenizer of
    :func:`ff_core.testing.tiny.build_qwen2_tokenizer` plus ``<image>`` (digits are one token each: ``10`` is ``1``,
    ``0``)."""
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    from ff_core.testing.tiny import build_qwen2_tokenizer

    tokenizer = build_qwen2_tokenizer(512)
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                               vision_feature_select_strategy="default", chat_template=LLAVA_TEMPLATE,
                               num_additional_image_tokens=1)  # fmt: skip
    config = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, image_size=16, patch_size=8),
        text_config=dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=512),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-1, image_seq_length=4,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():  # opinionated about digits: scores that differ from sample to sample, far from uniform
        digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
        model.get_output_embeddings().weight[digits] *= 100
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path
