"""``ff data smoke build OUT``: the two offline smoke datasets, every alias the installed adapters serve.

Spec dataset-guide, "Public offline smoke datasets". ``OUT/sft`` (demonstrations) and ``OUT/offline-dpo``
(preferences) are independent and self-contained, each ready for ``huggingface-cli upload`` as its Hub dataset::

    OUT/<algorithm>/
    ├── README.md            the dataset card (Hub front matter: license, one config per alias)
    ├── LICENSE              CC0-1.0
    ├── manifest.json        what the dataset holds: every alias's profile, adapter, outputs, inputs, geometry, rows
    ├── provenance.json      generator, seed, library versions, the SHA-256 of every data file
    └── profiles/<alias>/    train.jsonl (32 strict V2 records) and its media, paths relative to this folder

Row ``i`` of an alias is drawn from ``(seed, alias, i)`` alone (:mod:`ff_core.data.smoke.scenes`) and encoded
deterministically (:mod:`ff_core.data.smoke.media`): the same seed gives byte-identical files. A demonstration's target
is the preference pair's chosen candidate; the rejected one is its corruption, a video keeping its decoded first and
last frames. Condition keyframes are the chosen clip's decoded first / last frames. The tree is written beside ``OUT``
and published in one rename (:func:`ff_core.atomic.replace_dir`); an existing ``OUT`` is replaced only when asked.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ff_core.atomic import replace_dir
from ff_core.contracts import MediaType
from ff_core.data.smoke import media
from ff_core.data.smoke.card import license_text, readme
from ff_core.data.smoke.catalogue import (
    ALGORITHMS,
    CATALOGUE_VERSION,
    PROFILES,
    REPO_IDS,
    ROWS_PER_ALIAS,
    SUPERVISION,
    Alias,
    InputItem,
    SmokeError,
)
from ff_core.data.smoke.scenes import Scene, scene_rng
from ff_core.data.smoke.support import Support, support_table

MANIFEST, PROVENANCE, PROFILES_DIR = "manifest.json", "provenance.json", "profiles"
FORMAT = "ff-offline-smoke"
LICENSE_ID = "CC0-1.0"
EXTENSIONS = {MediaType.IMAGE: "png", MediaType.VIDEO: "mp4", MediaType.AUDIO: "wav"}
REFERENCE_SECONDS = 1.0
"""Length of a reference tone or clip (an input that is no keyframe)."""


@dataclass
class BuildReport:
    """What :func:`build` wrote.

    Attributes:
        root: ``OUT``.
        served: the aliases written, in catalogue order.
        unserved: alias -> why it was left out (its adapter is not installed, or cannot realise the profile).
        files: data files written per algorithm (media and ``train.jsonl``).
    """

    root: Path
    served: list[str] = field(default_factory=list)
    unserved: dict[str, str] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)


@dataclass
class _Row:
    """One row of an alias for both datasets: the files (relative path -> bytes) and the two records."""

    files: dict[str, dict[str, bytes]]
    records: dict[str, dict[str, Any]]


def build(out: str | os.PathLike, seed: int = 0, overwrite: bool = False,
          adapters: dict[str, type] | None = None) -> BuildReport:  # fmt: skip
    """Write both datasets to ``out`` (see the module docstring).

    Args:
        out: the folder to create.
        seed: the seed every scene is drawn from.
        overwrite: replace an existing ``out`` (atomically); otherwise an existing one is an error.
        adapters: adapter name -> class (default: the installed ones, :func:`ff_core.plugins.get_registry`).

    Raises:
        SmokeError: ``out`` exists and ``overwrite`` is off, or no installed adapter serves any alias.
    """
    root = Path(out).expanduser()
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise SmokeError(f"--seed must be a non-negative integer, got {seed!r}")
    if root.exists() and not overwrite:
        raise SmokeError(f"{root} already exists; pass --overwrite to replace it")
    table = support_table(adapters)
    served = [s for s in table.values() if s.served]
    if not served:
        raise SmokeError("no installed adapter serves any smoke alias (install a model plugin such as ff-sd3): "
                         + "; ".join(f"{n}: {s.reason}" for n, s in table.items()))  # fmt: skip
    report = BuildReport(root, [s.alias.name for s in served],
                         {n: s.reason for n, s in table.items() if not s.served})  # fmt: skip
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    try:
        digests: dict[str, dict[str, str]] = {a: {} for a in ALGORITHMS}
        for entry in served:
            _write_alias(tmp, entry.alias, seed, digests)
        for algorithm in ALGORITHMS:
            _write_dataset_files(tmp / algorithm, algorithm, seed, served, report.unserved, digests[algorithm])
            report.files[algorithm] = len(digests[algorithm])
        replace_dir(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def _write_alias(tmp: Path, alias: Alias, seed: int, digests: dict[str, dict[str, str]]) -> None:
    """Every row of ``alias`` into both datasets' ``profiles/<alias>/``."""
    rows = [_row(alias, seed, i) for i in range(ROWS_PER_ALIAS)]
    for algorithm in ALGORITHMS:
        folder = Path(PROFILES_DIR) / alias.name
        lines = []
        for row in rows:
            for rel, data in row.files[algorithm].items():
                _put(tmp / algorithm, folder / rel, data, digests[algorithm])
            lines.append(json.dumps(row.records[algorithm]) + "\n")
        _put(tmp / algorithm, folder / "train.jsonl", "".join(lines).encode(), digests[algorithm])


def _put(root: Path, rel: Path, data: bytes, digests: dict[str, str]) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    digests[rel.as_posix()] = hashlib.sha256(data).hexdigest()


def _row(alias: Alias, seed: int, index: int) -> _Row:
    """Row ``index`` of ``alias``: the scene, its outputs (chosen), their corruption (rejected), the conditions."""
    profile, geometry = PROFILES[alias.profile], alias.geometry
    rng = scene_rng(seed, alias.name, index)
    scene = Scene.draw(rng)
    types = [o.type for o in profile.outputs]
    stem = f"{index:04d}"
    chosen: list[tuple[dict[str, Any], bytes]] = []  # (media object without its path, bytes) per output
    rejected: list[bytes] = []
    endpoints: Any = None  # the first video's bytes, then its decoded (first, last) frames when a condition needs them
    for spec in profile.outputs:
        obj, good, bad = _output(spec.type, scene, geometry, rng)
        chosen.append((obj, good))
        rejected.append(bad)
        if spec.type is MediaType.VIDEO and endpoints is None:
            endpoints = good
    form = profile.forms[index % len(profile.forms)]
    if endpoints is not None and any(item.frame for item in form):
        endpoints = media.decoded_endpoints(endpoints)
    conditions = [_condition(item, scene, geometry, endpoints, alias) for item in form]
    inputs, condition_files = [], {}
    for j, (item, (obj, data)) in enumerate(zip(form, conditions)):
        rel = f"conditions/{stem}_{item.slot or j}.{EXTENSIONS[item.type]}"
        inputs.append({"type": item.type.value, "path": rel, **obj, **({"slot": item.slot} if item.slot else {})})
        condition_files[rel] = data

    def candidate(folder: str, blobs: list[bytes]) -> tuple[dict[str, Any], dict[str, bytes]]:
        objects, files = [], {}
        for k, ((obj, _), data) in enumerate(zip(chosen, blobs)):
            rel = f"{folder}/{stem}_{k}.{EXTENSIONS[profile.outputs[k].type]}"
            objects.append({"type": profile.outputs[k].type.value, "path": rel, **obj})
            files[rel] = data
        return {"media": objects}, files

    target, target_files = candidate("targets", [data for _, data in chosen])
    good, good_files = candidate("chosen", [data for _, data in chosen])
    bad, bad_files = candidate("rejected", rejected)
    prompt = scene.caption(MediaType.VIDEO in types, MediaType.AUDIO in types)
    records = {}
    for algorithm in ALGORITHMS:
        supervision = ({"type": "demonstration", "target": target} if algorithm == "sft" else
                       {"type": "preference", "chosen": good, "rejected": bad})  # fmt: skip
        metadata = {"provenance": _row_provenance(algorithm, alias, seed, index), "scene": scene.to_json()}
        if algorithm == "offline-dpo":
            metadata["rejected"] = _CORRUPTIONS
        records[algorithm] = {"schema_version": 2, "input": {"prompt": prompt, "media": inputs},
                              "supervision": supervision, "metadata": metadata}  # fmt: skip
    files = {"sft": {**condition_files, **target_files}, "offline-dpo": {**condition_files, **good_files, **bad_files}}
    return _Row(files, records)


_CORRUPTIONS = ("images and every video frame but the first and the last: colour channels rotated plus Gaussian "
                "noise (sigma 48); audio: hard-clipped plus white noise (sigma 0.1)")  # fmt: skip


def _output(mtype: MediaType, scene: Scene, geometry, rng: np.random.Generator) -> tuple[dict[str, Any], bytes, bytes]:
    """One output: its media object's rate keys, the chosen bytes and the rejected (corrupted) bytes."""
    h, w = geometry.height, geometry.width
    if mtype is MediaType.IMAGE:
        image = scene.frame(h, w)
        return {}, media.encode_png(image), media.encode_png(Scene.corrupt_image(image, rng))
    if mtype is MediaType.VIDEO:
        frames = scene.frames(geometry.num_frames, h, w)
        corrupt = Scene.corrupt_frames(frames, rng)
        return ({"fps": geometry.fps}, media.encode_mp4(frames, geometry.fps),
                media.encode_mp4(corrupt, geometry.fps))  # fmt: skip
    wave = scene.tone(geometry.duration, geometry.sample_rate)
    return ({"sample_rate": geometry.sample_rate}, media.encode_wav(wave, geometry.sample_rate),
            media.encode_wav(Scene.corrupt_tone(wave, rng), geometry.sample_rate))  # fmt: skip


def _condition(item: InputItem, scene: Scene, geometry, endpoints, alias: Alias) -> tuple[dict[str, Any], bytes]:
    """One condition input: a keyframe of the chosen clip, else a still, a short tone or a short clip of the scene."""
    if item.frame is not None:
        if endpoints is None:
            raise SmokeError(f"alias {alias.name!r}: a {item.frame}-frame condition needs a video output")
        return {}, media.encode_png(endpoints[0] if item.frame == "first" else endpoints[1])
    h, w = geometry.height, geometry.width
    if item.type is MediaType.IMAGE:
        return {}, media.encode_png(scene.frame(h, w))
    rate = geometry.sample_rate or 8000
    if item.type is MediaType.AUDIO:
        return {"sample_rate": rate}, media.encode_wav(scene.tone(REFERENCE_SECONDS, rate), rate)
    fps = geometry.fps or 8.0
    frames = scene.frames(max(2, int(round(REFERENCE_SECONDS * fps))), h, w)
    return {"fps": fps}, media.encode_mp4(frames, fps)


def _row_provenance(algorithm: str, alias: Alias, seed: int, index: int) -> dict[str, Any]:
    return {"dataset": REPO_IDS[algorithm], "generator": "ff_core.data.smoke", "catalogue_version": CATALOGUE_VERSION,
            "seed": seed, "alias": alias.name, "profile": alias.profile, "row": index, "license": LICENSE_ID,
            "synthetic": True}  # fmt: skip


def manifest(algorithm: str, seed: int, served: list[Support], unserved: dict[str, str]) -> dict[str, Any]:
    """``manifest.json`` of one dataset: what every served alias holds, and what was left out and why."""
    profiles = {}
    for entry in served:
        alias, profile = entry.alias, PROFILES[entry.alias.profile]
        profiles[alias.name] = {
            "profile": profile.name, "adapter": alias.adapter, "variant": alias.variant, "checkpoint": alias.checkpoint,
            "outputs": [o.describe() for o in profile.outputs],
            "inputs": [[item.to_json() for item in form] for form in profile.forms],
            "geometry": alias.geometry.to_json(), "rows": ROWS_PER_ALIAS,
            "train": f"{PROFILES_DIR}/{alias.name}/train.jsonl",
        }  # fmt: skip
    return {"format": FORMAT, "catalogue_version": CATALOGUE_VERSION, "algorithm": algorithm,
            "supervision": SUPERVISION[algorithm], "repo_id": REPO_IDS[algorithm], "seed": seed,
            "rows_per_alias": ROWS_PER_ALIAS, "license": LICENSE_ID, "profiles": profiles,
            "unserved": dict(unserved)}  # fmt: skip


def provenance(seed: int, digests: dict[str, str]) -> dict[str, Any]:
    """``provenance.json``: how the files were made (no clock, host or path: the same seed gives the same file)."""
    import av
    import PIL

    from ff_core import __version__

    return {
        "generator": "ff_core.data.smoke.build", "command": f"ff data smoke build OUT --seed {seed}",
        "ff_core": __version__, "catalogue_version": CATALOGUE_VERSION, "seed": seed,
        "procedure": "procedural scenes (a coloured square or disc moving across a plain background, a steady sine "
                     "tone) drawn from numpy.random.default_rng([seed, crc32(alias), row]); PNG by Pillow, H.264 MP4 "
                     f"(yuv420p, qp {media.QP}, one thread, first and last frames intra) by PyAV, 16-bit PCM WAV by "
                     "the standard library; rejected candidates: " + _CORRUPTIONS,
        "libraries": {"numpy": np.__version__, "pillow": PIL.__version__, "av": av.__version__,
                      **{k: ".".join(map(str, v)) for k, v in sorted(av.library_versions.items())}},
        "sha256": dict(sorted(digests.items())),
    }  # fmt: skip


def _write_dataset_files(folder: Path, algorithm: str, seed: int, served: list[Support], unserved: dict[str, str],
                         digests: dict[str, str]) -> None:  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    found = manifest(algorithm, seed, served, unserved)
    (folder / MANIFEST).write_text(json.dumps(found, indent=2) + "\n")
    (folder / PROVENANCE).write_text(json.dumps(provenance(seed, digests), indent=2) + "\n")
    (folder / "README.md").write_text(readme(found))
    (folder / "LICENSE").write_text(license_text())
