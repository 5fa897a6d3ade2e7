"""Helpers of the dataset tests: the example-media writers, split-file writing, support-table adapters.

(A plain module rather than conftest.py, so test modules can import it by a unique name.)
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

from ff_core.adapter import Adapter
from ff_core.testing.contracts import SUPPORT_TABLE

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "datasets"


def _load_make_media() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ff_example_make_media", EXAMPLES / "make_media.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


make_media = _load_make_media()


def write_lines(path: Path, rows: list) -> Path:
    """Write rows to a split file: dicts as JSON lines, strings verbatim."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def support_adapter(name: str) -> type[Adapter]:
    """A weightless Adapter subclass whose ``io_contract`` is the support-table row ``name``."""
    return type(f"Table_{name.replace('-', '_')}", (Adapter,), {"name": name, "io_contract": SUPPORT_TABLE[name]})
