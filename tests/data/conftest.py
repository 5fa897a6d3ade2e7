"""Fixtures of the dataset tests: media written on the fly with PyAV / Pillow (no binary test files), and a
registry of adapters built from the spec's support table."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from data_helpers import EXAMPLES, make_media, support_adapter

from ff_core.adapter import Adapter
from ff_core.testing.contracts import SUPPORT_TABLE


@pytest.fixture(scope="session")
def media_files(tmp_path_factory) -> dict[str, Path]:
    """One of each fixture file, plus corrupt ones, written once per session."""
    root = tmp_path_factory.mktemp("media")
    files = {
        "png": make_media.write_png(root / "a.png", size=(8, 12), colour=(10, 20, 30)),
        "mp4": make_media.write_mp4(root / "a.mp4", frames=12, fps=24, size=(16, 24), audio_rate=16000),
        "mp4_silent": make_media.write_mp4(root / "silent.mp4", frames=6, fps=12, audio_rate=None),
        "wav": make_media.write_wav(root / "a.wav", seconds=0.25, rate=8000, channels=2),
    }
    for name in ("png", "mp4", "wav"):
        data = files[name].read_bytes()
        (root / f"truncated.{name}").write_bytes(data[: max(len(data) // 3, 20)] if name != "wav" else data[:30])
        (root / f"garbage.{name}").write_bytes(b"\x00\x01not a media file" * 8)
        files[f"truncated_{name}"] = root / f"truncated.{name}"
        files[f"garbage_{name}"] = root / f"garbage.{name}"
    (root / "empty.mp4").write_bytes(b"")
    files["empty_mp4"] = root / "empty.mp4"
    return files


@pytest.fixture
def table_registry(monkeypatch):
    """Make ``ff_core.plugins.get_adapter_class`` resolve every support-table name (plugins not needed)."""
    import ff_core.plugins

    classes = {name: support_adapter(name) for name in SUPPORT_TABLE}
    real = ff_core.plugins.get_adapter_class

    def lookup(name: str) -> type[Adapter]:
        return classes[name] if name in classes else real(name)

    monkeypatch.setattr(ff_core.plugins, "get_adapter_class", lookup)
    return classes


@pytest.fixture(scope="session")
def examples(tmp_path_factory) -> Path:
    """A copy of examples/datasets with its media generated (the repo's copy is left untouched)."""
    root = tmp_path_factory.mktemp("examples")
    shutil.copytree(EXAMPLES, root, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.png", "*.mp4", "*.wav"))
    for folder in sorted(p for p in root.iterdir() if any((p / f"train.{ext}").exists() for ext in ("jsonl", "txt"))):
        make_media.make_dataset_media(folder, **make_media.OVERRIDES.get(folder.name, {}))
    return root


@pytest.fixture
def broken(examples, tmp_path):
    """Copy one example dataset (media included) to a scratch folder, to break it."""

    def copy(name: str) -> Path:
        return Path(shutil.copytree(examples / name, tmp_path / name))

    return copy
