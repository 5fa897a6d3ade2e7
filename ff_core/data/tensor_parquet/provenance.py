"""What a set of tensor-parquet shards was written for, stored in every file's footer and checked before training.

``ff data preprocess-latents`` stores, in each parquet file's schema metadata under :data:`PROVENANCE_KEY`, the JSON of
:func:`shard_provenance`: the adapter and its IO contract, the output geometry the targets were fitted to (canvas,
frame count, frame rate, audio span), a fingerprint of every checkpoint component that computed a stored tensor (the
VAEs, text encoders, connectors, image encoders: their config files; the denoisers and the scheduler are left out, as
they compute nothing stored) and the recipe's ``model.adapter_kwargs``. ``ff fit`` reads it from the first file's
footer (no data page) and refuses shards written for another adapter, contract, checkpoint or geometry before any
weight loads (:func:`check_provenance`), naming the entry, the field and both values: such rows have the right shapes
more often than not (same VAE, another frame count at the same latent length; another rate), so no shape check sees
them. ``adapter_kwargs`` are compared over ``from_pretrained``'s defaults: the canvas, clip, rate and posterior keys
(:data:`STRICT_KWARGS`) refuse too; the others (a text length, a re-compression setting) are logged as warnings;
``dtype`` (the training precision) and ``revision`` never count. Shards without provenance (FastVideo's, or written
before ff stored it) are trained from unchecked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ff_core.errors import ConfigError

if TYPE_CHECKING:
    from ff_core.adapter import Adapter

log = logging.getLogger(__name__)

PROVENANCE_KEY = b"ff.provenance"
PROVENANCE_VERSION = 1
# model_index.json components whose outputs are never stored: the trained networks and the noise schedule.
_NOT_STORED_PREFIXES = ("transformer", "unet", "scheduler")
# Keys of a component's config that name where or how it was saved, not what it computes.
_VOLATILE_KEYS = ("_name_or_path", "_commit_hash", "_diffusers_version", "transformers_version", "torch_dtype", "dtype")
# adapter_kwargs never compared: the training precision (latents are stored in their own dtype, cast when read) and
# the checkpoint's revision (its configs are fingerprinted).
_UNCOMPARED_KWARGS = ("dtype", "revision")
# adapter_kwargs that set what the stored tensors are, whatever the family: the canvas, the clip, its clock, which
# posterior statistic the latents are. A difference refuses the shards (adapters without resolve_output_geometry,
# SD3 and Wan, name their geometry with these).
STRICT_KWARGS = ("resolution", "height", "width", "num_frames", "fps", "frame_rate", "target_posterior")
# The fields that refuse a mismatch, in the order they are reported.
STRICT_FIELDS = ("adapter", "contract", "geometry", "checkpoint")


def _geometry(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.name != "tolerance"}
        return {"kind": type(value).__name__, **fields}
    return value


def checkpoint_fingerprint(pretrained: str | os.PathLike | None) -> dict[str, str]:
    """Component -> sha256 of its config file (canonical JSON, save-time keys dropped), for every component of
    ``model_index.json`` that may compute a stored tensor; ``{}`` without a checkpoint or a readable index. A
    component whose config cannot be read (an uncached hub file offline) is left out."""
    from ff_core.pretrained import read_config

    if pretrained is None:
        return {}
    try:
        index = read_config(pretrained, "model_index.json")
    except (OSError, ValueError):
        return {}
    out: dict[str, str] = {}
    for name, value in sorted(index.items()):
        if name.startswith("_") or name.startswith(_NOT_STORED_PREFIXES) or not isinstance(value, list):
            continue
        if len(value) != 2 or value[1] is None:
            continue
        config = None
        for filename in ("config.json", "preprocessor_config.json", "tokenizer_config.json"):
            try:
                config = read_config(pretrained, filename, subfolder=name)
                break
            except (OSError, ValueError):
                continue
        if config is None:
            continue
        kept = {k: v for k, v in config.items() if k not in _VOLATILE_KEYS}
        digest = hashlib.sha256(json.dumps([value, kept], sort_keys=True, default=str).encode()).hexdigest()
        out[name] = digest[:16]
    return out


def shard_provenance(
    adapter_cls: type[Adapter], pretrained: str | os.PathLike | None, adapter_kwargs: Mapping[str, Any] | None,
    supervision: str, storage: Mapping[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """What shards written by ``adapter_cls`` from ``pretrained`` with ``adapter_kwargs`` were written for (config
    files only, no weights): the JSON-ready dict :func:`check_provenance` compares.

    Args:
        adapter_cls: the adapter class.
        pretrained: ``model.pretrained_model_name_or_path``.
        adapter_kwargs: ``model.adapter_kwargs``.
        supervision: ``demonstration`` or ``preference``.
        storage: how the tensors were stored (``{"dtype": ...}``), recorded for ``ff data inspect``; not compared.
    """
    from ff_core.pretrained import resolve_contract

    kwargs = {k: v for k, v in _settings(adapter_cls, adapter_kwargs).items()
              if k not in getattr(adapter_cls, "training_kwargs", ())}
    geometry = None
    resolve = getattr(adapter_cls, "resolve_output_geometry", None)
    if resolve is not None:
        found = resolve(pretrained, kwargs)
        geometry = None if found is None else [_geometry(g) for g in found]
    return {
        "version": PROVENANCE_VERSION,
        "adapter": adapter_cls.name,
        "contract": resolve_contract(adapter_cls, pretrained, kwargs).describe(),
        "geometry": geometry,
        "checkpoint": checkpoint_fingerprint(pretrained),
        "pretrained_model_name_or_path": None if pretrained is None else str(pretrained),
        "adapter_kwargs": json.loads(json.dumps(kwargs, default=str)),
        "supervision": supervision,
        "training_kwargs": list(getattr(adapter_cls, "training_kwargs", ())),
        "storage": dict(storage or {}),
    }


def _settings(adapter_cls: type[Adapter], adapter_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``adapter_kwargs`` over the defaults of the adapter's ``from_pretrained`` (so a recipe that leaves a value at
    its default and one that spells it out agree), as JSON values."""
    import inspect

    defaults = {}
    try:
        params = list(inspect.signature(adapter_cls.from_pretrained).parameters.values())[1:]
    except (TypeError, ValueError):
        params = []
    for param in params:
        if param.default is not param.empty and param.kind is param.KEYWORD_ONLY or (
                param.default is not param.empty and param.kind is param.POSITIONAL_OR_KEYWORD):
            defaults[param.name] = param.default
    return json.loads(json.dumps({**defaults, **dict(adapter_kwargs or {})}, default=str))


def encode_provenance(provenance: Mapping[str, Any]) -> dict[bytes, bytes]:
    """The schema metadata entry holding ``provenance``."""
    return {PROVENANCE_KEY: json.dumps(provenance, sort_keys=True).encode()}


def read_provenance(path: str | os.PathLike) -> dict[str, Any] | None:
    """The provenance stored in one parquet file's footer, or ``None`` (shards written without it)."""
    import pyarrow.parquet as pq

    metadata = pq.read_schema(Path(path)).metadata or {}
    raw = metadata.get(PROVENANCE_KEY)
    if raw is None:
        return None
    try:
        found = json.loads(raw)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def provenance_differences(expected: Mapping[str, Any], found: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """``(errors, warnings)``: why shards of provenance ``found`` do not fit a run expecting ``expected``."""
    errors = []
    for key in STRICT_FIELDS:
        want, have = expected.get(key), found.get(key)
        if key == "checkpoint":  # components both sides could fingerprint
            common = sorted(set(want or {}) & set(have or {}))
            differ = [c for c in common if want[c] != have[c]]
            if differ:
                errors.append(f"checkpoint: the shards were computed by another {', '.join(differ)} (written from "
                              f"{found.get('pretrained_model_name_or_path')!r}, this run loads "
                              f"{expected.get('pretrained_model_name_or_path')!r}; their config files differ)")
            continue
        if want is None or have is None or want == have:
            continue
        if key == "geometry" and len(want) == len(have):  # name the fields that differ, per output
            for i, (w, h) in enumerate(zip(want, have)):
                fields = sorted(set(w or {}) | set(h or {})) if isinstance(w, dict) and isinstance(h, dict) else []
                differ = [f for f in fields if w.get(f) != h.get(f)] if fields else ([] if w == h else ["all"])
                errors += [f"output {i} {f}: the shards were written for {_show(h.get(f) if fields else h)}, this "
                           f"run has {_show(w.get(f) if fields else w)}" for f in differ]
            continue
        errors.append(f"{key}: the shards were written for {_show(have)}, this run has {_show(want)}")
    warnings = []
    if "adapter_kwargs" not in expected:  # a run that names no checkpoint and kwargs: nothing more to compare
        return errors, warnings
    want_kwargs, have_kwargs = expected.get("adapter_kwargs") or {}, found.get("adapter_kwargs") or {}
    ignored = {*_UNCOMPARED_KWARGS, *expected.get("training_kwargs", ())}
    for key in sorted((set(want_kwargs) | set(have_kwargs)) - ignored):
        if want_kwargs.get(key) != have_kwargs.get(key):
            line = (f"model.adapter_kwargs.{key}: the shards were written with {_show(have_kwargs.get(key))}, this run "
                    f"has {_show(want_kwargs.get(key))}")
            (errors if key in STRICT_KWARGS else warnings).append(line)
    return errors, warnings


def check_provenance(key: str, first_file: str | os.PathLike, expected: Mapping[str, Any]) -> None:
    """Refuse the shards of ``data.datasets`` entry ``key`` when their stored provenance does not fit ``expected``
    (:func:`shard_provenance` of the run); log the softer differences. Shards without provenance pass.

    Raises:
        ConfigError: naming ``key`` (``data.datasets[0].tensor_parquet_dir``), the file and every strict difference.
    """
    found = read_provenance(first_file)
    if found is None:
        log.info("%s: %s stores no ff provenance (written by another tool?): its adapter, checkpoint and geometry are "
                 "not checked, only its columns and shapes", key, first_file)
        return
    errors, warnings = provenance_differences(expected, found)
    if errors:
        raise ConfigError(key, f"{first_file}: written for another run: " + "; ".join(errors)
                          + " (rewrite them with ff data preprocess-latents and this recipe)")
    for warning in warnings:
        log.warning("%s: %s", key, warning)
