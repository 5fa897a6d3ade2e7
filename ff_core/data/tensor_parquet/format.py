"""The tensor-triplet row format: dtypes, encoding and checked decoding of one tensor, and the card's schemas.

Spec: tensor-parquet-dataset-card. A tensor ``name`` is stored as three columns: ``<name>_bytes`` (the raw,
C-contiguous, little-endian buffer), ``<name>_shape`` (a list of ints, per row: a text embedding's length varies)
and ``<name>_dtype`` (a torch dtype name; ``torch.`` prefixes and torch's aliases are accepted, :func:`tensor_dtype`).
The card's own loader maps only three float dtypes; ff decodes every dtype in :data:`TENSOR_DTYPES`, bfloat16 through
torch because numpy has none. The placeholder ``(b"", [], "")`` some scripts write for an absent tensor reads as
``None`` (:func:`is_empty_triplet`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import torch

BYTES, SHAPE, DTYPE = "_bytes", "_shape", "_dtype"
# `<name>_dtype` strings -> torch dtypes. The card writes "float32" / "bfloat16"; the rest are what a latent,
# mask or id column can hold (float8_e4m3fn: the latents of `ff data preprocess-latents --dtype float8_e4m3fn`).
# Itemsizes come from torch (bool is one byte).
TENSOR_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64,
    "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "uint8": torch.uint8, "bool": torch.bool, "float8_e4m3fn": torch.float8_e4m3fn,
}
_DTYPE_NAMES = {v: k for k, v in TENSOR_DTYPES.items()}


def tensor_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype a ``<name>_dtype`` string names, ``None`` if it names none ff stores.

    Writers spell dtypes differently: the card writes ``"bfloat16"``, ``str(tensor.dtype)`` gives ``"torch.bfloat16"``,
    and torch's aliases (``"half"``, ``"float"``, ``"long"``) name the same dtypes; all of them are accepted.
    """
    if not isinstance(name, str):
        return None
    found = getattr(torch, name.removeprefix("torch."), None) if name else None
    return found if isinstance(found, torch.dtype) and found in _DTYPE_NAMES else None


def is_empty_triplet(data_len: int | None, shape: Sequence[int] | None, dtype: str | None) -> bool:
    """Whether a triplet is the placeholder some preprocessing scripts write for an absent tensor: no bytes, an empty
    shape and an empty dtype (``(b"", [], "")``). Readers return ``None`` for it rather than failing."""
    return data_len == 0 and shape is not None and len(shape) == 0 and dtype == ""


def tensor_fields(name: str) -> list[pa.Field]:
    """The triplet fields of one tensor column, typed as the card's reference writer types them.

    Args:
        name: the tensor's name (``vae_latent``).
    """
    return [pa.field(name + BYTES, pa.binary()), pa.field(name + SHAPE, pa.list_(pa.int64())),
            pa.field(name + DTYPE, pa.string())]


def encode_tensor(t: torch.Tensor, name: str | None = None) -> dict[str, Any]:
    """One tensor as its triplet's values: raw bytes (C order), shape list and dtype name.

    Args:
        t: any tensor of a dtype in :data:`TENSOR_DTYPES` (moved to CPU, made contiguous).
        name: the tensor's column name; keys are ``<name>_bytes`` / ``_shape`` / ``_dtype``, or ``bytes`` /
            ``shape`` / ``dtype`` without one.
    """
    if t.dtype not in _DTYPE_NAMES:
        raise ValueError(f"{name or 'tensor'}: dtype {t.dtype} cannot be stored; use one of {sorted(TENSOR_DTYPES)}")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes()  # view(uint8) also covers bfloat16, which numpy lacks
    keys = (name + BYTES, name + SHAPE, name + DTYPE) if name else ("bytes", "shape", "dtype")
    return dict(zip(keys, (data, list(t.shape), _DTYPE_NAMES[t.dtype])))


def tensor_problem(data_len: int | None, shape: Sequence[int] | None, dtype: str | None) -> tuple[str, str] | None:
    """Why a triplet's values cannot be a tensor, as ``(part suffix, reason)``; ``None`` when they can.

    Problems: a null part, an unknown dtype, a negative dimension, a byte count other than prod(shape) x itemsize.

    Args:
        data_len: length of ``<name>_bytes`` (``None``: null).
        shape: the ``<name>_shape`` list (``None``: null).
        dtype: the ``<name>_dtype`` string (``None``: null).
    """
    for part, value in ((BYTES, data_len), (SHAPE, shape), (DTYPE, dtype)):
        if value is None:
            return part, "null value"
    dt = tensor_dtype(dtype)
    if dt is None:
        return DTYPE, f"unknown dtype {dtype!r}; expected one of {', '.join(TENSOR_DTYPES)}"
    if not isinstance(shape, (list, tuple)) or any(not isinstance(d, int) or d < 0 for d in shape):
        return SHAPE, f"shape {shape!r} is not a list of non-negative integers"
    itemsize = dt.itemsize
    expected = math.prod(shape) * itemsize
    if data_len != expected:
        return BYTES, f"{data_len} bytes, expected prod({list(shape)}) x {itemsize} ({dtype}) = {expected}"
    return None


def decode_buffer(buf: Any, offset: int, shape: Sequence[int], dtype: str) -> torch.Tensor:
    """A tensor viewing ``buf[offset : offset + prod(shape) * itemsize]`` (checked beforehand); a copy if misaligned.

    The tensor shares memory with ``buf`` (an Arrow buffer: immutable) and keeps it alive; writing into it in place
    would change the decoded data under every other view, so callers clone before in-place edits.
    """
    dt = tensor_dtype(dtype)
    count = math.prod(shape)
    if count == 0:
        return torch.empty(tuple(shape), dtype=dt)
    address = getattr(buf, "address", None)
    if address is not None and (address + offset) % dt.itemsize:
        # A value inside a Parquet page sits wherever the page put it: never view misaligned memory (compiled
        # kernels may assume alignment); copy it once, as bytes (always aligned), into memory torch owns.
        out = torch.empty(count * dt.itemsize, dtype=torch.uint8)
        out.copy_(_frombuffer(buf, torch.uint8, count * dt.itemsize, offset))
        return out.view(dt).view(tuple(shape))
    return _frombuffer(buf, dt, count, offset).view(tuple(shape))


def _frombuffer(buf: Any, dt: torch.dtype, count: int, offset: int) -> torch.Tensor:
    if isinstance(buf, pa.Buffer):  # torch cannot take an Arrow buffer over a read-only mmap; a memoryview it can
        buf = memoryview(buf)
    with warnings.catch_warnings():  # Arrow buffers are read-only; torch warns once per process about that
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(buf, dtype=dt, count=count, offset=offset)


def tensor_schema(scalars: Mapping[str, pa.DataType], tensors: Sequence[str]) -> pa.Schema:
    """A schema of ``id``-style scalar columns followed by one triplet per tensor (any adapter's layout).

    Args:
        scalars: scalar column names and their Arrow types, in column order.
        tensors: tensor names, in column order.
    """
    clash = [n for n in scalars if n.endswith((BYTES, SHAPE, DTYPE))]
    if clash:
        raise ValueError(f"scalar column {clash[0]!r} ends like a tensor part ({BYTES}, {SHAPE}, {DTYPE})")
    fields = [pa.field(n, t) for n, t in scalars.items()] + [f for n in tensors for f in tensor_fields(n)]
    return pa.schema(fields)


# The card's scalar columns; FastVideo's reference schemas put `id` first and the metadata after the tensors.
_META: dict[str, pa.DataType] = {
    "file_name": pa.string(), "caption": pa.string(), "media_type": pa.string(), "width": pa.int64(),
    "height": pa.int64(), "num_frames": pa.int64(), "duration_sec": pa.float64(), "fps": pa.float64(),
}
_T2V_TENSORS = ("vae_latent", "text_embedding")
_I2V_TENSORS = (*_T2V_TENSORS, "clip_feature", "first_frame_latent")
_TRACK_TENSORS = (*_I2V_TENSORS, "track_points", "track_visibility", "object_ids", "track_weights")


def _card_schema(tensors: Sequence[str]) -> pa.Schema:
    fields = [pa.field("id", pa.string())] + [f for n in tensors for f in tensor_fields(n)]
    return pa.schema(fields + [pa.field(n, t) for n, t in _META.items()])


T2V_SCHEMA: pa.Schema = _card_schema(_T2V_TENSORS)
I2V_SCHEMA: pa.Schema = _card_schema(_I2V_TENSORS)
# The card's `pyarrow_schema_i2v_track`: 9 scalars + 8 tensors x 3 = 33 columns.
I2V_TRACK_SCHEMA: pa.Schema = _card_schema(_TRACK_TENSORS)


def split_schema(schema: pa.Schema) -> tuple[tuple[str, ...], tuple[str, ...], list[tuple[str, str]]]:
    """Tensor names, scalar names, and ``(column, problem)`` for each incomplete triplet, from a schema.

    A column is a tensor part when it ends in ``_bytes``, or in ``_shape`` / ``_dtype`` beside a ``_bytes`` or with
    the part's type (list / string); every other column is a scalar.
    """
    names = schema.names
    tensors = [n[: -len(BYTES)] for n in names if n.endswith(BYTES)]
    problems: list[tuple[str, str]] = []
    parts = {t + s for t in tensors for s in (BYTES, SHAPE, DTYPE)}
    for t in tensors:
        for suffix in (SHAPE, DTYPE):
            if t + suffix not in names:
                problems.append((t + suffix, f"tensor {t!r} has {t}{BYTES} but no {t}{suffix} column"))
    orphans = [n for n in names if n not in parts and _looks_like_part(schema.field(n))]
    for n in orphans:
        base = n.rsplit("_", 1)[0]
        problems.append((base + BYTES, f"tensor {base!r} has {n} but no {base}{BYTES} column"))
        parts.add(n)
    scalars = tuple(n for n in names if n not in parts)
    return tuple(tensors), scalars, problems


def _looks_like_part(f: pa.Field) -> bool:
    if f.name.endswith(SHAPE):
        return pa.types.is_list(f.type) or pa.types.is_large_list(f.type)
    return f.name.endswith(DTYPE) and (pa.types.is_string(f.type) or pa.types.is_large_string(f.type))


def schema_problems(found: pa.Schema, expected: pa.Schema) -> list[tuple[str, str]]:
    """``(column, problem)`` for each column of ``expected`` that ``found`` lacks or types differently.

    ``binary``/``large_binary``, ``string``/``large_string`` and list widths count as the same type: they decode alike.
    """
    out = []
    for f in expected:
        if f.name not in found.names:
            out.append((f.name, f"missing column (expected {f.type})"))
        elif _family(found.field(f.name).type) != _family(f.type):
            out.append((f.name, f"type {found.field(f.name).type}, expected {f.type}"))
    return out


def _family(t: pa.DataType) -> str:
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "binary"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return f"list<{_family(t.value_type)}>"
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    return str(t)
