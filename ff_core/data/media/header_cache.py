"""Media headers kept across runs, so that a later ``ff fit`` start costs one ``stat`` per training target.

``ff fit`` reads every training target's header at each start (:mod:`ff_core.data.media.target_spans`: a PyAV container
probe, ~1.3 ms a file, some 4 minutes for 100k pairs). :class:`HeaderCache` keeps what
:func:`~ff_core.data.media.decode.probe_media` returned, keyed by ``(media type, resolved path)`` and valid while the
file's ``(size, mtime_ns, inode, ctime_ns)`` are the ones it had when probed; a file that changed is probed again (the
inode and ctime catch a same-size replacement whose mtime was kept, e.g. ``cp -p`` or ``rsync -a``: ``utime`` cannot
set ctime). One JSON file per record source (a split's manifest) in ``<cache dir>/headers/``, the cache dir being the
condition cache's (``data.cache_dir``, else ``$FF_CACHE_DIR``, else ``~/.cache/ff/datasets``), written atomically
(:func:`~ff_core.atomic.write_bytes_atomic`) and only when an entry was added. A file from another cache version or
PyAV version, damaged, or unwritable is ignored: no cache is only slower. Headers that cannot be read are never
cached: their error is raised again at every start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import asdict
from pathlib import Path

import av

from ff_core.atomic import write_bytes_atomic
from ff_core.contracts import MediaType
from ff_core.data.media.decode import MediaHeader, probe_media
from ff_core.data.records.base import Record

log = logging.getLogger(__name__)

HEADER_CACHE_VERSION = 2  # bump when the entries or media.probe_media's fields change
"""Bumped when what a header holds, or how it is read, changes: older cache files are then ignored."""
HEADER_CACHE_FOLDER = "headers"
"""The sub-folder of the cache dir holding the header caches."""


class HeaderCache:
    """:func:`~ff_core.data.media.decode.probe_media` with the results kept on disk (module docstring); thread-safe.

    Args:
        folder: where the cache files live (``<cache dir>/headers``); ``None``: nothing cached, every header probed.
    """

    def __init__(self, folder: str | os.PathLike | None) -> None:
        self.folder = Path(folder).expanduser() if folder is not None else None
        self.hits = 0
        """Headers answered from the cache."""
        self.probes = 0
        """Headers read from their files (or tried: an unreadable one counts, and is not cached)."""
        self._tables: dict[Path, dict[str, list]] = {}  # per source: key -> [file identity, header fields]
        self._dirty: set[Path] = set()
        self._lock = threading.Lock()

    def probe(self, path: str | os.PathLike, mtype: MediaType, record: Record, field: str | None) -> MediaHeader:
        """``path``'s header, as :func:`~ff_core.data.media.decode.probe_media` reads it (the same errors, naming the
        ``record`` and ``field`` that referenced it), from the cache while the file's size and mtime are unchanged."""
        if self.folder is None:
            return self._probe(path, mtype, record, field)
        real = os.path.realpath(path)
        try:
            stat = os.stat(real)
        except OSError:  # missing or unreadable: probe_media says so, naming the record
            return self._probe(path, mtype, record, field)
        key = f"{mtype.value}:{real}"
        table = self._table(record.source)
        cached = _cached_header(table.get(key), mtype, stat)
        if cached is not None:
            with self._lock:
                self.hits += 1
            return cached
        header = self._probe(path, mtype, record, field)
        fields = {k: v for k, v in asdict(header).items() if k != "type"}
        with self._lock:
            table[key] = [_identity(stat), fields]
            self._dirty.add(Path(record.source))
        return header

    def save(self) -> None:
        """Write the tables that gained entries, each atomically; an unwritable folder only costs the next start."""
        for source in sorted(self._dirty):
            payload = {"version": HEADER_CACHE_VERSION, "av": av.__version__, "source": os.path.realpath(source),
                       "entries": self._tables[source]}  # fmt: skip
            try:
                write_bytes_atomic(self._file(source), json.dumps(payload).encode())
            except OSError as exc:
                log.warning("media header cache not written (%s): the next start reads the headers again", exc)
        self._dirty.clear()

    def _probe(self, path, mtype: MediaType, record: Record, field: str | None) -> MediaHeader:
        with self._lock:
            self.probes += 1
        return probe_media(path, mtype, referenced_by=record.where, field=field)

    def _table(self, source: str | os.PathLike) -> dict[str, list]:
        source = Path(source)
        table = self._tables.get(source)
        if table is None:
            with self._lock:
                table = self._tables.get(source)
                if table is None:
                    table = self._tables[source] = self._load(source)
        return table

    def _file(self, source: Path) -> Path:
        """``<folder>/<manifest name>-<hash of its resolved path>.json``."""
        digest = hashlib.sha256(os.path.realpath(source).encode()).hexdigest()[:16]
        return self.folder / f"{source.name}-{digest}.json"

    def _load(self, source: Path) -> dict[str, list]:
        try:
            data = json.loads(self._file(source).read_text())
            if (data.get("version"), data.get("av"), data.get("source")) != (HEADER_CACHE_VERSION, av.__version__,
                                                                             os.path.realpath(source)):  # fmt: skip
                return {}
            entries = data["entries"]
            return entries if isinstance(entries, dict) else {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}  # absent, foreign or damaged: probe again


def _cached_header(entry: object, mtype: MediaType, stat: os.stat_result) -> MediaHeader | None:
    """The entry's header when it was taken from this very file (:func:`_identity`); ``None``: probe (stale,
    damaged)."""
    try:
        identity, fields = entry
        if identity == _identity(stat):
            return MediaHeader(mtype, **fields)
    except (TypeError, ValueError):
        pass
    return None


def _identity(stat: os.stat_result) -> list[int]:
    """What must be unchanged for a cached header to stand: size, mtime, inode and ctime (JSON-friendly)."""
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns]
