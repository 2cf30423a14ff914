"""What the server's start-up warm-up buys: `dhisparse serve` started twice, each with an empty
Triton cache of its own -- once with --skip-server-warmup, once with the warm-up -- timing the
start (until /health answers) and the first and second completions.

    python3 bench/serve_warmup.py --out bench/results/serve_warmup_h200.json
    python3 bench/serve_warmup.py --quick     # CPU smoke test with the tiny model

The baseline is the same server without the warm-up, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx

from dhisparse.bench.results import command_line, machine_info, now_iso

QUICK = ["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--max-model-len", "512"]
GPU = ["--model", "glm52-scaled-k512", "--device", "cuda", "--preset", "adaptive", "--max-model-len", "4096",
       "--kv-pool-bytes", str(4 << 30), "--host-pool-bytes", str(4 << 30), "--max-running-requests", "8"]


def start(args: list[str], port: int, skip: bool, cache: str) -> tuple[subprocess.Popen, float]:
    """Start the server; seconds until /health answers 200."""
    env = dict(os.environ, TRITON_CACHE_DIR=cache, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "dhisparse.cli", "serve", *args, "--port", str(port), "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd + (["--skip-server-warmup"] if skip else []), env=env)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 900:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                return proc, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not answer /health within 900 s")


def completion_s(port: int, prompt: str, max_tokens: int) -> float:
    model = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10.0).json()["data"][0]["id"]
    t0 = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=900.0,
                   json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
    if r.status_code != 200:
        raise RuntimeError(f"completion failed: {r.status_code} {r.text[:300]}")
    return time.perf_counter() - t0


def one(args, port: int, skip: bool, prompt: str, max_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        proc, start_s = start(args, port, skip, cache)
        try:
            first = completion_s(port, prompt, max_tokens)
            second = completion_s(port, prompt[::-1], max_tokens)
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return {"warmup": not skip, "start_s": start_s, "first_completion_s": first, "second_completion_s": second,
            "start_plus_first_s": start_s + first}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--port", type=int, default=30123)
    p.add_argument("--out", default="bench/results/serve_warmup.json")
    ns = p.parse_args(argv)
    args = QUICK if ns.quick else GPU
    plen = min(ns.prompt_len, 200) if ns.quick else ns.prompt_len
    prompt = ("The quick brown fox jumps over the lazy dog. " * (plen // 45 + 1))[:plen]
    runs = [one(args, ns.port, skip, prompt, ns.max_tokens) for skip in (True, False)]
    base, warm = runs
    ratios = {"first_completion_warm_over_skip": warm["first_completion_s"] / base["first_completion_s"],
              "start_plus_first_warm_over_skip": warm["start_plus_first_s"] / base["start_plus_first_s"]}
    out = {"kind": "serve_warmup", "date": now_iso(), "command": command_line(argv),
           "machine": machine_info(), "server_args": args, "prompt_chars": plen, "max_tokens": ns.max_tokens,
           "runs": runs, "ratios": ratios,
           "notes": ["baseline: the same server with --skip-server-warmup, each start with an empty Triton cache"]}
    os.makedirs(os.path.dirname(ns.out) or ".", exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump(out, f, indent=1)
    for r in runs:
        print(f"[serve] warm-up {r['warmup']!s:5}  start {r['start_s']:.1f} s  first {r['first_completion_s']:.2f} s  "
              f"second {r['second_completion_s']:.2f} s", flush=True)
    print(f"[ratio] {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
