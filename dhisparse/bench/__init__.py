"""Benchmarks: the closed-loop harness (in-process `inproc`, over HTTP `http`), sweeps, the load
step, result JSON (`results`), tables (`report`), paper-style figures (`plots`), the per-request
memory report (`memreport`) and the Table 3 retrieval-volume measurement (`table3`). May import
`engine`, the rooms below it and the top-level `dhisparse` API, not `server` (HTTP runs talk to a
URL); imports inside functions are allowed here, so `dhisparse --help` stays fast."""
