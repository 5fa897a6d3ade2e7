"""What the demo accuracy scripts share (demo_colour_accuracy.py, demo_motion_accuracy.py): finding the latest demo
checkpoint, loading it with its untrained base beside it, and generating samples for prompts."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ff_core.adapter import ConditionInput
from ff_core.module import FlowModule


def latest_checkpoint(run_dir: Path, script: str) -> Path:
    """The newest ``version_*/checkpoints/last.ckpt`` under ``run_dir`` (exits naming ``script``, which writes one)."""
    candidates = sorted(run_dir.glob("version_*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise SystemExit(f"no checkpoint under {run_dir}/version_*/checkpoints: run {script} first")
    return candidates[-1]


def load_trained_and_base(ckpt: Path) -> tuple[FlowModule, FlowModule]:
    """The trained FlowModule of ``ckpt`` and the untrained base it started from (same checkpoint folder, adapter and
    arguments): the baseline every demo score is read against."""
    with warnings.catch_warnings():  # checkpoints hold trained tensors only: the frozen rest comes from the base
        warnings.filterwarnings("ignore", message="Found keys that are in the model state dict but not in the")
        trained = FlowModule.load_from_checkpoint(ckpt, map_location="cpu")
    base = FlowModule(adapter=trained.hparams.adapter,
                      pretrained_model_name_or_path=trained.hparams.pretrained_model_name_or_path,
                      adapter_kwargs=trained.hparams.adapter_kwargs)  # fmt: skip
    base.configure_model()
    return trained, base


@torch.no_grad()
def generate(module: FlowModule, prompts: list[str], seeds: int, steps: int,
             encoder: FlowModule | None = None) -> list[tuple[str, torch.Tensor]]:  # fmt: skip
    """``(prompt, first output media)`` for every seed and prompt, seed-major (seed ``s`` samples with
    ``torch.Generator().manual_seed(s)``). ``encoder``: a module whose adapter encodes the prompts, for a ``module``
    that trained from the condition cache (``ff fit`` released its frozen text encoders); its encoders must be
    ``module``'s (the same base)."""
    adapter = module.adapter.eval()
    source = (encoder or module).adapter.eval()
    conditions = source.preprocess([ConditionInput(p) for p in prompts])
    batch = torch.utils.data.default_collate(conditions)
    out = []
    for seed in range(seeds):
        state = adapter.sample(adapter.prepare_condition(batch), num_steps=steps,
                               generator=torch.Generator().manual_seed(seed))  # fmt: skip
        out += [(p, media[0]) for p, media in zip(prompts, adapter.decode(state))]
    return out
