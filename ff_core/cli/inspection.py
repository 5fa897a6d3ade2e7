"""``ff data inspect``: what one split of a dataset holds, from its records and its media files' headers.

Per split: rows; the formats found (``txt`` prompts, ``legacy jsonl`` rows, ``v2 demonstration`` /
``v2 preference`` records; spec: "Common task formats", "Offline V2 records"); the ``metadata`` keys with the
number of rows carrying each; media references per role (``input``, ``references``, ``target``, ``chosen``,
``rejected``) and type, a video's separate Ref2VA ``audio_path`` counting as audio; and, over the distinct files
of each type, the ranges their headers give (image and frame sizes, durations, fps, sample rates, channels).
Headers are read with Pillow / PyAV (:func:`~ff_core.data.media.decode.probe_media`); no file is decoded in full.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ff_core.contracts import MediaType
from ff_core.data.media.decode import MediaHeader, probe_media
from ff_core.data.records import CANDIDATE_FIELDS, MediaItem, Record
from ff_core.errors import DatasetError

ROLES = ("input", "references", "target", "chosen", "rejected")
# Header fields summarised per media type, in print order.
HEADER_FIELDS: dict[MediaType, tuple[str, ...]] = {
    MediaType.IMAGE: ("width", "height"),
    MediaType.VIDEO: ("width", "height", "seconds", "fps"),
    MediaType.AUDIO: ("seconds", "sample_rate", "channels"),
}
_UNITS = {"seconds": " s", "fps": " fps", "sample_rate": " Hz", "channels": " channel"}


@dataclass
class FileStats:
    """Header ranges of the distinct files of one media type.

    Attributes:
        files: number of distinct files read.
        ranges: ``[min, max]`` of each header field that at least one file gave (``HEADER_FIELDS``).
    """

    files: int = 0
    ranges: dict[str, list[float]] = field(default_factory=dict)

    def add(self, header: MediaHeader) -> None:
        self.files += 1
        for name in HEADER_FIELDS[header.type]:
            value = getattr(header, name)
            if value is None:
                continue  # e.g. a stream without a duration in its header
            low_high = self.ranges.setdefault(name, [value, value])
            low_high[0], low_high[1] = min(low_high[0], value), max(low_high[1], value)

    def format(self) -> str:
        parts = [f"{self.files} distinct file{'s' if self.files != 1 else ''}"]
        width, height = self.ranges.get("width"), self.ranges.get("height")
        if width and height:
            uniform = width[0] == width[1] and height[0] == height[1]
            parts.append(f"{width[0]}x{height[0]} px" if uniform else
                         f"width {_span(width)} px, height {_span(height)} px")
        parts += [f"{_span(self.ranges[n], n)}{_UNITS[n]}" for n in _UNITS if n in self.ranges]
        if self.ranges.get("channels", [0, 0])[1] > 1:
            parts[-1] += "s"  # "1..2 channels", "2 channels"
        return ", ".join(parts)


@dataclass
class SplitInspection:
    """What ``ff data inspect`` found in one split.

    Attributes:
        split: ``train`` or ``test``.
        file: the split file.
        rows: number of rows.
        formats: rows per format (``txt``, ``legacy jsonl``, ``v2 demonstration``, ``v2 preference``).
        metadata: rows carrying each top-level ``metadata`` key.
        media: references per role, then per media type.
        stats: header ranges per media type, over distinct files.
    """

    split: str
    file: Path
    rows: int = 0
    formats: Counter = field(default_factory=Counter)
    metadata: Counter = field(default_factory=Counter)
    media: dict[str, Counter] = field(default_factory=dict)
    stats: dict[MediaType, FileStats] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (``ff data inspect --json``); keys in a stable order."""
        return {
            "split": self.split,
            "file": str(self.file),
            "rows": self.rows,
            "formats": dict(sorted(self.formats.items())),
            "metadata": dict(sorted(self.metadata.items())),
            "media": {role: {t.value: c[t] for t in MediaType if c[t]} for role, c in self._roles()},
            "files": {t.value: {"count": s.files, **s.ranges} for t, s in self._stats()},
        }

    def format(self) -> list[str]:
        """The text report: a heading line, then indented details."""
        formats = ", ".join(f"{k} {v}" for k, v in sorted(self.formats.items()))
        metadata = ", ".join(f"{k} {v}" for k, v in sorted(self.metadata.items())) or "none"
        media = "; ".join(
            f"{role} " + ", ".join(f"{t.value} {c[t]}" for t in MediaType if c[t]) for role, c in self._roles()
        ) or "none"
        lines = [f"{self.file.name}: {self.rows} row{'s' if self.rows != 1 else ''}; formats: {formats}",
                 f"  metadata: {metadata}", f"  media: {media}"]
        return lines + [f"  {t.value}: {s.format()}" for t, s in self._stats()]

    def _roles(self) -> list[tuple[str, Counter]]:
        return [(role, self.media[role]) for role in ROLES if role in self.media]

    def _stats(self) -> list[tuple[MediaType, FileStats]]:
        return [(t, self.stats[t]) for t in MediaType if t in self.stats]


def inspect_split(split: str, file: Path, records: list[Record]) -> tuple[SplitInspection, list[DatasetError]]:
    """Count one split's rows, formats, metadata and media, and read every distinct media file's header once.

    Args:
        split: ``train`` or ``test``.
        file: the split file the records came from.
        records: its records (:func:`~ff_core.data.records.sources.load_split`).

    Returns:
        the summary, and one error per reference to a file that is missing or whose header cannot be read
        (``path:line: field: file: reason``, as ``ff data validate`` reports them).
    """
    found = SplitInspection(split, file, rows=len(records))
    headers: dict[tuple[Path, MediaType], MediaHeader] = {}
    errors: list[DatasetError] = []
    for record in records:
        found.formats[record_format(record)] += 1
        found.metadata.update(record.metadata.keys())
        for role, item in _items_by_role(record):
            for path, mtype, key in _files(item):
                found.media.setdefault(role, Counter())[mtype] += 1
                if (path, mtype) in headers:
                    continue  # each distinct file is read and counted once
                try:
                    headers[path, mtype] = probe_media(path, mtype, referenced_by=record.where,
                                                       field=item.field_of(key) or key)
                except DatasetError as exc:
                    errors.append(exc)
                    continue
                found.stats.setdefault(mtype, FileStats()).add(headers[path, mtype])
    return found, errors


def record_format(record: Record) -> str:
    """``v2 <supervision>`` for a strict V2 record, else ``txt`` or ``legacy jsonl`` by the row's file."""
    if record.schema == "v2":
        return f"v2 {record.supervision}"
    return "txt" if record.source.suffix == ".txt" else "legacy jsonl"


def _items_by_role(record: Record) -> list[tuple[str, MediaItem]]:
    out = [("input", m) for m in record.inputs] + [("references", m) for m in record.references]
    for name, candidate in zip(CANDIDATE_FIELDS.get(record.supervision or "", ()), record.candidates):
        out += [(name.rpartition(".")[2], m) for m in candidate]  # supervision.chosen -> chosen
    return out


def _files(item: MediaItem) -> list[tuple[Path, MediaType, str]]:
    """The item's file, then a Ref2VA video's separate soundtrack (read as audio)."""
    out = [(item.path, item.type, "path")]
    if item.audio_path is not None:
        out.append((item.audio_path, MediaType.AUDIO, "audio_path"))
    return out


def _span(low_high: list[float], name: str = "") -> str:
    low, high = (f"{v:.2f}" if name == "seconds" else f"{v:g}" for v in low_high)
    return low if low == high else f"{low}..{high}"
