"""Bad media found while training (issue 24 item 8): real truncated files, real DataLoader worker processes.

A truncated PNG, a truncated faststart MP4 and a header-only WAV used to crash the step that drew their row with a
33-frame worker traceback (``RuntimeError: Caught DatasetError in DataLoader worker process 0``); the one-line error
came only with 0 workers. Now the same one line comes from workers, and ``data.bad_samples: skip`` trains on without
the row, counted and listed in ``<run dir>/bad_samples.jsonl``, with the number of batches per epoch unchanged.

References: each file is written by a real encoder (PIL's PNG writer, libx264 through PyAV with ``movflags=
faststart``, the WAV writer of media logging) and then cut; the expected reason is what the decoder itself says
about the cut file (PIL's ``Image.load``), not a restatement of ff's messages.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from ff_core.contracts import MediaGeometry
from ff_core.data.dataflow import DataflowLoader, MapDistributor
from ff_core.data.records.sources import DatasetConfig, load_split
from ff_core.data.samples import ConditionedRecords, RecordProcessor, SampleCollator
from ff_core.errors import DatasetError
from ff_core.testing.clips import write_wav

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "sd3" / "sft_tiny.yaml"
BAD_LINE = 4  # 1-based line of the row whose image is cut


@pytest.fixture(scope="module")
def bad_png_dir(tmp_path_factory, shapes_dir) -> Path:
    """8 rows of the shapes dataset; row 4's PNG re-written by PIL and cut after 60 bytes."""
    root = tmp_path_factory.mktemp("bad_png")
    (root / "images").mkdir()
    lines = (shapes_dir / "train.jsonl").read_text().splitlines()[:8]
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    for line in lines:
        rel = json.loads(line)["supervision"]["target"]["media"][0]["path"]
        Image.open(shapes_dir / rel).save(root / rel)
    cut = root / json.loads(lines[BAD_LINE - 1])["supervision"]["target"]["media"][0]["path"]
    cut.write_bytes(cut.read_bytes()[:60])
    return root


def pil_reason(path: Path) -> str:
    """What PIL itself says about the cut file."""
    with pytest.raises(OSError) as err:
        Image.open(path).load()
    return str(err.value)


def fit(data: Path, run: Path, *extra: str) -> subprocess.CompletedProcess:
    args = ["fit", "--config", str(RECIPE), "--data.datasets", json.dumps([{"name": "bad", "dataset_dir": str(data)}]),
            "--data.num_workers", "2", "--data.per_device_batch_size", "4", "--data.cache_dir", str(run / "cache"),
            "--trainer.default_root_dir", str(run), "--trainer.logger", "false", "--trainer.max_steps", "4",
            "--trainer.val_check_interval", "null", "--trainer.callbacks", "null", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "ff_core.cli", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=600)


def test_a_truncated_png_with_two_workers_is_one_line(bad_png_dir, tmp_path):
    result = fit(bad_png_dir, tmp_path)
    png = bad_png_dir / "images" / "00003.png"
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "worker process" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == (f"{bad_png_dir / 'train.jsonl'}:{BAD_LINE}: "
                                              f"supervision.target.media[0].path: {png}: cannot decode image: "
                                              f"{pil_reason(png)}")


def test_skip_lists_the_row_and_keeps_the_number_of_batches(bad_png_dir, tmp_path):
    """8 rows, 4 per batch: 2 batches per epoch, 4 steps = 2 epochs, the cut row drawn once in each."""
    result = fit(bad_png_dir, tmp_path, "--data.bad_samples", "skip")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=4` reached." in result.stderr + result.stdout
    entries = [json.loads(line) for line in (tmp_path / "bad_samples.jsonl").read_text().splitlines()]
    assert [(e["path"], e["line"], e["field"], e["rank"]) for e in entries] == [
        (str(bad_png_dir / "train.jsonl"), BAD_LINE, "supervision.target.media[0].path", 0)] * 2
    assert entries[0]["step"] in (1, 2) and entries[1]["step"] in (3, 4)  # one per epoch: batches not re-drawn
    assert pil_reason(bad_png_dir / "images" / "00003.png") in entries[0]["reason"]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("skipped a bad sample")]
    assert len(warnings) == 2 and "2 on rank 0 so far" in warnings[1], result.stderr[-3000:]


def faststart_mp4(path: Path, frames: int, fps: int, size: int = 32) -> Path:
    """An H.264 MP4 with its index (``moov``) before the data (``movflags=faststart``), random frames."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with av.open(str(path), "w", options={"movflags": "faststart"}) as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height = stream.width = size
        stream.pix_fmt = "yuv420p"
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 255, (size, size, 3), np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    data = path.read_bytes()
    assert data.find(b"moov") < data.find(b"mdat"), "faststart: the index comes first"
    return path


@pytest.fixture(scope="module")
def av_dir(tmp_path_factory) -> Path:
    """6 (video, audio) demonstrations; row 2's MP4 cut in half (its index still says 16 frames), row 5's WAV cut to
    its 44-byte header."""
    root = tmp_path_factory.mktemp("bad_av")
    rows = []
    for i in range(6):
        faststart_mp4(root / "videos" / f"{i}.mp4", frames=16, fps=8)
        write_wav(root / "audios" / f"{i}.wav", np.zeros((16000 * 2, 1), np.float32), 16000)
        rows.append({"schema_version": 2, "input": {"prompt": f"clip {i}"}, "supervision": {
            "type": "demonstration", "target": {"media": [{"type": "video", "path": f"videos/{i}.mp4"},
                                                          {"type": "audio", "path": f"audios/{i}.wav"}]}}})
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    mp4 = root / "videos" / "1.mp4"
    mp4.write_bytes(mp4.read_bytes()[: mp4.stat().st_size // 2])
    wav = root / "audios" / "4.wav"
    wav.write_bytes(wav.read_bytes()[:44])
    return root


def av_loader(root: Path, policy: str, workers: int = 2, on_bad=None, batch_size: int = 3) -> DataflowLoader:
    records = load_split(DatasetConfig(name="av", dataset_dir=str(root)), "train", "sft")
    table = ConditionedRecords(records, [{"x": torch.zeros(1)} for _ in records])
    geometry = (MediaGeometry(height=32, width=32, num_frames=16, fps=8), None)
    return DataflowLoader(MapDistributor(table, shuffle=False), RecordProcessor(geometry), collator=SampleCollator(),
                          batch_size=batch_size, num_workers=workers, steps_per_epoch=6 // batch_size,
                          bad_samples=policy,
                          on_bad_samples=on_bad)  # fmt: skip


def test_a_truncated_faststart_mp4_in_a_worker_raises_its_own_error(av_dir):
    with pytest.raises(DatasetError) as err:
        list(av_loader(av_dir, "error"))
    assert type(err.value) is DatasetError  # not torch's RuntimeError wrapping the worker's traceback
    assert (err.value.path, err.value.line, err.value.field) == (str(av_dir / "train.jsonl"), 2,
                                                                 "supervision.target.media[0].path")
    assert str(av_dir / "videos" / "1.mp4") in err.value.reason


def test_skip_leaves_out_the_cut_mp4_and_the_header_only_wav(av_dir):
    skipped: list = []
    batches = list(av_loader(av_dir, "skip", on_bad=lambda errors, step: skipped.extend((step, e) for e in errors)))
    assert [b["index"].tolist() for b in batches] == [[0, 2], [3, 5]]  # two batches of 3, each one row short
    assert [(step, e.line, e.field) for step, e in skipped] == [
        (1, 2, "supervision.target.media[0].path"), (2, 5, "supervision.target.media[1].path")]
    assert "no audio samples decoded" in skipped[1][1].reason
    for b in batches:  # the rows left are whole: 16 frames and their audio
        assert all(t[0].frames.shape[0] == 16 for t in b["target"])


def test_the_skipped_count_resumes(av_dir):
    loader = av_loader(av_dir, "skip", workers=0)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert state["skipped"] == 1
    resumed = av_loader(av_dir, "skip", workers=2)
    resumed.load_state_dict(state)
    assert [b["index"].tolist() for b in resumed] == [[3, 5]]
    assert resumed.skipped_samples == 2


def test_skip_cannot_leave_out_a_whole_batch(av_dir):
    """One sample per batch (MiniMax H3 trains so): leaving the bad one out would drop a batch on this rank only."""
    loader = av_loader(av_dir, "skip", batch_size=1)
    it = iter(loader)
    assert next(it)["index"].tolist() == [0]
    with pytest.raises(DatasetError) as err:
        next(it)
    assert (err.value.line, err.value.field) == (2, "supervision.target.media[0].path")


def test_validate_check_media_finds_the_cut_faststart_mp4_and_the_header_only_wav(av_dir, capsys):
    """Before a run: the cut MP4 used to decode without an error to its first 4 frames (frame threading drops the
    frames whose data is missing) and passed ``--check-media``; a single-threaded decode reports the broken packet."""
    from ff_core.cli import main

    assert main(["data", "validate", str(av_dir), "--check-media"]) != 0
    out = capsys.readouterr().out
    manifest = av_dir / "train.jsonl"
    assert (f"{manifest}:2: supervision.target.media[0].path: {av_dir / 'videos' / '1.mp4'}: cannot decode video: "
            "truncated or damaged: its index lists 16 frames but ") in out, out
    assert (f"{manifest}:5: supervision.target.media[1].path: {av_dir / 'audios' / '4.wav'}: no audio samples "
            "decoded (empty or truncated file?)") in out, out
    assert f"{manifest}:1:" not in out and f"{manifest}:3:" not in out
