"""The completion check and curves of a trained model (dhisparse/train/evaluate.py)."""

from __future__ import annotations

import json

from dhisparse.train import evaluate
from dhisparse.train.corpus import Corpus, CorpusFile


def test_body_of_keeps_the_indented_lines_and_stops_at_the_next_statement():
    sig = "    def area(self, r):"
    completion = "\n        return r * r\n\n    def other(self):\n        pass"
    assert evaluate.body_of(sig, completion) == "        return r * r"
    assert evaluate.parses(sig, completion)
    assert not evaluate.parses(sig, "\n    def other(self):\n        pass")  # no body: not a completion
    assert not evaluate.parses("def f(x):", "\n    return (x +")  # unbalanced: does not parse
    assert evaluate.parses("def f(x):", '\n    """Doc."""\n    if x:\n        return 1\n\n    return 2\nclass A: pass')



def test_a_completion_cut_by_the_token_limit_drops_its_unfinished_line():
    cut = "\n    x = 1\n    return (x +"
    assert evaluate.body_of("def f(x):", cut, cut=True) == "    x = 1"
    assert evaluate.parses("def f(x):", cut, cut=True) and not evaluate.parses("def f(x):", cut)
    assert not evaluate.parses("def f(x):", "\n    return (x +", cut=True)  # nothing complete: no body


def test_the_prompt_is_the_bare_signature(monkeypatch):
    """The trained tokenizer merges a newline with the next line's indentation, so a prompt ending
    in a bare newline asks for a line at column 0 (1 of 20 parsed that way on tiny-code, 12 of 20
    without): completion_check sends the signature as is and judges a cut completion by its
    complete lines."""
    from types import SimpleNamespace

    from dhisparse.models.registry import builtin_folder
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(builtin_folder("tiny-code") / "tokenizer.json"))
    ids = tok.encode("    def f(self):\n        return 1").ids
    assert tok.decode([ids[-3]]).startswith("\n ")  # newline + indent: one token
    sent = []

    class FakeLLM:
        def __init__(self, *a, **k):
            pass

        def generate(self, prompts, params):
            sent.extend(prompts)
            return [SimpleNamespace(text="\n    return 1\n    x = (", finish_reason="length") for _ in prompts]

    monkeypatch.setattr(evaluate, "LLM", FakeLLM)
    files = [CorpusFile("a.py", "def g(y):\n    pass\n")]
    c = evaluate.completion_check("unused", files, n=1)
    assert sent == ["def g(y):"] and c["parsed"] == 1 and c["samples"][0]["finish_reason"] == "length"


def test_signatures_are_fixed_and_spread_over_files():
    files = [CorpusFile(f"m{i}.py", f"def a{i}(x):\n    pass\n\nclass C:\n    def b{i}(self, y) -> int:\n        return 1\n")
             for i in range(5)]
    sigs = evaluate.signatures(files, 7)
    assert len(sigs) == 7 and sigs == evaluate.signatures(list(reversed(files)), 7)
    assert len({s.strip().split("(")[0][-1] for s in sigs[:5]}) == 5  # the first five: one per file
    assert all(evaluate.SIGNATURE.fullmatch(s) for s in sigs)


def test_the_evaluate_stage_writes_completions_and_curves(tmp_path):
    from dhisparse.train.__main__ import main
    from train_fixtures import SMOKE, cli_model

    cli_model(tmp_path, "--save-dtype", "bfloat16")
    saved = json.loads((tmp_path / "m" / "model_record.json").read_text())["saved_weights_bits_per_byte"]
    assert saved["dtype"] == "bfloat16" and saved["sparse"] > 0
    assert json.loads((tmp_path / "m" / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    assert main(["evaluate", "--model", str(tmp_path / "m"), *SMOKE, "--signatures", "3", "--max-tokens", "8"]) == 0
    record = json.loads((tmp_path / "m" / "eval_record.json").read_text())
    c = record["completions"]
    # as many as the slice's held-out files hold (3 here; 1 on the H200's Python 3.12 stdlib)
    n = len(evaluate.signatures(Corpus.build(max_files=12, share=0.2).heldout, 3))
    assert c["of"] == n >= 1 and 0 <= c["parsed"] <= n and len(c["samples"]) == n
    assert (tmp_path / "m" / "curves.png").stat().st_size > 1000
    assert main(["evaluate", "--model", str(tmp_path / "absent")]) == 2
    assert len(Corpus.build(max_files=12, share=0.2).heldout) > 0
