"""``ff rewards ...``: rewards outside a recipe.

``ff rewards serve --reward NAME [--args JSON_OR_YAML] [--host 127.0.0.1] [--port 0] [--device cpu]`` serves an
installed reward over HTTP for the ``remote`` reward (:mod:`ff_core.rewards.serve`); ``ff rewards list`` lists the
registered rewards, as ``ff plugins`` does among the adapters.
"""

from __future__ import annotations

import sys
from typing import TextIO

EXIT_USAGE = 2
# `ff rewards` subcommands and their one-line help (also listed by `ff --help`).
REWARDS_COMMANDS = {
    "serve": "serve an installed reward over HTTP for the `remote` reward: ff rewards serve --reward NAME",
    "list": "list the registered rewards (kind, media, needed metadata)",
}
USAGE = ("usage: ff rewards serve --reward NAME [--args JSON_OR_YAML] [--host 127.0.0.1] [--port 0] [--device cpu]\n"
         "       ff rewards list")  # fmt: skip


def print_rewards(stream: TextIO | None = None) -> int:
    """``ff rewards list``: each registered reward with its distribution, version, kind, media and needed fields."""
    from ff_core.plugins import get_registry

    out = stream or sys.stdout
    for info in sorted(get_registry().rewards().values(), key=lambda r: r.name):
        print(f"{info.name}  [{info.distribution} {info.version}]  {info.summary}", file=out)
    return 0


def main(args: list[str]) -> int:
    """``ff rewards ARGS``; returns the exit status."""
    if not args or args[0] in ("-h", "--help"):
        text = USAGE + "\n\n" + "\n".join(f"  {k:<7}{v}" for k, v in REWARDS_COMMANDS.items())
        print(text, file=sys.stdout if args else sys.stderr)
        return 0 if args else EXIT_USAGE
    if args[0] == "serve":
        from ff_core.rewards.serve import main as serve

        return serve(args[1:], prog="ff rewards serve")
    if args[0] == "list" and len(args) == 1:
        return print_rewards()
    print(f"{USAGE}\nff rewards: unknown subcommand {' '.join(args)!r} (subcommands: "
          f"{', '.join(REWARDS_COMMANDS)})", file=sys.stderr)  # fmt: skip
    return EXIT_USAGE
