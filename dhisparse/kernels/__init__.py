"""Triton kernels, each beside a plain-PyTorch reference of the same signature: the fused
resolver plan and gather-copy (`resolver.py`, `resolver_kernel.py`, `resolver_evict.py`, `gather.py`;
reference `resolver_ref.py`), sparse-MLA decode / verify attention (`sparse_mla.py`; reference
`sparse_mla_ref.py`), batched indexer scoring (`indexer.py`; reference `indexer_torch.py`) and
zero-copy views of pinned host memory (`uva.py`). `backend.py` holds the process's
`KernelSettings`, set at engine build; `dispatch.py` runs the kernel or the reference per call
(Triton is optional: without it every dispatcher runs the reference). May import `core` only."""
