"""`python -m dhisparse ...` = the `dhisparse` command (dhisparse/cli). Run through runpy so the
top-level package keeps its place below the CLI in the import order (tests/test_architecture.py)."""

import runpy

runpy.run_module("dhisparse.cli", run_name="__main__", alter_sys=True)
