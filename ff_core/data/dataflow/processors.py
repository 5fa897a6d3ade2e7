"""Built-in processors (spec §2): raw item → sample dict.

ff's own record → sample processor belongs to the datamodule; it subclasses :class:`RawItemProcessor` (or wraps a
function in :class:`CallableProcessor`). Processors run inside DataLoader workers, so they must be picklable or
fork-safe, and are never called for items a resume skips over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import RawItemProcessor


class IdentityProcessor(RawItemProcessor):
    """The distributor already yields finished sample dicts."""

    def process(self, item: Any) -> dict[str, Any]:
        return item


class CallableProcessor(RawItemProcessor):
    """Wrap a plain function ``item -> sample dict`` as a processor.

    Args:
        fn: Function applied to every raw item; a module-level function or a picklable callable.
    """

    def __init__(self, fn: Callable[[Any], dict[str, Any]]) -> None:
        self.fn = fn

    def process(self, item: Any) -> dict[str, Any]:
        return self.fn(item)
