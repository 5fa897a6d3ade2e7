"""Fixtures of the ff-sd3 tests: tiny checkpoints built once per session, never a download."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before diffusers/transformers read it

import pytest  # noqa: E402
from ff_sd3.testing import build_tiny_sd3  # noqa: E402

from ff_core.testing.shapes import write_shapes_dataset  # noqa: E402


@pytest.fixture(scope="session")
def tiny_sd3_dir(tmp_path_factory):
    """A tiny SD3.5 checkpoint with a random VAE (fast)."""
    return build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3"), seed=0)


@pytest.fixture(scope="session")
def shapes_dirs(tmp_path_factory):
    """(train, held-out) shapes datasets with different seeds."""
    root = tmp_path_factory.mktemp("shapes")
    train = write_shapes_dataset(root / "train", n_train=192, n_test=6, seed=0)
    held = write_shapes_dataset(root / "held", n_train=48, n_test=6, seed=123)
    return train, held


@pytest.fixture(scope="session")
def trained_sd3_dir(tmp_path_factory, shapes_dirs):
    """A tiny SD3.5 checkpoint whose VAE was trained briefly on shapes images."""
    return build_tiny_sd3(
        tmp_path_factory.mktemp("tiny_sd3_vae"), seed=0, vae_train_dir=shapes_dirs[0] / "images", vae_steps=100
    )
