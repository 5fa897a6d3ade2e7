"""The reward interface: weighted sets, pointwise/groupwise split, config errors, the metadata field check, the
registry (built-ins through the ``ff_rewards`` hook, plugins, dotted paths)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from ff_core.data.records.base import Record
from ff_core.errors import ConfigError, DatasetErrors
from ff_core.hookspecs import hookimpl
from ff_core.objectives.rewards import Rewards
from ff_core.plugins import PluginRegistry, get_reward_class
from ff_core.rewards import GROUPWISE, Reward, RewardBatch, RewardSpec


class MeanPixel(Reward):
    """Test reward: the mean pixel value / 255 of each image (pointwise)."""

    name = "mean_pixel"

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        return torch.stack([x.float().mean() / 255 for x in batch.outputs(self.media_types, self.name)])


class GroupCentred(Reward):
    """Test reward: a sample's mean pixel minus its group's mean (groupwise), needs metadata ``answer``."""

    name = "group_centred"
    kind = GROUPWISE
    required_fields = ("answer",)

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        x = torch.stack([m[0].float().mean() for m in batch.media])
        out = torch.empty_like(x)
        groups = batch.group_ids()
        for g in groups.unique():
            sel = groups == g
            out[sel] = x[sel] - x[sel].mean()
        return out


def image(value: int, size: int = 4) -> torch.Tensor:
    return torch.full((3, size, size), value, dtype=torch.uint8)


def batch_of(values, groups=None) -> RewardBatch:
    return RewardBatch(
        media=[[image(v)] for v in values], prompts=[f"p{i}" for i in range(len(values))],
        metadata=[{"answer": 1} for _ in values], groups=None if groups is None else torch.tensor(groups),
    )


def test_weighted_total_pointwise_and_groupwise_split():
    rewards = Rewards([
        RewardSpec(f"{__name__}:MeanPixel", weight=2.0, label="mean"),
        {"name": f"{__name__}:GroupCentred", "weight": -1.0},
    ])
    batch = batch_of([0, 51, 102, 255], groups=[0, 0, 1, 1])
    assert rewards.keys == ["mean", f"{__name__}:GroupCentred"]
    assert rewards.has_groupwise
    point = rewards.pointwise(batch)
    group = rewards.groupwise(batch)
    assert list(point) == ["mean"] and list(group) == [f"{__name__}:GroupCentred"]
    # Hand computation: means 0, .2, .4, 1; group means 25.5 and 178.5 -> centred -25.5, 25.5, -76.5, 76.5.
    assert_close(point["mean"], torch.tensor([0.0, 0.2, 0.4, 1.0]))
    expected_group = torch.tensor([-25.5, 25.5, -76.5, 76.5])
    assert_close(group[f"{__name__}:GroupCentred"], expected_group)
    scores = rewards(batch)
    assert_close(scores.total, 2 * torch.tensor([0.0, 0.2, 0.4, 1.0]) - expected_group)
    assert scores.total.dtype == torch.float32
    with pytest.raises(KeyError, match="GroupCentred are missing"):
        rewards.combine(point)
    # Without groups every sample is its own group: centred scores are all 0.
    assert rewards.groupwise(batch_of([0, 51]))[f"{__name__}:GroupCentred"].tolist() == [0.0, 0.0]


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.name: unknown reward 'color'; did you mean 'colour'"):
        Rewards([{"name": "color"}])
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.args: reward 'colour': .*unexpected keyword.*colour"):
        Rewards([{"name": "colour", "args": {"colour": [1, 2, 3]}}])
    with pytest.raises(ConfigError, match=r"model.eval_rewards\[0\]\.args: reward 'colour': target must be three"):
        Rewards([{"name": "colour", "args": {"target": [300, 0, 0]}}], config_key="model.eval_rewards")
    with pytest.raises(ConfigError, match=r"rewards\[1\]: reward 'colour' is configured twice; give one a distinct"):
        Rewards([{"name": "colour"}, {"name": "colour", "args": {"target": [255, 0, 0]}}])
    with pytest.raises(ConfigError, match=r"rewards\[0\]: unknown key\(s\) wieght"):
        Rewards([{"name": "colour", "wieght": 2}])
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.weight: expected a finite number"):
        Rewards([{"name": "colour", "weight": float("nan")}])


def test_bad_scores_are_refused_with_the_reward_name():
    class Wrong(Reward):
        name = "wrong"

        def __call__(self, batch):
            return torch.tensor([float("nan")] * len(batch))

    rewards = Rewards([])
    rewards.specs, rewards.rewards = [RewardSpec("wrong")], [Wrong()]
    with pytest.raises(ValueError, match="reward 'wrong' returned a non-finite score for sample 0"):
        rewards(batch_of([1, 2]))
    Wrong.__call__ = lambda self, batch: torch.zeros(len(batch), 1)
    with pytest.raises(ValueError, match=r"reward 'wrong' returned \(2, 1\); .* shape \(2,\)"):
        rewards(batch_of([1, 2]))


def test_check_records_names_reward_field_file_and_line(tmp_path):
    rewards = Rewards([{"name": f"{__name__}:GroupCentred", "label": "sudoku"}])
    src = tmp_path / "train.jsonl"
    records = [Record(src, 1, "a", metadata={"answer": 3}), Record(src, 2, "b", metadata={"solution": 1})]
    with pytest.raises(DatasetErrors) as err:
        rewards.check_records(records)
    assert str(err.value) == (
        f"{src}:2: metadata.answer: reward 'sudoku' (rewards) needs the metadata field 'answer', which this record "
        "lacks (a legacy row's extra column or a V2 record's metadata key)"
    )
    rewards.check_records(records[:1])
    many = [Record(Path("t.txt"), i, "p") for i in range(1, 30)]
    with pytest.raises(DatasetErrors) as err:
        rewards.check_records(many)
    assert len(err.value.errors) == 21 and "9 more records lack it (reward 'sudoku')" in str(err.value)


def test_check_outputs_refuses_a_reward_of_media_the_adapter_never_emits():
    Rewards([{"name": "colour"}]).check_outputs(["image"], "sd3-5")
    with pytest.raises(ConfigError, match=r"eval\[0\]: reward 'colour' scores image/video, but sd3-5 outputs audio"):
        Rewards([{"name": "colour"}], config_key="eval").check_outputs(["audio"], "sd3-5")


def test_builtins_register_through_the_hook_even_without_autoload(monkeypatch):
    monkeypatch.setenv("FF_DISABLE_PLUGIN_AUTOLOAD", "1")
    registry = PluginRegistry()
    info = registry.rewards()["colour"]
    assert info.distribution == "ff-core" and info.summary == "pointwise reward of image/video"
    assert registry.manager.has_plugin("ff-core")
    assert get_reward_class("brightness").name == "brightness"
    assert registry.reward_class(f"{__name__}:MeanPixel") is MeanPixel
    with pytest.raises(KeyError, match="not a subclass of ff_core.rewards.Reward"):
        registry.reward_class("collections:OrderedDict")


class _Plugin:
    """A plugin module stand-in: provides one new reward and one clashing with a built-in."""

    class Dup(MeanPixel):
        name = "colour"

    @staticmethod
    @hookimpl
    def ff_rewards():
        return [MeanPixel, _Plugin.Dup]


class _EP:
    """A fake entry point (name, dist, load), as tests/test_plugins.py's real ones but in-process."""

    name = "toy-rewards"

    class dist:
        name = "toy-rewards"
        version = "1.0"

    @staticmethod
    def load():
        return _Plugin


def test_plugin_rewards_register_and_conflicts_are_reported():
    registry = PluginRegistry(entry_points=[_EP])
    assert registry.rewards()["mean_pixel"].distribution == "toy-rewards"
    assert registry.rewards()["colour"].distribution == "ff-core"
    assert any("reward name 'colour' is already provided by ff-core" in f.error for f in registry.failures)


def test_ff_plugins_lists_the_rewards():
    import io

    from ff_core.cli import print_plugins

    out = io.StringIO()
    print_plugins(out)
    lines = out.getvalue().splitlines()
    for name in ("audio_loudness", "brightness", "clip_score", "colour", "jpeg_compressibility"):
        assert any(line.startswith(f"reward {name}  [ff-core ") for line in lines), lines
    assert any(line.endswith("pointwise reward of audio") for line in lines)



class MoveRecorder(Reward):
    """Records where it is moved and where it scores."""

    name = "move_recorder"

    def __init__(self) -> None:
        super().__init__()
        self.moves: list[str] = []

    def to(self, device):
        self.moves.append(str(device))
        return super().to(device)

    def __call__(self, batch):
        self.moves.append(f"score on {self.device}")
        return torch.zeros(len(batch))


@pytest.mark.parametrize("offload", [True, False])
def test_an_offloaded_reward_visits_the_device_only_while_it_scores(offload):
    """``offload: true``: kept on the CPU, moved to the scoring device for its call and back after; without it the
    reward moves to the device once. ("meta" stands for an accelerator: the visit happens for any non-CPU device.)"""
    rewards = Rewards([{"name": "tests.rewards.test_rewards_base:MoveRecorder", "offload": offload}])
    rewards.to("meta")
    batch = RewardBatch([[torch.zeros(3, 2, 2, dtype=torch.uint8)]], ["p"], [{}])
    rewards(batch)
    rewards(batch)
    moves = rewards.rewards[0].moves
    if offload:
        assert moves == ["cpu", "meta", "score on meta", "cpu", "meta", "score on meta", "cpu"]
    else:
        assert moves == ["meta", "score on meta", "score on meta"]


def test_offload_must_be_a_boolean():
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.offload: expected true or false"):
        Rewards([{"name": "colour", "offload": "yes"}])
