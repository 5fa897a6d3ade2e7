"""What a dataset is: split files read into validated, normalised records, and the folders they come from.

- :mod:`~ff_core.data.records.base` — the row types (:class:`MediaItem`, :class:`Record`) and strict field readers;
- :mod:`~ff_core.data.records.v2` — strict V2 supervised records; :mod:`~ff_core.data.records.legacy` — legacy
  generation rows; :mod:`~ff_core.data.records.jsonl` — reading split files (JSONL, ``prompts.txt``);
- :mod:`~ff_core.data.records.sources` — ``data.datasets``: dataset folders, split files, path resolution;
- :mod:`~ff_core.data.records.validation` — records against the selected adapter's IO contract.

The names below are this package's API (the reading functions and the row types), importable from here.
"""

from ff_core.data.records.base import (
    CANDIDATE_FIELDS,
    SUPERVISION_FOR_TRAINER,
    FieldReader,
    MediaItem,
    Record,
    Schema,
    Supervision,
)
from ff_core.data.records.jsonl import read_jsonl, read_prompts_txt, scan_jsonl, supervision_errors
from ff_core.data.records.legacy import parse_legacy_row, parse_reference
from ff_core.data.records.v2 import parse_v2_media, parse_v2_record

__all__ = [
    "CANDIDATE_FIELDS",
    "SUPERVISION_FOR_TRAINER",
    "FieldReader",
    "MediaItem",
    "Record",
    "Schema",
    "Supervision",
    "parse_legacy_row",
    "parse_reference",
    "parse_v2_media",
    "parse_v2_record",
    "read_jsonl",
    "read_prompts_txt",
    "scan_jsonl",
    "supervision_errors",
]
