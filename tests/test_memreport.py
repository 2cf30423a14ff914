"""Per-request memory report: hisparse holds far less device memory than resident, and its
required state does not grow with context except for the index keys."""

from dhisparse.bench.memreport import report


def test_memory_report_glm52_shape():
    rows = {(r["preset"], r["context"]): r for r in report()}
    res, hs = rows[("resident", 102400)], rows[("hisparse", 102400)]
    assert res["device_total"] / hs["device_total"] > 8
    # 4096 rows x 78 layers x 1152 B (bf16 latent rows) = 0.343 GiB of hot cache
    assert abs(hs["hot_cache"] - 4096 * 78 * 1152 / 2**30) < 1e-6
    assert rows[("hisparse", 32768)]["hot_cache"] == hs["hot_cache"]
    assert hs["host_backup"] >= 102400 * 78 * 1152 / 2**30


def test_speculative_required_state():
    rows = {(r["preset"], r["context"]): r for r in report()}
    ada, spec = rows[("adaptive", 102400)], rows[("adaptive+spec", 102400)]
    assert abs(spec["draft_ring"] - 12288 * 2176 / 2**30) < 1e-9  # eq. 9: R_d = 2176 for W 2048, p 64, K_max 8
    assert abs(spec["staging"] - 8 * 2048 * 1152 / 2**30) < 1e-9  # eq. 11 share of one slot, chi = 1
    assert spec["device_total"] - ada["device_total"] < 0.06  # bounded by the window, not the context
    assert rows[("adaptive+spec", 32768)]["draft_ring"] == spec["draft_ring"]
