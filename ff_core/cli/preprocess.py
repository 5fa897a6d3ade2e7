"""``ff data preprocess --config recipe.yaml [--key value ...]``: build a recipe's condition caches ahead of training.

The recipe is read exactly as ``ff fit`` reads it (LightningCLI: ``--config`` files, then dotted overrides), so the
caches it builds are the ones that run will reuse. The adapter is loaded as training loads it, every dataset split
is read and validated, and each split's cache is opened or built (docs/datasets.md, "Condition cache") on the
recipe's accelerator, with a progress bar. One line per split gives its folder, rows, size and whether it was
reused. Run it in one process; ``ff fit`` shards a build over its ranks by itself.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TextIO

EXIT_OK, EXIT_INVALID = 0, 2
USAGE = "usage: ff data preprocess --config recipe.yaml [--data.cache_dir DIR] [--data.force_reprocess true] ..."


def human_size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def main(argv: Sequence[str], out: TextIO | None = None) -> int:
    """Run ``ff data preprocess <argv>``; return the exit status.

    Args:
        argv: arguments after ``ff data preprocess`` (LightningCLI's: ``--config``, ``--data.*``, ``--model.*``).
        out: where to print (default: stdout).
    """
    out = out or sys.stdout
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=out)
        return EXIT_OK if argv else EXIT_INVALID
    recipe = read_recipe(argv, out)
    if isinstance(recipe, int):
        return recipe
    cli, data, model = recipe
    if not data.enable_preprocess:
        print("ff data preprocess: data.enable_preprocess is false: this recipe caches no conditions", file=out)
        return EXIT_INVALID
    model.configure_model()  # no trainer attached: loads the adapter (and its LoRA) without preparing conditions
    from ff_core.errors import DatasetError

    try:
        data.prepare_conditions(model.adapter, device=cli.trainer.strategy.root_device, progress=True)
    except DatasetError as exc:  # a full disk, a corrupt cache refused (docs/scaling.md, "Failures and recovery")
        print(exc.format(), file=out)
        return EXIT_INVALID
    for r in data.cache_results:
        verb = "reused" if r.reused else "built"
        print(f"{r.source.name}/{r.source.split}: {verb} {r.path} ({r.rows} rows, {human_size(r.bytes)})", file=out)
    return EXIT_OK


def read_recipe(argv: Sequence[str], out: TextIO) -> tuple[Any, Any, Any] | int:
    """The recipe as ``ff fit`` reads it, its datasets read and validated: ``(cli, data module, module)``, or the exit
    status after printing every dataset problem (no weights are loaded).

    Args:
        argv: LightningCLI's arguments (``--config``, ``--data.*``, ``--model.*``).
        out: where problems are printed.
    """
    from ff_core.cli.flow_cli import FlowCLI
    from ff_core.data.datamodule import FlowDataModule
    from ff_core.errors import DatasetErrors
    from ff_core.module import FlowModule

    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=list(argv))
    try:
        cli.datamodule.setup("fit")
    except DatasetErrors as exc:
        print(exc.format(), file=out)
        return EXIT_INVALID
    return cli, cli.datamodule, cli.model
