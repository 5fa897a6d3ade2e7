"""The ``ff`` command: LightningCLI (fit / validate / test / predict) plus ``ff plugins``, ``ff data`` and
``ff rewards``.

``ff fit --config recipe.yaml`` builds FlowModule (``model:``), FlowDataModule (``data:``) and Lightning's
Trainer (``trainer:``) from one YAML (see :mod:`ff_core.cli.flow_cli`). ``ff --help``, ``ff plugins``, ``ff data``
and ``ff rewards`` are answered here without importing Lightning, so they answer quickly.

A mistake the user can fix (an unknown ``model.adapter``, a checkpoint that is neither a folder nor a hub id, a
dataset problem) ends ``ff fit`` with its message and exit status 2, not a traceback. Output piped into a
reader that stops early (``ff data validate DIR | head``) ends quietly.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Sequence
from typing import TextIO

from ff_core.cli.pipes import EXIT_BROKEN_PIPE as EXIT_BROKEN_PIPE  # re-exported: ff_core.cli named it first
from ff_core.cli.pipes import pipe_safe
from ff_core.cli.scaffold import OUTPUTS  # the standard library only: `ff --help` stays quick

EXIT_USAGE = 2

# Lightning's subcommands as ff uses them (docs/config.md, "Subcommands"); LightningCLI parses their options.
TRAINER_COMMANDS = {
    "fit": "train: ff fit --config recipe.yaml [--section.key value ...]",
    "validate": "sample the evaluation prompts once into a grid (SampleGrid)",
    "test": "the same as validate, on Lightning's test loop",
    "predict": "write one file per evaluation prompt plus an index (MediaWriter)",
}
PLUGINS_HELP = "list installed adapters (distribution, version, IO contract), rewards, and plugins that failed to load"
PLUGINS_NEW_HELP = ("generate a plugin skeleton (pyproject with entry point, adapter, tiny checkpoint, tests, recipe) "
                    "of an image, video or audio+video family (--output)")  # fmt: skip
PLUGINS_NEW_USAGE = f"ff plugins new NAME [--dir DIR] [--output {{{','.join(OUTPUTS)}}}]"
_HELP_FLAGS = ("-h", "--help")
_OWN_OUTPUT_FLAGS = (*_HELP_FLAGS, "--print_config")  # LightningCLI prints these and exits


def usage() -> str:
    """``ff --help``: what ff is and every subcommand, Lightning's and ff's own."""
    from ff_core.cli.data import DATA_COMMANDS
    from ff_core.cli.rewards import REWARDS_COMMANDS

    rows = [*TRAINER_COMMANDS.items(), *((f"data {k}", v) for k, v in DATA_COMMANDS.items()), ("plugins", PLUGINS_HELP),
            ("plugins new", PLUGINS_NEW_HELP), *((f"rewards {k}", v) for k, v in REWARDS_COMMANDS.items())]  # fmt: skip
    width = max(len(name) for name, _ in rows) + 2
    return "\n".join([
        "usage: ff {fit,validate,test,predict} [--config recipe.yaml] [--section.key value ...]",
        "       ff data {" + ",".join(k for k in DATA_COMMANDS if k in ("validate", "inspect")) + "} DATASET_DIR "
        "[options]",
        "       ff data preprocess --config recipe.yaml [--section.key value ...]",
        "       ff data preprocess-latents --config recipe.yaml --output ROOT [--section.key value ...]",
        "       ff data smoke build OUT [--seed N] [--overwrite]",
        "       ff data smoke prepare --algorithm {sft,offline-dpo} --profile NAME_OR_ALIAS --world-size N [options]",
        "       ff data smoke list",
        "       ff plugins",
        f"       {PLUGINS_NEW_USAGE}",
        "       ff rewards serve --reward NAME [--args JSON_OR_YAML] [--host 127.0.0.1] [--port 0] [--device cpu]",
        "       ff rewards list",
        "",
        "ff post-trains flow-matching models on PyTorch Lightning. A recipe is one YAML with model: (FlowModule:",
        "adapter, checkpoint, objective), data: (FlowDataModule: datasets, batch sizes) and trainer: (Lightning's",
        "Trainer); every key can be overridden on the command line.",
        "",
        "commands:",
        *(f"  {name:<{width}}{text}" for name, text in rows),
        "",
        "`ff COMMAND --help` shows a command's options (`ff fit --help` lists every config key).",
    ])


def _print_usage() -> int:
    print(usage())
    return 0


def print_plugins(stream: TextIO | None = None) -> int:
    """``ff plugins``: each adapter with its distribution, version, IO contract and the adapter-interface version it
    targets; each reward; then failures (an incompatible interface version among them)."""
    from ff_core.plugins import UNDECLARED_INTERFACE, get_registry

    out = stream or sys.stdout
    registry = get_registry()
    adapters = registry.adapters()
    if not adapters:
        print("no adapters installed (install a model plugin such as ff-sd3)", file=out)
    for info in sorted(adapters.values(), key=lambda a: a.name):
        interface = f"  (adapter interface {info.interface or f'undeclared, assumed {UNDECLARED_INTERFACE}'})"
        print(f"{info.name}  [{info.distribution} {info.version}]  {info.summary}{interface}", file=out)
    for info in sorted(registry.rewards().values(), key=lambda r: r.name):
        print(f"reward {info.name}  [{info.distribution} {info.version}]  {info.summary}", file=out)
    for failure in registry.failures:
        print(f"FAILED plugin {failure.plugin!r} from {failure.distribution}: {failure.error}", file=out)
    return 0


def _plugins(args: list[str]) -> int:
    if args[:1] and args[0] in _HELP_FLAGS:
        print(f"usage: ff plugins\n       {PLUGINS_NEW_USAGE}\n\n{PLUGINS_HELP}.\n"
              f"new: {PLUGINS_NEW_HELP}.", file=sys.stdout)  # fmt: skip
        return 0
    if args[:1] == ["new"]:
        return _plugins_new(args[1:])
    if args:
        print(f"usage: ff plugins [new NAME [--dir DIR]]\nff plugins: takes no arguments but 'new', found "
              f"{' '.join(args)!r}", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    return print_plugins()


def _plugins_new(args: list[str]) -> int:
    """``ff plugins new NAME [--dir DIR] [--output KIND]`` (:func:`ff_core.cli.scaffold.new_plugin`)."""
    import argparse

    from ff_core.cli.scaffold import new_plugin

    parser = argparse.ArgumentParser(prog="ff plugins new", description=PLUGINS_NEW_HELP + ".")
    parser.add_argument("name", help="the family's name: lowercase letters, digits, single dashes or underscores "
                                     "(my-family)")
    parser.add_argument("--dir", default=".", help="folder to create the plugin in (default: the current one)")
    parser.add_argument("--output", default="image", choices=list(OUTPUTS),
                        help="what the family generates: image (text to image, the default), video (text to video on "
                             "diffusers' WanPipeline maths, reference-checked against it) or video+audio (text to an "
                             "ordered (video, audio) pair, two latent components)")  # fmt: skip
    a = parser.parse_args(args)
    try:
        folder = new_plugin(a.name, a.dir, output=a.output)
    except (ValueError, FileExistsError) as exc:
        print(f"ff plugins new: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote plugin {folder.name} to {folder}\nnext: pip install -e {folder} && ff plugins && "
          f"python -m pytest -q {folder / 'tests'}")
    return 0


def _unknown_command(name: str) -> int:
    commands = [*TRAINER_COMMANDS, "data", "plugins", "rewards"]
    close = difflib.get_close_matches(name, commands, n=1)
    guess = f"; did you mean {close[0]!r}?" if close else ""
    print(f"ff: unknown command {name!r}{guess} (commands: {', '.join(commands)}; see ff --help)", file=sys.stderr)
    return EXIT_USAGE


def _trainer_command(args: list[str] | None) -> int:
    """LightningCLI; ff's user errors print as their message (exit 2), anything else keeps its traceback."""
    from ff_core.cli.flow_cli import run
    from ff_core.errors import ConfigError, ContractError, DatasetError, NonFiniteError
    from ff_core.preemption import Preempted

    try:
        run(args)  # None: LightningCLI reads sys.argv itself for the `ff` script
    except Preempted as exc:  # SIGTERM: the checkpoint is written on every rank's behalf; rank 0 says where
        if exc.rank == 0:
            print(f"ff fit: {exc.message}", file=sys.stderr)
        return exc.code
    except DatasetError as exc:
        print(exc.format(), file=sys.stderr)  # `path:line: field: reason` lines, as `ff data validate` prints
        return EXIT_USAGE
    except (ConfigError, ContractError) as exc:
        command = next((a for a in (sys.argv[1:] if args is None else args) if a in TRAINER_COMMANDS), None)
        print(f"ff {command}: {exc}" if command else f"ff: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except NonFiniteError as exc:  # a run stopped on a NaN/inf (ff_core.nonfinite): one line, no traceback
        print(f"ff fit: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``ff ARGS``; returns the exit status.

    Args:
        argv: the arguments after ``ff`` (default: ``sys.argv[1:]``).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    first = args[0] if args else None
    if first is None:
        print(usage(), file=sys.stderr)
        return EXIT_USAGE
    if first in _HELP_FLAGS:
        return pipe_safe(_print_usage)
    if first == "plugins":
        return pipe_safe(lambda: _plugins(args[1:]))
    if first == "data":
        from ff_core.cli.data import main as data_main

        return pipe_safe(lambda: data_main(args[1:]))
    if first == "rewards":
        from ff_core.cli.rewards import main as rewards_main

        return pipe_safe(lambda: rewards_main(args[1:]))
    if not first.startswith("-") and first not in TRAINER_COMMANDS:
        return _unknown_command(first)
    lightning_args = None if argv is None else args
    # `ff fit --help | less`: the help is long and readers quit early.
    if any(a.partition("=")[0] in _OWN_OUTPUT_FLAGS for a in args):
        return pipe_safe(lambda: _trainer_command(lightning_args))
    return _trainer_command(lightning_args)

