"""Evaluation by generation: eval rewards scored on the generated samples, logged (progress bar included), the
samples sent to TensorBoard and CSV loggers and written to disk; a dataset lacking a reward's metadata field fails
before any weight loads."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ff_core.cli import main
from ff_core.cli.flow_cli import FlowCLI
from ff_core.data.datamodule import FlowDataModule
from ff_core.module import FlowModule

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "sd3" / "sft_tiny.yaml"
REWARDS = [{"name": "colour", "weight": 2.0, "args": {"target": [0, 255, 0]}},
           {"name": "brightness", "weight": 0.5, "label": "bright"}]


def cli_args(tiny_sd3, data_dir, root, loggers, *extra):
    datasets = json.dumps([{"name": "shapes", "dataset_dir": str(data_dir), "eval": {}}])
    return ["--config", str(RECIPE), "--model.pretrained_model_name_or_path", str(tiny_sd3),
            "--data.datasets", datasets, "--data.eval_batch_size", "4", "--model.sampling.num_steps", "2",
            "--trainer.default_root_dir", str(root), "--trainer.logger", json.dumps(loggers), *extra]


def logger(kind: str, root: Path) -> dict:
    cls = {"tb": "TensorBoardLogger", "csv": "CSVLogger"}[kind]
    return {"class_path": f"lightning.pytorch.loggers.{cls}",
            "init_args": {"save_dir": str(root), "name": kind, "version": 0}}


@pytest.fixture(scope="module")
def validated(tiny_sd3, shapes_dir, tmp_path_factory):
    """`ff validate` of the tiny model on the 6 shapes prompts (batches of 4 and 2), TensorBoard and CSV loggers."""
    root = tmp_path_factory.mktemp("eval")
    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=cli_args(
        tiny_sd3, shapes_dir, root, [logger("tb", root), logger("csv", root)],
        "--model.eval_rewards", json.dumps(REWARDS)))
    metrics = cli.trainer.validate(cli.model, cli.datamodule)[0]
    return cli, metrics, root


def colour_by_hand(png: Path) -> float:
    x = np.asarray(Image.open(png).convert("RGB"), dtype=np.float64) / 255
    return 1 - np.abs(x - np.array([0.0, 1.0, 0.0])).mean()


def brightness_by_hand(png: Path) -> float:
    x = np.asarray(Image.open(png).convert("RGB"), dtype=np.float64) / 255
    return (x @ np.array([0.299, 0.587, 0.114])).mean()


def test_eval_rewards_are_logged_as_means_of_hand_computed_scores(validated):
    cli, metrics, root = validated
    # The command line's list replaced the recipe's whole (no item inherits the recipe's args or label).
    assert cli.model.eval_reward_set.keys == ["colour", "bright"]
    assert [s.args for s in cli.model.eval_reward_set.specs] == [{"target": [0, 255, 0]}, {}]
    folder = Path(cli.trainer.log_dir) / "samples" / "step_000000"
    pngs = sorted(folder.glob("*.png"))
    assert [p.name for p in pngs] == [f"{i:05d}.png" for i in range(6)]
    colour = [colour_by_hand(p) for p in pngs]
    bright = [brightness_by_hand(p) for p in pngs]
    assert metrics["val/reward/colour"] == pytest.approx(np.mean(colour), abs=1e-5)
    assert metrics["val/reward/bright"] == pytest.approx(np.mean(bright), abs=1e-5)
    assert metrics["val/reward"] == pytest.approx(2 * np.mean(colour) + 0.5 * np.mean(bright), abs=1e-5)
    assert "val/reward" in cli.trainer.progress_bar_metrics
    index = json.loads((folder.parent / "step_000000.json").read_text())
    assert [row["index"] for row in index] == list(range(6))
    assert [row["rewards"]["colour"] for row in index] == pytest.approx(colour, abs=1e-5)
    assert index[0]["reward"] == pytest.approx(2 * colour[0] + 0.5 * bright[0], abs=1e-5)


def test_samples_reach_tensorboard(validated):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cli, metrics, root = validated
    events = EventAccumulator(str(root / "tb" / "version_0"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    [grid] = events.Images("val/samples")
    # SampleGrid's default layout: 6 columns of 96 px cells, one row of 96 px + 36 px of caption.
    assert (grid.width, grid.height) == (6 * 96, 96 + 36)
    assert Image.open(__import__("io").BytesIO(grid.encoded_image_string)).size == (576, 132)
    [scalar] = events.Scalars("val/reward")
    assert scalar.value == pytest.approx(metrics["val/reward"], abs=1e-6)


def test_samples_reach_the_csv_logger(validated):
    cli, metrics, root = validated
    log_dir = root / "csv" / "version_0"
    rows = list(csv.DictReader((log_dir / "samples.csv").open()))
    assert [(r["stage"], r["step"], r["index"], r["output"]) for r in rows] == [
        ("val", "0", str(i), "image") for i in range(6)]
    prompts = (Path(cli.datamodule.datasets[0].dataset_dir) / "test.txt").read_text().splitlines()
    assert [r["prompt"] for r in rows] == prompts
    for r in rows:
        assert float(r["reward/colour"]) == pytest.approx(colour_by_hand(log_dir / r["path"]), abs=1e-5)
        assert float(r["reward"]) == pytest.approx(
            2 * float(r["reward/colour"]) + 0.5 * float(r["reward/bright"]), abs=1e-5)
    assert "val/reward" in next(csv.DictReader((log_dir / "metrics.csv").open()))


def test_a_dataset_without_a_rewards_field_fails_before_any_weight_loads(shapes_dir, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(shapes_dir, data)
    (data / "test.txt").unlink()
    (data / "test.jsonl").write_text('{"prompt": "a red circle", "solution": 3}\n{"prompt": "a blue square"}\n')
    reward = [{"name": "tests.test_evaluation:NeedsSolution"}]
    args = cli_args(tmp_path / "no-such-checkpoint", data, tmp_path, logger("csv", tmp_path),
                    "--model.eval_rewards", json.dumps(reward))
    assert main(["validate", *args]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"{data}/test.jsonl:2: metadata.solution: reward 'tests.test_evaluation:NeedsSolution' "
        "(model.eval_rewards) needs the metadata field 'solution', which this record lacks (a legacy row's extra "
        "column or a V2 record's metadata key)")


from ff_core.rewards import Reward  # noqa: E402 - the test reward below is named by dotted path


class NeedsSolution(Reward):
    """A Sudoku-style reward: 1 where the row's ``solution`` is odd (reads the record metadata)."""

    name = "needs_solution"
    required_fields = ("solution",)

    def __call__(self, batch):
        return torch.tensor([float(m["solution"] % 2) for m in batch.metadata])


def test_objective_supplies_default_eval_rewards_and_training_reward_checks(tmp_path):
    """Without model.eval_rewards an objective's default_eval_rewards() is used (GRPO: its training rewards); the
    rewards an objective trains on are checked against the training records (stage fit only)."""
    from types import SimpleNamespace

    from ff_core.data.records.base import Record
    from ff_core.errors import DatasetErrors
    from ff_core.objectives import SFTObjective
    from ff_core.objectives.rewards import Rewards

    class Online(SFTObjective):
        def training_rewards(self):
            return Rewards([{"name": "tests.test_evaluation:NeedsSolution"}], config_key="model.objective.rewards")

        def default_eval_rewards(self):
            return [{"name": "colour"}]

    module = FlowModule("sd3-5", str(tmp_path / "unused"), objective=Online())
    module.setup("validate")  # no trainer: nothing to check yet
    assert module.eval_reward_set.keys == ["colour"]
    src = tmp_path / "train.jsonl"
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(
        eval_records=[], train_records=[Record(src, 1, "p", metadata={"solution": 1}), Record(src, 2, "q")]))
    module.setup("validate")
    with pytest.raises(DatasetErrors, match=r"train.jsonl:2: metadata.solution: reward 'tests.test_evaluation:"
                                            r"NeedsSolution' \(model.objective.rewards\) needs"):
        module.setup("fit")
    from ff_core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.eval_rewards\[0\]: unknown key\(s\) wieght"):
        FlowModule("sd3-5", "unused", eval_rewards=[{"name": "colour", "wieght": 1}])
    silent = FlowModule("sd3-5", "unused", objective=Online(), eval_rewards=[])  # [] turns the default off
    silent.setup("validate")
    assert silent.eval_reward_set is None
