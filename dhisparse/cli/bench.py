"""`dhisparse bench`: the paper's closed-loop concurrency benchmark (in-process or over HTTP)."""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import time

from dhisparse.cli.args import HelpFormatter, add_engine_args, engine_config


def int_list(text: str, flag: str) -> list[int]:
    """'1,4,8' -> [1, 4, 8]; every value >= 1."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers like 1,4,8; got {text!r}") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"{flag} needs integers >= 1; got {text!r}")
    return vals


def default_out(kind: str) -> str:
    return f"results/{kind}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"


def add_workload_args(p: argparse.ArgumentParser, duration: float | None = 30.0) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--input-len", type=int, default=1024, help="tokens of the prepared prefix every request starts with")
    g.add_argument("--output-len", type=int, default=128, help="output cap per request (exact unless --respect-eos)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    g.add_argument("--respect-eos", action="store_true", help="stop at EOS instead of always producing --output-len tokens")
    g.add_argument("--no-warmup", action="store_true", help="skip the short warm-up requests before each timed run")
    g.add_argument("--stagger", action="store_true",
                   help="staggered starts: client k's first request is capped at output_len * (k + 1) / clients "
                        "tokens, so completions and re-admissions spread over one request lifetime from the start")
    g.add_argument("--timeout", type=float, default=3600.0, help="hard bound in seconds on one run")
    g.add_argument("--sample-interval", type=float, default=1.0, help="seconds per row of the engine-counter time series")
    if duration is not None:
        g.add_argument("--duration", type=float, default=duration, help="seconds per run (closed loop, then in-flight requests are aborted)")
        g.add_argument("--num-requests", type=int, default=None, help="stop after this many requests instead of --duration")


def add_output_args(p: argparse.ArgumentParser, kind: str) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help=f"result JSON path (default: results/{kind}-DATE.json)")
    g.add_argument("--plot", default=None, metavar="DIR", help="also write PNG figures to DIR")
    g.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="closed-loop concurrency benchmark: output tok/s, TTFT, TPOT, active, slots",
                       formatter_class=HelpFormatter,
                       description="C clients each send their next request when the previous finishes; every request "
                                   "imports a private copy of one prepared prefix. Sweeps --concurrency x --presets.")
    add_engine_args(p)
    g = p.add_argument_group("sweep")
    g.add_argument("--concurrency", default="1,4,8", help="comma-separated offered concurrencies C")
    g.add_argument("--presets", default=None, help="comma-separated presets (default: every available preset)")
    g.add_argument("--url", default=None, help="benchmark a running server at this base URL instead of in-process")
    g.add_argument("--api-key", default=None,
                   help="API key sent to --url as 'Authorization: Bearer' (default: $DHISPARSE_API_KEY)")
    g.add_argument("--request-model", default=None, help="model name sent to --url (default: the server's first model)")
    g.add_argument("--label", default=None, help="preset label for --url runs (default: the server's preset)")
    add_workload_args(p)
    add_output_args(p, "bench")
    p.set_defaults(func=run)


def workload_from(ns: argparse.Namespace, duration_s: float | None = None):
    """The workload flags; `duration_s` overrides --duration (loadstep passes its phases' total)."""
    from dhisparse.bench.workload import Workload

    count = getattr(ns, "num_requests", None)
    duration = duration_s if duration_s is not None else getattr(ns, "duration", None)
    return Workload(input_len=ns.input_len, output_len=ns.output_len,
                    duration_s=None if count is not None else duration, num_requests=count,
                    temperature=ns.temperature, ignore_eos=not ns.respect_eos, timeout_s=ns.timeout,
                    warmup=not ns.no_warmup, stagger=ns.stagger)


def presets_from(ns: argparse.Namespace) -> list[str]:
    from dhisparse.bench.sweep import check_presets
    from dhisparse.engine.config import AVAILABLE_PRESETS

    if ns.presets:
        return check_presets([p.strip() for p in ns.presets.split(",") if p.strip()])
    return [ns.preset] if ns.preset else list(AVAILABLE_PRESETS)


def run(ns: argparse.Namespace) -> int:
    from dhisparse.bench import results as R
    from dhisparse.bench.report import console as report_console, bench_table
    from dhisparse.bench.sweep import ProgressBar, sweep_http, sweep_inprocess

    if ns.api_key is not None and not ns.url:
        raise ValueError("--api-key is for a server at --url; an in-process run needs none")
    console = report_console()
    concurrencies, workload = int_list(ns.concurrency, "--concurrency"), workload_from(ns)
    t0 = time.perf_counter()
    with ProgressBar(not ns.no_progress, console) as bar:
        if ns.url:
            key = ns.api_key if ns.api_key is not None else os.environ.get("DHISPARSE_API_KEY") or None
            runs = sweep_http(ns.url, ns.request_model, concurrencies, workload, bar, ns.sample_interval, ns.label, key)
            engine_cfg: dict = {"url": ns.url}
        else:
            base = engine_config(ns, preset=presets_from(ns)[0])
            runs = sweep_inprocess(base, presets_from(ns), concurrencies, workload, bar, ns.sample_interval)
            engine_cfg = R.to_jsonable(base)
    config = {"engine": engine_cfg, "workload": R.to_jsonable(workload), "concurrency": concurrencies,
              "wall_s": time.perf_counter() - t0}
    return publish(R.new_result("bench", getattr(ns, "argv", None), config, runs), ns, console, bench_table)


def publish(result, ns: argparse.Namespace, console, table) -> int:
    """Write the result JSON (--out, or the default path), print its table and, with --plot, figures."""
    from dhisparse.bench import results as R

    path = R.write_json(result, ns.out or default_out(result.kind))
    data = R.to_jsonable(result)
    console.print(table(data))
    console.print(f"results: {path}")
    if ns.plot:
        from dhisparse.bench.plots import plot_results

        for png in plot_results([data], ns.plot):
            console.print(f"figure: {png}")
    return 0
