"""The objective x strategy matrix (docs/scaling.md, "The matrix"): every workflow's tiny recipes under every strategy.

A cell is (workflow, objective, LoRA or full fine-tuning, strategy). Each runs the tiny recipe of its workflow and
objective (``scripts/build_inputs.sh`` builds the inputs; the A14B checkpoint is built here when missing) for 2
optimiser steps as real ``ff fit`` processes (2 ranks started at once, as torchrun does; 1 for ``single``), writing a
checkpoint at each step; a second process resumes from the step-1 checkpoint and takes step 2. A cell reads:

* ``= DDP``: rank 0's logged loss (SFT/DPO ``train/loss``; GRPO ``train/policy_loss`` and ``train/reward_mean``) at
  both steps equals the DDP cell's within 1e-4 (relative), and the resumed step 2 equals the uninterrupted one within
  1e-5: the same samples, noise and update on the same data and seeds. Offline DPO's loss is ``-log sigmoid`` of
  ``beta`` (thousands) times differences of nearly equal errors, which turns a reduction order's 1e-7 into 1e-4:
  its four errors (policy and reference, chosen and rejected: what the networks computed) are compared within 1e-4
  and its loss within 1e-3;
* ``= single``: the same against the one-process cell (context parallelism: both ranks take its samples);
* ``ran``: trained 2 steps and resumed exactly, not comparable with DDP (``single``: one rank takes both ranks'
  samples; a mismatch with DDP reads ``ran, ≠ DDP``); ``resume ≠``: the resumed step differs;
* ``refused: …``: ff refused the cell before training, with its one-line reason (``ff fit`` exit 2);
* ``GPU only``: FSDP1 on the CPU (torch's FSDP1 refuses it; ``--accelerator gpu`` runs these cells on a GPU machine);
* ``failed``: anything else (the log's last line), ``not run``: no result recorded yet.

Results accumulate in ``benchmarks/matrix.json`` (one entry per cell, rerun cells replaced) and the table between the
``matrix`` markers of docs/scaling.md is rewritten from it (tests/test_matrix_table.py checks the two agree)::

    python benchmarks/matrix.py                                   # every cell (hours on 2 CPU cores)
    python benchmarks/matrix.py --workflows h3-t2va h3-fl2va h3-ref2va --strategies ddp fsdp2 --tuning lora
    python benchmarks/matrix.py --render                          # only rewrite the table from matrix.json
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from lightning.fabric.plugins.environments.lightning import find_free_network_port

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "matrix.json"
DOC = REPO / "docs" / "scaling.md"
BEGIN, END = "<!-- matrix:begin (benchmarks/matrix.py writes this table) -->", "<!-- matrix:end -->"

# Workflow -> (label, {objective: recipe}, extra arguments). No recipe: "no tiny recipe".
WORKFLOWS: dict[str, tuple[str, dict[str, str], tuple[str, ...]]] = {
    "sd3-t2i": ("SD3.5 T2I", {"sft": "sd3/sft_tiny", "dpo": "sd3/offline_dpo_tiny", "grpo": "sd3/grpo_tiny"}, ()),
    "wan-t2v": ("Wan T2V", {"sft": "wan/sft_tiny", "dpo": "wan/offline_dpo_tiny", "grpo": "wan/grpo_tiny"}, ()),
    "wan-i2v": ("Wan I2V", {"sft": "wan/i2v_sft_tiny"}, ()),
    "wan-a14b": ("Wan2.2 T2V-A14B", {"sft": "wan/sft_tiny", "dpo": "wan/offline_dpo_tiny", "grpo": "wan/grpo_tiny"},
                 ("--model.pretrained_model_name_or_path", "build/tiny-wan-t2v-a14b")),
    "ltx2-t2av": ("LTX-2 T2AV", {"sft": "ltx2/sft_tiny", "dpo": "ltx2/offline_dpo_tiny", "grpo": "ltx2/grpo_tiny"}, ()),
    "ltx2-i2av": ("LTX-2 I2AV", {"sft": "ltx2/i2av_sft_tiny", "dpo": "ltx2/i2av_offline_dpo_tiny",
                                 "grpo": "ltx2/i2av_grpo_tiny"}, ()),
    "h3-t2va": ("H3 T2VA", {"sft": "minimax/t2va_sft_tiny", "dpo": "minimax/t2va_offline_dpo_tiny",
                            "grpo": "minimax/t2va_grpo_tiny"}, ()),
    "h3-fl2va": ("H3 FL2VA", {"sft": "minimax/fl2va_sft_tiny", "dpo": "minimax/fl2va_offline_dpo_tiny",
                              "grpo": "minimax/fl2va_grpo_tiny"}, ()),
    "h3-ref2va": ("H3 Ref2VA", {"sft": "minimax/ref2va_sft_tiny", "dpo": "minimax/ref2va_offline_dpo_tiny",
                                "grpo": "minimax/ref2va_grpo_tiny"}, ()),
}  # fmt: skip
# Arguments of one workflow's objective in every cell. A14B's SFT and DPO: one expert per micro-batch under every
# strategy (FSDP2 and DeepSpeed take it by default: docs/scaling.md, "Routed experts"), so DDP draws the same levels.
CELL_EXTRA = {("wan-a14b", objective): ("--model.objective.init_args.timesteps.expert_choice", "per_micro_batch")
              for objective in ("sft", "dpo")}  # fmt: skip
OBJECTIVES = {"sft": "SFT", "dpo": "offline DPO", "grpo": "Flow-GRPO"}
TUNING = {"lora": (), "full": ("--model.lora", "null", "--model.optimizer.init_args.lr", "1.0e-4")}


def _deepspeed(stage: int) -> str:
    return json.dumps({"class_path": "ff_core.strategies.DeepSpeedStrategy",
                       "init_args": {"stage": stage, "exclude_frozen_parameters": True}})  # fmt: skip


# Strategy -> (ranks, trainer arguments).
STRATEGIES: dict[str, tuple[int, tuple[str, ...]]] = {
    "single": (1, ()),
    "ddp": (2, ("--trainer.strategy", "ddp")),
    "fsdp2": (2, ("--trainer.strategy", json.dumps({
        "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
        "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1, "save_distributed_checkpoint": False}}))),
    "fsdp1": (2, ("--trainer.strategy", json.dumps({
        "class_path": "lightning.pytorch.strategies.FSDPStrategy",
        "init_args": {"sharding_strategy": "FULL_SHARD", "state_dict_type": "full"}}))),
    "zero2": (2, ("--trainer.strategy", _deepspeed(2))),
    "zero3": (2, ("--trainer.strategy", _deepspeed(3))),
    "cp2": (2, ("--trainer.strategy", json.dumps({"class_path": "ff_core.strategies.ContextParallelStrategy",
                                                  "init_args": {"context_parallel_size": 2,
                                                                "save_distributed_checkpoint": False}}))),
}  # fmt: skip
STRATEGY_LABELS = {"single": "single", "ddp": "DDP", "fsdp2": "FSDP2", "fsdp1": "FSDP1", "zero2": "ZeRO-2",
                   "zero3": "ZeRO-3", "cp2": "context parallel 2"}  # fmt: skip
BASELINES = {"cp2": "single"}
"""Cells compared with another cell than DDP's: context parallelism on 2 ranks (one data-parallel rank) takes the
one-process run's samples (``= single``)."""


def cell_id(workflow: str, objective: str, tuning: str, strategy: str) -> str:
    return f"{workflow}/{objective}/{tuning}/{strategy}"


def ff_fit(root: Path, ranks: int, args: list[str], accelerator: str, timeout: int) -> tuple[int, str]:
    """``ff fit ARGS`` on ``ranks`` processes started at once (LOCAL_RANK set: Lightning launches nothing); the exit
    code (the first non-zero) and the tail of rank 0's log."""
    root.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "ff_core.cli", "fit", *args, "--trainer.accelerator", accelerator,
           "--trainer.devices", str(ranks)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH",
                                                                                                        "")]))
    if ranks > 1:
        port = str(find_free_network_port())
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(ranks), NODE_RANK="0")
    procs = []
    for rank in range(ranks):
        log = (root / f"rank{rank}.log").open("w")
        extra = {"LOCAL_RANK": str(rank), "RANK": str(rank)} if ranks > 1 else {}
        procs.append(subprocess.Popen(cmd, cwd=REPO, env={**env, **extra}, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))  # fmt: skip
    codes = []
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(124)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    code = next((c for c in codes if c != 0), 0)
    return code, (root / "rank0.log").read_text(errors="replace")[-4000:]


ERRORS = ("train/error_policy_chosen", "train/error_policy_rejected", "train/error_reference_chosen",
          "train/error_reference_rejected")  # fmt: skip
"""Offline DPO's per-arm errors, logged beside its loss."""


def metrics(root: Path) -> dict[int, dict[str, float]]:
    """Rank 0's logged training metrics per optimiser step (Lightning's CSVLogger)."""
    out: dict[int, dict[str, float]] = {}
    path = root / "metrics.csv"
    if not path.is_file():
        return out
    with path.open() as f:
        for row in csv.DictReader(f):
            step = int(row["step"]) + 1  # logged before the step counter moves
            for key in ("train/loss", *ERRORS, "train/policy_loss", "train/reward_mean"):
                if row.get(key):
                    out.setdefault(step, {})[key] = float(row[key])
    return out


def close(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]], rel: float, steps: list[int]) -> bool:
    for step in steps:
        if step not in a or step not in b or a[step].keys() != b[step].keys():
            return False
        dpo = ERRORS[0] in b[step]
        for key, value in b[step].items():
            tolerance = max(rel, 1e-3) if dpo and key == "train/loss" else rel
            if abs(a[step][key] - value) > tolerance * abs(value) + 1e-7:
                return False
    return True


def run_cell(workflow: str, objective: str, tuning: str, strategy: str, work: Path, accelerator: str,
             timeout: int) -> tuple[dict, Path | None]:  # fmt: skip
    label, recipes, extra = WORKFLOWS[workflow]
    if objective not in recipes:
        return {"status": "no tiny recipe"}, None
    ranks, strategy_args = STRATEGIES[strategy]
    root = work / cell_id(workflow, objective, tuning, strategy).replace("/", "-")
    shutil.rmtree(root, ignore_errors=True)  # an earlier invocation's checkpoints would be taken for this run's
    callbacks = [{"class_path": "ff_core.callbacks.FlowCheckpoint",
                  "init_args": {"every_n_train_steps": 1, "save_top_k": -1, "dirpath": str(root / "ckpt")}}]
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger",
              "init_args": {"save_dir": str(root), "name": "", "version": ""}}  # fmt: skip
    args = ["--config", str(REPO / "configs" / f"{recipes[objective]}.yaml"), *extra,
            *CELL_EXTRA.get((workflow, objective), ()), *TUNING[tuning], *strategy_args,
            "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
            "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.callbacks", json.dumps(callbacks), "--trainer.logger", json.dumps(logger)]  # fmt: skip
    begin = time.monotonic()
    code, log = ff_fit(root, ranks, args, accelerator, timeout)
    seconds = round(time.monotonic() - begin, 1)
    if code != 0:
        last = [line for line in log.splitlines() if line.strip()][-1:] or [f"exit {code}"]
        if code == 2:
            return {"status": "refused", "reason": last[0].strip(), "seconds": seconds}, None
        if strategy == "fsdp1" and accelerator == "cpu":
            return {"status": "GPU only", "reason": "torch's FSDP1 refuses the CPU", "seconds": seconds}, None
        return {"status": "failed", "reason": last[0].strip()[-300:], "seconds": seconds}, None
    ckpt = next((root / "ckpt").glob("*step=1.ckpt"), None)
    if ckpt is None:
        return {"status": "failed", "reason": "no step-1 checkpoint", "seconds": seconds}, None
    again = root / "resumed"
    callbacks[0]["init_args"]["dirpath"] = str(again / "ckpt")
    logger["init_args"]["save_dir"] = str(again)
    resume = [*args[:-4], "--trainer.callbacks", json.dumps(callbacks), "--trainer.logger", json.dumps(logger),
              "--ckpt_path", str(ckpt)]  # fmt: skip
    code, log = ff_fit(again, ranks, resume, accelerator, timeout)
    if code != 0:
        last = [line for line in log.splitlines() if line.strip()][-1:] or [f"exit {code}"]
        return {"status": "failed", "reason": f"resume: {last[0].strip()[-280:]}", "seconds": seconds}, root
    resumed = close(metrics(root / "resumed"), metrics(root), 1e-5, [2])
    return {"status": "ran" if resumed else "resume ≠", "seconds": round(time.monotonic() - begin, 1)}, root


def render(results: dict[str, dict]) -> str:
    """The Markdown table: one row per workflow, objective and tuning; one column per strategy."""
    head = "| workflow | objective | tuning | " + " | ".join(STRATEGY_LABELS.values()) + " |"
    lines = [head, "|" + "---|" * (3 + len(STRATEGIES))]
    for workflow, (label, _, _) in WORKFLOWS.items():
        for objective, name in OBJECTIVES.items():
            for tuning in TUNING:
                cells = []
                for strategy in STRATEGIES:
                    r = results.get(cell_id(workflow, objective, tuning, strategy))
                    cells.append(_cell_text(r))
                lines.append(f"| {label} | {name} | {'LoRA' if tuning == 'lora' else 'full'} | " + " | ".join(cells)
                             + " |")  # fmt: skip
    return "\n".join(lines)


def _cell_text(result: dict | None) -> str:
    if result is None:
        return "not run"
    status = result["status"]
    if status == "refused":
        reason = result["reason"].replace("|", "/")
        return f"refused: {reason[:160]}"
    if status == "failed":
        return f"failed: {result['reason'][:120].replace('|', '/')}"
    return status


def write_doc(results: dict[str, dict]) -> None:
    text = DOC.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOC.write_text(text[:start] + "\n" + render(results) + "\n" + text[end:])


def load() -> dict[str, dict]:
    return json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}


def ensure_inputs(workflows: list[str]) -> None:
    if "wan-a14b" in workflows and not (REPO / "build" / "tiny-wan-t2v-a14b" / "model_index.json").is_file():
        subprocess.run([sys.executable, "-m", "ff_wan.testing", "--out", "build/tiny-wan-t2v-a14b", "--variant",
                        "t2v_a14b"], cwd=REPO, check=True)  # fmt: skip


def recheck(results: dict[str, dict], work: Path) -> None:
    """Compare again every cell that trained and resumed (its runs still in ``work``) with its baseline's runs."""
    for key, result in results.items():
        if not result["status"].startswith(("ran", "= ")):
            continue
        workflow, objective, tuning, strategy = key.split("/")
        baseline = BASELINES.get(strategy, "ddp")
        root, base = (work / cell_id(workflow, objective, tuning, s).replace("/", "-") for s in (strategy, baseline))
        if strategy in (baseline, "single") or not all((r / "metrics.csv").is_file() for r in (root, base)):
            continue
        name = STRATEGY_LABELS[baseline] if baseline == "single" else "DDP"
        same = close(metrics(root), metrics(base), 1e-4, [1, 2])
        result["status"] = f"= {name}" if same else f"ran, ≠ {name}"
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workflows", nargs="+", default=list(WORKFLOWS), choices=list(WORKFLOWS))
    p.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=list(OBJECTIVES))
    p.add_argument("--tuning", nargs="+", default=list(TUNING), choices=list(TUNING))
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--work", type=Path, default=Path("/tmp/ff_matrix"))
    p.add_argument("--timeout", type=int, default=900, help="seconds per ff fit process group")
    p.add_argument("--render", action="store_true", help="only rewrite the docs table from matrix.json")
    p.add_argument("--reuse", action="store_true", help="compare with the baselines' runs in --work (DDP, one process) "
                   "instead of running them again, when they are not among --strategies")
    p.add_argument("--recheck", action="store_true", help="compare again the cells whose runs are in --work (after a "
                   "change of the comparison), without running anything")
    a = p.parse_args(argv)
    results = load()
    if a.recheck:
        recheck(results, a.work)
    elif not a.render:
        ensure_inputs(a.workflows)
        # The baselines first (DDP; the one-process run where a cell compares with it): the others compare with them
        first = ["ddp", *(["single"] if any(BASELINES.get(s) == "single" for s in a.strategies) else [])]
        strategies = [*first, *[s for s in a.strategies if s not in first]]
        for workflow in a.workflows:
            for objective in a.objectives:
                for tuning in a.tuning:
                    roots: dict[str, Path | None] = {}
                    for strategy in strategies:
                        key = cell_id(workflow, objective, tuning, strategy)
                        kept = a.work / key.replace("/", "-")
                        reusable = a.reuse and strategy in first and strategy not in a.strategies
                        if reusable and (kept / "metrics.csv").is_file():
                            roots[strategy] = kept  # a baseline's runs from an earlier invocation
                            continue
                        result, root = run_cell(workflow, objective, tuning, strategy, a.work, a.accelerator, a.timeout)
                        roots[strategy] = root
                        baseline = BASELINES.get(strategy, "ddp")
                        base = roots.get(baseline)
                        if strategy != baseline and root is not None and base is not None and result["status"] == "ran":
                            name = STRATEGY_LABELS[baseline] if baseline == "single" else "DDP"
                            if close(metrics(root), metrics(base), 1e-4, [1, 2]):
                                result["status"] = f"= {name}"
                            elif strategy != "single":
                                result["status"] = f"ran, ≠ {name}"
                        if strategy in a.strategies:
                            results[key] = result
                            print(f"{key}: {_cell_text(result)} ({result.get('seconds', 0)} s)", flush=True)
                            RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    write_doc(results)


if __name__ == "__main__":
    main()
