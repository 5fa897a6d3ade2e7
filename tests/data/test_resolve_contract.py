"""Contracts resolved from a checkpoint's config files, without weights (``Adapter.resolve_contract``): the data
module, ``ff data validate --pretrained`` and the loaded adapter all use the checkpoint's contract. A toy adapter
whose accepted inputs depend on a key of ``transformer/config.json`` stands for a family with checkpoint variants."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

from ff_core.adapter import Adapter
from ff_core.cli.data import main
from ff_core.data.datamodule import FlowDataModule
from ff_core.errors import ConfigError, DatasetErrors
from ff_core.pretrained import load_pretrained, read_config, resolve_contract
from ff_core.testing.contracts import SUPPORT_TABLE

ADAPTER = "test_resolve_contract:VariantAdapter"
FIRST_ONLY, FIRST_LAST = SUPPORT_TABLE["wan2_i2v-2.1"], SUPPORT_TABLE["wan2_i2v-flf2v"]


class VariantAdapter(Adapter):
    """First frame only, or first and last frame, as the checkpoint's transformer config says."""

    name = "variant-i2v"
    io_contract = FIRST_ONLY
    resolved: list[str] = []  # what resolve_contract was asked (to show it never needs weights)

    @classmethod
    def resolve_contract(cls, pretrained_model_name_or_path, adapter_kwargs=None):
        if pretrained_model_name_or_path is None:
            return cls.io_contract
        cls.resolved.append(os.fspath(pretrained_model_name_or_path))
        config = read_config(pretrained_model_name_or_path, subfolder="transformer")
        return FIRST_LAST if config.get("pos_embed_seq_len") else FIRST_ONLY

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs: Any) -> VariantAdapter:
        return cls()


def checkpoint(root: Path, flf2v: bool) -> Path:
    """A checkpoint folder holding only its configs: no weight file at all."""
    (root / "transformer").mkdir(parents=True)
    config = {"_class_name": "WanTransformer3DModel", "pos_embed_seq_len": 514 if flf2v else None}
    (root / "transformer" / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture
def checkpoints(tmp_path) -> dict[str, Path]:
    return {"i2v": checkpoint(tmp_path / "i2v", False), "flf2v": checkpoint(tmp_path / "flf2v", True)}


def test_each_variant_resolves_from_its_config(checkpoints):
    assert resolve_contract(VariantAdapter, checkpoints["i2v"]) is FIRST_ONLY
    assert resolve_contract(VariantAdapter, checkpoints["flf2v"]) is FIRST_LAST
    assert resolve_contract(VariantAdapter, None) is FIRST_ONLY  # no checkpoint: the class's default
    assert Adapter.resolve_contract.__func__(VariantAdapter, "x") is FIRST_ONLY  # the base default


def test_unreadable_configs_name_the_key(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^model.pretrained_model_name_or_path: cannot resolve variant-i2v's "
                                          r"contract from .*transformer/config.json not found"):
        resolve_contract(VariantAdapter, tmp_path / "empty")
    with pytest.raises(ConfigError, match="neither a folder"):
        resolve_contract(VariantAdapter, tmp_path / "missing/x/y")


def test_the_loaded_adapter_carries_its_checkpoints_contract(checkpoints):
    adapter = load_pretrained(VariantAdapter, checkpoints["flf2v"], {})
    assert adapter.io_contract is FIRST_LAST and VariantAdapter.io_contract is FIRST_ONLY


def test_data_module_validates_against_the_checkpoints_contract_before_weights(examples, checkpoints):
    def setup(variant: str) -> FlowDataModule:
        dm = FlowDataModule([{"name": "i2v", "dataset_dir": str(examples / "wan_i2v_sft")}], adapter=ADAPTER,
                            eval_batch_size=1,
                            pretrained_model_name_or_path=str(checkpoints[variant]))
        dm.setup("fit")
        return dm

    assert len(setup("i2v").train_records) == 2
    with pytest.raises(DatasetErrors) as err:
        setup("flf2v")  # FLF2V requires a last_frame the records lack
    text = str(err.value)
    assert "train.jsonl:1" in text and "last_frame" in text


def test_validate_cli_takes_the_checkpoint(examples, checkpoints, tmp_path):
    def run(*argv) -> tuple[int, str]:
        out = io.StringIO()
        return main([str(a) for a in argv], out=out), out.getvalue()

    d = examples / "wan_i2v_sft"
    code, out = run("validate", d, "--model", ADAPTER, "--pretrained", checkpoints["i2v"])
    assert code == 0, out
    code, out = run("validate", d, "--model", ADAPTER, "--pretrained", checkpoints["flf2v"])
    assert code == 2 and "last_frame" in out
    (tmp_path / "bare").mkdir()
    code, out = run("validate", d, "--model", ADAPTER, "--pretrained", tmp_path / "bare")
    assert code == 2 and "--pretrained: cannot resolve variant-i2v's contract" in out
    code, out = run("validate", d, "--pretrained", checkpoints["i2v"])
    assert code == 2 and "--pretrained needs --model" in out
    code, out = run("inspect", d, "--model", ADAPTER, "--pretrained", checkpoints["flf2v"])
    assert code == 0 and "contract of 'variant-i2v' at " in out and "last_frame" in out, out


def test_the_cli_links_the_checkpoint_to_the_data_module(examples, checkpoints):
    from ff_core.cli.flow_cli import FlowCLI
    from ff_core.module import FlowModule

    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--model.adapter", ADAPTER, "--model.pretrained_model_name_or_path", str(checkpoints["flf2v"]),
        "--model.adapter_kwargs", '{"resolution": 16}',  "--data.eval_batch_size", "1",
        "--data.datasets", json.dumps([{"name": "i2v", "dataset_dir": str(examples / "wan_i2v_sft")}])])
    assert cli.datamodule.pretrained_model_name_or_path == str(checkpoints["flf2v"])
    assert cli.datamodule.adapter_kwargs == {"resolution": 16}
    assert cli.model.io_contract is FIRST_LAST  # resolved from the config, no weights loaded
