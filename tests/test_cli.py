"""The command line (issue #28 items 5, 6, 8, 9): global flags anywhere, SGLang flag names with vLLM
aliases, --dtype spellings, --version, `python -m dhisparse`, help with choices and defaults, a
one-line error and exit code 2 for every bad flag (before any model loads), Ctrl-C without a
traceback, the port checked before loading, the serving log line, generate's prefill progress,
memreport's argparse, and the test suite's own memory fixtures."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest

from dhisparse.cli import build_parser, main
from dhisparse.cli.args import engine_config, mem_fraction_pool_bytes

ROOT = Path(__file__).resolve().parents[1]
CPU = ["--device", "cpu", "--kv-pool-bytes", str(8 << 20)]


def run_cli(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "dhisparse", *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=kw.get("cwd", ROOT))


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if a model starts loading: flags must be checked first."""
    import dhisparse.models.registry as registry

    def refuse(*a, **k):
        raise AssertionError("a model is being loaded although the flags are bad")

    monkeypatch.setattr(registry, "load_model", refuse)
    monkeypatch.setattr(registry, "load_for_config", refuse)


# ---- global flags, names, aliases ---------------------------------------------------------------


def test_global_flags_before_or_after_the_command():
    p = build_parser()
    assert p.parse_args(["serve"]).log_level == "WARNING"
    assert p.parse_args(["--log-level", "error", "serve"]).log_level == "ERROR"
    assert p.parse_args(["serve", "--log-level", "debug"]).log_level == "DEBUG"
    assert p.parse_args(["--log-level", "error", "generate", "--log-level", "info"]).log_level == "INFO"


@pytest.mark.parametrize("primary,alias,field,value", [
    ("--context-length", "--max-model-len", "max_model_len", 777),
    ("--chunked-prefill-size", "--max-num-batched-tokens", "max_num_batched_tokens", 96),
    ("--max-running-requests", "--max-num-seqs", "max_running_requests", 5),
    ("--model-path", "--model", "model", "tiny"),
    ("--tokenizer-path", "--tokenizer", "tokenizer", "/tok"),
])
def test_sglang_names_and_vllm_aliases(primary, alias, field, value):
    p = build_parser()
    a = engine_config(p.parse_args(["serve", primary, str(value)]), full_loader=True)
    b = engine_config(p.parse_args(["serve", alias, str(value)]), full_loader=True)
    assert getattr(a, field) == getattr(b, field) == value


@pytest.mark.parametrize("flag,want", [("auto", None), ("half", "float16"), ("float16", "float16"), ("bf16", "bfloat16"),
                                       ("bfloat16", "bfloat16"), ("float32", "float32"), ("BF16", "bfloat16")])
def test_dtype_spellings(flag, want):
    assert engine_config(build_parser().parse_args(["generate", "--dtype", flag])).dtype == want


def test_new_loader_fields_and_tp_size():
    p = build_parser()
    cfg = engine_config(p.parse_args(["serve", "--revision", "v1", "--chat-template", "x.jinja", "--quantization", "fp8",
                                      "--kv-cache-dtype", "bfloat16", "--tp-size", "1"]), full_loader=True)
    assert (cfg.revision, cfg.chat_template, cfg.quantization, cfg.kv_cache_dtype) == ("v1", "x.jinja", "fp8", "bfloat16")
    with pytest.raises(ValueError, match="--tp-size 2 with --dp-size 2"):
        engine_config(p.parse_args(["serve", "--tensor-parallel-size", "2", "--dp-size", "2"]), full_loader=True)
    cfg = engine_config(p.parse_args(["serve", "--dp-size", "2", "--dist-timeout", "9", "--nnodes", "2", "--node-rank", "1",
                                      "--dist-init-addr", "10.0.0.2:4000"]), full_loader=True)
    assert (cfg.dp_size, cfg.dist_timeout_s, cfg.nnodes, cfg.node_rank, cfg.dist_init_addr) == (2, 9.0, 2, 1, "10.0.0.2:4000")
    with pytest.raises(ValueError, match="--enable-dp-attention"):
        engine_config(p.parse_args(["serve", "--dp-size", "2", "--enable-dp-attention"]), full_loader=True)
    # a command that would drop a loader flag refuses it instead of ignoring it
    with pytest.raises(ValueError, match="`dhisparse bench` does not take --chat-template"):
        engine_config(p.parse_args(["bench", "--chat-template", "x"]))


def test_mem_fraction_static_arithmetic():
    gib = 1 << 30
    # 80 GiB GPU, 10 GiB in use after loading the weights, 0.9 static: 72 - 10 = 62 GiB of KV pool
    assert mem_fraction_pool_bytes(0.9, free=70 * gib, total=80 * gib) == 62 * gib
    with pytest.raises(ValueError, match="raise the fraction"):
        mem_fraction_pool_bytes(0.1, free=70 * gib, total=80 * gib)
    p = build_parser()
    ns = p.parse_args(["serve", "--gpu-memory-utilization", "0.8"])
    assert ns.mem_fraction_static == 0.8
    with pytest.raises(ValueError, match="not both"):
        engine_config(p.parse_args(["serve", "--mem-fraction-static", "0.8", "--kv-pool-bytes", "100"]), full_loader=True)


def test_help_shows_choices_defaults_and_one_engine_group(capsys):
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert "{resident,hisparse,adaptive,resident+spec,adaptive+spec}" in out
    assert "{auto,half,float16" in out and "{auto,bfloat16,fp8_e4m3}" in out and "{none,fp8}" in out
    assert "--context-length N, --max-model-len N" in out
    assert "(default: 16)" in out and "(default: 30000)" in out and "(default: resident)" in out
    assert out.count("\nengine:") == 1 and out.count("--page-size N") == 1
    assert "{critical,error,warning,info,debug,trace}" in out


def test_version_and_python_m_dhisparse():
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip().startswith("dhisparse ")
    r = run_cli("generate", "--version")
    assert r.returncode == 0 and "dhisparse" in r.stdout


# ---- bad flags: one line, exit 2, nothing loaded --------------------------------------------------


BAD_FLAGS = [
    (["--log-level", "LOUD", "serve"], "--log-level"),
    (["serve", "--log-level", "LOUD"], "--log-level"),
    (["serve", "--cpu-threads", "-3"], "--cpu-threads"),
    (["generate", "--cpu-threads", "0", "--prompt", "x"], "--cpu-threads"),
    (["serve", "--uvicorn-log-level", "LOUD"], "--uvicorn-log-level"),
    (["serve", "--dtype", "int4"], "--dtype"),
    (["serve", "--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype"),
    (["serve", "--kv-cache-dtype", "int8"], "--kv-cache-dtype"),
    (["serve", "--quantization", "awq"], "--quantization"),
    (["serve", "--tp-size", "2", "--dp-size", "2"], "--tp-size"),
    (["serve", "--mem-fraction-static", "1.5"], "--mem-fraction-static"),
    (["serve", "--context-length", "0"], "--context-length"),
    (["serve", "--preset", "magic"], "--preset"),
    (["serve", "--kv-cache-dtype", "bfloat16", "--dtype", "float32"], "--kv-cache-dtype bfloat16"),
    (["generate", "--page-size", "abc", "--prompt", "x"], "--page-size"),
    (["serve", "--no-such-flag"], "--no-such-flag"),
]


@pytest.mark.parametrize("argv,name", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flag_is_one_line_and_exit_2(argv, name, capsys, no_model):
    assert main(argv) == 2
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert len(err.splitlines()) == 1 and name in err and "Traceback" not in err, err
    assert cap.out == ""


def test_bad_flags_in_a_real_process():
    # CI-sized: a global flag and a subcommand's, each in a process of its own (~1.5 s apiece); every entry
    # of BAD_FLAGS is also checked in-process above
    for argv, name in (BAD_FLAGS[0], BAD_FLAGS[2]):
        r = run_cli(*argv)
        err = r.stderr.strip()
        assert r.returncode == 2 and len(err.splitlines()) == 1 and name in err, (argv, r.stderr)


def test_busy_port_is_found_before_the_model_loads(capsys, no_model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--port {port}" in err and "already in use" in err


# ---- Ctrl-C ------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "dhisparse", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT)


def _wait_for(proc: subprocess.Popen, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if text in line:
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}: {proc.stderr.read()}")
    raise AssertionError(f"no {text!r} within {timeout} s")


def test_ctrl_c_on_serve_exits_0_without_traceback():
    proc = _start(["serve", *CPU, "--skip-server-warmup", "--port", str(_free_port())])
    try:
        _wait_for(proc, "serving")
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err


def test_ctrl_c_on_serve_while_warming_up_exits_0_without_traceback():
    proc = _start(["serve", *CPU, "--port", str(_free_port()), "--log-level", "INFO"])
    try:
        time.sleep(0.2)
        while proc.poll() is None and "KV pool" not in (proc.stderr.readline() or "KV pool"):
            pass
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err


def test_ctrl_c_on_generate_exits_130_without_traceback():
    proc = _start(["generate", "--device", "cpu", "--kv-pool-bytes", str(32 << 20), "--prompt", "x", "--max-tokens", "8000",
                   "--log-level", "INFO"])
    try:
        while "KV pool" not in (proc.stderr.readline() or "KV pool"):
            pass
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err and "interrupted" in err, err


# ---- feedback ------------------------------------------------------------------------------------


def test_serving_log_line_every_interval_while_busy():
    from dhisparse.engine.progress import ServingLog

    now = [0.0]
    lines: list[str] = []
    log = ServingLog(interval_s=10.0, emit=lines.append, clock=lambda: now[0])
    stats = dict(running=2, waiting=1, generated_tokens=0, prefill_tokens=0, kv_pages_used=25, kv_pages_total=100,
                 host_pages_used=10, host_pages_total=400)
    log(stats)
    now[0] = 5.0
    log(dict(stats, generated_tokens=50))
    assert lines == []
    now[0] = 10.0
    log(dict(stats, generated_tokens=100, prefill_tokens=2000))
    assert lines == ["serving: gen 10.0 tok/s, prefill 200.0 tok/s, running 2, waiting 1, KV pool 25.0% (25/100 pages), "
                     "host 2.5%"]
    now[0] = 30.0
    log(dict(stats, running=0, waiting=0, generated_tokens=100, prefill_tokens=2000))  # idle: nothing
    assert len(lines) == 1


def test_serving_log_reads_real_engine_stats():
    from dhisparse.engine.engine import Engine
    from dhisparse.engine.config import EngineConfig
    from dhisparse.engine.progress import ServingLog
    from dhisparse.core.params import SamplingParams

    engine = Engine(EngineConfig(device="cpu", kv_pool_bytes=8 << 20))
    now = [0.0]
    lines: list[str] = []
    log = ServingLog(interval_s=1.0, emit=lines.append, clock=lambda: now[0])
    log(engine.stats().as_dict())
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    now[0] = 2.0
    log(engine.stats().as_dict())
    assert len(lines) == 1 and "running 1" in lines[0] and "prefill 1.5 tok/s" in lines[0], lines


def test_generate_prints_prefill_progress_for_long_prompts(capsys):
    ids = ",".join(str(5 + i % 200) for i in range(600))
    assert main(["generate", *CPU, "--prompt-ids", ids, "--max-tokens", "1", "--chunked-prefill-size", "64",
                 "--progress-min-tokens", "100"]) == 0
    err = capsys.readouterr().err
    assert "prefill: 600/600 tokens in" in err
    assert main(["generate", *CPU, "--prompt-ids", "5,6,7", "--max-tokens", "1"]) == 0
    assert "prefill" not in capsys.readouterr().err


# ---- memreport ----------------------------------------------------------------------------------


def test_memreport_help_writes_nothing_and_out_writes_json(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-m", "dhisparse.bench.memreport", "--help"], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0 and "--out" in r.stdout and list(tmp_path.iterdir()) == []
    from dhisparse.bench import memreport

    out = tmp_path / "m.json"
    assert memreport.main(["--out", str(out), "--contexts", "4096"]) == 0
    d = json.loads(out.read_text())
    assert {r["context"] for r in d["rows"]} == {4096} and "--out" in d["command"]
    assert memreport.main(["--contexts", "x"]) == 2


# ---- the suite's memory (item 9) ----------------------------------------------------------------

_DROPPED: list = []


def test_memory_a_dropped_engine_with_default_pools():
    """Test engines that leave the pools unset get small ones (conftest), and one dropped at the end
    of a test is collected before the next test runs (its store holds reference cycles)."""
    from dhisparse.engine.engine import Engine
    from dhisparse.engine.config import EngineConfig
    from conftest import CPU_TEST_POOL_BYTES
    import torch

    engine = Engine(EngineConfig(device="cpu", preset="hisparse"))
    if not torch.cuda.is_available():
        assert engine.stats().kv_pool_bytes <= CPU_TEST_POOL_BYTES
    _DROPPED.append(weakref.ref(engine))


def test_memory_the_dropped_engine_is_gone():
    assert _DROPPED and _DROPPED[0]() is None
