"""The bottom room: the vocabulary every other room speaks. Model configurations (`config.py`
for GLM-5.x / DeepSeek-V3.2; `v4_config.py` and the V4.1-style cross-layer sources `v4_sources.py`
for DeepSeek-V4), the `ForwardBatch` and the `KVContext` a model pass reads and writes KV through
(`batch.py`), the declared `KVStore` contract the engine calls (`contracts.py`), row-space helpers
(`rows.py`), per-request sampling parameters (`params.py`) and the sampler (`sampling.py`). Imports
no other dhisparse room."""
