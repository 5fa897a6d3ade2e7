"""``ff data smoke {build,prepare,list}``: the offline smoke datasets (:mod:`ff_core.data.smoke`).

``ff data smoke build OUT [--seed N] [--overwrite]`` writes both datasets; ``ff data smoke prepare --algorithm
{sft,offline-dpo} --profile NAME_OR_ALIAS --world-size N [--per-device-batch-size B] [--batches-per-rank K]
[--source DIR|HUB_ID@COMMIT] [--output DIR]`` materialises the ``N x B x K`` rows of one run; ``ff data smoke list``
prints the catalogue and which aliases the installed adapters serve. Also ``python -m ff_core.cli.smoke prepare ...``
(Flow-Factory's ``python -m dataset.offline_smoke.prepare ...`` with the same options). A mistake the user can fix is
one line and exit status 2; rows that fail validation are listed as ``ff data validate`` lists them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

from ff_core.data.smoke.catalogue import ALGORITHMS, ALIASES, PROFILES, SmokeError
from ff_core.errors import DatasetError

EXIT_OK, EXIT_INVALID = 0, 2
SMOKE_HELP = "the offline smoke datasets: build them, prepare one run's rows (N x B x K), list the profiles"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ff data smoke", description=SMOKE_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write the SFT and offline-DPO smoke datasets (OUT/sft, OUT/offline-dpo)")
    b.add_argument("out", help="the folder to create (each dataset in it is ready for `huggingface-cli upload`)")
    b.add_argument("--seed", type=int, default=0, help="the seed every scene is drawn from (default: 0)")
    b.add_argument("--overwrite", action="store_true", help="replace an existing OUT (atomically)")
    p = sub.add_parser("prepare", help="write exactly world_size x per_device_batch_size x batches_per_rank rows "
                                       "of one profile, media copied beside them, validated")  # fmt: skip
    p.add_argument("--algorithm", required=True, choices=ALGORITHMS)
    p.add_argument("--profile", required=True, help="an alias (ltx2-t2av) or a canonical profile name "
                                                    "(text_to_audio_video: its first alias served here)")  # fmt: skip
    p.add_argument("--world-size", type=int, required=True, help="data-parallel ranks of the run")
    p.add_argument("--per-device-batch-size", type=int, default=1, help="rows per batch on each rank (default: 1)")
    p.add_argument("--batches-per-rank", type=int, default=2, help="batches each rank reads (default: 2)")
    p.add_argument("--source", help="a folder `ff data smoke build` wrote, or HUB_ID@COMMIT (a pinned Hub dataset, "
                                    "from the Hugging Face cache when offline); default: a build in ff's cache folder, "
                                    "made on first use")  # fmt: skip
    p.add_argument("--output", default=None, help="root of prepared datasets; rows go to "
                                                  "OUTPUT/ALGORITHM/PROFILE/train.jsonl "
                                                  "(default: dataset/_prepared_offline_smoke)")  # fmt: skip
    sub.add_parser("list", help="every profile and alias, its ff adapter, and whether it is served here")
    return parser


def main(argv: Sequence[str], out: TextIO | None = None) -> int:
    """Run ``ff data smoke <argv>``; return the exit status.

    Args:
        argv: arguments after ``ff data smoke``.
        out: where to print (default: stdout).
    """
    out = out or sys.stdout
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:  # argparse already printed usage
        return int(exc.code or 0)
    try:
        if args.command == "build":
            return _build(args, out)
        if args.command == "prepare":
            return _prepare(args, out)
        return _list(out)
    except SmokeError as exc:
        print(f"ff data smoke {args.command}: {exc}", file=out)
        return EXIT_INVALID
    except DatasetError as exc:  # prepared rows that fail validation: every problem, as `ff data validate` prints
        for error in exc.errors:
            print(error.format(), file=out)
        print(f"ff data smoke {args.command}: {len(exc.errors)} problem(s)", file=out)
        return EXIT_INVALID


def _build(args: argparse.Namespace, out: TextIO) -> int:
    from ff_core.data.smoke.build import build

    report = build(args.out, seed=args.seed, overwrite=args.overwrite)
    print(f"wrote {report.root}/sft ({report.files['sft']} files) and {report.root}/offline-dpo "
          f"({report.files['offline-dpo']} files): {', '.join(report.served)}", file=out)  # fmt: skip
    for name, why in report.unserved.items():
        print(f"  not served here: {name}: {why}", file=out)
    return EXIT_OK


def _prepare(args: argparse.Namespace, out: TextIO) -> int:
    from ff_core.data.smoke.prepare import DEFAULT_OUTPUT, prepare

    # The default source's cache: $FF_CACHE_DIR, else ~/.cache/ff/datasets (ff's cache folder, without importing
    # the data module and Lightning for it).
    done = prepare(args.algorithm, args.profile, args.world_size, args.per_device_batch_size, args.batches_per_rank,
                   source=args.source, output=args.output or DEFAULT_OUTPUT)
    folder = done.train.parent
    print(f"prepared {done.rows} rows of {done.alias} (adapter {done.adapter}) for {args.algorithm} at world size "
          f"{args.world_size} x batch {args.per_device_batch_size} x {args.batches_per_rank} batches per rank: "
          f"{done.train}", file=out)  # fmt: skip
    print(f"  train with: --data.datasets '[{{\"name\": \"{done.alias}\", \"dataset_dir\": \"{folder}\"}}]' "
          f"--data.per_device_batch_size {args.per_device_batch_size}", file=out)  # fmt: skip
    return EXIT_OK


def _list(out: TextIO) -> int:
    from ff_core.data.smoke.support import support_table

    table = support_table()
    for profile in PROFILES.values():
        outputs = " + ".join(o.describe() for o in profile.outputs)
        print(f"{profile.name}  -> {outputs}", file=out)
        for alias in (a for a in ALIASES.values() if a.profile == profile.name):
            entry = table[alias.name]
            adapter = alias.adapter + (f" ({alias.variant})" if alias.variant else "")
            status = "served" if entry.served else f"not served: {entry.reason}"
            print(f"  {alias.name}  [{adapter}]  {status}", file=out)
    return EXIT_OK


if __name__ == "__main__":  # `python -m ff_core.cli.smoke prepare ...`
    from ff_core.cli.pipes import pipe_safe

    sys.exit(pipe_safe(lambda: main(sys.argv[1:])))
