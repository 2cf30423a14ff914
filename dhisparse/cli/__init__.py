"""Command line: `dhisparse {demo,generate,serve,bench,loadstep,plot,table}` (or `python -m dhisparse`);
`dhisparse COMMAND --help` explains each flag. Global flags (--log-level, --version) go before or
after the command. (One module per command; the package may import every room, and each command
imports what it runs only when it runs, so this help stays fast.)

Exit codes: 0 done; 2 a bad flag or input (one line on stderr, no traceback); 130 interrupted
(Ctrl-C) -- except `serve`, for which Ctrl-C is the normal way to stop, so 0."""

from __future__ import annotations

import argparse
import logging
import sys

from dhisparse.cli import bench, demo, generate, loadstep, plot, serve, table
from dhisparse.cli.args import HelpFormatter, Parser, add_global_args


# optional dependency -> the pyproject extra that installs it
EXTRAS = {"fastapi": "serve", "uvicorn": "serve", "pydantic": "serve", "prometheus_client": "serve", "anyio": "serve",
          "starlette": "serve", "httpx": "test", "matplotlib": "plot", "triton": "triton"}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="dhisparse", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_global_args(p, top=True)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_command_parser)
    demo.add_parser(sub)
    generate.add_parser(sub)
    serve.add_parser(sub)
    bench.add_parser(sub)
    loadstep.add_parser(sub)
    plot.add_parser(sub)
    table.add_parser(sub)
    return p


def _command_parser(**kw) -> Parser:
    """A command's parser: one-line errors, the help formatter with defaults, the global flags."""
    kw.setdefault("formatter_class", HelpFormatter)
    kw.setdefault("usage", "%(prog)s [options]  (flags below; global flags may come before the command too)")
    p = Parser(**kw)
    add_global_args(p, top=False)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        ns = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or a bad flag (already explained on one line)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    ns.argv = list(sys.argv[1:] if argv is None else argv)  # recorded in result files
    logging.basicConfig(level=ns.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns)
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback
        print(f"dhisparse {ns.command}: interrupted", file=sys.stderr, flush=True)
        return 0 if ns.command == "serve" else 130
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
