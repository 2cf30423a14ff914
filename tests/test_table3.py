"""Table 3 measurement (`dhisparse.bench.table3`) on tiny stand-ins of both models: the counters
it reports are per decode token and per step, and follow the models' structure (selections =
selecting layers x k once histories exceed k; one resolver call per selecting layer; follower
copies only on GLM; a missed V4.1 selection moves one source row)."""

from __future__ import annotations

import json

import pytest

from dhisparse.bench import table3
from dhisparse.models.tiny import build_tiny
from v4_engine_util import loaded_v41
from v4_fixtures import one_thread as _one_thread

one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)


def test_table3_cli_on_tiny_models(tmp_path, monkeypatch):
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
            "--output-len", "8", "--warmup", "2", "--threads", "1", "--page-size", "4"]
    assert table3.main(args) == 0
    d = json.loads(out.read_text())
    assert d["kind"] == "table3" and d["command"].startswith("python -m dhisparse.bench.table3 --out")
    g, v = d["runs"]
    assert g["selections_per_token"] == 3 * 16 and g["resolver_calls_per_step"] == 3.0
    assert g["follower_copies_per_step"] == 3.0 and g["host_fetched_share"] > 0
    assert v["selections_per_token"] == 4 * 3 and v["resolver_calls_per_step"] == 4.0
    assert v["follower_copies_per_step"] == 0.0 and v["bytes_per_missed_selection"] == 32 * 4
    assert v["host_fetched_share"] > 0
    assert v["full_plan"]["selections_per_token"] == 8 * 3 and v["decode_tokens"] > 0
