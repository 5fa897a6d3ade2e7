"""The target-span header checks at an ``ff fit`` start, without and with the media header cache (docs/datasets.md,
"Target headers at set-up").

Writes ``--pairs`` V2 records of an (MP4, WAV) target each (a 12-frame 32x32 clip at 8 fps, 1.5 s of 22.05 kHz mono:
the tiny LTX-2 recipes' targets; ``2 * pairs`` distinct files, copies of one clip), then times
:func:`~ff_core.data.media.target_spans.target_span_errors` for a 9-frame 8 fps clip and its 1.125 s of audio: with no
cache, on a cold cache (every header read, the table written) and on the warm one (a ``stat`` a file).

    python benchmarks/bench_header_cache.py --pairs 1000
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ff_core.callbacks.media_log import audio_to_wav
from ff_core.contracts import AudioSpan, MediaGeometry
from ff_core.data.media.target_spans import target_span_errors
from ff_core.data.records.sources import DatasetConfig, load_split
from ff_core.testing.moving_shapes import write_mp4


def write_pairs(root: Path, pairs: int) -> Path:
    (root / "videos").mkdir(parents=True)
    (root / "audios").mkdir()
    clip = write_mp4(root / "clip.mp4", np.full((12, 32, 32, 3), 96, np.uint8), 8.0).read_bytes()
    wav = audio_to_wav(0.1 * torch.sin(torch.arange(33075) / 10.0)[None], 22050)
    lines = []
    for i in range(pairs):
        (root / "videos" / f"{i:06d}.mp4").write_bytes(clip)
        (root / "audios" / f"{i:06d}.wav").write_bytes(wav)
        media = [{"type": "video", "path": f"videos/{i:06d}.mp4", "fps": 8.0},
                 {"type": "audio", "path": f"audios/{i:06d}.wav", "sample_rate": 22050}]  # fmt: skip
        lines.append(json.dumps({"schema_version": 2, "input": {"prompt": f"clip {i}", "media": []},
                                 "supervision": {"type": "demonstration", "target": {"media": media}}}))  # fmt: skip
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1000)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ff-header-cache-"))
    try:
        records = load_split(DatasetConfig(name="pairs", dataset_dir=str(write_pairs(work / "data", args.pairs))),
                             "train", "sft")  # fmt: skip
        geometry = [MediaGeometry(32, 32, num_frames=9, fps=8.0), AudioSpan(1.125)]
        files = 2 * len(records)
        for label, cache in (("no cache", None), ("cold cache", work / "cache"), ("warm cache", work / "cache")):
            start = time.perf_counter()
            errors = target_span_errors(records, geometry, cache_dir=cache)
            seconds = time.perf_counter() - start
            assert not errors, errors[:3]
            print(f"{label:>10}: {seconds:7.3f} s for {files} files ({1e3 * seconds / files:.3f} ms a file)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
