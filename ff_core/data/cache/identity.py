"""Content identity of records and their media: what a condition cache key and a resume fingerprint are built from.

Spec dataset-guide, "Condition cache and target lifecycle": every unique normalised input and supervision media
path is streamed once through SHA-256 per source build, with digests memoised only for that build
(:class:`MediaDigests`); media payloads are never copied. A record's identity covers its prompts, its normalised
input media (with their digests), its supervision type and candidates (target / chosen / rejected, with digests)
and its metadata, so replacing any of those files in place changes it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import Any

from ff_core.data.records.base import MediaItem, Record

_CHUNK = 1 << 20


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes, streamed in 1 MiB chunks (never read whole).

    Args:
        path: the file.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


class MediaDigests:
    """SHA-256 of media files, each file streamed at most once for the lifetime of this object (one source build).

    Paths are resolved before lookup, so two spellings of one file share a digest.
    """

    def __init__(self) -> None:
        self._digests: dict[Path, str] = {}

    def __call__(self, path: str | Path) -> str:
        key = Path(path).resolve()
        if key not in self._digests:
            self._digests[key] = file_sha256(key)
        return self._digests[key]

    def __len__(self) -> int:
        return len(self._digests)


def _plain(value: Any, digests: MediaDigests | None) -> Any:
    """JSON-ready form of record fields; media items carry their content digest beside their path."""
    if isinstance(value, MediaItem):
        item = {k: _plain(v, digests) for k, v in vars(value).items() if k != "origin"}
        if digests is not None:
            item["sha256"] = digests(value.path)
            if value.audio_path is not None:
                item["audio_sha256"] = digests(value.audio_path)
        return item
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v, digests) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, digests) for v in value]
    return value


def record_identity(record: Record, digests: MediaDigests | None = None) -> str:
    """Hex SHA-256 of a record's content: prompts, input media, references, supervision, candidates and metadata,
    with every media file's content digest when ``digests`` is given (its file position, ``source``/``line``, is
    not part of it: moving a row changes the order's identity, not the row's).

    Args:
        record: a validated record.
        digests: the build's media digest memo; ``None`` hashes paths only.
    """
    fields = {k: v for k, v in vars(record).items() if k not in ("source", "line")}
    blob = json.dumps(_plain(fields, digests), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def records_identity(records: Iterable[Record], digests: MediaDigests | None = None) -> str:
    """Hex SHA-256 of an ordered sequence of records (their identities in order).

    Args:
        records: the records, in loader order.
        digests: as for :func:`record_identity`.
    """
    h = hashlib.sha256()
    for record in records:
        h.update(record_identity(record, digests).encode())
    return h.hexdigest()


def input_identity(record: Record, digests: MediaDigests | None = None) -> str:
    """Hex SHA-256 of a record's input side only: its prompts, input media and references, with every media file's
    content digest when ``digests`` is given. The condition cache's row id (spec dataset-guide, "Condition cache and
    target lifecycle"): replacing a condition file in place changes it; replacing a target, chosen or rejected file
    (or the metadata) does not, since only the input side is cached.

    Args:
        record: a validated record.
        digests: the build's media digest memo; ``None`` hashes paths only.
    """
    fields = {k: getattr(record, k) for k in ("prompt", "negative_prompt", "inputs", "references")}
    blob = json.dumps(_plain(fields, digests), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()
