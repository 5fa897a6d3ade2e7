"""The offline smoke datasets (docs/datasets.md, "Offline smoke datasets"; spec dataset-guide, "Public offline smoke
datasets"): the builder's tree and determinism, rejected clips that keep their decoded endpoints, `prepare` at world
sizes 1, 3 and 8 for every served alias and both algorithms (each folder passing `ff data validate --model`), the Hub
source from a pre-populated cache, and one clear line for each mistake. The whole catalogue is built once (~8 s);
`ff fit` on prepared rows is tests/test_smoke_fit.py."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from ff_core.cli import main
from ff_core.contracts import IMAGE_OUT, PipelineIOContract
from ff_core.data.smoke.build import build
from ff_core.data.smoke.catalogue import ALIASES, PROFILES, ROWS_PER_ALIAS, SFT_REPO_ID, SmokeError
from ff_core.data.smoke.prepare import prepare
from ff_core.data.smoke.support import support, support_table
from ff_core.plugins import get_registry

REPO = Path(__file__).resolve().parents[1]
ALGORITHMS = ("sft", "offline-dpo")
# Flow-Factory's names (dataset/offline_smoke/profiles.py), so a user's commands carry over.
FLOW_FACTORY_ALIASES = ("sd35-t2i", "image-i2i", "bagel-mri2i", "wan-t2v", "wan-i2v-first", "wan-flf2v", "ltx2-t2av",
                        "ltx2-i2av", "h3-t2va", "h3-fl2va", "h3-ref2va")  # fmt: skip
SERVED = [name for name, entry in support_table().items() if entry.served]


def adapters(*names: str) -> dict[str, type]:
    """Only these installed adapters (a build or prepare of a few aliases, as if nothing else were installed)."""
    return {n: info.cls for n, info in get_registry().adapters().items() if n in names}


def frames_of(path: Path) -> list[np.ndarray]:
    with av.open(str(path)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("smoke") / "out"
    report = build(root, seed=0)
    assert report.served == SERVED
    return root


@pytest.fixture(scope="module")
def flf2v_checkpoint(tmp_path_factory) -> Path | None:
    """A tiny Wan2.1 FLF2V checkpoint: `ff data validate --model wan2_i2v` reads the FLF2V contract from its configs."""
    if "wan-flf2v" not in SERVED:
        return None
    from ff_wan.testing import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("tiny-wan-flf2v"), variant="flf2v")


def test_the_catalogue_has_flow_factorys_names_and_serves_what_is_installed(capsys):
    assert tuple(ALIASES) == FLOW_FACTORY_ALIASES
    assert main(["data", "smoke", "list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0] == "text_to_image  -> image" and listed[1] == "  sd35-t2i  [sd3-5]  served"
    assert any(line.startswith("  image-i2i  [flux1-kontext]  not served: adapter 'flux1-kontext' is not installed")
               for line in listed)  # fmt: skip
    assert {a.profile for a in ALIASES.values()} == set(PROFILES)
    table = support_table()
    for name in ("image-i2i", "bagel-mri2i"):  # no ff adapter of FLUX.1 Kontext or Bagel: listed, never faked
        assert not table[name].served and "is not installed" in table[name].reason
    if "wan2_i2v" in get_registry().adapters():
        assert table["wan-flf2v"].served and [s.name for s in table["wan-flf2v"].contract.slots] == [
            "first_frame", "last_frame"]


def test_an_adapter_that_cannot_realise_the_profile_leaves_its_alias_unserved():
    """Checked against the adapter's own contract: a wan2_i2v without an `flf2v` variant, or whose only contract
    takes no last frame, does not serve wan-flf2v."""

    class NoVariants:
        io_contract = PipelineIOContract(outputs=(IMAGE_OUT,))

        @classmethod
        def resolve_contract(cls, pretrained, adapter_kwargs=None):
            return cls.io_contract

    found = support(ALIASES["wan-flf2v"], {"wan2_i2v": NoVariants})
    assert not found.served and "has no 'flf2v' checkpoint variant" in found.reason
    NoVariants.io_contract_variants = {"flf2v": NoVariants.io_contract}
    found = support(ALIASES["wan-flf2v"], {"wan2_i2v": NoVariants})
    assert not found.served and "refuses the profile's rows" in found.reason
    found = support(ALIASES["sd35-t2i"], {"sd3-5": NoVariants})  # an image-only, prompt-only contract serves T2I
    assert found.served


def test_build_writes_two_self_contained_datasets(built):
    for algorithm in ALGORITHMS:
        root = built / algorithm
        assert {p.name for p in root.iterdir()} == {"README.md", "LICENSE", "manifest.json", "provenance.json",
                                                    "profiles"}  # fmt: skip
        manifest = json.loads((root / "manifest.json").read_text())
        assert manifest["algorithm"] == algorithm and list(manifest["profiles"]) == SERVED
        assert set(manifest["unserved"]) == set(ALIASES) - set(SERVED)
        assert "license: cc0-1.0" in (root / "README.md").read_text()
        digests = json.loads((root / "provenance.json").read_text())["sha256"]
        files = sorted(p.relative_to(root).as_posix() for p in (root / "profiles").rglob("*") if p.is_file())
        assert sorted(digests) == files
        for rel in files[:: max(1, len(files) // 50)]:
            assert hashlib.sha256((root / rel).read_bytes()).hexdigest() == digests[rel]
        for name in SERVED:
            rows = records(root / "profiles" / name / "train.jsonl")
            assert len(rows) == ROWS_PER_ALIAS
            assert {r["supervision"]["type"] for r in rows} == {"demonstration" if algorithm == "sft" else "preference"}
            provenance = rows[3]["metadata"]["provenance"]
            assert (provenance["alias"], provenance["row"], provenance["seed"]) == (name, 3, 0)
            for row in rows:  # media paths relative to the profile folder, and there
                for item in row["input"]["media"] + [m for c in row["supervision"].values() if isinstance(c, dict)
                                                     for m in c["media"]]:  # fmt: skip
                    assert not os.path.isabs(item["path"]) and (root / "profiles" / name / item["path"]).is_file()


def test_the_same_seed_gives_byte_identical_files_and_refuses_to_overwrite(built, tmp_path):
    """Two aliases rebuilt (an image one; a video + audio one with keyframes): the same bytes as the full build; another
    seed: other media. An existing folder is refused unless --overwrite."""
    again = tmp_path / "again"
    build(again, seed=0, adapters=adapters("sd3-5", "minimax-h3-fl2va"))
    for algorithm in ALGORITHMS:
        for name in ("sd35-t2i", "h3-fl2va"):
            ours, theirs = built / algorithm / "profiles" / name, again / algorithm / "profiles" / name
            files = sorted(p.relative_to(ours) for p in ours.rglob("*") if p.is_file())
            assert files == sorted(p.relative_to(theirs) for p in theirs.rglob("*") if p.is_file())
            assert all((ours / f).read_bytes() == (theirs / f).read_bytes() for f in files)
    with pytest.raises(SmokeError, match="already exists; pass --overwrite"):
        build(again, seed=1, adapters=adapters("sd3-5"))
    build(again, seed=1, overwrite=True, adapters=adapters("sd3-5"))
    image = "sft/profiles/sd35-t2i/targets/0000_0.png"
    assert (again / image).read_bytes() != (built / image).read_bytes()
    assert not (again / "sft/profiles/h3-fl2va").exists()  # replaced whole
    assert [p.name for p in again.parent.iterdir() if p.name.startswith(".")] == []  # no temporary left


@pytest.mark.parametrize("name", [n for n in SERVED if ALIASES[n].geometry.num_frames])
def test_rejected_clips_keep_the_decoded_first_and_last_frames(built, name):
    """Every fourth row: the rejected clip decodes to the chosen clip's first and last frames, differs in between; a
    keyframe condition is exactly the chosen clip's decoded frame; video fps and frame count are the alias's."""
    folder = built / "offline-dpo" / "profiles" / name
    geometry = ALIASES[name].geometry
    for row in records(folder / "train.jsonl")[::4]:
        chosen, rejected = (row["supervision"][k]["media"][0] for k in ("chosen", "rejected"))
        assert chosen["fps"] == geometry.fps
        good, bad = frames_of(folder / chosen["path"]), frames_of(folder / rejected["path"])
        assert len(good) == len(bad) == geometry.num_frames
        assert np.array_equal(good[0], bad[0]) and np.array_equal(good[-1], bad[-1])
        assert not np.array_equal(good[len(good) // 2], bad[len(bad) // 2])
        for item in row["input"]["media"]:
            if item.get("slot") in ("first_frame", "last_frame"):
                image = np.asarray(Image.open(folder / item["path"]).convert("RGB"))
                assert np.array_equal(image, good[0] if item["slot"] == "first_frame" else good[-1])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("name", SERVED)
def test_prepare_gives_exactly_n_x_b_x_k_valid_rows(built, flf2v_checkpoint, tmp_path, name, algorithm):
    """World sizes 1, 3 and 8 at B=1, K=2: the first 2 N rows, media copied beside them, and the folder passes
    `ff data validate --model <adapter> --trainer <algorithm>` (wan-flf2v: against a tiny FLF2V checkpoint's
    contract; `prepare` validates each folder the same way before publishing it)."""
    adapter = ALIASES[name].adapter
    source = (built / algorithm / "profiles" / name / "train.jsonl").read_text().splitlines()
    for world_size in (1, 3, 8):
        done = prepare(algorithm, name, world_size, source=built, output=tmp_path)
        assert done.train == tmp_path / algorithm / name / "train.jsonl" and done.rows == 2 * world_size
        assert done.train.read_text().splitlines() == source[: 2 * world_size]  # the first rows: 8's hold 1's and 3's
    extra = ["--pretrained", str(flf2v_checkpoint)] if name == "wan-flf2v" else []
    assert main(["data", "validate", str(done.train.parent), "--model", adapter, "--trainer", algorithm, *extra]) == 0
    media = {p.relative_to(done.train.parent).as_posix() for p in done.train.parent.rglob("*") if p.is_file()}
    expected = {m["path"] for r in records(done.train) for m in r["input"]["media"] + [
        m for c in r["supervision"].values() if isinstance(c, dict) for m in c["media"]]}  # fmt: skip
    assert media == expected | {"train.jsonl"}  # exactly the referenced files: nothing preprocessed, no cache


def test_prepare_takes_batch_size_and_batches_per_rank_and_a_profile_name(built, tmp_path, capsys):
    """Through `ff data smoke prepare`: a canonical profile name means its first served alias."""
    assert main(["data", "smoke", "prepare", "--algorithm", "sft", "--profile", "text_to_image", "--world-size", "3",
                 "--per-device-batch-size", "2", "--batches-per-rank", "3", "--source", str(built / "sft"),
                 "--output", str(tmp_path)]) == 0  # fmt: skip
    train = tmp_path / "sft" / "text_to_image" / "train.jsonl"
    assert capsys.readouterr().out.startswith(f"prepared 18 rows of sd35-t2i (adapter sd3-5) for sft at world size 3 "
                                              f"x batch 2 x 3 batches per rank: {train}\n")  # fmt: skip
    assert len(records(train)) == 18
    if "h3-t2va" in SERVED:  # MiniMax H3 runs with B=1
        with pytest.raises(SmokeError, match="supports at most 1 sample"):
            prepare("sft", "h3-t2va", 1, per_device_batch_size=2, source=built, output=tmp_path)


def test_prepare_builds_the_default_source_into_the_cache_once(tmp_path):
    cache = tmp_path / "cache"
    done = prepare("offline-dpo", "sd35-t2i", 2, output=tmp_path / "out", cache_dir=cache, adapters=adapters("sd3-5"))
    manifest = cache / "offline_smoke" / "v1-seed0" / "offline-dpo" / "manifest.json"
    assert done.source == manifest.parent and done.rows == 4
    stamp = manifest.stat().st_mtime_ns
    prepare("sft", "sd35-t2i", 1, output=tmp_path / "out", cache_dir=cache, adapters=adapters("sd3-5"))
    assert manifest.stat().st_mtime_ns == stamp  # reused, not rebuilt


def hub_cache(root: Path, built: Path, commit: str) -> Path:
    """The SFT dataset as huggingface_hub caches a dataset snapshot: datasets--OWNER--NAME/snapshots/COMMIT/."""
    snapshot = root / ("datasets--" + SFT_REPO_ID.replace("/", "--")) / "snapshots" / commit
    shutil.copytree(built / "sft", snapshot)
    return root


def test_prepare_reads_a_pinned_hub_revision_from_the_cache_offline(built, tmp_path, monkeypatch):
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache(tmp_path / "hub", built, commit)))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    done = prepare("sft", "sd35-t2i", 8, source=f"{SFT_REPO_ID}@{commit}", output=tmp_path / "out")
    assert done.rows == 16 and done.source.name == commit
    with pytest.raises(SmokeError, match="pin an immutable revision"):
        prepare("sft", "sd35-t2i", 1, source=f"{SFT_REPO_ID}@main", output=tmp_path / "out")
    with pytest.raises(SmokeError, match="holds the 'sft' dataset, not 'offline-dpo'"):
        prepare("offline-dpo", "sd35-t2i", 1, source=f"{SFT_REPO_ID}@{commit}", output=tmp_path / "out")


def one_line(capsys, argv: list[str]) -> str:
    assert main(["data", "smoke", *argv]) == 2
    out = capsys.readouterr().out.strip()
    assert "\n" not in out and "Traceback" not in out
    return out


def test_each_mistake_is_one_clear_line(built, tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    prepare_args = ["prepare", "--algorithm", "sft", "--output", str(tmp_path), "--source", str(built)]
    assert one_line(capsys, [*prepare_args, "--profile", "sd35-t2i", "--world-size", "17"]) == (
        f"ff data smoke prepare: --world-size 17 x --per-device-batch-size 1 x --batches-per-rank 2 needs 34 rows, "
        f"but 'sd35-t2i' has 32 in {built / 'sft'} (world size 16 at most)")
    assert one_line(capsys, [*prepare_args, "--profile", "image-i2i", "--world-size", "1"]).startswith(
        "ff data smoke prepare: profile 'image-i2i' is not served here: adapter 'flux1-kontext' is not installed")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    commit = "f" * 40
    message = one_line(capsys, ["prepare", "--algorithm", "sft", "--profile", "sd35-t2i", "--world-size", "1",
                                "--source", f"{SFT_REPO_ID}@{commit}", "--output", str(tmp_path)])  # fmt: skip
    assert message == (f"ff data smoke prepare: --source '{SFT_REPO_ID}@{commit}': revision {commit} of {SFT_REPO_ID} "
                       f"is not in the Hugging Face cache ({tmp_path / 'empty-hub'}) and the Hub is offline "
                       "(HF_HUB_OFFLINE); fetch it once online or pass --source DIR")  # fmt: skip
    assert "unknown profile 'ltx-t2av'; did you mean 'ltx2-t2av'?" in one_line(
        capsys, [*prepare_args, "--profile", "ltx-t2av", "--world-size", "1"])
    assert one_line(capsys, ["build", str(built)]) == (
        f"ff data smoke build: {built} already exists; pass --overwrite to replace it")
    assert not list(tmp_path.glob("sft/*"))  # nothing published by a refused run


def test_an_alias_whose_adapter_is_not_installed_is_refused(built, tmp_path):
    with pytest.raises(SmokeError, match="^profile 'h3-ref2va' is not served here: adapter 'minimax-h3-ref2va' is not "
                                         "installed"):  # fmt: skip
        prepare("offline-dpo", "h3-ref2va", 1, source=built, output=tmp_path, adapters=adapters("sd3-5"))


def test_python_m_entry_fails_without_a_traceback(built, tmp_path):
    """`python -m ff_core.cli.smoke prepare ...` (Flow-Factory's `python -m dataset.offline_smoke.prepare ...`): a
    mistake is its one line and exit status 2 (success goes through the same `main`, tested in-process)."""
    cmd = [sys.executable, "-m", "ff_core.cli.smoke", "prepare", "--algorithm", "offline-dpo", "--profile", "sd35-t2i",
           "--source", str(built), "--output", str(tmp_path)]  # fmt: skip
    bad = subprocess.run([*cmd, "--world-size", "99"], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert bad.returncode == 2 and "needs 198 rows" in bad.stdout and "Traceback" not in bad.stdout + bad.stderr
