"""The DSA training recipe (dhisparse/train/dsa.py) in its CPU smoke mode: a few steps of each
stage on a slice of the corpus. The dense stage lowers the language loss; the warm-up lowers the
indexer's KL to its attention without touching the rest of the model; the sparse stage trains with
the selection; the indexer scores recomputed with gradients select what transformers' indexer
selects; the checkpoint loads into the engine and decodes as transformers does."""

from __future__ import annotations

import pytest
import torch

from dhisparse import SamplingParams
from dhisparse.engine.llm import LLM
from dhisparse.train import dsa
from dhisparse.train.corpus import Corpus
from dhisparse.train.tokenizer import save_tokenizer, train_tokenizer
from hf_fixtures import greedy_hf
from tie_rule import tie_rule

SMALL = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4, kv_lora_rank=32,
             q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, index_head_dim=16,
             index_topk=8, indexer_types=["full", "full", "shared", "full"], first_k_dense_replace=2,
             max_position_embeddings=256)
SEQ = 48


@pytest.fixture(scope="module")
def data():
    corpus = Corpus.build(max_files=12, share=0.2)
    tok = train_tokenizer([f.text for f in corpus.train], 400)
    train = torch.tensor(tok.encode(Corpus.text(corpus.train)).ids[:20000])
    held = Corpus.text(corpus.heldout)[:4000]
    return tok, train, torch.tensor(tok.encode(held).ids), len(held.encode())


def test_stages_and_a_loadable_checkpoint(data, tmp_path):
    tok, train, held, held_bytes = data
    torch.set_num_threads(1)
    model = dsa.build_model(dsa.small_config(tok.get_vocab_size(), **SMALL), seed=0)
    dense = dsa.train_stage(model, "dense", train, 30, seq_len=SEQ, batch=4, log_every=5)
    assert dense.lm_loss[-1] < dense.lm_loss[0] - 0.5, dense.lm_loss
    before = {n: p.detach().clone() for n, p in model.named_parameters() if ".indexer." not in n}
    warm = dsa.train_stage(model, "warmup", train, 20, seq_len=SEQ, batch=4, log_every=5)
    assert warm.kl_loss[-1] < warm.kl_loss[0], warm.kl_loss
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)  # frozen
    sparse = dsa.train_stage(model, "sparse", train, 10, seq_len=SEQ, batch=4, topk=8, log_every=5)
    assert all(torch.isfinite(torch.tensor(sparse.lm_loss + sparse.kl_loss)))
    dense_bpb = dsa.bits_per_byte(model, held, held_bytes, SEQ)
    sparse_bpb = dsa.bits_per_byte(model, held, held_bytes, SEQ, topk=8)
    assert 0 < dense_bpb < 8 and 0 < sparse_bpb < 8
    model.save_pretrained(tmp_path)
    save_tokenizer(tok, tmp_path)
    llm = LLM(str(tmp_path), device="cpu")
    prompt = tok.encode("def main():\n    ").ids
    ours = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    dsa.set_topk(model, 8)
    assert ours == greedy_hf(tie_rule(model), prompt, 8)


def test_recomputed_scores_select_what_the_indexer_selects(data):
    tok, train, _, _ = data
    model = dsa.build_model(dsa.small_config(tok.get_vocab_size(), **SMALL), seed=1).eval()
    catch = dsa._Catch(model)
    try:
        with torch.no_grad():
            model(input_ids=train[None, :SEQ])
        ix = dsa.indexers(model)[0]
        hidden, q_resid, pos, mask, selected = catch.inputs[0]
        scores = dsa.indexer_scores(ix, hidden, q_resid, pos, mask)
        mine = scores.topk(selected.shape[-1], dim=-1).indices.sort(-1).values
        assert torch.equal(mine, selected.long().sort(-1).values)
    finally:
        catch.close()


def test_the_model_stage_writes_a_checkpoint_and_a_record(tmp_path):
    import json

    from dhisparse.train.__main__ import main
    from train_fixtures import cli_model

    cli_model(tmp_path)
    record = json.loads((tmp_path / "m" / "model_record.json").read_text())
    assert [s["stage"] for s in record["stages"]] == ["dense", "warmup", "sparse"]
    assert record["heldout_bits_per_byte"]["dense"] > 0 and record["config"]["index_topk"] == 16
    assert LLM(str(tmp_path / "m"), device="cpu").generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].token_ids
    assert main(["model", "--tokenizer", str(tmp_path / "absent"), "--out", str(tmp_path / "x")]) == 2
