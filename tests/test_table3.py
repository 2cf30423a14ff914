"""Table 3 measurement (`dhisparse.bench.table3`) on tiny stand-ins of both models: the counters
it reports are per decode token and per step, and follow the models' structure (selections =
selecting layers x k once histories exceed k; one resolver call per selecting layer; follower
copies only on GLM; a missed V4.1 selection moves one source row)."""

from __future__ import annotations

import json

import pytest
import torch

from dhisparse.bench import table3
from dhisparse.models.tiny import build_tiny
from v4_engine_util import loaded_v41
from v4_fixtures import one_thread as _one_thread

one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)


def run_tiny_table3(tmp_path, monkeypatch, *extra: str) -> dict:
    """table3.main on tiny stand-ins of GLM-5.2 (the built-in tiny) and V4.1; the result file."""
    def glm(setup, seed, device):
        cfg = build_tiny(seed).config
        return build_tiny(seed), dict(selecting=len(cfg.full_layers), payload=cfg.num_layers, sources=cfg.num_layers,
                                      k=cfg.index_topk, width=cfg.latent_dim, full_selecting=21, full_payload=78)

    def v41(setup, seed, device):
        loaded = loaded_v41()
        c = loaded.config
        return loaded, dict(selecting=len(c.selecting_layers), payload=len(c.csa_sources), sources=len(c.csa_sources),
                            k=c.index_topk, width=c.head_dim, full_selecting=8, full_payload=4)

    monkeypatch.setattr(table3, "_glm", glm)
    monkeypatch.setattr(table3, "_v41", v41)
    out = tmp_path / "t3.json"
    args = ["--out", str(out), "--glm-prompt", "40", "--v41-prompt", "40", "--glm-hot", "16", "--v41-hot", "4",
            "--output-len", "8", "--warmup", "2", "--threads", "1", "--page-size", "4", *extra]
    assert table3.main(args) == 0
    return json.loads(out.read_text())


def test_table3_cli_on_tiny_models(tmp_path, monkeypatch):
    d = run_tiny_table3(tmp_path, monkeypatch)
    assert d["kind"] == "table3" and d["command"].startswith("python -m dhisparse.bench.table3 --out")
    g, v = d["runs"]
    assert g["selections_per_token"] == 3 * 16 and g["resolver_calls_per_step"] == 3.0
    assert g["follower_copies_per_step"] == 3.0 and g["host_fetched_share"] > 0
    assert v["selections_per_token"] == 4 * 3 and v["resolver_calls_per_step"] == 4.0
    assert v["follower_copies_per_step"] == 0.0 and v["bytes_per_missed_selection"] == 32 * 4
    assert v["host_fetched_share"] > 0
    assert v["full_plan"]["selections_per_token"] == 8 * 3 and v["decode_tokens"] > 0


def test_table3_fp8_rows_come_from_the_arena(tmp_path, monkeypatch):
    """--kv-cache-dtype fp8_e4m3 reaches the engine: row_bytes is the arena's stored row
    (`formats.latent.nbytes`, not elements x itemsize) and the census moves those bytes."""
    from dhisparse.core.kvformat import KVFormats

    tiny = build_tiny(0).config
    v4 = loaded_v41().config
    glm_row = KVFormats.mla("fp8_e4m3", tiny.latent_dim, tiny.qk_rope_head_dim, tiny.index_head_dim, torch.float32).latent.nbytes
    v4_row = KVFormats.v4("fp8_e4m3", v4.head_dim, v4.rope_head_dim, v4.index_head_dim, torch.float32).latent.nbytes
    # tiny GLM: 32 e4m3 + 1 fp32 scale + 8 bf16 rope = 52 B (float32 plain: 160 B); tiny V4.1: head_dim 32 -> 24 e4m3 + 16 B
    # rope + 1 e8m0 + pad to 8 = 48 B (float32 plain: 128 B)
    assert (glm_row, v4_row) == (52, 48)

    d = run_tiny_table3(tmp_path, monkeypatch, "--kv-cache-dtype", "fp8_e4m3")
    g, v = d["runs"]
    assert (g["kv_cache_dtype"], g["row_bytes"], v["row_bytes"]) == ("fp8_e4m3", 52, 48)
    assert "--kv-cache-dtype fp8_e4m3" in d["command"]
    # V4.1: a missed selection moves one compressed row of its source; GLM: the row of every layer of its group
    # (groups of 1 to 4 of the 6 layers): whole 52-B rows, never 2 B x elements
    assert v["bytes_per_missed_selection"] == 48 and v["host_fetched_share"] > 0
    assert round(g["host_bytes_per_token"] * g["decode_tokens"]) % 52 == 0 and g["host_fetched_share"] > 0
    assert 52 < g["bytes_per_missed_selection"] < 52 * 4
    assert g["hot_cache_bytes_per_session"] == 16 * 52 * 6 and v["hot_cache_bytes_per_session"] == 4 * 48 * 2
    assert g["full_plan"]["bytes_per_missed_selection"] == pytest.approx(g["bytes_per_missed_selection"] * (78 / 21) / (6 / 3))
    assert g["full_plan"]["follower_copies_per_step"] == 57 and v["full_plan"]["follower_copies_per_step"] == 0
    p = v["paper"]["bytes_per_missed_selection"]
    assert p == {"ours": 48.0, "paper": 288, "ratio": 48 / 288}
    assert g["paper"]["host_bytes_per_token"]["paper"] == [34e6, 4.2e6]
