"""Helpers of the condition-cache tests: a weightless adapter whose conditions a test can compute by hand, a small
V2 dataset with condition images, and a command-line builder the multi-process tests run in subprocesses.

``python tests/data/cache_helpers.py DATASET CACHE_DIR [--delay S] [--log FILE] [--dist MODE RANK WORLD INIT]
[--barrier DIR N]`` builds (or opens) the cache of DATASET's training split and prints ``reused|built <folder>``;
with ``--dist`` it joins a gloo group of WORLD processes (``global``: one node of WORLD ranks; ``local``: WORLD
nodes of one rank); with ``--barrier`` it starts building only once N helpers have written their ready file in DIR
(so two helpers that import at different speeds still build at the same time).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import torch
from PIL import Image

from ff_core.adapter import Adapter, ConditionInput
from ff_core.contracts import IMAGE_OUT, MediaType, PipelineIOContract, SlotSpec
from ff_core.data.cache.group import BuildGroup
from ff_core.data.cache.store import ConditionSource, open_or_build
from ff_core.data.records.sources import DatasetConfig, load_split, split_file


def prompt_embedding(prompt: str) -> torch.Tensor:
    """The hand reference of :class:`HashAdapter`'s ``embeds``: the prompt's SHA-256 bytes as 8 bfloat16 values."""
    return torch.tensor(list(hashlib.sha256(prompt.encode()).digest()[:8]), dtype=torch.float32).bfloat16()


class HashAdapter(Adapter):
    """Conditions a test can recompute: ``embeds`` from the prompt's hash (bf16), ``colour`` the mean colour of the
    ``reference`` image (float32, ``-1`` without one), ``length`` the prompt's length (int64, 0-d).

    Args:
        delay: seconds each ``preprocess`` call sleeps (so a test can kill a build midway).
        log: file to which each call appends its prompts (one JSON line per call).
    """

    name: ClassVar[str] = "test-hash"
    io_contract: ClassVar[PipelineIOContract] = PipelineIOContract(
        outputs=(IMAGE_OUT,), slots=(SlotSpec("reference", MediaType.IMAGE, required=False),)
    )

    def __init__(self, delay: float = 0.0, log: str | Path | None = None) -> None:
        super().__init__()
        self.delay, self.log = delay, log

    def preprocess_identity(self) -> dict[str, Any]:
        return {"checkpoint": "hash-v1"}

    @torch.no_grad()
    def preprocess(self, inputs: list[ConditionInput]) -> list[dict[str, torch.Tensor]]:
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(json.dumps([item.prompt for item in inputs]) + "\n")
        time.sleep(self.delay)
        out = []
        for item in inputs:
            image = next((m["data"] for m in item.media if m.get("slot") == "reference"), None)
            colour = image.float().mean((1, 2)) if image is not None else torch.full((3,), -1.0)
            out.append({"embeds": prompt_embedding(item.prompt), "colour": colour,
                        "length": torch.tensor(len(item.prompt))})  # fmt: skip
        return out


def expected_condition(prompt: str, rgb: tuple[int, int, int] | None) -> dict[str, torch.Tensor]:
    return {"embeds": prompt_embedding(prompt),
            "colour": torch.tensor(rgb, dtype=torch.float32) if rgb else torch.full((3,), -1.0),
            "length": torch.tensor(len(prompt))}  # fmt: skip


def rgb(i: int) -> tuple[int, int, int]:
    return (i * 17 % 256, i * 41 % 256, i * 73 % 256)


def write_dataset(root: Path, n: int, with_media: bool = True) -> Path:
    """``n`` V2 SFT records ``prompt i`` whose condition image ``cond/i.png`` is a solid :func:`rgb` ``(i)``, with
    a target image each, and a legacy ``test.txt`` of three prompts."""
    (root / "cond").mkdir(parents=True, exist_ok=True)
    (root / "targets").mkdir(exist_ok=True)
    lines = []
    for i in range(n):
        media = []
        if with_media:
            Image.new("RGB", (4, 3), rgb(i)).save(root / "cond" / f"{i}.png")
            media = [{"type": "image", "path": f"cond/{i}.png"}]
        Image.new("RGB", (8, 8), (i, 0, 0)).save(root / "targets" / f"{i}.png")
        target = {"media": [{"type": "image", "path": f"targets/{i}.png"}]}
        lines.append(json.dumps({"schema_version": 2, "input": {"prompt": f"prompt {i}", "media": media},
                                 "supervision": {"type": "demonstration", "target": target}}))  # fmt: skip
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    (root / "test.txt").write_text("eval a\neval b\neval c\n")
    return root


def source(root: Path, split: str = "train", name: str = "d") -> ConditionSource:
    cfg = DatasetConfig(name=name, dataset_dir=str(root), eval={})
    return ConditionSource(name, split, cfg.root, split_file(cfg, split), load_split(cfg, split, "sft"))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dataset")
    parser.add_argument("cache_dir")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--log")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--dist", nargs=4, metavar=("MODE", "RANK", "WORLD", "INIT"))
    parser.add_argument("--barrier", nargs=2, metavar=("DIR", "N"))
    args = parser.parse_args(argv)
    group, parallelism = BuildGroup(), "local"
    if args.dist:
        import torch.distributed as dist

        parallelism, rank, world, init = args.dist[0], int(args.dist[1]), int(args.dist[2]), args.dist[3]
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
        if parallelism == "global":  # one node of `world` ranks
            group = BuildGroup(rank, world, rank, world, 0)
        else:  # `world` nodes of one rank each
            group = BuildGroup(rank, world, 0, 1, rank)
    # The class as the tests import it (its qualified name is part of the cache identity), not __main__'s copy.
    from cache_helpers import HashAdapter as Imported

    if args.barrier:
        ready, n = Path(args.barrier[0]), int(args.barrier[1])
        ready.mkdir(parents=True, exist_ok=True)
        (ready / f"{os.getpid()}.ready").touch()
        deadline = time.monotonic() + 120
        while len(list(ready.glob("*.ready"))) < n:
            if time.monotonic() > deadline:
                raise SystemExit(f"barrier {ready}: {n} helpers never got ready")
            time.sleep(0.01)

    result = open_or_build(source(Path(args.dataset)), Imported(args.delay, args.log), cache_dir=args.cache_dir,
                           batch_size=args.batch_size, group=group, parallelism=parallelism)  # fmt: skip
    rows = [result.conditions[i] for i in range(len(result.conditions))]  # every row read (and its id checked)
    print("reused" if result.reused else "built", result.path, len(rows), flush=True)
    if args.dist:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
