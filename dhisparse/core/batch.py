"""The contract between the model forward and whatever stores its KV.

A model pass runs over a `ForwardBatch`: the new tokens of N requests flattened into T rows, each
request's tokens contiguous and in position order. The model asks a `KVContext` to

1. `store` the rows its layer produced for those tokens (latent MLA rows, index keys),
2. hand back a request's `index_keys` for the whole history (the indexer scores all of it),
   and `index_table(layer)`: every request's keys at once (`IndexTable`) so the indexer can
   score the whole batch in one pass, or None (the default) and the indexer uses `index_keys`,
3. `locate` the selected positions: turn a selection `[T, k]` of token positions (-1 = none)
   into locations `[T, k]` in a row space `[R, latent_dim]` that attention gathers from.

The resident engine, the HiSparse hierarchy and the adaptive hierarchy are different
implementations of this one protocol; the model code does not change between presets.

  flattened batch (T tokens)
  |-- req 0: positions n0 .. n0+q0-1 --|-- req 1: n1 .. n1+q1-1 --| ...
  query_start[0]                        query_start[1]              query_start[N] == T
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, Protocol

import torch

from dhisparse.core.kvformat import KVFormats, RowFormat


@dataclass
class ForwardBatch:
    """Tokens of one model pass.

    input_ids  [T] int64   token ids
    positions  [T] int64   absolute positions (request-local)
    req_idx    [T] int64   batch row 0..N-1 of each token
    seq_lens   [N] int64   KV length of each request after this pass (= last position + 1)
    query_start list[int]  N+1 offsets; request r owns tokens query_start[r]:query_start[r+1]
    lens       list[int]   seq_lens on the host (stores read it without a device sync)
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    req_idx: torch.Tensor
    seq_lens: torch.Tensor
    query_start: list[int]
    lens: list[int] | None = None

    def __post_init__(self) -> None:
        if self.lens is None:
            self.lens = self.seq_lens.tolist()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_reqs(self) -> int:
        return len(self.query_start) - 1

    @cached_property
    def tokens_per_request(self) -> int:
        """K when every request runs exactly K consecutive tokens (a decode or verification pass,
        padded ones included), else 0."""
        qs, N = self.query_start, self.num_reqs
        K = qs[-1] // N if N else 0
        return K if K and all(qs[r] == r * K for r in range(N + 1)) else 0

    @classmethod
    def build(cls, chunks: list[tuple[list[int], int]], device: torch.device | str = "cpu") -> "ForwardBatch":
        """Build from `(token_ids, start_position)` per request."""
        ids: list[int] = []
        pos: list[int] = []
        req: list[int] = []
        starts = [0]
        lens: list[int] = []
        for r, (toks, start) in enumerate(chunks):
            ids.extend(toks)
            pos.extend(range(start, start + len(toks)))
            req.extend([r] * len(toks))
            starts.append(len(ids))
            lens.append(start + len(toks))
        packed = torch.tensor(ids + pos + req + lens, dtype=torch.int64).to(device, non_blocking=True)
        T = len(ids)
        return cls(packed[:T], packed[T : 2 * T], packed[2 * T : 3 * T], packed[3 * T :], starts, lens)

    def last_token_index(self) -> torch.Tensor:
        """[N] flattened index of each request's last token in this pass."""
        return torch.tensor(self.query_start[1:], dtype=torch.int64, device=self.input_ids.device) - 1


class IndexTable(NamedTuple):
    """Index keys of every request of a pass, as one paged row space plus location tables.

    rows [P, ips, Wi]  paged index-key space (may be a strided view); flat location l is
                       rows[l // ips, l % ips]; Wi = iD for plain keys, fmt.width for FP8 keys
    locs [N, Lmax] int64  location of position s of request r (-1 padding past lens[r])
    lens [N] int64     number of index keys of request r (this pass included)
    fmt                the keys' RowFormat (core/kvformat.py), or None: plain keys of the model dtype
    scales [P, ips, Wi - D]  FP8 keys split as the arena keeps them: `rows` [P, ips, D] holds the
                       e4m3 values and this space their scales (same locations); None: `rows` holds
                       whole stored keys
    """

    rows: torch.Tensor
    locs: torch.Tensor
    lens: torch.Tensor
    fmt: "RowFormat | None" = None
    scales: torch.Tensor | None = None


class KVContext(Protocol):
    """Per-pass view of the KV store, built by the engine for one `ForwardBatch`."""

    def store(self, layer: int, latent: torch.Tensor, index_key: torch.Tensor | None) -> None:
        """Write this pass's rows. latent [T, latent_dim]; index_key [T, index_head_dim] or None
        on layers without an indexer. Called before the layer's indexer and attention run."""
        ...

    def index_keys(self, layer: int, req: int) -> torch.Tensor:
        """[seq_lens[req], index_head_dim] index keys of request `req`, this pass included."""
        ...

    def index_table(self, layer: int) -> IndexTable | None:
        """Every request's index keys at once (row s of request r is index_keys(layer, r)[s]), or
        None when the context has no batched view (the default): `indexer_topk` then scores
        request by request over `index_keys`."""
        return None

    def row_formats(self) -> KVFormats | None:
        """How this context's stored rows are laid out (core/kvformat.py): `locate` returns row
        spaces of `latent`-format rows, `index_table` keys of the `index` format. None (the
        default): plain rows of the model dtype."""
        return None

    def graph_pass(self) -> "GraphPass | None":
        """What a whole-step CUDA graph needs to replay this pass (`GraphPass`), or None (the
        default): the pass runs eagerly."""
        return None

    def locate(self, layer: int, selection: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Resolve a selection [T, k] (positions, -1 padding) of layer `layer`'s attention.

        Returns (rows [P, per_page, W], loc [T, k]) (W: `row_formats().latent.width`) where the row at flat location
        loc[t, i] is the row of position selection[t, i] of token t's request (invariant I2);
        loc is -1 where selection is -1.
        """
        ...


    def finish(self) -> None:
        """The model's last layer has been issued: work the pass deferred until every layer of a
        selection group had read its rows (paper staging's copy-back, kv/hier/promotion.py) is
        issued now, in stream order (inside a step graph's capture too). Default: nothing."""


class GraphPass(NamedTuple):
    """What a context offers a whole-step CUDA graph (`engine.step_graphs`) for its pass.

    K        tokens of the longest request: the graph runs N requests x K tokens, request r owning
             tokens r*K .. r*K+K-1; a shorter request's (ragged pass) missing tokens are padding
             (position -1: they see no history and write to the scratch rows)
    variant  hashable Python-side branch of the pass (e.g. all-direct or not): one graph each
    rows     name -> (tensor [N, ...], pad value): the per-request tensors the context reads in
             the forward; the graph holds static copies [N_bucket, ...] (2-D tables also padded
             to a static width) and the context's `for_graph` rebuilds itself over them
    width    (`for_graph` only) the graph's static table width W_b >= every request's length
    """

    K: int
    variant: tuple
    rows: dict
    width: int = 0


class ScratchRows(NamedTuple):
    """A latent and an index location owned by no request: padded tokens of a step graph write
    their rows there, so a padded request never touches a real request's rows."""

    latent: int
    index: int
