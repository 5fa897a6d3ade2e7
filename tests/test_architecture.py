"""The house plan, enforced: ff_core's parts import downward only, and no module imports itself back in a circle.

The import graph is read from the source with ``ast`` (every ``import`` and ``from … import``, inside functions and
``if TYPE_CHECKING:`` blocks included: a type-only import is still a dependency of the design), plus the implicit
edge from a module to each package above it (Python runs ``pkg/__init__.py`` before ``pkg.mod``). docs/architecture.md
draws the same layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ff_core"

# Top to bottom. A module may import modules of its own part and of any part on a lower level; parts on one level
# never import each other. The first prefix that matches a module names its part (longer prefixes first).
LEVELS: list[dict[str, tuple[str, ...]]] = [
    {"testing": ("ff_core.testing",)},  # the plugin author's kit: builds on everything
    # `ff …`: Lightning's subcommands and ff's own (data, plugins, rewards, the scaffold); `python -m
    # ff_core.rewards.serve` is `ff rewards serve`, an entry point that resolves reward names through the registry.
    {"cli": ("ff_core.cli", "ff_core.rewards.serve")},
    {
        "training": (  # the LightningModule and LightningDataModule and what Lightning calls around them
            "ff_core.module", "ff_core.evaluation", "ff_core.data.datamodule", "ff_core.callbacks", "ff_core.lora",
            "ff_core.sharding", "ff_core.strategies", "ff_core.context_parallel", "ff_core.nonfinite",
            "ff_core.preemption", "ff_core.run_folder", "ff_core.ckpt_path", "ff_core.vae_memory",
        ),
    },
    {"objectives": ("ff_core.objectives",), "data": ("ff_core.data",)},
    {"registry": ("ff_core.plugins", "ff_core.hookspecs", "ff_core.pretrained")},
    {"adapter": ("ff_core.adapter", "ff_core.sampling"), "rewards": ("ff_core.rewards",)},
    {"contracts": ("ff_core.contracts",)},
    {
        "base": (
            "ff_core.errors", "ff_core.atomic", "ff_core.disk_full", "ff_core.seeding", "ff_core.groups",
            "ff_core.audio", "ff_core.image_latents", "ff_core.prompt_templates", "ff_core.moved",
        ),
    },
]  # fmt: skip
ROOT_PACKAGE = "ff_core"  # ff_core/__init__.py: the version constants and the moved-module aliases (base)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> dict[str, int]:
    """The ff_core modules ``name`` imports, each with the line of its first import."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            targets = [module, *(f"{module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for target in targets:
            while target not in known and "." in target:
                target = target.rpartition(".")[0]
            if target in known and target != name and target.startswith(ROOT_PACKAGE):
                found.setdefault(target, node.lineno)
    # Importing a.b.c runs a/__init__.py and a/b/__init__.py first.
    for target in list(found):
        parent = target.rpartition(".")[0]
        while parent and parent != ROOT_PACKAGE:
            if parent != name and not name.startswith(parent + "."):
                found.setdefault(parent, found[target])
            parent = parent.rpartition(".")[0]
    return found


def graph() -> dict[str, dict[str, int]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def part_of(name: str) -> tuple[int, str]:
    if name == ROOT_PACKAGE:  # the version constants: the base of everything
        return len(LEVELS) - 1, "base"
    matches = [
        (len(prefix), level, part)
        for level, parts in enumerate(LEVELS)
        for part, prefixes in parts.items()
        for prefix in prefixes
        if name == prefix or name.startswith(prefix + ".")
    ]
    if not matches:
        raise AssertionError(f"{name} belongs to no part of the house plan: add it to LEVELS in {__file__}")
    _, level, part = max(matches)
    return level, part


def test_every_module_has_a_part():
    for name in modules():
        if name != ROOT_PACKAGE:
            part_of(name)


def test_imports_run_downward():
    upward = []
    for name, targets in graph().items():
        level, part = part_of(name)
        for target, line in targets.items():
            target_level, target_part = part_of(target)
            if target_level > level or (target_level == level and target_part == part):
                continue
            how = "up" if target_level < level else "sideways"
            upward.append(f"{modules()[name].relative_to(ROOT.parent)}:{line}: {part} imports {how} into "
                          f"{target_part} ({target})")  # fmt: skip
    assert not upward, "imports against the house plan:\n" + "\n".join(upward)


def find_cycle(edges: dict[str, dict[str, int]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(edges.get(node, {})):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_circles():
    edges = graph()
    cycle = find_cycle(edges)
    assert cycle is None, "import circle: " + " -> ".join(
        f"{a} (line {edges[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False)
    ) + f" -> {cycle[-1]}"


def test_the_checks_see_a_circle_and_an_upward_import(tmp_path):
    """The graph reader finds what it must: a relative import, a function-level import, a TYPE_CHECKING import."""
    package = tmp_path / "ff_core"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "data" / "__init__.py").write_text("")
    (package / "data" / "a.py").write_text("from .b import x\n")
    (package / "data" / "b.py").write_text("def f():\n    from ff_core.data import a\n")
    type_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import ff_core.module\n"
    (package / "errors.py").write_text(type_only)
    (package / "module.py").write_text("")
    known = {"ff_core", "ff_core.data", "ff_core.data.a", "ff_core.data.b", "ff_core.errors", "ff_core.module"}
    edges = {
        name: imports_of(name, package / (name.replace("ff_core.", "").replace(".", "/") + ".py"), known)
        for name in ("ff_core.data.a", "ff_core.data.b", "ff_core.errors")
    }
    assert find_cycle(edges) == ["ff_core.data.a", "ff_core.data.b", "ff_core.data.a"]
    assert edges["ff_core.errors"] == {"ff_core.module": 3}
    assert part_of("ff_core.errors") > part_of("ff_core.module")  # so the downward test refuses errors -> module


def test_moved_modules_are_the_new_modules():
    """Every old module path imports (with a DeprecationWarning naming the new one) the very module of its new path."""
    import subprocess
    import sys

    from ff_core.moved import MOVED_MODULES

    script = """
import importlib, sys, warnings
from ff_core.moved import MOVED_MODULES
for old, new in MOVED_MODULES.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new), old
    assert module.__spec__.name == new, (old, module.__spec__.name)
    assert any(new in str(w.message) and w.category is DeprecationWarning for w in caught), (old, caught)
    assert sys.modules[old] is module
from ff_core.data.geometry import MediaGeometry
from ff_core.contracts import MediaGeometry as new
assert MediaGeometry is new
print("ok", len(MOVED_MODULES))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok", str(len(MOVED_MODULES))]
    for old, new in MOVED_MODULES.items():  # the table points at modules that exist, never at another old path
        assert new in modules() and new not in MOVED_MODULES and old not in modules(), (old, new)


def test_checkpoints_written_before_a_class_moved_still_load(tmp_path, monkeypatch):
    """Hyper-parameters pickle their classes by path: a checkpoint written when ``LoRAConfig`` and ``SamplingConfig``
    lived in ``ff_core.module`` loads under ``torch.load(weights_only=True)`` (Lightning's default), with the classes
    of their new homes."""
    import torch

    from ff_core.evaluation import SamplingConfig
    from ff_core.lora import LoRAConfig
    from ff_core.module import CHECKPOINT_CLASSES

    hparams = {"lora": LoRAConfig(rank=4, alpha=8.0), "sampling": SamplingConfig(num_steps=3)}
    with monkeypatch.context() as patch:  # what a checkpoint of the old layout holds
        for cls in (LoRAConfig, SamplingConfig):
            patch.setattr(cls, "__module__", "ff_core.module")
        torch.save({"hyper_parameters": hparams}, tmp_path / "old.ckpt")
    torch.save({"hyper_parameters": hparams}, tmp_path / "new.ckpt")
    assert b"ff_core.module" in (tmp_path / "old.ckpt").read_bytes()
    for name in ("old.ckpt", "new.ckpt"):
        loaded = torch.load(tmp_path / name, weights_only=True)["hyper_parameters"]
        assert loaded == hparams and type(loaded["lora"]) is LoRAConfig, name
    assert {cls.__module__ for cls in CHECKPOINT_CLASSES} == {"ff_core.lora", "ff_core.evaluation", "ff_core.sharding"}
