"""``ff data preprocess-latents --config recipe.yaml --output ROOT``: a training split as tensor-parquet shards.

For every training record of the recipe (read and validated exactly as ``ff fit`` reads it), the adapter the recipe
loads computes what a training step would: ``preprocess`` (the condition: text embeddings, condition media) and
``encode_output`` of the decoded target fitted to ``output_geometry()`` (the clean latents; both arms of a
preference pair, under the latent columns prefixed ``chosen_`` and ``rejected_``). Each record becomes one
row of ``ROOT/worker_0/data_chunk_<i>.parquet`` (:class:`~ff_core.data.tensor_parquet.TensorParquetWriter`), its
tensors under the adapter's :attr:`~ff_core.adapter.Adapter.tensor_columns` names, plus the scalars ``prompt`` and
``source`` (``file:line`` of the record). A recipe with ``data.datasets: [{tensor_parquet_dir: ROOT}]`` then trains
without text encoders or VAE encodes (docs/datasets.md, "Training from tensor-parquet shards").

The latents are what the adapter's ``encode_output`` returns in training, given a generator seeded by ``(--seed,
first row of the batch)``: the same command writes the same shards. LTX-2 and MiniMax H3 take the VAE posterior's
mode by default (adapter kwarg ``target_posterior: mode``, their reference trainers'), so ``--seed`` changes nothing
for them; SD3 and Wan take a seeded posterior sample, as their training scripts do (diffusers'
``train_dreambooth_sd3.py``: ``latent_dist.sample()``), one fixed draw per record reused every epoch (their VAE
posteriors are narrow, so it is close to the mode).

The shards are written into a hidden folder beside ``ROOT`` and published by one rename when every row is written:
an interrupted run leaves no partial dataset, and an existing non-empty ``ROOT`` is refused unless ``--overwrite``.
A full disk (``ENOSPC``, quota, file-size limit) removes the hidden folder and ends in one line naming ``ROOT``
(:class:`~ff_core.disk_full.DiskFullError`), exit 2; a rerun with space starts clean.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch

from ff_core.atomic import remove_leftovers, replace_dir
from ff_core.cli.preprocess import EXIT_INVALID, EXIT_OK, human_size, read_recipe
from ff_core.data.tensor_parquet.provenance import shard_provenance
from ff_core.disk_full import DiskFullError, disk_full_error, is_disk_full

if TYPE_CHECKING:
    from ff_core.adapter import Adapter
    from ff_core.contracts import TensorColumns
    from ff_core.data.records import Record

USAGE = ("ff data preprocess-latents --config recipe.yaml --output ROOT [--overwrite] [--rows-per-file N] "
         "[--dtype bfloat16|float32|float16|float8_e4m3fn|keep] [--compression CODEC] [--seed N] "
         "[--section.key value ...]")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16,
          "float8_e4m3fn": torch.float8_e4m3fn, "keep": None}
# The largest finite FP8 E4M3 value: a latent beyond it cannot be stored in float8_e4m3fn (normalised latents, a few
# units at most, never come near it; a raw, unnormalised one might).
FP8_MAX = 448.0
SCALARS = ("prompt", "source")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        # allow_abbrev off: the arguments it does not know are LightningCLI's (--data.seed is not --seed)
        prog="ff data preprocess-latents", usage=USAGE, add_help=False, allow_abbrev=False,
        description="Write a recipe's training split as tensor-parquet shards: per record the condition "
                    "adapter.preprocess returns and the clean latents adapter.encode_output returns "
                    "(docs/datasets.md, \"ff data preprocess-latents\"). Every other argument is the recipe's, as for "
                    "ff fit (--config, --data.*, --model.*).")
    parser.add_argument("--output", required=True, help="the shard root to create (must be absent or empty)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    parser.add_argument("--rows-per-file", type=int, default=64, help="rows per parquet file (default 64)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16",
                        help="store floating-point tensors in this dtype (default bfloat16, the card's storage); "
                             "float8_e4m3fn: the latent columns in FP8 E4M3, the other floating tensors in bfloat16; "
                             "keep: as the adapter computes them (docs/datasets.md, \"Storage\")")
    parser.add_argument("--compression", default=None, help="parquet codec (zstd, snappy, ...; default none)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the VAE posterior samples (default 0)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str], out: TextIO | None = None) -> int:
    """Run ``ff data preprocess-latents <argv>``; return the exit status.

    Args:
        argv: arguments after ``ff data preprocess-latents``: its own flags, then LightningCLI's (``--config``,
            ``--data.*``, ``--model.*``).
        out: where to print (default: stdout).
    """
    out = out or sys.stdout
    if not argv or argv[0] in ("-h", "--help"):
        print(_parser().format_help() if argv else f"usage: {USAGE}", file=out)
        return EXIT_OK if argv else EXIT_INVALID
    try:
        args, rest = _parser().parse_known_args(list(argv))
    except SystemExit as exc:  # argparse printed the problem
        return int(exc.code or EXIT_INVALID)
    if args.rows_per_file < 1:
        print(f"ff data preprocess-latents: --rows-per-file must be >= 1, got {args.rows_per_file}", file=out)
        return EXIT_INVALID
    output = Path(args.output).expanduser()
    if output.is_symlink():  # a linked ROOT: its temporaries and the swap live beside the target (replace_dir)
        output = output.resolve()
    remove_leftovers(output)  # an interrupted run's temporaries; a swap it left half done is put back first
    if output.exists() and (not output.is_dir() or any(output.iterdir())) and not args.overwrite:
        print(f"ff data preprocess-latents: --output {output}: exists and is not empty; pass --overwrite to replace "
              "it", file=out)
        return EXIT_INVALID
    recipe = read_recipe(rest, out)
    if isinstance(recipe, int):
        return recipe
    cli, data, model = recipe
    if data.trainer_type not in ("sft", "offline-dpo"):
        print(f"ff data preprocess-latents: the recipe trains {data.trainer_type!r}; only the offline trainers' "
              "datasets (demonstrations, preference pairs) are stored as latents", file=out)
        return EXIT_INVALID
    if data.train_rows is not None:
        print("ff data preprocess-latents: the recipe already trains from tensor-parquet shards", file=out)
        return EXIT_INVALID
    if model.adapter_cls.tensor_columns is None:
        print(f"ff data preprocess-latents: adapter {model.adapter_cls.name!r} declares no tensor_columns", file=out)
        return EXIT_INVALID
    provenance = shard_provenance(model.adapter_cls, model.pretrained_model_name_or_path, model.adapter_kwargs,
                                  data._supervision, {"dtype": args.dtype, "seed": args.seed})  # fmt: skip
    model.configure_model()  # no trainer attached: loads the adapter without preparing conditions
    adapter = model.adapter
    adapter.frozen_to(cli.trainer.strategy.root_device)
    try:
        rows = write_latent_shards(
            adapter, data.train_records, output, batch_size=data._preprocess_batch_size(adapter),
            rows_per_file=args.rows_per_file, dtype=DTYPES[args.dtype], compression=args.compression, seed=args.seed,
            progress=not args.no_progress, provenance=provenance,
        )
    except (DiskFullError, StorageError) as exc:  # one line; write_latent_shards removed its hidden folder
        print(f"ff data preprocess-latents: {exc}", file=out)
        return EXIT_INVALID
    size = sum(f.stat().st_size for f in output.rglob("*.parquet"))
    print(f"wrote {rows} rows to {output} ({human_size(size)})", file=out)
    return EXIT_OK


def write_latent_shards(
    adapter: Adapter,
    records: Sequence[Record],
    output: Path,
    *,
    batch_size: int = 8,
    rows_per_file: int = 64,
    dtype: torch.dtype | None = None,
    compression: str | None = None,
    seed: int = 0,
    progress: bool | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> int:
    """Encode ``records`` with ``adapter`` and publish them as tensor-parquet shards at ``output`` (replaced whole).

    Returns the number of rows written.

    Args:
        adapter: the loaded adapter (its preprocessing components and VAE on the device to run on).
        records: demonstration (or preference) records, validated against the adapter's contract.
        output: the shard root to publish.
        batch_size: records per ``preprocess`` / ``encode_output`` call.
        rows_per_file: rows per parquet file.
        dtype: floating-point tensors are stored in this dtype (``None``: as computed); ``torch.float8_e4m3fn``
            stores the latent columns in FP8 E4M3 and the other floating tensors in bfloat16.
        compression: parquet codec (``None``: uncompressed).
        seed: seed of the VAE posterior samples; batch ``[i, i + batch_size)`` draws from ``derive_seed(seed, i)``.
        progress: show a progress bar (``None``: only on a terminal).
        provenance: what the shards are written for (:func:`~ff_core.data.tensor_parquet.provenance.
            shard_provenance`), stored in every file's footer and checked by ``ff fit``; ``None``: none stored.
    """
    from tqdm.auto import tqdm

    if output.is_symlink():  # the shards land at the link's target; the temporary must lie beside it (replace_dir)
        output = output.resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    tmp.chmod(0o755)
    writer = None
    try:
        with tqdm(total=len(records), desc=f"encoding {output.name}", unit="row",
                  disable=None if progress is None else not progress) as bar:
            for start in range(0, len(records), batch_size):
                batch = records[start : start + batch_size]
                for row in encode_rows(adapter, batch, start, seed, dtype):
                    if writer is None:
                        writer = _writer(tmp, row, rows_per_file, compression, provenance)
                    writer.write(row)
                bar.update(len(batch))
        if writer is not None:
            writer.close()
        replace_dir(tmp, output)
    except BaseException as exc:
        if writer is not None:
            writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc):
            raise disk_full_error(exc, output, f"the tensor-parquet shards of {output}",
                                  f"the partial folder {tmp.name}") from None  # fmt: skip
        raise
    return len(records)


def _writer(root: Path, row: dict[str, Any], rows_per_file: int, compression: str | None,
            provenance: Mapping[str, Any] | None = None):  # fmt: skip
    import pyarrow as pa

    from ff_core.data.tensor_parquet import TensorParquetWriter, tensor_schema
    from ff_core.data.tensor_parquet.provenance import encode_provenance

    tensors = [k for k in row if k not in SCALARS]
    schema = tensor_schema({"prompt": pa.string(), "source": pa.string()}, tensors)
    if provenance is not None:
        schema = schema.with_metadata(encode_provenance(provenance))
    return TensorParquetWriter(root, schema, rows_per_file=rows_per_file, compression=compression)


@torch.no_grad()
def encode_rows(
    adapter: Adapter, records: Sequence[Record], start: int, seed: int, dtype: torch.dtype | None = None
) -> list[dict[str, Any]]:
    """The shard rows of one batch of records: the condition ``preprocess`` returns and the clean latents
    ``encode_output`` returns for the target fitted to ``output_geometry()``, under the adapter's column names. A
    preference record's two arms are encoded in turn and stored under the latent columns prefixed ``chosen_`` and
    ``rejected_``.

    Args:
        adapter: the loaded adapter.
        records: demonstration records, or preference records (not both).
        start: the first record's position in the split (seeds the posterior samples: ``derive_seed(seed, start)``
            for a target, ``derive_seed(seed, start, 1)`` and ``(..., 2)`` for the chosen and rejected arms).
        seed: the run's seed.
        dtype: floating-point tensors are stored in this dtype (``None``: as computed).
    """
    from ff_core.contracts import LATENT_BATCH_KEYS
    from ff_core.data.cache.collation import collate_conditions
    from ff_core.data.dataflow import derive_seed
    from ff_core.data.media.conditions import condition_input
    from ff_core.data.samples import ConditionedRecord, RecordProcessor

    conditions = adapter.preprocess([condition_input(r, adapter.io_contract) for r in records])
    processor = RecordProcessor(adapter.output_geometry())  # the training loader's decoding and fitting
    samples = [processor.process(ConditionedRecord(start + k, r, {})) for k, r in enumerate(records)]
    # Collated as the training loader collates them (variable-length text embeddings padded per batch).
    prepared = adapter.prepare_condition(collate_conditions(conditions, adapter.condition_collation,
                                                            [f"{r.source}:{r.line}" for r in records]))
    preference = "chosen" in samples[0]
    arms = {"target": ("", (seed, start))} if not preference else {
        "chosen": (LATENT_BATCH_KEYS["preference"]["chosen_latents"], (seed, start, 1)),
        "rejected": (LATENT_BATCH_KEYS["preference"]["rejected_latents"], (seed, start, 2))}
    columns: TensorColumns = adapter.tensor_columns
    rows = [{"prompt": r.prompt, "source": f"{r.source}:{r.line}"} for r in records]
    latent_columns = {prefix + c for prefix, _ in arms.values() for c in columns.latents}
    for key, (prefix, seeds) in arms.items():
        generator = torch.Generator().manual_seed(derive_seed(*seeds))
        clean = adapter.encode_output([s[key] for s in samples], prepared, generator=generator)
        for k, row in enumerate(rows):
            latents = {name: value[k] for name, value in clean.components.items()}
            for name, t in columns.to_row(conditions[k], latents, prefix).items():
                row[name] = _stored(t, dtype, name in latent_columns, f"{records[k].source}:{records[k].line}", name)
    return rows


class StorageError(ValueError):
    """A tensor cannot be stored in the requested dtype (a latent beyond FP8's range)."""


def _stored(t: torch.Tensor, dtype: torch.dtype | None, latent: bool, where: str, column: str) -> torch.Tensor:
    """``t`` on the CPU in its storage dtype: FP8 for latent columns only (other floating tensors then in bfloat16:
    text embeddings have outliers FP8 would clip), after a range check."""
    t = t.detach().cpu()
    if dtype is None or not t.is_floating_point():
        return t.contiguous()
    if dtype == torch.float8_e4m3fn:
        if not latent:
            return t.to(torch.bfloat16).contiguous()
        peak = float(t.float().abs().max()) if t.numel() else 0.0
        if not peak <= FP8_MAX:  # NaN too
            raise StorageError(f"{where}: {column} reaches |x| = {peak:g}, beyond float8_e4m3fn's {FP8_MAX:g}; store "
                               "this dataset with --dtype bfloat16")
    return t.to(dtype).contiguous()
