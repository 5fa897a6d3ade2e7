"""The media header cache of the target-span checks (ff_core/data/media/header_cache.py, docs/datasets.md): a second
start answers every header from the cache with one ``stat`` a file, a changed file is read again, and the cache file
is published atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ff_core import atomic
from ff_core.callbacks.media_log import audio_to_wav
from ff_core.contracts import AudioSpan, MediaType
from ff_core.data import header_cache
from ff_core.data.media.decode import probe_media
from ff_core.data.media.header_cache import HeaderCache
from ff_core.data.media.target_spans import target_span_errors
from ff_core.data.records.sources import DatasetConfig, load_split

RATE = 8000


def write_audio_dataset(root: Path, seconds: list[float]) -> Path:
    """A V2 SFT dataset of audio targets (16-bit mono WAV at 8 kHz), record ``i`` holding ``seconds[i]``."""
    (root / "audios").mkdir(parents=True)
    lines = []
    for i, s in enumerate(seconds):
        (root / "audios" / f"{i:05d}.wav").write_bytes(audio_to_wav(torch.zeros(1, round(s * RATE)), RATE))
        media = [{"type": "audio", "path": f"audios/{i:05d}.wav", "sample_rate": RATE}]
        lines.append(json.dumps({"schema_version": 2, "input": {"prompt": f"tone {i}", "media": []},
                                 "supervision": {"type": "demonstration", "target": {"media": media}}}))  # fmt: skip
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    return root


def records_of(root: Path):
    return load_split(DatasetConfig(name="tones", dataset_dir=str(root)), "train", "sft")


def check(records, cache_dir, monkeypatch) -> tuple[list[str], HeaderCache]:
    """``target_span_errors`` for a 1 s span, with the cache it used kept for its counters."""
    made = []

    class Recorded(HeaderCache):
        def __init__(self, folder):
            super().__init__(folder)
            made.append(self)

    monkeypatch.setattr("ff_core.data.media.target_spans.HeaderCache", Recorded)
    errors = target_span_errors(records, [AudioSpan(1.0)], cache_dir=cache_dir)
    return [e.format() for e in errors], made[0]


def test_second_start_reads_no_header_and_a_changed_file_is_read_again(tmp_path, monkeypatch):
    """First start: every header probed, the same errors as without a cache. Second: no probe at all, same errors
    (the cached headers equal ``probe_media``'s, field for field). Rewriting one target (now too short: new size and
    mtime) re-probes that file alone, and the error follows the file, not the stale entry."""
    root = write_audio_dataset(tmp_path / "data", [1.5, 0.5, 1.25])
    records, cache = records_of(root), tmp_path / "cache"
    uncached = [e.format() for e in target_span_errors(records, [AudioSpan(1.0)])]
    assert len(uncached) == 1 and "audios/00001.wav: audio too short" in uncached[0]
    first, used = check(records, cache, monkeypatch)
    assert first == uncached and (used.probes, used.hits) == (3, 0)
    [table] = (cache / "headers").glob("train.jsonl-*.json")
    second, used = check(records, cache, monkeypatch)
    assert second == uncached and (used.probes, used.hits) == (0, 3)
    wav = root / "audios" / "00002.wav"
    for key in json.loads(table.read_text())["entries"]:
        assert key.startswith("audio:") and Path(key.removeprefix("audio:")).is_absolute()
    cached = HeaderCache(cache / "headers").probe(wav, MediaType.AUDIO, records[2], None)
    assert cached == probe_media(wav, MediaType.AUDIO)
    stat = wav.stat()
    wav.write_bytes(audio_to_wav(torch.zeros(1, RATE // 4), RATE))  # 0.25 s: too short now
    os.utime(wav, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a coarse clock must not hide the change
    third, used = check(records, cache, monkeypatch)
    assert (used.probes, used.hits) == (1, 2)
    assert len(third) == 2 and "audios/00002.wav: audio too short: it holds 0.250 s" in third[1]
    fourth, used = check(records, cache, monkeypatch)
    assert fourth == third and (used.probes, used.hits) == (0, 3)


def test_same_size_rewrite_is_caught_by_mtime(tmp_path, monkeypatch):
    """A file replaced by one of the same size (a WAV of the same length) differs in mtime_ns: read again."""
    root = write_audio_dataset(tmp_path / "data", [1.5, 1.5])
    records = records_of(root)
    check(records, tmp_path / "cache", monkeypatch)
    wav = root / "audios" / "00000.wav"
    stat = wav.stat()
    wav.write_bytes(audio_to_wav(torch.full((1, round(1.5 * RATE)), 0.5), RATE))
    os.utime(wav, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert wav.stat().st_size == stat.st_size
    _, used = check(records, tmp_path / "cache", monkeypatch)
    assert (used.probes, used.hits) == (1, 1)


def test_a_same_size_replacement_keeping_its_mtime_is_read_again(tmp_path, monkeypatch):
    """``cp -p`` / ``rsync -a`` put another file of the same size in place with the old mtime: its inode or ctime
    differs (``utime`` cannot set ctime), so it is probed again, never served the old header."""
    root = write_audio_dataset(tmp_path / "data", [1.5, 1.5])
    records = records_of(root)
    check(records, tmp_path / "cache", monkeypatch)
    wav = root / "audios" / "00000.wav"
    stat = wav.stat()
    other = wav.with_suffix(".new")
    other.write_bytes(audio_to_wav(torch.full((1, round(1.5 * RATE)), 0.5), RATE))
    os.utime(other, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(other, wav)
    assert (wav.stat().st_size, wav.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    _, used = check(records, tmp_path / "cache", monkeypatch)
    assert (used.probes, used.hits) == (1, 1)


def test_the_cache_file_is_published_atomically_and_a_damaged_one_is_ignored(tmp_path, monkeypatch):
    """The table is written through ``write_bytes_atomic`` (a temporary file renamed over it: a concurrent reader
    sees the old table or the new one); a write that fails midway leaves the previous table intact and no temporary
    file behind, and the run still gets its errors. A damaged table, or one from another PyAV version, is ignored:
    every header probed again, the table rewritten."""
    root = write_audio_dataset(tmp_path / "data", [1.5, 0.5])
    records, cache = records_of(root), tmp_path / "cache"
    published = []
    real_write = header_cache.write_bytes_atomic
    monkeypatch.setattr(header_cache, "write_bytes_atomic", lambda p, d: published.append(p) or real_write(p, d))
    check(records, cache, monkeypatch)
    [table] = published
    before = table.read_bytes()

    def no_rename(src, dst):  # the temporary file is written in full, then the rename fails (a full disk, say)
        assert Path(src).name.startswith(f".{table.name}.") and Path(src).read_bytes() != before
        raise OSError("rename failed")

    monkeypatch.setattr(atomic.os, "replace", no_rename)
    wav = root / "audios" / "00000.wav"
    os.utime(wav, ns=(wav.stat().st_atime_ns, wav.stat().st_mtime_ns + 1))  # one entry to rewrite
    errors, used = check(records, cache, monkeypatch)
    monkeypatch.undo()
    assert len(errors) == 1 and used.probes == 1
    assert table.read_bytes() == before and [p.name for p in table.parent.iterdir()] == [table.name]
    for damage in (b'{"version": 1, "entr', json.dumps({**json.loads(before), "av": "0.0"}).encode()):
        table.write_bytes(damage)
        errors, used = check(records, cache, monkeypatch)
        assert len(errors) == 1 and (used.probes, used.hits) == (2, 0)
        assert json.loads(table.read_text())["av"] != "0.0"


def test_unreadable_headers_are_not_cached(tmp_path, monkeypatch):
    """A target whose header cannot be read fails at every start, naming file, line and field; it is never cached."""
    root = write_audio_dataset(tmp_path / "data", [1.5, 1.5])
    (root / "audios" / "00001.wav").write_bytes(b"not a wav file at all")
    records = records_of(root)
    for hits in (0, 1):
        errors, used = check(records, tmp_path / "cache", monkeypatch)
        assert (used.probes, used.hits) == (2 - hits, hits) and len(errors) == 1
        assert "train.jsonl:2" in errors[0] and "cannot read audio header" in errors[0]
    table = json.loads(next((tmp_path / "cache" / "headers").glob("*.json")).read_text())
    assert list(table["entries"]) == [f"audio:{os.path.realpath(root / 'audios' / '00000.wav')}"]


def test_without_a_cache_dir_nothing_is_written(tmp_path, monkeypatch):
    root = write_audio_dataset(tmp_path / "data", [1.5, 0.5])
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    errors, used = check(records_of(root), None, monkeypatch)
    assert len(errors) == 1 and used.probes == 2 and not (tmp_path / "home").exists()
