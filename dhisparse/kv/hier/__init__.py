"""The KV hierarchy: `HierarchicalKV` (`hisparse`: host backing + fixed hot cache + resolver,
`hierarchy.py`, its tables, staging arenas, admission, hand-off, tail and checks in `tables.py`,
`staging_arena.py`, `admission.py`, `handoff.py`, `tail.py`, `integrity.py`) and the context of its
passes (`context.py`, over the resolver step of `resolver_step.py`), the resolver's counters
(`census.py`), the direct path and verification staging (`staging.py`), a stored prefix's shared
host pages (`prefix_pages.py`), a whole prompt's KV computed elsewhere admitted resident-first or
host-first (`arrival.py`, prefill/decode disaggregation), and `AdaptiveKV` (`adaptive`: load-adaptive residency of optional
history, `adaptive.py`, `residency.py`). May import `core`, `kernels`, `kv/memory` and
`kv/resident`."""
