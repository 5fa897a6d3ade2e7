"""``check_ckpt_path`` on sharded checkpoint folders, laid out as Lightning writes them (issue 24 review).

DeepSpeed: ``DeepSpeedStrategy.save_checkpoint`` writes a folder (named like the ``.ckpt`` file) holding a
``checkpoint/`` folder of shards and a ``latest`` file; Lightning recognises it by the ``checkpoint/`` folder
(``lightning.fabric.strategies.deepspeed._is_deepspeed_checkpoint``). FSDP: ``meta.pt``
(``lightning.fabric.strategies.fsdp._is_sharded_checkpoint``) or torch.distributed.checkpoint's ``.metadata``.
Before the fix a DeepSpeed folder (and an FSDP one with ``meta.pt`` only) was refused as "a folder, not a checkpoint".
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ff_core.ckpt_path import check_ckpt_path
from ff_core.errors import ConfigError


def test_deepspeed_folder_accepted(tmp_path: Path) -> None:
    folder = tmp_path / "epoch=0-step=2.ckpt"
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "checkpoint" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (folder / "latest").write_text("checkpoint")
    from lightning.fabric.strategies.deepspeed import _is_deepspeed_checkpoint

    assert _is_deepspeed_checkpoint(folder)  # the layout is the one Lightning recognises
    check_ckpt_path(folder)


@pytest.mark.parametrize("name", ["meta.pt", ".metadata"])
def test_sharded_folder_accepted(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_bytes(b"x")
    check_ckpt_path(tmp_path)


def test_plain_folder_refused_with_hint(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"is a folder, not a checkpoint file.*DeepSpeed: a checkpoint/ folder"):
        check_ckpt_path(tmp_path)
