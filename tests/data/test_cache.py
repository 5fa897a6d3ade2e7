"""The Arrow condition cache (ff_core/data/cache/store.py): rows, identity rules, atomic publication, concurrent and
sharded builds. Conditions come from ``HashAdapter`` (cache_helpers.py), whose tensors a test recomputes by hand;
the rules that involve a real model (checkpoint, dtype, text length) run the tiny SD3 in tests/test_cache_fit.py."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from cache_helpers import HashAdapter, expected_condition, rgb, source, write_dataset
from PIL import Image

from ff_core.contracts import IMAGE_OUT, MediaType, NegativePrompt, PipelineIOContract, SlotSpec
from ff_core.data.cache.store import MANIFEST, ConcatConditions, open_or_build, read_manifest, remove_stale_builds
from ff_core.data.cache.table import CachedConditions, PartWriter

HELPER = Path(__file__).with_name("cache_helpers.py")
N = 6


def build(root: Path, cache: Path, adapter=None, **kw):
    """open_or_build of ``root``'s training split, counting the records ``preprocess`` saw."""
    adapter = adapter or HashAdapter()
    seen: list[str] = []
    real = adapter.preprocess

    def counting(inputs):
        seen.extend(i.prompt for i in inputs)
        return real(inputs)

    adapter.preprocess = counting
    result = open_or_build(source(root), adapter, cache_dir=cache, batch_size=kw.pop("batch_size", 4), **kw)
    return result, seen


def assert_rows(conditions, expected: list[dict[str, torch.Tensor]]) -> None:
    assert len(conditions) == len(expected)
    for i, want in enumerate(expected):
        got = conditions[i]
        assert got.keys() == want.keys()
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (i, key)


@pytest.fixture
def dataset(tmp_path) -> Path:
    return write_dataset(tmp_path / "data", N)


# -- rows ------------------------------------------------------------------------------------------------
def test_rows_round_trip_every_dtype_zero_copy(tmp_path):
    """Raw bytes + shape + dtype per key: float32, bfloat16 (numpy has none), int64 0-d, bool, empty; two parts of
    several record batches read back exactly; two reads of a row share memory (the mapped file, no copy); a pickled
    sequence (what a spawned worker receives) reopens the files by path."""
    g = torch.Generator().manual_seed(0)
    rows = [{"f": torch.randn(3, 4, generator=g), "h": torch.randn(5, generator=g).bfloat16(),
             "i": torch.tensor(i), "b": torch.rand(2, 2, generator=g) > 0.5, "e": torch.zeros(0, 3)}
            for i in range(7)]  # fmt: skip
    ids = [bytes([i]) * 32 for i in range(7)]
    for name, lo, hi in (("p0.arrow", 0, 5), ("p1.arrow", 5, 7)):
        writer = PartWriter(tmp_path / name)
        for start in range(lo, hi, 2):
            stop = min(start + 2, hi)
            writer.write(ids[start:stop], rows[start:stop], start)
        writer.close()
    table = CachedConditions(tmp_path, [("p0.arrow", 5), ("p1.arrow", 2)], b"".join(ids))
    assert_rows(table, rows)
    assert table[6]["f"].data_ptr() == table[6]["f"].data_ptr()  # a view of the mapping, not a fresh copy
    assert_rows(pickle.loads(pickle.dumps(table)), rows)
    assert_rows(ConcatConditions([table, table]), rows + rows)
    with pytest.raises(IndexError):
        table[7]


def test_dropping_mapped_pages_keeps_rows_in_use_intact(tmp_path, monkeypatch):
    """Readers drop their mapped pages as they go (a flat resident set); a tensor still held reads its pages back
    from the file."""
    import ff_core.data.cache.table as cache_table

    monkeypatch.setattr(cache_table, "TRIM_BYTES", 1)  # drop after every row
    rows = [{"x": torch.arange(4096, dtype=torch.float32) + i} for i in range(4)]
    writer = PartWriter(tmp_path / "p.arrow")
    writer.write([bytes([i]) * 32 for i in range(4)], rows, 0)
    writer.close()
    table = CachedConditions(tmp_path, [("p.arrow", 4)], b"".join(bytes([i]) * 32 for i in range(4)))
    held = [table[i]["x"] for i in range(4)]
    for i, tensor in enumerate(held):
        assert torch.equal(tensor, rows[i]["x"])


def test_a_row_whose_condition_id_differs_is_refused(tmp_path):
    writer = PartWriter(tmp_path / "p.arrow")
    writer.write([b"\1" * 32, b"\2" * 32], [{"x": torch.zeros(1)}] * 2, 0)
    writer.close()
    table = CachedConditions(tmp_path, [("p.arrow", 2)], b"\1" * 32 + b"\3" * 32)
    table[0]
    with pytest.raises(RuntimeError, match=r"row 1 holds condition 0202.*force_reprocess"):
        table[1]


def test_preprocess_output_must_be_tensors_with_the_same_keys(tmp_path):
    writer = PartWriter(tmp_path / "p.arrow")
    with pytest.raises(TypeError, match="'text' as str"):
        writer.write([b"\1" * 32], [{"text": "no"}], 0)
    writer = PartWriter(tmp_path / "q.arrow")
    with pytest.raises(ValueError, match="row 1 has keys"):
        writer.write([b"\1" * 32, b"\2" * 32], [{"x": torch.zeros(1)}, {"y": torch.zeros(1)}], 0)


# -- build and identity ----------------------------------------------------------------------------------
def test_build_then_reuse(dataset, tmp_path):
    """The first call preprocesses every record once, in batches; the second reads the published cache."""
    cache = tmp_path / "cache"
    first, seen = build(dataset, cache, batch_size=4)
    assert not first.reused and seen == [f"prompt {i}" for i in range(N)]
    assert_rows(first.conditions, [expected_condition(f"prompt {i}", rgb(i)) for i in range(N)])
    manifest = json.loads((first.path / MANIFEST).read_text())
    assert manifest["rows"] == N and first.path.name == manifest["key"] and first.bytes > 0
    assert sorted(p.name for p in cache.iterdir()) == [first.path.name]  # no build folder left behind
    again, seen = build(dataset, cache, batch_size=3)  # the batch size is not part of the identity
    assert again.reused and seen == [] and again.path == first.path
    assert_rows(again.conditions, [expected_condition(f"prompt {i}", rgb(i)) for i in range(N)])


def test_replacing_a_condition_file_in_place_rebuilds(dataset, tmp_path):
    """Same path, new pixels: the file's SHA-256 changes the row's condition id and so the key (spec: "Replacing an
    input condition file in place therefore changes its condition identity and invalidates the Arrow cache")."""
    cache = tmp_path / "cache"
    first, _ = build(dataset, cache)
    Image.new("RGB", (4, 3), (1, 2, 3)).save(dataset / "cond" / "2.png")
    second, seen = build(dataset, cache)
    assert not second.reused and second.path != first.path and len(seen) == N
    assert torch.equal(second.conditions[2]["colour"], torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(first.conditions[2]["colour"], torch.tensor(rgb(2), dtype=torch.float32))  # old one intact


def test_replacing_a_target_in_place_reuses(dataset, tmp_path):
    """Only the input side is cached: a new target file (or its content) never invalidates conditions."""
    cache = tmp_path / "cache"
    first, _ = build(dataset, cache)
    Image.new("RGB", (8, 8), (9, 9, 9)).save(dataset / "targets" / "0.png")
    second, seen = build(dataset, cache)
    assert second.reused and seen == [] and second.path == first.path


@pytest.mark.parametrize("change", ["prompt", "source bytes", "row count", "dataset root"])
def test_dataset_changes_rebuild(dataset, tmp_path, change):
    cache = tmp_path / "cache"
    first, _ = build(dataset, cache)
    split = dataset / "train.jsonl"
    lines = split.read_text().splitlines()
    if change == "prompt":
        lines[1] = lines[1].replace('"prompt 1"', '"prompt one"')
        split.write_text("\n".join(lines) + "\n")
    elif change == "source bytes":  # same records, other bytes (the spec keys the file's bytes)
        split.write_text("\n".join(line.replace('"schema_version": 2', '"schema_version":2') for line in lines))
    elif change == "row count":
        split.write_text("\n".join(lines[:-1]) + "\n")
    else:
        dataset = dataset.rename(tmp_path / "moved")
    second, seen = build(dataset, cache)
    assert not second.reused and second.path != first.path and seen


class OtherVersion(HashAdapter):
    preprocess_version: ClassVar[str] = "2"


class OtherCheckpoint(HashAdapter):
    def preprocess_identity(self):
        return {"checkpoint": "hash-v2"}


class SlotsSwapped(HashAdapter):
    io_contract: ClassVar[PipelineIOContract] = replace(
        HashAdapter.io_contract,
        slots=(SlotSpec("reference", MediaType.IMAGE, required=False), SlotSpec("extra", MediaType.IMAGE, False)),
    )


class NoNegativePrompt(HashAdapter):
    io_contract: ClassVar[PipelineIOContract] = replace(HashAdapter.io_contract,
                                                        negative_prompt=NegativePrompt.REJECTED)


class SingleSample(HashAdapter):
    io_contract: ClassVar[PipelineIOContract] = replace(HashAdapter.io_contract, max_batch_size=1)


class OtherOutputs(HashAdapter):
    io_contract: ClassVar[PipelineIOContract] = replace(HashAdapter.io_contract, outputs=(IMAGE_OUT, IMAGE_OUT))


@pytest.mark.parametrize("cls", [OtherVersion, OtherCheckpoint, SlotsSwapped, NoNegativePrompt, SingleSample])
def test_adapter_changes_rebuild(dataset, tmp_path, cls):
    """preprocess_version, preprocess_identity (model identity, dtype, semantic fields) and the input-projection
    contract (slots, negative-prompt policy, batch capability) are in the key."""
    cache = tmp_path / "cache"
    first, _ = build(dataset, cache)
    second, seen = build(dataset, cache, adapter=cls())
    assert not second.reused and second.path != first.path and len(seen) == N


def test_output_contract_is_not_in_the_key(dataset, tmp_path):
    """Outputs never reach preprocess: an adapter differing only there would reuse (if its class matched)."""
    from ff_core.data.cache.store import contract_identity

    assert contract_identity(OtherOutputs.io_contract) == contract_identity(HashAdapter.io_contract)


def test_force_reprocess_rebuilds_and_replaces(dataset, tmp_path):
    cache = tmp_path / "cache"
    first, _ = build(dataset, cache)
    token = json.loads((first.path / MANIFEST).read_text())["token"]
    second, seen = build(dataset, cache, force=True)
    assert not second.reused and len(seen) == N and second.path == first.path
    assert json.loads((second.path / MANIFEST).read_text())["token"] != token
    assert_rows(second.conditions, [expected_condition(f"prompt {i}", rgb(i)) for i in range(N)])
    assert sorted(p.name for p in cache.iterdir()) == [first.path.name]


def test_a_folder_without_a_complete_manifest_is_never_read(dataset, tmp_path):
    """A half-copied cache (files but no manifest, or a part of the wrong size) is rebuilt, not read."""
    cache = tmp_path / "cache"
    first, _ = build(dataset, cache)
    part = next(first.path.glob("*.arrow"))
    part.write_bytes(part.read_bytes()[:-10])
    assert read_manifest(first.path, first.path.name, N) is None
    second, seen = build(dataset, cache)
    assert not second.reused and len(seen) == N
    (second.path / MANIFEST).unlink()
    third, seen = build(dataset, cache)
    assert not third.reused and len(seen) == N
    assert_rows(third.conditions, [expected_condition(f"prompt {i}", rgb(i)) for i in range(N)])


def test_a_failed_build_leaves_nothing(dataset, tmp_path):
    cache = tmp_path / "cache"
    adapter = HashAdapter()

    def broken(inputs):
        raise RuntimeError("encoder exploded")

    adapter.preprocess = broken
    with pytest.raises(RuntimeError, match="encoder exploded"):
        open_or_build(source(dataset), adapter, cache_dir=cache, batch_size=2)
    assert list(cache.iterdir()) == []


# -- processes -------------------------------------------------------------------------------------------
def helper(dataset: Path, cache: Path, *args: str) -> list[str]:
    return [sys.executable, str(HELPER), str(dataset), str(cache), *args]


def test_a_build_killed_midway_is_never_read_and_the_next_run_rebuilds(dataset, tmp_path):
    """SIGKILL while the builder writes (after its first batch): no cache is published; the next build ignores the
    dead build folder, removes it (its owner is gone) and publishes a complete cache."""
    cache, log = tmp_path / "cache", tmp_path / "calls.jsonl"
    proc = subprocess.Popen(helper(dataset, cache, "--delay", "1.0", "--log", str(log)))
    deadline = time.monotonic() + 60
    while not (log.exists() and log.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    [build_dir] = cache.glob(".*.build-*")
    assert any(build_dir.glob("*.arrow"))  # the part file is half written
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert [p.name for p in cache.iterdir()] == [build_dir.name]  # nothing published
    result, seen = build(dataset, cache)
    assert not result.reused and len(seen) == N and not build_dir.exists()
    assert_rows(result.conditions, [expected_condition(f"prompt {i}", rgb(i)) for i in range(N)])


def test_two_concurrent_builders_publish_one_complete_cache(dataset, tmp_path):
    """Two jobs build the same key at once: each writes its own build folder, the first rename wins, the other
    keeps the winner's cache; both read every row (ids checked) and nothing else is left. A barrier starts both builds
    together (on a busy machine one helper's imports can otherwise outlast the other's whole build)."""
    cache, ready = tmp_path / "cache", tmp_path / "ready"
    args = ("--delay", "0.3", "--barrier", str(ready), "2")
    procs = [subprocess.Popen(helper(dataset, cache, *args), stdout=subprocess.PIPE, text=True)
             for _ in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert {o[0] for o in outs} == {"built"} and outs[0][1] == outs[1][1] and outs[0][2] == str(N)
    assert [p.name for p in cache.iterdir()] == [Path(outs[0][1]).name]
    result, seen = build(dataset, cache)
    assert result.reused and seen == []
    assert_rows(result.conditions, [expected_condition(f"prompt {i}", rgb(i)) for i in range(N)])


@pytest.mark.parametrize("mode", ["global", "local"])
def test_sharded_build_over_two_ranks(dataset, tmp_path, mode):
    """Two gloo ranks. ``global``: each preprocesses half the rows into one build folder that rank 0 publishes.
    ``local`` (two one-rank nodes on one shared disk): each node builds a whole copy and the first to publish wins.
    A later one-process run reuses it: the world size is not part of the identity."""
    cache = tmp_path / "cache"
    logs = [tmp_path / f"rank{r}.jsonl" for r in range(2)]
    procs = [subprocess.Popen(helper(dataset, cache, "--log", str(logs[r]), "--batch-size", "2", "--dist", mode,
                                     str(r), "2", str(tmp_path / "rendezvous")), stdout=subprocess.PIPE, text=True)
             for r in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[0][:3] == outs[1][:3] == ["built", outs[0][1], str(N)]
    seen = [[p for line in log.read_text().splitlines() for p in json.loads(line)] for log in logs]
    if mode == "global":
        assert seen == [[f"prompt {i}" for i in range(3)], [f"prompt {i}" for i in range(3, 6)]]
        manifest = json.loads((Path(outs[0][1]) / MANIFEST).read_text())
        assert [p["rows"] for p in manifest["parts"]] == [3, 3]
    else:
        assert seen == [[f"prompt {i}" for i in range(N)]] * 2
    assert [p.name for p in cache.iterdir()] == [Path(outs[0][1]).name]
    result, again = build(dataset, cache)
    assert result.reused and again == []
    assert_rows(result.conditions, [expected_condition(f"prompt {i}", rgb(i)) for i in range(N)])


def test_stale_build_folders_of_dead_builders_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket

    stale, live = tmp_path / ".k.build-a", tmp_path / ".k.build-b"
    for folder, pid in ((stale, int(dead.stdout)), (live, os.getpid())):
        folder.mkdir()
        (folder / "owner.json").write_text(json.dumps({"host": socket.gethostname(), "pid": pid}))
    assert remove_stale_builds(tmp_path) == [stale] and live.exists() and not stale.exists()


def test_build_group_from_a_trainer():
    """Lightning numbers ranks node-major: 2 nodes of 2 devices, global rank 3 is node 1's local rank 1."""
    from types import SimpleNamespace

    from ff_core.data.cache.group import BuildGroup

    trainer = SimpleNamespace(world_size=4, num_nodes=2, global_rank=3, local_rank=1, node_rank=1)
    group = BuildGroup.from_trainer(trainer)
    assert group == BuildGroup(rank=3, world_size=4, local_rank=1, local_world_size=2, node_rank=1)
    assert [group.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert BuildGroup.from_trainer(SimpleNamespace(world_size=1)) == BuildGroup()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        group.all_gather(1)


def test_flow_module_prepares_conditions_with_torch_defaults(tmp_path):
    """Lightning runs configure_model under its tensor-init context (default device: the accelerator, default dtype:
    the precision's, e.g. bf16-true). A cache built there must hold what it holds anywhere else: here the context
    is the meta device and bfloat16, under which the adapter's own tensors (``torch.tensor(len(prompt))``) would be
    meta tensors and its float constants bfloat16."""
    from types import SimpleNamespace

    from ff_core.data.datamodule import FlowDataModule
    from ff_core.data.records.sources import DatasetConfig
    from ff_core.module import FlowModule

    root = write_dataset(tmp_path / "data", 3, with_media=False)
    data = FlowDataModule([DatasetConfig(name="d", dataset_dir=str(root))], cache_dir=str(tmp_path / "cache"),
                          adapter="cache_helpers:HashAdapter")  # fmt: skip
    data.setup("fit")
    model = FlowModule("cache_helpers:HashAdapter", "unused")
    model._trainer = SimpleNamespace(datamodule=data, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    adapter = HashAdapter()
    default = torch.get_default_dtype()
    try:
        with torch.device("meta"):
            torch.set_default_dtype(torch.bfloat16)
            model._prepare_conditions(adapter)
        assert torch.get_default_dtype() == torch.bfloat16  # the context is restored
    finally:
        torch.set_default_dtype(default)
    assert adapter.preprocessing_released
    assert_rows(data._conditions["train"], [expected_condition(f"prompt {i}", None) for i in range(3)])
