"""``model.pretrained_model_name_or_path``: a local checkpoint folder or a hub id, loaded by the adapter.

A value that is neither ends ``ff fit`` with one line naming the key (:class:`~ff_core.errors.ConfigError`), not
a diffusers ``OSError`` traceback. Nothing here reaches the network: a folder is checked on disk and a hub id by
its syntax before loading; whether a well-formed hub id can be reached (online, or from the local hub cache
under ``HF_HUB_OFFLINE=1``) is only known once the adapter's ``from_pretrained`` has tried, so its ``OSError``
is translated afterwards. A cached hub id therefore loads exactly as before, online or offline.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ff_core.errors import ConfigError

if TYPE_CHECKING:
    from ff_core.adapter import Adapter

KEY = "model.pretrained_model_name_or_path"


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot name a checkpoint, found without loading anything; ``None`` when it may.

    Args:
        path: the configured value: a folder (``~`` expanded) or a hub id ``name`` / ``org/name``.
    """
    local = Path(path).expanduser()
    if local.is_dir():
        return None
    if local.exists():
        return f"{os.fspath(path)!r} is a file; expected a checkpoint folder (diffusers layout) or a hub id"
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(os.fspath(path))
    except HFValidationError:
        return f"{os.fspath(path)!r} is neither a folder ({_no_folder(local)}) nor a hub id ('name' or 'org/name')"
    return None


def load_pretrained(
    adapter_cls: type[Adapter], path: str | os.PathLike, kwargs: dict[str, Any], key: str = KEY
) -> Adapter:
    """``adapter_cls.from_pretrained(path, **kwargs)``, with a missing or unreachable checkpoint as a ConfigError.

    Args:
        adapter_cls: the adapter class (``model.adapter``).
        path: a local folder (``~`` expanded) or a hub id.
        kwargs: the adapter's ``from_pretrained`` keyword arguments (``model.adapter_kwargs``).
        key: the config key named in the error.
    """
    problem = checkpoint_problem(path)
    if problem:
        raise ConfigError(key, problem)
    local = Path(path).expanduser()
    source = str(local) if local.is_dir() else os.fspath(path)
    try:
        return adapter_cls.from_pretrained(source, **kwargs)
    except OSError as exc:  # diffusers / transformers / huggingface_hub: missing files, unknown or unreachable repo
        raise ConfigError(key, _load_failure(adapter_cls, path, local, exc)) from exc


def _load_failure(adapter_cls: type[Adapter], path: str | os.PathLike, local: Path, exc: OSError) -> str:
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if local.is_dir():
        return f"{str(local)!r} is a folder but not a {adapter_cls.name} checkpoint in the diffusers layout: {detail}"
    from huggingface_hub import is_offline_mode

    if is_offline_mode():
        # The library's own message ("couldn't connect", "does not appear to have a file named config.json")
        # says nothing more here: offline, only the local hub cache was searched.
        return (f"{os.fspath(path)!r} is neither a folder ({_no_folder(local)}) nor a hub id in the local hub cache "
                "(HF_HUB_OFFLINE is set, so the hub was not asked)")
    return f"{os.fspath(path)!r} is neither a folder ({_no_folder(local)}) nor a reachable hub id: {detail}"


def _no_folder(local: Path) -> str:
    return f"no such directory: {local.absolute()}"
