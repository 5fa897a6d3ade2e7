"""The remote-reward protocol, version 1: JSON over HTTP, media inlined as base64 tensors.

A reward served by ``ff rewards serve`` (:mod:`ff_core.rewards.serve`) and scored through the ``remote`` reward
(:mod:`ff_core.rewards.remote`) — the way Flow-GRPO and Flow-Factory run GenEval and large judges in their own
environments — speaks this:

``GET {url}/info`` answers ``{"version": 1, "name": ..., "kind": "pointwise"|"groupwise", "media_types": [...],
"required_fields": [...], "args": {...}}``.

``POST {url}/score`` sends ``{"version": 1, "reward": name|null, "prompts": [str], "metadata": [{...}],
"groups": [int]|null, "outputs": [{"type": "image", "rate": null}], "media": [[tensor, ...], ...]}`` — one ``media``
row per sample, one tensor per entry of ``outputs`` — and gets ``{"scores": [float, ...]}`` (one per sample) or, with
HTTP 400/500, ``{"error": message}``. A tensor is ``{"dtype": "uint8", "shape": [3, H, W], "encoding": "raw"|"png",
"data": base64}``: ``raw`` is the C-order little-endian bytes of the tensor, ``png`` a lossless PNG of a uint8
(3, H, W) image. The media are in the request, so client and server share no filesystem; nothing is pickled
(flow_grpo's servers unpickle requests, which runs whatever code the sender chose).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ff_core.rewards.base import GROUPWISE, POINTWISE, Reward, RewardBatch

PROTOCOL_VERSION = 1
DTYPES = {
    "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64,
    "bool": torch.bool,
}  # fmt: skip
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ENCODINGS = ("raw", "png")
MEDIA_KINDS = ("image", "video", "audio")
MAX_DIMS = 8


class ProtocolError(ValueError):
    """A request or an answer that breaks the protocol; the message names the field (``media[3][0].shape``)."""


# -- tensors ----------------------------------------------------------------------------------------------------
def encode_tensor(x: Tensor, encoding: str = "raw") -> dict[str, Any]:
    """One tensor as JSON: ``png`` for a uint8 (3, H, W) image when asked, otherwise its raw bytes."""
    x = x.detach().cpu().contiguous()
    if x.dtype not in DTYPE_NAMES:
        raise ProtocolError(f"cannot send a {x.dtype} tensor; dtypes: {', '.join(DTYPES)}")
    if encoding == "png" and x.dtype == torch.uint8 and x.dim() == 3 and x.shape[0] == 3:
        from PIL import Image

        buffer = io.BytesIO()
        Image.fromarray(x.permute(1, 2, 0).numpy()).save(buffer, format="PNG", compress_level=1)
        data, encoding = buffer.getvalue(), "png"
    else:
        _check_byte_order()
        data, encoding = x.reshape(-1).view(torch.uint8).numpy().tobytes(), "raw"
    return {"dtype": DTYPE_NAMES[x.dtype], "shape": list(x.shape), "encoding": encoding,
            "data": base64.b64encode(data).decode("ascii")}  # fmt: skip


def decode_tensor(item: Any, where: str) -> Tensor:
    """The tensor :func:`encode_tensor` wrote; a malformed entry raises :class:`ProtocolError` naming ``where``."""
    if not isinstance(item, dict):
        raise ProtocolError(f"{where}: expected {{dtype, shape, encoding, data}}, found {type(item).__name__}")
    dtype = DTYPES.get(item.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise ProtocolError(f"{where}.dtype: expected one of {', '.join(DTYPES)}, found {item.get('dtype')!r}")
    shape = item.get("shape")
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise ProtocolError(f"{where}.shape: expected a list of at most {MAX_DIMS} sizes >= 0, found {shape!r}")
    encoding = item.get("encoding", "raw")
    if encoding not in ENCODINGS:
        raise ProtocolError(f"{where}.encoding: expected one of {', '.join(ENCODINGS)}, found {encoding!r}")
    try:
        data = base64.b64decode(item.get("data", ""), validate=True)
    except (binascii.Error, TypeError, ValueError) as exc:
        raise ProtocolError(f"{where}.data: not base64 ({exc})") from None
    if encoding == "png":
        return _decode_png(data, dtype, shape, where)
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if len(data) != expected:
        raise ProtocolError(f"{where}.data: {len(data)} bytes, but a {item['dtype']} tensor of shape {shape} has "
                            f"{expected}")  # fmt: skip
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    _check_byte_order()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _check_byte_order() -> None:
    # The wire order is little-endian, the host's own on every platform PyTorch ships wheels for; a big-endian host
    # would need a byte swap per element, which nothing here needs yet.
    if sys.byteorder != "little":
        raise ProtocolError("raw tensors are little-endian; this host is big-endian (use encoding: png for images)")


def _decode_png(data: bytes, dtype: torch.dtype, shape: list[int], where: str) -> Tensor:
    from PIL import Image, UnidentifiedImageError

    if dtype != torch.uint8 or len(shape) != 3 or shape[0] != 3:
        raise ProtocolError(f"{where}: png carries a uint8 (3, H, W) image, found {DTYPE_NAMES[dtype]} {shape}")
    try:
        image = Image.open(io.BytesIO(data)).convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ProtocolError(f"{where}.data: not a PNG image ({exc})") from None
    if [image.height, image.width] != shape[1:]:
        raise ProtocolError(f"{where}: the PNG is {image.width}x{image.height}, but shape says {shape}")
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    return pixels.view(image.height, image.width, 3).permute(2, 0, 1).contiguous()


# -- requests ---------------------------------------------------------------------------------------------------
def encode_request(
    batch: RewardBatch, indices: Sequence[int], media_types: Sequence[str], reward: str | None,
    groups: bool, encoding: str = "raw",
) -> dict[str, Any]:  # fmt: skip
    """The ``/score`` request for the samples ``indices`` of ``batch``: only the outputs whose kind the reward
    scores travel (a video+audio sample scored for its audio sends the audio), in the contract's order.

    Args:
        batch: the samples.
        indices: which of them, in order.
        media_types: the kinds the served reward scores.
        reward: the served reward's name (the server refuses another), or ``None``.
        groups: send the group ids (groupwise rewards).
        encoding: ``raw`` or ``png`` (images).
    """
    keep = [i for i, kind in enumerate(batch.output_types) if kind in media_types]
    if not keep:
        batch.output_index(media_types, reward or "remote")  # raises, naming both sides
    ids = batch.group_ids()
    return {
        "version": PROTOCOL_VERSION,
        "reward": reward,
        "prompts": [batch.prompts[i] for i in indices],
        "metadata": [batch.metadata[i] for i in indices],
        "groups": [int(ids[i]) for i in indices] if groups else None,
        "outputs": [{"type": batch.output_types[k], "rate": batch.rates[k]} for k in keep],
        "media": [[encode_tensor(batch.media[i][k], encoding) for k in keep] for i in indices],
    }


def decode_request(request: Any) -> RewardBatch:
    """The :class:`RewardBatch` a ``/score`` request describes; anything malformed raises :class:`ProtocolError`."""
    if not isinstance(request, dict):
        raise ProtocolError(f"the request must be a JSON object, found {type(request).__name__}")
    check_version(request.get("version"), "the request")
    prompts, metadata, media = request.get("prompts"), request.get("metadata"), request.get("media")
    if not isinstance(media, list):
        raise ProtocolError(f"media: expected a list (one row per sample), found {type(media).__name__}")
    n = len(media)
    if not isinstance(prompts, list) or len(prompts) != n or not all(isinstance(p, str) for p in prompts):
        raise ProtocolError(f"prompts: expected {n} strings (one per media row), found {_short(prompts)}")
    if not isinstance(metadata, list) or len(metadata) != n or not all(isinstance(m, dict) for m in metadata):
        raise ProtocolError(f"metadata: expected {n} objects (one per media row), found {_short(metadata)}")
    outputs = request.get("outputs")
    if not isinstance(outputs, list) or not outputs:
        raise ProtocolError(f"outputs: expected a non-empty list of {{type, rate}}, found {_short(outputs)}")
    types, rates = [], []
    for j, out in enumerate(outputs):
        kind, rate = (out.get("type"), out.get("rate")) if isinstance(out, dict) else (None, None)
        if kind not in MEDIA_KINDS:
            raise ProtocolError(f"outputs[{j}].type: expected one of {', '.join(MEDIA_KINDS)}, found {kind!r}")
        if rate is not None and not _is_number(rate):
            raise ProtocolError(f"outputs[{j}].rate: expected a number or null, found {rate!r}")
        types.append(kind)
        rates.append(None if rate is None else float(rate))
    rows = []
    for i, row in enumerate(media):
        if not isinstance(row, list) or len(row) != len(outputs):
            raise ProtocolError(f"media[{i}]: expected {len(outputs)} tensors (one per output), found {_short(row)}")
        rows.append([decode_tensor(t, f"media[{i}][{j}]") for j, t in enumerate(row)])
    groups = request.get("groups")
    if groups is not None:
        if not isinstance(groups, list) or len(groups) != n or not all(_is_int(g) for g in groups):
            raise ProtocolError(f"groups: expected null or {n} integers, found {_short(groups)}")
        groups = torch.tensor(groups, dtype=torch.long)
    return RewardBatch(rows, prompts, metadata, groups, tuple(types), tuple(rates))


def check_version(version: Any, what: str) -> None:
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"{what} speaks remote-reward protocol version {version!r}; this ff speaks "
                            f"{PROTOCOL_VERSION}")  # fmt: skip


# -- answers ----------------------------------------------------------------------------------------------------
def reward_info(reward: Reward, args: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``/info`` answer describing a served reward (read from the instance: an instance may narrow its
    class's attributes)."""
    return {"version": PROTOCOL_VERSION, "name": reward.name, "kind": reward.kind,
            "media_types": list(reward.media_types), "required_fields": list(reward.required_fields),
            "args": args or {}}  # fmt: skip


def parse_info(info: Any) -> dict[str, Any]:
    """Check an ``/info`` answer; returns it. Raises :class:`ProtocolError` saying what is wrong."""
    if not isinstance(info, dict):
        raise ProtocolError(f"/info must answer a JSON object, found {_short(info)}")
    check_version(info.get("version"), "the server")
    if not isinstance(info.get("name"), str):
        raise ProtocolError(f"/info: 'name' must be a string, found {info.get('name')!r}")
    if info.get("kind") not in (POINTWISE, GROUPWISE):
        raise ProtocolError(f"/info: 'kind' must be {POINTWISE!r} or {GROUPWISE!r}, found {info.get('kind')!r}")
    media = info.get("media_types")
    if not isinstance(media, list) or not media or not all(m in MEDIA_KINDS for m in media):
        raise ProtocolError(f"/info: 'media_types' must be a non-empty list of {', '.join(MEDIA_KINDS)}, "
                            f"found {media!r}")  # fmt: skip
    fields = info.get("required_fields", [])
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
        raise ProtocolError(f"/info: 'required_fields' must be a list of strings, found {fields!r}")
    return info


def parse_scores(answer: Any, n: int) -> list[float]:
    """The ``scores`` of a ``/score`` answer for ``n`` samples: exactly ``n`` finite numbers, else
    :class:`ProtocolError` saying what came instead."""
    scores = answer.get("scores") if isinstance(answer, dict) else None
    if not isinstance(scores, list):
        raise ProtocolError(f"the answer has no 'scores' list: {_short(answer)}")
    if len(scores) != n:
        raise ProtocolError(f"the answer has {len(scores)} scores for {n} samples")
    for i, s in enumerate(scores):
        if not _is_number(s) or not math.isfinite(s):
            raise ProtocolError(f"score {i} is {s!r}, not a finite number")
    return [float(s) for s in scores]


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _short(x: Any, limit: int = 200) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[:limit] + "..."
