"""Modules that moved, importable by their old names (the data layer's folders, the CLI package, the sampling and
contracts packages; docs/architecture.md has the map).

An old path (``ff_core.data.geometry``) names the very module object of its new home (``ff_core.data.media.geometry``):
``isinstance`` checks, monkeypatching and pickles see one module. Importing it warns once
(``DeprecationWarning``) with the new path. A name that moved between modules keeps importing from its old module
where that module still exists (e.g. ``MediaGeometry`` from ``ff_core.data.media.geometry``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

MOVED_MODULES: dict[str, str] = {
    "ff_core.data.records_base": "ff_core.data.records.base",
    "ff_core.data.records_legacy": "ff_core.data.records.legacy",
    "ff_core.data.records_v2": "ff_core.data.records.v2",
    "ff_core.data.sources": "ff_core.data.records.sources",
    "ff_core.data.validation": "ff_core.data.records.validation",
    "ff_core.data.geometry": "ff_core.data.media.geometry",
    "ff_core.data.target_spans": "ff_core.data.media.target_spans",
    "ff_core.data.header_cache": "ff_core.data.media.header_cache",
    "ff_core.data.buckets": "ff_core.data.media.buckets",
    "ff_core.data.cache_table": "ff_core.data.cache.table",
    "ff_core.data.cache_group": "ff_core.data.cache.group",
    "ff_core.data.cache_digest": "ff_core.data.cache.digest",
    "ff_core.data.identity": "ff_core.data.cache.identity",
    "ff_core.data.condition_collation": "ff_core.data.cache.collation",
    "ff_core.data.tensor_rows": "ff_core.data.tensor_parquet.rows",
    "ff_core.data.tensor_checks": "ff_core.data.tensor_parquet.checks",
    "ff_core.data.shard_order": "ff_core.data.tensor_parquet.order",
    "ff_core.data.processors": "ff_core.data.samples",
    "ff_core.data.disk_full": "ff_core.disk_full",
    "ff_core.data.commands": "ff_core.cli.data",
    "ff_core.data.preprocess": "ff_core.cli.preprocess",
    "ff_core.data.preprocess_latents": "ff_core.cli.preprocess_latents",
    "ff_core.data.inspection": "ff_core.cli.inspection",
    "ff_core.lightning_cli": "ff_core.cli.flow_cli",
    "ff_core.scaffold": "ff_core.cli.scaffold",
    "ff_core.scheduler_sampling": "ff_core.sampling.schedulers",
    "ff_core.rewards.builtin": "ff_core.plugins",
}
"""Old module path -> new module path. ``ff_core.data.media`` and ``ff_core.data.cache`` became packages: the first
re-exports its decoders, the second's API is :mod:`ff_core.data.cache.store`."""


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A ``sys.meta_path`` finder that answers an old module path with the module at its new one."""

    def __init__(self) -> None:
        self._own_specs: dict[str, object] = {}

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED_MODULES[spec.name]
        warnings.warn(f"{spec.name} moved to {new}: import it from there", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system set the old path's spec on the module: give it back its own.
        module.__spec__ = self._own_specs.pop(module.__spec__.name)


def install() -> None:
    """Put :class:`MovedModuleFinder` on ``sys.meta_path`` once (``import ff_core`` does)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
