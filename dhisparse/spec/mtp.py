"""`MtpDrafter`: drafts from the target checkpoint's own MTP ("next-n predict") block, EAGLE-style.

A round of request r with n committed positions and anchor x_n (at position n): the MTP step at
position q takes (x_{q+1}, g_q) and predicts x_{q+2} (`spec/mtp_model.py`). Step 0 is q = n - 1
with the anchor and the target's g_{n-1}: it drafts x_{n+1}. Step j >= 1 (q = n - 1 + j) takes the
previous draft and the previous step's h', so K - 1 chained steps draft x_{n+1}..x_{n+K-1}.

**KV.** The MTP layer has its own MLA rows. Row p is a function of (x_{p+1}, g_p) alone, so the
rows of committed positions are computed from the REAL target features: prompt features come
through `observe`, a round's 1 + A committed positions through `commit`, and the row of position
p is written once x_{p+1} is known (at the next `propose`, whose anchor supplies the last one), in
a `LatentRing` (eq. 9-10) slot holding the last W committed positions. The rows of chained
positions n..n+K-2 are transient: computed in the round, never stored, so a rejection needs no
rollback.

**Attention, and why it is exact DSA for W <= index_topk.** The query at position q attends
densely to the rows of positions max(0, q - W + 1)..q. The MTP layer is a DSA layer: its indexer
keeps the top k = index_topk of the rows it can see. Over a KV of at most k rows, top-k selects
every row (eq. 1 with |visible| <= k: S_t is all of them, in some order, and attention is
order-free), so with W <= k dense attention over the window IS the layer's sparse attention over
that KV, and the indexer need not run. Against upstream serving, which keeps the MTP layer's whole
history, this is identical for every query with q < W (the whole history is in the window: with
the default W = k, contexts up to index_topk tokens), and an approximation beyond, where DSA would
pick k of the q + 1 rows by indexer score and the window keeps the most recent W. A window
W > k (explicit `window=`) is dense over more than k rows: an approximation even inside it. Any
approximation only costs acceptance: verification keeps the output exact (I7).

Greedy requests get argmax drafts (probs None, confidence = softmax max); sampled requests draw
each step from q = processed_probs(logits, params) with a per-request generator and return q.

**DeepSeek-V4.** The same drafter runs V4's MTP block (`spec/mtp_v4.py`, `spec/mtp_v4_model.py`):
the model-specific pieces (which features, what a ring row is, one chained step) sit in a "parts"
object, `MtpParts` (above) or `MtpV4Parts`, picked by the module's type. V4's MTP layer is a
sliding-window layer, so its window ring is exact at every context length.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Sequence

import torch

from dhisparse.core.sampling import make_generator, processed_probs
from dhisparse.core.v4_config import V4Config
from dhisparse.spec.config import SpecConfig
from dhisparse.spec.drafter import Commit, DraftProposal, DrafterBytes, DraftRequest, Features, commit_each
from dhisparse.spec.mtp_io import build_module
from dhisparse.spec.mtp_model import MtpModule, MtpParts
from dhisparse.spec.mtp_ring import LatentRing
from dhisparse.spec.mtp_v4 import MtpV4Parts
from dhisparse.spec.mtp_v4_io import build_module as build_v4_module
from dhisparse.spec.mtp_v4_model import MtpV4Module
from dhisparse.spec.ring import ring_rows


@dataclass
class _State:
    slot: int
    known: int = 0  # features exist for positions < known
    floor: int = 0  # first position observed after a gap
    rows_done: int = 0  # ring rows exist for window positions < rows_done
    feats: torch.Tensor | None = None  # g of positions known - len(feats) .. known - 1 [m, H]
    generator: torch.Generator | None = None


def target_model(target):
    """The causal LM (DsaForCausalLM) of a model or of a LoadedModel wrapping one."""
    inner = getattr(target, "model", target)
    return inner if hasattr(inner, "lm_head") else target


class MtpDrafter:
    """`module` (MtpModule, or MtpV4Module for DeepSeek-V4) drafts for `target`. window = W
    (default index_topk: exact DSA, see above; V4: sliding_window, exact); page / k_max size the
    ring (R_d of eq. 9); `max_requests` ring slots."""

    def __init__(self, module: MtpModule | MtpV4Module, target, *, window: int | None = None, page: int = 64,
                 k_max: int = 8, max_requests: int = 64, seed: int = 0) -> None:
        lm = target_model(target)
        parts_cls = MtpV4Parts if isinstance(module, MtpV4Module) else MtpParts
        self.parts = parts = parts_cls(module.eval(), lm, window)
        self.module, self.seed = parts.module, seed
        self.embed, self.head, self.final_norm = parts.embed, parts.head, parts.final_norm
        self.layer, self.window = parts.layer, parts.window
        self.ring_rows = ring_rows(self.window, page, k_max)
        w = module.weight
        self.ring = LatentRing(max_requests, self.ring_rows, parts.row_width, w.dtype, w.device)
        self._feat_bytes = self.window * parts.feat_width * w.element_size()
        self._states: dict[str, _State] = {}

    @classmethod
    def random(cls, target, seed: int = 0, **kw) -> "MtpDrafter":
        """Seeded random MTP weights (built-in random targets without an MTP block)."""
        lm = target_model(target)
        w = lm.lm_head.weight
        module_cls = MtpV4Module if isinstance(lm.config, V4Config) else MtpModule
        return cls(module_cls.random(lm.config, seed, w.dtype, w.device), target, seed=seed, **kw)

    @classmethod
    def from_checkpoint(cls, target, **kw) -> "MtpDrafter":
        """The MTP block the loader set aside on the target (`model.mtp_weights`)."""
        lm = target_model(target)
        w = lm.lm_head.weight
        build = build_v4_module if isinstance(lm.config, V4Config) else build_module
        return cls(build(lm.mtp_weights, lm.config, w.dtype, w.device), target, **kw)

    # ---- Drafter protocol ----------------------------------------------------------------------
    @property
    def capture_layers(self) -> tuple[int, ...]:
        return (self.layer,)

    @property
    def feature_window(self) -> int:
        return self.window

    def device_bytes(self) -> DrafterBytes:
        """The MTP block's own weights (not the target's embedding / head it may share) and the ring."""
        weights = sum(p.numel() * p.element_size() for p in self.module.parameters())
        return DrafterBytes(weights, self.ring.device_bytes())

    def stats(self) -> dict[str, float]:
        return {}

    def use_graphs(self, runner, max_requests: int) -> bool:
        """The MTP block runs eagerly (one layer a round, its shapes vary with the round's rows)."""
        return False

    def state_bytes_per_request(self) -> int:
        """The ring slot plus, until the first round, up to W prompt features awaiting their rows."""
        return self.ring.bytes_per_slot() + self._feat_bytes

    def admit(self, request_id: str) -> None:
        if request_id not in self._states:
            self._states[request_id] = _State(self.ring.admit(request_id))

    def release(self, request_id: str) -> None:
        if self._states.pop(request_id, None) is not None:
            self.ring.release(request_id)

    def observe(self, request_id: str, features: Features, start: int) -> None:
        self.admit(request_id)
        state = self._states[request_id]
        if start < state.known:
            raise ValueError(f"MTP drafter: observe(start={start}) rewinds request {request_id!r}, which already "
                             f"holds positions up to {state.known - 1}; release it to start over")
        if start > state.known:
            state.floor = state.known = state.rows_done = start
            state.feats = None
        self._ingest(state, features)

    def commit(self, request_id: str, accepted: int, new_features: Features | None = None) -> None:
        if request_id not in self._states:
            raise KeyError(f"MTP drafter: commit for unknown request {request_id!r}; admit / propose it first")
        if new_features is None:
            raise ValueError("MTP drafter: commit needs the target features of the committed positions "
                             f"(run the target with capture_layers={self.capture_layers})")
        if self._rows(new_features) != accepted + 1:
            raise ValueError(f"MTP drafter: commit got {self._rows(new_features)} feature rows for accepted="
                             f"{accepted}; pass the anchor's and the accepted drafts' rows (accepted + 1)")
        self._ingest(self._states[request_id], new_features)

    def commit_many(self, items: Sequence[Commit]) -> list[Exception | None]:
        return commit_each(self, items)

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        states = [self._prepare(r) for r in requests]
        live = [i for i, (r, s) in enumerate(zip(requests, states)) if r.max_drafts >= 1 and s.feats is not None]
        out = [DraftProposal.empty() for _ in requests]
        with torch.inference_mode():
            self._write_rows([requests[i] for i in live], [states[i] for i in live])
            if live:
                for i, prop in zip(live, self._chain([requests[i] for i in live], [states[i] for i in live])):
                    out[i] = prop
        return out

    # ---- features and committed rows -----------------------------------------------------------
    def _rows(self, features: Features) -> int:
        if self.layer not in features:
            raise ValueError(f"MTP drafter: features lack target layer {self.layer}; "
                             f"run the target with capture_layers={self.capture_layers}")
        return int(features[self.layer].shape[0])

    def _ingest(self, state: _State, features: Features) -> None:
        """Keep g of the new positions; only positions inside the next window or without a row matter."""
        n_new = self._rows(features)
        if n_new == 0:
            return
        with torch.inference_mode():
            g = self.parts.features(features[self.layer])
        feats = g if state.feats is None else torch.cat([state.feats, g])
        state.known += n_new
        keep = state.known - max(state.known - self.window, min(state.rows_done, state.known - 1))
        state.feats = feats[-keep:]

    def _prepare(self, req: DraftRequest) -> _State:
        self.admit(req.request_id)
        state = self._states[req.request_id]
        if req.new_features is not None and self._rows(req.new_features) > 0:
            self._ingest(state, req.new_features)
        n = req.num_committed
        if state.known < n:
            raise ValueError(f"MTP drafter: request {req.request_id!r} has {n} committed positions but the drafter "
                             f"holds features for {state.known}; pass positions {state.known}..{n - 1} in "
                             "DraftRequest.new_features, observe() or commit()")
        if state.known > n:
            raise ValueError(f"MTP drafter: request {req.request_id!r} has {n} committed positions but the drafter "
                             f"already holds {state.known} (committed more than verified?); release it to start over")
        if max(0, n - self.window) < state.floor:
            raise ValueError(f"MTP drafter: request {req.request_id!r} skipped positions before {state.floor} that "
                             f"its window still needs (window starts at {max(0, n - self.window)}); observe them")
        return state

    def _write_rows(self, reqs: list[DraftRequest], states: list[_State]) -> None:
        """Rows of committed positions max(rows_done, n - W)..n - 1, from (x_{p+1}, g_p), one pass."""
        dev = self.module.weight.device
        parts = []
        for req, st in zip(reqs, states):
            n = req.num_committed
            lo = max(st.rows_done, n - self.window)
            if lo < n:
                ids = list(req.token_ids[lo + 1:n]) + [req.anchor]
                parts.append((st, lo, n, ids, st.feats[st.feats.shape[0] - (n - lo):]))
        if parts:
            ids = torch.tensor([t for p in parts for t in p[3]], dtype=torch.int64, device=dev)
            pos = torch.cat([torch.arange(lo, n, device=dev) for _, lo, n, _, _ in parts])
            latent = self.parts.rows(ids, torch.cat([p[4] for p in parts]), pos)
            a = 0
            for st, lo, n, _, _ in parts:
                self.ring.write(st.slot, pos[a:a + n - lo], latent[a:a + n - lo])
                a += n - lo
        for req, st in zip(reqs, states):
            st.rows_done = req.num_committed
            if st.feats is not None:
                st.feats = st.feats[-1:]

    # ---- the chained drafting steps ------------------------------------------------------------
    def _window(self, slots: list[int], n: torch.Tensor, j: int, transient: list[torch.Tensor]):
        """Rows [N * L, 1, D] and loc [N, L] for the queries at positions n - 1 + j: committed ring rows
        max(0, n + j - W)..n - 1, then transient rows of positions max(n, n + j - W)..n - 1 + j."""
        W, N = self.window, len(slots)
        start = (n + j - W).clamp(min=0)
        count = (n - start).clamp(min=0)
        width = int(count.max())
        ar = torch.arange(width, device=n.device)
        comm_ok = ar[None, :] < count[:, None]
        comm_pos = torch.where(comm_ok, start[:, None] + ar[None, :], start[:, None])
        comm = self.ring.read_batch(slots, comm_pos, comm_ok)
        trans = transient[max(0, j - W):]
        rows = torch.cat([comm, torch.stack(trans, 1)], 1) if trans else comm
        valid = torch.cat([comm_ok, torch.ones(N, len(trans), dtype=torch.bool, device=n.device)], 1)
        L = rows.shape[1]
        loc = torch.where(valid, torch.arange(N * L, device=n.device).view(N, L), -1)
        return rows.reshape(N * L, 1, rows.shape[-1]), loc

    def _chain(self, reqs: list[DraftRequest], states: list[_State]) -> list[DraftProposal]:
        dev = self.module.weight.device
        n = torch.tensor([r.num_committed for r in reqs], dtype=torch.int64, device=dev)
        hidden = torch.cat([s.feats[-1:] for s in states])
        tok = torch.tensor([r.anchor for r in reqs], dtype=torch.int64, device=dev)
        slots, transient = [s.slot for s in states], []
        picks: list[list[tuple[int, float, torch.Tensor | None]]] = [[] for _ in reqs]
        for j in range(max(r.max_drafts for r in reqs)):
            def window(row: torch.Tensor, j: int = j):
                """The step's own row [N, width] (position n - 1 + j; transient for j >= 1) -> rows, loc."""
                if j:
                    transient.append(row)
                return self._window(slots, n, j, transient)

            logits, hidden = self.parts.step(tok, hidden, n - 1 + j, window)
            tok = self._pick(reqs, states, logits, picks)
        out = []
        for req, got in zip(reqs, picks):
            got = got[:req.max_drafts]
            probs = None if req.params.greedy else torch.stack([q for _, _, q in got])
            out.append(DraftProposal([t for t, _, _ in got], probs, [c for _, c, _ in got]))
        return out

    def _pick(self, reqs, states, logits: torch.Tensor, picks) -> torch.Tensor:
        """One token per request from logits [N, V]; appends (token, confidence, q or None)."""
        tokens = logits.argmax(dim=-1)
        conf = torch.softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
        for i, (req, st) in enumerate(zip(reqs, states)):
            if req.params.greedy:
                picks[i].append((int(tokens[i]), float(conf[i]), None))
                continue
            if st.generator is None:  # seeded requests draft reproducibly whatever their id
                salt = req.params.seed if req.params.seed is not None else zlib.crc32(req.request_id.encode())
                st.generator = make_generator((self.seed * 1_000_003) ^ salt, logits.device)
            q = processed_probs(logits[i:i + 1], [req.params])[0]
            t = int(torch.multinomial(q, 1, generator=st.generator)[0])
            tokens[i] = t
            picks[i].append((t, float(q[t]), q))
        return tokens


def build_mtp(cfg: SpecConfig, target, max_requests: int = 64) -> MtpDrafter:
    """`--speculative-algorithm mtp`: the checkpoint's MTP block (a loaded checkpoint's
    `model.mtp_weights`; a checkpoint without one is refused in one line), or seeded random
    weights for built-in random models (no such attribute). W = --speculative-draft-window-size,
    by default index_topk (window attention = exact DSA), for DeepSeek-V4 sliding_window (exact)."""
    lm = target_model(target)
    default = lm.config.sliding_window if isinstance(lm.config, V4Config) else lm.config.index_topk
    kw = dict(window=cfg.draft_window_size or default, page=cfg.page_size,
              k_max=cfg.num_draft_tokens, max_requests=max_requests, seed=cfg.seed)
    if getattr(lm, "mtp_weights", None) is None:
        return MtpDrafter.random(target, **kw)
    return MtpDrafter.from_checkpoint(target, **kw)
