"""Kill -9 at the named moments of a save (issue 24, items 2, 3, 4 and 12), in real `ff` subprocesses.

The child runs `ff` under a small driver (:data:`DRIVER`) that pauses at a filesystem moment named by the test, with
no knowledge of how ff writes: when an existing ``last.ckpt`` is opened for writing or renamed over, when a folder is
moved away or exchanged. The test waits for the pause, sends SIGKILL, and checks what the next reader or the next
start sees. The moments are those at which the writers of today's main lose data:

* Lightning's writer stages a checkpoint in ``$TMPDIR`` and ``shutil.move``s it, which copies in place across
  filesystems (``$TMPDIR`` on /dev/shm here): a kill mid-copy leaves a truncated ``last.ckpt``;
* the checkpoint and its LoRA folder are two publications: a kill between them leaves a pair from two saves;
* ``replace_dir`` was two renames: a kill between them leaves the folder missing.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ff_core.cli import main
from ff_core.data.tensor_parquet import TensorParquetDataset

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "sd3" / "sft_tiny.yaml"

DRIVER = r'''
import builtins, os, sys, time
from pathlib import Path

MARK, AT = Path(os.environ["PAUSE_MARK"]), os.environ["PAUSE_AT"]
TARGETS = os.environ["PAUSE_TARGETS"].split(os.pathsep)
seen = set()


def pause(what):
    MARK.write_text(what)
    while True:
        time.sleep(1)


def target(path):
    try:
        path = os.path.abspath(os.fsdecode(path))
    except TypeError:
        return None
    return path if path in TARGETS else None


def event(kind, path, before):
    """A publication of one target: `ckpt` pauses on the checkpoint's (an existing one, so after the first save);
    `pair` on the second target published in one save; `swap` after a folder target was moved away."""
    if AT == "ckpt" and kind == "file" and before and os.path.exists(path):
        pause("ckpt " + path)
    if AT == "pair" and before and os.path.exists(TARGETS[0]):
        seen.add(path)
        if len(seen) == 2:
            pause("pair " + path)
    if AT == "swap" and not before:
        pause("swap " + path)


real_open, real_replace, real_rename = builtins.open, os.replace, os.rename


def patched_open(file, mode="r", *args, **kwargs):
    f = real_open(file, mode, *args, **kwargs)
    if ("w" in mode or "+" in mode) and target(file):  # opened: a truncating copy has emptied it
        event("file", target(file), True)
    return f


def patched_rename(real):
    def rename(src, dst, **kwargs):
        moved = target(src) if AT == "swap" else None
        hit = target(dst) or target(src)
        # a rename across filesystems fails (EXDEV) and shutil.move copies instead: the pause is then in the copy
        if hit and not moved and os.stat(src).st_dev == os.stat(os.path.dirname(os.path.abspath(dst))).st_dev:
            event("file" if os.path.isfile(hit) or hit.endswith(".ckpt") else "dir", hit, True)
        real(src, dst, **kwargs)
        if moved:
            event("dir", moved, False)
    return rename


builtins.open, os.replace, os.rename = patched_open, patched_rename(real_replace), patched_rename(real_rename)
try:
    from ff_core import atomic
except ImportError:
    atomic = None
if atomic is not None and hasattr(atomic, "_exchange"):
    real_exchange = atomic._exchange

    def exchange(src, dst):
        if os.environ.get("NO_EXCHANGE"):  # a filesystem without renameat2(RENAME_EXCHANGE): NFS, macOS
            raise OSError(22, "Invalid argument")
        event("dir", target(dst), True) if target(dst) and AT == "pair" else None
        real_exchange(src, dst)
        if target(dst) and AT == "swap":
            event("dir", target(dst), False)

    atomic._exchange = exchange

from ff_core.cli import main

sys.exit(main(sys.argv[1:]))
'''


def recipe_args(tiny_sd3, shapes_dir, root, *extra):
    datasets = json.dumps([{"name": "shapes", "dataset_dir": str(shapes_dir), "eval": {}}])
    return [
        "--config", str(RECIPE), "--model.pretrained_model_name_or_path", str(tiny_sd3), "--data.datasets", datasets,
        "--data.eval_batch_size", "6", "--model.sampling.num_steps", "2", "--trainer.limit_val_batches", "0",
        "--trainer.default_root_dir", str(root),
        "--trainer.logger", json.dumps({"class_path": "lightning.pytorch.loggers.CSVLogger",
                                        "init_args": {"save_dir": str(root), "name": "logs", "version": 0}}),
        "--trainer.callbacks", json.dumps([{"class_path": "ff_core.callbacks.FlowCheckpoint",
                                            "init_args": {"every_n_train_steps": 2, "save_last": True}}]),
        *extra,
    ]  # fmt: skip


def kill_at(tmp_path, at, targets, args, env=None, timeout=240):
    """Run ``ff ARGS`` under the driver until it pauses at ``at``; SIGKILL it there. Returns what it paused at."""
    driver, mark = tmp_path / "driver.py", tmp_path / "paused"
    driver.write_text(DRIVER)
    mark.unlink(missing_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PAUSE_MARK": str(mark), "PAUSE_AT": at,
           "PAUSE_TARGETS": os.pathsep.join(str(t) for t in targets), **(env or {})}  # fmt: skip
    log = (tmp_path / "child.log").open("w")
    child = subprocess.Popen([sys.executable, str(driver), *args], env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while not mark.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if child.poll() is None:
        os.kill(child.pid, signal.SIGKILL)
    child.wait()
    tail = (tmp_path / "child.log").read_text()[-2000:]
    assert mark.exists(), f"never paused at {at!r} (rc {child.returncode}): {tail}"
    return mark.read_text()


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def export_step(folder: Path) -> int:
    return json.loads((folder / "ff_export.json").read_text())["step"]


@pytest.fixture
def other_fs_tmpdir(tmp_path):
    """``$TMPDIR`` on another filesystem than the run folder (/dev/shm, a tmpfs), as on many clusters."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem for $TMPDIR")
    folder = Path(os.path.join(shm, f"ff-tmp-{os.getpid()}"))
    folder.mkdir(exist_ok=True)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_kill_while_last_ckpt_is_written_leaves_the_previous_one_loadable(tiny_sd3, shapes_dir, tmp_path,
                                                                          other_fs_tmpdir, capsys):
    """Item 2: SIGKILL at the moment ``last.ckpt`` of step 4 is published (main: mid-copy from $TMPDIR on /dev/shm;
    now: its temporary beside it written and fsynced, before the rename). The step-2 file stays whole; the resume
    continues from it and removes the temporary (item 12)."""
    run = tmp_path / "run"
    ckpts = run / "logs" / "version_0" / "checkpoints"
    args = ["fit", *recipe_args(tiny_sd3, shapes_dir, run, "--trainer.max_steps", "4")]
    kill_at(tmp_path, "ckpt", [ckpts / "last.ckpt"], args, env={"TMPDIR": str(other_fs_tmpdir)})
    assert (ckpts / "last.ckpt").stat().st_size > 0, "a kill mid-save emptied last.ckpt"
    assert torch.load(ckpts / "last.ckpt", weights_only=False)["global_step"] == 2
    assert not list(other_fs_tmpdir.iterdir()), "the checkpoint was staged outside its folder"
    assert [n for n in hidden(ckpts) if n.startswith(".last.ckpt.")], "the temporary lies beside last.ckpt"

    assert main(["fit", *recipe_args(tiny_sd3, shapes_dir, run, "--trainer.max_steps", "6"),
                 "--ckpt_path", str(ckpts / "last.ckpt")]) == 0  # fmt: skip
    assert torch.load(ckpts / "last.ckpt", weights_only=False)["global_step"] == 6
    assert hidden(ckpts) == [], "leftovers of the killed save"


def test_kill_between_checkpoint_and_lora_export_is_caught_and_repaired(tiny_sd3, shapes_dir, tmp_path, capsys,
                                                                      caplog):
    """Item 3: SIGKILL between the two publications of the step-4 save (``last.ckpt`` and ``last.lora``). `ff predict`
    refuses the pair with one line naming both steps; the resume exports the checkpoint's LoRA again, and every later
    pair records one step (the checkpoint's LoRA tensors are the folder's)."""
    run = tmp_path / "run"
    ckpts = run / "logs" / "version_0" / "checkpoints"
    last, lora = ckpts / "last.ckpt", ckpts / "last.lora"
    args = ["fit", *recipe_args(tiny_sd3, shapes_dir, run, "--trainer.max_steps", "4")]
    kill_at(tmp_path, "pair", [last, lora], args)
    step = torch.load(last, weights_only=False)["global_step"]
    folder_step = export_step(lora) if (lora / "ff_export.json").exists() else None
    assert step != folder_step  # the two saves really are out of step on disk

    capsys.readouterr()
    status = main(["predict", *recipe_args(tiny_sd3, shapes_dir, tmp_path / "predict"), "--ckpt_path", str(last)])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # the last line, after Lightning's INFO lines
    assert status == 2 and err.startswith("ff predict: ckpt_path: "), err
    assert f"step {step}" in err and f"step {folder_step}" in err and str(lora) in err
    print(err)

    with caplog.at_level("WARNING", logger="ff_core.callbacks.checkpoint"):
        assert main([*args, "--ckpt_path", str(last)]) == 0
    [warning] = [r.getMessage() for r in caplog.records if "exported again" in r.getMessage()]
    assert f"step {folder_step}, not step {step}" in warning  # re-exported before the first step
    checkpoint = torch.load(last, weights_only=False)
    assert checkpoint["global_step"] == 4 == export_step(lora)
    state = {k: v for k, v in checkpoint["state_dict"].items() if "lora_" in k}
    exported = load_file(lora / "pytorch_lora_weights.safetensors")
    assert len(exported) == len(state) > 0
    for key, value in state.items():  # the folder holds the checkpoint's tensors (peft names, diffusers prefix)
        name = "transformer." + key.split("transformer.", 1)[1].replace(".default", "")
        torch.testing.assert_close(exported[name], value, rtol=0, atol=0)
    assert hidden(ckpts) == []
    assert main(["predict", *recipe_args(tiny_sd3, shapes_dir, tmp_path / "predict"), "--ckpt_path", str(last)]) == 0


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_kill_during_overwrite_of_latent_shards_never_loses_the_root(exchange, tiny_sd3, shapes_dir,
                                                                     shapes_latents_dir, tmp_path):
    """Items 4 and 12: SIGKILL right after ``preprocess-latents --overwrite`` moved the existing ROOT (main: renamed to
    ``.ROOT.old``, ROOT missing). With an atomic exchange ROOT is whole at every instant; on a filesystem without one
    (two renames) the next start puts the old shards back. Either way the next start leaves no hidden folder."""
    root = tmp_path / "out" / "shards"
    shutil.copytree(shapes_latents_dir, root)
    rows = len(TensorParquetDataset(root))
    datasets = json.dumps([{"name": "shapes", "dataset_dir": str(shapes_dir)}])
    args = ["data", "preprocess-latents", "--output", str(root), "--overwrite", "--rows-per-file", "10",
            "--no-progress", "--config", str(RECIPE), "--model.pretrained_model_name_or_path", str(tiny_sd3),
            "--data.datasets", datasets]  # fmt: skip
    kill_at(tmp_path, "swap", [root], args, env={} if exchange else {"NO_EXCHANGE": "1"})
    if exchange:
        assert len(TensorParquetDataset(root)) == rows  # the new ROOT, whole, published in one step
    else:
        assert not root.exists()  # the moment the fallback cannot hide; the next start recovers it
    assert main(["data", "preprocess-latents", "--output", str(root), "--rows-per-file", "10", "--no-progress",
                 "--config", str(RECIPE), "--model.pretrained_model_name_or_path", str(tiny_sd3),
                 "--data.datasets", datasets]) != 0  # fmt: skip  # refused: ROOT exists (again) and is not empty
    assert len(TensorParquetDataset(root)) == rows
    assert hidden(root.parent) == []


def test_an_interrupted_two_rename_swap_is_recovered_and_leftovers_go(tmp_path):
    """The states a kill leaves in a two-rename swap (POSIX rename(2) semantics, built by hand): the published folder
    missing with the old one parked, or both present; the next writer's start restores or removes."""
    from ff_core.atomic import remove_leftovers

    out = tmp_path / "shards"
    (tmp_path / ".shards.old").mkdir()
    (tmp_path / ".shards.old" / "a.parquet").write_bytes(b"old")
    (tmp_path / ".shards.k3j2x9ab").mkdir()  # a half-written new version
    (tmp_path / ".last.ckpt.q1w2e3").write_bytes(b"partial")  # another output's temporary stays
    remove_leftovers(out)
    assert (out / "a.parquet").read_bytes() == b"old"
    assert hidden(tmp_path) == [".last.ckpt.q1w2e3"]

    (tmp_path / ".shards.old").mkdir()  # swap completed, the old one not yet removed
    remove_leftovers(out)
    assert (out / "a.parquet").read_bytes() == b"old" and hidden(tmp_path) == [".last.ckpt.q1w2e3"]


def test_a_failed_checkpoint_write_keeps_the_old_file(tmp_path):
    """AtomicCheckpointIO: an error while serialising leaves the previous file byte for byte and no temporary."""
    from ff_core.callbacks.checkpoint import AtomicCheckpointIO

    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 2}, path)
    before = path.read_bytes()

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        io.save_checkpoint({"global_step": 4, "x": Unpicklable()}, path)
    assert path.read_bytes() == before and hidden(tmp_path) == []
    assert torch.load(path, weights_only=False)["global_step"] == 2
