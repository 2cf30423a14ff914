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
