"""Benchmarks: the closed-loop harness (in-process `inproc`, over HTTP `http`), sweeps, the load
step, result JSON (`results`), tables (`report`) and paper-style figures (`plots`)."""
