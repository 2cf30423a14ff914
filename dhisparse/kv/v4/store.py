"""`V4ResidentStore`: the `resident` preset for DeepSeek-V4 models.

Each admitted request owns a `V4RequestState` (sliding window, compressor streaming tails and its
compressed rows, all on device). Capacity is accounted in pages of the KV pool: a request reserves
pages for its sliding windows and raw tails plus the compressed rows its prompt + output can
produce, so admission waits instead of overcommitting. States are committed after each pass up to
the positions the engine keeps, and rolled back exactly when a pass restarts below their length.

Prefix import / export are not built for V4 yet; the hierarchical presets live in `kv/v4/hier.py`.
"""

from __future__ import annotations

import torch

from dhisparse.core.contracts import KVStore
from dhisparse.core.rows import cdiv
from dhisparse.core.batch import ForwardBatch
from dhisparse.core.kvformat import KVFormats
from dhisparse.kv.memory.pool import PagePool, PoolUsage
from dhisparse.kv.v4.passes import V4Cache, V4Pass
from dhisparse.core.v4_config import V4Config


def v4_bytes(cfg: V4Config, n_tokens: int, elem: int, formats: KVFormats | None = None) -> int:
    """Device bytes of one request's V4 state after n_tokens: per layer a window of head_dim rows,
    compressed kv rows (head_dim / m per token) and, on CSA layers, index keys, in their stored
    format (`formats`; None: plain rows of `elem` bytes a value); plus raw tails (< 2m tokens of
    [kv | gate], twice as wide on CSA). Windows and tails stay in the model dtype."""
    row = formats.latent.nbytes if formats is not None else cfg.head_dim * elem
    key = formats.index.nbytes if formats is not None else cfg.index_head_dim * elem
    total = 0
    for i, t in enumerate(cfg.layer_types):
        total += cfg.sliding_window * cfg.head_dim * elem
        m = cfg.compress_rate(i)
        if m and cfg.produces_rows(i):  # reindex / reuse layers hold no rows of their own
            csa = cfg.has_indexer(i)
            total += (n_tokens // m) * (row + (key if csa else 0))
            total += 2 * m * 2 * (2 if csa else 1) * (cfg.head_dim + (cfg.index_head_dim if csa else 0)) * elem
    return total


class V4ResidentStore(KVStore):
    supports_prefix = False

    def __init__(self, cfg: V4Config, pool_bytes: int, page_bytes: int, device: torch.device, dtype: torch.dtype,
                 formats: KVFormats | None = None) -> None:
        """formats: the compressed rows' formats (None: plain rows of `dtype`)."""
        self.cfg, self.page_bytes, self.device, self.dtype, self.formats = cfg, page_bytes, device, dtype, formats
        self.cache = V4Cache(cfg, device, dtype, formats=formats)
        self.pool = PagePool(max(1, pool_bytes // page_bytes), "kv pages")
        self.states: dict[object, object] = {}

    def pages_for(self, max_total: int, prompt_len: int | None = None) -> int:
        return cdiv(v4_bytes(self.cfg, max_total, self.dtype.itemsize, self.formats), self.page_bytes)

    def admit(self, req: object, max_total: int, prompt_len: int | None = None) -> bool:
        need = self.pages_for(max_total)
        if need > self.pool.available:
            return False
        self.pool.alloc(req, need)
        self.states[req] = self.cache.new_request(req, auto_commit=False)
        return True

    def free(self, req: object) -> None:
        st = self.states.pop(req, None)
        if st is not None:
            st.release()
        self.pool.release(req)

    def context(self, batch: ForwardBatch, reqs: list[object]) -> V4Pass:
        states = [self.states[r] for r in reqs]
        for i, st in enumerate(states):
            start = int(batch.positions[batch.query_start[i]])
            if st.length > start:  # uncommitted positions (rejected drafts): forget them exactly
                st.rollback(start)
        return self.cache.begin(batch, states)

    def before_sync(self) -> None:
        """Nothing to do (see AdaptiveKV.before_sync)."""

    def after_step(self, computed: dict[object, tuple[int, bool]]) -> None:
        for req, (n, _) in computed.items():
            st = self.states.get(req)
            if st is not None:
                st.commit(min(n, st.length))

    def usage(self) -> PoolUsage:
        return self.pool.usage()

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        assert set(self.states) == {o for o in self.states if self.pool.owned_by(o)}, "a V4 state without pages"

    def write_rows(self, req: object, latent, index, start: int = 0) -> None:
        raise ValueError("prefix KV import is not available for deepseek_v4 models yet; send the whole prompt")

    def read_rows(self, req: object, n: int):
        raise ValueError("prefix KV export (prepare_prefix) is not available for deepseek_v4 models yet")
