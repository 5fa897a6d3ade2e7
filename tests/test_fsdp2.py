"""FSDP2 (Lightning's ModelParallelStrategy) through `ff fit` on 2 CPU processes (gloo), against DDP (issue 13).

Runs of the real console entry, both ranks started at once as torchrun would (never DDP inside pytest):

* D: configs/sd3/sft_tiny.yaml (LoRA) under DDP, 2 ranks x 2 samples, 6 steps;
* A: configs/sd3/sft_tiny_fsdp2.yaml (the same recipe under FSDP2, sharded checkpoints), SIGKILLed once its step-2
  checkpoint is written;
* B: A resumed from that checkpoint to step 6;
* DF / F: full fine-tuning (``--model.lora null``) under DDP and FSDP2 (with activation checkpointing), 4 steps;
* FR: F resumed from its gathered step-2 file to step 4.

FSDP2 must train exactly what DDP trains: the same samples and noise per rank and step, the same per-rank losses and
the same final weights (within float tolerance: reduce-scatter sums in another order than all-reduce), each rank
storing half of every trained parameter. The resumed run continues the killed one exactly (its samples, noise,
losses and final weights are the uninterrupted DDP run's), and the LoRA exported beside each checkpoint is the whole
LoRA, gathered from the shards, equal to DDP's.

The defects these guard against, each checked by reverting its fix: a configure_model that never shards (each rank
then held all 8192 trained elements, reduced no gradient, rank 1's step-2 loss left DDP's by 1e-4, and the resume
failed in Lightning's loader: "Could not find a distributed model"); a LoRA export of the local shards (the first
FSDP2 checkpoint crashed writing DTensors); a sharded checkpoint holding only the LoRA while the module's state dict
named the frozen base too (the resume failed: "Missing key in checkpoint state_dict").
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from ff_core.callbacks import read_sample_log
from ff_core.sharding import global_numel, local_numel
from tests.test_ddp_resume import LAUNCHER_VARS, free_port

REPO = Path(__file__).resolve().parents[1]
DDP_RECIPE = REPO / "configs" / "sd3" / "sft_tiny.yaml"
FSDP2_RECIPE = REPO / "configs" / "sd3" / "sft_tiny_fsdp2.yaml"
DPO_RECIPE = REPO / "configs" / "sd3" / "offline_dpo_tiny.yaml"
KILL_AT, MAX_STEPS, FULL_STEPS = 2, 6, 4  # FULL_STEPS: a multiple of the checkpoint interval (2)
# The LoRA runs write sharded checkpoints (one file per rank, nothing gathered); full fine-tuning the recipe's
# gathered file.
SHARDED = ("--trainer.strategy.init_args.save_distributed_checkpoint", "true")


class ShardReport(L.Callback):
    """Writes, per rank, what it stores of the trained parameters (as the strategy set the model up) and which
    adapter components are in the module tree."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)

    def on_train_start(self, trainer, pl_module) -> None:
        trained = [p for p in pl_module.parameters() if p.requires_grad]
        report = {
            "trained_local": sum(local_numel(p) for p in trained),
            "trained_total": sum(global_numel(p) for p in trained),
            "unsharded": sum(not isinstance(p, DTensor) for p in trained),
            "submodules": sorted(name for name, _ in pl_module.adapter.named_children()),
            "detached": sorted(pl_module.adapter.detached_modules()),
        }
        reference = getattr(pl_module.objective, "reference", None)
        copies = [p for c in reference.copies() for p in c.parameters()] if reference is not None else []
        report["reference_local"] = sum(local_numel(p) for p in copies)
        report["reference_total"] = sum(global_numel(p) for p in copies)
        self.dirpath.mkdir(parents=True, exist_ok=True)
        (self.dirpath / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def ff_fit(recipe: Path, tiny_sd3: Path, shapes_dir: Path, root: Path, max_steps: int, *extra: str,
           ddp: bool = False) -> list[subprocess.Popen]:
    """Start both ranks of `ff fit` at once, as torchrun or SLURM would (LOCAL_RANK set: Lightning launches nothing),
    each in its own process group: the two import in parallel instead of rank 1 after rank 0."""
    callbacks = [
        {"class_path": "ff_core.callbacks.FlowCheckpoint",
         "init_args": {"every_n_train_steps": 2, "save_top_k": -1, "save_last": True, "dirpath": str(root / "ckpt")}},
        {"class_path": "ff_core.callbacks.SampleLog",
         "init_args": {"dirpath": str(root / "ids"), "outputs": ["sigma", "noise_seed", "loss"]}},
        {"class_path": "tests.test_fsdp2.ShardReport", "init_args": {"dirpath": str(root / "shards")}},
    ]
    strategy = ["--trainer.strategy", "ddp", "--trainer.devices", "2"] if ddp else []
    return launch(root, [
        "--config", str(recipe), *strategy,
        "--model.pretrained_model_name_or_path", str(tiny_sd3),
        "--data.datasets", json.dumps([{"name": "shapes", "dataset_dir": str(shapes_dir)}]),
        "--data.per_device_batch_size", "2", "--trainer.max_steps", str(max_steps),
        "--trainer.default_root_dir", str(root), "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.limit_val_batches", "0", "--trainer.callbacks", json.dumps(callbacks), *extra,
    ])  # fmt: skip


def launch(root: Path, args: list[str], ranks: int = 2) -> list[subprocess.Popen]:
    """`ff fit ARGS` on ``ranks`` ranks started at once (LOCAL_RANK set, as torchrun does: Lightning launches
    nothing), each in its own process group, logging to ROOT/ff_fit.rank<r>.log."""
    cmd = [sys.executable, "-m", "ff_core.cli", "fit", *args]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(HF_HUB_OFFLINE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               WORLD_SIZE=str(ranks), NODE_RANK="0",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))  # fmt: skip
    procs = []
    for rank in range(ranks):
        log = (root / f"ff_fit.rank{rank}.log").open("w")
        procs.append(subprocess.Popen(cmd, cwd=REPO, env={**env, "LOCAL_RANK": str(rank), "RANK": str(rank)},
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
    return procs


def log_tail(root: Path) -> str:
    return "\n".join(f"--- {p.name}\n" + p.read_text()[-3000:] for p in sorted(root.glob("ff_fit.rank*.log")))


def kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def kill_at(root: Path, procs: list, step: int, timeout: float = 300) -> Path:
    """SIGKILL a LoRA run's processes once its step-``step`` checkpoint is complete (FlowCheckpoint exports each
    LoRA before its checkpoint, and ``last.lora`` after the step's own pair); returns that checkpoint."""
    begin, ckpt = time.monotonic(), None
    try:
        while ckpt is None:
            assert all(proc.poll() is None for proc in procs), log_tail(root)
            assert time.monotonic() - begin < timeout, f"no step-{step} checkpoint within {timeout} s"
            export = root / "ckpt" / "last.lora" / "ff_export.json"
            done = export.is_file() and json.loads(export.read_text())["step"] == step
            ckpt = next((root / "ckpt").glob(f"*step={step}.ckpt")) if done else None
            time.sleep(0.05)
    finally:
        kill(procs)
    return ckpt


def wait(runs: dict[Path, list[subprocess.Popen]]) -> None:
    """Wait for every run (root -> its ranks); each must exit 0."""
    try:
        for root, procs in runs.items():
            codes = [proc.wait(timeout=300) for proc in procs]
            assert codes == [0] * len(procs), log_tail(root)
    finally:
        for procs in runs.values():
            kill(procs)


def start(*args, **kwargs) -> dict[Path, list[subprocess.Popen]]:
    root = args[3]
    root.mkdir()
    return {root: ff_fit(*args, **kwargs)}


def rows(root: Path, rank: int, max_step: int | None = None) -> list[dict]:
    return read_sample_log(root / "ids" / f"rank{rank}.jsonl", max_step)


def report(root: Path, rank: int) -> dict:
    return json.loads((root / "shards" / f"rank{rank}.json").read_text())


def weights(root: Path, name: str = "last") -> dict[str, torch.Tensor]:
    """A checkpoint's model tensors: a file, or a sharded FSDP2 folder read whole (torch's dcp_to_torch_save)."""
    path = root / "ckpt" / f"{name}.ckpt"
    if path.is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        whole = path.with_suffix(".whole.pt")
        dcp_to_torch_save(path, whole)
        path = whole
    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


@pytest.fixture(scope="module")
def lora_runs(tiny_sd3, shapes_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("fsdp2")
    ddp, killed, resumed = base / "D", base / "A", base / "B"
    timings = {}
    begin = time.monotonic()
    # D and A run side by side: each of the 4 processes is mostly importing or waiting on the other rank.
    reference = start(DDP_RECIPE, tiny_sd3, shapes_dir, ddp, MAX_STEPS, ddp=True)
    killed.mkdir()
    procs = ff_fit(FSDP2_RECIPE, tiny_sd3, shapes_dir, killed, 1000, *SHARDED)
    ckpt = kill_at(killed, procs, KILL_AT)
    timings["killed"] = time.monotonic() - begin
    wait(reference)
    timings["ddp"] = time.monotonic() - begin

    begin = time.monotonic()
    wait(start(FSDP2_RECIPE, tiny_sd3, shapes_dir, resumed, MAX_STEPS, "--ckpt_path", str(ckpt), *SHARDED))
    timings["resumed"] = time.monotonic() - begin
    print(f"FSDP2 LoRA run timings (s): {timings}")
    return ddp, killed, resumed, ckpt


@pytest.fixture(scope="module")
def full_runs(tiny_sd3, shapes_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("fsdp2_full")
    ddp, fsdp2, resumed = base / "DF", base / "F", base / "FR"
    begin = time.monotonic()
    # Activation checkpointing inside the sharded blocks: recomputation changes no gradient.
    full = ("--model.lora", "null", "--model.gradient_checkpointing", "true")
    wait({**start(DDP_RECIPE, tiny_sd3, shapes_dir, ddp, FULL_STEPS, "--model.lora", "null", ddp=True),
          **start(FSDP2_RECIPE, tiny_sd3, shapes_dir, fsdp2, FULL_STEPS, *full)})
    print(f"full fine-tuning runs, side by side (s): {time.monotonic() - begin:.1f}")
    begin = time.monotonic()
    ckpt = next((fsdp2 / "ckpt").glob(f"*step={KILL_AT}.ckpt"))  # the gathered file (the recipe's setting)
    wait(start(FSDP2_RECIPE, tiny_sd3, shapes_dir, resumed, FULL_STEPS, *full, "--ckpt_path", str(ckpt)))
    print(f"full fine-tuning FSDP2 resumed from its step-{KILL_AT} file (s): {time.monotonic() - begin:.1f}")
    return ddp, fsdp2, resumed


@pytest.fixture(scope="module")
def dpo_full_runs(tiny_sd3, shapes_dpo_dir, tmp_path_factory):
    """Full fine-tuning offline DPO (a frozen reference copy of the denoiser) under DDP and FSDP2, 2 steps, side by
    side."""
    base = tmp_path_factory.mktemp("dpo_fsdp2")
    ddp, fsdp2 = base / "DD", base / "DF"
    fsdp2_strategy = json.dumps({"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                                 "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1}})  # fmt: skip
    full = ("--model.lora", "null", "--model.optimizer.init_args.lr", "1.0e-4")
    wait({**start(DPO_RECIPE, tiny_sd3, shapes_dpo_dir, ddp, KILL_AT, *full, ddp=True),
          **start(DPO_RECIPE, tiny_sd3, shapes_dpo_dir, fsdp2, KILL_AT, *full, "--trainer.strategy", fsdp2_strategy,
                  "--trainer.devices", "2")})  # fmt: skip
    return ddp, fsdp2


def test_fsdp2_full_fine_tuning_dpo_shards_its_reference_and_trains_as_ddp(dpo_full_runs):
    """Offline DPO without LoRA (refused under FSDP2 before issue 26): the frozen reference copy is sharded like the
    policy (half per rank; whole on every DDP rank), and the run takes DDP's samples, noise, per-sample losses and
    final weights. The losses within 1e-4: DPO's beta (5000) multiplies the float rounding of the policy-reference
    gap (a reference computed with the policy's weights would give log 2 at step 2, as at step 1)."""
    ddp, fsdp2 = dpo_full_runs
    for rank in (0, 1):
        assert rows(ddp, rank)[0]["loss"] == pytest.approx(math.log(2))  # the policy starts as its reference
        assert rows(ddp, rank)[1]["loss"] > 2 * math.log(2)
        assert_same_run(rows(fsdp2, rank), rows(ddp, rank), rel=1e-4)
        sharded, whole = report(fsdp2, rank), report(ddp, rank)
        assert whole["reference_local"] == whole["reference_total"] == sharded["reference_total"] > 0
        assert sharded["reference_local"] == pytest.approx(sharded["reference_total"] / 2, rel=0.05)
        assert sharded["unsharded"] == 0
    assert_same_weights(weights(fsdp2), weights(ddp))


def assert_same_run(fsdp2_rows: list[dict], ddp_rows: list[dict], rel: float = 1e-5) -> None:
    """The same batches and noise at every step; the losses within float tolerance (``rel``)."""
    strip = [{k: v for k, v in r.items() if k != "loss"} for r in fsdp2_rows]
    assert strip == [{k: v for k, v in r.items() if k != "loss"} for r in ddp_rows]
    got, want = [r["loss"] for r in fsdp2_rows], [r["loss"] for r in ddp_rows]
    assert got == pytest.approx(want, rel=rel, abs=1e-6)


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key].shape == value.shape, key
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("rank", [0, 1])
def test_fsdp2_lora_killed_and_resumed_trains_as_ddp(lora_runs, rank):
    """Per rank: the killed FSDP2 run up to its checkpoint, then the resumed one, consumed DDP's samples and drew its
    noise, step by step, with DDP's losses."""
    ddp, killed, resumed, _ = lora_runs
    expected = rows(ddp, rank)
    assert [r["step"] for r in expected] == list(range(1, MAX_STEPS + 1))
    after_resume = rows(resumed, rank)
    assert [r["step"] for r in after_resume] == list(range(KILL_AT + 1, MAX_STEPS + 1))
    assert_same_run(rows(killed, rank, KILL_AT) + after_resume, expected)


def test_fsdp2_lora_ends_with_ddp_weights_and_exports_the_whole_lora(lora_runs):
    """Sharded checkpoints (one shard file per rank, the LoRA only) and the diffusers export beside them, gathered
    from the shards, equal DDP's: at the kill point and at the end of the resumed run. An export of local shards would
    hold half-size tensors."""
    ddp, killed, resumed, ckpt = lora_runs
    assert ckpt.is_dir() and sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    final, reference = weights(resumed), weights(ddp)
    assert final and all("lora_" in k for k in final)
    assert_same_weights(final, reference)
    assert_same_weights(weights(killed, ckpt.stem), weights(ddp, ckpt.stem))
    for ours, theirs in ((ckpt.with_suffix(".lora"), ddp / "ckpt" / f"{ckpt.stem}.lora"),
                         (resumed / "ckpt" / "last.lora", ddp / "ckpt" / "last.lora")):
        assert_same_weights(load_file(ours / "pytorch_lora_weights.safetensors"),
                            load_file(theirs / "pytorch_lora_weights.safetensors"))


def test_fsdp2_shards_the_lora_denoiser_and_nothing_else(lora_runs):
    """Each rank stores half of the trained parameters (every one a DTensor shard); under DDP each stores all. The
    frozen text encoders and VAE are outside the module tree (no strategy can shard them), so the adapter's only
    submodule is the transformer."""
    ddp, _, resumed, _ = lora_runs
    for rank in (0, 1):
        sharded, whole = report(resumed, rank), report(ddp, rank)
        assert sharded["unsharded"] == 0 and whole["trained_local"] == whole["trained_total"]
        assert sharded["trained_total"] == whole["trained_total"]
        assert sharded["trained_local"] == pytest.approx(sharded["trained_total"] / 2, rel=0.05)
        # The text encoders were released once the conditions were cached; the VAE encodes the targets.
        assert sharded["submodules"] == whole["submodules"] == ["transformer"]
        assert sharded["detached"] == whole["detached"] == ["vae"]


def test_fsdp2_full_fine_tuning_trains_as_ddp(full_runs):
    ddp, fsdp2, _ = full_runs
    for rank in (0, 1):
        assert_same_run(rows(fsdp2, rank), rows(ddp, rank))
        shards = report(fsdp2, rank)
        assert shards["unsharded"] == 0
        assert shards["trained_local"] == pytest.approx(shards["trained_total"] / 2, rel=0.05)
    final = weights(fsdp2)
    assert final and all(k.startswith("adapter.transformer.") for k in final)  # the whole denoiser, nothing frozen
    assert_same_weights(final, weights(ddp))


def test_fsdp2_full_fine_tuning_resumes_from_its_gathered_file(full_runs):
    """The gathered file (optimizer state keyed by index among all parameters, as FSDP2 writes it) resumes under
    FSDP2: the resumed run takes the uninterrupted run's samples, noise and losses and ends with its weights."""
    _, fsdp2, resumed = full_runs
    for rank in (0, 1):
        tail = rows(resumed, rank)
        assert tail and tail[0]["step"] == KILL_AT + 1  # the steps after the checkpoint's
        assert_same_run(tail, rows(fsdp2, rank)[-len(tail):])
    assert_same_weights(weights(resumed), weights(fsdp2))


def test_fsdp2_checkpoint_loads_on_a_single_device(full_runs, tiny_sd3):
    """The gathered FSDP2 checkpoint is an ordinary Lightning checkpoint: a single-device module takes its weights and
    its optimiser state (keyed by parameter index, shapes of the whole parameters) as Lightning's restore does."""
    from ff_core.module import FlowModule

    _, fsdp2, _ = full_runs
    saved = torch.load(fsdp2 / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    module = FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32}, lora=None)
    module.configure_model()
    module.on_load_checkpoint(saved)  # raises when a trained tensor is missing
    module.load_state_dict(saved["state_dict"], strict=False)
    for name, p in module.named_parameters():
        if p.requires_grad:
            assert torch.equal(p.detach(), saved["state_dict"][name]), name
    optimizer = module.configure_optimizers()
    optimizer.load_state_dict(saved["optimizer_states"][0])
    params = optimizer.param_groups[0]["params"]
    assert len(optimizer.state) == len(params)
    for p in params:
        state = optimizer.state[p]
        assert state["exp_avg"].shape == p.shape and int(state["step"]) == saved["global_step"]
