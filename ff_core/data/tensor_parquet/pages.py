"""Direct reads of a flat ``BYTE_ARRAY`` column chunk's values (the tensors' ``_bytes``) from its Parquet pages.

Decoding a ``_bytes`` column through pyarrow copies every value into a fresh Arrow buffer, and, for dictionary-encoded
chunks (pyarrow's default, and what the card's reference writer produces), builds the column a second time from the
dictionary. Neither copy is needed to hand out a tensor: a PLAIN value is a 4-byte length and the raw bytes. This
module walks a chunk's pages (Parquet format spec: PageHeader, DataPageHeader/V2, DictionaryPageHeader; Thrift
compact protocol) and returns, per row of the row group, where its value lies:

* uncompressed pages: a range of the file itself (nothing copied yet: the reader ``pread`` s it into the tensor);
* compressed pages: inside the page decompressed by ``pyarrow.decompress`` (the one unavoidable copy).

Supported: data pages v1 and v2, PLAIN and (RLE_/PLAIN_)DICTIONARY encodings, an optional or required flat column
(definition levels 0..1, no repetition), no codec or snappy, zstd, gzip (:data:`CODECS`). Anything else, and anything
inconsistent (a header field of the wrong type or out of range, a length past its page, a page past its chunk, an
uncompressed size other than the codec's), raises :class:`Unsupported`: the caller then decodes the chunk through
pyarrow, which reads it or names the damage. The bytes of a value are never interpreted here; the reader checks
them against ``_shape`` and ``_dtype`` as before. ``tests/data/test_tensor_parquet_pages.py`` compares both paths,
on damaged files too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

# Parquet enums (parquet.thrift): page types, encodings.
DATA_PAGE, INDEX_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = 0, 1, 2, 3
PLAIN, PLAIN_DICTIONARY, RLE, RLE_DICTIONARY = 0, 2, 3, 8
# Column-chunk codecs ff inflates itself (``pyarrow.decompress``, one block), by the name pyarrow's metadata gives
# them: those whose true uncompressed size can be checked against the page header's, since pyarrow.decompress pads a
# short result with zeros. zstd fails on a mismatch itself; snappy states the size in its preamble; gzip in its
# trailer (ISIZE). Brotli and LZ4 state none: their pages are left to pyarrow, which checks.
CODECS = {"SNAPPY": "snappy", "ZSTD": "zstd", "GZIP": "gzip"}

Value = tuple[pa.Buffer, int, int] | None  # (buffer, start, length) of one row's value; None for a null


class Unsupported(Exception):
    """The chunk is not one this module reads (or is inconsistent): decode it through pyarrow instead."""


def chunk_values(file: pa.Buffer, chunk: pq.ColumnChunkMetaData, max_def: int, rows: int) -> list[Value]:
    """Where each of the ``rows`` values of a flat ``BYTE_ARRAY`` column chunk lies.

    Args:
        file: the whole file (a memory-mapped buffer: uncompressed values are returned as slices of it).
        chunk: the column chunk's metadata.
        max_def: the column's maximum definition level (0 required, 1 optional).
        rows: rows in the row group.

    Raises:
        Unsupported: see the module docstring.
    """
    if chunk.physical_type != "BYTE_ARRAY" or max_def > 1:
        raise Unsupported(f"{chunk.physical_type} column with max definition level {max_def}")
    codec = None if chunk.compression == "UNCOMPRESSED" else CODECS.get(chunk.compression)
    if codec is None and chunk.compression != "UNCOMPRESSED":
        raise Unsupported(f"codec {chunk.compression}")
    start = chunk.data_page_offset
    if chunk.has_dictionary_page and 0 < chunk.dictionary_page_offset < start:
        start = chunk.dictionary_page_offset
    end = start + chunk.total_compressed_size
    if start < 0 or end > file.size:
        raise Unsupported("column chunk outside the file")
    view = _bytes_of(file)
    global_limit = chunk.total_uncompressed_size  # no page inflates past its whole chunk (a damaged size would)
    out: list[Value] = []
    dictionary: list[Value] | None = None
    pos = start
    try:
        while len(out) < rows and pos < end:
            header, body = read_struct(view, pos)
            size = _int(header, 3, end - body)
            kind = _int(header, 1, DATA_PAGE_V2)
            if kind == DICTIONARY_PAGE:
                info = _struct(header, 7)
                if _int(info, 2, RLE_DICTIONARY, PLAIN) not in (PLAIN, PLAIN_DICTIONARY):
                    raise Unsupported("dictionary page not PLAIN")
                page = _inflate(file, body, size, _int(header, 2, global_limit), codec)
                count = _int(info, 1, len(page) // 4)  # a value takes at least its 4-byte length
                if codec is None:  # values stay in the file
                    dictionary = _plain_values(view, file, count, body, body + size)
                else:
                    dictionary = _plain_values(_bytes_of(page), page, count, 0, len(page))
            elif kind == DATA_PAGE:
                out += _data_page_v1(file, view, header, body, size, codec, max_def, dictionary, global_limit,
                                     rows - len(out))
            elif kind == DATA_PAGE_V2:
                out += _data_page_v2(file, view, header, body, size, codec, max_def, dictionary, global_limit,
                                     rows - len(out))
            elif kind != INDEX_PAGE:
                raise Unsupported(f"page type {kind}")
            pos = body + size
    except (IndexError, ValueError, OSError, pa.ArrowException) as exc:  # a codec's error is an OSError
        raise Unsupported(f"unreadable page: {exc}") from None
    if len(out) != rows:
        raise Unsupported(f"{len(out)} values for {rows} rows")
    return out


def _int(struct_: dict, key: int, most: int, default: int | None = None) -> int:
    """Field ``key`` of a parsed header: an integer from 0 to ``most`` (a damaged header fails here, not later)."""
    value = struct_.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= most:
        raise Unsupported(f"page header field {key}: {value!r}, expected 0..{most}")
    return value


def _struct(struct_: dict, key: int) -> dict:
    value = struct_.get(key)
    if not isinstance(value, dict):
        raise Unsupported(f"page header field {key}: {value!r}, expected a struct")
    return value


def _inflate(file: pa.Buffer, body: int, size: int, raw_size: int, codec: str | None) -> pa.Buffer:
    """A page's data: a slice of the file when uncompressed, else the page decompressed to ``raw_size`` bytes (one
    copy; callers bound ``raw_size`` by the chunk's uncompressed size, so a damaged header cannot ask for more)."""
    if codec is None:
        return file.slice(body, size)
    stated, expected = raw_size, raw_size  # zstd checks itself
    if codec == "snappy":
        stated = varint(_bytes_of(file.slice(body, min(size, 10))), 0)[0]
    elif codec == "gzip":
        stated, expected = int.from_bytes(file.slice(body + size - 4, 4).to_pybytes(), "little"), raw_size % (1 << 32)
    if stated != expected:
        raise Unsupported(f"page states {stated} bytes uncompressed, its header {raw_size}")
    return pa.decompress(file.slice(body, size), decompressed_size=raw_size, codec=codec, asbytes=False)


def _data_page_v1(file: pa.Buffer, view: memoryview, header: dict, body: int, size: int, codec: str | None,
                  max_def: int, dictionary: list[Value] | None, limit: int, rows_left: int) -> list[Value]:
    info = _struct(header, 5)
    count = _int(info, 1, rows_left)  # a flat column's page holds one value per row
    page = _inflate(file, body, size, _int(header, 2, limit), codec)
    # Offsets below are inside `page`; an uncompressed page is the file itself, shifted by `body`.
    data, base = (view, body) if codec is None else (_bytes_of(page), 0)
    pos, levels = base, None
    if max_def:
        if _int(info, 3, RLE_DICTIONARY, RLE) != RLE:
            raise Unsupported("definition levels not RLE")
        n = int.from_bytes(data[pos: pos + 4], "little")
        if pos + 4 + n > base + len(page):
            raise Unsupported("definition levels past the end of their page")
        levels = hybrid(data[pos + 4: pos + 4 + n], 1, count)
        pos += 4 + n
    buffer = file if codec is None else page
    return _values(data, buffer, pos, base + len(page), _int(info, 2, 9, PLAIN), count, levels, dictionary)


def _data_page_v2(file: pa.Buffer, view: memoryview, header: dict, body: int, size: int, codec: str | None,
                  max_def: int, dictionary: list[Value] | None, limit: int, rows_left: int) -> list[Value]:
    info = _struct(header, 8)
    count, def_len = _int(info, 1, rows_left), _int(info, 5, size, 0)
    _int(info, 6, 0, 0)  # no repetition levels in a flat column
    encoding = _int(info, 4, 9, PLAIN)
    # Levels are never compressed in a v2 page; the values after them are unless is_compressed is false.
    levels = hybrid(view[body: body + def_len], 1, count) if max_def else None
    values_at, values_size = body + def_len, size - def_len
    if codec is None or info.get(7, True) is False:
        return _values(view, file, values_at, values_at + values_size, encoding, count, levels, dictionary)
    page = _inflate(file, values_at, values_size, _int(header, 2, limit) - def_len, codec)
    return _values(_bytes_of(page), page, 0, len(page), encoding, count, levels, dictionary)


def _values(data: memoryview, buffer: pa.Buffer, pos: int, end: int, encoding: int, count: int,
            levels: list[int] | None, dictionary: list[Value] | None) -> list[Value]:
    """The ``count`` values of a data page whose encoded values start at ``data[pos]``; nulls where a level is 0."""
    if levels is not None and any(level > 1 for level in levels):
        raise Unsupported("definition level above 1 in a flat column")
    present = count if levels is None else sum(levels)
    if encoding == PLAIN:
        found = _plain_values(data, buffer, present, pos, end)
    elif encoding in (RLE_DICTIONARY, PLAIN_DICTIONARY):
        if dictionary is None:
            raise Unsupported("dictionary-encoded page without a dictionary page")
        indices = hybrid(data[pos + 1: end], data[pos], present) if present else []
        if any(k >= len(dictionary) for k in indices):
            raise Unsupported("dictionary index out of range")
        found = [dictionary[k] for k in indices]
    else:
        raise Unsupported(f"encoding {encoding}")
    if levels is None or present == count:
        return found
    values = iter(found)
    return [next(values) if level else None for level in levels]


def _plain_values(data: memoryview, buffer: pa.Buffer, count: int, pos: int, end: int) -> list[Value]:
    """``count`` PLAIN ``BYTE_ARRAY`` values (4-byte little-endian length, then the bytes) from ``data[pos]`` up to
    ``data[end]``; positions in ``data`` are positions in ``buffer``."""
    out: list[Value] = []
    for _ in range(count):
        n = int.from_bytes(data[pos: pos + 4], "little")
        if pos + 4 + n > end:
            raise Unsupported("value past the end of its page")
        out.append((buffer, pos + 4, n))
        pos += 4 + n
    return out


def hybrid(data: memoryview, width: int, count: int) -> list[int]:
    """``count`` values of Parquet's RLE / bit-packed hybrid encoding of ``width``-bit integers (no length prefix)."""
    out: list[int] = []
    pos, nbytes = 0, (width + 7) // 8
    while len(out) < count:
        header, pos = varint(data, pos)
        if header & 1:  # bit-packed: (header >> 1) groups of 8 values, little-endian bit order
            size = (header >> 1) * width
            raw = np.frombuffer(data[pos: pos + size], dtype=np.uint8)
            if len(raw) != size or not size:
                raise Unsupported("bit-packed run past its data")
            bits = np.unpackbits(raw, bitorder="little").reshape(-1, width)
            out += (bits @ (1 << np.arange(width, dtype=np.int64))).tolist()
            pos += size
        else:  # run: (header >> 1) repeats of one value
            if header < 2 or pos + nbytes > len(data):
                raise Unsupported("empty run, or a run past its data")
            out += [int.from_bytes(data[pos: pos + nbytes], "little")] * min(header >> 1, count - len(out))
            pos += nbytes
    return out[:count]


# Thrift compact protocol (thrift/doc/specs/thrift-compact-protocol.md): just enough to read a page header.
def varint(data: Any, pos: int) -> tuple[int, int]:
    """An unsigned LEB128 varint at ``data[pos]``; returns it and the position after it."""
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise Unsupported("varint too long")


def _zigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def _read_value(data: Any, pos: int, kind: int, depth: int) -> tuple[Any, int]:
    if kind in (1, 2):  # booleans live in the field header
        return kind == 1, pos
    if kind == 3:
        return data[pos], pos + 1
    if kind in (4, 5, 6):
        n, pos = varint(data, pos)
        return _zigzag(n), pos
    if kind == 7:
        return None, pos + 8  # no double in a page header ff reads
    if kind == 8:
        n, pos = varint(data, pos)
        return None, pos + n  # binary fields of a page header (statistics) are skipped unread
    if kind in (9, 10):
        head = data[pos]
        pos += 1
        n, elem = head >> 4, head & 0x0F
        if n == 15:
            n, pos = varint(data, pos)
        for _ in range(n):
            _, pos = (None, pos + 1) if elem in (1, 2) else _read_value(data, pos, elem, depth + 1)
        return None, pos  # no list in a page header ff reads
    if kind == 11:
        n, pos = varint(data, pos)
        if n:
            types = data[pos]
            pos += 1
            for _ in range(n):
                _, pos = _read_value(data, pos, types >> 4, depth + 1)
                _, pos = _read_value(data, pos, types & 0x0F, depth + 1)
        return None, pos
    if kind == 12:
        return read_struct(data, pos, depth + 1)
    raise Unsupported(f"thrift type {kind}")


def read_struct(data: Any, pos: int, depth: int = 0) -> tuple[dict[int, Any] | None, int]:
    """A Thrift compact struct at ``data[pos]`` as ``{field id: value}``; returns it and the position after it.

    Only the page header and the page-type header inside it are kept (``depth`` 0 and 1); deeper structs (the
    statistics) are skipped without building them.
    """
    out: dict[int, Any] | None = {} if depth < 2 else None
    field = 0
    while True:
        head = data[pos]
        pos += 1
        if head == 0:
            return out, pos
        kind, delta = head & 0x0F, head >> 4
        if delta:
            field += delta
        else:
            n, pos = varint(data, pos)
            field = _zigzag(n)
        value, pos = _read_value(data, pos, kind, depth)
        if out is not None:
            out[field] = value


def _bytes_of(buffer: pa.Buffer) -> memoryview:
    # An Arrow buffer exports signed chars ("b"): index it as unsigned bytes.
    return memoryview(buffer).cast("B")
