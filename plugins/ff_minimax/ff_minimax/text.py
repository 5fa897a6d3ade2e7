"""The Qwen3-VL processor MiniMax H3's text blocks read, loadable without torchvision.

The H3 blocks use three things of the processor: ``image_processor`` (keyframe and reference images to vision
patches), ``image_processor.merge_size`` and ``create_mm_token_type_ids`` (Qwen3-VL's per-token modality ids).
``Qwen3VLProcessor`` also insists on a video processor, and every transformers video processor needs torchvision,
which does not install beside the pinned torch here (DESIGN, engineering notes). :func:`load_processor` loads the
processor whole when it can and otherwise assembles the same class from its image processor and tokenizer, with no
video processor (the H3 blocks never hand the conditioner a video: a video reference is presented as frames).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def assemble_processor(image_processor: Any, tokenizer: Any) -> Any:
    """A ``Qwen3VLProcessor`` of ``image_processor`` and ``tokenizer``: built normally when transformers can (a video
    processor is then created from defaults), else without a video processor (see the module docstring)."""
    from transformers import Qwen3VLProcessor

    try:
        from transformers import Qwen3VLVideoProcessor

        return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                video_processor=Qwen3VLVideoProcessor())  # fmt: skip
    except (ImportError, AttributeError):  # no torchvision: the video processor class is a dummy
        pass
    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    # What Qwen3VLProcessor.__init__ sets, minus the class check of the (absent) video processor.
    processor.tokenizer, processor.image_processor, processor.video_processor = tokenizer, image_processor, None
    processor.chat_template = None
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.vision_start_token, processor.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    for name in ("image_token", "video_token", "vision_start_token", "vision_end_token"):
        setattr(processor, f"{name}_id", tokenizer.convert_tokens_to_ids(getattr(processor, name)))
    return processor


def load_processor(path: str | Path, subfolder: str = "processor", revision: str | None = None) -> Any:
    """The checkpoint's ``Qwen3VLProcessor`` (``from_pretrained``), or, without torchvision, the same class assembled
    from its ``Qwen2VLImageProcessorPil`` and tokenizer, both loaded with ``from_pretrained`` from ``subfolder``.

    Args:
        path: the checkpoint folder or hub id.
        subfolder: the processor's folder in it.
        revision: hub revision.
    """
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLProcessor

    try:
        return Qwen3VLProcessor.from_pretrained(str(path), subfolder=subfolder, revision=revision)
    except (ImportError, AttributeError, ValueError, TypeError):
        pass
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(path), subfolder=subfolder, revision=revision)
    tokenizer = AutoTokenizer.from_pretrained(str(path), subfolder=subfolder, revision=revision)
    return assemble_processor(image_processor, tokenizer)
