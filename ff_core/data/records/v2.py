"""Strict V2 supervised records (spec: dataset-guide, "Offline V2 records", "Demonstration supervision",
"Preference supervision").

::

    {"schema_version": 2,
     "input": {"prompt": "...", "negative_prompt": "..." | null,
               "media": [{"type": "image", "path": "...", "slot": "first_frame"}]},
     "supervision": {"type": "demonstration", "target": {"media": [...]}}
                  | {"type": "preference", "chosen": {"media": [...]}, "rejected": {"media": [...]}},
     "metadata": {...}}

Format rules live here, as strict as Flow-Factory's pydantic V2 schema (``extra="forbid"``, ``strict=True``,
``allow_inf_nan=False``): ``prompt`` is any string (empty too), ``negative_prompt`` a string or null,
``sample_rate`` a JSON integer, ``metadata`` finite JSON. What a given adapter accepts (slots, output order,
required rates, a prompt, a negative prompt) is checked in :mod:`ff_core.data.records.validation`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ff_core.contracts import MediaType
from ff_core.data.records.base import FieldReader, MediaItem, Record, join, kind, resolve

# Spec: "Every V2 media object uses type as its only public discriminator"; an image has no fps, a video no
# sample_rate (its soundtrack is not part of the V2 vocabulary), and only inputs take a slot.
V2_MEDIA_KEYS: dict[MediaType, set[str]] = {
    MediaType.IMAGE: {"type", "path"},
    MediaType.VIDEO: {"type", "path", "fps"},
    MediaType.AUDIO: {"type", "path", "sample_rate"},
}
V2_RECORD_KEYS = {"schema_version", "input", "supervision", "metadata"}
V2_INPUT_KEYS = {"prompt", "negative_prompt", "media"}


def parse_v2_media(reader: FieldReader, value: Any, field: str, root: Path, *, is_input: bool) -> MediaItem:
    """One V2 media object; paths resolve against the source's ``dataset_dir`` (``root``)."""
    if not isinstance(value, dict):
        raise reader.error(field, f"expected a media object, found {kind(value)}")
    mtype = reader.media_type(value, field)
    if not is_input and "slot" in value:
        # Spec: "Supervision outputs reject slot because their order is declared by the pipeline output contract".
        raise reader.error(join(field, "slot"), "outputs take no slot: their order is the pipeline's output order")
    allowed = V2_MEDIA_KEYS[mtype] | ({"slot"} if is_input else set())
    reader.obj(value, field, allowed, {"type", "path"})
    path = reader.string(value["path"], join(field, "path"))
    slot = reader.string(value["slot"], join(field, "slot")) if "slot" in value else None
    fps = reader.rate(value["fps"], join(field, "fps")) if "fps" in value else None
    # Flow-Factory: ``sample_rate: int | None = Field(gt=0)`` under strict mode, so 16000.0 is refused.
    rate = reader.count(value["sample_rate"], join(field, "sample_rate")) if "sample_rate" in value else None
    return MediaItem(mtype, resolve(path, root), slot, fps, None if rate is None else float(rate), origin=field)


def _media_list(reader: FieldReader, value: Any, field: str, root: Path, *, is_input: bool) -> tuple[MediaItem, ...]:
    if not isinstance(value, list):
        raise reader.error(field, f"expected an array of media objects, found {kind(value)}")
    if not is_input and not value:
        raise reader.error(field, "an output needs at least one media object")
    return tuple(parse_v2_media(reader, m, join(field, i), root, is_input=is_input) for i, m in enumerate(value))


def _candidate(reader: FieldReader, value: Any, field: str, root: Path) -> tuple[MediaItem, ...]:
    reader.obj(value, field, {"media"}, {"media"})
    return _media_list(reader, value["media"], join(field, "media"), root, is_input=False)


def parse_v2_record(obj: Any, path: Path, line: int, root: Path) -> Record:
    """Validate one decoded V2 JSON object and return it normalised, paths resolved against ``root``.

    Args:
        obj: the decoded JSON value of one line.
        path: the file it came from.
        line: its 1-based line.
        root: the source's ``dataset_dir``; relative paths resolve against it, absolute paths are kept.
    """
    reader = FieldReader(path, line)
    if not isinstance(obj, dict):
        raise reader.error(None, f"expected a JSON object (a V2 record), found {kind(obj)}")
    if "schema_version" not in obj:
        raise reader.error("schema_version", "required key is missing: training records must be strict V2 records")
    version = obj["schema_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version != 2:
        raise reader.error("schema_version", f"must be the integer 2, found {json.dumps(version)}")
    reader.obj(obj, "", V2_RECORD_KEYS, {"input", "supervision"})

    inp = reader.obj(obj["input"], "input", V2_INPUT_KEYS, {"prompt"})
    # An empty prompt is a valid string (Flow-Factory: ``prompt: str``); an adapter that needs one says so.
    prompt = reader.string(inp["prompt"], "input.prompt", allow_empty=True)
    negative = inp.get("negative_prompt")
    if negative is not None:
        negative = reader.string(negative, "input.negative_prompt", allow_empty=True)
    inputs = _media_list(reader, inp.get("media", []), "input.media", root, is_input=True)

    sup = obj["supervision"]
    if not isinstance(sup, dict):
        raise reader.error("supervision", f"expected a JSON object, found {kind(sup)}")
    sup_type = sup.get("type")
    if sup_type == "demonstration":
        reader.obj(sup, "supervision", {"type", "target"}, {"target"})
        candidates = (_candidate(reader, sup["target"], "supervision.target", root),)
    elif sup_type == "preference":
        reader.obj(sup, "supervision", {"type", "chosen", "rejected"}, {"chosen", "rejected"})
        candidates = (
            _candidate(reader, sup["chosen"], "supervision.chosen", root),
            _candidate(reader, sup["rejected"], "supervision.rejected", root),
        )
    elif "type" not in sup:
        raise reader.error("supervision.type", "required key is missing ('demonstration' or 'preference')")
    else:
        raise reader.error("supervision.type", f"must be 'demonstration' or 'preference', found {json.dumps(sup_type)}")

    # Spec: "metadata # optional JSON provenance; never a model input" - any content, but a finite JSON object.
    metadata = obj.get("metadata", {})
    if not isinstance(metadata, dict):
        raise reader.error("metadata", f"expected a JSON object, found {kind(metadata)}")
    reader.finite_json(metadata, "metadata")
    return Record(path, line, prompt, negative, inputs, sup_type, candidates, metadata, schema="v2")
