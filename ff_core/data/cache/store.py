"""The Arrow condition cache: identity, build (sharded over ranks), atomic publication, memory-mapped reads.

Spec dataset-guide, "Condition cache and target lifecycle" and "Preprocessing and cache flow": only the input side
is cached. ``adapter.preprocess`` runs under no_grad over a split's records, ``preprocessing_batch_size`` at a time
(1 for adapters whose contract takes one sample at a time), and its CPU tensors go to Arrow IPC files
(:mod:`ff_core.data.cache.table`) that every rank memory-maps. Target, chosen and rejected media, their latents and
supervision metadata are never written.

One cache holds one split of one dataset and lives in ``cache_dir/<key>/``, where ``key`` is the SHA-256 of its
identity (:func:`cache_identity`): the dataset root and split, the split file's bytes, every row's condition id
(prompts and input media, each media file's SHA-256 streamed once per build), the adapter's name, class,
``preprocess_version`` and :meth:`~ff_core.adapter.Adapter.preprocess_identity` (model identity, dtype policy,
semantic preprocessing settings), and the input-projection contract (slots and their order, references, grouped
inputs, negative-prompt policy, batch capability). Nothing else enters it, so batch sizes, learning rates,
accumulation or world size reuse a cache.

Safety (docs/datasets.md, "Condition cache"): a cache is written into a hidden build folder and published by one
``rename`` once its ``manifest.json`` is written; a reader opens only a folder whose manifest matches its key and
files. A build killed midway leaves only a build folder, removed by the next builder on that host once its owner is
dead. Two builders of one key (ranks of different nodes, or two jobs) write different build folders; the first
rename wins and the other discards its copy, so no reader ever sees a mixed or partial cache.

Integrity (:mod:`ff_core.data.cache.digest`): the manifest holds a SHA-256 per record batch of each part. An open
checks each part's footer and first batch, a reader every other batch before its first row; damage found at open
is rebuilt with a loud warning, damage found while reading stops the run with one line and a ``corrupt.json`` note
(the next start rebuilds), and a rebuilt cache damaged again is refused. A full disk during a build is one line
(:class:`~ff_core.disk_full.DiskFullError`) and leaves no build folder.
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ff_core.atomic import replace_dir, write_bytes_atomic
from ff_core.contracts import PipelineIOContract
from ff_core.data.cache.digest import DIGEST, CacheCorruptError, check_block, read_mark
from ff_core.data.cache.group import BuildGroup
from ff_core.data.cache.identity import MediaDigests, file_sha256, input_identity
from ff_core.data.cache.table import ID_BYTES, CachedConditions, PartWriter
from ff_core.data.media.conditions import condition_input
from ff_core.data.records import Record
from ff_core.disk_full import disk_full_error, is_disk_full
from ff_core.errors import DatasetError

if TYPE_CHECKING:
    from ff_core.adapter import Adapter

log = logging.getLogger(__name__)

FORMAT = "ff-condition-cache/1"
MANIFEST = "manifest.json"
Parallelism = Literal["global", "local"]


@dataclass
class ConditionSource:
    """The records of one split of one dataset: what one cache holds.

    Attributes:
        name: the dataset's name (messages only; not part of the identity).
        split: ``train`` or ``test``.
        root: the dataset folder.
        file: the split file (``train.jsonl``, ``test.txt``, ...).
        records: its records, in data-module order.
    """

    name: str
    split: str
    root: Path
    file: Path
    records: list[Record]


@dataclass
class CacheResult:
    """What :func:`open_or_build` did: the rows, where they live and whether an existing cache was reused.

    Attributes:
        source: the records cached.
        conditions: the rows, a lazy memory-mapped sequence aligned with ``source.records``.
        path: the published cache folder.
        rows: number of rows.
        bytes: size of its files.
        reused: ``True`` when this call found the cache published and built nothing.
    """

    source: ConditionSource
    conditions: CachedConditions
    path: Path
    rows: int
    bytes: int
    reused: bool


class ConcatConditions(Sequence):
    """Several datasets' cached rows as one sequence, in data-module order (picklable: it holds only the parts).

    Args:
        parts: the per-dataset sequences.
    """

    def __init__(self, parts: Sequence[Sequence[dict[str, Any]]]) -> None:
        self.parts = list(parts)
        self._starts = [0]
        for part in self.parts:
            self._starts.append(self._starts[-1] + len(part))

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> dict[str, Any]:  # type: ignore[override]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"condition row {index} out of range ({len(self)} rows)")
        part = bisect.bisect_right(self._starts, index) - 1
        return self.parts[part][index - self._starts[part]]


def contract_identity(contract: PipelineIOContract) -> dict[str, Any]:
    """The input-projection half of an IO contract (spec: slot order, binding, aggregate rules, negative-prompt
    policy, batch capability). Outputs are left out: they never reach ``preprocess``."""
    fields = asdict(contract)
    fields.pop("outputs")
    return json.loads(json.dumps(fields, default=lambda v: sorted(v) if isinstance(v, frozenset) else str(v)))


def cache_identity(source: ConditionSource, adapter: Adapter, digests: MediaDigests) -> tuple[dict[str, Any], bytes]:
    """The identity of ``source``'s cache under ``adapter``, and its rows' condition ids (32 bytes each, in order).

    Args:
        source: the records to cache.
        adapter: the loaded adapter whose ``preprocess`` fills the cache.
        digests: the build's media digest memo (every input file streamed once).
    """
    ids = b"".join(bytes.fromhex(input_identity(r, digests)) for r in source.records)
    cls = type(adapter)
    identity = {
        "format": FORMAT,
        "dataset": {"root": str(source.root.resolve()), "split": source.split, "file": source.file.name,
                    "sha256": file_sha256(source.file)},
        "rows": {"count": len(source.records), "sha256": hashlib.sha256(ids).hexdigest()},
        "adapter": {"name": cls.name, "class": f"{cls.__module__}.{cls.__qualname__}",
                    "preprocess_version": cls.preprocess_version, **adapter.preprocess_identity()},
        "contract": contract_identity(adapter.io_contract),
    }  # fmt: skip
    return identity, ids


def identity_key(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_manifest(folder: Path, key: str, rows: int) -> dict[str, Any] | None:
    """The manifest of a published cache folder, or ``None`` when the folder is not a complete cache of ``key``
    (a cache written before parts had digests counts as incomplete: it is rebuilt once)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("format") != FORMAT or manifest.get("key") != key or manifest.get("rows") != rows:
        return None
    if manifest.get("digest") != DIGEST:
        return None
    for part in manifest.get("parts", []):
        try:
            if (folder / part["file"]).stat().st_size != part["bytes"] or part["blocks"][-1][0] != part["bytes"]:
                return None
        except (OSError, KeyError, TypeError, IndexError):
            return None
    return manifest


def inspect_cache(folder: Path, key: str, rows: int) -> tuple[str, dict[str, Any] | None]:
    """What an open finds in a cache folder: ``("ok", None)``, ``("missing", None)`` (absent or incomplete), or
    ``("corrupt", note)``: a reader left a ``corrupt.json`` note, or the blocks checked at every open (each part's
    footer and first record batch, :mod:`ff_core.data.cache.digest`) do not match. ``note["previous"]`` is the
    corruption this cache was itself rebuilt after, if any."""
    manifest = read_manifest(folder, key, rows)
    if manifest is None:
        return "missing", None
    note = read_mark(folder)
    if note is None:
        import mmap

        for part in manifest["parts"]:
            path = folder / part["file"]
            try:
                with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                    view = memoryview(data)
                    try:
                        for block, rows_text in ((-1, "the footer"), (0, "the header and first record batch")):
                            check_block(view, part["blocks"], block, path, rows_text)
                    finally:
                        view.release()
            except CacheCorruptError:
                note = read_mark(folder) or {"file": part["file"]}
                break
            except OSError as exc:
                note = {"file": part["file"], "reason": str(exc)}
                break
    if note is None:
        return "ok", None
    return "corrupt", {**note, "folder": str(folder), "previous": manifest.get("rebuilt_after_corruption")}


def _corruption(states: list[tuple[str, dict | None]], cache_dir: Path, loud: bool) -> dict[str, Any] | None:
    """The corruption any rank found (logged as a warning), or ``None``; a cache that was already rebuilt after a
    corruption and is corrupt again is refused: a disk that corrupts must not be masked by rebuilding forever."""
    note = next((n for state, n in states if state == "corrupt"), None)
    if note is None:
        return None
    where = Path(note["folder"]) / str(note.get("file", "?"))
    detail = f"bytes {note['bytes'][0]}-{note['bytes'][1]}" if "bytes" in note else note.get("reason", "content")
    previous = note.get("previous")
    if previous:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(previous.get("time", 0)))
        raise CacheCorruptError(where, f"{detail} do not match the manifest's sha256, and this cache was already "
                                f"rebuilt after {previous.get('file', '?')} was corrupt ({when} UTC): the disk under "
                                f"{cache_dir} may be failing; check it, then delete {note['folder']} (or set "
                                "data.force_reprocess: true) to rebuild")  # fmt: skip
    if loud:
        log.warning("CORRUPT CONDITION CACHE %s: %s do not match the manifest's sha256 (the file changed on disk "
                    "after it was written); rebuilding it. A second corruption of the rebuilt cache stops the run: "
                    "check the disk under %s", where, detail, cache_dir)  # fmt: skip
    return {k: v for k, v in note.items() if k != "previous"}


def open_or_build(
    source: ConditionSource,
    adapter: Adapter,
    *,
    cache_dir: str | os.PathLike,
    batch_size: int,
    force: bool = False,
    group: BuildGroup | None = None,
    parallelism: Parallelism = "local",
    progress: bool | None = None,
    preprocess: Callable[[list[Record]], list[dict[str, Any]]] | None = None,
    digests: MediaDigests | None = None,
) -> CacheResult:
    """Open ``source``'s cache, building and publishing it first when it is missing (or ``force``).

    A collective call: every rank of ``group`` calls it with the same arguments, in the same order.

    Args:
        source: the records to cache.
        adapter: the loaded adapter (its identity keys the cache; its ``preprocess`` fills it).
        cache_dir: the folder holding caches.
        batch_size: records per ``preprocess`` call.
        force: rebuild even when a complete cache exists (``data.force_reprocess``).
        group: the ranks that share the work (default: this process alone).
        parallelism: ``global``: every rank of the job preprocesses a contiguous shard into one build folder that
            global rank 0 publishes (the cache folder must be on a file system all nodes share). ``local``: the ranks
            of each node shard the work and its local rank 0 publishes, so each node builds its own copy (node-local
            disks; on a shared one the first node to publish wins and the others discard theirs).
        progress: show a progress bar on the publishing rank (``None``: only on a terminal).
        preprocess: records -> conditions (default: decode inputs and call ``adapter.preprocess`` under no_grad).
        digests: the build's media digest memo, shared with other uses of the same files (the resume identity);
            ``None``: a new one.
    """
    group = group or BuildGroup()
    cache_dir = Path(cache_dir).expanduser()
    digests = digests if digests is not None else MediaDigests()
    identity, ids = group.broadcast(cache_identity(source, adapter, digests) if group.rank == 0 else None)
    key, rows = identity_key(identity), len(source.records)
    final = cache_dir / key
    # Every rank reports what it sees, so all decide alike even when nodes see different disks.
    states = group.all_gather(("missing", None) if force else inspect_cache(final, key, rows))
    corrupt = _corruption(states, cache_dir, loud=group.rank == 0)
    node_needs = {group.node_of(r) for r, (state, _) in enumerate(states) if state != "ok"}
    if not node_needs:
        return _open(source, final, key, ids, reused=True)
    token = group.broadcast(f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}" if group.rank == 0 else None)
    if parallelism == "global":
        shard, shards, leader = group.rank, group.world_size, group.rank == 0
        build = cache_dir / f".{key}.build-{token}"
    elif parallelism == "local":
        shard, shards, leader = group.local_rank, group.local_world_size, group.local_rank == 0
        build = cache_dir / f".{key}.build-{token}-node{group.node_rank}"
    else:
        raise ValueError(f"data.preprocess_parallelism must be 'global' or 'local', got {parallelism!r}")
    building = parallelism == "global" or group.node_rank in node_needs

    def step(action: Callable[[], None]) -> None:
        """Run ``action`` (when this rank builds), then agree: if any rank failed, every rank raises. A full disk
        is a one-line :class:`~ff_core.disk_full.DiskFullError`; the build folder is removed either way."""
        error = None
        if building:
            try:
                action()
            except Exception as exc:  # reported to every rank, so none waits forever for the others
                if is_disk_full(exc):
                    exc = disk_full_error(exc, build, f"the condition cache {source.name}/{source.split}",
                                          f"the partial build {build.name}")  # fmt: skip
                error = (f"rank {group.rank}: {exc}" if isinstance(exc, DatasetError) else
                         f"rank {group.rank}: {type(exc).__name__}: {exc}", isinstance(exc, DatasetError))
                if group.world_size == 1:
                    shutil.rmtree(build, ignore_errors=True)
                    if isinstance(exc, DatasetError):
                        raise exc from None
                    raise
        errors = [e for e in group.all_gather(error) if e]
        if errors:
            if leader:
                shutil.rmtree(build, ignore_errors=True)
            text = f"condition cache {source.name}/{source.split}: build failed: {'; '.join(e[0] for e in errors)}"
            if all(user for _, user in errors):
                raise DatasetError(build, None, None, text)
            raise RuntimeError(text)

    started = time.monotonic()
    step(lambda: _start_build(cache_dir, build) if leader else None)
    lo, hi = rows * shard // shards, rows * (shard + 1) // shards
    part = f"part-{shard:05d}-of-{shards:05d}.arrow"
    preprocess = preprocess or adapter_preprocess(adapter)
    step(lambda: _write_part(build / part, source.records, ids, lo, hi, batch_size, preprocess,
                             progress=progress if leader else False, label=f"{source.name}/{source.split}"))
    step(lambda: _publish(build, final, key, identity, shards, force or corrupt is not None,
                          time.monotonic() - started, corrupt) if leader else None)
    return _open(source, final, key, ids, reused=False)


def adapter_preprocess(adapter: Adapter) -> Callable[[list[Record]], list[dict[str, Any]]]:
    """Records -> their conditions: inputs decoded (:func:`~ff_core.data.media.conditions.condition_input`), then
    ``adapter.preprocess`` under no_grad."""
    import torch

    def run(records: list[Record]) -> list[dict[str, Any]]:
        # Condition media are decoded a chunk at a time, so only one chunk's pixels are ever held.
        with torch.no_grad():
            return adapter.preprocess([condition_input(r, adapter.io_contract) for r in records])

    return run


def _start_build(cache_dir: Path, build: Path) -> None:
    cache_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_builds(cache_dir)
    build.mkdir()
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    (build / "owner.json").write_text(json.dumps(owner))


def _write_part(path: Path, records: Sequence[Record], ids: bytes, lo: int, hi: int, batch_size: int,
                preprocess: Callable, *, progress: bool | None, label: str) -> None:  # fmt: skip
    from tqdm.auto import tqdm

    if not path.parent.is_dir():
        raise FileNotFoundError(f"build folder {path.parent} is not visible to this rank: preprocess_parallelism "
                                "'global' needs a cache_dir that every node shares; use 'local' otherwise")
    writer = PartWriter(path)
    disable = None if progress is None else not progress  # None: tqdm shows the bar only on a terminal
    try:
        with tqdm(total=hi - lo, desc=f"preprocessing {label}", unit="row", disable=disable) as bar:
            for start in range(lo, hi, batch_size):
                stop = min(start + batch_size, hi)
                rows = preprocess(list(records[start:stop]))
                if len(rows) != stop - start:
                    raise ValueError(f"adapter.preprocess returned {len(rows)} conditions for {stop - start} inputs")
                writer.write([ids[i * ID_BYTES : (i + 1) * ID_BYTES] for i in range(start, stop)], rows, start)
                bar.update(stop - start)
        blocks = writer.close()
    except BaseException:
        writer.abort()
        raise
    if blocks:  # the leader puts them in the manifest (another rank's part: read from this file)
        write_bytes_atomic(path.with_name(path.name + ".blocks.json"), json.dumps(blocks).encode())


def _publish(build: Path, final: Path, key: str, identity: dict, shards: int, replace: bool, seconds: float,
             corrupt: dict[str, Any] | None = None) -> None:
    """Write the manifest of a finished build folder and rename it into place (the one atomic step). ``corrupt``:
    the corruption this build replaces, kept in the manifest (a second one is refused, see :func:`_corruption`)."""
    parts = []
    for shard in range(shards):
        path = build / f"part-{shard:05d}-of-{shards:05d}.arrow"
        if path.exists():  # a shard with no rows writes no file
            import pyarrow as pa

            with pa.memory_map(str(path), "r") as source:
                reader = pa.ipc.open_file(source)
                rows = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
                if parts and reader.schema != parts[0]["schema"]:
                    raise ValueError(f"{path.name}: its columns differ from {parts[0]['file']}'s: "
                                     f"{reader.schema.names} vs {parts[0]['schema'].names}")
            sidecar = path.with_name(path.name + ".blocks.json")
            blocks = json.loads(sidecar.read_text())
            sidecar.unlink()
            parts.append({"file": path.name, "rows": rows, "bytes": path.stat().st_size, "blocks": blocks,
                          "schema": reader.schema})  # fmt: skip
    manifest = {
        "format": FORMAT, "key": key, "rows": sum(p["rows"] for p in parts), "digest": DIGEST,
        "parts": [{k: v for k, v in p.items() if k != "schema"} for p in parts],
        "identity": identity, "build_seconds": round(seconds, 3), "created": time.time(), "token": build.name,
    }  # fmt: skip
    if corrupt is not None:
        manifest["rebuilt_after_corruption"] = corrupt
    if manifest["rows"] != identity["rows"]["count"]:
        raise ValueError(f"build holds {manifest['rows']} rows, expected {identity['rows']['count']}")
    write_bytes_atomic(build / MANIFEST, json.dumps(manifest, indent=1).encode())
    (build / "owner.json").unlink(missing_ok=True)
    _fsync_dir(build)
    try:
        os.rename(build, final)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        # Another builder published first. Keep its cache (the same content) unless it is broken or this build
        # must replace it (force_reprocess).
        if replace or read_manifest(final, key, manifest["rows"]) is None:
            replace_dir(build, final)
        else:
            shutil.rmtree(build, ignore_errors=True)
    _fsync_dir(final.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open(source: ConditionSource, final: Path, key: str, ids: bytes, reused: bool) -> CacheResult:
    manifest = read_manifest(final, key, len(source.records))
    if manifest is None:
        raise RuntimeError(f"condition cache {final}: missing or incomplete after its build (was it removed?)")
    parts = [(p["file"], p["rows"], p["blocks"]) for p in manifest["parts"]]
    size = sum(p["bytes"] for p in manifest["parts"])
    verb = "reused" if reused else "built"
    log.info("condition cache %s/%s: %s %s (%d rows, %d bytes)", source.name, source.split, verb, final,
             manifest["rows"], size)  # fmt: skip
    return CacheResult(source, CachedConditions(final, parts, ids), final, manifest["rows"], size, reused)


def remove_stale_builds(cache_dir: Path) -> list[Path]:
    """Remove build folders whose builder died (on this host: its process is gone), and return them.

    A build folder of another host is left alone (its owner may be alive), as is one whose owner is unknown
    unless it is a day old.
    """
    removed = []
    host = socket.gethostname()
    for build in cache_dir.glob(".*.build-*"):
        try:
            owner = json.loads((build / "owner.json").read_text())
            dead = owner["host"] == host and not _alive(int(owner["pid"]))
        except (OSError, ValueError, KeyError, TypeError):
            try:
                dead = time.time() - build.stat().st_mtime > 86400
            except OSError:
                continue
        if dead:
            shutil.rmtree(build, ignore_errors=True)
            removed.append(build)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
