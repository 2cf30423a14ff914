"""Hooks a rank of a prefill/decode world runs on its engine (engine/disagg_launch.py
on_engine="disagg_hooks:NAME"), and the breakages the disaggregation tests must catch."""

from __future__ import annotations

import torch

from dist_hooks import row_checker

DECODE_RANK = 1  # the worlds of tests/test_disagg.py: rank 0 prefill, the last rank decode
EP_DECODE_RANK = 2  # tests/test_disagg_ep.py's 2 + 2 world: ranks 2 and 3 decode


def ep_placement_checker(engine, rank: int) -> None:
    """`placement_checker` in a world of 2 prefill + 2 decode ranks with --ep-size 2 per role; also
    every MoE layer holds the expert block of the rank's index in its role (rank mod 2: 4 of 8)."""
    from dhisparse.layers.ep_moe import EPMoE

    moes = [layer.mlp for layer in engine.model.model.layers if isinstance(layer.mlp, EPMoE)]
    assert moes and all((m.rank, m.world, m.experts.gate_up_proj.shape[0]) == (rank % 2, 2, 4) for m in moes), rank
    placement_checker(engine, rank, EP_DECODE_RANK)


def placement_checker(engine, rank: int, first_decode: int = DECODE_RANK) -> None:
    """The row checker (I2) on every rank; on a decode rank also: each arrived prompt's rows are where
    the store says its admission put them (`prompt_chunk_limit` is not None: host-first):

        host-first     every complete-page row has a host copy and is read from host (tier "host")
        resident       adaptive: published optional history (tier "optional"); resident: "resident"
        partial page   the tail, whichever placement
    A mismatch fails the rank (rank 0 sees it lost)."""
    row_checker(engine, rank)
    if rank < first_decode:
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


def v4_checker(engine, rank: int) -> None:
    """DeepSeek-V4's row checks on a decode rank of a hierarchical preset (V4 has no dense-mirror
    checker; `resident` keeps every row in its dense store, checked by tokens alone):

        I2   every CSA row a pass locates or reuses is exactly the selected row of the right request
             (`v4_engine_util.SourceCheck`); an arrived prompt's rows are shadowed from the bytes it
             received (its tiered item), the rows it emits here from what it emits
        I1   after every step each row below a decoding request's tail has a host copy equal to its
             shadow, or is published optional history
    A mismatch fails the rank (rank 0 sees it lost). Rank 0 (this test process) is left unpatched."""
    import pytest

    from v4_engine_util import SourceCheck

    if rank < DECODE_RANK or engine.config.base_preset == "resident":
        return
    ck, store = SourceCheck().install(pytest.MonkeyPatch()), engine.store
    inner_import, inner_step = store.import_prefix, engine.step

    def import_prefix(req, item, n):
        for g, layer in enumerate(engine.model_config.csa_sources):
            for w in range(n // store.m):
                ck.rows[(req, layer, w)] = item.tiered.latent[g, w].clone()
        inner_import(req, item, n)

    def step():
        outs = inner_step()
        host_copies_equal_shadow(store.kv, engine.model_config.csa_sources, ck.rows)
        return outs

    store.import_prefix, engine.step = import_prefix, step


def host_copies_equal_shadow(kv, sources, shadow: dict) -> None:
    """I1 of a V4 row hierarchy `kv` against shadow rows {(req, source layer, row): stored row}."""
    for req, st in kv.reqs.items():
        for w in range(st.tail_start if st.decoding else 0):
            place = kv.row_place(req, w)
            assert place.host >= 0 or place.tier == "optional", f"I1: row {w} of {req} ({place})"
            if place.host >= 0:
                h, ps = place.host, kv.host.page_size
                for g, layer in enumerate(sources):
                    got = kv.host.layer_rows(g)[h // ps, h % ps]
                    want = shadow[(req, layer, w)].to(got.device)
                    assert torch.equal(got, want), f"I1: row {w} of {req}, source {layer}"
