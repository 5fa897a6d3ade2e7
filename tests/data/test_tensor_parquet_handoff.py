"""DataLoader workers hand uncompressed tensor-parquet values to the main process as file ranges (``hand_off``):
what crosses is a small description, what the main process reads is exactly the stored tensor (checked against the
rows as written and the card's decoder), a file replaced in between is an error, and the open files stay bounded."""

from __future__ import annotations

import collections
import os
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tensor_parquet_helpers import card_decode
from test_tensor_parquet_pages import rows_of_every_dtype

from ff_core.data.dataflow import LazyValue, materialize
from ff_core.data.dataflow.lazy import LazyStack, stack
from ff_core.data.tensor_parquet import TENSOR_DTYPES, FileTensor, TensorParquetDataset, encode_tensor, tensor_schema
from ff_core.data.tensor_parquet import file_tensor as file_tensor_module
from ff_core.data.tensor_parquet.file_tensor import file_identity
from ff_core.errors import DatasetError

SCHEMA = tensor_schema({"id": pa.string()}, list(TENSOR_DTYPES))


def write(path, rows, compression: str = "none", **kw) -> None:
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), path, compression=compression, **kw)


def worker_rows(ds: TensorParquetDataset, workers: int = 2) -> list[dict]:
    """Rows as DataLoader workers return them, not materialised (a plain DataLoader does not)."""
    return list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers))


@pytest.mark.parametrize("compression", ["none", "snappy"])
def test_workers_hand_off_uncompressed_values_and_the_main_process_reads_the_stored_tensors(tmp_path, compression):
    rows = rows_of_every_dtype()
    write(tmp_path / "f.parquet", rows, row_group_size=2, compression=compression)  # dictionary pages, 2 rows a group
    ds = TensorParquetDataset(tmp_path, hand_off=True)
    for i, (crossed, written) in enumerate(zip(worker_rows(ds), rows)):
        values = {k: v for k, v in crossed.items() if k != "id"}
        handed = [k for k, v in values.items() if isinstance(v, FileTensor)]
        if compression == "none":  # every non-empty value is described, none sent
            assert handed == [k for k, v in values.items() if v.shape.numel()], i
        else:  # compressed values are decoded in the worker and cross in shared memory, as without hand_off
            assert handed == [] and all(v.untyped_storage().is_shared() for v in values.values() if v.numel()), i
        got = materialize(crossed)
        assert got["id"] == written["id"]
        for name in TENSOR_DTYPES:
            tensor = got[name]
            assert isinstance(tensor, torch.Tensor) and not isinstance(tensor, LazyValue)
            assert encode_tensor(tensor, name) == {k: written[k] for k in encode_tensor(tensor, name)}, (i, name)
            if tensor.numel():  # (the card's decoder cannot decode an empty buffer)
                assert torch.equal(tensor, card_decode(written, name)), (i, name)
                assert tensor.data_ptr() % tensor.element_size() == 0  # aligned for its dtype, owned, writable
                tensor.view(-1)[0] = tensor.view(-1)[-1]
    # In the main process the option changes nothing.
    assert all(isinstance(v, torch.Tensor) for k, v in ds[0].items() if k != "id")


def test_what_crosses_is_a_description_not_the_bytes(tmp_path):
    """A row of 4 MB crosses the worker queue as a few hundred bytes; its tensor is the row's."""
    big = torch.arange(1 << 20, dtype=torch.float32)
    row = {"id": "0"} | {k: v for name in TENSOR_DTYPES
                         for k, v in encode_tensor(big if name == "float32" else torch.zeros(0), name).items()}
    write(tmp_path / "f.parquet", [row])
    crossed = worker_rows(TensorParquetDataset(tmp_path, hand_off=True, columns=["float32"]), workers=1)[0]
    assert isinstance(crossed["float32"], FileTensor) and crossed["float32"].nbytes == big.numel() * 4
    assert len(pickle.dumps(crossed)) < 1024
    assert torch.equal(materialize(crossed)["float32"], big)


def test_a_file_replaced_after_a_worker_located_a_value_is_never_read_as_it(tmp_path, monkeypatch):
    """A value is read from the file the worker located it in, or not at all: a file the main process still holds
    serves its own bytes though another was renamed over its path; otherwise the change is an error naming it."""
    monkeypatch.setattr(file_tensor_module, "_FILES", file_tensor_module._Files())
    rows = rows_of_every_dtype()
    path = tmp_path / "f.parquet"
    write(path, rows)
    crossed = worker_rows(TensorParquetDataset(tmp_path, hand_off=True, columns=["float32"]), workers=1)
    assert torch.equal(materialize(crossed[1])["float32"], card_decode(rows[1], "float32"))  # its fd is now held
    other = list(reversed(rows))
    write(tmp_path / "new.tmp", other)
    os.replace(tmp_path / "new.tmp", path)  # what ff's writer does
    assert torch.equal(materialize(crossed[0])["float32"], card_decode(rows[0], "float32"))  # the held old file
    monkeypatch.setattr(file_tensor_module, "_FILES", file_tensor_module._Files())  # a process that holds nothing
    with pytest.raises(DatasetError, match=r"f\.parquet: float32_bytes: row 0 \(row group 0, dataset row 0\): the "
                                           r"file changed after a DataLoader worker located the value"):
        materialize(crossed[0])
    fresh = worker_rows(TensorParquetDataset(tmp_path, hand_off=True, columns=["float32"]), workers=1)
    assert torch.equal(materialize(fresh[0])["float32"], card_decode(other[0], "float32"))  # now held
    with open(path, "r+b") as f:  # rewritten in place (same bytes here), under the held descriptor
        f.write(f.read())
    os.utime(path, ns=(1, 1))
    with pytest.raises(DatasetError, match="the file changed"):
        materialize(fresh[0])


def test_lazy_values_stack_and_pad_as_torch_does(tmp_path):
    """Against torch.stack / torch.cat of the tensors read by hand (``torch.frombuffer`` of the file's bytes)."""
    values = [torch.randn(3, 5, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16) for k in range(3)]
    path = tmp_path / "raw.bin"
    path.write_bytes(b"x" * 7 + b"".join(v.view(torch.uint8).numpy().tobytes() for v in values))  # unaligned
    fd = os.open(path, os.O_RDONLY)
    identity = file_identity(fd)
    os.close(fd)
    lazy = [FileTensor(str(path), identity, 7 + 30 * k, (3, 5), torch.bfloat16) for k in range(3)]
    raw = path.read_bytes()
    by_hand = [torch.frombuffer(bytearray(raw[7 + 30 * k: 37 + 30 * k]), dtype=torch.bfloat16).view(3, 5)
               for k in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(by_hand, values))
    mixed = stack([lazy[0], values[1], lazy[2]])
    assert isinstance(mixed, LazyStack) and mixed.shape == (3, 3, 5) and mixed.dtype == torch.bfloat16
    assert torch.equal(mixed.materialize(), torch.stack(by_hand))
    assert torch.equal(stack(values), torch.stack(values))  # no lazy value: torch.stack itself
    padded = stack([lazy[0].padded(4), torch.cat([values[1], values[1].new_zeros(1, 5)])]).materialize()
    assert torch.equal(padded, torch.stack([torch.cat([v, v.new_zeros(1, 5)]) for v in by_hand[:2]]))
    with pytest.raises(ValueError, match="one shape and dtype"):
        LazyStack([lazy[0], values[1].float()])  # stack() promotes those as torch.stack does (test below)
    # Containers are walked and keep their types; without a lazy value nothing is copied.
    Pair = collections.namedtuple("Pair", "a b")
    batch = {"x": [lazy[0], (1, lazy[1])], "p": Pair(lazy[2], "s"), "keep": {"t": values[0]}, "n": 3}
    done = materialize(batch)
    assert isinstance(done["p"], Pair) and done["p"].b == "s" and torch.equal(done["p"].a, values[2])
    assert torch.equal(done["x"][0], values[0]) and done["x"][1][0] == 1 and torch.equal(done["x"][1][1], values[1])
    assert done["keep"] is batch["keep"] and materialize(done) is done


def test_the_main_process_keeps_few_files_open(tmp_path, monkeypatch):
    monkeypatch.setattr(file_tensor_module, "_FILES", file_tensor_module._Files())
    monkeypatch.setattr(file_tensor_module._Files, "most", 2)
    rows = [r for r in rows_of_every_dtype() if r["int64_bytes"]][:5]
    for k in range(5):
        (tmp_path / f"s{k}").mkdir()
        write(tmp_path / f"s{k}" / "f.parquet", rows[k:k + 1])
    crossed = worker_rows(TensorParquetDataset(tmp_path, hand_off=True, columns=["int64"]), workers=1)
    before = len(os.listdir("/proc/self/fd"))
    for k, row in enumerate(crossed * 2):
        assert torch.equal(materialize(row)["int64"], card_decode(rows[k % 5], "int64"))
        assert len(file_tensor_module._FILES.open) <= 2
    assert len(os.listdir("/proc/self/fd")) <= before + 2


def test_a_pinning_loader_gets_page_locked_batches(tmp_path):
    """``DataLoader(pin_memory=True)`` pins each batch before the main process reads its lazy values: they ask to be
    read into page-locked memory (the read allocates it; pinning the description could not)."""
    from torch.utils.data._utils.pin_memory import pin_memory

    rows = [r for r in rows_of_every_dtype() if r["int64_bytes"]]
    write(tmp_path / "f.parquet", rows)
    crossed = worker_rows(TensorParquetDataset(tmp_path, hand_off=True, columns=["int64"]), workers=1)[0]
    batch = {"x": stack([crossed["int64"], crossed["int64"]])}
    pinned = pin_memory(batch)  # what the loader's pinning thread does to a batch
    assert pinned["x"] is batch["x"] and batch["x"].pinned
    if not torch.cuda.is_available():
        pytest.skip("no CUDA: page-locked memory cannot be allocated here")
    got = materialize(pinned)["x"]
    assert got.is_pinned() and torch.equal(got[1], card_decode(rows[0], "int64"))
    alone = pin_memory(crossed)["int64"]
    assert alone.pinned and materialize(alone).is_pinned()


def test_stack_promotes_mixed_dtypes_as_torch_does(tmp_path):
    """Rows of one column stored in two dtypes (two shard roots) stack as ``torch.stack`` stacks them, whether the
    values are tensors or were handed off; uniform ones land in reused host memory, equal to ``torch.stack``."""
    path = tmp_path / "raw.bin"
    half = torch.arange(6, dtype=torch.float16).view(2, 3)
    path.write_bytes(half.view(torch.uint8).numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    lazy = FileTensor(str(path), file_identity(fd), 0, (2, 3), torch.float16)
    os.close(fd)
    full = torch.ones(2, 3)
    for values in ([lazy, full], [half, full]):
        got = stack(values)
        assert not isinstance(got, LazyValue) and got.dtype == torch.float32
        assert torch.equal(got, torch.stack([half, full]))
    uniform = [torch.randn(2, 3) for _ in range(3)]
    assert torch.equal(stack(uniform), torch.stack(uniform))
    with pytest.raises(RuntimeError, match="not resizable"):  # as host_empty's docstring says
        stack(uniform).resize_(4, 2, 3)


def located(tmp_path, tensors: list[torch.Tensor], name: str = "raw.bin") -> list[FileTensor]:
    """``tensors`` written back to back in one raw file, as FileTensor values of it."""
    path = tmp_path / name
    path.write_bytes(b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors))
    fd = os.open(path, os.O_RDONLY)
    identity = file_identity(fd)
    os.close(fd)
    out, at = [], 0
    for t in tensors:
        out.append(FileTensor(str(path), identity, at, t.shape, t.dtype))
        at += t.numel() * t.element_size()
    return out


def test_threads_reading_values_of_many_files_each_get_their_own(tmp_path, monkeypatch):
    """A descriptor is looked up and read under one lock: another thread evicting (closing) it mid-read, and the
    number being reused for another file, would hand out another file's bytes or fail."""
    import threading

    monkeypatch.setattr(file_tensor_module, "_FILES", file_tensor_module._Files())
    monkeypatch.setattr(file_tensor_module._Files, "most", 1)  # every other read evicts a file another thread holds
    values = [torch.full((1 << 16,), float(k)) for k in range(6)]
    lazy = [located(tmp_path, [v], f"f{k}.bin")[0] for k, v in enumerate(values)]
    failures: list[str] = []

    def work(seed: int) -> None:
        for step in range(150):
            k = (seed * 7 + step) % len(lazy)
            try:
                got = lazy[k].materialize()
            except Exception as exc:  # noqa: BLE001 - reported below
                failures.append(f"{k}: {exc!r}")
                return
            if not torch.equal(got, values[k]):
                failures.append(f"{k}: another file's bytes")
                return

    threads = [threading.Thread(target=work, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:3]


def test_short_reads_are_continued(tmp_path, monkeypatch):
    """A file system may return fewer bytes than asked (FUSE, network, a signal): the read goes on from there."""
    big = torch.arange(1 << 18, dtype=torch.float32)
    lazy = located(tmp_path, [big])[0]
    real = os.preadv

    def short(fd, buffers, offset):  # at most 1000 bytes a call
        return real(fd, [memoryview(buffers[0])[:1000]], offset)

    monkeypatch.setattr(os, "preadv", short)
    assert torch.equal(lazy.materialize(), big)
    rows = [r for r in rows_of_every_dtype() if r["float32_bytes"]]
    (tmp_path / "t").mkdir()
    write(tmp_path / "t" / "f.parquet", rows)
    ds = TensorParquetDataset(tmp_path / "t", columns=["float32"])  # the reader's own pread
    assert all(torch.equal(ds[i]["float32"], card_decode(r, "float32")) for i, r in enumerate(rows))


def test_a_refused_read_ahead_advice_is_ignored(tmp_path, monkeypatch):
    """``posix_fadvise`` is advice: a file system that refuses it (``EINVAL`` on some FUSE mounts) still serves."""
    def refuse(*args):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "posix_fadvise", refuse, raising=False)  # inherited by the forked workers
    rows = [r for r in rows_of_every_dtype() if r["int64_bytes"]]
    write(tmp_path / "f.parquet", rows)
    crossed = worker_rows(TensorParquetDataset(tmp_path, hand_off=True, columns=["int64"]), workers=1)
    assert isinstance(crossed[0]["int64"], FileTensor)
    assert torch.equal(materialize(crossed[0])["int64"], card_decode(rows[0], "int64"))


def test_a_value_is_read_only_into_a_tensor_of_its_shape_and_dtype(tmp_path):
    lazy = located(tmp_path, [torch.arange(6, dtype=torch.int32).view(2, 3)])[0]
    for out in (torch.empty(2, 3, dtype=torch.float32), torch.empty(3, 2, dtype=torch.int32),
                torch.empty(3, 2, dtype=torch.int32).t()):
        with pytest.raises(ValueError, match=r"shape \(2, 3\) and dtype torch.int32 expected"):
            lazy.materialize_into(out)
    out = torch.empty(2, 3, dtype=torch.int32)
    lazy.materialize_into(out)
    assert torch.equal(out, torch.arange(6, dtype=torch.int32).view(2, 3))


def test_a_loader_iteration_closes_the_files_it_read_and_forked_children_inherit_none(tmp_path, monkeypatch):
    import multiprocessing

    from ff_core.data.dataflow import BatchCollator, DataflowLoader, DataParallelCoords, SamplerDistributor
    from ff_core.data.dataflow.base import RawItemProcessor

    class Rows(RawItemProcessor):
        def __init__(self, ds):
            self.ds = ds

        def process(self, item):
            return self.ds[int(item)]

    class Stack(BatchCollator):
        def collate(self, samples):
            return {"int64": stack([s["int64"] for s in samples])}

    files = file_tensor_module._Files()
    monkeypatch.setattr(file_tensor_module, "_FILES", files)
    rows = [r for r in rows_of_every_dtype() if r["int64_bytes"]]
    write(tmp_path / "f.parquet", rows)
    ds = TensorParquetDataset(tmp_path, hand_off=True, columns=["int64"])
    crossed = worker_rows(ds, workers=1)
    materialize(crossed[0])
    assert len(files.open) == 1
    child = multiprocessing.get_context("fork")
    queue = child.SimpleQueue()
    proc = child.Process(target=lambda: queue.put(len(file_tensor_module._FILES.open)))
    proc.start()
    proc.join()
    assert queue.get() == 0 and len(files.open) == 1  # the child closed its copies; the parent's are untouched
    for stop in (None, 1):  # an iteration run to its end, or abandoned after one batch
        dist = SamplerDistributor(range(len(rows)), shuffle=False, name="t", identity={"t": {"rows": len(rows)}})
        loader = DataflowLoader(dist, Rows(ds), collator=Stack(), batch_size=1, num_workers=1,
                                coords=DataParallelCoords(0, 1))
        it = iter(loader)
        got = [next(it)["int64"][0] for _ in range(stop or len(rows))]
        assert len(files.open) == 1  # held while the iteration runs
        if stop is None:
            assert next(it, None) is None
        else:
            it.close()
        assert not files.open
        assert all(torch.equal(g, card_decode(r, "int64")) for g, r in zip(got, rows))
