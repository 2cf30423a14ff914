"""Hooks a rank of a prefill/decode world runs on its engine (engine/disagg_launch.py
on_engine="disagg_hooks:NAME"), and the breakages the disaggregation tests must catch."""

from __future__ import annotations

from dist_hooks import row_checker

DECODE_RANK = 1  # the worlds of tests/test_disagg.py: rank 0 prefill, the last rank decode


def placement_checker(engine, rank: int) -> None:
    """The row checker (I2) on every rank; on a decode rank also: each arrived prompt's rows are where
    the store says its admission put them (`prompt_chunk_limit` is not None: host-first):

        host-first     every complete-page row has a host copy and is read from host (tier "host")
        resident       adaptive: published optional history (tier "optional"); resident: "resident"
        partial page   the tail, whichever placement
    A mismatch fails the rank (rank 0 sees it lost)."""
    row_checker(engine, rank)
    if rank < DECODE_RANK:
        return
    store, inner = engine.store, engine.store.import_prefix

    def import_prefix(req, item, n):
        inner(req, item, n)
        if item.whole_prompt:
            check_placement(engine, req, n)

    store.import_prefix = import_prefix


def check_placement(engine, req, n: int) -> None:
    store, ps = engine.store, engine.store.page_size
    host_first = store.prompt_chunk_limit(req) is not None
    preset = engine.config.base_preset
    for p in range(n):
        place = store.row_place(req, p)
        if preset == "resident":
            want = {"resident"}
        elif p >= n // ps * ps:
            want = {"tail"}
        elif host_first:
            want = {"host"}
        else:
            want = {"optional"} if preset == "adaptive" else {"host"}  # hisparse's hand-off moved them to host
        assert place.tier in want, f"row {p} of {req!r} is {place}, admitted {'host' if host_first else 'resident'}-first"
        if preset != "resident" and place.tier == "host":
            assert place.host >= 0, f"row {p} of {req!r} has no host copy (I1)"


def hosted_as_resident_on_decode(engine, rank: int) -> None:
    """A breakage: the decode rank's store places an arrived prompt host-first while it claims a
    resident-first admission (its host-first set loses the request right after the import)."""
    placement_checker(engine, rank)
    if rank < DECODE_RANK:
        return
    store, inner = engine.store, engine.store.import_prefix

    def import_prefix(req, item, n):
        if item.whole_prompt:
            store._host_first.add(req)  # placed host-first ...
            inner(req, item, n)
            store._host_first.discard(req)  # ... but reported resident-first
            check_placement(engine, req, n)
        else:
            inner(req, item, n)

    store.import_prefix = import_prefix
