"""Every README snippet runs as written (issue #28 item 8): each ```python block executes, and the
`dhisparse ...` / `python -m dhisparse...` commands that are cheap on CPU (the built-in `tiny`
model, --help, --version) exit 0. Commands that need a checkpoint folder (/path/to/...), a GPU, a
running server or minutes of benchmarking are listed by `expensive` and only parsed."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def commands() -> list[str]:
    """The `dhisparse` / `python -m dhisparse` command lines of the bash blocks (continuations joined)."""
    out = []
    for block in blocks("bash"):
        text = re.sub(r"\\\n\s*", " ", block)
        for line in text.splitlines():
            line = line.split(" # ")[0].strip()
            for part in line.split("&&"):
                part = part.strip()
                if part.startswith(("dhisparse ", "python -m dhisparse")):
                    out.append(part)
    return out


def inline_commands() -> list[str]:
    """`python -m dhisparse...` commands quoted inline in the text."""
    return re.findall(r"`(python -m dhisparse[^`]* [^`]*)`", README)  # with arguments: a command, not a name


def expensive(cmd: str) -> str | None:
    """Why a command is not run here (None: cheap on CPU, run it)."""
    argv = shlex.split(cmd)
    if "/path/to" in cmd or "--url" in argv:
        return "needs a checkpoint folder or a running server"
    if any(c in argv for c in ("serve", "bench", "loadstep", "plot", "demo")):
        return "serves or benchmarks for minutes"
    if "dhisparse.train" in cmd or "m/" in argv:
        return "trains a model for minutes on a GPU, or needs the folder it writes"
    if "dhisparse.bench.table3" in cmd:
        return "a benchmark run"
    if any("*" in a for a in argv):
        return "reads the result files of a run (a shell glob)"
    if "bench/results/" in cmd:
        return "writes a shipped result (test_readme_memreport_command_keeps_the_shipped_result)"
    return None


def test_readme_has_snippets():
    assert len(blocks("python")) >= 1 and len(commands()) >= 5


@pytest.mark.parametrize("code", blocks("python"), ids=lambda c: c.splitlines()[0][:40])
def test_python_block_runs(code, capsys):
    exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})
    assert capsys.readouterr().out.strip()


CHEAP = [c for c in commands() + inline_commands() if expensive(c) is None]


@pytest.mark.parametrize("cmd", CHEAP)
def test_cheap_command_runs(cmd, tmp_path):
    argv = shlex.split(cmd)
    argv = [sys.executable] + argv[1:] if argv[0] == "python" else [sys.executable, "-m", "dhisparse", *argv[1:]]
    if "generate" in argv:
        argv += ["--device", "cpu", "--kv-pool-bytes", str(32 << 20)]  # CI-sized pools; the flags as written otherwise
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip()


@pytest.mark.parametrize("cmd", [c for c in commands() if expensive(c) is not None and c.startswith("dhisparse ")])
def test_expensive_command_parses(cmd):
    from dhisparse.cli import build_parser

    build_parser().parse_args(shlex.split(cmd)[1:])  # SystemExit (a bad flag) fails the test


def test_readme_memreport_command_keeps_the_shipped_result():
    """The memreport command the README shows must not overwrite bench/results/memreport_glm52.json."""
    from dhisparse.bench.memreport import build_parser

    cmds = [c for c in inline_commands() if "dhisparse.bench.memreport" in c]
    assert cmds
    for c in cmds:
        ns = build_parser().parse_args(shlex.split(c)[3:])
        assert ns.out is None or not str(ns.out).startswith("bench/results/"), c
