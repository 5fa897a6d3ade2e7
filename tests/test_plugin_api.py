"""docs/plugin-api.md is the plugin author's API: every name its tables list imports from the module given, and every
field its "Fields" table lists exists on that class, so the page cannot drift from the code."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGE = DOCS / "plugin-api.md"
NAMES_HEADER = ["Name", "Module", "What it is"]
FIELDS_HEADER = ["Class", "Fields and properties"]


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every Markdown table of ``text`` as ``(header cells, rows of cells)``, backticks stripped."""
    found: list[tuple[list[str], list[list[str]]]] = []
    rows: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            rows.append([cell.strip().replace("`", "") for cell in line.strip().strip("|").split("|")])
        elif rows:
            found.append((rows[0], rows[2:]))  # rows[1]: the |---| separator
            rows = []
    return found


def documented() -> tuple[list[tuple[str, str, str]], list[tuple[str, list[str]]]]:
    names, fields = [], []
    for header, rows in tables(PAGE.read_text()):
        if header == NAMES_HEADER:
            names += [(name, module, what) for name, module, what in rows]
        elif header == FIELDS_HEADER:
            fields += [(cls, [f.strip() for f in listed.split(",")]) for cls, listed in rows]
        else:
            raise AssertionError(f"{PAGE.name}: a table with header {header}: expected {NAMES_HEADER} or "
                                 f"{FIELDS_HEADER}")  # fmt: skip
    return names, fields


NAMES, FIELDS = documented()


def test_the_page_lists_the_api_once():
    """The parse found the tables (not an empty page passing vacuously), each name once, each with a line."""
    assert len(NAMES) >= 80 and len(FIELDS) >= 10
    listed = [name for name, _, _ in NAMES]
    assert len(listed) == len(set(listed)), sorted({n for n in listed if listed.count(n) > 1})
    assert all(what for _, _, what in NAMES)


@pytest.mark.parametrize(("name", "module"), [(n, m) for n, m, _ in NAMES], ids=[n for n, _, _ in NAMES])
def test_every_documented_name_imports_from_its_module(name, module):
    assert hasattr(importlib.import_module(module), name), f"{PAGE.name}: {module} has no {name}"


@pytest.mark.parametrize(("cls", "fields"), FIELDS, ids=[c for c, _ in FIELDS])
def test_every_documented_field_exists(cls, fields):
    """A field of the dataclass (with or without a default) or a property of the class."""
    modules = {name: module for name, module, _ in NAMES}
    assert cls in modules, f"{PAGE.name}: the Fields table lists {cls}, which no names table documents"
    obj = getattr(importlib.import_module(modules[cls]), cls)
    assert dataclasses.is_dataclass(obj), f"{cls} is not a dataclass"
    declared = {f.name for f in dataclasses.fields(obj)}
    missing = [f for f in fields if f not in declared and not isinstance(getattr(obj, f, None), property)]
    assert not missing, f"{PAGE.name}: {cls} has no field or property {missing}"


def test_the_plugin_guide_and_the_architecture_link_the_page():
    assert "(plugin-api.md)" in (DOCS / "plugins.md").read_text()
    assert "docs/plugin-api.md" in (DOCS / "architecture.md").read_text()
