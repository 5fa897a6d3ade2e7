"""Composable dataflow: distributor → processor → batcher → collator, sharded, packed, mixed, resumed exactly.

Implements ``spec/composable-dataloader-guide.md`` under ff's names (``DataflowLoader`` for ``CosmosDataLoader``);
see docs/dataflow.md for recipes and the resume guarantees.
"""

from ff_core.groups import check_grouping
from ff_core.seeding import derive_seed

from .base import (
    BatchCollator,
    Cursor,
    DataDistributor,
    IndexedDistributor,
    RawItemProcessor,
    SampleBatcher,
    stream_slot,
)
from .batchers import PoolPackingBatcher, SimpleBatcher, video_token_count
from .buckets import BucketBatcher
from .collators import DefaultBatchCollator, ListBatchCollator
from .coords import DataParallelCoords, WorkerCoords
from .distributors import (
    IterableDistributor,
    MapDistributor,
    RankPartitionedDistributor,
    SamplerDistributor,
    apportion_ranks,
)
from .grouped import GroupedDistributor, GroupedItem
from .joint import JointDataflowLoader
from .lazy import LazyValue, materialize
from .loader import DataflowLoader
from .mixture import MixtureDistributor
from .processors import CallableProcessor, IdentityProcessor
from .sequential import SequentialPackingBatcher
from .state import StateHistory, check_state, merge_rank_states

__all__ = [
    "BatchCollator",
    "BucketBatcher",
    "CallableProcessor",
    "Cursor",
    "DataDistributor",
    "DataParallelCoords",
    "DataflowLoader",
    "DefaultBatchCollator",
    "GroupedDistributor",
    "GroupedItem",
    "IdentityProcessor",
    "IndexedDistributor",
    "IterableDistributor",
    "JointDataflowLoader",
    "LazyValue",
    "ListBatchCollator",
    "MapDistributor",
    "MixtureDistributor",
    "PoolPackingBatcher",
    "RankPartitionedDistributor",
    "RawItemProcessor",
    "SampleBatcher",
    "SamplerDistributor",
    "SequentialPackingBatcher",
    "SimpleBatcher",
    "StateHistory",
    "WorkerCoords",
    "apportion_ranks",
    "check_grouping",
    "check_state",
    "derive_seed",
    "materialize",
    "merge_rank_states",
    "stream_slot",
    "video_token_count",
]
