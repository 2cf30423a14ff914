"""DeepSeek-V4's KV: per-request streaming state with exact rollback (`state.py`), where
emitted compressed rows live (`rows.py`), the view one model pass works through (`passes.py`), the
`resident` store (`store.py`) and the hierarchical presets, which tier the CSA compressed rows
through `kv/hier` (`hier.py`, `hier_pass.py`, `tiered.py`), and prepared prefixes (`prefix.py`). May import `core`, `kernels` and the
kv sub-rooms `memory`, `resident` and `hier`."""
