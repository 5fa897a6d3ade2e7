"""MiniMax H3 Ref2VA references: the input contract and the canonical ``reference_manifest``.

Spec dataset-guide, "Ref2VA: minimax-h3-ref2va": a legacy row's ``references`` array (or a V2 record's
``input.media``) holds 1-12 globally ordered image / video / audio entries, at least one of them an image or a video;
array order is semantically significant and "is preserved during validation, encoding, caching, and sample identity
hashing" (never sorted, never deduplicated). The row format itself (keys per type, finite positive rates, paths
resolved against ``dataset_dir``) is parsed by :mod:`ff_core.data.records.legacy` / :mod:`ff_core.data.records.v2`;
the counts are checked against :data:`REF2VA_CONTRACT` by :mod:`ff_core.data.records.validation`, before any weights
load.

"Ref2VA adds an ordered-reference path": the references array is validated and canonicalised as
``reference_manifest``, "the canonical JSON string retained for reproducibility and sample identity". Here it is the
JSON array of the entries as the record declared them (``type``, the resolved ``path``, and ``fps``,
``sample_rate``, ``audio_path`` where written), keys sorted, no whitespace, numbers as floats, so that parsing and
re-serialising it gives the same bytes (:func:`canonical_manifest`). The condition cache stores tensors only, so the
adapter caches it as UTF-8 bytes in a ``uint8`` tensor (:func:`manifest_tensor` / :func:`manifest_text`). The cache
row id (:func:`ff_core.data.cache.identity.input_identity`) already hashes the same ordered entries plus each file's
SHA-256, so a reordered or edited list never reuses a cached condition.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ff_core.contracts import MediaType, PipelineIOContract, ReferenceSpec
from ff_minimax.rules import AV_OUTPUTS, H3_CONTRACT_LIMITS

#: diffusers' ``MiniMaxH3Ref2VASetupStep`` defaults ("what MiniMax-H3 documents for the released checkpoint"): at
#: most 9 images, 3 videos and 3 audio clips, 12 references in all, and audio never alone.
MAX_IMAGES, MAX_VIDEOS, MAX_AUDIOS, MAX_REFERENCES = 9, 3, 3, 12
#: The setup step's "A reference image must be within 1:4 and 4:1" (``MINIMAX_H3_MAX_ASPECT_RATIO``).
MAX_IMAGE_ASPECT = 4.0

REF2VA_REFERENCES = ReferenceSpec(
    types=frozenset(MediaType),
    min_count=1,
    max_count=MAX_REFERENCES,
    requires_one_of=frozenset({MediaType.IMAGE, MediaType.VIDEO}),
    max_per_type=((MediaType.IMAGE, MAX_IMAGES), (MediaType.VIDEO, MAX_VIDEOS), (MediaType.AUDIO, MAX_AUDIOS)),
    max_image_aspect=MAX_IMAGE_ASPECT,
)
"""The ordered references of Ref2VA (spec: "1-12 entries and requires at least one image or video")."""

REF2VA_CONTRACT = PipelineIOContract(
    outputs=AV_OUTPUTS,
    references=REF2VA_REFERENCES,
    **H3_CONTRACT_LIMITS,  # B = 1, no CFG (ff_minimax.rules)
)
"""``minimax-h3-ref2va``: ordered references + prompt -> (video(fps), audio(sample_rate)); B=1, no CFG."""

#: The keys a manifest entry may carry, as the spec's "Supported entries" table names them.
MANIFEST_KEYS = ("type", "path", "fps", "sample_rate", "audio_path")
_RATES = ("fps", "sample_rate")
_PATHS = ("path", "audio_path")


def manifest_entry(media: Mapping[str, Any]) -> dict[str, Any]:
    """One reference as the manifest records it: ``type`` and ``path``, and the declared ``fps``, ``sample_rate`` and
    ``audio_path`` where present; paths as strings, rates as floats.

    Args:
        media: a :class:`~ff_core.adapter.ConditionInput` media entry (``{"type", "data", "path", ...}``) or a parsed
            manifest entry; keys outside :data:`MANIFEST_KEYS` (``data``) are not part of the manifest.
    """
    mtype = MediaType(str(media["type"]))
    entry: dict[str, Any] = {"type": mtype.value}
    for key in _PATHS:
        if media.get(key) is not None:
            entry[key] = str(Path(media[key]))
    for key in _RATES:
        if media.get(key) is not None:
            value = media[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"reference_manifest: {key} must be a finite positive number, got {value!r}")
            entry[key] = float(value)
    if "path" not in entry:
        raise ValueError(f"reference_manifest: a {mtype} reference needs a path")
    return entry


def reference_manifest(references: Sequence[Mapping[str, Any]]) -> str:
    """The canonical JSON of an ordered reference list (the list order kept exactly: no sorting, no deduplication).

    Args:
        references: the references in record order (ConditionInput media entries or parsed manifest entries).
    """
    entries = [manifest_entry(m) for m in references]
    return json.dumps(entries, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def canonical_manifest(text: str) -> str:
    """``text`` (any JSON spelling of a manifest: other key order, whitespace, ``12`` for ``12.0``) re-serialised in
    the canonical form; a canonical manifest maps to itself.

    Args:
        text: a JSON array of reference entries.
    """
    value = json.loads(text)
    if not isinstance(value, list):
        raise ValueError(f"reference_manifest must be a JSON array, found {type(value).__name__}")
    unknown = sorted({k for entry in value for k in entry} - set(MANIFEST_KEYS))
    if unknown:
        raise ValueError(f"reference_manifest: unknown key(s) {unknown} (allowed: {', '.join(MANIFEST_KEYS)})")
    return reference_manifest(value)


def manifest_tensor(text: str) -> Tensor:
    """The manifest as a 1-D ``uint8`` tensor of its UTF-8 bytes (the condition cache stores tensors only)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8)


def manifest_text(tensor: Tensor) -> str:
    """The manifest back from :func:`manifest_tensor`'s bytes.

    Args:
        tensor: a 1-D ``uint8`` tensor (a batch of one, ``(1, N)``, is accepted: H3 runs B=1).
    """
    flat = tensor.reshape(-1) if tensor.dim() == 2 and tensor.shape[0] == 1 else tensor
    if flat.dim() != 1 or flat.dtype != torch.uint8:
        raise ValueError(f"reference_manifest: expected 1-D uint8 bytes, got {flat.dtype} {tuple(flat.shape)}")
    return bytes(flat.cpu().tolist()).decode("utf-8")


__all__ = [
    "MANIFEST_KEYS",
    "REF2VA_CONTRACT",
    "REF2VA_REFERENCES",
    "canonical_manifest",
    "manifest_entry",
    "manifest_tensor",
    "manifest_text",
    "reference_manifest",
]
