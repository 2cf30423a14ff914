"""The oracle drafter's reference, kept in a file between processes.

A serving run with the oracle drafter first decodes every distinct prompt greedily without
speculation (`gpu_serving.oracle_reference`): at glm5-faithful's 100K, C20 and 1,024-token outputs
that is ~100 s of a 600-s device call. The outputs depend only on the model, the prompts, the row
format and the code, so a later call at the same commit can read them back instead:

    {"key": {model, dtype, kv_cache_dtype, input_len, output_len, distinct_suffixes, commit},
     "outputs": {"0": [token ids of suffix 0's greedy output], ...}}

Prompts are not stored (100K ids each): suffix i's prompt is the prepared prefix followed by
`suffix_text(i)`, rebuilt by the caller. A file whose key differs from the run's is refused with
the fields that differ: a reference from other code or another row format would make the oracle
propose tokens the target does not produce (its `oracle_off_reference_share` would show it).
"""

from __future__ import annotations

import json
from pathlib import Path

KEY_FIELDS = ("model", "dtype", "kv_cache_dtype", "input_len", "output_len", "distinct_suffixes", "commit")


class ReferenceMismatch(ValueError):
    """A reference file made for another run; the message names the fields that differ."""


def reference_key(model: str, dtype: str, kv_cache_dtype: str, input_len: int, output_len: int,
                  distinct_suffixes: int, commit: str | None) -> dict:
    """What a reference's tokens depend on (commit None: unknown, and then never matches a file)."""
    return dict(zip(KEY_FIELDS, (model, dtype, kv_cache_dtype, input_len, output_len, distinct_suffixes, commit)))


def save_reference(path: str | Path, key: dict, outputs: dict[int, list[int]]) -> Path:
    """Write outputs (suffix index -> greedy output ids) under key; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "outputs": {str(i): list(v) for i, v in sorted(outputs.items())}}) + "\n")
    return path


def load_reference(path: str | Path, key: dict) -> dict[int, list[int]] | None:
    """The outputs in path if it exists and was made under key; None if there is no file.

    Raises ReferenceMismatch naming the differing fields (or an unknown commit), and ValueError
    for a file that is not a reference or lacks a suffix."""
    path = Path(path)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "key" not in data or "outputs" not in data:
        raise ValueError(f"{path}: not an oracle reference file (needs 'key' and 'outputs')")
    if key.get("commit") is None:
        raise ReferenceMismatch(f"{path}: the run's commit is unknown (set DHISPARSE_COMMIT), so a stored reference "
                                "cannot be matched to its code")
    diff = {k: (data["key"].get(k), key[k]) for k in KEY_FIELDS if data["key"].get(k) != key[k]}
    if diff:
        said = ", ".join(f"{k}: file {a!r}, run {b!r}" for k, (a, b) in diff.items())
        raise ReferenceMismatch(f"{path}: made for another run ({said}); delete it or point --reference-file elsewhere")
    outputs = {int(i): list(v) for i, v in data["outputs"].items()}
    missing = [i for i in range(key["distinct_suffixes"]) if i not in outputs]
    if missing:
        raise ValueError(f"{path}: no output for suffixes {missing[:8]}")
    return outputs
