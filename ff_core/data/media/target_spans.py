"""Training targets too short for what the adapter cuts from them, found from their headers before weights load.

An adapter that says what each output's targets must cover (:meth:`~ff_core.adapter.Adapter.resolve_output_geometry`:
a video clip's :class:`~ff_core.data.media.geometry.MediaGeometry`, an audio
:class:`~ff_core.data.media.geometry.AudioSpan`) has every training target's header read (``probe_media``: PyAV
container metadata, no frame or sample decoded) at ``ff fit``'s set-up and in ``ff data validate --model``; a target
that falls short is reported there, naming file, line and field, instead of failing the run when its batch is decoded.
Decoding keeps its own checks (a header may lie). The headers are cached across runs
(:mod:`~ff_core.data.media.header_cache`): a later start reads only the files that changed, one ``stat`` for each of the
others.

* video: the clip's whole frame grid must lie inside the file (:func:`~ff_core.data.media.buckets.fits`, the rule
  :func:`~ff_core.data.media.decode.decode_clip` applies);
* audio: ``start + seconds - tolerance`` on the target's clock: the header's duration, played at the manifest's
  ``sample_rate`` when it declares one (``seconds * file rate / declared rate``). Audio shorter than ``seconds`` but
  within the tolerance (LTX-2's default: any shortfall, ``math.inf``, right-padded with silence as Flow-Factory does)
  is a :class:`~ff_core.errors.DatasetNote` in ``ff data validate``, not an error (:func:`target_span_problems`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ff_core.contracts import AudioSpan, MediaGeometry, MediaType
from ff_core.data.media.buckets import fits
from ff_core.data.media.decode import MediaHeader
from ff_core.data.media.header_cache import HEADER_CACHE_FOLDER, HeaderCache
from ff_core.data.records import Record
from ff_core.data.records.base import CANDIDATE_FIELDS
from ff_core.errors import DatasetError, DatasetNote

_EPS = 1e-6  # header durations are rationals printed as floats


def target_span_errors(
    records: Sequence[Record],
    geometry: Sequence[MediaGeometry | AudioSpan | None],
    *,
    skip_first: bool = False,
    cache_dir: str | os.PathLike | None = None,
) -> list[DatasetError]:
    """One error per training target (every candidate's every output) its output's entry of ``geometry`` rejects
    (:func:`target_span_problems`' errors; ``ff fit``'s set-up)."""
    return target_span_problems(records, geometry, skip_first=skip_first, cache_dir=cache_dir)[0]


def target_span_problems(
    records: Sequence[Record],
    geometry: Sequence[MediaGeometry | AudioSpan | None],
    *,
    skip_first: bool = False,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[list[DatasetError], list[DatasetNote]]:
    """Per training target (every candidate's every output), an error when its output's entry of ``geometry``
    rejects it, a note when the adapter accepts it but pads it (audio shorter than the span, within its tolerance).

    Args:
        records: the records (those without candidates, prompts, are skipped).
        geometry: per output of the contract, what its targets must cover (``None``: not checked).
        skip_first: leave the first output alone (``data.buckets`` assigns it a geometry of its own, checked by
            :func:`~ff_core.data.media.buckets.assign_buckets`).
        cache_dir: ff's cache folder (the condition cache's): the headers are cached in its ``headers/``
            (:class:`~ff_core.data.media.header_cache.HeaderCache`); ``None``: every header read from its file.
    """
    headers = HeaderCache(None if cache_dir is None else Path(cache_dir).expanduser() / HEADER_CACHE_FOLDER)
    checks = []
    for record in records:
        for name, candidate in zip(CANDIDATE_FIELDS.get(record.supervision or "", ()), record.candidates):
            for index, (item, spec) in enumerate(zip(candidate, geometry)):
                if spec is not None and not (skip_first and index == 0):
                    field = item.field_of("path") if item.origin else f"{name}.media[{index}].path"
                    checks.append((record, item, spec, field))

    def check(task: tuple) -> list[DatasetError]:
        record, item, spec, field = task
        try:
            problem = _shortfall(headers, item.path, item.type, spec, item.fps, item.sample_rate, record, field)
        except DatasetError as exc:
            return exc.errors
        if problem is None:
            return []
        kind = DatasetNote if isinstance(problem, _Padded) else DatasetError
        return [kind(record.source, record.line, field, f"{item.path}: {problem}")]

    # Opening a container is I/O and C code that releases the GIL (a WAV: ~4 ms, most of it ffmpeg's stream probe):
    # threads overlap them; results stay in record order.
    with ThreadPoolExecutor(max_workers=max(1, min(16, os.cpu_count() or 1))) as pool:
        found = [problem for problems in pool.map(check, checks) for problem in problems]
    headers.save()
    return ([p for p in found if not isinstance(p, DatasetNote)],
            [p for p in found if isinstance(p, DatasetNote)])  # fmt: skip


class _Padded(str):
    """A shortfall the adapter accepts and pads: a note, not an error."""


def _shortfall(headers: HeaderCache, path, mtype: MediaType, spec: MediaGeometry | AudioSpan, fps: float | None,
               sample_rate: float | None, record: Record, field: str | None) -> str | None:  # fmt: skip
    """Why a target of this type falls short of ``spec`` (``None``: it does not, or its header does not say); a
    :class:`_Padded` reason when the adapter accepts it and pads it with silence."""
    if isinstance(spec, MediaGeometry):
        if mtype is not MediaType.VIDEO or not spec.is_clip:
            return None
        header = headers.probe(path, mtype, record, field)
        if header.seconds is None or not header.fps or fits(header, spec, fps):
            return None
        clock = fps or header.fps
        rate = f"{spec.fps:g} fps" if spec.fps is not None else "the clip's rate"
        return (f"video too short: {spec.num_frames} frames at {rate} from {spec.start:g} s, but the file holds "
                f"{header.seconds * header.fps / clock:.3f} s at {clock:g} fps (its header); clips are never "
                "stretched: drop the record, or lower the adapter's num_frames / raise its frame rate")
    if mtype is not MediaType.AUDIO:
        return None
    header = headers.probe(path, mtype, record, field)
    seconds = _clock_seconds(header, sample_rate)
    if seconds is None:
        return None
    declared = sample_rate and header.sample_rate and sample_rate != header.sample_rate
    clock = f" played at its declared {sample_rate:g} Hz (file: {header.sample_rate} Hz)" if declared else ""
    have = max(seconds - spec.start, 0.0)
    if seconds - spec.start >= spec.seconds - spec.tolerance - _EPS:
        # Short by under a millisecond: the header's or the sample count's rounding, not worth a note.
        if seconds - spec.start >= spec.seconds - 1e-3:
            return None
        return _Padded(f"audio shorter than the clip: it holds {have:.3f} s{clock} from {spec.start:g} s, the clip "
                       f"needs {spec.seconds:.3f} s; the adapter right-pads it with {spec.seconds - have:.3f} s of "
                       "silence (its header)")  # fmt: skip
    return (f"audio too short: it holds {have:.3f} s{clock} from {spec.start:g} s, the "
            f"clip needs {spec.seconds:.3f} s (at most {spec.tolerance:g} s less; its header); audio is never "
            "stretched: drop the record, or shorten the adapter's clip (num_frames / frame_rate)")


def _clock_seconds(header: MediaHeader, declared_rate: float | None) -> float | None:
    """The header's duration on the target's clock: a declared rate plays the file's samples at that rate."""
    if header.seconds is None:
        return None
    if declared_rate and header.sample_rate:
        return header.seconds * header.sample_rate / declared_rate
    return header.seconds
