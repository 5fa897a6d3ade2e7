"""Tensor-parquet shards (spec: tensor-parquet-dataset-card): tensors stored as ``<name>_bytes`` / ``_shape`` /
``_dtype`` triplets in parquet files below a root.

- :mod:`.format`: dtypes, one tensor's encoding and checked decoding, the card's schemas.
- :mod:`.index`: the row index from the files' footers, cached and invalidated by file size and mtime.
- :mod:`.reader`: :class:`TensorParquetDataset`, map-style random access.
- :mod:`.file_tensor`: :class:`FileTensor`, an uncompressed value as a file range (a worker hands it over; a batch
  reads it in place).
- :mod:`.catalogue`: a file's row catalogue (small columns, values' places), stored for the next process.
- :mod:`.pages`: where a ``_bytes`` column chunk's values lie in its Parquet pages (the reader's direct path).
- :mod:`.writer`: :class:`TensorParquetWriter`, one row per row group, atomic files.
- :mod:`.shuffle`: :func:`two_level_order` for files with many rows per row group.
- :mod:`.inspect`: ``ff data inspect`` / ``validate`` on a root.
"""

from ff_core.data.tensor_parquet.file_tensor import FileTensor
from ff_core.data.tensor_parquet.format import (
    I2V_SCHEMA,
    I2V_TRACK_SCHEMA,
    T2V_SCHEMA,
    TENSOR_DTYPES,
    encode_tensor,
    tensor_fields,
    tensor_schema,
)
from ff_core.data.tensor_parquet.reader import TensorParquetDataset
from ff_core.data.tensor_parquet.shuffle import two_level_order
from ff_core.data.tensor_parquet.writer import TensorParquetWriter

__all__ = [
    "FileTensor", "I2V_SCHEMA", "I2V_TRACK_SCHEMA", "T2V_SCHEMA", "TENSOR_DTYPES", "TensorParquetDataset",
    "TensorParquetWriter", "encode_tensor", "tensor_fields", "tensor_schema", "two_level_order",
]
