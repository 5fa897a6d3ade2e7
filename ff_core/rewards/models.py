"""What the model-based rewards share: loading weights (transformers folders, state dict files) with errors that name
the config argument at fault, the weights' dtype, and :class:`ModelReward`, which holds the frozen modules and moves
them with the reward.

A reward's options arrive as the config's ``args`` (``rewards: [{name: pickscore, args: {...}}]``), so a folder that
does not load is reported as the argument the user wrote (``pretrained_model_name_or_path 'x': ...``), which
:class:`ff_core.objectives.rewards.Rewards` prefixes with the config key (``rewards[0].args: reward 'pickscore': ``).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from ff_core.rewards.base import Reward

MODEL_PATH = "pretrained_model_name_or_path"
"""The argument every model-based reward names its model folder (or hub id) by, as transformers does."""


def torch_dtype(dtype: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; a ValueError naming the value for anything that is not a dtype."""
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype must name a torch dtype (float32, bfloat16, float16), got {dtype!r}")
    return value


def check_counts(**counts: int) -> None:
    """A ValueError naming the first of ``counts`` (``batch_size=...``, ``video_frames=...``) that is below 1."""
    for key, value in counts.items():
        if value < 1:
            raise ValueError(f"{key} must be >= 1, got {value}")


def given_path(**paths: str | None) -> tuple[str, str]:
    """The first of ``paths`` that is set, as ``(argument, path)``: an optional folder (``processor_name_or_path``)
    falling back to the model's, so a load error names the argument the path came from."""
    for key, path in paths.items():
        if path:
            return key, path
    raise ValueError(f"none of {', '.join(paths)} is set")


def from_pretrained(cls: Any, path: str, key: str = MODEL_PATH, holds: str | None = None,
                    errors: tuple[type[Exception], ...] = (OSError,), **kwargs: Any) -> Any:  # fmt: skip
    """``cls.from_pretrained(path, **kwargs)``; the error transformers raises for a folder or hub id it cannot load
    (an OSError; add ValueError for a folder of another kind of model) becomes a ValueError naming the argument:
    ``{key} {path!r}: {error}``, or ``{key} {path!r} holds no {holds}: {error}``."""
    try:
        return cls.from_pretrained(path, **kwargs)
    except errors as exc:
        what = f" holds no {holds}" if holds else ""
        raise ValueError(f"{key} {path!r}{what}: {exc}") from None


def load_state_dict(path: str | Path) -> dict[str, Tensor]:
    """Tensors of a ``.safetensors`` file, or of a PyTorch pickle (``.pth`` / ``.pt``, read with
    ``weights_only=True``: tensors only, no code run)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {str(path)!r}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # objects other than tensors and plain containers
        raise ValueError(f"{str(path)!r} holds more than tensors; save its state dict alone: {exc}") from None


def projected(out) -> Tensor:
    """The projected embeddings ``get_image_features`` / ``get_text_features`` / ``get_audio_features`` (CLIP,
    CLAP) return: the tensor itself (transformers 4) or the output's ``pooler_output`` (transformers 5)."""
    return out if isinstance(out, Tensor) else out.pooler_output


class ModelReward(Reward):
    """A reward that scores with frozen torch modules: the attributes named in :attr:`module_names`.

    ``__init__`` checks the counts and parses ``dtype`` (into :attr:`dtype`); the subclass then loads its modules
    and calls :meth:`freeze`. :meth:`to` moves every one of them.

    Attributes:
        module_names: names of the ``nn.Module`` attributes the reward scores with (``("model", "head")``).
        dtype: the weights' dtype.
    """

    module_names: ClassVar[tuple[str, ...]] = ("model",)

    def __init__(self, dtype: str = "float32", **counts: int) -> None:
        """Check ``counts`` (options that must be >= 1: ``batch_size=...``, ``video_frames=...``, in order) and
        parse ``dtype`` (``float32``, ``bfloat16``, ``float16``); the subclass's own signature is its config."""
        super().__init__()
        check_counts(**counts)
        self.dtype = torch_dtype(dtype)

    def freeze(self) -> None:
        """Every module in eval mode (dropout off) without gradients: rewards are scored, never trained."""
        for name in self.module_names:
            getattr(self, name).eval().requires_grad_(False)

    def to(self, device: torch.device | str) -> ModelReward:
        super().to(device)
        for name in self.module_names:
            getattr(self, name).to(self.device)
        return self
