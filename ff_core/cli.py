"""The ``ff`` command: LightningCLI (fit / validate / test / predict) plus ``ff plugins`` and ``ff data``.

``ff fit --config recipe.yaml`` builds FlowModule (``model:``), FlowDataModule (``data:``) and Lightning's
Trainer (``trainer:``) from one YAML (see :mod:`ff_core.lightning_cli`). ``ff plugins`` and ``ff data`` do not
import Lightning, so they answer quickly.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def print_plugins(stream=None) -> int:
    """``ff plugins``: each adapter with its distribution, version and IO contract; then failures."""
    from ff_core.plugins import get_registry

    out = stream or sys.stdout
    registry = get_registry()
    adapters = registry.adapters()
    if not adapters:
        print("no adapters installed (install a model plugin such as ff-sd3)", file=out)
    for info in sorted(adapters.values(), key=lambda a: a.name):
        print(f"{info.name}  [{info.distribution} {info.version}]  {info.summary}", file=out)
    for failure in registry.failures:
        print(f"FAILED plugin {failure.plugin!r} from {failure.distribution}: {failure.error}", file=out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["plugins"]:
        return print_plugins()
    if args[:1] == ["data"]:
        from ff_core.data.commands import main as data_main

        return data_main(args[1:])
    from ff_core.lightning_cli import run

    run(None if argv is None else args)  # None: LightningCLI reads sys.argv itself for the `ff` script
    return 0


if __name__ == "__main__":
    sys.exit(main())
