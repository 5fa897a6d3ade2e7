"""The ranks that build a condition cache together: their coordinates and the two collectives the build needs.

An injectable object (STYLE 12): the data module builds it from the Lightning trainer; tests pass their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class BuildGroup:
    """Where this process sits among the ranks of the job (global ranks are node-major, as torchrun assigns them).

    Args:
        rank: global rank.
        world_size: number of ranks.
        local_rank: rank on this node.
        local_world_size: ranks per node.
        node_rank: this node's index.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.world_size and 0 <= self.local_rank < self.local_world_size
                and self.world_size % self.local_world_size == 0):  # fmt: skip
            raise ValueError(f"BuildGroup: inconsistent coordinates {self}")

    @classmethod
    def from_trainer(cls, trainer: Any) -> BuildGroup:
        """The coordinates of a Lightning trainer's processes (``num_devices`` ranks on each of ``num_nodes``).

        Args:
            trainer: a ``lightning.pytorch.Trainer`` whose strategy environment is set up.
        """
        world = int(getattr(trainer, "world_size", 1))
        if world == 1:
            return cls()
        local_world = world // max(int(getattr(trainer, "num_nodes", 1)), 1)
        return cls(int(trainer.global_rank), world, int(trainer.local_rank), local_world, int(trainer.node_rank))

    def node_of(self, rank: int) -> int:
        """The node that global rank ``rank`` runs on."""
        return rank // self.local_world_size

    def _distributed(self) -> bool:
        if self.world_size == 1:
            return False
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"BuildGroup: world_size={self.world_size} but torch.distributed is not initialised")
        return True

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order. All ranks must call it together."""
        if not self._distributed():
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank. All ranks must call it together."""
        if not self._distributed():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
