"""Data-parallel and worker coordinates as injectable objects (STYLE 12; spec §6).

A test passes ``DataParallelCoords(rank=r, world_size=w)`` to play every rank in one process; production code
calls :meth:`DataParallelCoords.detect` (explicit DP coordinates > ``parallel_dims`` > ``torch.distributed`` >
``(0, 1)``) or :meth:`DataParallelCoords.from_trainer`, which uses the strategy's data-parallel layout so that
FSDP/TP runs shard by the data-parallel rank, not the global rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.utils.data


@dataclass(frozen=True)
class DataParallelCoords:
    """Where this process sits among the data-parallel replicas.

    Args:
        rank: Data-parallel rank in ``[0, world_size)``.
        world_size: Number of data-parallel replicas.
        group: Process group spanning the data-parallel replicas, used to gather per-rank resume state;
            ``None`` is the default group (or no gathering when ``torch.distributed`` is not initialised).
    """

    rank: int = 0
    world_size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"DataParallelCoords: rank must be in [0, world_size) and world_size >= 1, "
                f"found rank={self.rank}, world_size={self.world_size}"
            )

    @classmethod
    def detect(
        cls, parallel_dims: Any = None, dp_rank: int | None = None, dp_world_size: int | None = None
    ) -> DataParallelCoords:
        """Resolve the coordinates: explicit ``dp_rank``/``dp_world_size`` > ``parallel_dims`` > torch.distributed.

        Args:
            parallel_dims: An object with ``dp_coord`` = ``(rank, world_size)`` or with ``dp_rank`` and
                ``dp_world_size`` attributes (spec §6: FSDP+TP/PP layouts); ``None`` to skip.
            dp_rank: Explicit data-parallel rank (needs ``dp_world_size`` too).
            dp_world_size: Explicit data-parallel world size.
        """
        if (dp_rank is None) != (dp_world_size is None):
            raise ValueError("DataParallelCoords.detect: give both dp_rank and dp_world_size, or neither")
        if dp_rank is not None:
            return cls(int(dp_rank), int(dp_world_size))
        if parallel_dims is not None:
            if hasattr(parallel_dims, "dp_coord"):
                rank, size = parallel_dims.dp_coord
            else:
                rank, size = parallel_dims.dp_rank, parallel_dims.dp_world_size
            return cls(int(rank), int(size), getattr(parallel_dims, "dp_group", None))
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    @classmethod
    def from_trainer(cls, trainer: Any) -> DataParallelCoords:
        """Coordinates of a Lightning trainer: its strategy's ``distributed_sampler_kwargs`` (data-parallel).

        Args:
            trainer: A ``lightning.pytorch.Trainer`` (after its strategy is set up).
        """
        kwargs = getattr(trainer, "distributed_sampler_kwargs", None)
        if not kwargs:
            return cls()
        size = int(kwargs.get("num_replicas", 1))
        # Under a device mesh (ModelParallelStrategy, ff's ContextParallelStrategy) the data-parallel ranks may be a
        # subset of the processes: gathers run over that dimension's group.
        mesh = getattr(getattr(trainer, "strategy", None), "_device_mesh", None)
        group = None
        if mesh is not None and size != trainer.world_size:  # (a group of one rank too: never the default group)
            group = mesh["data_parallel"].get_group()
        return cls(int(kwargs.get("rank", 0)), size, group)

    def all_gather(self, obj: Any) -> list[Any]:
        """Every data-parallel rank's ``obj``, in rank order (just ``[obj]`` without a process group).

        Args:
            obj: A picklable object; all ranks must call this together.
        """
        if self.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            if self.world_size != 1:
                raise RuntimeError(
                    f"DataParallelCoords.all_gather: world_size={self.world_size} but torch.distributed is not "
                    "initialised; gather the per-rank states yourself and merge them with merge_rank_states"
                )
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


@dataclass(frozen=True)
class WorkerCoords:
    """Which DataLoader worker this code runs in.

    Args:
        worker_id: Worker index in ``[0, num_workers)``.
        num_workers: Streams per rank; ``1`` when loading in the main process.
    """

    worker_id: int = 0
    num_workers: int = 1

    @classmethod
    def detect(cls) -> WorkerCoords:
        """From ``torch.utils.data.get_worker_info()``; ``(0, 1)`` in the main process."""
        info = torch.utils.data.get_worker_info()
        if info is None:
            return cls()
        return cls(info.id, info.num_workers)
