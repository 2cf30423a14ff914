"""`DFlashDrafter`: the DFlash-style block drafter behind the `Drafter` protocol.

Per request it keeps the context K/V of committed positions in a window ring (eq. 9-10, one slot
per request, allocated at `admit`); the block K/V are recomputed each round and never stored.
A round for a request with n committed positions and anchor x_0 drafts the block at positions
n..n+B-1 from [x_0, mask * (B-1)], attending to the last W committed positions (positions
max(0, n-W)..n-1) plus the block. Drafts x_1..x_{K-1} come from block rows 1..K-1 through the
target's LM head (K = min(max_width, B)).

The ring is sized by eq. 9 with room for a block of max(K_max, B) positions, so a device kernel
may write the block K/V in place; this reference keeps them transient and reads only committed
rows (the window), which is what the ring guarantees stay live.

Greedy requests get argmax drafts (probs None; confidence = softmax max). Sampled requests draw
each draft from q = processed_probs(draft logits, params) with the drafter's per-request
generator and return q for rejection sampling (confidence = q(x)).
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from dhisparse.core.sampling import make_generator
from dhisparse.spec.config import DEFAULT_WINDOW
from dhisparse.spec.dflash_config import DFlashConfig, DFlashConfigError
from dhisparse.spec.dflash_io import load_dflash, save_dflash
from dhisparse.spec.dflash_model import DFlashModel
from dhisparse.spec.drafter import Commit, DrafterBytes, DraftProposal, DraftRequest, Features
from dhisparse.spec.dflash_graphs import BlockGraphs, IngestGraphs
from dhisparse.spec.dflash_pick import head_path, pick_each, select_path
from dhisparse.spec.ring import STALE, DenseDraftKV, DraftKVRing, ring_rows

log = logging.getLogger(__name__)


@dataclass
class _State:
    slot: int
    num_context: int = 0  # positions floor..num_context-1 have context K/V
    floor: int = 0  # lowest position observed after the last gap (observe with start > num_context)
    generator: torch.Generator | None = None


def target_parts(target) -> tuple[torch.nn.Embedding, torch.nn.Linear, object]:
    """(embed_tokens, lm_head, ModelConfig) of a DsaForCausalLM or a LoadedModel wrapping one."""
    model = getattr(target, "model", target)
    if not hasattr(model, "lm_head"):  # LoadedModel.model is the DsaForCausalLM
        model = target
    return model.model.embed_tokens, model.lm_head, getattr(target, "config", model.config)


class DFlashDrafter:
    """Block drafter conditioned on target features. `window` = W, `page` = p and `k_max` size the
    ring (R_d of eq. 9); `max_requests` ring slots; context="dense" keeps an unbounded store
    (reference for tests, same window semantics)."""

    def __init__(self, cfg: DFlashConfig, model: DFlashModel, target, *, window: int | None = None,
                 page: int = 64, k_max: int | None = None, max_requests: int = 64,
                 context: str = "ring", seed: int = 0, max_context: int | None = None) -> None:
        self.embed, self.lm_head, tcfg = target_parts(target)
        cfg.check_target(tcfg.vocab_size, tcfg.hidden_size, tcfg.num_layers)
        self.cfg, self.model, self.seed = cfg, model.eval(), seed
        # W: the user's window, else the checkpoint's (its sliding window; every position when a layer
        # attends to all of them, i.e. the longest context); a user window below the checkpoint's
        # (or below full context) departs from the drafter as trained
        self.window = window or cfg.context_window or max_context or DEFAULT_WINDOW
        if self.window < cfg.block_size:
            raise DFlashConfigError(
                f"--speculative-draft-window-size {self.window} is smaller than the drafter's block "
                f"({cfg.block_size}); use a window of at least {cfg.block_size}"
            )
        self.k_max = max(k_max or 0, cfg.block_size)
        self.ring_rows = ring_rows(self.window, page, self.k_max)
        dtype, device = model.fc.weight.dtype, model.fc.weight.device
        if context == "ring":
            self.kv = DraftKVRing(cfg.num_layers, max_requests, self.ring_rows, cfg.num_kv_heads, cfg.head_dim, dtype, device)
        elif context == "dense":
            self.kv = DenseDraftKV(cfg.num_layers)
        else:
            raise ValueError(f"DFlashDrafter.context must be 'ring' or 'dense', got {context!r}")
        self._bytes = 2 * cfg.num_layers * self.ring_rows * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
        if window is not None and cfg.context_window != window:
            log.warning("drafter window %d (--speculative-draft-window-size) differs from the checkpoint's (%s): "
                        "drafts differ from the drafter as trained (exactness is unaffected)", window,
                        cfg.context_window or "the whole context")
        log.info("draft KV ring: W %d, %d rows x %d slots, %s per request", self.window, self.ring_rows, max_requests,
                 f"{self._bytes / 2**20:.1f} MiB")
        self._states: dict[str, _State] = {}
        self.graphs: BlockGraphs | None = None  # `use_graphs`
        self.ingest_graphs: IngestGraphs | None = None  # `use_graphs`

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def random(cls, cfg: DFlashConfig, target, seed: int = 0, **kw) -> "DFlashDrafter":
        """Seeded random weights in the target's dtype / device."""
        model = DFlashModel(cfg)
        model.init_random(torch.Generator().manual_seed(seed))
        w = target_parts(target)[1].weight
        return cls(cfg, model.to(device=w.device, dtype=w.dtype), target, seed=seed, **kw)

    @classmethod
    def load(cls, folder: str | Path, target, strict: bool = True, **kw) -> "DFlashDrafter":
        """Load a checkpoint (config.json + safetensors, DFlash layout) onto the target's device."""
        w = target_parts(target)[1].weight
        cfg, model = load_dflash(folder, dtype=w.dtype, device=w.device, strict=strict)
        return cls(cfg, model, target, **kw)

    def save(self, folder: str | Path) -> Path:
        return save_dflash(folder, self.cfg, self.model)

    # ---- Drafter protocol ----------------------------------------------------------------------
    @property
    def capture_layers(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.cfg.target_layer_ids)))

    @property
    def feature_window(self) -> int:
        return self.window

    def state_bytes_per_request(self) -> int:
        return self._bytes

    def device_bytes(self) -> DrafterBytes:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        fixed = 0 if self.ingest_graphs is None else self.ingest_graphs.device_bytes()
        return DrafterBytes(weights, self.kv.device_bytes() + fixed)

    def stats(self) -> dict[str, float]:
        return {**({} if self.graphs is None else self.graphs.counters()),
                **({} if self.ingest_graphs is None else self.ingest_graphs.counters())}

    def admit(self, request_id: str) -> None:
        if request_id not in self._states:
            self._states[request_id] = _State(self.kv.admit(request_id))

    def release(self, request_id: str) -> None:
        if self._states.pop(request_id, None) is not None:
            self.kv.release(request_id)

    def observe(self, request_id: str, features: Features, start: int) -> None:
        self.admit(request_id)
        state = self._states[request_id]
        if start < state.num_context:
            raise ValueError(f"DFlash drafter: observe(start={start}) rewinds request {request_id!r}, which already "
                             f"holds positions up to {state.num_context - 1}; release it to start over")
        if start > state.num_context:
            state.floor, state.num_context = start, start
        self._ingest(state, features)

    def commit(self, request_id: str, accepted: int, new_features: Features | None = None) -> None:
        self._ingest(self._committing(request_id, accepted, new_features), new_features)

    def commit_many(self, items: Sequence[Commit]) -> list[Exception | None]:
        """Every valid item's features projected and written at once (`_ingest_many`: one pass of
        the context projections and one ring write a layer for the round, not one a request). An
        item that fails its checks gets its error; if the batched pass itself fails, the items are
        ingested one at a time so only a failing one fails (writes are idempotent; no state moved)."""
        errors: list[Exception | None] = [None] * len(items)
        ok: list[tuple[int, _State, Features]] = []
        for i, c in enumerate(items):
            try:
                ok.append((i, self._committing(c.request_id, c.accepted, c.new_features), c.new_features))
            except AssertionError:
                raise
            except Exception as e:  # noqa: BLE001 - that request's own failure
                errors[i] = e
        if not ok:
            return errors
        try:
            self._ingest_many([s for _, s, _ in ok], [f for _, _, f in ok])
        except AssertionError:
            raise
        except Exception:  # noqa: BLE001 - find the request it belongs to, one at a time
            for i, state, feats in ok:
                try:
                    self._ingest(state, feats)
                except AssertionError:
                    raise
                except Exception as e:  # noqa: BLE001
                    errors[i] = e
        return errors

    def _committing(self, request_id: str, accepted: int, new_features: Features | None) -> "_State":
        """The state a commit of `accepted` drafts with `new_features` goes to (checks its arguments)."""
        if request_id not in self._states:
            raise KeyError(f"DFlash drafter: commit for unknown request {request_id!r}; admit / propose it first")
        if new_features is None:
            raise ValueError("DFlash drafter: commit needs the target features of the committed positions "
                             f"(run the target with capture_layers={self.capture_layers})")
        rows = self._rows(new_features)
        if rows != accepted + 1:
            raise ValueError(f"DFlash drafter: commit got {rows} feature rows for accepted={accepted}; "
                             "pass the anchor's and the accepted drafts' rows (accepted + 1)")
        return self._states[request_id]

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        out: list[DraftProposal | None] = [None] * len(requests)
        live = []
        for i, (req, state) in enumerate(zip(requests, self._prepare_many(requests))):
            if req.max_drafts < 1:
                out[i] = DraftProposal.empty()
            else:
                live.append((i, req, state))
        if live:
            reqs, states = [r for _, r, _ in live], [s for _, _, s in live]
            hidden, logits, stale = self._draft_logits(reqs, states)
            gens = [None if r.params.greedy else self._generator(r, s, logits.device) for r, s in zip(reqs, states)]
            if self.cfg.is_dflash2:
                picked = select_path(self.model.candidate_selector, reqs, gens, hidden, logits)
            elif self.cfg.is_dspark:
                picked = head_path(self.model.sequential_head, reqs, gens, hidden, logits)
            else:
                picked = pick_each(reqs, gens, logits)
            self._check_live(stale)
            for (i, _, _), prop in zip(live, picked):
                out[i] = prop
        return out  # type: ignore[return-value]

    # ---- internals -----------------------------------------------------------------------------
    def _rows(self, features: Features) -> int:
        missing = [l for l in self.cfg.target_layer_ids if l not in features]
        if missing:
            raise ValueError(f"DFlash drafter: features lack target layers {missing}; "
                             f"run the target with capture_layers={self.capture_layers}")
        counts = {int(features[l].shape[0]) for l in self.cfg.target_layer_ids}
        if len(counts) != 1:
            raise ValueError(f"DFlash drafter: feature layers disagree on row count: {sorted(counts)}")
        return counts.pop()

    def _ingest(self, state: _State, features: Features) -> None:
        """Project features of positions num_context.. into context K/V; only the last W matter."""
        self._ingest_many([state], [features])

    def _ingest_many(self, states: list[_State], features: list[Features]) -> None:
        """`_ingest` of several requests in one pass: their kept rows concatenated through the
        context projections, then one ring write for every layer. States advance only once every
        write is done.

            request i:  positions num_context_i .. +n_i - 1, of which the last min(n_i, W) are kept
            rows:       [ kept_0 | kept_1 | ... ] per target layer, the layers side by side
                        -> context_kv -> k, v [sum kept, kvh, d] per draft layer
        """
        counts = [self._rows(feats) for feats in features]
        keeps = [min(n, self.window) for n in counts]
        rows = torch.cat([torch.cat([f[l] if keep == n else f[l][n - keep:] for f, n, keep in zip(features, counts, keeps)])
                          for l in self.cfg.target_layer_ids], dim=-1)  # a cat a layer, not one a request
        positions = [torch.arange(s.num_context + n - keep, s.num_context + n, dtype=torch.int64)
                     for s, n, keep in zip(states, counts, keeps)]
        kv = self._context_kv(rows, torch.cat(positions))
        self.kv.write_layers([s.slot for s in states], positions, kv)
        for state, n_new in zip(states, counts):
            state.num_context += n_new

    def _context_kv(self, rows: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`DFlashModel.context_kv` of rows [n, F*H] at positions [n]: from `ingest_graphs` where a
        bucket holds n rows, else eagerly."""
        out = self.ingest_graphs.run(rows, positions) if self.ingest_graphs is not None else None
        return self.model.context_kv(rows, positions) if out is None else out

    def _prepare(self, req: DraftRequest) -> _State:
        return self._prepare_many([req])[0]

    def _prepare_many(self, reqs: Sequence[DraftRequest]) -> list[_State]:
        """Admit each request, ingest every request's new_features in one pass, check each is ready."""
        for req in reqs:
            self.admit(req.request_id)
        states = [self._states[r.request_id] for r in reqs]
        fresh = [(s, r.new_features) for r, s in zip(reqs, states)
                 if r.new_features is not None and self._rows(r.new_features) > 0]
        if fresh:
            self._ingest_many([s for s, _ in fresh], [f for _, f in fresh])
        for req, state in zip(reqs, states):
            self._check_ready(req, state)
        return states

    def _check_ready(self, req: DraftRequest, state: _State) -> None:
        """The drafter holds exactly the request's committed positions its window needs."""
        if max(0, req.num_committed - self.window) < state.floor:
            raise ValueError(
                f"DFlash drafter: request {req.request_id!r} skipped positions before {state.floor} that its window "
                f"still needs (window starts at {max(0, req.num_committed - self.window)}); observe them"
            )
        if state.num_context > req.num_committed:
            raise ValueError(
                f"DFlash drafter: request {req.request_id!r} has {req.num_committed} committed positions but the "
                f"drafter already holds {state.num_context} (committed more than verified?); release it to start over"
            )
        if state.num_context < req.num_committed:
            raise ValueError(
                f"DFlash drafter: request {req.request_id!r} has {req.num_committed} committed positions but the "
                f"drafter holds features for {state.num_context}; pass positions {state.num_context}.."
                f"{req.num_committed - 1} in DraftRequest.new_features, observe() or commit()"
            )

    def _draft_logits(self, reqs: list[DraftRequest], states: list[_State]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (hidden [N, B-1, H], fp32 logits [N, B-1, V] of block rows 1..B-1, stale: a bool scalar
        to check once the round's drafts are read, see `_check_live`). The block pass replays from
        `graphs` where it can (spec/dflash_graphs.py), else runs eagerly over the same inputs."""
        anchors, committed = [r.anchor for r in reqs], [r.num_committed for r in reqs]
        out = self.graphs.run(anchors, committed, [s.slot for s in states]) if self.graphs is not None else None
        if out is None:
            device = self.model.fc.weight.device
            ctx, valid, ctx_pos, stale = self._gather_context(reqs, states, device)
            as_t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
            hidden = self._block(as_t(anchors), as_t(committed), ctx, valid, ctx_pos)
        else:
            hidden, stale = out
        hidden = hidden[:, 1:]
        with torch.inference_mode():
            return hidden, self.model.logits(hidden, self.lm_head), stale

    def _block(self, anchors: torch.Tensor, committed: torch.Tensor, ctx: list, valid: torch.Tensor,
               ctx_pos: torch.Tensor) -> torch.Tensor:
        """The block pass: anchors / committed [N] int64 on the device, ctx per layer (k, v) [N, L,
        kvh, d], valid / ctx_pos [N, L] -> final-normed hidden [N, B, H] of the block
        [anchor, mask * (B-1)] at positions n..n+B-1 (eager, or captured by `BlockGraphs`)."""
        b = self.cfg.block_size
        ids = torch.full((anchors.shape[0], b), self.cfg.mask_token_id, dtype=torch.int64, device=anchors.device)
        ids[:, 0] = anchors
        positions = committed[:, None] + torch.arange(b, device=anchors.device)[None, :]
        with torch.inference_mode():
            x = self.embed(ids).to(self.model.fc.weight.dtype) * self.cfg.input_embedding_scale
            return self.model.block_hidden(x, positions, ctx, valid, ctx_pos)

    def _gather_context(self, reqs: list[DraftRequest], states: list[_State], device):
        """Window K/V per layer, left-aligned and padded: ([(k, v) [N, L, kvh, d]], valid [N, L],
        positions [N, L], stale: one liveness flag for every layer, not yet read)."""
        starts = torch.tensor([max(0, r.num_committed - self.window) for r in reqs], dtype=torch.int64)
        ends = torch.tensor([r.num_committed for r in reqs], dtype=torch.int64)
        width = max(int((ends - starts).max()), 1)
        positions = starts[:, None] + torch.arange(width)[None, :]  # [N, L]
        valid = positions < ends[:, None]
        positions = torch.where(valid, positions, starts[:, None])  # padding reads a live row, then is masked
        slots = [s.slot for s in states]
        if not bool(valid.any()):
            shape = (len(reqs), width, self.cfg.num_kv_heads, self.cfg.head_dim)
            zeros = torch.zeros(shape, dtype=self.model.fc.weight.dtype, device=device)
            return [(zeros, zeros)] * self.cfg.num_layers, valid.to(device), positions.to(device), torch.tensor(False)
        valid, positions = valid.to(device), positions.to(device)
        out, stale = self.kv.read_layers(slots, positions, valid)
        return out, valid, positions, stale

    @staticmethod
    def _check_live(stale: torch.Tensor) -> None:
        """Raise if the round read a ring row that no longer holds its position (I6). Read after
        the drafts, so the check adds no host sync of its own."""
        if bool(stale):
            raise RuntimeError(STALE)

    # ---- CUDA graphs -----------------------------------------------------------------------------
    def use_graphs(self, runner, max_requests: int) -> bool:
        """Replay the block pass from per-bucket graphs through `runner` (`CudaGraphRunner`; tests:
        `EagerRunner`), every bucket up to `max_requests` captured now, in rounds whose windows are
        full, and the commits' context projection from per-row-bucket graphs (up to `max_requests`
        x block size rows, spec/dflash_graphs.py); the dense reference store has neither."""
        if not isinstance(self.kv, DraftKVRing):
            return False
        self.graphs = BlockGraphs(self._block, self.kv, self.window, runner, max_requests)
        w = self.model.fc.weight
        self.ingest_graphs = IngestGraphs(self.model.context_kv, w.shape[1], w.dtype, w.device, runner,
                                          max_requests * self.cfg.block_size)
        return True

    def _generator(self, req: DraftRequest, state: _State, device) -> torch.Generator:
        if state.generator is None:
            # a seeded request drafts reproducibly whatever its id; unseeded ones get a per-id stream
            salt = req.params.seed if req.params.seed is not None else zlib.crc32(req.request_id.encode())
            state.generator = make_generator((self.seed * 1_000_003) ^ salt, device)
        return state.generator
