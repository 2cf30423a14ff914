"""Eq. 13's memory term at deploy time (engine/spec_memory.py): the bytes speculation holds for the
engine's life and the sessions of max_model_len each configuration fits, from the engine's pools."""

from __future__ import annotations

import logging

from dhisparse.engine.llm import LLM
from dhisparse.engine.spec_memory import SpecMemory


def test_speculation_costs_sessions_as_the_pools_say(caplog):
    with caplog.at_level(logging.INFO, logger="dhisparse.engine"):
        llm = LLM("tiny", preset="adaptive+spec", page_size=4, hot_cache_rows=16)
    e = llm.engine
    st = e.stats().as_dict()
    mem = e.spec_memory
    drafter = e.spec.drafter.device_bytes()
    stage_pages = len(e.arena.pool.owned_by("staging"))
    assert mem.drafter_weights == drafter.weights > 0 and mem.drafter_state == drafter.state > 0
    assert mem.staging == stage_pages * e.page_bytes > 0
    session = e.store.pages_for(e.max_model_len, 0) * e.page_bytes
    # requests hold the pool less staging and the engine's own permanent pages (on CUDA the step
    # graphs' scratch page: leaving it out here failed on the H200)
    pool = (e.arena.pool.num_pages - stage_pages - e._fixed_pages) * e.page_bytes
    assert pool == e.arena.pool.capacity * e.page_bytes
    assert (mem.pool_bytes, mem.session_bytes) == (pool, session)
    assert st["sessions_fit_spec"] == pool // session
    assert st["sessions_fit_no_spec"] == (pool + mem.spec_bytes) // session > st["sessions_fit_spec"]
    assert st["spec_bytes"] == drafter.weights + drafter.state + mem.staging
    assert any("eq. 13" in r.getMessage() and "sessions of max_model_len" in r.getMessage() for r in caplog.records)


def test_no_speculation_no_memory_term():
    e = LLM("tiny", preset="resident").engine
    assert e.spec_memory is None and "sessions_fit_spec" not in e.stats().as_dict()


def test_the_full_load_bar():
    m = SpecMemory(drafter_weights=10, drafter_state=20, staging=30, pool_bytes=940, session_bytes=100)
    assert (m.sessions(True), m.sessions(False)) == (9, 10)
    assert "TPOT_0 / TPOT_s > 1.111" in m.note()
    assert "never" in SpecMemory(0, 0, 0, 50, 100).note()


def test_deepseek_v4_staging_counts_too():
    """V4's row hierarchy stages verification unions in its own arena: its permanent pages are
    speculation's memory as well (the store does not expose them as a GLM row space)."""
    from v4_engine_util import engine, loaded_v41

    e = engine(loaded_v41(), None, preset="hisparse", hot_cache_rows=4, speculative_algorithm="ngram",
               speculative_num_draft_tokens=3)
    st, u = e.stats().as_dict(), e.store.usage()
    assert u.permanent > 0 and st["spec_staging_bytes"] == u.permanent * e.page_bytes == st["spec_bytes"]
    assert st["sessions_fit_no_spec"] > st["sessions_fit_spec"]
