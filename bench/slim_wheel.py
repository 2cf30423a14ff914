"""Repack the transformers wheel with only the model folders our tests import, for device calls.

The device tool carries the working tree and `.whl/` under 64 MiB together. With the shipped
`tiny-code` checkpoint the tree is 44 MB, and transformers' wheel alone is 13.5 MB (560 model
folders), so the full wheel no longer fits. Tests need transformers for the model families we
compare against (glm_moe_dsa, deepseek_v32, deepseek_v4) and for the `dflash` reference (qwen3).
This keeps those folders and every model folder their files import (`from ..name`), transitively,
plus the whole library outside `transformers/models/`. It writes a new wheel with a consistent
RECORD. It only affects device calls: CI and users install transformers from the registry.

    python bench/slim_wheel.py .whl/transformers-5.24.0-py3-none-any.whl   # rewrites it in place
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import zipfile
from pathlib import Path

KEEP = ("glm_moe_dsa", "deepseek_v32", "deepseek_v4", "qwen3", "auto")
IMPORT = re.compile(rb"^\s*from \.\.([a-z0-9_]+)", re.M)
MODELS = "transformers/models/"


def model_of(name: str) -> str | None:
    """The model folder a wheel entry belongs to (None outside transformers/models/<name>/)."""
    if not name.startswith(MODELS):
        return None
    rest = name[len(MODELS):]
    return rest.split("/", 1)[0] if "/" in rest else None


def closure(zf: zipfile.ZipFile, keep: tuple[str, ...]) -> set[str]:
    """`keep` and every model folder their .py files import, transitively."""
    files: dict[str, list[str]] = {}
    for n in zf.namelist():
        m = model_of(n)
        if m and n.endswith(".py"):
            files.setdefault(m, []).append(n)
    todo, seen = list(keep), set()
    while todo:
        m = todo.pop()
        if m in seen or m not in files:
            continue
        seen.add(m)
        for n in files[m]:
            todo += [d.decode() for d in IMPORT.findall(zf.read(n))]
    return seen


def slim(path: Path, keep: tuple[str, ...] = KEEP) -> tuple[int, int, set[str]]:
    """Rewrite the wheel at `path` in place; return (bytes before, bytes after, kept models)."""
    before = path.stat().st_size
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(path) as zf:
        kept = closure(zf, keep)
        names = [n for n in zf.namelist() if model_of(n) is None or model_of(n) in kept]
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        rows = []
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
            for n in names:
                if n == record:
                    continue
                data = zf.read(n)
                out.writestr(n, data)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                rows.append(f"{n},sha256={digest},{len(data)}")
            out.writestr(record, "\n".join(rows + [f"{record},,"]) + "\n")
    tmp.replace(path)
    return before, path.stat().st_size, kept


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel", type=Path)
    ns = ap.parse_args()
    before, after, kept = slim(ns.wheel)
    print(f"{ns.wheel}: {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB; models kept: {', '.join(sorted(kept))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
