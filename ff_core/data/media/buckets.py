"""Geometry buckets for mixed resolutions and durations: each training record is assigned, from its target's header
alone (``probe_media``: width, height, duration, frame rate; nothing decoded; cached across runs,
:mod:`~ff_core.data.media.header_cache`), to one of a recipe's bucket
geometries, and its target is then decoded and fitted to that bucket (:class:`~ff_core.data.samples.
RecordProcessor`). Batches are drawn per bucket (:class:`~ff_core.data.dataflow.BucketBatcher`), so no batch mixes
shapes and no token is padded.

Assignment rule (deterministic, per record): among the buckets the target can fill — an image always; a video when
the bucket's whole frame grid lies inside the clip (:func:`~ff_core.data.media.decode.clip_source_frames`, the same rule
decoding applies, so an assigned clip is never rejected as too short) — take the one whose aspect ratio is closest
to the target's (``|log(w/h) - log(W/H)|``: the least cropped), then the longest clip (most frames), then the largest
area, then the first listed. A record no bucket can take is an error naming its file and line, before any weight
loads.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ff_core.contracts import MediaGeometry, MediaType
from ff_core.data.media.decode import MediaHeader, clip_source_frames
from ff_core.data.media.header_cache import HEADER_CACHE_FOLDER, HeaderCache
from ff_core.data.records import Record
from ff_core.errors import DatasetError, raise_collected


@dataclass(frozen=True)
class Bucket:
    """One bucket of a recipe (``data.buckets`` entry).

    Attributes:
        geometry: the geometry its targets are fitted to (its first output's; later outputs keep the adapter's).
        batch_size: samples per batch (``None``: from ``data.max_tokens`` and the adapter's token count, else
            ``data.per_device_batch_size``).
    """

    geometry: MediaGeometry
    batch_size: int | None = None
    frame_rule_given: bool = False

    def adopt_frame_rule(self, rule: str) -> Bucket:
        """This bucket with the adapter's frame rule (MiniMax H3: ffmpeg's ``fps`` filter), unless its entry named
        its own ``frame_rule``: a bucket changes the clip's size, never how its frames are picked."""
        if self.frame_rule_given or self.geometry.frame_rule == rule:
            return self
        return dataclasses.replace(self, geometry=dataclasses.replace(self.geometry, frame_rule=rule))

    @classmethod
    def from_config(cls, entry: dict, key: str) -> Bucket:
        """A ``data.buckets`` entry: ``{height, width, num_frames?, fps?, start?, frame_rule?, batch_size?}``."""
        if not isinstance(entry, dict):
            raise ValueError(f"{key}: expected a mapping {{height, width, num_frames?, fps?, batch_size?}}")
        fields = dict(entry)
        batch_size = fields.pop("batch_size", None)
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ValueError(f"{key}.batch_size must be an integer >= 1, got {batch_size!r}")
        try:
            return cls(MediaGeometry(**fields), batch_size, "frame_rule" in fields)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{key}: {exc}") from None


def fits(header: MediaHeader, geometry: MediaGeometry, declared_fps: float | None) -> bool:
    """Whether a target with this header can fill ``geometry`` (a video: the whole frame grid inside the clip)."""
    if header.type is not MediaType.VIDEO or not geometry.is_clip:
        return True
    clock = declared_fps or header.fps
    if not clock or header.seconds is None or not header.fps:
        return False
    frames = round(header.seconds * header.fps)  # the header's duration on the file's own clock
    last = clip_source_frames(geometry.num_frames, geometry.fps, geometry.start, clock, geometry.frame_rule)[-1]
    return last < frames


def choose_bucket(header: MediaHeader, geometries: Sequence[MediaGeometry], declared_fps: float | None) -> int | None:
    """The bucket a target goes to (module docstring's rule), or ``None`` when it fits none."""
    aspect = math.log(header.width / header.height) if header.width and header.height else 0.0
    candidates = [i for i, g in enumerate(geometries) if fits(header, g, declared_fps)]
    if not candidates:
        return None

    def rank(i: int) -> tuple[float, int, int, int]:
        g = geometries[i]
        return (round(abs(aspect - math.log(g.width / g.height)), 9), -(g.num_frames or 0), -g.height * g.width, i)

    return min(candidates, key=rank)


def assign_buckets(records: Sequence[Record], geometries: Sequence[MediaGeometry],
                   cache_dir: str | os.PathLike | None = None) -> list[int]:  # fmt: skip
    """Each record's bucket, from its first candidate's first target header; every record that fits no bucket is
    reported (``DatasetErrors``) before training starts.

    Args:
        records: the training records (demonstrations or preference pairs: both arms must fit the same bucket).
        geometries: the buckets' geometries.
        cache_dir: ff's cache folder: the headers are cached in its ``headers/`` across runs
            (:class:`~ff_core.data.media.header_cache.HeaderCache`); ``None``: every header read from its file.
    """
    headers = HeaderCache(None if cache_dir is None else Path(cache_dir).expanduser() / HEADER_CACHE_FOLDER)
    out, errors = [], []
    for record in records:
        choices = set()
        for candidate in record.candidates or ((),):
            if not candidate:
                choices.add(0)
                continue
            item = candidate[0]
            header = headers.probe(item.path, item.type, record, item.field_of("path"))
            choices.add(choose_bucket(header, geometries, item.fps))
        if None in choices or len(choices) > 1:
            what = ("fits no bucket" if None in choices else "has candidates in different buckets "
                    f"({sorted(choices)}): a preference pair must share one")
            item = record.candidates[0][0]
            errors.append(DatasetError(record.source, record.line, item.field_of("path"),
                                       f"{item.path}: {what} (buckets: {_describe(geometries)}); a clip shorter than "
                                       "every bucket's frame grid is never stretched: drop it or add a shorter bucket"))
            out.append(-1)
            continue
        out.append(choices.pop())
    headers.save()
    raise_collected(errors)
    return out


def _describe(geometries: Sequence[MediaGeometry]) -> str:
    def one(g: MediaGeometry) -> str:
        clip = f"x{g.num_frames}f" + (f"@{g.fps:g}fps" if g.fps else "") if g.is_clip else ""
        return f"{g.width}x{g.height}{clip}"

    return ", ".join(one(g) for g in geometries)
