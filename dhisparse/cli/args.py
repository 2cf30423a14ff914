"""Flags shared by the commands: the global ones (`--log-level`, `--version`, accepted before or
after the command) and the engine flags (their table: `cli/flags.py`), each mapping onto one field of
the frozen EngineConfig (`engine_config`), and building the engine they describe (`build_engine`).

Engine flags carry SGLang's names where an equivalent exists; vLLM's names are aliases:

    --context-length        (vLLM --max-model-len)            -> max_model_len
    --chunked-prefill-size  (vLLM --max-num-batched-tokens)   -> max_num_batched_tokens
    --mem-fraction-static   (vLLM --gpu-memory-utilization)   -> kv_pool_bytes, see mem_fraction_pool_bytes
    --tp-size               (vLLM --tensor-parallel-size)     -> tp_size: TP alone, or with DP attention + EP
    --dp-size               (vLLM --data-parallel-size)       -> dp_size: one engine + KV hierarchy per rank
    --disaggregation-mode   (SGLang's; per host of several)   -> disaggregation_mode; ours for the world's ranks:
                            --disaggregation-prefill-size P, --disaggregation-decode-size D (engine/disagg.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

from dhisparse import __version__
from dhisparse.cli.flags import DTYPE_NAMES, FLAGS, lower, nonneg_int, positive_int
from dhisparse.engine.config import EngineConfig

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (`dhisparse serve: error: ...`) and exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" only for real defaults (engine flags default to None = "the engine's":
    their help names EngineConfig's default itself)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
            return action.help or ""
        if "%(default)" in (action.help or "") or "default:" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def _upper(text: str) -> str:
    return text.strip().upper()


def add_global_args(p: argparse.ArgumentParser, top: bool) -> None:
    """--log-level and --version. On a command's parser they default to SUPPRESS, so a value given
    before the command is kept unless the same flag is given again after it."""
    g = p.add_argument_group("global")
    g.add_argument("--log-level", type=_upper, choices=LOG_LEVELS, default="WARNING" if top else argparse.SUPPRESS,
                   help="logging level (INFO shows KV pool sizing, load progress and the serving log)"
                        + (" (default: WARNING)" if top else ""))
    g.add_argument("--version", action="version", version=f"dhisparse {__version__}")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine", "model and KV engine (every command that runs an engine takes these)")
    for f in FLAGS:
        kw = dict(dest=f.dest, type=f.type, default=None, help=f.help_text())
        if f.choices:
            kw["choices"] = f.choices
        if f.metavar:
            kw["metavar"] = f.metavar
        elif not f.choices and f.type is not str and f.type is not lower:
            kw["metavar"] = "N" if f.type in (int, positive_int, nonneg_int) else "X"
        g.add_argument(*f.names, **kw)
    g.add_argument("--enable-dp-attention", dest="enable_dp_attention", action="store_true", default=None,
                   help="SGLang's DP attention: every rank of the TP group runs its own requests' attention "
                        "(built with --dp-size = --ep-size = --tp-size)")
    g.add_argument("--debug-checks", dest="debug_checks", action="store_true", default=None, help="check KV pool integrity after every step")
    g.add_argument("--step-graph-warmup", dest="step_graph_warmup", action="store_true", default=None,
                   help="capture every decode / verification step graph at start (default: on first use)")


# settings only `load_for_config` applies (serve and generate load through it; the sweep commands
# load through bench/sweep.py's load_shared_model, which does not take them yet)
LOADER_FIELDS = {"revision": "--revision", "tokenizer": "--tokenizer", "chat_template": "--chat-template",
                 "quantization": "--quantization"}


def engine_config(ns: argparse.Namespace, *, full_loader: bool = False, **overrides: object) -> EngineConfig:
    """The EngineConfig of the parsed flags (ValueError naming the flag on a bad one). full_loader:
    the command loads through `build_engine` (all loader flags apply); otherwise the flags it would
    ignore are refused rather than silently dropped."""
    kw = {f.field: getattr(ns, f.dest) for f in FLAGS if f.field and getattr(ns, f.dest, None) is not None}
    if "dtype" in kw:
        kw["dtype"] = DTYPE_NAMES.get(kw["dtype"], kw["dtype"])
        if kw["dtype"] is None:
            del kw["dtype"]
    frac = getattr(ns, "mem_fraction_static", None)
    if not full_loader:
        given = [flag for field, flag in LOADER_FIELDS.items() if kw.get(field) not in (None, "none")]
        given += ["--mem-fraction-static"] if frac is not None else []
        given += ["--kv-cache-dtype bfloat16"] if kw.get("kv_cache_dtype") == "bfloat16" else []
        if given:
            raise ValueError(f"`dhisparse {getattr(ns, 'command', 'COMMAND')}` does not take {', '.join(given)} yet "
                             "(serve and generate do); leave it out")
    if frac is not None and ("kv_pool_bytes" in kw or "kv_pool_fraction" in kw):
        raise ValueError("--mem-fraction-static sizes the KV pool; give it or --kv-pool-bytes / --kv-pool-fraction, not both")
    if getattr(ns, "debug_checks", None):
        kw["debug_checks"] = True
    if getattr(ns, "enable_dp_attention", None):
        kw["enable_dp_attention"] = True
    if getattr(ns, "step_graph_warmup", None):
        kw["step_graph_warmup"] = True
    kw.update(overrides)
    return EngineConfig.from_kwargs(**kw)


def mem_fraction_pool_bytes(fraction: float, free: int, total: int) -> int:
    """SGLang's --mem-fraction-static on our pool: static memory (weights + KV pool) may use
    `fraction` of the device's total memory; measured once the weights are loaded, everything in use
    then (weights, CUDA context, other processes) counts against it:
        kv_pool_bytes = fraction x total - (total - free)."""
    pool = int(fraction * total) - (total - free)
    if pool <= 0:
        raise ValueError(f"--mem-fraction-static {fraction}: {format_gib(total - free)} GiB of the GPU's "
                         f"{format_gib(total)} GiB are in use after loading the weights, more than {fraction} of it; "
                         "raise the fraction")
    return pool


def format_gib(n: int) -> str:
    return f"{n / (1 << 30):.1f}"


def build_engine(ns: argparse.Namespace, config: EngineConfig | None = None, progress: bool = True):
    """The command's Engine: the model loaded first through `registry.load_for_config` (Hub id,
    revision, tokenizer, chat template, quantization; a shard progress bar), then the pool sized
    (--mem-fraction-static on CUDA), then the engine built on the loaded model."""
    import torch

    from dhisparse.engine.engine import Engine
    from dhisparse.engine.memory import resolve_device
    from dhisparse.models.registry import load_for_config

    config = config or engine_config(ns, full_loader=True)
    if config.disaggregated:  # prefill and decode ranks, each its own engine (engine/disagg_launch.py)
        return _build_disagg(ns, config)
    if config.parallel_config().distributed:  # every rank loads its own replica (engine/launch.py)
        from dhisparse.engine.launch import run_node, start_ranks

        if config.node_rank != 0:  # this host only runs ranks; node 0 serves
            print(f"dhisparse: node {config.node_rank} of {config.nnodes}: ranks {list(config.parallel_config().local_ranks())} "
                  f"joining {config.dist_init_addr}", flush=True)
            raise SystemExit(run_node(config))
        if getattr(ns, "mem_fraction_static", None) is not None:
            raise ValueError("--mem-fraction-static with --dp-size > 1 is not supported yet; size the pool with "
                             "--kv-pool-bytes (each rank's)")
        return start_ranks(config)
    device = resolve_device(config.device)
    loaded = load_for_config(config, device, progress=progress)
    frac = getattr(ns, "mem_fraction_static", None)
    if frac is not None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        config = dataclasses.replace(config, kv_pool_bytes=mem_fraction_pool_bytes(frac, free, total))
    elif frac is not None:
        logging.getLogger("dhisparse.cli").warning(
            "--mem-fraction-static applies to GPU memory; on %s the KV pool is --kv-pool-bytes (default 256 MiB)", device)
    return Engine(config, loaded=loaded)


def _build_disagg(ns: argparse.Namespace, config: EngineConfig):
    """Node 0 of a prefill/decode world (its Coordinator), or run the ranks of another node and exit."""
    from dhisparse.engine.disagg_launch import build_disagg, run_disagg_node

    if getattr(ns, "mem_fraction_static", None) is not None:
        raise ValueError("--mem-fraction-static with prefill/decode disaggregation is not supported yet; size the pool "
                         "with --kv-pool-bytes (each rank's)")
    layout = config.disagg_layout()
    if layout.node_rank != 0:  # this host only runs ranks; node 0 serves
        print(f"dhisparse: node {layout.node_rank} of {layout.nnodes}: {layout.node_role} ranks "
              f"{list(layout.parallel_config().local_ranks())} joining {layout.dist_init_addr}", flush=True)
        raise SystemExit(run_disagg_node(config))
    return build_disagg(config)
