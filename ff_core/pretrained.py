"""``model.pretrained_model_name_or_path``: a local checkpoint folder or a hub id, loaded by the adapter.

A value that is neither ends ``ff fit`` with one line naming the key (:class:`~ff_core.errors.ConfigError`), not
a diffusers ``OSError`` traceback. Nothing here reaches the network: a folder is checked on disk and a hub id by
its syntax before loading; whether a well-formed hub id can be reached (online, or from the local hub cache
under ``HF_HUB_OFFLINE=1``) is only known once the adapter's ``from_pretrained`` has tried, so its ``OSError``
is translated afterwards. A cached hub id therefore loads exactly as before, online or offline.

Two more checks before any weight loads: under ``HF_HUB_OFFLINE`` a relative ``dir/name`` whose ``dir`` is a folder
here but whose ``name`` is not there (nor in the hub cache) is a missing local folder (online it is left to the hub:
``org/name``); and a checkpoint of
another family (``model_index.json``'s ``_class_name`` and component classes against the adapter's
:attr:`~ff_core.adapter.Adapter.checkpoint_classes`) is refused naming what was found and what was expected.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ff_core.errors import ConfigError

if TYPE_CHECKING:
    from ff_core.adapter import Adapter
    from ff_core.contracts import AudioSpan, MediaGeometry, PipelineIOContract, TensorColumns

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
    return _missing_local_folder(os.fspath(path), local)


def _missing_local_folder(repo_id: str, local: Path) -> str | None:
    """Why ``repo_id``, hub-id-shaped (``dir/name``), is a local folder that does not exist, or ``None``.

    Only under ``HF_HUB_OFFLINE``: ``build/tiny-sd3`` where ``build/`` is a folder here and ``tiny-sd3`` is not in it,
    and no hub id of that name is in the local hub cache, names a local folder (a recipe run before
    ``scripts/setup.sh`` built it, or from another directory), which the loader would report only as a missing cache
    entry. Online the same string may be a hub id (``org/name`` with an ``org/`` folder here by chance): the hub is
    asked. A path written as local (``./``, ``../``, ``/``, ``~``) never reaches here: it is no valid hub id.
    """
    from huggingface_hub import is_offline_mode, try_to_load_from_cache

    head, sep, _ = repo_id.partition("/")
    if not sep or not is_offline_mode() or not Path(head).expanduser().is_dir():
        return None
    try:
        if isinstance(try_to_load_from_cache(repo_id, "model_index.json"), str):
            return None
    except Exception:  # noqa: BLE001 - a cache the library cannot read is no cached hub id
        pass
    return (f"{repo_id!r} is not a folder ({_no_folder(local)}; {head + '/'!r} is a folder here and HF_HUB_OFFLINE "
            f"is set, so this names a local path, not a cached hub id)")


def check_checkpoint_classes(adapter_cls: type, path: str | os.PathLike | None, key: str = KEY) -> None:
    """Refuse a checkpoint of another family before any weight loads: ``model_index.json``'s ``_class_name`` and the
    component classes it names against the adapter's :attr:`~ff_core.adapter.Adapter.checkpoint_classes`, one
    :class:`ConfigError` naming ``key``, the found class and the expected ones.

    Nothing is checked for an adapter that declares no classes, a path that is not a checkpoint (reported where
    the weights load, as before), a folder without ``model_index.json``, or a hub id whose ``model_index.json``
    cannot be fetched (the loader then says why).

    Args:
        adapter_cls: the adapter class (``model.adapter``).
        path: ``model.pretrained_model_name_or_path``; ``None``: nothing to check.
        key: the config key named in the error.
    """
    expected = getattr(adapter_cls, "checkpoint_classes", None) or {}
    if not expected or path is None or checkpoint_problem(path):
        return
    index = _model_index(path)
    if index is None:
        return
    for entry, accepted in expected.items():
        found = index.get(entry)
        if entry == "_class_name":
            what = "pipeline class (_class_name)"
        else:  # "transformer": ["diffusers", "SD3Transformer2DModel"]; null or absent: not loaded from here
            found = found[1] if isinstance(found, (list, tuple)) and len(found) == 2 else None
            what = f"{entry} class"
            if found is None:
                continue
        if found not in accepted:
            names = " or ".join(repr(a) for a in accepted)
            raise ConfigError(key, f"{os.fspath(path)!r} is not a {_name(adapter_cls)} checkpoint: its "
                                   f"model_index.json names the {what} {found!r}, expected {names} "
                                   "(is model.adapter the right family?)")


def _model_index(path: str | os.PathLike) -> dict[str, Any] | None:
    """``model_index.json`` of a folder, or of a hub id (from the hub cache, else fetched when online), or ``None``."""
    local = Path(path).expanduser()
    if not local.is_dir():
        from huggingface_hub import is_offline_mode, try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(os.fspath(path), "model_index.json")
        except Exception:  # noqa: BLE001 - an unreadable hub cache: fetch or skip below
            cached = None
        if not isinstance(cached, str) and is_offline_mode():
            return None
    try:
        return read_config(path, "model_index.json")
    except Exception:  # noqa: BLE001 - missing, unreachable or not JSON: the loader's own error says why
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
    check_checkpoint_classes(adapter_cls, path, key)
    local = Path(path).expanduser()
    source = str(local) if local.is_dir() else os.fspath(path)
    # The checkpoint's contract, what the data were validated against (a bare loader class without one: skipped).
    resolves = hasattr(adapter_cls, "resolve_contract")
    contract = resolve_contract(adapter_cls, source, kwargs, key) if resolves else None
    try:
        adapter = adapter_cls.from_pretrained(source, **kwargs)
    except OSError as exc:  # diffusers / transformers / huggingface_hub: missing files, unknown or unreachable repo
        raise ConfigError(key, _load_failure(adapter_cls, path, local, exc)) from exc
    if contract is not None:
        adapter.io_contract = contract
    return adapter


def read_config(path: str | os.PathLike, filename: str = "config.json", subfolder: str | None = None) -> dict[str, Any]:
    """One JSON config file of a checkpoint (``model_index.json``, ``transformer/config.json``), nothing else.

    For :meth:`~ff_core.adapter.Adapter.resolve_contract`: a local folder is read on disk; a hub id fetches (or
    finds in the hub cache) that one file with ``huggingface_hub.hf_hub_download``, never the weights.

    Args:
        path: the checkpoint folder or hub id.
        filename: the file, relative to ``subfolder``.
        subfolder: the component folder (``transformer``), or ``None`` for the top level.

    Raises:
        FileNotFoundError: the file does not exist (an OSError: :func:`resolve_contract` names the config key).
        ValueError: it is not a JSON object.
    """
    local = Path(path).expanduser()
    relative = f"{subfolder}/{filename}" if subfolder else filename
    if local.is_dir():
        file = local / relative
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found")
    else:
        from huggingface_hub import hf_hub_download

        file = Path(hf_hub_download(os.fspath(path), filename, subfolder=subfolder))
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return data


def resolve_contract(
    adapter_cls: type[Adapter], path: str | os.PathLike | None, kwargs: dict[str, Any] | None = None, key: str = KEY
) -> PipelineIOContract:
    """``adapter_cls.resolve_contract(path, kwargs)`` (config files only), with an unreadable config as a ConfigError
    naming ``key``; ``path=None`` gives the class's default contract."""
    return _resolve(adapter_cls.resolve_contract, adapter_cls, path, kwargs, key)


def resolve_tensor_columns(
    adapter_cls: type[Adapter], path: str | os.PathLike | None, kwargs: dict[str, Any] | None = None, key: str = KEY
) -> TensorColumns | None:
    """``adapter_cls.resolve_tensor_columns(path, kwargs)``, errors as in :func:`resolve_contract`."""
    return _resolve(adapter_cls.resolve_tensor_columns, adapter_cls, path, kwargs, key)


def resolve_output_geometry(
    adapter_cls: type[Adapter], path: str | os.PathLike | None, kwargs: dict[str, Any] | None = None, key: str = KEY
) -> tuple[MediaGeometry | AudioSpan | None, ...] | None:
    """``adapter_cls.resolve_output_geometry(path, kwargs)`` (config files only), errors as in
    :func:`resolve_contract`; ``None`` for an adapter that does not say (or a bare loader class)."""
    if not hasattr(adapter_cls, "resolve_output_geometry"):
        return None
    return _resolve(adapter_cls.resolve_output_geometry, adapter_cls, path, kwargs, key, what="output geometry")


def resolve_tensor_shapes(
    adapter_cls: type[Adapter], path: str | os.PathLike | None, kwargs: dict[str, Any] | None = None, key: str = KEY
) -> dict[str, Any]:
    """``adapter_cls.resolve_tensor_shapes(path, kwargs)``: stored column -> its expected
    :class:`~ff_core.data.tensor_parquet.checks.StoredShape` (config files only), errors as in :func:`resolve_contract`;
    empty for an adapter that does not say."""
    if not hasattr(adapter_cls, "resolve_tensor_shapes"):
        return {}
    return _resolve(adapter_cls.resolve_tensor_shapes, adapter_cls, path, kwargs, key, what="tensor shapes") or {}


ADAPTER_KWARGS_KEY = "model.adapter_kwargs"


def check_adapter_kwargs(
    adapter_cls: type[Adapter], path: str | os.PathLike | None, kwargs: dict[str, Any] | None, key: str = KEY
) -> None:
    """Refuse ``model.adapter_kwargs`` before any weight loads, each error one :class:`ConfigError` naming the key:
    a key ``adapter_cls.from_pretrained`` does not take (with the ones it does), then the adapter's own checks
    (:meth:`~ff_core.adapter.Adapter.check_adapter_kwargs`, config files only; ``path=None``: those needing no
    checkpoint). An unreadable config names ``key``.

    Args:
        adapter_cls: the adapter class (``model.adapter``).
        path: ``model.pretrained_model_name_or_path``, or ``None`` when unknown.
        kwargs: ``model.adapter_kwargs``.
        key: the config key of the checkpoint, named when its configs cannot be read.
    """
    import inspect

    kwargs = dict(kwargs or {})
    loader = getattr(adapter_cls, "from_pretrained", None)
    if loader is not None:
        params = list(inspect.signature(loader).parameters.values())[1:]  # after the checkpoint
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            accepted = [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
            for name in kwargs:
                if name not in accepted:
                    raise ConfigError(f"{ADAPTER_KWARGS_KEY}.{name}", f"{_name(adapter_cls)} takes no such argument; "
                                      f"it takes {', '.join(accepted) or 'none'}")  # fmt: skip
    check = getattr(adapter_cls, "check_adapter_kwargs", None)
    if check is None:
        check_checkpoint_classes(adapter_cls, path, key)
        return
    try:
        check(None, kwargs)  # what needs no checkpoint first: reported even when the path is wrong too
        check_checkpoint_classes(adapter_cls, path, key)
        if path is not None and _overridden(adapter_cls, "check_adapter_kwargs"):
            problem = checkpoint_problem(path)
            if problem:
                raise ConfigError(key, problem)
            local = Path(path).expanduser()
            check(str(local) if local.is_dir() else os.fspath(path), kwargs)
    except OSError as exc:  # a missing / unreadable config file
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(key, f"cannot read {_name(adapter_cls)}'s configs from {os.fspath(path)!r}: {detail}"
                          ) from exc


def _resolve(method: Any, adapter_cls: type[Adapter], path: str | os.PathLike | None,
             kwargs: dict[str, Any] | None, key: str, what: str = "contract") -> Any:
    check_checkpoint_classes(adapter_cls, path, key)
    if path is None or not _overridden(adapter_cls, method.__name__):
        # The class-level default needs no checkpoint: a bad path is reported where the weights load, as before.
        return method(None, dict(kwargs or {}))
    problem = checkpoint_problem(path)
    if problem:
        raise ConfigError(key, problem)
    local = Path(path).expanduser()
    source = str(local) if local.is_dir() else os.fspath(path)
    try:
        return method(source, dict(kwargs or {}))
    except ConfigError:  # the adapter named the key itself
        raise
    except (OSError, ValueError) as exc:  # a missing / unreadable config file, or a variant the family lacks
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(key, f"cannot resolve {adapter_cls.name}'s {what} from {os.fspath(path)!r}: {detail}"
                          ) from exc


def _name(adapter_cls: type) -> str:
    return getattr(adapter_cls, "name", adapter_cls.__name__)


def _overridden(adapter_cls: type[Adapter], name: str) -> bool:
    """Whether ``adapter_cls`` overrides the classmethod ``name`` of :class:`~ff_core.adapter.Adapter`."""
    from ff_core.adapter import Adapter

    base = getattr(Adapter, name, None)
    own = getattr(adapter_cls, name, None)
    return base is None or getattr(own, "__func__", own) is not getattr(base, "__func__", base)


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
