"""Session fixtures shared by every test folder (tests/ and plugins/*/tests): tiny checkpoints in the real diffusers
layout, built once per test session, and small synthetic datasets. Nothing here reaches the network."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before diffusers/transformers read it
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread (this process and the `ff fit` subprocesses): every model here is tiny, and torch's thread pool
# on a 2-core machine that runs anything else stalls at its barriers. Measured (benchmarks/RESULTS.md, "Test suite"):
# the trained-VAE fixture takes 14 s instead of 49 s with one core busy; the idle suite 114 s instead of 100 s.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402


def pytest_configure(config):
    import tempfile

    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # Condition caches of the session (and of its `ff fit` subprocesses) go to a temporary folder, never ~/.cache:
    # one per process, so each pytest-xdist worker has its own.
    if "FF_CACHE_DIR" not in os.environ:
        config._ff_cache_dir = tempfile.mkdtemp(prefix="ff-cache-")
        os.environ["FF_CACHE_DIR"] = config._ff_cache_dir


def pytest_unconfigure(config):
    import shutil

    folder = getattr(config, "_ff_cache_dir", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("FF_CACHE_DIR", None)


@pytest.fixture(scope="session")
def shapes_dir(tmp_path_factory):
    """24 training images of coloured shapes with captions, 6 evaluation prompts."""
    from ff_core.testing.shapes import write_shapes_dataset

    return write_shapes_dataset(tmp_path_factory.mktemp("shapes"), n_train=24, n_test=6, size=32)


@pytest.fixture(scope="session")
def shapes_dpo_dir(tmp_path_factory):
    """24 preference pairs (chosen: the prompt's colour; rejected: another, same shape and place), 6 test prompts."""
    from ff_core.testing.shapes import write_preference_dataset

    return write_preference_dataset(tmp_path_factory.mktemp("shapes_dpo"), n_train=24, n_test=6, size=32)


@pytest.fixture(scope="session")
def shapes_dirs(tmp_path_factory):
    """(train, held-out) shapes datasets with different seeds: 192 and 48 images."""
    from ff_core.testing.shapes import write_shapes_dataset

    root = tmp_path_factory.mktemp("shapes_vae")
    train = write_shapes_dataset(root / "train", n_train=192, n_test=6, seed=0)
    held = write_shapes_dataset(root / "held", n_train=48, n_test=6, seed=123)
    return train, held


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory):
    """The tiny SD3.5 checkpoint every test shares (random VAE: fast to build)."""
    from ff_sd3.testing import build_tiny_sd3

    return build_tiny_sd3(tmp_path_factory.mktemp("tiny-sd3"), num_layers=2)


@pytest.fixture(scope="session")
def trained_sd3(tmp_path_factory, shapes_dirs):
    """The same tiny checkpoint with its VAE trained briefly on shapes images: the one trained VAE of the session
    (the slowest fixture; every test that needs a VAE that really reconstructs uses this one)."""
    from ff_sd3.testing import build_tiny_sd3

    return build_tiny_sd3(tmp_path_factory.mktemp("tiny-sd3-vae"), num_layers=2,
                          vae_train_dir=shapes_dirs[0] / "images", vae_steps=100)


@pytest.fixture(scope="session")
def shapes_latents_dir(tmp_path_factory, tiny_sd3, shapes_dir):
    """The shapes training split as tensor-parquet shards of ``tiny_sd3`` (fp32 text embeddings and VAE latents at
    resolution 32, 10 rows per file), written by ``ff data preprocess-latents``."""
    import json
    from pathlib import Path

    from ff_core.cli import main

    out = tmp_path_factory.mktemp("shapes_latents") / "shards"
    recipe = Path(__file__).parent / "configs" / "sd3" / "sft_tiny.yaml"
    datasets = json.dumps([{"name": "shapes", "dataset_dir": str(shapes_dir)}])
    status = main(["data", "preprocess-latents", "--output", str(out), "--rows-per-file", "10", "--no-progress",
                   "--dtype", "float32", "--config", str(recipe),
                   "--model.pretrained_model_name_or_path", str(tiny_sd3), "--data.datasets", datasets])
    assert status == 0
    return out


@pytest.fixture
def fake_world():
    """``fake_world(rank)``: this process as ``rank`` of a 2-rank process group without processes (torch's fake
    backend), for device meshes in one process (tests/test_sharding.py); destroyed after the test."""
    import torch.distributed
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(rank: int) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        torch.distributed.init_process_group("fake", rank=rank, world_size=2, store=FakeStore())

    yield init
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
