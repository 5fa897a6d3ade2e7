"""Content digests of condition-cache parts: a SHA-256 per record batch, checked before Arrow parses the bytes.

A part (an Arrow IPC file, :mod:`ff_core.data.cache.table`) is cut into contiguous blocks at the writer's record
batch boundaries: block 0 is the file header, the schema and record batch 0; block ``k`` is record batch ``k`` (its
metadata message and body); the last block is the footer. The manifest lists each block as ``[end offset, sha256]``
(:func:`block_digests`). A reader checks the footer block and block 0 when it opens a part (so ``pa.ipc.open_file``
never parses flipped bytes: before this check 8 flipped footer bytes gave a segfault or an ``ArrowInvalid``) and
each further block the first time it reads a row of it, in every process (a loader worker checks the blocks it
reads). A warm start therefore hashes one record batch per part, not the whole cache: a full check at every open
would cost about as much as building a cache of large text embeddings (docs/datasets.md, "Condition cache").

A mismatch raises :class:`CacheCorruptError` (one line naming the part, the block's rows and byte range) and leaves
a ``corrupt.json`` note in the cache folder, so the next start rebuilds the cache, loudly, instead of reading it
again (:mod:`ff_core.data.cache.store`).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from ff_core.atomic import write_bytes_atomic
from ff_core.errors import DatasetError

DIGEST = "sha256-per-record-batch"
CORRUPT = "corrupt.json"


class CacheCorruptError(DatasetError):
    """A condition-cache part whose bytes no longer match the manifest's digests. ``str(err)`` is ``path: reason``.

    Args:
        path: the part file (or the cache folder).
        reason: what did not match, and what ff did about it.
    """

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        super().__init__(path, None, None, reason)

    def __reduce__(self):  # pickling (loader workers) with the 2-argument constructor
        return (CacheCorruptError, (self.path, self.reason))


def block_digests(path: Path, batch_ends: list[int]) -> list[list[Any]]:
    """``[[end, sha256 hex], ...]`` of the blocks of ``path`` that end at ``batch_ends`` (the writer's offsets after
    each record batch), then the footer block, which ends at the file's size.

    Args:
        path: a finished part.
        batch_ends: the file offset after each record batch, in order.
    """
    size = path.stat().st_size
    ends = [*batch_ends, size]
    if ends != sorted(ends) or len(set(ends)) != len(ends):
        raise ValueError(f"{path}: record batch offsets {batch_ends} do not cut a file of {size} bytes into blocks")
    out, start = [], 0
    with open(path, "rb") as f:
        for end in ends:
            digest = hashlib.sha256()
            remaining = end - start
            while remaining:
                chunk = f.read(min(remaining, 16 << 20))
                if not chunk:
                    raise OSError(f"{path}: shorter than its record batches ({start + end - remaining} bytes)")
                digest.update(chunk)
                remaining -= len(chunk)
            out.append([end, digest.hexdigest()])
            start = end
    return out


def block_range(blocks: list[list[Any]], index: int) -> tuple[int, int]:
    """The byte range ``[start, end)`` of block ``index`` (``-1``: the footer)."""
    index %= len(blocks)
    return (blocks[index - 1][0] if index else 0), blocks[index][0]


def check_block(data: memoryview | bytes, blocks: list[list[Any]], index: int, path: Path, rows: str) -> int:
    """Check block ``index`` of a part's bytes ``data`` against its digest; return its size.

    Raises:
        CacheCorruptError: the bytes differ (a ``corrupt.json`` note is left in the part's folder first).

    Args:
        data: the whole part (its memory map).
        blocks: the part's ``[end, sha256]`` list from the manifest.
        index: the block (record batch number; ``-1``: the footer).
        path: the part (messages, and where the note goes).
        rows: which rows the block holds, for the message (``rows 32-63``, ``the footer``).
    """
    start, end = block_range(blocks, index)
    expected = blocks[index][1]
    found = hashlib.sha256(data[start:end]).hexdigest() if end <= len(data) else "(file too short)"
    if found != expected:
        reason = (f"{rows} (bytes {start}-{end}) do not match the cache manifest's sha256 (expected "
                  f"{expected[:16]}…, found {found[:16]}…): the file changed on disk after it was written")  # fmt: skip
        mark_corrupt(path.parent, {"file": path.name, "block": index % len(blocks), "bytes": [start, end],
                                   "expected": expected, "found": found})  # fmt: skip
        raise CacheCorruptError(path, f"{reason}; the next start rebuilds this condition cache")
    return end - start


def mark_corrupt(folder: Path, record: dict[str, Any]) -> None:
    """Leave ``corrupt.json`` in a cache folder (best effort: a read-only folder keeps none, and the open-time
    checks then find the damage again only when it lies in a block they check)."""
    note = {**record, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
    try:
        write_bytes_atomic(folder / CORRUPT, json.dumps(note, indent=1).encode())
    except OSError:
        pass


def read_mark(folder: Path) -> dict[str, Any] | None:
    """The ``corrupt.json`` note of a cache folder, or ``None``."""
    try:
        note = json.loads((folder / CORRUPT).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"file": CORRUPT, "reason": "unreadable note"}
    return note if isinstance(note, dict) else {"file": CORRUPT, "reason": "unreadable note"}
