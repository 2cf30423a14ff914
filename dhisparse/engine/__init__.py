"""The engine: `EngineConfig` (`config.py`), requests and outputs (`request.py`), the
scheduler (`scheduler.py`), device choice and pool sizing (`memory.py`), the step loop
(`engine.py`), stop checks (`stops.py`), speculative rounds (`speculative.py`), whole-step CUDA
graphs (`step_graphs.py`), stats and per-interval series (`stats.py`, `series.py`), the start-up
warm-up (`warmup.py`) and the offline `LLM` API (`llm.py`). May import every room below it:
`core`, `kernels`, `kv`, `layers`, `models` and `spec`."""
