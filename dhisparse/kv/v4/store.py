"""`V4ResidentStore`: the `resident` preset for DeepSeek-V4 models.

Each admitted request owns a `V4RequestState` (sliding window, compressor streaming tails and its
compressed rows, all on device). Capacity is accounted in pages of the KV pool: a request reserves
pages for its sliding windows and raw tails plus the compressed rows its prompt + output can
produce, so admission waits instead of overcommitting. States are committed after each pass up to
the positions the engine keeps, and rolled back exactly when a pass restarts below their length.

Prefixes (kv/v4/prefix.py): `export_prefix` copies the exporting request's whole state at its
prompt's end to host (tails and every compressed row, stored bytes); `import_prefix` puts it into
a fresh request's state (`V4RequestState.adopt`), whole prefixes only (`import_len`). The
hierarchical presets live in `kv/v4/hier.py`.
"""

from __future__ import annotations

import torch

from dhisparse.core.contracts import KVStore
from dhisparse.core.rows import cdiv
from dhisparse.core.batch import ForwardBatch
from dhisparse.core.kvformat import KVFormats
from dhisparse.kv.memory.pool import PagePool, PoolUsage
from dhisparse.kv.v4.passes import V4Cache, V4Pass
from dhisparse.kv.v4.prefix import V4Prefix, adopt_tails, export_rows, export_tails, import_len, put_rows
from dhisparse.core.v4_config import V4Config


def v4_bytes(cfg: V4Config, n_tokens: int, elem: int, formats: KVFormats | None = None) -> int:
    """Device bytes of one request's V4 state after n_tokens: per layer a window of head_dim rows,
    compressed kv rows (head_dim / m per token) and, on CSA layers, index keys, in their stored
    format (`formats`; None: plain rows of `elem` bytes a value); plus raw tails (< 2m tokens of
    [kv | gate], twice as wide on CSA). Windows and tails stay in the model dtype."""
    row, key = v4_row_bytes(cfg, elem, formats)
    total = 0
    for i, t in enumerate(cfg.layer_types):
        total += cfg.sliding_window * cfg.head_dim * elem
        m = cfg.compress_rate(i)
        if m and cfg.produces_rows(i):  # reindex / reuse layers hold no rows of their own
            csa = cfg.has_indexer(i)
            total += (n_tokens // m) * (row + (key if csa else 0))
            total += 2 * m * 2 * (2 if csa else 1) * (cfg.head_dim + (cfg.index_head_dim if csa else 0)) * elem
    return total


def v4_row_bytes(cfg: V4Config, elem: int, formats: KVFormats | None) -> tuple[int, int]:
    """(bytes of a stored compressed row, of a stored index key): the formats', else plain rows
    of `elem` bytes a value."""
    if formats is not None:
        return formats.latent.nbytes, formats.index.nbytes
    return cfg.head_dim * elem, cfg.index_head_dim * elem


class V4ResidentStore(KVStore):

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

    # -- prefixes (kv/v4/prefix.py) -------------------------------------------------------------
    def export_prefix(self, req: object, token_ids: list[int], features: dict, pin: bool) -> V4Prefix:
        """req's state after its prompt (length len(token_ids)): tails and every compressed row."""
        st = self.states[req]
        if st.length != len(token_ids):
            raise ValueError(f"request {req!r} holds {st.length} tokens, its prefix has {len(token_ids)}")
        feats = {l: f.cpu() for l, f in features.items()}
        return V4Prefix(tuple(token_ids), export_tails(st, pin), export_rows(st, self.cache.store, set(), pin),
                        None, feats)

    def import_len(self, item, n: int) -> int:
        """Whole prefixes only (kv/v4/prefix.py `import_len`)."""
        return import_len(item, n)

    def import_prefix(self, req: object, item: V4Prefix, n: int) -> None:
        """req's fresh state <- the item's rows and tails at n = len(item.token_ids)."""
        if n != len(item.token_ids) or item.tiered is not None:
            raise ValueError(f"a resident V4 state imports a whole resident prefix ({len(item.token_ids)} tokens), "
                             f"not {n} positions{' of a hierarchical one' if item.tiered is not None else ''}")
        st = self.states[req]
        put_rows(self.cache.store, req, item.rows)
        adopt_tails(st, item, self.device)

    def write_rows(self, req: object, latent, index, start: int = 0) -> None:
        raise ValueError("deepseek_v4 prefixes are whole streaming states (import_prefix), not rows by position")

    def read_rows(self, req: object, n: int, pin: bool = False):
        raise ValueError("deepseek_v4 prefixes are whole streaming states (export_prefix), not rows by position")
