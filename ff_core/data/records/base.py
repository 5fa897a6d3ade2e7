"""The normalised row types (:class:`MediaItem`, :class:`Record`) and the strict field readers both row
formats use. Every reader raises :class:`~ff_core.errors.DatasetError` naming the record's file, line and
the dotted field path (``supervision.chosen.media[1].sample_rate``, ``references[2].path``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from ff_core.contracts import MediaType
from ff_core.errors import DatasetError

Supervision = Literal["demonstration", "preference"]
Schema = Literal["legacy", "v2"]

# The supervision each trainer consumes (spec: "Use it with train.trainer_type: sft / offline-dpo").
SUPERVISION_FOR_TRAINER: dict[str, Supervision | None] = {
    "sft": "demonstration",
    "offline-dpo": "preference",
    "grpo": None,
    "nft": None,
}
# Field of each candidate, in ``Record.candidates`` order.
CANDIDATE_FIELDS: dict[str, tuple[str, ...]] = {
    "demonstration": ("supervision.target",),
    "preference": ("supervision.chosen", "supervision.rejected"),
}


@dataclass(frozen=True)
class MediaItem:
    """One media object, paths resolved.

    Attributes:
        type: ``image``, ``video`` or ``audio`` (the only discriminator).
        path: resolved file path.
        slot: input-only semantic binding (``first_frame``), or ``None``.
        fps: video frame-rate override (a logical clock; decoding reports the file's own rate beside it).
        sample_rate: sample-rate override of an audio item, or of a video's separate ``audio_path``
            soundtrack (a logical clock; decoding never resamples).
        audio_path: a Ref2VA video's separate soundtrack file (``None``: the embedded soundtrack, if any).
        origin: where the item was written in its record (``input.media[1]``, ``images[0]``), for messages.
        bare: the path was written as a plain string (a legacy ``image(s)`` / ``video(s)`` / ``audio(s)`` column),
            not as an object with a ``path`` key, so messages about the file name the column itself.
    """

    type: MediaType
    path: Path
    slot: str | None = None
    fps: float | None = None
    sample_rate: float | None = None
    audio_path: Path | None = None
    origin: str = field(default="", compare=False)
    bare: bool = field(default=False, compare=False)

    def files(self) -> tuple[Path, ...]:
        """Every file this item references (the media file, then a separate soundtrack)."""
        return (self.path,) if self.audio_path is None else (self.path, self.audio_path)

    def field_of(self, key: str = "path") -> str | None:
        """The field that holds one of this item's files, as the user wrote it (``None`` without an origin).

        Args:
            key: ``path`` or ``audio_path``. A bare string column is its own path: ``image``, not ``image.path``.
        """
        if not self.origin:
            return None
        return self.origin if key == "path" and self.bare else join(self.origin, key)

    def file_fields(self) -> list[tuple[Path, str | None]]:
        """``(file, field)`` of every file this item references, in :meth:`files` order."""
        return list(zip(self.files(), (self.field_of("path"), self.field_of("audio_path"))))


@dataclass(frozen=True)
class Record:
    """One row of a dataset, normalised.

    Attributes:
        source: the file the row came from.
        line: its 1-based line.
        prompt: text prompt (a V2 prompt may be empty; whether that is usable is the adapter's decision).
        negative_prompt: CFG negative prompt (legacy ``negative_prompt`` column or V2 ``input.negative_prompt``;
            ``None`` when absent or null).
        inputs: condition media in record order (legacy ``image(s)``/``video(s)``/``audio(s)`` columns in that
            column order, or V2 ``input.media``).
        supervision: ``demonstration``, ``preference`` or ``None`` for a generation row.
        candidates: output media sequences: ``(target,)`` or ``(chosen, rejected)``.
        metadata: never a model input; what rewards and evaluation may read. A legacy row's reward metadata:
            every column that is not a prompt, media or references column, plus the keys of its ``metadata``
            object (Flow-Factory packs the same columns into each sample's metadata); a V2 record's
            ``metadata`` object.
        references: legacy MiniMax H3 Ref2VA ``references``, globally ordered (V2 records carry their ordered
            references in ``inputs``).
        schema: ``legacy`` (txt / legacy JSONL generation row) or ``v2`` (strict supervised record).
    """

    source: Path
    line: int
    prompt: str
    negative_prompt: str | None = None
    inputs: tuple[MediaItem, ...] = ()
    supervision: Supervision | None = None
    candidates: tuple[tuple[MediaItem, ...], ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)
    references: tuple[MediaItem, ...] = ()
    schema: Schema = "legacy"

    @property
    def where(self) -> tuple[Path, int]:
        """``(source, line)``: what media decoders take as ``referenced_by``."""
        return (self.source, self.line)

    def field_path(self, name: str) -> str:
        """Where a prompt field lives in this record's format: ``prompt`` or V2 ``input.prompt``.

        Args:
            name: ``prompt`` or ``negative_prompt``.
        """
        return f"input.{name}" if self.schema == "v2" else name

    @property
    def input_field(self) -> str:
        """The field that holds this record's condition media, for messages."""
        if self.schema == "v2":
            return "input.media"
        return "references" if self.references else "images"

    def media(self) -> list[tuple[str, MediaItem]]:
        """Every media item with its field path: inputs, references, then each candidate's outputs (an output
        built without an ``origin`` gets its ``supervision...media[i]`` one, so its messages name it too)."""
        out = [(m.origin, m) for m in (*self.inputs, *self.references)]
        for name, cand in zip(CANDIDATE_FIELDS.get(self.supervision or "", ()), self.candidates):
            for i, m in enumerate(cand):
                item = m if m.origin else replace(m, origin=f"{name}.media[{i}]")
                out.append((item.origin, item))
        return out


# ---------------------------------------------------------------------------------------------------------
# Field readers shared by the legacy and V2 parsers.
class FieldReader:
    """Checks the values of one record; each failing check raises a DatasetError naming the field.

    Args:
        path: the record's file.
        line: the record's 1-based line.
    """

    def __init__(self, path: Path, line: int) -> None:
        self.path, self.line = path, line

    def error(self, field: str | None, reason: str) -> DatasetError:
        return DatasetError(self.path, self.line, field or None, reason)

    def obj(self, value: Any, field: str, allowed: set[str], required: set[str]) -> dict[str, Any]:
        """An object with no key outside ``allowed`` and every key of ``required``.

        Every unknown key is named in one message, which lists only the keys valid at this place (one key:
        ``input.media[0].fps: unknown key (allowed here: path, slot, type)``; several:
        ``input.media[0]: unknown keys 'fps', 'rate' (allowed here: ...)``).
        """
        if not isinstance(value, dict):
            raise self.error(field, f"expected a JSON object, found {kind(value)}")
        unknown = sorted(set(value) - allowed)
        valid = f"(allowed here: {', '.join(sorted(allowed))})"
        if len(unknown) == 1:
            raise self.error(join(field, unknown[0]), f"unknown key {valid}")
        if unknown:
            raise self.error(field, f"unknown keys {', '.join(map(repr, unknown))} {valid}")
        missing = sorted(required - set(value))
        if missing:
            raise self.error(join(field, missing[0]), "required key is missing")
        return value

    def string(self, value: Any, field: str, *, allow_empty: bool = False) -> str:
        if not isinstance(value, str):
            raise self.error(field, f"expected a string, found {kind(value)}")
        if not allow_empty and not value.strip():
            raise self.error(field, "must not be empty")
        return value

    def rate(self, value: Any, field: str) -> float:
        """A finite positive number (spec: "fps and sample_rate overrides must be finite positive numbers")."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(field, f"expected a number, found {kind(value)}")
        if not math.isfinite(value) or value <= 0:
            raise self.error(field, f"must be a finite positive number, found {value}")
        return float(value)

    def count(self, value: Any, field: str) -> int:
        """A positive JSON integer: ``16000``, not ``16000.0`` (a V2 ``sample_rate``, strict like Flow-Factory's
        ``sample_rate: int`` in its strict pydantic schema)."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(field, f"expected an integer, found {kind(value)}")
        if value <= 0:
            raise self.error(field, f"must be a positive integer, found {value}")
        return value

    def finite_json(self, value: Any, field: str) -> Any:
        """``value`` when it holds no ``NaN`` / ``Infinity`` at any depth (they are not JSON; Python's parser
        accepts them, Flow-Factory's strict V2 schema does not)."""
        if isinstance(value, float) and not math.isfinite(value):
            raise self.error(field, f"must be finite JSON (NaN and Infinity are not JSON), found {value}")
        if isinstance(value, dict):
            for key, item in value.items():
                self.finite_json(item, join(field, key))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                self.finite_json(item, join(field, i))
        return value

    def media_type(self, value: dict[str, Any], field: str) -> MediaType:
        """The ``type`` discriminator: ``image``, ``video`` or ``audio`` and nothing else."""
        if "type" not in value:
            raise self.error(join(field, "type"), "required key is missing (image, video or audio)")
        found = value["type"]
        if not isinstance(found, str) or found not in {t.value for t in MediaType}:
            raise self.error(join(field, "type"), f"unknown media type {_show(found)} (image, video or audio)")
        return MediaType(found)


def kind(value: Any) -> str:
    """A JSON value's kind for messages: ``an object``, ``a string``, ``null``, ..."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), f"a number ({value})" if isinstance(value, (int, float)) else "a value")


def join(parent: str, child: str | int) -> str:
    """``join("a.b", 2) == "a.b[2]"``, ``join("a", "b") == "a.b"``, ``join("", "b") == "b"``."""
    if isinstance(child, int):
        return f"{parent}[{child}]"
    return f"{parent}.{child}" if parent else child


def resolve(path: str, root: Path) -> Path:
    """``~`` expanded; an absolute path is kept, a relative one is joined to ``root``; then normalised
    (``a/./b/../c`` -> ``a/c``, as Flow-Factory's V2 loader does with ``os.path.normpath``), so messages and
    cache identities show one spelling of each file."""
    p = Path(path).expanduser()
    return Path(os.path.normpath(p if p.is_absolute() else root / p))


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else kind(value)
