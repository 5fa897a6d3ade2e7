"""Mixed geometry through same-shape buckets: records assigned from their targets' headers, targets fitted to their
bucket, batches that never mix buckets (so nothing is padded), resumable; short clips rejected before weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ff_core.adapter import Adapter
from ff_core.contracts import MediaGeometry, MediaType
from ff_core.data.dataflow import BucketBatcher, DataflowLoader, MapDistributor
from ff_core.data.datamodule import FlowDataModule
from ff_core.data.media.buckets import assign_buckets, choose_bucket
from ff_core.data.media.decode import MediaHeader
from ff_core.data.records.sources import DatasetConfig, load_split
from ff_core.data.samples import ConditionedRecords, RecordProcessor, SampleCollator
from ff_core.errors import DatasetErrors
from ff_core.testing.clips import write_clip_dataset
from ff_core.testing.contracts import SUPPORT_TABLE

LAND = MediaGeometry(16, 32, num_frames=5, fps=8.0)  # 1 + 4/8 s
LAND_SHORT = MediaGeometry(16, 32, num_frames=3, fps=8.0)
PORTRAIT = MediaGeometry(32, 16, num_frames=5, fps=8.0)
GEOMETRIES = [LAND, LAND_SHORT, PORTRAIT]
# (height, width, frames, fps): landscape long, landscape short, portrait long, portrait short (fits only a short
# landscape bucket: cropped, but never stretched), square long
CLIPS = [(36, 64, 12, 8), (36, 64, 4, 8), (64, 36, 16, 16), (64, 36, 3, 8), (40, 40, 12, 8)]


def header(w: int, h: int, seconds: float, fps: float = 8.0) -> MediaHeader:
    return MediaHeader(MediaType.VIDEO, width=w, height=h, seconds=seconds, fps=fps)


def test_choice_prefers_aspect_then_length_and_never_stretches():
    assert choose_bucket(header(64, 36, 2.0), GEOMETRIES, None) == 0  # landscape, long enough for 5 frames
    assert choose_bucket(header(64, 36, 0.5), GEOMETRIES, None) == 1  # 4 frames: only the 3-frame grid fits
    assert choose_bucket(header(36, 64, 2.0), GEOMETRIES, None) == 2
    assert choose_bucket(header(36, 64, 0.375), GEOMETRIES, None) == 1  # 3 frames: short landscape, cropped
    assert choose_bucket(header(64, 36, 0.25), GEOMETRIES, None) is None  # 2 frames: nothing fits
    # A declared 4 fps clock makes the 4-frame clip 1 s long: the 5-frame grid at 8 fps (0.5 s) fits.
    assert choose_bucket(header(64, 36, 0.5), GEOMETRIES, 4.0) == 0


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return write_clip_dataset(tmp_path_factory.mktemp("mixed"), CLIPS)


def test_records_are_assigned_and_short_clips_rejected(clips, tmp_path):
    records = load_split(DatasetConfig(name="mixed", dataset_dir=str(clips)), "train", "sft")
    assert assign_buckets(records, GEOMETRIES) == [0, 1, 2, 1, 0]
    with pytest.raises(DatasetErrors) as err:
        assign_buckets(records, [LAND, PORTRAIT])
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 2 and "train.jsonl:2" in lines[0] and "1.mp4: fits no bucket" in lines[0]
    assert "train.jsonl:4" in lines[1] and "never stretched" in lines[1]


def test_bucket_headers_are_cached_across_runs(clips, tmp_path, monkeypatch):
    """With ``cache_dir`` (``FlowDataModule`` passes its cache root) the second assignment reads no header
    (ff_core/data/media/header_cache.py) and gives the same buckets and the same errors."""
    from ff_core.data import header_cache

    records = load_split(DatasetConfig(name="mixed", dataset_dir=str(clips)), "train", "sft")
    read = []
    probe = header_cache.probe_media
    monkeypatch.setattr(header_cache, "probe_media", lambda *a, **k: read.append(a[0]) or probe(*a, **k))
    for expected_reads in (5, 0):
        read.clear()
        assert assign_buckets(records, GEOMETRIES, cache_dir=tmp_path) == [0, 1, 2, 1, 0]
        assert len(read) == expected_reads
    with pytest.raises(DatasetErrors, match="1.mp4: fits no bucket"):
        assign_buckets(records, [LAND, PORTRAIT], cache_dir=tmp_path)
    assert len(read) == 0


def test_bucketed_batches_are_homogeneous_and_resume_exactly(clips):
    records = load_split(DatasetConfig(name="mixed", dataset_dir=str(clips)), "train", "sft") * 4
    assignment = assign_buckets(records, GEOMETRIES)
    table = ConditionedRecords(records, [{"pooled": torch.zeros(2)} for _ in records])

    def loader() -> DataflowLoader:
        return DataflowLoader(MapDistributor(table, seed=3), RecordProcessor((None,), GEOMETRIES, assignment),
                              BucketBatcher([2, 3, 1]), SampleCollator(), steps_per_epoch=6)

    first = loader()
    batches = list(first)
    for batch in batches:
        shapes = {tuple(t[0].frames.shape) for t in batch["target"]}
        buckets = {assignment[i] for i in batch["index"].tolist()}
        assert len(shapes) == 1 and len(buckets) == 1
        (bucket,) = buckets
        g = GEOMETRIES[bucket]
        assert shapes == {(g.num_frames, g.height, g.width, 3)} and len(batch["index"]) == [2, 3, 1][bucket]
    # Resume after the third batch: the same remaining batches.
    again = loader()
    it = iter(again)
    for _ in range(3):
        next(it)
    state = again.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    assert [b["index"].tolist() for b in resumed] == [b["index"].tolist() for b in batches[3:]]


def test_data_module_assigns_before_weights_and_sizes_batches(clips):
    dm = FlowDataModule([{"name": "mixed", "dataset_dir": str(clips)}], per_device_batch_size=2, max_tokens=100,
                        buckets=[{"height": 16, "width": 32, "num_frames": 5, "fps": 8.0},
                                 {"height": 16, "width": 32, "num_frames": 3, "fps": 8.0, "batch_size": 4},
                                 {"height": 32, "width": 16, "num_frames": 5, "fps": 8.0}])
    dm.setup("fit")
    assert dm.bucket_assignment == [0, 1, 2, 1, 0]
    tokens = SimpleNamespace(name="toy", denoiser_tokens=lambda g: g.num_frames * g.height * g.width // 64)
    assert dm.bucket_batch_sizes(tokens) == [100 // 40, 4, 100 // 40]
    # counts (2, 2, 1) over sizes (2, 4, 2): 1 + 0.5 + 0.5 batches per epoch, shared by the ranks
    assert dm.bucketed_steps([2, 4, 2], world_size=1) == 2 and dm.bucketed_steps([2, 4, 2], world_size=2) == 1


class ClipAdapter(Adapter):
    """No weights: a text condition of one value per prompt word (ragged, padded by its collation rule)."""

    name = "clip-toy"
    io_contract = SUPPORT_TABLE["wan2_t2v"]
    condition_collation = {"words": "pad"}

    def preprocess(self, inputs):
        return [{"words": torch.ones(len(i.prompt.split()) + int(i.prompt[-1]) % 3, 2)} for i in inputs]

    def output_geometry(self):
        return (MediaGeometry(16, 16, num_frames=3, fps=8.0),)

    def denoiser_tokens(self, geometry):
        return geometry.num_frames * geometry.height * geometry.width // 64


def test_the_training_loader_batches_by_bucket(clips):
    dm = FlowDataModule([{"name": "mixed", "dataset_dir": str(clips)}], enable_preprocess=False, shuffle=False,
                        max_tokens=100, buckets=[{"height": 16, "width": 32, "num_frames": 5, "fps": 8.0},
                                                 {"height": 16, "width": 32, "num_frames": 3, "fps": 8.0},
                                                 {"height": 32, "width": 16, "num_frames": 5, "fps": 8.0}])
    dm.setup("fit")
    dm.trainer = SimpleNamespace(lightning_module=SimpleNamespace(adapter=ClipAdapter()), accumulate_grad_batches=1)
    loader = dm.train_dataloader()
    assert isinstance(loader.batcher, BucketBatcher) and loader.batcher.batch_sizes == (2, 4, 2)
    assert len(loader) == 2  # (2/2 + 2/4 + 1/2) batches per epoch
    seen = []
    for batch in loader:
        shapes = {tuple(t[0].frames.shape) for t in batch["target"]}
        assert len(shapes) == 1  # one bucket per batch
        assert batch["condition"]["words"].shape[:2] == batch["condition"]["words_mask"].shape
        seen.append((batch["index"].tolist(), shapes.pop()))
    assert seen[0] == ([0, 4], (5, 16, 32, 3))  # stream order: bucket 0 fills first (records 0 and 4)
