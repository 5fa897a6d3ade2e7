"""``ff plugins new NAME``: a plugin skeleton that installs, registers, passes the conformance kit and trains as
generated.

The files come from ``ff_core/templates/plugin`` (``string.Template`` placeholders, in file contents and path names):
``pyproject.toml`` with the ``ff`` entry point, the package (``plugin.py`` hooks, ``adapter.py``, ``testing.py``
tiny-checkpoint factory on :mod:`ff_core.testing.tiny`), a conformance test, a tiny recipe and a README. The adapter
is a small working text-to-image family whose family-specific stages are marked ``FAMILY:``; docs/plugins.md walks
from it to a real family (examples/plugins/ff_flux).
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from string import Template

TEMPLATE_DIR = Path(__file__).parents[1] / "templates" / "plugin"
NAME_PATTERN = re.compile(r"[a-z][a-z0-9]*([-_][a-z0-9]+)*")  # adapter names: sd3-5, wan2_t2v


@dataclass(frozen=True)
class PluginNames:
    """Every name a generated plugin uses, derived from the one the user gives (``ff plugins new my-family``).

    Attributes:
        adapter_name: the registry name recipes write (``model.adapter: my-family``): the given name without ``ff-``.
        dist: the distribution (``ff-my-family``).
        package: the import package (``ff_my_family``).
        module: the name in identifiers (``my_family``: ``build_tiny_my_family``).
        entry_point: the entry point's name in the ``ff`` group (``my-family``).
        class_name: the adapter class (``MyFamilyAdapter``).
        interface_version: the adapter interface the plugin targets (this ff-core's).
    """

    adapter_name: str
    dist: str
    package: str
    module: str
    entry_point: str
    class_name: str
    interface_version: str

    @classmethod
    def from_name(cls, name: str) -> PluginNames:
        """Derive the names; ``ValueError`` when ``name`` is not lowercase letters and digits, parts joined by single
        dashes or underscores (``my-family``, ``wan2_t2v``)."""
        from ff_core import ADAPTER_INTERFACE_VERSION

        base = name.removeprefix("ff-")
        if not NAME_PATTERN.fullmatch(base):
            raise ValueError(f"plugin name {name!r}: use lowercase letters, digits and single dashes or underscores, "
                             "starting with a letter (e.g. my-family, wan2_t2v)")  # fmt: skip
        module = base.replace("-", "_")
        return cls(adapter_name=base, dist=f"ff-{base}", package=f"ff_{module}", module=module, entry_point=base,
                   class_name="".join(p.capitalize() for p in re.split("[-_]", base)) + "Adapter",
                   interface_version=ADAPTER_INTERFACE_VERSION)  # fmt: skip


def new_plugin(name: str, directory: str | Path = ".") -> Path:
    """Write the skeleton of plugin ``name`` to ``directory/<package>`` (published whole, or not at all) and return it.

    Args:
        name: the family's name (``my-family``; an ``ff-`` prefix is dropped).
        directory: the parent folder (created if missing).

    Raises:
        ValueError: a name that cannot be a distribution and registry name.
        FileExistsError: the plugin folder exists already (nothing is overwritten).
    """
    names = PluginNames.from_name(name)
    parent = Path(directory)
    target = parent / names.package
    if target.exists():
        raise FileExistsError(f"{target} exists already; choose another --dir or name")
    parent.mkdir(parents=True, exist_ok=True)
    values = asdict(names)
    tmp = Path(tempfile.mkdtemp(prefix=f".{names.package}.", dir=parent))
    try:
        for source in sorted(TEMPLATE_DIR.rglob("*.tmpl")):
            relative = Template(str(source.relative_to(TEMPLATE_DIR).with_suffix(""))).substitute(values)
            out = tmp / relative
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(Template(source.read_text()).substitute(values))
        tmp.chmod(0o755)  # mkdtemp creates 0700; the published folder is an ordinary one
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
