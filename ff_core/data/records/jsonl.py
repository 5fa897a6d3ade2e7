"""Dataset rows and records: reading split files into validated, normalised :class:`Record` s.

Spec: dataset-guide, "Offline V2 records" (strict, supervised, ``schema_version: 2``; see
:mod:`ff_core.data.records.v2`) and "Common task formats" (legacy prompt / condition rows used for generation
and evaluation; see :mod:`ff_core.data.records.legacy`). Parsing is strict where Flow-Factory is strict (V2 records:
unknown keys, wrong types, blank lines) and forgiving where it is forgiving (legacy rows: extra columns are
reward metadata, blank lines are skipped); every error names the file, the 1-based line and the field, and a
whole file is checked and every problem reported together.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ff_core.data.records.base import (
    Record,
    Supervision,
)
from ff_core.errors import DatasetError, DatasetErrors, raise_collected

Parser = Callable[[Any, Path, int], Record]


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads silently keeps the last of two equal keys; a duplicate is almost always an editing mistake.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def parse_json_line(text: str, path: Path, line: int) -> Any:
    """Decode one JSONL line; invalid JSON and duplicate keys raise a DatasetError with the line."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as exc:
        raise DatasetError(path, line, str(exc), "duplicate key in one JSON object") from None
    except json.JSONDecodeError as exc:
        raise DatasetError(path, line, None, f"invalid JSON: {exc.msg} at column {exc.colno}") from None


def read_jsonl(path: Path, parse: Parser, *, skip_blank: bool = False) -> list[Record]:
    """Parse every line of a JSONL file with ``parse``; collect every error and raise them together.

    Args:
        path: the file.
        parse: turns one decoded line into a Record (raising DatasetError).
        skip_blank: skip blank lines (legacy rows) instead of reporting them (strict V2 manifests).
    """
    records, errors = scan_jsonl(path, parse, skip_blank=skip_blank)
    raise_collected(errors)
    return records


def scan_jsonl(path: Path, parse: Parser, *, skip_blank: bool = False) -> tuple[list[Record], list[DatasetError]]:
    """Like :func:`read_jsonl`, but return the rows that parsed and the errors of the others.

    A blank line is an error unless ``skip_blank``; line numbers always count it. An empty file and invalid JSON
    are errors with their line.
    """
    records: list[Record] = []
    errors: list[DatasetError] = []
    for line_no, text in enumerate(_lines(path), start=1):
        if not text.strip():
            # Flow-Factory's strict V2 manifest loader refuses a blank line; its legacy loader (HF datasets'
            # JSON builder on pyarrow's line-delimited reader) skips blank and whitespace-only lines.
            if not skip_blank:
                errors.append(DatasetError(path, line_no, None, "blank line (every line must hold one JSON object)"))
            continue
        try:
            records.append(parse(parse_json_line(text, path, line_no), path, line_no))
        except DatasetError as exc:
            errors.append(exc)
    return records, errors


def read_prompts_txt(path: Path) -> list[Record]:
    """One prompt per line, surrounding whitespace stripped; blank lines are skipped, as Flow-Factory does
    (``[line.strip() for line in f if line.strip()]``), but still counted, so every record keeps its file line."""
    return [Record(path, i, text.strip()) for i, text in enumerate(_lines(path), start=1) if text.strip()]


def supervision_errors(records: list[Record], wanted: Supervision | None = None) -> list[DatasetError]:
    """A training source is homogeneous (spec: "Preference supervision").

    Args:
        records: the rows of one source.
        wanted: the supervision the trainer consumes; ``None``: every row must match the first one.
    """
    if not records:
        return []
    expected = wanted or records[0].supervision
    why = "this trainer needs" if wanted else f"mixed supervision: line {records[0].line} has"
    return [
        DatasetError(r.source, r.line, "supervision.type", f"{why} {expected!r} records, found {r.supervision!r}")
        for r in records
        if r.supervision != expected
    ]


def _lines(path: Path) -> list[str]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DatasetError(path, None, None, f"cannot read: {exc.strerror}") from None
    try:
        text = data.decode("utf-8-sig")  # tolerate a byte-order mark
    except UnicodeDecodeError:
        raise DatasetErrors(_undecodable_lines(path, data)) from None
    if not text.strip():
        raise DatasetErrors([DatasetError(path, 1, None, "file is empty (expected one row per line)")])
    # Split on "\n" only: str.splitlines would also break inside JSON strings holding U+2028 and friends.
    lines = [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]
    return lines[:-1] if lines[-1] == "" else lines


def _undecodable_lines(path: Path, data: bytes) -> list[DatasetError]:
    """One error per line of ``data`` that is not UTF-8, naming the line and the byte within it (a manifest saved
    as Latin-1 or cp1252 by an editor has one such byte in a few lines, not a broken file)."""
    errors = []
    for line_no, raw in enumerate(data.removeprefix(b"\xef\xbb\xbf").split(b"\n"), start=1):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            why = f"not UTF-8 text: {exc.reason} (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
            errors.append(DatasetError(path, line_no, None, f"{why}; save the file as UTF-8"))
    return errors
