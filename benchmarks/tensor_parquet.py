"""Tensor-parquet random reads: the card's recipe, a whole-row-group reader, ff's reader, and memory copy.

Run: ``python benchmarks/tensor_parquet.py [--gb 2] [--seconds 4] [--workdir DIR] [--quick] [--layouts ff]
[--loader-only] [--training-only [--repeat N]]``. Prints markdown tables (``--layouts ff``: only ff's layout, the
copy ceilings and the memory figures; ``--loader-only``: only the DataLoader tables; ``--training-only``: only ff's
layout written and the training loader table, measured N times). Shards are
generated in a temporary folder (removed at the end) in two layouts holding the same rows:

* ``reference``: as the reference writer writes them: one row group per chunk file of ``--group-rows`` rows
  (16), pyarrow's ``write_table`` defaults otherwise (snappy, dictionary attempted);
* ``ff``: :class:`TensorParquetWriter`: one row per row group, 64 rows a file, uncompressed.

Rows have the card's columns at about 10 MB (bf16 latents 16x16x60x104 twice, text L x 4096 with L in 64..191,
CLIP 257x1280, tracks 121x2500x2 and 121x2500, float32 ids and weights): ``--gb 2`` is 200 rows per layout.
Files are read warm (from the page cache, as after the first epoch): the figures are decoding costs, not disk.

Readers, each over a random permutation of the rows (the same one), for at most ``--seconds`` each, best of three
rounds (each from a freshly opened dataset; the machine may be shared):

* ``card recipe``: the card's ``pq.read_table(file).slice(k, 1).to_pylist()`` + ``torch.frombuffer(bytearray)``;
* ``whole row group``: like the reference loader, decode the row's whole row group, all columns, to Python, and
  take the row (the reference loader also ignores ``_dtype``; this one honours it, which costs nothing);
* ``ff``: ``TensorParquetDataset[i]`` (one row group, requested columns, ``_bytes`` values read from their pages);
* ``ff pyarrow``: the same with ``direct=False`` (every column decoded by pyarrow: the path before the page reader);
* ``ff file ranges``: ``TensorParquetDataset.describe(i)``: the row located and checked, its uncompressed tensors
  as file ranges that the consumption reads straight into its buffer (one copy from the page cache: what the
  training loader does, ``data.hand_off``, with or without workers); ``, no catalogue``: the same without row
  catalogues (``catalogue=False``: each file's small columns decoded and its page headers parsed again in every
  new process, as on a dataset's first epoch), else the catalogues the first round stored serve every later one;
* ``ff two-level``: ff over :func:`two_level_order` (window 4, 4 cached groups) instead of a full permutation;
* ``memcpy``: copying each row's bytes between two RAM buffers (``ctypes.memmove``), the ceiling of any reader that
  returns memory it owns; ``pread``: reading each row's byte range of a file into a reused buffer (kernel copy from
  the page cache).

Every reader is charged the same consumption: each tensor of each row it returns is copied once into one reused
destination buffer (what a collate into a batch buffer does), timed apart from the read (``consume`` column); for
``memcpy``/``pread`` the consumption is one more ``memmove`` of the row. A reader returning views it did not copy
(a zero-copy reader) pays its page faults there instead of in its read, so compare ``read + consume`` across readers.
``cpu`` is the process CPU time per row of read + consume: on a shared machine it moves less with other jobs than the
wall time does.

``DataLoader``: ff with 0 (main process), 1 and 2 workers (``batch_size=None``), rows crossing either in shared
memory (a worker reads each row into one shared-memory buffer, which crosses to the main process as one segment) or
as file ranges (``hand_off=True``: a worker locates and checks the row, the main process ``pread`` s its
uncompressed tensors when it materialises the row), each row materialised and consumed in the main process as
above, with the time (and CPU time) each row's read took inside its worker; and the cost of copying a row into
fresh shared memory (what torch charges for every tensor a worker returns that is not in shared memory already).
The training loader: the ``DataflowLoader`` ``ff fit`` builds (``FlowDataModule.setup`` then ``train_dataloader``) for
Wan I2V and Wan T2V over ff's layout, their ``tensor_columns``, ``condition_collation`` and contract batch size, with
0, 1 and 2 workers and ``data.hand_off`` on and off; the 1-minute load average is printed around it.
Memory: a fresh process reads every row of half, then all, of the ff-layout rows in random order; ``VmHWM`` is its
peak resident set, ``RssAnon`` its private memory at the end, ``RssFile`` the mapped file pages resident at the
end (page cache the kernel reclaims, bounded by ``open_files``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ff_core.data.dataflow import DataflowLoader, LazyValue, materialize  # noqa: E402
from ff_core.data.datamodule import FlowDataModule  # noqa: E402
from ff_core.data.tensor_parquet import (  # noqa: E402
    I2V_TRACK_SCHEMA,
    TensorParquetDataset,
    TensorParquetWriter,
    encode_tensor,
    two_level_order,
)

SHAPES = {"vae_latent": (16, 16, 60, 104), "first_frame_latent": (16, 16, 60, 104), "clip_feature": (257, 1280),
          "track_points": (121, 2500, 2), "track_visibility": (121, 2500), "object_ids": (2500,),
          "track_weights": (2500,)}
FLOAT32 = ("object_ids", "track_weights")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def row_shapes(i: int, scale: float) -> dict[str, tuple[int, ...]]:
    """Row ``i``'s tensor shapes: the card's at 720p when ``scale`` is 1 (first dimension scaled otherwise)."""
    shapes = {k: tuple(max(1, round(d * scale)) if j == 0 else d for j, d in enumerate(s)) for k, s in SHAPES.items()}
    shapes["text_embedding"] = (max(1, round((64 + (i * 37) % 128) * scale)), 4096)
    return shapes


def row_tensors(i: int, scale: float, pool: torch.Tensor) -> dict[str, torch.Tensor]:
    """Row ``i``: tensors cut from a random pool (fast to make, incompressible), text length varying per row."""
    out, offset = {}, 4 * ((i * 7919) % 256)  # dtype-aligned start, different per row
    for name, shape in row_shapes(i, scale).items():
        dtype = torch.float32 if name in FLOAT32 else torch.bfloat16
        nbytes = math.prod(shape) * dtype.itemsize
        out[name] = pool[offset: offset + nbytes].view(dtype).reshape(shape).clone()
        offset += nbytes
    return out


def make_row(i: int, scale: float, pool: torch.Tensor) -> dict:
    return {"id": f"clip{i:06d}", "file_name": f"clip{i:06d}.mp4", "caption": f"a clip number {i}",
            "media_type": "video", "width": 1280, "height": 720, "num_frames": 121, "duration_sec": 121 / 24,
            "fps": 24.0, **row_tensors(i, scale, pool)}


def write_layouts(root: Path, rows: int, scale: float, group_rows: int, reference: bool = True) -> int:
    """Both layouts of the same rows (ff's in two shards, so half the dataset is one shard; ``reference=False``: ff's
    only); returns payload bytes."""
    most = max(sum(math.prod(s) * 4 for s in row_shapes(i, scale).values()) for i in range(128))
    pool = torch.randint(0, 256, (most + 1024,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    payload, pending, half = 0, [], rows // 2
    writers = [TensorParquetWriter(root / "ff" / f"shard{s:03d}" / "combined_parquet_dataset", I2V_TRACK_SCHEMA,
                                   rows_per_file=64) for s in range(2)]
    for i in range(rows):
        row = make_row(i, scale, pool)
        payload += sum(t.numel() * t.element_size() for t in row.values() if isinstance(t, torch.Tensor))
        writers[i >= half].write(row)
        pending.append({k: v for k, v in row.items() if not isinstance(v, torch.Tensor)}
                       | {k2: v2 for k, v in row.items() if isinstance(v, torch.Tensor)
                          for k2, v2 in encode_tensor(v, k).items()})
        if not reference:
            pending = []
        elif len(pending) == group_rows or i == rows - 1:
            path = root / "reference" / "shard000" / "combined_parquet_dataset" / "worker_0"
            path.mkdir(parents=True, exist_ok=True)
            table = pa.Table.from_pylist(pending, schema=I2V_TRACK_SCHEMA)
            pq.write_table(table, path / f"data_chunk_{i // group_rows}.parquet", row_group_size=len(pending))
            pending = []
    for w in writers:
        w.close()
    return payload


def decode(row: dict, name: str) -> torch.Tensor:
    """The card's ``decode``."""
    return torch.frombuffer(bytearray(row[f"{name}_bytes"]), dtype=DTYPES[row[f"{name}_dtype"]]).reshape(
        row[f"{name}_shape"])


def card_recipe(ds: TensorParquetDataset) -> Callable[[int], dict]:
    def read(i: int) -> dict:
        f = ds.index.locate(i)[0]
        row = pq.read_table(ds.files[f]).slice(i - int(ds.index.file_start[f]), 1).to_pylist()[0]
        return {n: decode(row, n) for n in ds.tensor_names}
    return read


def whole_group(ds: TensorParquetDataset) -> Callable[[int], dict]:
    files: dict[Path, pq.ParquetFile] = {}

    def read(i: int) -> dict:
        path, g, r = ds.locate(i)
        pf = files.setdefault(path, pq.ParquetFile(path, memory_map=True))
        row = pf.read_row_group(g).slice(r, 1).to_pylist()[0]
        return {n: decode(row, n) for n in ds.tensor_names}
    return read


class Consumer:
    """Copies every tensor of a row once into one reused buffer: the same consumption charged to every reader."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.buffer.fill_(0)  # resident before timing

    def __call__(self, row: dict) -> None:
        at = 0
        for value in row.values():
            if isinstance(value, (torch.Tensor, LazyValue)):
                n = value.shape.numel() * value.dtype.itemsize
                slot = self.buffer[at: at + n]
                if isinstance(value, LazyValue):  # a file range: read straight into its slot (no other copy)
                    value.materialize_into(slot.view(value.dtype).view(value.shape))
                else:
                    slot.copy_(value.reshape(-1).view(torch.uint8))
                at += -(-n // 64) * 64  # slots aligned for any dtype


def timed(read: Callable[[int], dict | None], order: Iterator[int], budget: float, row_bytes: float,
          consume: Callable[[Any], None] | None = None) -> dict:
    """Rows read (then consumed) for at most ``budget`` seconds; the read and the consumption are timed apart."""
    done, reading, consuming = 0, 0.0, 0.0
    cpu, start = time.process_time(), time.perf_counter()
    for i in order:
        t0 = time.perf_counter()
        row = read(int(i))
        t1 = time.perf_counter()
        if consume is not None:
            consume(row)
        del row  # freed before the next read, as a training loop would
        reading, consuming = reading + t1 - t0, consuming + time.perf_counter() - t1
        done += 1
        if time.perf_counter() - start > budget:
            break
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"rows": done, "rows_s": done / seconds, "gb_s": done * row_bytes / seconds / 1e9,
            "ms_row": 1e3 * seconds / done, "read_ms": 1e3 * reading / done, "consume_ms": 1e3 * consuming / done,
            "cpu_ms": 1e3 * cpu / done}


ROUNDS = 3  # every measurement is repeated from scratch and the best round kept: the machine is shared


def best_of(rounds: int, measure_once: Callable[[], dict]) -> dict:
    return max((measure_once() for _ in range(rounds)), key=lambda r: r["rows_s"])


def run_reader(root: Path, name: str, order: torch.Tensor, budget: float, row_bytes: float,
               consume: Consumer) -> dict:
    """One round of one reader over a freshly opened dataset (no decoded group carried over between rounds)."""
    ds = TensorParquetDataset(root, cached_groups=4, direct="pyarrow" not in name,
                              catalogue="no catalogue" not in name)
    if name.startswith("ff two-level"):
        order = two_level_order(ds.group_bounds, 0, 0, window=4)
    if name.startswith("ff file ranges"):
        read = ds.describe
    else:
        read = {"card recipe": card_recipe, "whole row group": whole_group}.get(name, lambda d: d.__getitem__)(ds)
    return timed(read, iter(order), budget, row_bytes, consume)


def copy_ceiling(row_bytes: int, budget: float) -> tuple[dict, dict]:
    """``memmove`` between RAM buffers, and ``pread`` of a page-cached file, of ``row_bytes`` a row; each row then
    consumed by one more ``memmove`` (the readers' consumption)."""
    src = np.random.default_rng(0).integers(0, 255, size=row_bytes * 8, dtype=np.uint8)
    dst, out = np.empty(row_bytes, dtype=np.uint8), np.zeros(row_bytes, dtype=np.uint8)
    dst.fill(0)

    def consume(_: Any) -> None:
        ctypes.memmove(out.ctypes.data, dst.ctypes.data, row_bytes)

    mem = timed(lambda i: ctypes.memmove(dst.ctypes.data, src.ctypes.data + (i % 8) * row_bytes, row_bytes),
                iter(range(10 ** 9)), budget / 2, row_bytes, consume)
    with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR")) as f:
        f.write(src.tobytes())
        f.flush()
        pread = timed(lambda i: os.preadv(f.fileno(), [memoryview(dst)], (i % 8) * row_bytes),
                      iter(range(10 ** 9)), budget / 2, row_bytes, consume)
    return mem, pread


class TimedReads(torch.utils.data.Dataset):
    """The dataset, with each row's read time and CPU time (in the process that read it) added."""

    def __init__(self, ds: TensorParquetDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        start, cpu = time.perf_counter(), time.thread_time()
        row = self.ds[i]
        return {"read_s": time.perf_counter() - start, "read_cpu_s": time.thread_time() - cpu, **row}


def loader_rate(ds: TensorParquetDataset, order: torch.Tensor, budget: float, row_bytes: float, workers: int,
                consume: Consumer) -> dict:
    """Rows delivered (and consumed) by a DataLoader with ``workers`` workers (``batch_size=None``), the main
    process's CPU time per row, and the per-row read time inside the workers. Every row is ``materialize`` d in
    the main process as it is delivered (what ``DataflowLoader`` does: with ``hand_off`` it reads the row's
    uncompressed tensors there; otherwise it finds nothing to do)."""
    loader = torch.utils.data.DataLoader(TimedReads(ds), batch_size=None, sampler=order.tolist(), num_workers=workers,
                                         prefetch_factor=2 if workers else None, persistent_workers=False)
    it = iter(loader)
    next(it)  # workers started and primed: measure the steady state
    reads: list[tuple[float, float]] = []

    def deliver(_: int) -> dict:
        row = materialize(next(it))
        reads.append((row.pop("read_s"), row.pop("read_cpu_s")))
        return row

    r = timed(deliver, iter(range(len(order) - 1)), budget, row_bytes, consume)
    return {**r, "worker_ms_row": 1e3 * sum(a for a, _ in reads) / len(reads),
            "worker_cpu_ms_row": 1e3 * sum(b for _, b in reads) / len(reads)}


TRAINING_ADAPTERS = ("wan2_i2v", "wan2_t2v")
"""The adapters whose training loaders are measured: Wan I2V reads the card's text embedding (stored without padding,
padded per batch by its ``condition_collation``, with a mask), CLIP feature, first-frame latent and latent, one row a
batch (its contract's ``max_batch_size``); Wan T2V the text embedding and latent, four rows a batch (so the text
embeddings are padded to each batch's longest). The track columns are not read."""


def flat_tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in flat_tensors(v)]
    return [batch] if isinstance(batch, torch.Tensor) else []


class _Trainer:
    """What ``FlowDataModule.train_dataloader`` reads of a Lightning trainer: one rank, no accumulation, and the
    module's adapter (only its class-level ``condition_collation`` is used: no weights are loaded)."""

    distributed_sampler_kwargs = None
    accumulate_grad_batches = 1

    def __init__(self, adapter: type) -> None:
        self.lightning_module = SimpleNamespace(adapter=adapter)


def training_batch_size(adapter: str, most: int = 4) -> int:
    """Rows per training batch: ``most``, or fewer when the adapter's contract allows fewer (Wan I2V: one)."""
    from ff_core.plugins import get_adapter_class
    from ff_core.pretrained import resolve_contract

    limit = resolve_contract(get_adapter_class(adapter), None).max_batch_size
    return most if limit is None else min(most, limit)


def training_loader(root: Path, adapter: str, workers: int, hand_off: bool, batch_size: int) -> DataflowLoader:
    """The training loader exactly as ``ff fit`` builds it for ``adapter`` over ``root``:
    ``FlowDataModule(data.datasets=[{tensor_parquet_dir: root}], per_device_batch_size, num_workers, hand_off)``,
    ``setup("fit")`` (the adapter's ``tensor_columns`` resolved, the shards opened against them) and
    ``train_dataloader()`` (SamplerDistributor, TensorRowProcessor, TensorRowCollator with the adapter's
    ``condition_collation``)."""
    from ff_core.plugins import get_adapter_class

    data = FlowDataModule([{"name": "bench", "tensor_parquet_dir": str(root)}], per_device_batch_size=batch_size,
                          eval_batch_size=batch_size, num_workers=workers, hand_off=hand_off, adapter=adapter, seed=1)
    data.setup("fit")
    data.trainer = _Trainer(get_adapter_class(adapter))
    return data.train_dataloader()


def dataflow_rate(root: Path, adapter: str, budget: float, workers: int, hand_off: bool, batch_size: int) -> dict:
    """Batches of ``batch_size`` rows from the loader ``ff fit`` builds (:func:`training_loader`), each batch's
    tensors (masks included) copied once in the main process (consumption)."""
    loader = training_loader(root, adapter, workers, hand_off, batch_size)
    it = iter(loader)
    first = next(it)  # workers started and primed
    nbytes = sum(t.numel() * t.element_size() for t in flat_tensors(first))
    sink = torch.zeros(2 * nbytes, dtype=torch.uint8)  # text lengths vary by row: room for the longest batch
    consumed = [0]

    def consume(batch: dict) -> None:
        at = 0
        for t in flat_tensors(batch):
            n = t.numel() * t.element_size()
            sink[at: at + n].copy_(t.reshape(-1).view(torch.uint8))
            at += n
        consumed[0] += at

    r = timed(lambda _: next(it), iter(range(len(loader) - 1)), budget, nbytes, consume)
    row_bytes = consumed[0] / (r["rows"] * batch_size)
    per_row = {k: r[k] / batch_size for k in ("ms_row", "read_ms", "consume_ms", "cpu_ms")}
    return {**r, **per_row, "rows_s": r["rows_s"] * batch_size, "row_bytes": row_bytes,
            "gb_s": r["rows_s"] * batch_size * row_bytes / 1e9}


def shared_memory_cost(row_bytes: int, budget: float) -> dict:
    """One row's bytes copied into fresh shared memory, as torch moves a tensor from a worker (``share_memory_``)."""
    src = torch.ones(row_bytes, dtype=torch.uint8)
    return timed(lambda _: src.clone().share_memory_(), iter(range(10 ** 9)), budget / 2, row_bytes)


def rss_child(root: str) -> None:
    """Read every row of ``root`` in random order; print the process's memory figures as JSON."""
    ds = TensorParquetDataset(root)
    for i in torch.randperm(len(ds), generator=torch.Generator().manual_seed(0)):
        ds[int(i)]
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    print(json.dumps({k: int(status[k].split()[0]) // 1024 for k in ("VmHWM", "RssAnon", "RssFile")} |
                     {"rows": len(ds)}))


def rss(root: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, __file__, "--rss-child", str(root)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="payload of each layout, in GB (rows of ~10 MB)")
    parser.add_argument("--seconds", type=float, default=4.0, help="time budget of each measurement")
    parser.add_argument("--group-rows", type=int, default=16, help="rows per row group of the reference layout")
    parser.add_argument("--workdir", help="where to generate the shards (default: a temporary folder)")
    parser.add_argument("--quick", action="store_true", help="tiny rows (~100 kB), short budgets: a smoke test")
    parser.add_argument("--layouts", nargs="+", choices=list(READERS), default=list(READERS),
                        help="the layouts to measure (both are written; the copy ceilings are always measured)")
    parser.add_argument("--loader-only", action="store_true", help="only the DataLoader table (and shared memory)")
    parser.add_argument("--training-only", action="store_true",
                        help="only ff's layout and the training loader table (repeated --repeat times)")
    parser.add_argument("--repeat", type=int, default=1, help="with --training-only: times the table is measured")
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_child:
        return rss_child(args.rss_child)
    torch.set_num_threads(1)
    global ROUNDS
    ROUNDS = 1 if args.quick else ROUNDS
    scale = 0.01 if args.quick else 1.0
    budget = 0.15 if args.quick else args.seconds
    rows = 48 if args.quick else max(32, round(args.gb * 1e9 / 10e6))
    work = Path(tempfile.mkdtemp(prefix="ff-tp-bench-", dir=args.workdir))
    try:
        t = time.perf_counter()
        payload = write_layouts(work, rows, scale, args.group_rows, reference=not args.training_only)
        row_bytes = payload / rows
        print(f"{rows} rows of {row_bytes / 1e6:.2f} MB per layout ({payload / 1e9:.2f} GB), written in "
              f"{time.perf_counter() - t:.0f} s; {args.group_rows} rows per row group in the reference layout\n")
        if args.training_only:
            results = {}
            for _ in range(args.repeat):
                training_table(work, budget, results)
        else:
            results = measure(work, rows, row_bytes, budget, args.quick, args.layouts, args.loader_only)
        print(json.dumps(results))
    finally:
        shutil.rmtree(work, ignore_errors=True)


READERS = {"reference": ("card recipe", "whole row group", "ff", "ff pyarrow", "ff two-level", "ff two-level pyarrow"),
           "ff": ("card recipe", "whole row group", "ff", "ff file ranges", "ff file ranges, no catalogue",
                  "ff pyarrow", "ff two-level")}


def row_line(layout: str, name: str, r: dict) -> str:
    return (f"| {layout} | {name} | {r['rows']} | {r['rows_s']:.1f} | {r['gb_s']:.2f} | {r['read_ms']:.2f} | "
            f"{r['consume_ms']:.2f} | {r['read_ms'] + r['consume_ms']:.2f} | {r['cpu_ms']:.2f} |")


# (layout, two-level order, workers, hand_off): 0 workers is the DataLoader reading in the main process; with
# hand_off the workers return uncompressed tensors as FileTensor descriptions, read in the main process.
LOADERS = [("ff", False, 0, False), ("ff", False, 1, False), ("ff", False, 2, False), ("ff", False, 1, True),
           ("ff", False, 2, True), ("reference", True, 0, False), ("reference", True, 2, False)]


def measure(work: Path, rows: int, row_bytes: float, budget: float, quick: bool,
            layouts: list[str] | None = None, loader_only: bool = False) -> dict:
    layouts = list(READERS) if layouts is None else layouts
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(1))
    results: dict = {}
    consume = Consumer(int(row_bytes * 1.1) + 4096)
    if not loader_only:
        readers(work, row_bytes, budget, layouts, order, consume, results)
    loaders(work, row_bytes, budget, layouts, order, consume, results)
    if not quick and not loader_only and "ff" in layouts:
        print("\n| ff-layout rows read | VmHWM MiB | RssAnon MiB | RssFile MiB |\n|---|---|---|---|")
        for root in (work / "ff" / "shard000", work / "ff"):
            r = results[f"rss/{r_rows(root)}"] = rss(root)
            print(f"| {r['rows']} | {r['VmHWM']} | {r['RssAnon']} | {r['RssFile']} |")
    return results


def readers(work: Path, row_bytes: float, budget: float, layouts: list[str], order: torch.Tensor, consume: Consumer,
            results: dict) -> None:
    """The random-read table: every reader of :data:`READERS`, then the copy ceilings."""
    print("| layout | reader | rows read | rows/s | GB/s | ms/row read | ms/row consume | ms/row read + consume | "
          "cpu ms/row |\n|---|---|---|---|---|---|---|---|---|")
    for layout, names in READERS.items():
        for name in names if layout in layouts else ():
            r = results[f"{layout}/{name}"] = best_of(ROUNDS, lambda: run_reader(work / layout, name, order, budget,
                                                                                 row_bytes, consume))
            print(row_line(layout, name, r))
    pairs = [copy_ceiling(int(row_bytes), budget) for _ in range(ROUNDS)]
    mem, pread = (max((p[k] for p in pairs), key=lambda r: r["rows_s"]) for k in (0, 1))
    results["memcpy"], results["pread"] = mem, pread
    for name, r in (("memcpy (RAM to RAM)", mem), ("pread (page cache to RAM)", pread)):
        print(row_line("-", name, r))


def loaders(work: Path, row_bytes: float, budget: float, layouts: list[str], order: torch.Tensor, consume: Consumer,
            results: dict) -> None:
    """The DataLoader table (:data:`LOADERS`) and the cost of fresh shared memory."""
    print("\n| layout, order | workers | rows cross as | rows/s | GB/s | ms/row delivered + consumed | main process: "
          "cpu ms/row | worker: ms/row read | worker: cpu ms/row read |\n|---|---|---|---|---|---|---|---|---|")
    for layout, two_level, workers, hand_off in (x for x in LOADERS if x[0] in layouts):
        ds = TensorParquetDataset(work / layout, cached_groups=4, hand_off=hand_off)
        rows_order = two_level_order(ds.group_bounds, 0, 0, window=4) if two_level else order
        key = f"{layout}/loader{workers}{'/hand_off' if hand_off else ''}"
        r = results[key] = best_of(ROUNDS, lambda: loader_rate(ds, rows_order, budget, row_bytes, workers, consume))
        how = "-" if not workers else "file ranges (hand_off)" if hand_off else "shared memory"
        print(f"| {layout}, {'two-level' if two_level else 'random'} | {workers} | {how} | {r['rows_s']:.1f} | "
              f"{r['gb_s']:.2f} | {r['ms_row']:.2f} | {r['cpu_ms']:.2f} | {r['worker_ms_row']:.2f} | "
              f"{r['worker_cpu_ms_row']:.2f} |")
    if "ff" in layouts:
        training_table(work, budget, results)
    r = results["share_memory"] = best_of(ROUNDS, lambda: shared_memory_cost(int(row_bytes), budget))
    print(f"\nA row's bytes copied into fresh shared memory (`clone().share_memory_()`, what a worker's tensor costs "
          f"to send): {r['ms_row']:.2f} ms ({r['cpu_ms']:.2f} ms CPU)")


def load() -> str:
    """The 1-minute load average (``uptime``'s first figure): how busy the machine was."""
    return f"{os.getloadavg()[0]:.1f}"


def training_table(work: Path, budget: float, results: dict) -> None:
    """The training loaders (:func:`training_loader`) of :data:`TRAINING_ADAPTERS` with 0, 1 and 2 workers, rows
    crossing in shared memory (``data.hand_off: false``) or as file ranges, best of :data:`ROUNDS` each; the load
    average around them."""
    print(f"\nload {load()} at {time.strftime('%H:%M:%S', time.gmtime())} UTC")
    print("| training loader (adapter, rows a batch, MB read a row) | workers | rows cross as | rows/s | "
          "ms/row delivered + consumed | ms/row consume | main process: cpu ms/row |\n|---|---|---|---|---|---|---|")
    for adapter, workers, hand_off in ((a, w, h) for a in TRAINING_ADAPTERS
                                       for w, h in ((0, False), (1, False), (2, False), (1, True), (2, True))):
        batch = training_batch_size(adapter)
        key = f"ff/dataflow{workers}{'/hand_off' if hand_off else ''}"
        key += "" if adapter == TRAINING_ADAPTERS[0] else f"/{adapter}"
        r = best_of(ROUNDS, lambda: dataflow_rate(work / "ff", adapter, budget, workers, hand_off, batch))
        results[key] = r  # the last run's; every run's under "<key>/runs"
        results.setdefault(f"{key}/runs", []).append(r)
        how = "-" if not workers else "file ranges (hand_off)" if hand_off else "shared memory"
        print(f"| {adapter}, {batch}, {r['row_bytes'] / 1e6:.1f} MB | {workers} | {how} | {r['rows_s']:.1f} | "
              f"{r['ms_row']:.2f} | {r['consume_ms']:.2f} | {r['cpu_ms']:.2f} |")
    print(f"load {load()} at {time.strftime('%H:%M:%S', time.gmtime())} UTC")


def r_rows(root: Path) -> int:
    return len(TensorParquetDataset(root))


if __name__ == "__main__":
    main()
