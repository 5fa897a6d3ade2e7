"""A checkpoint of another family is refused before any weight loads (issue 24 item 7).

SD3 on a Wan folder used to end in a 22-frame diffusers ``TypeError`` once the weights loaded, and
``ff data validate --model sd3-5 --pretrained <wan folder>`` said OK. The reference for what a checkpoint *is*: the
``model_index.json`` that diffusers' own ``save_pretrained`` writes for each family's pipeline (the tiny builders save
real diffusers pipelines), whose ``_class_name`` is the pipeline class's ``__name__``.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import diffusers
import pytest
from ff_ltx2.testing import build_tiny_ltx2
from ff_minimax.testing import build_tiny_minimax
from ff_wan.testing import build_tiny_wan

from ff_core.adapter import Adapter
from ff_core.cli import main
from ff_core.errors import ConfigError
from ff_core.plugins import get_adapter_class
from ff_core.pretrained import check_checkpoint_classes, load_pretrained

REPO = Path(__file__).resolve().parents[1]
KEY = "model.pretrained_model_name_or_path"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_sd3):
    """family -> (tiny checkpoint, the diffusers pipeline class that wrote it)."""
    root = tmp_path_factory.mktemp("families")
    return {
        "sd3-5": (tiny_sd3, diffusers.StableDiffusion3Pipeline),
        "wan2_t2v": (build_tiny_wan(root / "wan"), diffusers.WanPipeline),
        "ltx2_t2av": (build_tiny_ltx2(root / "ltx2"), diffusers.LTX2Pipeline),
        "minimax-h3-t2va": (build_tiny_minimax(root / "minimax"), diffusers.MiniMaxH3ModularPipeline),
    }


FAMILIES = ["sd3-5", "wan2_t2v", "ltx2_t2av", "minimax-h3-t2va"]


@pytest.mark.parametrize("adapter", FAMILIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_accepts_its_own_checkpoint_and_refuses_the_others(checkpoints, adapter, family):
    cls = get_adapter_class(adapter)
    path, pipeline = checkpoints[family]
    assert json.loads((path / "model_index.json").read_text())["_class_name"] == pipeline.__name__
    if adapter == family:
        check_checkpoint_classes(cls, str(path))
        return
    with pytest.raises(ConfigError) as err:
        check_checkpoint_classes(cls, str(path))
    expected = " or ".join(repr(c) for c in cls.checkpoint_classes["_class_name"])
    assert str(err.value) == (f"{KEY}: {str(path)!r} is not a {adapter} checkpoint: its model_index.json names the "
                              f"pipeline class (_class_name) {pipeline.__name__!r}, expected {expected} "
                              "(is model.adapter the right family?)")


def test_a_foreign_denoiser_under_the_right_pipeline_name_is_refused(checkpoints, tmp_path):
    """A folder whose model_index.json claims StableDiffusion3Pipeline but names Wan's transformer class."""
    path = tmp_path / "mixed"
    shutil.copytree(checkpoints["sd3-5"][0], path)
    index = json.loads((path / "model_index.json").read_text())
    index["transformer"] = ["diffusers", diffusers.WanTransformer3DModel.__name__]
    (path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"names the transformer class 'WanTransformer3DModel', expected "
                                          r"'SD3Transformer2DModel'"):
        load_pretrained(get_adapter_class("sd3-5"), str(path), {"resolution": 32})


def test_sd3_on_a_wan_folder_fails_before_weights_load(checkpoints):
    """Today's failure: diffusers' TypeError after the weights load; now a ConfigError before ``from_pretrained``."""
    cls = get_adapter_class("sd3-5")
    wan = str(checkpoints["wan2_t2v"][0])
    loads = []

    class Watched(cls):
        @classmethod
        def from_pretrained(klass, *args, **kwargs):
            loads.append(args)
            return super().from_pretrained(*args, **kwargs)

    with pytest.raises(ConfigError, match=r"^model.pretrained_model_name_or_path: .* is not a sd3-5 checkpoint: its "
                                          r"model_index.json names the pipeline class \(_class_name\) 'WanPipeline'"):
        load_pretrained(Watched, wan, {"resolution": 32})
    assert loads == []


def test_an_adapter_declaring_no_classes_is_not_checked(checkpoints):
    class Outside(Adapter):  # a third-party adapter that predates checkpoint_classes
        name = "outside"

    check_checkpoint_classes(Outside, str(checkpoints["wan2_t2v"][0]))


def test_ff_fit_with_a_wan_checkpoint_for_sd3_prints_one_line(checkpoints, shapes_dir, tmp_path, capsys):
    wan = checkpoints["wan2_t2v"][0]
    args = ["fit", "--config", str(REPO / "configs" / "sd3" / "sft_tiny.yaml"),
            "--data.datasets", json.dumps([{"name": "shapes", "dataset_dir": str(shapes_dir)}]),
            "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false", "--trainer.max_steps", "1",
            "--model.pretrained_model_name_or_path", str(wan)]
    assert main(args) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(f"ff fit: {KEY}: {str(wan)!r} is not a sd3-5 checkpoint: its model_index.json names the "
                           "pipeline class (_class_name) 'WanPipeline', expected 'StableDiffusion3Pipeline'"), last


def test_ff_data_validate_with_a_wan_checkpoint_for_sd3_fails(checkpoints, shapes_dir):
    wan = checkpoints["wan2_t2v"][0]
    result = subprocess.run([sys.executable, "-m", "ff_core.cli", "data", "validate", str(shapes_dir), "--model",
                             "sd3-5", "--pretrained", str(wan)], capture_output=True, text=True, env=ENV, cwd=REPO)
    assert result.returncode != 0, result.stdout
    assert (f"ff data validate: --pretrained: {str(wan)!r} is not a sd3-5 checkpoint: its model_index.json names the "
            "pipeline class (_class_name) 'WanPipeline'") in result.stdout, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
