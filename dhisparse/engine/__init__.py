"""The engine: `EngineConfig` (`config.py`), requests and outputs (`request.py`), the
scheduler (`scheduler.py`), device choice and pool sizing (`memory.py`), `Engine` (`engine.py`)
and its step loop (`step_loop.py`: the pass `forward.py`, sampling `sample.py`, verification
`verification.py`, outputs `outputs.py`, a request's end `finish.py`; admission `admission.py`,
prepared prefixes `prefixes.py`, disaggregation's prompts `handoff.py`), stop checks (`stops.py`),
speculative rounds (`speculative.py`), whole-step CUDA graphs (`step_graphs.py`), stats and
per-interval series (`stats.py`, `series.py`), the start-up warm-up (`warmup.py`) and the offline
`LLM` API (`llm.py`). May import every room below it: `core`, `kernels`, `kv`, `layers`, `models`
and `spec`."""
