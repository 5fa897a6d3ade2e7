"""ff_core.rewards.models: what the model-based rewards share (loading errors naming the argument, dtype, counts,
frozen modules moved with the reward)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ff_core.rewards.models import ModelReward, check_counts, from_pretrained, given_path, torch_dtype


class _Missing:
    """A transformers class whose ``from_pretrained`` cannot find the folder (transformers raises OSError)."""

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        raise OSError(f"{path} does not appear to have a file named config.json")


class _TwoModules(ModelReward):
    name = "two_modules"
    module_names = ("model", "head")

    def __init__(self, batch_size: int = 1, dtype: str = "float32") -> None:
        super().__init__(dtype, batch_size=batch_size)
        self.model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
        self.head = nn.Linear(2, 1)
        self.freeze()


def test_from_pretrained_names_the_argument():
    with pytest.raises(ValueError, match=r"^pretrained_model_name_or_path 'x': x does not appear"):
        from_pretrained(_Missing, "x")
    with pytest.raises(ValueError, match=r"^processor_name_or_path 'p' holds no CLIP processor: p does not"):
        from_pretrained(_Missing, "p", "processor_name_or_path", holds="CLIP processor")
    with pytest.raises(OSError):  # an error the caller did not ask to translate passes through
        from_pretrained(_Missing, "x", errors=(ValueError,))


def test_given_path_counts_and_dtype():
    model = "pretrained_model_name_or_path"
    assert given_path(tokenizer_name_or_path=None, pretrained_model_name_or_path="m") == (model, "m")
    assert given_path(tokenizer_name_or_path="t", pretrained_model_name_or_path="m") == ("tokenizer_name_or_path", "t")
    assert torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype must name a torch dtype .* got 'Tensor'"):
        torch_dtype("Tensor")
    check_counts(batch_size=1, video_frames=3)
    with pytest.raises(ValueError, match="^video_frames must be >= 1, got 0$"):
        check_counts(batch_size=1, video_frames=0)


def test_model_reward_freezes_and_moves_every_module():
    reward = _TwoModules()
    assert reward.dtype is torch.float32
    for module in (reward.model, reward.head):
        assert not module.training and not any(p.requires_grad for p in module.parameters())
    assert reward.to("meta") is reward and reward.device == torch.device("meta")
    assert all(p.device.type == "meta" for m in (reward.model, reward.head) for p in m.parameters())
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        _TwoModules(batch_size=0)
