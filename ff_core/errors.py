"""Errors a user can act on: every message names the file, the 1-based line and the field.

The one-line form is ``path:line: field: reason`` (``path:line: reason`` without a field), the shape compilers
and linters print, so editors can jump to it. A file-level problem (a missing split file, a folder that does
not exist) has no line and prints as ``path: reason`` - no made-up ``:0``. Validation collects every problem of
a file and raises them together as :class:`DatasetErrors`; ``ff data validate`` prints one diagnostic per line,
and :class:`DatasetWarning` s (kept, but worth a look) as ``path:line: warning: field: reason``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable


class DatasetError(ValueError):
    """A problem in a dataset file. ``str(err)`` starts with ``path:line:``.

    Args:
        path: the file the problem is in (for a media file that cannot be decoded: the record's file).
        line: 1-based line (record) number, or ``None`` for a file-level problem.
        field: dotted field path inside the record (``supervision.target.media[0].path``), or ``None``.
        reason: what is wrong, with the found and expected value.

    Attributes:
        path: as given, as a string.
        line: as given.
        field: as given.
        reason: as given.
    """

    def __init__(self, path: str | os.PathLike, line: int | None, field: str | None, reason: str) -> None:
        self.path = os.fspath(path)
        self.line = line
        self.field = field
        self.reason = reason
        super().__init__(self.format())

    @property
    def errors(self) -> list[DatasetError]:
        """This error as a one-element list, so callers can treat one error and many alike."""
        return [self]

    def format(self) -> str:
        """``path:line: field: reason`` (``path:line: reason`` without a field; ``path: ...`` without a line)."""
        return f"{self.where}{self.field}: {self.reason}" if self.field else f"{self.where}{self.reason}"

    @property
    def where(self) -> str:
        """``path:line: `` or, for a problem of a whole file or folder, ``path: ``."""
        return f"{self.path}:{self.line}: " if self.line is not None else f"{self.path}: "

    def sort_key(self) -> tuple[str, int, str]:
        return (self.path, self.line or 0, self.field or "")

    def __reduce__(self):  # keep pickling (DataLoader workers) working with the 4-argument constructor
        return (DatasetError, (self.path, self.line, self.field, self.reason))


class DatasetErrors(DatasetError):
    """Several dataset problems collected in one pass (validation reports all of them, not only the first).

    Args:
        errors: the problems, in the order found; nested :class:`DatasetErrors` are flattened.

    Attributes:
        errors: the flattened list; ``path``/``line``/``field``/``reason`` are those of the first one.
    """

    def __init__(self, errors: Iterable[DatasetError]) -> None:
        flat = [leaf for e in errors for leaf in e.errors]
        if not flat:
            raise ValueError("DatasetErrors needs at least one error")
        self._errors = flat
        first = flat[0]
        super().__init__(first.path, first.line, first.field, first.reason)

    @property
    def errors(self) -> list[DatasetError]:
        return self._errors

    def format(self) -> str:
        lines = [e.format() for e in self._errors]
        return "\n".join([f"{len(lines)} dataset errors:", *lines]) if len(lines) > 1 else lines[0]

    def __reduce__(self):
        return (DatasetErrors, (self._errors,))


class DatasetWarning(DatasetError):
    """Something ``ff data validate`` kept but the user should look at (``path:line: warning: field: reason``).

    Same arguments and attributes as :class:`DatasetError`; it is reported, never raised.
    """

    def format(self) -> str:
        what = f"{self.field}: {self.reason}" if self.field else self.reason
        return f"{self.where}warning: {what}"

    def __reduce__(self):
        return (DatasetWarning, (self.path, self.line, self.field, self.reason))


class DatasetNote(DatasetWarning):
    """What ``ff data validate`` reports about a row the adapter accepts as it is but changes on the way in (LTX-2:
    audio shorter than the clip, padded with silence): ``path:line: note: field: reason``. Never raised."""

    def format(self) -> str:
        what = f"{self.field}: {self.reason}" if self.field else self.reason
        return f"{self.where}note: {what}"

    def __reduce__(self):
        return (DatasetNote, (self.path, self.line, self.field, self.reason))


def raise_collected(errors: list[DatasetError]) -> None:
    """Raise ``errors`` together as :class:`DatasetErrors`; do nothing when the list is empty."""
    if errors:
        raise DatasetErrors(errors)


class ResumeError(ValueError):
    """A checkpoint whose saved state cannot continue this run (its data order differs): ``ff fit`` prints it as
    one line naming ``--ckpt_path`` and exits 2."""


class ContractError(ValueError):
    """A configuration that the selected adapter's IO contract cannot serve (found before weights load)."""


class ConfigError(ValueError):
    """A config value that cannot work, named by the key the user wrote (STYLE 3). ``str(err)`` is ``key: reason``.

    ``ff fit`` prints it as one line and exits 2 instead of showing a traceback.

    Args:
        key: the dotted config key (``model.adapter``, ``model.pretrained_model_name_or_path``).
        reason: what is wrong, with the found value and, where there is one, the closest valid value.

    Attributes:
        key: as given.
        reason: as given.
    """

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"{key}: {reason}")

    def __reduce__(self):  # pickling (DDP spawn) with the 2-argument constructor
        return (ConfigError, (self.key, self.reason))


class NonFiniteError(RuntimeError):
    """A training step met a non-finite loss or gradient (``model.nonfinite: stop``; :mod:`ff_core.nonfinite`).

    ``str(err)`` is one line naming the step, the rank(s) and the step's samples; ``ff fit`` prints it and exits 1,
    and no checkpoint of poisoned weights exists (the step was refused before the optimiser ran).
    """
