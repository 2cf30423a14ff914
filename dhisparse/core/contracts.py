"""The declared contract between the engine and its KV stores: `KVStore`.

(The drafters' contract is `spec/drafter.py`'s `Drafter` protocol, beside the request and
proposal types it speaks in; `tests/test_contracts.py` checks every store and drafter.)

The engine calls methods; it never probes for names. Every ability a store or drafter may lack
is declared here with its default, so a store that does not override it gets well-defined
behaviour, and a misspelled override is caught by `tests/test_contracts.py` (it checks that an
override keeps the declared signature and that no store defines a near-miss of a declared name).

A request is named by its id (any hashable: the engine uses strings). Token counts are positions
of the request's sequence (prompt + outputs); `computed` maps request -> (positions whose KV is
written, prompt done).
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Hashable, Mapping, NamedTuple

import torch

from dhisparse.core.batch import ForwardBatch, KVContext

class RequestFailures(Exception):
    """Per-request failures inside a batched store call (e.g. `after_step`): the store finished
    every other request's work and reports these, request -> exception, so the engine aborts
    exactly them (one request never hurts another)."""

    def __init__(self, failures: Mapping[Hashable, BaseException]) -> None:
        super().__init__("; ".join(f"{r}: {type(e).__name__}: {e}" for r, e in failures.items()))
        self.failures = dict(failures)


PrefixMatch = Callable[[Hashable], tuple[Any, int]]
"""req -> (stored prefix or None, rows it will import): set on a store by the engine."""


TIERS = ("resident", "workspace", "tail", "optional", "hot", "host", "staging", "none")
"""Where a row can live. resident: the resident preset's pages; workspace: a prompt being
prefilled (hierarchy); tail / optional (adaptive's ready map) / hot (hot cache): device rows of
a decoding request, in the resolver's order; host: the host backing only; staging: a row staged
for one verification pass (a location >= `core.rows.SPACE` of that pass); none: no
row (past the request's length)."""


class RowPlace(NamedTuple):
    """One answer to "where does row p of request r live" (`KVStore.row_place`).

    tier    the tier attention reads the row from (one of TIERS)
    device  its flat location in the layer's device row space (-1: not on the device)
    host    its flat location in the host rows (page * page_size + offset; -1: no host copy)
    """

    tier: str
    device: int = -1
    host: int = -1


class KVStore(abc.ABC):
    """Where a preset keeps KV: pages on the device (and, for the hierarchy, a host backing).

    Required: admission and release, the per-pass context, pool usage and integrity checks.
    Optional abilities have defaults here (no prefix pages, no loading, no staging, no census,
    no residency, no step graphs); the concrete stores override what they provide.

    Attributes every store sets: `page_size` (token positions per latent page), `pool` (its page
    pool: `num_pages`, `usage()`) and `device`.
    """

    page_size: int
    pool: Any
    device: torch.device

    # -- required ----------------------------------------------------------------------------------
    @abc.abstractmethod
    def pages_for(self, max_total: int, prompt_len: int | None = None) -> int:
        """Pool pages a request of `max_total` positions (prompt `prompt_len`) reserves."""

    @abc.abstractmethod
    def admit(self, req: Hashable, max_total: int, prompt_len: int | None = None) -> bool:
        """Reserve req's whole life; False (nothing held) when it must wait."""

    def never_fits(self, max_total: int, prompt_len: int | None = None) -> str | None:
        """Why a request of `max_total` positions can never be admitted, even into an idle store
        (its pages exceed the pool net of what the store holds for good, or another pool of the
        store), as a message naming the setting to raise; None when it can fit once others finish."""
        need, cap = self.pages_for(max_total, prompt_len), self.pool.capacity
        if need > cap:
            return (f"the request needs {need} KV pages but the pool can ever give a request {cap}; "
                    "raise --kv-pool-bytes or lower max_tokens")
        return None

    @abc.abstractmethod
    def free(self, req: Hashable) -> None:
        """Release everything req holds (a request never admitted is a no-op)."""

    @abc.abstractmethod
    def context(self, batch: ForwardBatch, reqs: list[Hashable]) -> KVContext:
        """The KVContext of one model pass over `batch`; reqs[r] owns batch row r."""

    @abc.abstractmethod
    def usage(self) -> Any:
        """The pool's `PoolUsage` (total / used pages)."""

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Assert the store's bookkeeping is consistent (debug checks after each step)."""

    # -- step upkeep (defaults: nothing to do) -----------------------------------------------------
    def before_sync(self) -> None:
        """Upkeep that needs no result of the step just launched, run while the device computes."""

    def after_step(self, computed: Mapping[Hashable, tuple[int, bool]]) -> None:
        """After the step's results: computed[req] = (positions with KV, prompt done)."""

    def idle(self) -> None:
        """The engine had nothing to run this step: settle the copies still in flight (wait for
        them and free the pages they held), so an idle engine's pool holds only live requests."""

    def loading(self, req: Hashable) -> bool:
        """Whether req waits for a background copy (prefix import, hand-off): it sits the step out."""
        return False

    # -- prefixes -----------------------------------------------------------------------------------
    supports_prefix: bool = True
    """Whether `prepare_prefix` can export this store's rows (`read_rows`) and import them."""

    def read_rows(self, req: Hashable, n: int, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Host copies of positions 0..n-1: (latent [L, n, d], index [F, n, iD]), pinned when `pin`."""
        raise NotImplementedError(f"{type(self).__name__} cannot export rows (supports_prefix is False)")

    def write_rows(self, req: Hashable, latent: torch.Tensor, index: torch.Tensor, start: int = 0) -> None:
        """Write positions start..start+n-1 of req: latent [L, n, d], index [F, n, iD]."""
        raise NotImplementedError(f"{type(self).__name__} cannot import rows (supports_prefix is False)")

    def prefix_layout(self) -> tuple[int, int, int] | None:
        """(page_size, index_page_size, index_split) of the page layout `import_prefix` copies whole
        pages from (`StoredPrefix.paged`), or None: the store imports a prefix row by row (`write_rows`)."""
        return None

    def export_prefix(self, req: Hashable, token_ids: list[int], features: dict, pin: bool) -> Any | None:
        """A prefix item of req's first len(token_ids) positions, in this store's own form (host
        tensors, pinned when `pin`; features: the drafter's, kept on it), for `import_prefix`; or
        None: the engine stores `read_rows` as a `StoredPrefix` (rows by position). DeepSeek-V4
        exports its whole streaming state (kv/v4/prefix.py `V4Prefix`)."""
        return None

    def import_len(self, item: Any, n: int) -> int:
        """How many of the n positions `PrefixStore.match` offers of `item` this store imports
        (0: none, the whole prompt is prefilled). Rows by position import any n; a streaming
        state that cannot be rewound below its committed position (DeepSeek-V4) imports only the
        whole prefix (n == len(item.token_ids)), so a prompt equal to the prefix imports nothing."""
        return n

    def import_prefix(self, req: Hashable, item: Any, n: int) -> None:
        """Positions 0..n-1 of a stored prefix `item` (kv/memory/prefix_store.py) into req
        (n = `import_len(item, matched)` > 0)."""
        self.write_rows(req, item.latent[:, :n], item.index[:, :n])

    def set_prefix_match(self, match: PrefixMatch) -> None:
        """The engine's prefix matcher; stores whose admission depends on it keep it (default: unused)."""

    # -- what the engine reports and the step graphs need (defaults: none) -------------------------
    def prompt_chunk_limit(self, req: Hashable) -> int | None:
        """The most prompt tokens req may compute in one pass, or None (the step's token budget
        alone): a hierarchy's host-first request feeds its prompt through the decode path."""
        return None

    def staging_rows(self, layer: int = 0) -> torch.Tensor | None:
        """The verification staging arena [1, R, latent_dim] layer `layer`'s attention may read
        besides its pages (a second row space), or None."""
        return None

    def resolver_census(self) -> Any:
        """The resolver's `Census` (kv/hier/census.py), or None for stores without a resolver."""
        return None

    @property
    def hot_cache_rows(self) -> int:
        """B: hot-cache rows per request and selection source (0: the store has no hot cache)."""
        return 0

    def host_usage(self) -> Any:
        """The host backing pool's `PoolUsage`, or None for stores without one."""
        return None

    def residency(self) -> Any:
        """The `ResidencyManager` (kv/hier/residency.py) of load-adaptive stores, or None."""
        return None

    def graph_context(self) -> type | None:
        """The KVContext class whole-step CUDA graphs capture (`for_graph`, `graph_templates`),
        or None: this store's passes never replay from a step graph."""
        return None

    @property
    def replayable(self) -> bool:
        """Whether decode passes can replay from a step graph."""
        return self.graph_context() is not None

    def graph_fingerprint(self) -> tuple:
        """Addresses a captured step graph bakes in that may change while serving."""
        return ()

    def prepare_replay(self) -> None:
        """Apply pending device-side updates a replayed graph reads directly."""

    # -- where rows live ---------------------------------------------------------------------------
    def row_place(self, req: Hashable, position: int, layer: int = 0) -> RowPlace:
        """Where row `position` of req lives for `layer`'s attention, between passes (debug checks
        and tests; reads the device, so never on the serving path)."""
        raise NotImplementedError(f"{type(self).__name__} does not report row places")
