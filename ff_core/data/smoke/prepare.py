"""``ff data smoke prepare``: exactly the rows one smoke run reads, for an algorithm, a profile and a world size.

Spec dataset-guide, "Public offline smoke datasets": "materialize exactly two rank-local batches"; the tool "selects
world_size * per_device_batch_size * batches_per_rank rows, and validates through the existing V2 and canonical
task-profile contract boundaries. It does not preprocess target media or create latent caches." The first ``N x B x K``
rows of the alias (in file order) are written to ``<output>/<algorithm>/<profile>/train.jsonl`` with their media copied
beside it (profile-local, the same relative paths), each file checked against the source's ``provenance.json`` digest;
the folder is validated as ``ff data validate --model <adapter> --trainer <algorithm>`` would (strict V2 records, the
adapter's contract for the alias's checkpoint variant, missing files, target headers against the adapter's clip), then
published in one rename. With ``K`` batches per rank and ``B`` rows per batch on ``N`` ranks, one epoch is exactly
``K`` steps on every rank.

The source is a folder :func:`~ff_core.data.smoke.build.build` wrote (either dataset's root or the build's root), a
Hub dataset at a pinned commit (``HUB_ID@COMMIT``, through ``huggingface_hub``; from its cache when offline), or, by
default, a build in ff's cache folder made on first use.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ff_core.atomic import replace_dir
from ff_core.data.smoke.build import FORMAT, MANIFEST, PROFILES_DIR, PROVENANCE, build
from ff_core.data.smoke.catalogue import ALGORITHMS, CATALOGUE_VERSION, SmokeError
from ff_core.data.smoke.support import Support, served_alias
from ff_core.errors import DatasetError, DatasetErrors

DEFAULT_OUTPUT = "dataset/_prepared_offline_smoke"
"""Flow-Factory's default output folder (relative to the working directory), so its commands carry over."""
CACHE_FOLDER = "offline_smoke"
"""The default source: ``<cache dir>/offline_smoke/v<catalogue version>-seed0``, built on first use."""
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class Prepared:
    """What :func:`prepare` wrote.

    Attributes:
        train: the prepared ``train.jsonl``.
        rows: how many rows it holds (``N x B x K``).
        alias: the served alias the profile resolved to.
        adapter: its ff adapter.
        source: the dataset root the rows came from.
    """

    train: Path
    rows: int
    alias: str
    adapter: str
    source: Path


def prepare(algorithm: str, profile: str, world_size: int, per_device_batch_size: int = 1,
            batches_per_rank: int = 2, source: str | os.PathLike | None = None,
            output: str | os.PathLike = DEFAULT_OUTPUT, cache_dir: str | os.PathLike | None = None,
            adapters: dict[str, type] | None = None) -> Prepared:  # fmt: skip
    """Materialise ``world_size x per_device_batch_size x batches_per_rank`` rows (see the module docstring).

    Args:
        algorithm: ``sft`` or ``offline-dpo``.
        profile: an alias (``ltx2-t2av``) or a canonical profile name (its first alias served here).
        world_size: data-parallel ranks of the run.
        per_device_batch_size: rows per batch on each rank (at most the adapter's batch capability).
        batches_per_rank: batches each rank reads.
        source: a builder's folder, ``HUB_ID@COMMIT``, or ``None``: the cache build (made on first use).
        output: the root of prepared datasets; the rows go to ``<output>/<algorithm>/<profile>/``.
        cache_dir: ff's cache folder, home of the default source (``None``: ``$FF_CACHE_DIR``, else
            ``~/.cache/ff/datasets``).
        adapters: adapter name -> class (default: the installed ones).

    Raises:
        SmokeError: an unknown profile, an alias no installed adapter serves, too few rows, an uncached revision, a
            source that is not a smoke dataset (one line each).
        DatasetErrors: the prepared rows fail validation (every problem, ``path:line: field: reason``).
    """
    if algorithm not in ALGORITHMS:
        raise SmokeError(f"--algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    for key, value in (("--world-size", world_size), ("--per-device-batch-size", per_device_batch_size),
                       ("--batches-per-rank", batches_per_rank)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SmokeError(f"{key} must be a positive integer, got {value!r}")
    served = served_alias(profile, adapters)
    alias = served.alias
    limit = served.contract.max_batch_size
    if limit is not None and per_device_batch_size > limit:
        raise SmokeError(f"--per-device-batch-size {per_device_batch_size}: adapter {alias.adapter!r} supports at "
                         f"most {limit} sample(s) per batch")  # fmt: skip
    root = resolve_source(source, algorithm, alias.name, cache_dir, adapters)
    lines = _alias_lines(root, algorithm, alias.name)
    needed = world_size * per_device_batch_size * batches_per_rank
    if needed > len(lines):
        most = len(lines) // (per_device_batch_size * batches_per_rank)
        raise SmokeError(f"--world-size {world_size} x --per-device-batch-size {per_device_batch_size} x "
                         f"--batches-per-rank {batches_per_rank} needs {needed} rows, but {alias.name!r} has "
                         f"{len(lines)} in {root} (world size {most} at most)")  # fmt: skip
    target = Path(output).expanduser() / algorithm / profile
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _copy_rows(root, alias.name, lines[:needed], tmp)
        validate(tmp, algorithm, served)
        replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Prepared(target / "train.jsonl", needed, alias.name, alias.adapter, root)


# -- sources ----------------------------------------------------------------------------------------
def resolve_source(
    source: str | os.PathLike | None, algorithm: str, alias: str, cache_dir: str | os.PathLike | None = None,
    adapters: dict[str, type] | None = None,
) -> Path:
    """The root of ``algorithm``'s dataset in ``source`` (a folder holding ``manifest.json``), checked to be one.

    Raises:
        SmokeError: a folder that is no smoke dataset, a dataset of the other algorithm, a malformed Hub source, an
            uncached revision while offline.
    """
    if source is None:
        return _cache_build(algorithm, alias, cache_dir, adapters)
    text = os.fspath(source)
    folder = Path(text).expanduser()
    if folder.exists():
        if (folder / algorithm / MANIFEST).is_file():  # the builder's root: both datasets
            folder = folder / algorithm
        return _checked(folder, algorithm, text)
    if "@" not in text:
        raise SmokeError(f"--source {text!r}: no such folder (a Hub dataset is written HUB_ID@COMMIT)")
    return _checked(_hub_snapshot(text, alias), algorithm, text)


def _checked(folder: Path, algorithm: str, source: str) -> Path:
    try:
        found = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        raise SmokeError(f"--source {source!r}: not an offline smoke dataset (no {MANIFEST} in {folder})") from None
    except (OSError, ValueError) as exc:
        raise SmokeError(f"--source {source!r}: cannot read {folder / MANIFEST}: {exc}") from None
    if not isinstance(found, dict) or found.get("format") != FORMAT:
        raise SmokeError(f"--source {source!r}: {folder / MANIFEST} is not an offline smoke manifest")
    if found.get("algorithm") != algorithm:
        raise SmokeError(f"--source {source!r} holds the {found.get('algorithm')!r} dataset, not {algorithm!r}")
    return folder


def _hub_snapshot(source: str, alias: str) -> Path:
    """``HUB_ID@COMMIT`` from the Hugging Face cache (or downloaded when online): only the alias's files and the
    dataset's own (manifest, provenance, card)."""
    repo_id, _, revision = source.rpartition("@")
    if not _COMMIT.fullmatch(revision):
        raise SmokeError(f"--source {source!r}: pin an immutable revision, the dataset's 40-hex commit "
                         f"(HUB_ID@COMMIT), not {revision!r}")  # fmt: skip
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        patterns = [MANIFEST, PROVENANCE, "README.md", "LICENSE", f"{PROFILES_DIR}/{alias}/**"]
        path = snapshot_download(repo_id, repo_type="dataset", revision=revision, local_files_only=offline,
                                 allow_patterns=patterns)
    except LocalEntryNotFoundError:
        where = "the Hub is offline (HF_HUB_OFFLINE)" if offline else "the Hub could not be reached"
        raise SmokeError(f"--source {source!r}: revision {revision} of {repo_id} is not in the Hugging Face cache "
                         f"({constants.HF_HUB_CACHE}) and {where}; fetch it once online or pass --source "
                         "DIR") from None  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - huggingface_hub's errors (unknown repo or revision, incomplete cache)
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SmokeError(f"--source {source!r}: {message}") from None
    return Path(path)


def _cache_build(algorithm: str, alias: str, cache_dir: str | os.PathLike | None,
                 adapters: dict[str, type] | None) -> Path:  # fmt: skip
    """The default source: ``<cache>/offline_smoke/v<version>-seed0``, built when absent or lacking ``alias`` (an
    adapter installed since the last build)."""
    base = cache_dir or os.environ.get("FF_CACHE_DIR") or "~/.cache/ff/datasets"
    root = Path(base).expanduser() / CACHE_FOLDER / f"v{CATALOGUE_VERSION}-seed0"
    manifest = root / algorithm / MANIFEST
    try:
        present = alias in json.loads(manifest.read_text()).get("profiles", {})
    except (OSError, ValueError):
        present = False
    if not present:
        build(root, seed=0, overwrite=True, adapters=adapters)
    return root / algorithm


# -- rows -------------------------------------------------------------------------------------------
def _alias_lines(root: Path, algorithm: str, alias: str) -> list[str]:
    """The alias's ``train.jsonl`` lines (each a record, newline kept)."""
    profiles = json.loads((root / MANIFEST).read_text()).get("profiles", {})
    train = root / PROFILES_DIR / alias / "train.jsonl"
    if alias not in profiles or not train.is_file():
        held = ", ".join(profiles) or "none"
        raise SmokeError(f"{root} holds no rows of {alias!r} (its aliases: {held}); rebuild it where its adapter is "
                         "installed")  # fmt: skip
    return train.read_text().splitlines(keepends=True)


def _paths(record: dict[str, Any]) -> list[str]:
    """Every media path of a V2 record (inputs, then each candidate's outputs), as written."""
    supervision = record.get("supervision", {})
    candidates = [supervision.get(k, {}) for k in ("target", "chosen", "rejected")]
    items = [*record.get("input", {}).get("media", []), *(m for c in candidates for m in c.get("media", []))]
    return [m["path"] for m in items if isinstance(m, dict) and isinstance(m.get("path"), str)]


def _copy_rows(root: Path, alias: str, lines: list[str], out: Path) -> None:
    """``lines`` as ``out/train.jsonl`` and every file they reference copied to the same relative path under ``out``,
    each checked against ``provenance.json``'s SHA-256 where the source lists it."""
    source = root / PROFILES_DIR / alias
    try:
        digests = json.loads((root / PROVENANCE).read_text()).get("sha256", {})
    except (OSError, ValueError):
        digests = {}
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise DatasetErrors([DatasetError(source / "train.jsonl", number, None, f"invalid JSON: {exc}")]) from None
        for rel in _paths(record) if isinstance(record, dict) else []:
            path = Path(rel)
            if path.is_absolute() or ".." in path.parts:
                raise DatasetErrors([DatasetError(source / "train.jsonl", number, None,
                                                  f"{rel}: smoke media paths are relative to the profile folder")])
            data = (source / path).read_bytes() if (source / path).is_file() else None
            if data is None:
                continue  # validation names the missing file at its field
            expected = digests.get(f"{PROFILES_DIR}/{alias}/{path.as_posix()}")
            if expected is not None and hashlib.sha256(data).hexdigest() != expected:
                raise SmokeError(f"{source / path}: its SHA-256 differs from {root / PROVENANCE}'s (a damaged or "
                                 "edited source)")  # fmt: skip
            (out / path).parent.mkdir(parents=True, exist_ok=True)
            (out / path).write_bytes(data)
    (out / "train.jsonl").write_text("".join(line if line.endswith("\n") else line + "\n" for line in lines))


def validate(folder: Path, algorithm: str, served: Support) -> None:
    """``folder`` as ``ff data validate FOLDER --model <adapter> --trainer <algorithm>`` checks it, against the
    adapter's contract for the alias's variant: strict V2 records of the algorithm's supervision, the contract, files
    present, target headers covering the adapter's default clip (no header cache is written).

    Raises:
        DatasetErrors: every problem.
    """
    from ff_core.data.media.decode import missing_files
    from ff_core.data.media.target_spans import target_span_errors
    from ff_core.data.records.sources import DatasetConfig, load_split
    from ff_core.data.records.validation import conform, record_errors
    from ff_core.pretrained import resolve_output_geometry

    records = load_split(DatasetConfig(name=served.alias.name, dataset_dir=str(folder)), "train", algorithm)
    contract = served.contract
    errors = [e for r in records for e in record_errors(r, contract)]
    records = [conform(r, contract) for r in records]
    errors += [e for r in records for _, item in r.media() for e in missing_files(r, item)]
    if not errors and served.adapter_class is not None:
        geometry = resolve_output_geometry(served.adapter_class, None, {})
        if geometry:
            errors += target_span_errors(records, geometry)
    if errors:
        raise DatasetErrors(errors)
