"""``data.bad_samples: skip``: the samples training left out, listed in the run folder and counted, never silently.

Each skipped sample is one JSON line of ``<run dir>/bad_samples.jsonl`` (``trainer.log_dir``: the logger's version
folder, else ``trainer.default_root_dir``) and one warning on the console::

    {"step": 7, "rank": 0, "path": "data/train.jsonl", "line": 4, "field": "supervision.target.media[0].path",
     "reason": "data/images/00003.png: cannot decode image: image file is truncated",
     "error": "data/train.jsonl:4: supervision.target.media[0].path: data/images/00003.png: ..."}

``step`` is the loader's delivery number of the batch the sample was left out of (resumed runs count on from the
checkpoint, so a batch delivered again after a resume is listed again with the same step). Every rank appends its
own lines (one ``write`` of one line to a file opened for appending: lines of different ranks do not interleave).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FILENAME = "bad_samples.jsonl"


class BadSampleLog:
    """``on_bad_samples`` of :class:`~ff_core.data.dataflow.DataflowLoader` under ``bad_samples="skip"``.

    Args:
        folder: the run folder; the list is ``folder / bad_samples.jsonl``.
        rank: the global rank, recorded on each line.
    """

    def __init__(self, folder: str | os.PathLike, rank: int = 0) -> None:
        self.path = Path(folder) / FILENAME
        self.rank = rank
        self.count = 0

    def __call__(self, errors: list[Any], step: int) -> None:
        """Append one line per error and warn.

        Args:
            errors: the skipped samples' :class:`~ff_core.errors.DatasetError` s.
            step: the delivery number of their batch.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for err in errors:
            self.count += 1
            entry = {"step": step, "rank": self.rank, "path": getattr(err, "path", None),
                     "line": getattr(err, "line", None), "field": getattr(err, "field", None),
                     "reason": getattr(err, "reason", None), "error": str(err)}  # fmt: skip
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (json.dumps(entry) + "\n").encode())
            finally:
                os.close(fd)
            log.warning("skipped a bad sample (data.bad_samples: skip; %d on rank %d so far, listed in %s): %s",
                        self.count, self.rank, self.path, err)
