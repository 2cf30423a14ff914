"""Token digest of a `dhisparse bench` run: runs the CLI bench in this process while recording
every finished request's output ids, and prints one sha256 per preset (request ids sorted), so
two commits can be shown to produce the same tokens (issue 23: behaviour does not change).

    python bench/token_digest.py --out digest.json -- bench --model tiny --presets resident,hisparse \
        --concurrency 4 --num-requests 12 --input-len 200 --output-len 24 --no-progress --out /tmp/b.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

from dhisparse.cli import main as cli_main
from dhisparse.engine.engine import Engine


def run(argv: list[str]) -> dict:
    outputs: dict[int, dict[str, list[int]]] = {}
    orig = Engine.step

    def step(self):
        outs = orig(self)
        runs = outputs.setdefault(id(self), {})
        for o in outs:
            if o.finished:
                runs[o.request_id] = list(o.token_ids)
        return outs

    Engine.step = step
    try:
        cli_main(argv)
    finally:
        Engine.step = orig
    digests = []
    for runs in outputs.values():
        blob = json.dumps([runs[k] for k in sorted(runs)]).encode()
        digests.append({"requests": len(runs), "tokens": sum(map(len, runs.values())), "sha256": hashlib.sha256(blob).hexdigest()})
    return {"argv": argv, "engines": digests}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("argv", nargs=argparse.REMAINDER)
    ns = ap.parse_args()
    argv = ns.argv[1:] if ns.argv[:1] == ["--"] else ns.argv
    res = run(argv)
    print(json.dumps(res, indent=1))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(res, f, indent=1)
    sys.exit(0)
