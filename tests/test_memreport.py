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
    assert abs(spec["staging"] - 4 * 8 * 2048 * 1152 / 2**30) < 1e-9  # eq. 11 share of one slot, chi = 4 (paper staging)
    assert spec["device_total"] - ada["device_total"] < 0.12  # ring 0.025 + staging 0.070 + tail: the window and width, not the context
    assert rows[("adaptive+spec", 32768)]["draft_ring"] == spec["draft_ring"]


# ---- FP8 rows (--kv-cache-dtype fp8_e4m3) ------------------------------------------------------------

GIB = 2**30
L, F, PS, B = 78, 21, 64, 4096  # GLM-5.2: layers, full index layers, page, hot cache rows


def _cdiv(a, b):
    return -(-a // b)


def _index_gib(n, w, wi):
    """Index keys of n positions: whole index pages of (L * PS * w) // (F * wi) positions, each a page of L * PS * w B."""
    page = L * PS * w
    return _cdiv(n, page // (F * wi)) * page / GIB


def hs_meta_gib(n, w=656, wi=132):
    """hisparse metadata: hot_pos, hot_stamp [G, B] + hot_loc [B] + tail_loc [2 PS] int64 and tail_start, plus the
    int32 tables of its index pages (85 at 100K in FP8) and host pages (1563)."""
    index_pages = _cdiv(n, (L * PS * w) // (F * wi))
    return ((2 * F * B + B + 2 * PS + 1) * 8 + (index_pages + _cdiv(n, PS)) * 4) / GIB


def test_fp8_rows_flow_through_every_tier():
    fp8 = {(r["preset"], r["context"]): r for r in report(kv_cache_dtype="fp8_e4m3")}
    bf = {(r["preset"], r["context"]): r for r in report(kv_cache_dtype="bfloat16")}
    assert {(r["latent_row_bytes"], r["index_row_bytes"]) for r in fp8.values()} == {(656, 132)}
    assert {(r["latent_row_bytes"], r["index_row_bytes"]) for r in bf.values()} == {(1152, 256)}
    assert report() == [r | {"kv_cache_dtype": "auto"} for r in bf.values()]  # the default stays bf16
    for n in (32768, 102400):
        hs, hb = fp8[("hisparse", n)], bf[("hisparse", n)]
        # exact byte counts: B rows x L layers x 656 B; tail 2 pages; index pages of 1181 positions of 132-B keys
        assert hs["hot_cache"] == B * L * 656 / GIB
        assert hs["tail"] == 2 * PS * L * 656 / GIB
        assert hs["host_backup"] == _cdiv(n, PS) * PS * L * 656 / GIB
        assert hs["index_state"] == _index_gib(n, 656, 132)
        assert (L * PS * 656) // (F * 132) == 1181 and (L * PS * 1152) // (F * 256) == 1069
        # the latent part scales by exactly 656/1152; the index keys by 132/256 up to whole index pages
        for k in ("hot_cache", "tail", "host_backup"):
            assert abs(hs[k] / hb[k] - 656 / 1152) < 1e-12
        assert abs(hs["index_state"] / hb["index_state"] - 132 / 256) < 0.02
        assert hs["metadata"] == hs_meta_gib(n)  # int64 slot tables + int32 page tables (whatever the rows)
        rs = fp8[("resident", n)]
        assert rs["latent_history"] == _cdiv(n, PS) * PS * L * 656 / GIB
        assert rs["index_state"] == _index_gib(n, 656, 132)
        sp = fp8[("adaptive+spec", n)]
        assert sp["staging"] == 4 * 8 * 2048 * 656 / GIB  # staged rows are stored rows, chi = 4 arenas
        assert sp["draft_ring"] == bf[("adaptive+spec", n)]["draft_ring"] == 12288 * 2176 / GIB  # model dtype


def test_paper_model_reproduces_table1():
    """The decomposition the comparison lists its components against prints the paper's digits."""
    from dhisparse.bench.memreport_paper import PAPER_CONTEXTS, PAPER_HOST_100K, PAPER_TABLE1, paper_model

    for preset, vals in PAPER_TABLE1.items():
        for label, v in vals.items():
            assert round(paper_model(preset, PAPER_CONTEXTS[label])["device_total"], 3) == v, (preset, label)
    assert round(paper_model("hisparse", 100000)["host_backup"], 3) == PAPER_HOST_100K


def test_paper_comparison_explains_the_gaps():
    from dhisparse.bench.memreport_paper import paper_comparison

    cmp = {(e["preset"], e["context"], e["quantity"]): e for e in paper_comparison()}
    hs = cmp[("hisparse", "100K", "device_total")]
    assert hs["paper_gib"] == 0.432 and hs["over_5pct"]
    assert hs["ours_gib"] == round((B * L * 656 + 2 * PS * L * 656) / GIB + _index_gib(100000, 656, 132)
                                   + hs_meta_gib(100000), 4)
    assert abs(hs["ours_at_paper_row_bytes_diff_pct"]) < 2
    assert any(line.startswith("hot_cache: ours 0.1952 GiB (4096 rows x 78 layers x 656 B)") for line in hs["explanation"])
    res = cmp[("resident", "100K", "device_total")]
    assert res["paper_gib"] == 4.444 and abs(res["ours_at_paper_row_bytes_diff_pct"]) < 0.5
    assert res["ours_gib"] == round(1563 * PS * L * 656 / GIB + _index_gib(100000, 656, 132) + (1563 + 85) * 4 / GIB, 4)
    host = cmp[("hisparse", "100K", "host_backup")]
    assert host["ours_gib"] == round(100032 * L * 656 / GIB, 4) and host["paper_model_gib"] == round(100032 * L * 576 / GIB, 4)
    assert any("staging: ours 0.0400 GiB" in s for s in cmp[("adaptive+spec", "32K", "device_total")]["explanation"])


def test_cli_kv_cache_dtype(tmp_path, capsys):
    import json

    from dhisparse.bench import memreport

    out = tmp_path / "m.json"
    assert memreport.main(["--kv-cache-dtype", "both", "--contexts", "4096", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert [r["kv_cache_dtype"] for r in d["rows"]] == ["bfloat16"] * 5 + ["fp8_e4m3"] * 5
    assert d["machine"] == "CPU, meta-device sizing" and d["paper_table1"] and "576-B" in d["paper_note"]
    assert "656-B latent rows, 132-B index keys" in capsys.readouterr().out
    assert memreport.main(["--contexts", "4096", "--out", str(out)]) == 0
    assert "paper_table1" not in json.loads(out.read_text())
