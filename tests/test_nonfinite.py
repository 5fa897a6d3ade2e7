"""Non-finite values stop the run (issue 24, item 1) and bad shard rows are refused at ``ff fit`` start (item 9).

Real shards written by ff's own writer (``ff data preprocess-latents``, then one row rewritten with
``TensorParquetWriter``), real ``ff fit`` processes. The reference for "poisoned" is the IEEE definition itself:
``torch.isfinite`` over every saved tensor; for the geometry, SD3Transformer2DModel's config (in_channels,
patch_size) read from the checkpoint's transformer/config.json in the test.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from safetensors.torch import load_file

from ff_core.cli import main
from ff_core.data.tensor_parquet import TensorParquetDataset, TensorParquetWriter
from ff_core.data.tensor_parquet.format import encode_tensor

BAD_ROW = 13  # the dataset row made non-finite (24 rows, 4 per batch: 6 steps an epoch)


def rewrite_shards(source: Path, out: Path, row: int, change) -> Path:
    """A copy of ``source`` written by ff's ``TensorParquetWriter`` (10 rows per file, as the fixture), where
    ``change(values)`` edits row ``row``'s values (tensors, or triplets ``latent_bytes``/``_shape``/``_dtype``)."""
    dataset = TensorParquetDataset(source, copy=True)
    with TensorParquetWriter(out, dataset.index.schema, rows_per_file=10) as writer:
        for i in range(len(dataset)):
            values = dataset[i]
            for name in dataset.tensor_names:  # absent optional tensors: the placeholder triplet
                if values[name] is None:
                    values.pop(name)
                    values.update({f"{name}_bytes": b"", f"{name}_shape": [], f"{name}_dtype": ""})
            if i == row:
                change(values)
            writer.write(values)
    return out


def nan_latent(values: dict) -> None:
    values["latent"] = torch.full_like(values["latent"], float("nan"))


def recipe(tmp_path: Path, tiny_sd3: Path, shards: Path, **model) -> Path:
    """SFT from shards, 12 steps (two epochs: the bad row is drawn in both), a checkpoint (and LoRA) every step."""
    config = {
        "seed_everything": 0,
        "model": {"adapter": "sd3-5", "pretrained_model_name_or_path": str(tiny_sd3),
                  "adapter_kwargs": {"resolution": 32},
                  "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3}},
                  "lora": {"rank": 2, "alpha": 2, "target_modules": ["to_q"]}, **model},
        "data": {"datasets": [{"name": "latents", "tensor_parquet_dir": str(shards)}], "per_device_batch_size": 4,
                 "num_workers": 0},
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 12, "num_sanity_val_steps": 0,
                    "log_every_n_steps": 1, "enable_progress_bar": False, "default_root_dir": str(tmp_path / "run"),
                    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                               "init_args": {"save_dir": str(tmp_path / "run")}},
                    "callbacks": [{"class_path": "ff_core.callbacks.FlowCheckpoint",
                                   "init_args": {"every_n_train_steps": 1, "save_last": True, "save_top_k": -1}}]},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def ff_fit(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ff_core.cli", "fit", "--config", str(config)], capture_output=True,
                          text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)


def saved_tensors(run: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every checkpoint's and LoRA export's tensors under the run folder."""
    out = {}
    for ckpt in run.rglob("*.ckpt"):
        out[str(ckpt)] = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    for lora in run.rglob("*.safetensors"):
        out[str(lora)] = load_file(lora)
    return out


def test_a_nan_row_stops_ff_fit_before_any_poisoned_checkpoint(tiny_sd3, shapes_latents_dir, tmp_path):
    shards = rewrite_shards(shapes_latents_dir, tmp_path / "shards", BAD_ROW, nan_latent)
    result = ff_fit(recipe(tmp_path, tiny_sd3, shards))
    assert result.returncode == 1, result.stderr[-3000:]
    [line] = [x for x in result.stderr.splitlines() if x.startswith("ff fit: non-finite")]
    assert "Traceback" not in result.stderr
    assert " on rank 0 of 1" in line and f"dataset row {BAD_ROW})" in line, line
    step = int(line.split(" at step ")[1].split()[0])
    assert 1 <= step <= 6  # the first epoch draws every row
    saved = saved_tensors(tmp_path / "run")
    assert saved, "the steps before the bad one were checkpointed"
    for where, tensors in saved.items():
        for key, value in tensors.items():
            assert torch.isfinite(value).all(), (where, key)
    last = torch.load(next((tmp_path / "run").rglob("last.ckpt")), map_location="cpu", weights_only=False)
    assert last["global_step"] == step - 1  # the last finite step; nothing after it was written


def test_skip_counts_and_lists_the_nan_steps(tiny_sd3, shapes_latents_dir, tmp_path):
    shards = rewrite_shards(shapes_latents_dir, tmp_path / "shards", BAD_ROW, nan_latent)
    result = ff_fit(recipe(tmp_path, tiny_sd3, shards, nonfinite="skip"))
    assert result.returncode == 0, result.stderr[-3000:]
    [listed] = list((tmp_path / "run").rglob("nonfinite_skipped.jsonl"))
    skipped = [json.loads(x) for x in listed.read_text().splitlines()]
    assert len(skipped) == 2  # once an epoch
    for entry in skipped:
        assert entry["what"] == "loss" and entry["ranks"] == [0]
        assert any(f"dataset row {BAD_ROW})" in name for name in entry["samples"]["0"])
    last = torch.load(next((tmp_path / "run").rglob("last.ckpt")), map_location="cpu", weights_only=False)
    assert last["global_step"] == 12 and last["ff_nonfinite_skipped"] == 2
    for where, tensors in saved_tensors(tmp_path / "run").items():
        for key, value in tensors.items():
            assert torch.isfinite(value).all(), (where, key)
    [metrics] = list((tmp_path / "run").rglob("metrics.csv"))
    counts = [float(v) for v in _column(metrics, "train/nonfinite_skipped")]
    assert counts and counts[-1] == 2.0


def _column(path: Path, name: str) -> list[str]:
    import csv

    return [r[name] for r in csv.DictReader(open(path)) if r.get(name)]


def test_validate_check_media_reports_non_finite_tensors(shapes_latents_dir, tmp_path, capsys):
    shards = rewrite_shards(shapes_latents_dir, tmp_path / "shards", BAD_ROW, nan_latent)
    assert main(["data", "validate", str(shards)]) == 0  # the small columns are fine
    capsys.readouterr()
    assert main(["data", "validate", str(shards), "--check-media"]) != 0
    out = capsys.readouterr()
    text = out.out + out.err
    [line] = [x for x in text.splitlines() if "non-finite" in x]
    assert "data_chunk_1.parquet" in line and "latent_bytes" in line and f"dataset row {BAD_ROW})" in line


# -- item 9: _dtype / _shape problems at fit start --------------------------------------------------------------------
def geometry(tiny_sd3: Path) -> tuple[int, int]:
    """SD3Transformer2DModel's (in_channels, patch_size), read from the checkpoint's own config."""
    config = json.loads((tiny_sd3 / "transformer" / "config.json").read_text())
    return config["in_channels"], config["patch_size"]


def wrong_dtype(values: dict) -> None:
    triplet = encode_tensor(values.pop("latent"), "latent")
    triplet["latent_dtype"] = "float16"  # half the bytes the row holds
    values.update(triplet)


def transposed_shape(values: dict) -> None:
    latent = values.pop("latent")  # (C, H, W) stored as (H, W, C): the byte count of the right shape
    triplet = encode_tensor(latent, "latent")
    triplet["latent_shape"] = [*latent.shape[1:], latent.shape[0]]
    values.update(triplet)


@pytest.mark.parametrize("change, column, reason", [
    (wrong_dtype, "latent_bytes", "expected prod("),
    (transposed_shape, "latent_shape", "axis 0 must be"),
])
def test_bad_rows_are_refused_at_fit_start(tiny_sd3, shapes_latents_dir, tmp_path, change, column, reason):
    channels, patch = geometry(tiny_sd3)
    latent = TensorParquetDataset(shapes_latents_dir)[0]["latent"]
    assert latent.shape[0] == channels and latent.shape[0] != latent.shape[-1] and latent.shape[1] % patch == 0
    shards = rewrite_shards(shapes_latents_dir, tmp_path / "shards", BAD_ROW, change)
    result = ff_fit(recipe(tmp_path, tiny_sd3, shards))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    [line] = [x for x in result.stderr.splitlines() if column in x]
    assert line.startswith(f"{shards}/worker_0/data_chunk_1.parquet: {column}: row 3 (dataset row {BAD_ROW})")
    assert reason in line
    assert not list((tmp_path / "run").rglob("*.ckpt")) and math.isfinite(channels)  # refused before step 1


# -- under DDP: every rank decides alike, the rank of the NaN row is named ---------------------------------------------
LAUNCHER_VARS = ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RANK", "GROUP_RANK")


def test_ddp_ranks_stop_together_naming_the_rank_of_the_nan_row(tiny_sd3, shapes_latents_dir, tmp_path):
    """2-process DDP on gloo (a subprocess without launcher variables, as tests/test_ddp_resume.py): the NaN row is
    drawn by one rank; both stop at the same step (no rank hangs in a collective: the run ends well within the
    timeout), the line names the rank whose batch held the row, and nothing saved holds a non-finite value."""
    import socket

    shards = rewrite_shards(shapes_latents_dir, tmp_path / "shards", BAD_ROW, nan_latent)
    config = recipe(tmp_path, tiny_sd3, shards)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(HF_HUB_OFFLINE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result = subprocess.run([sys.executable, "-m", "ff_core.cli", "fit", "--config", str(config),
                             "--trainer.strategy", "ddp", "--trainer.devices", "2"],
                            capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert result.returncode != 0, result.stderr[-3000:]
    lines = [x for x in result.stderr.splitlines() if x.startswith("ff fit: non-finite")]
    assert lines, result.stderr[-3000:]
    line = lines[0]
    rank = int(line.split(" on rank ")[1].split()[0])
    assert " of 2;" in line and f"rank {rank}: [" in line and f"dataset row {BAD_ROW})" in line, line
    assert len({x.split(";")[0] for x in lines}) == 1  # every rank that printed names the same step and rank
    for where, tensors in saved_tensors(tmp_path / "run").items():
        for key, value in tensors.items():
            assert torch.isfinite(value).all(), (where, key)


# -- GRPO: manual optimisation checks each transition's loss before its optimizer.step ---------------------------------
class OverflowingReplay(L.Callback):
    """The transformer's output projection overflows to NaN in every forward with gradient (GRPO's replays, not
    its no-grad rollouts): the model code runs as is, its output is poisoned, as an fp16 overflow would."""

    def on_train_start(self, trainer, pl_module):
        self.start = {n: p.detach().clone() for n, p in pl_module.named_parameters() if p.requires_grad}
        pl_module.adapter.transformer.proj_out.register_forward_hook(
            lambda module, args, out: out * float("nan") if torch.is_grad_enabled() else out)


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_grpo_nan_reward_stops_or_skips_before_the_weights_move(tiny_sd3, tmp_path, policy):
    from test_grpo_fit import fit

    from ff_core.errors import NonFiniteError
    from ff_core.testing.shapes import write_prompt_dataset

    prompts = write_prompt_dataset(tmp_path / "prompts")
    cli = fit(tiny_sd3, prompts, tmp_path, "--trainer.max_steps", "2", "--model.nonfinite", policy,
              "--model.objective.init_args.rewards", json.dumps([{"name": "test_grpo_fit:Constant"}]),
              "--model.objective.init_args.filter_zero_std", "false", "--model.eval_rewards", "[]")  # fmt: skip
    probe = OverflowingReplay()
    cli.trainer.callbacks.append(probe)
    if policy == "stop":
        with pytest.raises(NonFiniteError, match=r"^non-finite loss at step 1 on rank 0 of 1; samples of the step: "
                                                 r"rank 0: \[.*train\.txt:\d+"):
            cli.trainer.fit(cli.model, cli.datamodule)
    else:
        cli.trainer.fit(cli.model, cli.datamodule)
        assert cli.trainer.global_step == 2 and cli.model.nonfinite_guard.skipped == 2
        [listed] = list(tmp_path.rglob("nonfinite_skipped.jsonl"))
        assert [json.loads(x)["step"] for x in listed.read_text().splitlines()] == [1, 2]
        assert not cli.model.optimizers().optimizer.state  # AdamW never stepped
    for n, p in cli.model.named_parameters():  # every trained weight as it started
        if p.requires_grad:
            assert torch.equal(p, probe.start[n]), n


# -- the gradient check against the IEEE definition ------------------------------------------------------------------
def test_gradients_finite_is_isfinite_of_every_element():
    """``gradients_finite`` (the CPU's 2-norms first, inf-norms where they are not finite) against ``torch.isfinite``
    of every element: NaN, +-inf, and finite values whose squares overflow (a 2-norm alone would call them
    infinite), in float32 and bfloat16 gradients of one model (one group per dtype)."""
    from ff_core.nonfinite import gradients_finite

    cases = [[1.0, -2.0], [float("nan"), 0.0], [float("inf"), 1.0], [-float("inf"), 1.0], [3e38, -3e38]]
    for dtype in (torch.float32, torch.bfloat16):
        for values in cases:
            params = [torch.nn.Parameter(torch.zeros(2, dtype=dtype)), torch.nn.Parameter(torch.zeros(3)),
                      torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]
            params[0].grad = torch.tensor(values, dtype=dtype)
            params[1].grad = torch.ones(3)  # params[2]: no gradient
            params[3].grad = torch.full((2,), 1e30, dtype=torch.bfloat16)  # a finite 2-norm would overflow
            expected = all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None)
            assert bool(gradients_finite(params)) == expected, (dtype, values)
    assert gradients_finite([torch.nn.Parameter(torch.zeros(1))]) is None
