"""Condition-cache integrity (issue 24, item 5) and full disks (item 11) with real ``ff fit`` processes.

A cache built by ``ff fit`` (the tiny SD3 of configs/sd3/sft_tiny.yaml) gets 8 flipped bytes, as a failing disk or
a stray write would leave them, and the next ``ff fit`` must notice: before the digests, a flip in the footer gave
a segfault (rc 139) or an ``ArrowInvalid`` traceback, and a flip in a tensor went unnoticed (the run trained on the
damaged embeddings, exit 0). The reference is the file itself: the test flips bytes at offsets it picks from the
manifest's block table and from the file size, never through ff's reader.

The full disk is real: a 256 KiB tmpfs (``mount -t tmpfs``; skipped where the test may not mount) as
``data.cache_dir`` or as the ``--output`` of ``ff data preprocess-latents``, so the OS itself answers ``ENOSPC``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ff_core.data.cache.store import MANIFEST

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "sd3" / "sft_tiny.yaml"


def ff(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``ff ARGS`` in a fresh process (what a user runs), output captured."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "ff_core.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO)  # fmt: skip


def fit(tiny_sd3, shapes_dir, cache: Path, root: Path, *extra: str) -> subprocess.CompletedProcess:
    datasets = json.dumps([{"name": "shapes", "dataset_dir": str(shapes_dir)}])
    return ff("fit", "--config", str(RECIPE), "--model.pretrained_model_name_or_path", str(tiny_sd3),
              "--data.datasets", datasets, "--data.cache_dir", str(cache), "--data.preprocessing_batch_size", "4",
              "--trainer.max_steps", "3", "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
              "--trainer.enable_progress_bar", "false", "--trainer.callbacks", "[]",
              "--trainer.default_root_dir", str(root), *extra)  # fmt: skip


def train_cache(cache: Path) -> tuple[Path, dict]:
    """The training split's cache folder (24 rows) and its manifest."""
    for manifest in cache.glob(f"*/{MANIFEST}"):
        data = json.loads(manifest.read_text())
        if data["identity"]["dataset"]["split"] == "train":
            return manifest.parent, data
    raise AssertionError(f"no training cache in {cache}: {list(cache.iterdir())}")


def flip(path: Path, offset: int, n: int = 8) -> None:
    """Invert ``n`` bytes of ``path`` from ``offset`` (same size: the old size check cannot see it)."""
    data = bytearray(path.read_bytes())
    data[offset : offset + n] = bytes(b ^ 0xFF for b in data[offset : offset + n])
    path.write_bytes(bytes(data))


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The last stderr line of a failed run, checked to be ff's one-line error, not a traceback."""
    assert proc.returncode not in (0, -11, 139), (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr.strip().splitlines()[-1]


def test_flipped_tensor_bytes_stop_the_run_then_the_cache_is_rebuilt(tiny_sd3, shapes_dir, tmp_path):
    """8 flipped bytes inside record batch 3 (rows 12-15; batches of 4 rows) of the training part: the open-time
    checks (footer, batch 0) pass, the first read of those rows fails with one line naming the file and rows, and
    the next start rebuilds the cache (with a warning) and trains."""
    cache = tmp_path / "cache"
    assert fit(tiny_sd3, shapes_dir, cache, tmp_path / "r0").returncode == 0
    folder, manifest = train_cache(cache)
    part = manifest["parts"][0]
    offset = (folder / part["file"]).stat().st_size * 6 // 10  # inside the tensors of batch 3 of 6 (+ footer)
    flip(folder / part["file"], offset)

    failed = fit(tiny_sd3, shapes_dir, cache, tmp_path / "r1")
    line = one_line_error(failed)  # before the digests: exit 0, trained on the damaged rows
    block = next(i for i, (end, _) in enumerate(part["blocks"]) if offset < end)
    start, end = part["blocks"][block - 1][0], part["blocks"][block][0]
    assert block == 3, part["blocks"]
    assert line.startswith(f"{folder / part['file']}: rows 12-15 (bytes {start}-{end}) do not match"), line
    assert "the next start rebuilds this condition cache" in line
    assert (folder / "corrupt.json").exists()

    again = fit(tiny_sd3, shapes_dir, cache, tmp_path / "r2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "CORRUPT CONDITION CACHE" in again.stderr
    rebuilt_folder, rebuilt = train_cache(cache)
    assert rebuilt_folder == folder and not (folder / "corrupt.json").exists()
    assert rebuilt["rebuilt_after_corruption"]["file"] == part["file"]
    assert rebuilt["rebuilt_after_corruption"]["bytes"] == [start, end]


def test_flipped_footer_is_rebuilt_once_then_refused(tiny_sd3, shapes_dir, tmp_path):
    """8 flipped bytes in the Arrow footer (what gave the segfault / ArrowInvalid): the next start finds it at
    open and rebuilds, loudly; the same damage to the rebuilt cache stops the run with one line (a disk that
    corrupts twice is not masked), until the user forces a rebuild."""
    cache = tmp_path / "cache"
    assert fit(tiny_sd3, shapes_dir, cache, tmp_path / "r0").returncode == 0
    folder, manifest = train_cache(cache)
    part = folder / manifest["parts"][0]["file"]
    flip(part, part.stat().st_size - 40)

    rebuilt = fit(tiny_sd3, shapes_dir, cache, tmp_path / "r1")
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    assert f"CORRUPT CONDITION CACHE {part}: bytes" in rebuilt.stderr
    assert train_cache(cache)[1]["rebuilt_after_corruption"]["block"] == len(manifest["parts"][0]["blocks"]) - 1

    flip(part, part.stat().st_size - 40)
    refused = fit(tiny_sd3, shapes_dir, cache, tmp_path / "r2")
    line = one_line_error(refused)
    assert line.startswith(f"{part}: bytes ") and "already rebuilt after" in line and "may be failing" in line, line

    forced = fit(tiny_sd3, shapes_dir, cache, tmp_path / "r3", "--data.force_reprocess", "true")
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert "rebuilt_after_corruption" not in train_cache(cache)[1]


# -- the same rules in one process (HashAdapter: seconds) ----------------------------------------------------------
def test_blocks_cut_the_ipc_file_at_its_record_batches(tmp_path):
    """The digest blocks cover the file contiguously, the first starts with and the last ends with the Arrow IPC
    file magic ``ARROW1`` (Arrow columnar format spec, "IPC File Format": magic, stream, footer, footer size,
    magic), there is one block per record batch plus the footer, and each digest is hashlib's over its range."""
    import hashlib

    import torch

    from ff_core.data.cache.table import PartWriter

    writer = PartWriter(tmp_path / "p.arrow")
    for start in range(0, 6, 2):
        writer.write([bytes([i]) * 32 for i in range(start, start + 2)], [{"x": torch.full((5,), float(i))}
                                                                          for i in range(start, start + 2)], start)
    blocks = writer.close()
    data = (tmp_path / "p.arrow").read_bytes()
    assert len(blocks) == 3 + 1 and blocks[-1][0] == len(data)
    assert data[:6] == b"ARROW1" and data[-6:] == b"ARROW1"
    starts = [0] + [end for end, _ in blocks[:-1]]
    assert [hashlib.sha256(data[a:end]).hexdigest() for a, (end, _) in zip(starts, blocks)] == [d for _, d in blocks]
    assert all(a < end for a, (end, _) in zip(starts, blocks))


def test_in_process_flip_read_then_rebuild(tmp_path, caplog):
    """open_or_build with the test adapter: a flip in record batch 1 passes the open, fails the first read of rows
    2-3 (CacheCorruptError naming them), and the next open rebuilds with a warning; rows read back as computed."""
    from cache_helpers import HashAdapter, expected_condition, rgb, source, write_dataset

    from ff_core.data.cache.digest import CacheCorruptError
    from ff_core.data.cache.store import open_or_build

    root = write_dataset(tmp_path / "data", 6)
    first = open_or_build(source(root), HashAdapter(), cache_dir=tmp_path / "cache", batch_size=2)
    part = json.loads((first.path / MANIFEST).read_text())["parts"][0]
    start, end = part["blocks"][0][0], part["blocks"][1][0]
    flip(first.path / part["file"], end - 16)
    second = open_or_build(source(root), HashAdapter(), cache_dir=tmp_path / "cache", batch_size=2)
    assert second.reused
    second.conditions[0]
    with pytest.raises(CacheCorruptError, match=rf"rows 2-3 \(bytes {start}-{end}\) do not match"):
        second.conditions[3]
    with caplog.at_level("WARNING", logger="ff_core.data.cache.store"):
        third = open_or_build(source(root), HashAdapter(), cache_dir=tmp_path / "cache", batch_size=2)
    assert not third.reused and "CORRUPT CONDITION CACHE" in caplog.text
    for i in range(6):
        want = expected_condition(f"prompt {i}", rgb(i))
        assert all(torch_equal(third.conditions[i][k], want[k]) for k in want)


def torch_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and torch.equal(a, b)


# -- full disks ------------------------------------------------------------------------------------------------
@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 256 KiB tmpfs (root only; skipped elsewhere), unmounted afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="ff-small-disk-"))
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)], capture_output=True)
    if mount.returncode:
        folder.rmdir()
        pytest.skip(f"cannot mount a small tmpfs here: {mount.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)
        folder.rmdir()


def test_full_disk_while_building_the_cache(tiny_sd3, shapes_dir, tmp_path, small_disk):
    """``ff fit`` with ``data.cache_dir`` on a full disk: one line naming the cache folder and the OS's reason,
    exit 2, nothing left on that disk; the same command with space builds and trains."""
    failed = fit(tiny_sd3, shapes_dir, small_disk / "cache", tmp_path / "r0")
    line = one_line_error(failed)
    assert failed.returncode == 2
    assert line.startswith(str(small_disk / "cache")) and "no space left on device" in line, line
    assert "nothing was published" in line
    assert [p.name for p in (small_disk / "cache").iterdir()] == []
    assert fit(tiny_sd3, shapes_dir, tmp_path / "cache", tmp_path / "r1").returncode == 0


def test_full_disk_while_writing_shards(tiny_sd3, shapes_dir, tmp_path, small_disk):
    """``ff data preprocess-latents --output`` on a full disk: one line naming the shard folder, exit non-zero, no
    hidden or partial folder left beside it; with space, the same command writes the shards."""
    datasets = json.dumps([{"name": "shapes", "dataset_dir": str(shapes_dir)}])
    args = ["data", "preprocess-latents", "--config", str(RECIPE), "--model.pretrained_model_name_or_path",
            str(tiny_sd3), "--data.datasets", datasets, "--no-progress"]  # fmt: skip
    failed = ff(*args, "--output", str(small_disk / "latents"))
    assert failed.returncode != 0 and "Traceback" not in failed.stdout + failed.stderr, failed.stderr[-3000:]
    line = failed.stdout.strip().splitlines()[-1]  # the command's messages go to stdout (stderr: loading bars)
    assert line.startswith(f"ff data preprocess-latents: {small_disk}") and "no space left on device" in line, line
    assert list(small_disk.iterdir()) == []
    ok = ff(*args, "--output", str(tmp_path / "latents"))
    assert ok.returncode == 0 and "wrote 24 rows" in ok.stdout, ok.stdout + ok.stderr[-3000:]
