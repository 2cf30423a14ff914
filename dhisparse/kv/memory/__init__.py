"""Device and host memory under every store: `KVArena` (one array of typed pages,
`arena.py`) over the page allocator (`pool.py`), KV sources and row geometry (`layout.py`), the host
backing store (`host.py`) pinned at its exact size (`pinned.py`), page-copy engines (`copies.py`),
background loads (`loads.py`), device mirrors of per-slot page lists (`slot_tables.py`) and the
prefix store (`prefix_store.py`). May import `core` and `kernels`; no other kv sub-room."""
