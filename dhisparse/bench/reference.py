"""The oracle drafter's reference, kept in a file between processes.

A serving run with the oracle drafter first decodes every distinct prompt greedily without
speculation (`gpu_serving.oracle_reference`): at glm5-faithful's 100K, C20 and 1,024-token outputs
that is ~100 s of a 600-s device call. The outputs depend only on the model, the prompts, the row
format and the code, so a later call on the same code can read them back instead:

    {"key": {model, dtype, kv_cache_dtype, input_len, output_len, distinct_suffixes, code[, prompts]},
     "commit": the commit it was made at (information only),
     "outputs": {"0": [token ids of suffix 0's greedy output], ...}}

`code` is `code_digest()`: a hash of every file of the dhisparse subpackages a greedy decode runs (the
models and their seeded weights, the tokenizer, kernels, layers, stores, engine, speculation, core), that is
every file but those of `bench/`, `cli/`, `server/` and `train/` (`NOT_DECODED`: none of the others imports
them). A commit that changes only docs, tests, bench scripts, plots or the server keeps it, so a carried
reference stays valid across such commits (a device session keeps the ~150-s decode of its first call);
any change to the decoding code refuses it. The prompt builders live in `bench/`, so the caller adds
`prompts`, `prompts_digest` of the prompts themselves: a changed prompt refuses the file whatever built it.

Prompts are not stored (100K ids each): suffix i's prompt is the prepared prefix followed by
`suffix_text(i)`, rebuilt by the caller. A file whose key differs from the run's is refused with
the fields that differ: a reference from other code or another row format would make the oracle
propose tokens the target does not produce (its `oracle_off_reference_share` would show it). A key
may carry fields beyond these (a parallel world's `layout`); they must match too.

The ranks of a parallel world (dhisparse/bench/multi.py) cannot rebuild the prompts, so its file
also maps each prompt's digest to its suffix, `"prompts": {prompt_digest(ids): i}` (`save_reference`
with `prompts`), and each rank reads it through `FileReference` (prompt ids -> output ids) while the
world runs. Files are written whole and renamed into place: a reader never sees half a file.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
from pathlib import Path

KEY_FIELDS = ("model", "dtype", "kv_cache_dtype", "input_len", "output_len", "distinct_suffixes", "code")
_PACKAGE = Path(__file__).resolve().parent.parent  # dhisparse/
_DIGESTS: dict[Path, str] = {}
NOT_DECODED = ("bench", "cli", "server", "train")  # subpackages no greedy decode runs (code_digest skips them)


class ReferenceMismatch(ValueError):
    """A reference file made for another run; the message names the fields that differ."""


def code_digest(root: Path | None = None) -> str:
    """blake2b (16 bytes, hex) of every file under root, each as its relative path and bytes in sorted
    order; __pycache__ and .pyc files are skipped. Default root: the dhisparse package without its
    `NOT_DECODED` subpackages (module docstring). Computed once a process per root (~0.1 s)."""
    skip = NOT_DECODED if root is None else ()
    root = Path(root) if root is not None else _PACKAGE
    if root not in _DIGESTS:
        h = hashlib.blake2b(digest_size=16)
        for f in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                        and p.suffix != ".pyc" and p.relative_to(root).parts[0] not in skip):
            rel = f.relative_to(root).as_posix().encode()
            h.update(len(rel).to_bytes(4, "little") + rel)
            data = f.read_bytes()
            h.update(len(data).to_bytes(8, "little") + data)
        _DIGESTS[root] = h.hexdigest()
    return _DIGESTS[root]


def reference_key(model: str, dtype: str, kv_cache_dtype: str, input_len: int, output_len: int,
                  distinct_suffixes: int, code: str | None = None) -> dict:
    """What a reference's tokens depend on; code defaults to this process's `code_digest()`."""
    code = code_digest() if code is None else code
    return dict(zip(KEY_FIELDS, (model, dtype, kv_cache_dtype, input_len, output_len, distinct_suffixes, code)))


def prompt_digest(ids) -> str:
    """A prompt's key in a reference file's `prompts` (its ids as int64, hashed)."""
    return hashlib.blake2b(array.array("q", [int(t) for t in ids]).tobytes(), digest_size=16).hexdigest()


def prompts_digest(prompts) -> str:
    """A reference key's `prompts`: the prompts (suffix i's ids at i) in order, hashed."""
    h = hashlib.blake2b(digest_size=16)
    for ids in prompts:
        h.update(prompt_digest(ids).encode())
    return h.hexdigest()


def save_reference(path: str | Path, key: dict, outputs: dict[int, list[int]], prompts: list | None = None,
                   commit: str | None = None) -> Path:
    """Write outputs (suffix index -> greedy output ids) under key, and with `prompts` (suffix i's
    prompt ids at i) their digests; `commit` is recorded for the reader, not matched. Written whole
    and renamed into place. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data: dict = {"key": key, "commit": commit}
    if prompts is not None:
        data["prompts"] = {prompt_digest(p): i for i, p in enumerate(prompts)}
    data["outputs"] = {str(i): list(map(int, v)) for i, v in sorted(outputs.items())}
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)
    return path


def load_reference(path: str | Path, key: dict) -> dict[int, list[int]] | None:
    """The outputs in path if it exists and was made under key; None if there is no file.

    Raises ReferenceMismatch naming the differing fields (`code`: made by other package files), and
    ValueError for a file that is not a reference or lacks a suffix."""
    path = Path(path)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "key" not in data or "outputs" not in data:
        raise ValueError(f"{path}: not an oracle reference file (needs 'key' and 'outputs')")
    fields = [*KEY_FIELDS, *(k for k in key if k not in KEY_FIELDS)]
    diff = {k: (data["key"].get(k), key[k]) for k in fields if data["key"].get(k) != key[k]}
    if diff:
        said = ", ".join(f"{k}: file {a!r}, run {b!r}" for k, (a, b) in diff.items())
        raise ReferenceMismatch(f"{path}: made for another run ({said}); delete it or point --reference-file elsewhere")
    outputs = {int(i): list(v) for i, v in data["outputs"].items()}
    missing = [i for i in range(key["distinct_suffixes"]) if i not in outputs]
    if missing:
        raise ValueError(f"{path}: no output for suffixes {missing[:8]}")
    return outputs


class FileReference:
    """The oracle's reference as a callable (prompt ids -> output ids) over a reference file with
    `prompts` that may appear or change while a world runs: read again whenever its mtime moves; a
    prompt it does not hold gets [] (no drafts)."""

    def __init__(self, path: str | Path) -> None:
        self.path, self.mtime = Path(path), None
        self.prompts: dict[str, int] = {}
        self.outputs: dict[str, list[int]] = {}

    def __call__(self, prompt) -> list[int]:
        self._reload()
        i = self.prompts.get(prompt_digest(prompt))
        return [] if i is None else self.outputs[str(i)]

    def _reload(self) -> None:
        try:
            mtime = self.path.stat().st_mtime_ns
        except OSError:
            return
        if mtime != self.mtime:
            data = json.loads(self.path.read_text())
            self.prompts, self.outputs, self.mtime = data["prompts"], data["outputs"], mtime


CYCLE_SPAN = 16  # cycle_share looks for periods 1..CYCLE_SPAN


def cycle_share(tokens: list[int], span: int = CYCLE_SPAN) -> tuple[float, int]:
    """(share, d): the largest share, over periods d in 1..span, of `tokens` equal to the token d before
    them, and that period (the smallest d reaching it; (0.0, 0) for fewer than two tokens). One token
    repeated gives ~1 at d = 1, a cycle of four tokens ~1 at d = 4; byte text (this repository's
    README and design notes, the paper) gives at most 0.19 a 1,024-token window, 0.08 on average."""
    best, period = 0.0, 0
    for d in range(1, min(span, len(tokens) - 1) + 1):
        share = sum(a == b for a, b in zip(tokens, tokens[d:])) / (len(tokens) - d)
        if share > best:
            best, period = share, d
    return best, period


def output_diversity(outputs: dict[int, list[int]]) -> dict:
    """How varied a reference's greedy outputs are: `distinct_ids` (mean distinct ids an output),
    `repeat_share` (share of tokens equal to the one before), `cycle_share` (mean over outputs of
    `cycle_share`: tokens equal to the one d <= 16 before, at each output's worst d) with
    `cycle_periods` (each output's d), `distinct_outputs` (how many of the outputs differ from each
    other), `n`. A model whose outputs repeat one token for every prompt (glm5-faithful before
    session 36) makes an oracle's accepted drafts identical tokens: every query of a round then differs
    only by position, which flatters a round's retrieval union; a short cycle (a random model's greedy
    map over a long fixed context: four tokens over and over, session 40) does the same with
    repeat_share near 0."""
    outs = [list(o) for o in outputs.values()]
    if not outs:
        return {"n": 0, "distinct_ids": 0.0, "repeat_share": 0.0, "cycle_share": 0.0, "cycle_periods": [],
                "distinct_outputs": 0}
    pairs = sum(max(0, len(o) - 1) for o in outs)
    repeats = sum(a == b for o in outs for a, b in zip(o, o[1:]))
    cycles = [cycle_share(o) for o in outs]
    return {"n": len(outs), "distinct_ids": sum(len(set(o)) for o in outs) / len(outs),
            "repeat_share": repeats / pairs if pairs else 0.0, "cycle_share": sum(c for c, _ in cycles) / len(outs),
            "cycle_periods": [d for _, d in cycles], "distinct_outputs": len({tuple(o) for o in outs})}


def check_diversity(div: dict, max_repeat: float) -> None:
    """Refuse a degenerate reference before any window runs: ValueError (naming
    `--max-reference-repeat`) when its `cycle_share` (tokens equal to the one d <= 16 before, at each
    output's worst d; `repeat_share`, d = 1 alone, for a result written before it existed) is above
    `max_repeat`. Sessions 36-37 decoded glm5-faithful references of one token repeated, session 39's
    settled on one after 128-500 tokens, and a random model over a long fixed context cycles through a
    few tokens (session 40); byte text stays under 0.2. 1.0 lets any reference through."""
    share = div.get("cycle_share", div.get("repeat_share", 0.0))
    if div.get("n") and share > max_repeat:
        periods = sorted(set(div.get("cycle_periods", [1])))
        raise ValueError(f"--max-reference-repeat: {100 * share:.1f}% of the reference's tokens repeat the one "
                         f"d <= {CYCLE_SPAN} before (d {periods}; limit {100 * max_repeat:.0f}%; "
                         f"{100 * div['repeat_share']:.1f}% the one before, {div['distinct_ids']:.1f} distinct ids an "
                         f"output, {div['distinct_outputs']} distinct outputs of {div['n']}): the model's greedy "
                         "output is degenerate, so an oracle's rounds would replay a few tokens; fix the model or "
                         "pass 1.0")
