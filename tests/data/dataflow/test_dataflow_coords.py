"""Coordinates are injectable and detected in a fixed order (STYLE 12; spec §6)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ff_core.data.dataflow import DataParallelCoords, WorkerCoords


def test_detect_precedence():
    assert DataParallelCoords.detect() == DataParallelCoords(0, 1)  # no process group in this test
    dims = SimpleNamespace(dp_coord=(1, 4))
    assert DataParallelCoords.detect(dims) == DataParallelCoords(1, 4)
    assert DataParallelCoords.detect(SimpleNamespace(dp_rank=2, dp_world_size=3)) == DataParallelCoords(2, 3)
    assert DataParallelCoords.detect(dims, dp_rank=0, dp_world_size=2) == DataParallelCoords(0, 2)
    with pytest.raises(ValueError, match="both dp_rank and dp_world_size"):
        DataParallelCoords.detect(dp_rank=1)
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        DataParallelCoords(2, 2)


def test_from_trainer_uses_the_data_parallel_layout():
    trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 4, "rank": 3})
    assert DataParallelCoords.from_trainer(trainer) == DataParallelCoords(3, 4)
    assert DataParallelCoords.from_trainer(SimpleNamespace(distributed_sampler_kwargs=None)) == DataParallelCoords()


def test_gather_and_worker_coords_in_one_process():
    assert DataParallelCoords().all_gather({"a": 1}) == [{"a": 1}]
    with pytest.raises(RuntimeError, match="not initialised"):
        DataParallelCoords(0, 2).all_gather({})
    assert WorkerCoords.detect() == WorkerCoords(0, 1)
