"""The models' building blocks: RMSNorm (`norm.py`), RoPE (`rope.py`), the lightning indexer
with ordered top-k (`indexer.py`), absorbed sparse MLA over gathered rows (`attention.py`), MoE and
MLP (`moe.py`), and DeepSeek-V4's attention, compressor and CSA indexer, hyper-connections, MoE and
numeric ops (`v4_*.py`). May import `core`, `kernels` and `kv` (the V4 layers speak
`kv/v4/passes.py`'s pass types)."""
