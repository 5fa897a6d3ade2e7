"""``ff data ...``: dataset tools that need no weights and no GPU (but ``preprocess``).

``ff data preprocess --config recipe.yaml`` builds a recipe's condition caches ahead of training; it loads the
model (see :mod:`ff_core.cli.preprocess`). ``ff data smoke {build,prepare,list}``: the offline smoke datasets
(:mod:`ff_core.cli.smoke`).

``ff data validate DATASET_DIR [--model NAME] [--trainer sft|offline-dpo|grpo] [--split train|test]
[--check-media]`` reads a dataset folder exactly as training would (spec: dataset-guide, "Directory and
split layout", "Offline V2 records", "Common task formats"), checks it against an adapter's IO contract when
``--model`` is given, and with ``--check-media`` opens and decodes every referenced file. Exit status 0 prints
a summary (with the reward-metadata columns legacy rows carry, so a misspelt column is visible); exit status 2
prints every diagnostic as ``path:line: field: reason``. Warnings (``path:line: warning: field: reason``) name
what was kept but deserves a look, and never change the exit status.

``ff data inspect DATASET_DIR [--split train|test] [--json]`` describes each split (rows, formats, metadata
keys, media per role and type, header ranges of the files; :mod:`ff_core.cli.inspection`). Problems that stop
it reading (a missing split, a bad row, a missing or unreadable file) are printed as ``validate`` prints them,
with exit status 2.

Both commands also take a tensor-parquet root (a folder with parquet files below it and no ``train.*`` split
file; spec: tensor-parquet-dataset-card): ``inspect`` reports files, rows, row groups, columns with dtypes and
shape ranges and bytes per row; ``validate [--schema t2v|i2v|i2v_track] [--check-media]`` exits 2 on schema and
row problems, each naming file, row and column (``--check-media`` also reads every ``_bytes`` value to check its
length; :mod:`ff_core.data.tensor_parquet.inspect`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ff_core.cli.inspection import SplitInspection, inspect_split
from ff_core.contracts import MediaType, PipelineIOContract
from ff_core.data.media.decode import check_media, missing_files
from ff_core.data.records import Record
from ff_core.data.records.legacy import closest_column
from ff_core.data.records.sources import DatasetConfig, Split, folder_error, load_split, split_file
from ff_core.data.records.validation import conform, record_errors, record_warnings
from ff_core.data.tensor_parquet.format import I2V_SCHEMA, I2V_TRACK_SCHEMA, T2V_SCHEMA
from ff_core.data.tensor_parquet.inspect import inspect_tensor_parquet, is_tensor_parquet_root
from ff_core.errors import DatasetError, DatasetWarning

EXIT_OK, EXIT_INVALID = 0, 2
CARD_SCHEMAS = {"t2v": T2V_SCHEMA, "i2v": I2V_SCHEMA, "i2v_track": I2V_TRACK_SCHEMA}
# `ff data` subcommands and their one-line help (also listed by `ff --help`).
DATA_COMMANDS = {
    "validate": "check a dataset folder (optionally against an adapter); exit 2 listing every problem",
    "inspect": "describe a dataset folder: rows, formats, metadata, media per role, sizes/durations/rates",
    "preprocess": "build a recipe's condition caches ahead of training: ff data preprocess --config recipe.yaml",
    "preprocess-latents": "write a recipe's training split as tensor-parquet shards (conditions + clean latents): "
                          "ff data preprocess-latents --config recipe.yaml --output ROOT",
    "smoke": "the offline smoke datasets: ff data smoke build OUT | prepare --algorithm A --profile P --world-size N "
             "| list",
}


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
        metadata: how many legacy rows carry each reward-metadata key (their extra columns and ``metadata`` keys).
    """

    file: str
    rows: int
    supervision: str
    media: Counter = field(default_factory=Counter)
    video_seconds: float = 0.0
    audio_seconds: float = 0.0
    metadata: Counter = field(default_factory=Counter)

    def format(self, decoded: bool) -> str:
        """One line, plus an indented ``metadata:`` line when legacy rows carry reward metadata."""
        media = ", ".join(f"{t.value} {self.media[t]}" for t in MediaType if self.media[t]) or "none"
        text = f"{self.file}: {_rows(self.rows)}, {self.supervision}; media: {media}"
        if decoded:
            text += f"; decoded video {self.video_seconds:.2f} s, audio {self.audio_seconds:.2f} s"
        if self.metadata:
            text += "\n    metadata: " + ", ".join(_metadata_key(k, n) for k, n in sorted(self.metadata.items()))
        return text


def _rows(n: int) -> str:
    return f"{n} row{'s' if n != 1 else ''}"


def _metadata_key(key: str, rows: int) -> str:
    # A column one edit away from a known column is most likely a typo that silently became metadata.
    near = closest_column(key)
    return f"{key} ({_rows(rows)}; did you mean {near!r}?)" if near else f"{key} ({_rows(rows)})"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ff data", description="Dataset tools (no weights, no GPU).")
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help=DATA_COMMANDS["validate"], description=DATA_COMMANDS["validate"])
    _dataset_arguments(v)
    v.add_argument("--model", help="adapter name (see `ff plugins`) or dotted path pkg.module:Class")
    v.add_argument("--pretrained", metavar="PATH",
                   help="with --model: the checkpoint (folder or hub id) whose contract applies, read from its config "
                   "files only (families whose checkpoints differ, e.g. Wan I2V variants); default: the adapter's")
    v.add_argument("--adapter-kwargs", metavar="JSON",
                   help="with --model: the recipe's model.adapter_kwargs as a JSON object (clip geometry), checked; "
                   "every target's header is checked against the clip the adapter cuts (too-short video or audio); "
                   "default: {} (the adapter's defaults)")
    v.add_argument("--trainer", choices=["sft", "offline-dpo", "grpo", "nft"],
                   help="trainer type (default: detected; V2 records -> their supervision, else generation rows)")
    v.add_argument("--check-media", action="store_true", help="open and decode every referenced media file "
                   "(tensor-parquet: read every _bytes value and check its length)")
    v.add_argument("--schema", choices=sorted(CARD_SCHEMAS),
                   help="tensor-parquet roots: the card's schema the files must have")
    i = sub.add_parser("inspect", help=DATA_COMMANDS["inspect"], description=DATA_COMMANDS["inspect"])
    _dataset_arguments(i)
    i.add_argument("--json", action="store_true", help="print one JSON object (for scripts) instead of text")
    i.add_argument("--model", help="also print this adapter's IO contract (name or dotted path pkg.module:Class)")
    i.add_argument("--pretrained", metavar="PATH", help="with --model: the checkpoint whose contract is printed, "
                   "read from its config files only")
    sub.add_parser("preprocess", help=DATA_COMMANDS["preprocess"])
    sub.add_parser("preprocess-latents", help=DATA_COMMANDS["preprocess-latents"])
    sub.add_parser("smoke", help=DATA_COMMANDS["smoke"])
    return parser


def _dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every dataset command shares: the folder, ``--split`` and the media-root overrides."""
    parser.add_argument("dataset_dir", help="the dataset folder (train.jsonl|train.txt, optional test.*), "
                        "or a tensor-parquet root (parquet files below it)")
    parser.add_argument("--split", choices=["train", "test"],
                        help="one split only (default: train, and test if present)")
    for kind in ("image", "video", "audio"):
        parser.add_argument(f"--{kind}-dir", help=f"root of legacy {kind}/{kind}s paths (default: DATASET_DIR/{kind}s)")


def main(argv: Sequence[str], out: TextIO | None = None) -> int:
    """Run ``ff data <argv>``; return the exit status.

    Args:
        argv: arguments after ``ff data``.
        out: where to print (default: stdout).
    """
    out = out or sys.stdout
    if list(argv[:1]) == ["preprocess"]:  # a LightningCLI command line: ff_core.cli.preprocess parses it
        from ff_core.cli.preprocess import main as preprocess

        return preprocess(argv[1:], out)
    if list(argv[:1]) == ["preprocess-latents"]:  # its own flags, then a LightningCLI command line
        from ff_core.cli.preprocess_latents import main as preprocess_latents

        return preprocess_latents(argv[1:], out)
    if list(argv[:1]) == ["smoke"]:  # its own subcommands (ff_core.cli.smoke)
        from ff_core.cli.smoke import main as smoke

        return smoke(argv[1:], out)
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:  # argparse already printed usage
        return int(exc.code or 0)
    if args.command == "validate":
        return validate(args, out)
    if args.command == "inspect":
        return inspect(args, out)
    return EXIT_INVALID  # pragma: no cover - argparse rejects unknown commands


def _contract(
    model: str | None, out: TextIO, pretrained: str | None = None, adapter_kwargs: str | None = None
) -> tuple[str, PipelineIOContract] | None | int:
    if model is None:
        if pretrained is not None:
            print("ff data: --pretrained needs --model", file=out)
            return EXIT_INVALID
        if adapter_kwargs is not None:
            print("ff data: --adapter-kwargs needs --model", file=out)
            return EXIT_INVALID
        return None
    from ff_core.pretrained import resolve_contract

    found = _resolve(model, pretrained, resolve_contract, out)
    return found if isinstance(found, int) else (found[0].name, found[1])


def _output_geometry(args: argparse.Namespace, out: TextIO) -> tuple[Any, ...] | None | int:
    """``--adapter-kwargs`` checked (:func:`ff_core.pretrained.check_adapter_kwargs`) and the adapter's output geometry
    from them (:meth:`~ff_core.adapter.Adapter.resolve_output_geometry`), or the exit status after printing why not."""
    from ff_core.errors import ConfigError
    from ff_core.plugins import get_adapter_class
    from ff_core.pretrained import check_adapter_kwargs, resolve_output_geometry

    try:
        kwargs = json.loads(args.adapter_kwargs) if args.adapter_kwargs else {}
    except json.JSONDecodeError as exc:
        print(f"ff data validate: --adapter-kwargs: not JSON: {exc}", file=out)
        return EXIT_INVALID
    if not isinstance(kwargs, dict):
        print(f"ff data validate: --adapter-kwargs: expected a JSON object, got {args.adapter_kwargs}", file=out)
        return EXIT_INVALID
    cls = get_adapter_class(args.model)
    try:
        check_adapter_kwargs(cls, args.pretrained, kwargs, key="--pretrained")
        return resolve_output_geometry(cls, args.pretrained, kwargs, key="--pretrained")
    except ConfigError as exc:
        print(f"ff data validate: {exc}", file=out)
        return EXIT_INVALID


def _resolve(model: str, pretrained: str | None, resolver: Any, out: TextIO) -> tuple[type, Any] | int:
    """``(adapter class, resolver(class, pretrained))`` for ``--model`` / ``--pretrained`` (a contract or tensor
    columns read from the checkpoint's config, no weights), or the exit status after printing why not."""
    from ff_core.errors import ConfigError
    from ff_core.plugins import get_adapter_class

    try:
        cls = get_adapter_class(model)
    except KeyError as exc:
        print(f"ff data validate: --model: {exc.args[0]}", file=out)
        return EXIT_INVALID
    try:
        return cls, resolver(cls, pretrained, None, key="--pretrained")
    except ConfigError as exc:
        print(f"ff data validate: {exc}", file=out)
        return EXIT_INVALID


def _dataset(args: argparse.Namespace) -> DatasetConfig:
    """The ``data.datasets`` entry the command line describes, named after its folder (for messages)."""
    name = Path(args.dataset_dir).expanduser().resolve().name or args.dataset_dir
    return DatasetConfig(name=name, dataset_dir=args.dataset_dir, image_dir=args.image_dir,
                         video_dir=args.video_dir, audio_dir=args.audio_dir)


def read_splits(
    cfg: DatasetConfig, only: Split | None, trainer: str | None = None
) -> tuple[list[tuple[Split, Path, list[Record]]], list[DatasetError]]:
    """Read ``only`` that split, or ``train`` and (when present) ``test``, exactly as training would.

    Returns:
        ``(split, file, records)`` of each split that could be read, and the problems of the others.
    """
    read: list[tuple[Split, Path, list[Record]]] = []
    missing = folder_error(cfg)  # a missing folder is one problem, not one per split
    if missing:
        return read, [missing]
    errors: list[DatasetError] = []
    for split in [only] if only else ["train", "test"]:
        try:
            path = split_file(cfg, split)
            if path is None and split == "test" and only is None:
                continue  # the evaluation split is optional
            if path is None and split == "test":
                reason = f"dataset {cfg.name!r}: no evaluation split (neither test.jsonl nor test.txt exists)"
                raise DatasetError(cfg.root, None, None, reason)
            records = load_split(cfg, split, trainer)
        except DatasetError as exc:
            errors.extend(exc.errors)
            continue
        read.append((split, path, records))
    return read, errors


def validate(args: argparse.Namespace, out: TextIO) -> int:
    """``ff data validate``: read, check and (optionally) decode; print a summary or every diagnostic."""
    if is_tensor_parquet_root(args.dataset_dir):
        return _tensor_parquet(args, out, "validate")
    contract = _contract(args.model, out, args.pretrained, args.adapter_kwargs)
    if isinstance(contract, int):
        return contract
    geometry = _output_geometry(args, out) if contract is not None else None
    if isinstance(geometry, int):
        return geometry
    splits, errors = read_splits(_dataset(args), args.split, args.trainer)
    warnings: list[DatasetWarning] = []
    notes: list[DatasetWarning] = []  # rows the adapter accepts but changes (audio padded with silence)
    summaries: list[SplitSummary] = []
    for split, path, records in splits:
        if contract is not None:
            errors.extend(e for r in records for e in record_errors(r, contract[1]))
            warnings.extend(w for r in records for w in record_warnings(r, contract[1], contract[0]))
            records = [conform(r, contract[1]) for r in records]  # what the adapter will see, as in training
        before = len(errors)
        summary, media_errors = _summarise(path.name, records, args.check_media)
        errors.extend(media_errors)
        # The headers of files that exist, in records that hold; of the training split only, as `ff fit` checks them
        # (evaluation splits hold legacy prompt rows, without targets: target_span_errors would skip them anyway).
        if geometry and split == "train" and len(errors) == before:
            from ff_core.data.datamodule import cache_root
            from ff_core.data.media.target_spans import target_span_problems

            span_errors, span_notes = target_span_problems(records, geometry, cache_dir=cache_root())  # `ff fit`
            errors.extend(span_errors)  # reuses the headers
            notes.extend(span_notes)
        summaries.append(summary)
    return _report(args, contract, summaries, errors, [*_grouped(warnings), *notes], out)


def _report(args: argparse.Namespace, contract: tuple[str, PipelineIOContract] | None,
            summaries: list[SplitSummary], errors: list[DatasetError], warnings: list[DatasetWarning],
            out: TextIO) -> int:
    if errors:
        _print_problems("validate", [*errors, *warnings], args.dataset_dir, out, count=len(errors))
        return EXIT_INVALID
    against = f" against {contract[0]!r}" if contract else " (format only: pass --model to check an adapter's contract)"
    print(f"{args.dataset_dir}: OK{against}", file=out)
    for s in summaries:
        print(f"  {s.format(args.check_media)}", file=out)
    for w in warnings:
        print(w.format(), file=out)
    return EXIT_OK


def _grouped(warnings: list[DatasetWarning], shown: int = 5) -> list[DatasetWarning]:
    """One warning per (file, field, reason), at its first line, naming the rows it covers."""
    groups: dict[tuple[str, str | None, str], list[int]] = {}
    for w in warnings:
        groups.setdefault((w.path, w.field, w.reason), []).append(w.line or 0)
    out = []
    for (path, fld, reason), lines in groups.items():
        if len(lines) > 1:
            listed = ", ".join(map(str, lines[:shown])) + (", ..." if len(lines) > shown else "")
            reason = f"{reason} ({len(lines)} rows: lines {listed})"
        out.append(DatasetWarning(path, lines[0], fld, reason))
    return out


def inspect(args: argparse.Namespace, out: TextIO) -> int:
    """``ff data inspect``: per split, what the rows and their media files hold (text, or ``--json``)."""
    if is_tensor_parquet_root(args.dataset_dir):
        return _tensor_parquet(args, out, "inspect")
    contract = _contract(args.model, out, args.pretrained)
    if isinstance(contract, int):
        return contract
    splits, errors = read_splits(_dataset(args), args.split)
    found: list[SplitInspection] = []
    for split, path, records in splits:
        summary, media_errors = inspect_split(split, path, records)
        found.append(summary)
        errors.extend(media_errors)
    if args.json:
        report = {"dataset_dir": args.dataset_dir, "splits": [s.to_json() for s in found],
                  "errors": [_error_json(e) for e in errors]}
        if contract is not None:
            report["contract"] = {"adapter": contract[0], "pretrained": args.pretrained,
                                  "describe": contract[1].describe()}
        print(json.dumps(report, indent=2), file=out)
        return EXIT_INVALID if errors else EXIT_OK
    print(args.dataset_dir, file=out)
    if contract is not None:
        at = f" at {args.pretrained}" if args.pretrained else ""
        print(f"  contract of {contract[0]!r}{at}: {contract[1].describe()}", file=out)
    for summary in found:
        print("\n".join(f"  {line}" for line in summary.format()), file=out)
    if errors:
        _print_problems("inspect", errors, args.dataset_dir, out)
        return EXIT_INVALID
    return EXIT_OK


def _tensor_parquet(args: argparse.Namespace, out: TextIO, command: str) -> int:
    """``inspect`` / ``validate`` of a tensor-parquet root: the report, or every problem and exit status 2."""
    schema = CARD_SCHEMAS[args.schema] if getattr(args, "schema", None) else None
    report, errors = inspect_tensor_parquet(args.dataset_dir, schema, getattr(args, "check_media", False))
    if getattr(args, "model", None) and not errors:  # the columns the adapter trains from (docs/plugins.md)
        found = _model_columns(args.model, args.dataset_dir, out, getattr(args, "pretrained", None))
        if isinstance(found, int):
            return found
        errors += found
    if getattr(args, "json", False):
        print(json.dumps({**report.to_json(), "errors": [_error_json(e) for e in errors]}, indent=2), file=out)
    elif command == "inspect" or not errors:
        header = f"{args.dataset_dir}: OK (tensor-parquet" + (f", schema {args.schema})" if schema else ")")
        print(header if command == "validate" else args.dataset_dir, file=out)
        print("\n".join(f"  {line}" for line in report.format()), file=out)
    if errors and not getattr(args, "json", False):
        _print_problems(command, errors, args.dataset_dir, out)
    return EXIT_INVALID if errors else EXIT_OK


def _model_columns(model: str, root: str, out: TextIO, pretrained: str | None = None) -> list[DatasetError] | int:
    """``validate --model`` on a tensor-parquet root: the tensor columns the adapter trains from that it lacks."""
    from ff_core.data.tensor_parquet import TensorParquetDataset
    from ff_core.data.tensor_parquet.rows import column_problems
    from ff_core.pretrained import resolve_tensor_columns

    found = _resolve(model, pretrained, resolve_tensor_columns, out)
    if isinstance(found, int):
        return found
    cls, columns = found
    if columns is None:
        return [DatasetError(root, None, None, f"adapter {cls.name!r} declares no tensor_columns: it cannot train "
                             "from tensor-parquet shards")]
    return column_problems(TensorParquetDataset(root), columns, cls.name)


def _print_problems(command: str, problems: list[DatasetError], dataset_dir: str, out: TextIO,
                    count: int | None = None) -> None:
    """Every problem (errors, then any warnings), then the count of errors (``count``; default: all of them)."""
    for e in problems:
        print(e.format(), file=out)
    print(f"ff data {command}: {len(problems) if count is None else count} problem(s) in {dataset_dir}", file=out)


def _error_json(error: DatasetError) -> dict[str, Any]:
    return {"path": error.path, "line": error.line, "field": error.field, "reason": error.reason,
            "message": error.format()}


def _summarise(name: str, records: list[Record], decode: bool) -> tuple[SplitSummary, list[DatasetError]]:
    kinds = sorted({r.supervision or "generation" for r in records})
    summary = SplitSummary(name, len(records), ", ".join(kinds))
    errors: list[DatasetError] = []
    for record in records:
        if record.schema == "legacy":
            summary.metadata.update(record.metadata.keys())
        for _, item in record.media():
            summary.media[item.type] += 1
            if item.audio_path is not None:
                summary.media[MediaType.AUDIO] += 1
            if not decode:
                errors.extend(missing_files(record, item))
                continue
            try:
                found = check_media(item, referenced_by=record.where)
            except DatasetError as exc:
                errors.extend(exc.errors)
                continue
            summary.video_seconds += found.video_seconds
            summary.audio_seconds += found.audio_seconds
    return summary, errors


if __name__ == "__main__":  # `python -m ff_core.cli.data validate ...`: `ff data` without the `ff` dispatch
    from ff_core.cli.pipes import pipe_safe

    sys.exit(pipe_safe(lambda: main(sys.argv[1:])))
