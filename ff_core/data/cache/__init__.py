"""The condition cache: adapter-preprocessed conditions in Arrow IPC files, keyed by content identity.

- :mod:`~ff_core.data.cache.store` — identity, build (sharded over ranks), atomic publication, memory-mapped reads;
- :mod:`~ff_core.data.cache.identity` — content identity of records and their media (cache keys, resume fingerprints);
- :mod:`~ff_core.data.cache.table` — the Arrow IPC files: one row per record, written in record batches;
- :mod:`~ff_core.data.cache.digest` — a SHA-256 per record batch, checked before Arrow parses the bytes;
- :mod:`~ff_core.data.cache.group` — the ranks that build a cache together;
- :mod:`~ff_core.data.cache.collation` — how per-sample conditions become one batch (an adapter's rule per key).
"""
