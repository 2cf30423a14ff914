"""The `resident` preset's store, full history on device (`ResidentKV` and its
`PagedContext`, `store.py`), and `DenseKV` (`dense.py`): the unpaged reference store the others are
tested against. May import `core`, `kernels` and `kv/memory`."""
