"""Legacy generation rows (spec: dataset-guide, "Common task formats", "MiniMax H3 datasets").

Used for generation acquisition: every evaluation split, and the training split of online RL (GRPO)::

    {"prompt": "...", "negative_prompt": "...", "image": "a.png" | "images": ["a.png", "b.png"],
     "video": ... | "videos": [...], "audio": ... | "audios": [...], "metadata": {...}}
    {"prompt": "...", "references": [{"type": "image", "path": "references/style.png"}, ...]}   # H3 Ref2VA

Singular columns are normalised to the list form, and so is a plural column given as one string
(``"images": "a.png"``, as Flow-Factory's loader does); list order is kept (never sorted or deduplicated).
Ordinary media paths resolve against their media directory; Ref2VA reference paths resolve against
``dataset_dir``. Every other column is reward metadata (spec: datasets carry "prompts, and optional reward
metadata"; Flow-Factory packs every column it does not preprocess into the sample's ``metadata``): it is kept
on :attr:`Record.metadata`, never a model input. Which columns a given adapter accepts (FL2VA: 1 or 2 images;
T2VA: none) is checked in :mod:`ff_core.data.records.validation`.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from ff_core.contracts import MediaType, ReferenceSpec
from ff_core.data.records.base import FieldReader, MediaItem, Record, join, kind, resolve

MEDIA_COLUMNS: dict[str, MediaType] = {
    "image": MediaType.IMAGE,
    "images": MediaType.IMAGE,
    "video": MediaType.VIDEO,
    "videos": MediaType.VIDEO,
    "audio": MediaType.AUDIO,
    "audios": MediaType.AUDIO,
}
# Columns with a meaning of their own; any other column of a row is reward metadata.
KNOWN_COLUMNS = ("prompt", "negative_prompt", *MEDIA_COLUMNS, "references", "metadata")
# The references column itself, whichever adapter reads the row (spec, Ref2VA: "The array accepts 1-12
# entries and requires at least one image or video; an audio-only array is invalid").
REFERENCES_COLUMN = ReferenceSpec(min_count=1, max_count=12, requires_one_of=frozenset({MediaType.IMAGE,
                                                                                       MediaType.VIDEO}))
# Spec table "Supported entries" of Ref2VA references: required keys are type and path.
REFERENCE_KEYS: dict[MediaType, set[str]] = {
    MediaType.IMAGE: {"type", "path"},
    MediaType.VIDEO: {"type", "path", "fps", "audio_path", "sample_rate"},
    MediaType.AUDIO: {"type", "path", "sample_rate"},
}


def parse_reference(reader: FieldReader, value: Any, field: str, root: Path) -> MediaItem:
    """One Ref2VA reference entry; ``path`` and ``audio_path`` resolve against ``dataset_dir`` (``root``)."""
    if not isinstance(value, dict):
        raise reader.error(field, f"expected a reference object, found {kind(value)}")
    mtype = reader.media_type(value, field)
    reader.obj(value, field, REFERENCE_KEYS[mtype], {"type", "path"})
    path = resolve(reader.string(value["path"], join(field, "path")), root)
    fps = reader.rate(value["fps"], join(field, "fps")) if "fps" in value else None
    rate = reader.rate(value["sample_rate"], join(field, "sample_rate")) if "sample_rate" in value else None
    audio_path = None
    if "audio_path" in value:
        audio_path = resolve(reader.string(value["audio_path"], join(field, "audio_path")), root)
    if mtype is MediaType.VIDEO and rate is not None and audio_path is None:
        # Spec: "a video sample_rate override requires audio_path" (an embedded soundtrack keeps its own clock).
        raise reader.error(join(field, "sample_rate"), "a video's sample_rate override requires audio_path")
    return MediaItem(mtype, path, None, fps, rate, audio_path, origin=field)


def _references(reader: FieldReader, value: Any, root: Path) -> tuple[MediaItem, ...]:
    if not isinstance(value, list):
        raise reader.error("references", f"expected an array of reference objects, found {kind(value)}")
    if not value:
        raise reader.error("references", "must hold at least one reference (omit the key for none)")
    items = tuple(parse_reference(reader, v, join("references", i), root) for i, v in enumerate(value))
    problem = REFERENCES_COLUMN.count_problem([m.type for m in items])
    if problem:
        raise reader.error("references", problem)
    return items


def _column(reader: FieldReader, obj: dict[str, Any], mtype: MediaType, media_dir: Path) -> list[MediaItem]:
    single, plural = mtype.value, f"{mtype.value}s"
    if single in obj and plural in obj:
        raise reader.error(plural, f"give either {single!r} or {plural!r}, not both")
    if single in obj:
        values, names = [obj[single]], [single]
    elif isinstance(obj.get(plural), str):
        # One string in a plural column is a one-element list (Flow-Factory: ``if isinstance(paths, str)``).
        values, names = [obj[plural]], [plural]
    elif plural in obj:
        if not isinstance(obj[plural], list):
            raise reader.error(plural, f"expected a path or an array of paths, found {kind(obj[plural])}")
        if not obj[plural]:
            raise reader.error(plural, "must hold at least one path (omit the key for none)")
        values, names = obj[plural], [join(plural, i) for i in range(len(obj[plural]))]
    else:
        return []
    return [MediaItem(mtype, resolve(reader.string(v, n), media_dir), origin=n, bare=True)
            for v, n in zip(values, names)]


def closest_column(name: str) -> str | None:
    """The known column ``name`` is probably a misspelling of (``promt`` -> ``prompt``), or ``None``.

    Args:
        name: a column of a row that is not a known column.
    """
    if name in KNOWN_COLUMNS:
        return None
    close = difflib.get_close_matches(name, KNOWN_COLUMNS, n=1, cutoff=0.75)
    return close[0] if close else None


def _metadata(reader: FieldReader, obj: dict[str, Any]) -> dict[str, Any]:
    """The row's reward metadata: its ``metadata`` object merged with every column that is not a known column."""
    given = obj.get("metadata", {})
    if not isinstance(given, dict):
        raise reader.error("metadata", f"expected a JSON object, found {kind(given)}")
    columns = {k: v for k, v in obj.items() if k not in KNOWN_COLUMNS}
    both = sorted(set(columns) & set(given))
    if both:
        raise reader.error(both[0], "given both as a column and inside metadata; keep one")
    return {**given, **columns}


def _prompt(reader: FieldReader, obj: dict[str, Any]) -> str:
    if "prompt" not in obj:
        near = [k for k in obj if closest_column(k) == "prompt"]
        hint = f" (is {near[0]!r} a misspelling of it?)" if near else ""
        raise reader.error("prompt", f"required key is missing{hint}")
    return reader.string(obj["prompt"], "prompt")


def parse_legacy_row(
    obj: Any, path: Path, line: int, media_dirs: dict[MediaType, Path], root: Path | None = None
) -> Record:
    """Validate one legacy JSONL row; media columns are normalised to the list form, every column that is not a
    known column becomes reward metadata.

    Args:
        obj: the decoded JSON value of one line.
        path: the file it came from.
        line: its 1-based line.
        media_dirs: root of relative ``image(s)`` / ``video(s)`` / ``audio(s)`` paths, per media type.
        root: ``dataset_dir``, root of relative Ref2VA ``references`` paths (default: the file's folder).
    """
    reader = FieldReader(path, line)
    if isinstance(obj, dict) and "schema_version" in obj:
        raise reader.error(
            "schema_version",
            "a strict V2 record in a generation split: V2 records are offline training records (sft, offline-dpo);"
            " evaluation and GRPO use legacy prompt rows",
        )
    if not isinstance(obj, dict):
        raise reader.error(None, f"expected a JSON object, found {kind(obj)}")
    prompt = _prompt(reader, obj)
    negative = None
    if "negative_prompt" in obj:
        negative = reader.string(obj["negative_prompt"], "negative_prompt", allow_empty=True)
    inputs = [item for mtype in MediaType for item in _column(reader, obj, mtype, media_dirs[mtype])]
    references: tuple[MediaItem, ...] = ()
    if "references" in obj:
        if inputs:
            raise reader.error("references", "give either references or image/video/audio columns, not both")
        references = _references(reader, obj["references"], path.parent if root is None else root)
    return Record(path, line, prompt, negative, tuple(inputs), metadata=_metadata(reader, obj), references=references)
