"""Where KV lives, in sub-rooms by tier, each importing only those before it: `memory/` (page
arena and pool, host store, copies and loads, prefix store) -> `resident/` (the `resident` store and
the dense reference) -> `hier/` (the hot-cache hierarchy: `hisparse`, `adaptive`) -> `v4/`
(DeepSeek-V4's streaming state and its stores). `build.py` (`build_store`: the store a preset names,
for GLM-5.x / V3.2 and DeepSeek-V4 alike) sits above the sub-rooms. May import `core` and
`kernels`."""
