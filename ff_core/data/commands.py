"""``ff data ...``: dataset tools that need no weights and no GPU (but ``preprocess``).

``ff data preprocess --config recipe.yaml`` builds a recipe's condition caches ahead of training; it loads the
model (see :mod:`ff_core.data.preprocess`).

``ff data validate DATASET_DIR [--model NAME] [--trainer sft|offline-dpo|grpo] [--split train|test]
[--check-media]`` reads a dataset folder exactly as training would (spec: dataset-guide, "Directory and
split layout", "Offline V2 records", "Common task formats"), checks it against an adapter's IO contract when
``--model`` is given, and with ``--check-media`` opens and decodes every referenced file. Exit status 0 prints
a summary; exit status 2 prints every diagnostic as ``path:line: field: reason``.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

from ff_core.contracts import MediaType, PipelineIOContract
from ff_core.data.media import check_media, missing_files
from ff_core.data.records import Record
from ff_core.data.sources import DatasetConfig, load_split, split_file
from ff_core.data.validation import record_errors
from ff_core.errors import DatasetError

EXIT_OK, EXIT_INVALID = 0, 2


@dataclass
class SplitSummary:
    """What ``ff data validate`` found in one split file.

    Attributes:
        file: the split file's name.
        rows: number of rows.
        supervision: ``demonstration``, ``preference`` or ``generation``.
        media: referenced files by media type (a video's separate soundtrack counts as audio).
        video_seconds: total decoded video duration (with ``--check-media``).
        audio_seconds: total decoded audio duration, soundtracks included (with ``--check-media``).
    """

    file: str
    rows: int
    supervision: str
    media: Counter = field(default_factory=Counter)
    video_seconds: float = 0.0
    audio_seconds: float = 0.0

    def format(self, decoded: bool) -> str:
        media = ", ".join(f"{t.value} {self.media[t]}" for t in MediaType if self.media[t]) or "none"
        text = f"{self.file}: {self.rows} row{'s' if self.rows != 1 else ''}, {self.supervision}; media: {media}"
        if decoded:
            text += f"; decoded video {self.video_seconds:.2f} s, audio {self.audio_seconds:.2f} s"
        return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ff data", description="Dataset tools (no weights, no GPU).")
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="check a dataset folder; exit 2 listing every problem")
    v.add_argument("dataset_dir", help="the dataset folder (train.jsonl|train.txt, optional test.*)")
    v.add_argument("--model", help="adapter name (see `ff plugins`) or dotted path pkg.module:Class")
    v.add_argument("--trainer", choices=["sft", "offline-dpo", "grpo"],
                   help="trainer type (default: detected; V2 records -> their supervision, else generation rows)")
    v.add_argument("--split", choices=["train", "test"], help="one split only (default: train, and test if present)")
    v.add_argument("--check-media", action="store_true", help="open and decode every referenced media file")
    for kind in ("image", "video", "audio"):
        v.add_argument(f"--{kind}-dir", help=f"root of legacy {kind}/{kind}s paths (default: DATASET_DIR/{kind}s)")
    sub.add_parser("preprocess", help="build a recipe's condition caches: ff data preprocess --config recipe.yaml")
    return parser


def main(argv: Sequence[str], out: TextIO | None = None) -> int:
    """Run ``ff data <argv>``; return the exit status.

    Args:
        argv: arguments after ``ff data``.
        out: where to print (default: stdout).
    """
    out = out or sys.stdout
    if list(argv[:1]) == ["preprocess"]:  # a LightningCLI command line: ff_core.data.preprocess parses it
        from ff_core.data.preprocess import main as preprocess

        return preprocess(argv[1:], out)
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:  # argparse already printed usage
        return int(exc.code or 0)
    if args.command == "validate":
        return validate(args, out)
    return EXIT_INVALID  # pragma: no cover - argparse rejects unknown commands


def _contract(model: str | None, out: TextIO) -> tuple[str, PipelineIOContract] | None | int:
    if model is None:
        return None
    from ff_core.plugins import get_adapter_class

    try:
        cls = get_adapter_class(model)
    except KeyError as exc:
        print(f"ff data validate: --model: {exc.args[0]}", file=out)
        return EXIT_INVALID
    return cls.name, cls.io_contract


def validate(args: argparse.Namespace, out: TextIO) -> int:
    """``ff data validate``: read, check and (optionally) decode; print a summary or every diagnostic."""
    contract = _contract(args.model, out)
    if isinstance(contract, int):
        return contract
    cfg = DatasetConfig(name="validate", dataset_dir=args.dataset_dir, image_dir=args.image_dir,
                        video_dir=args.video_dir, audio_dir=args.audio_dir)
    splits = [args.split] if args.split else ["train", "test"]
    errors: list[DatasetError] = []
    summaries: list[SplitSummary] = []
    for split in splits:
        try:
            path = split_file(cfg, split)
            if path is None and split == "test" and args.split is None:
                continue  # the evaluation split is optional
            if path is None and split == "test":
                raise DatasetError(cfg.root, None, None, "no evaluation split (neither test.jsonl nor test.txt exists)")
            records = load_split(cfg, split, args.trainer)
        except DatasetError as exc:
            errors.extend(exc.errors)
            continue
        if contract is not None:
            errors.extend(e for r in records for e in record_errors(r, contract[1]))
        summary, media_errors = _summarise(path.name, records, args.check_media)
        errors.extend(media_errors)
        summaries.append(summary)
    if errors:
        for e in errors:
            print(e.format(), file=out)
        print(f"ff data validate: {len(errors)} problem(s) in {args.dataset_dir}", file=out)
        return EXIT_INVALID
    against = f" against {contract[0]!r}" if contract else " (format only: pass --model to check an adapter's contract)"
    print(f"{args.dataset_dir}: OK{against}", file=out)
    for s in summaries:
        print(f"  {s.format(args.check_media)}", file=out)
    return EXIT_OK


def _summarise(name: str, records: list[Record], decode: bool) -> tuple[SplitSummary, list[DatasetError]]:
    kinds = sorted({r.supervision or "generation" for r in records})
    summary = SplitSummary(name, len(records), ", ".join(kinds))
    errors: list[DatasetError] = []
    for record in records:
        for origin, item in record.media():
            summary.media[item.type] += 1
            if item.audio_path is not None:
                summary.media[MediaType.AUDIO] += 1
            if not decode:
                errors.extend(missing_files(record, origin, item))
                continue
            try:
                found = check_media(item, referenced_by=record.where, field=f"{origin}.path")
            except DatasetError as exc:
                errors.append(exc)
                continue
            summary.video_seconds += found.video_seconds
            summary.audio_seconds += found.audio_seconds
    return summary, errors


if __name__ == "__main__":  # `python -m ff_core.data.commands validate ...` skips the Lightning CLI imports
    sys.exit(main(sys.argv[1:]))
