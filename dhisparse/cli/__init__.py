"""Command line: `dhisparse {demo,generate,serve,bench,loadstep,plot}`; `dhisparse COMMAND --help`
explains each flag. (One module per command; the package may import every room, and each command
imports what it runs only when it runs, so this help stays fast.)"""

from __future__ import annotations

import argparse
import logging
import sys

from dhisparse.cli import bench, demo, generate, loadstep, plot, serve


# optional dependency -> the pyproject extra that installs it
EXTRAS = {"fastapi": "serve", "uvicorn": "serve", "pydantic": "serve", "prometheus_client": "serve", "anyio": "serve",
          "starlette": "serve", "httpx": "test", "matplotlib": "plot", "triton": "triton"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dhisparse", description=__doc__)
    p.add_argument("--log-level", default="WARNING", help="logging level (INFO shows KV pool sizing and waits)")
    sub = p.add_subparsers(dest="command", required=True)
    demo.add_parser(sub)
    generate.add_parser(sub)
    serve.add_parser(sub)
    bench.add_parser(sub)
    loadstep.add_parser(sub)
    plot.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    ns.argv = list(sys.argv[1:] if argv is None else argv)  # recorded in result files
    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # an optional extra is not installed
        extra = EXTRAS.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"error: `dhisparse {ns.command}` needs {e.name}; install it with: pip install -e '.[{extra}]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
