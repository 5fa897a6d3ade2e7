"""Shared fixtures: a tiny SD3 checkpoint on disk (loaded through the real from_pretrained path) and a small
shapes dataset. Nothing here reaches the network."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory):
    from ff_sd3.testing import build_tiny_sd3

    return build_tiny_sd3(tmp_path_factory.mktemp("tiny-sd3"), num_layers=2)


@pytest.fixture(scope="session")
def shapes_dir(tmp_path_factory):
    from ff_core.testing.shapes import write_shapes_dataset

    return write_shapes_dataset(tmp_path_factory.mktemp("shapes"), n_train=24, n_test=6, size=32)
