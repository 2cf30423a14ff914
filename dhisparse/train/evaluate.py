"""What a person sees of a trained model: greedy completions of held-out function signatures, and
the training curves.

Completion check (issue 29): `signatures` picks n function signatures (`def name(args):` on one
line at any indentation) spread over the held-out files, deterministically; each is completed
greedily by our engine; the signature plus the completion's lines that belong to its body (the
lines up to the first non-blank one indented no deeper than the signature) must `ast.parse`. A
completion the token limit cut keeps only its complete lines (the line being written when the limit
came is dropped: the model had not finished it).

    signature   "    def area(self, r):"           (the prompt, as is; dedented before parsing)
    completion  "\\n        return r * r\\n\\n    def ..."   -> body "        return r * r"
    parsed      "def area(self, r):\\n    return r * r"
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import textwrap
from pathlib import Path

from dhisparse.core.params import SamplingParams
from dhisparse.engine.llm import LLM
from dhisparse.train.corpus import CorpusFile

SIGNATURE = re.compile(r"^([ \t]*)def [A-Za-z_]\w*\([^()\n]*\)(?: -> [^:\n]+)?:[ \t]*$", re.M)


def signatures(files: list[CorpusFile], n: int = 20) -> list[str]:
    """n held-out signatures, one per file in turn (files ordered by the hash of their path, each
    file's signatures by the hash of their text), so the pick spreads over files and is fixed."""
    per_file = []
    for f in sorted(files, key=lambda f: hashlib.sha256(f.path.encode()).hexdigest()):
        found = sorted({m.group(0) for m in SIGNATURE.finditer(f.text)}, key=lambda s: hashlib.sha256(s.encode()).hexdigest())
        if found:
            per_file.append(found)
    out: list[str] = []
    depth = 0
    while len(out) < n and any(depth < len(s) for s in per_file):
        out += [s[depth] for s in per_file if depth < len(s)][: n - len(out)]
        depth += 1
    return out


def body_of(signature: str, completion: str, cut: bool = False) -> str:
    """The completion's lines that belong to the signature's body (module docstring); `cut` (the
    token limit ended the completion) drops the unfinished last line."""
    indent = len(signature) - len(signature.lstrip())
    lines = completion.split("\n")
    if cut:
        lines = lines[:-1]
    if lines and not lines[0].strip():
        lines = lines[1:]  # the newline that ends the signature's line
    body = []
    for line in lines:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        body.append(line)
    return "\n".join(body).rstrip()


def parses(signature: str, completion: str, cut: bool = False) -> bool:
    """Whether the signature plus its completed body is valid Python (a body is required)."""
    body = body_of(signature, completion, cut)
    if not body.strip():
        return False
    try:
        ast.parse(textwrap.dedent(signature + "\n" + body))
    except SyntaxError:
        return False
    return True


def completion_check(folder: str | Path, files: list[CorpusFile], n: int = 20, max_tokens: int = 256,
                     device: str = "cpu", preset: str = "resident") -> dict:
    """Greedy completions of `signatures(files, n)` by our engine; the share that parses."""
    sigs = signatures(files, n)
    llm = LLM(str(folder), device=device, preset=preset)
    # the prompt is the signature without its newline: the tokenizer merges a newline with the next
    # line's indentation ("\n" + 8 spaces is one token), so a prompt ending in a bare "\n" would ask
    # for a line at column 0
    outs = llm.generate(sigs, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    samples = [{"signature": s, "completion": o.text, "finish_reason": o.finish_reason,
                "parses": parses(s, o.text, cut=o.finish_reason == "length")} for s, o in zip(sigs, outs)]
    ok = sum(x["parses"] for x in samples)
    return {"rule": "signatures `def name(args):` spread over the held-out files; greedy completion; the signature "
                    "plus the completion's body lines must ast.parse (a completion cut by the token limit "
                    "keeps only its complete lines)", "preset": preset, "max_tokens": max_tokens,
            "parsed": ok, "of": len(samples), "share": ok / max(len(samples), 1), "samples": samples}


def plot_curves(records: list[dict], out: str | Path) -> Path:
    """Training curves of a model record (dense / warm-up / sparse: language and indexer KL loss)
    and, when given, an MTP record, on one figure (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_lm, ax_kl) = plt.subplots(1, 2, figsize=(10, 3.6))
    for rec in records:
        if rec.get("stage") == "model":
            x0 = 0
            for st in rec["stages"]:
                n = len(st["lm_loss"])
                xs = [x0 + i * st["steps"] / max(n - 1, 1) for i in range(n)]
                ax_lm.plot(xs, st["lm_loss"], label=f"{st['stage']} (next token)")
                if st["stage"] != "dense":
                    ax_kl.plot(xs, st["kl_loss"], label=f"{st['stage']} indexer KL")
                x0 += st["steps"]
        elif rec.get("stage") == "mtp":
            n = len(rec["loss"])
            ax_lm.plot([i * rec["steps"] / max(n - 1, 1) for i in range(n)], rec["loss"], label="MTP (next-next token)")
    ax_lm.set(xlabel="step", ylabel="cross-entropy (nats)", title="language losses")
    ax_kl.set(xlabel="step (from the start of training)", ylabel="KL", title="indexer vs attention")
    for ax in (ax_lm, ax_kl):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def load_records(folder: str | Path) -> list[dict]:
    """The stage records a model folder holds (model_record.json, mtp_record.json)."""
    folder = Path(folder)
    return [json.loads((folder / n).read_text()) for n in ("model_record.json", "mtp_record.json") if (folder / n).is_file()]
