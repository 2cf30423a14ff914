"""The engine flags' table: one `Flag` per EngineConfig field a command line sets (names, type, help,
choices), the value types that check them (`positive_int`, `fraction`, ...), and the --dtype spellings.
`cli/args.py` adds them to a command's parser and maps the parsed values onto an EngineConfig.
"""

from __future__ import annotations

import argparse
import dataclasses

from dhisparse.engine.config import (FP8_ACTIVATIONS, KV_CACHE_DTYPES, PLACEMENTS, PRESETS, QUANTIZATIONS, RESOLVER_COPIES,
                                     RESOLVER_LOOKUPS, STAGING_MODES, EngineConfig)
from dhisparse.core.topk import TOPK_FORMS
from dhisparse.spec.config import COSTED

# --dtype spellings (vLLM's and SGLang's) -> EngineConfig.dtype (None = the checkpoint's)
DTYPE_NAMES = {"auto": None, "half": "float16", "float16": "float16", "fp16": "float16", "bfloat16": "bfloat16",
               "bf16": "bfloat16", "float": "float32", "float32": "float32", "fp32": "float32",
               "float64": "float64", "fp64": "float64", "double": "float64"}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def number_type(kind: type, low: float, what: str):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}; got {text!r}") from None
        if not v >= low:
            raise argparse.ArgumentTypeError(f"must be {what}; got {text!r}")
        return v

    parse.__name__ = what  # argparse names the type in some messages
    return parse


positive_int = number_type(int, 1, "a whole number >= 1")
nonneg_int = number_type(int, 0, "a whole number >= 0")
positive_float = number_type(float, 1e-300, "a number > 0")
nonneg_float = number_type(float, 0, "a number >= 0")


def positive_ints(text: str) -> tuple[int, ...]:
    """'8192,4096,4096' -> (8192, 4096, 4096); every entry a whole number >= 1."""
    parts = [p.strip() for p in text.split(",")]
    if not parts or any(not p for p in parts):
        raise argparse.ArgumentTypeError(f"must be a comma-separated list of whole numbers >= 1; got {text!r}")
    return tuple(positive_int(p) for p in parts)


positive_ints.__name__ = "a comma-separated list of whole numbers >= 1"


def fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1]; got {text!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1]; got {text!r}")
    return v


def dtype_name(text: str) -> str:
    key = text.strip().lower()
    if key not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from {', '.join(DTYPE_NAMES)})")
    return key



def lower(text: str) -> str:
    return text.strip().lower()


class Flag:
    """One engine flag: its names (the first is the primary, SGLang's), the EngineConfig field, type, help."""

    def __init__(self, names: str | tuple[str, ...], field: str | None, type_=str, help_: str = "",
                 choices: tuple | None = None, dest: str | None = None, metavar: str | None = None) -> None:
        self.names = (names,) if isinstance(names, str) else names
        self.field, self.type, self.help, self.choices = field, type_, help_, choices
        self.dest, self.metavar = dest or field, metavar

    def help_text(self) -> str:
        h = self.help
        d = _DEFAULTS.get(self.field) if self.field else None
        if d is not None and "default" not in h:
            h += f" (default: {d})"
        return h


FLAGS: list[Flag] = [
    Flag(("--model-path", "--model"), "model",
         help_="'tiny' (built-in GLM-5-architecture model, random weights), 'tiny-code' (the same architecture trained on "
               "Python's standard library; the demo's default), another built-in, a Hugging Face checkpoint "
               "folder, or a Hub id org/name found in the local Hugging Face cache (offline; HF_HUB_CACHE / HF_HOME)"),
    Flag("--revision", "revision", help_="Hub revision (branch, tag or commit) of a --model-path org/name (default: main)"),
    Flag(("--tokenizer-path", "--tokenizer"), "tokenizer",
         help_="tokenizer folder (tokenizer.json [+ tokenizer_config.json]) or Hub id (default: the model's)"),
    Flag("--chat-template", "chat_template",
         help_="chat template: a Jinja file, or the template text itself (default: the tokenizer's)"),
    Flag("--preset", "preset", help_="KV policy", choices=PRESETS),
    Flag("--device", "device", help_="auto (cuda if available), cpu, cuda or cuda:N"),
    Flag("--dtype", "dtype", dtype_name, metavar="{" + ",".join(DTYPE_NAMES) + "}",
         help_="weights and KV dtype: auto = the checkpoint's (float32 for 'tiny'); half = float16, bf16 = bfloat16"),
    Flag("--kv-cache-dtype", "kv_cache_dtype", lower, choices=KV_CACHE_DTYPES,
         help_="KV cache rows: auto = the model dtype; bfloat16 needs a bfloat16 model; fp8_e4m3 = FP8 rows in every "
               "tier (656-B MLA rows and 132-B index keys at GLM-5's shape; CPU or CUDA compute capability >= 8.9)"),
    Flag("--fp8-activations", "fp8_activations", lower, choices=FP8_ACTIVATIONS,
         help_="FP8 weight GEMMs (glm5-faithful, v41-faithful): auto = the checkpoint's activation_scheme (dynamic for "
               "DeepSeek-V3 / GLM-5 FP8 checkpoints and the faithful models); none = activations in the model dtype "
               "(w8a16); dynamic = FP8 per token and group of 128 columns (w8a8, as SGLang and vLLM serve them)"),
    Flag("--quantization", "quantization", lower, choices=QUANTIZATIONS,
         help_="weights: none = as stored (block-scaled FP8 checkpoints are dequantized at load); fp8 = require a "
               "block-scaled FP8 checkpoint (dequantized at load; no online quantization)"),
    Flag("--page-size", "page_size", positive_int, "token positions per KV page"),
    Flag(("--context-length", "--max-model-len"), "max_model_len", positive_int,
         "limit on prompt + output tokens (default: the model's max_position_embeddings)"),
    Flag(("--chunked-prefill-size", "--max-num-batched-tokens"), "max_num_batched_tokens", positive_int,
         "token budget of one engine step: long prompts are prefilled in chunks of at most this many tokens"),
    Flag(("--max-running-requests", "--max-num-seqs"), "max_running_requests", positive_int,
         "requests decoding or prefilling at once"),
    Flag(("--mem-fraction-static", "--gpu-memory-utilization"), None, fraction, dest="mem_fraction_static",
         help_="CUDA: fraction of the GPU's total memory for static allocation, model weights + KV pool, as in "
               "SGLang: KV pool bytes = fraction x total - memory in use once the weights are loaded. Replaces "
               "--kv-pool-fraction (share of the free memory after loading). CPU: ignored (the pool is "
               "--kv-pool-bytes, default 256 MiB)"),
    Flag("--kv-pool-bytes", "kv_pool_bytes", positive_int,
         "KV pool capacity in bytes (default: --kv-pool-fraction of free GPU memory; 256 MiB on CPU)"),
    Flag("--kv-pool-fraction", "kv_pool_fraction", fraction,
         "share of the GPU memory free after loading the weights for the KV pool when --kv-pool-bytes is unset"),
    Flag(("--tp-size", "--tensor-parallel-size"), "tp_size", positive_int,
         help_="ranks of a TP group. Alone (--dp-size 1): tensor parallelism, every rank runs the same requests with "
               "1/N of the attention / index heads and FFN intermediate sizes (the MLA latent KV replicated on every "
               "rank); GLM-5.x / DeepSeek-V3.2 only. With --dp-size N --enable-dp-attention --ep-size N: SGLang's DP "
               "attention + EP"),
    Flag(("--dp-size", "--data-parallel-size"), "dp_size", positive_int,
         help_="data-parallel ranks: each runs its own engine and KV hierarchy (weights replicated) on its own GPU "
               "(cuda:0..N-1) or on the CPU; rank 0 places requests (fewest sessions, then most free pages)"),
    Flag("--ep-size", "ep_size", positive_int,
         help_="expert parallelism: the routed experts sharded over --ep-size ranks (with --enable-dp-attention, = --tp-size); "
               "with --disaggregation-prefill-size P --disaggregation-decode-size D: EP groups of --ep-size ranks "
               "inside each role (it must divide P and D; --enable-dp-attention)"),
    Flag("--nnodes", "nnodes", positive_int, help_="hosts the ranks span (with --dist-init-addr and --node-rank)"),
    Flag("--node-rank", "node_rank", nonneg_int, help_="this host's index among --nnodes (0 runs the server)"),
    Flag("--dist-init-addr", "dist_init_addr", help_="host:port of node 0's rendezvous (default: 127.0.0.1 and a free port)"),
    Flag("--dist-timeout", "dist_timeout_s", positive_float,
         help_="seconds every control round between ranks and the start-up rendezvous may take before the "
               "server reports the rank lost (503)"),
    Flag("--disaggregation-mode", "disaggregation_mode", choices=("null", "prefill", "decode"),
         help_="SGLang's prefill/decode disaggregation: the role of this host's ranks in a world of several hosts "
               "(--nnodes, --node-rank, --dist-init-addr; every host gives the same sizes below); null = off"),
    Flag("--disaggregation-prefill-size", "disaggregation_prefill_size", positive_int,
         help_="ours: prefill ranks P of a disaggregated world (they compute prompts and first tokens, then send the "
               "KV); with --disaggregation-decode-size on one host, one command spawns all P + D ranks (default: 1 "
               "each when only --disaggregation-mode is given)"),
    Flag("--disaggregation-decode-size", "disaggregation_decode_size", positive_int,
         help_="ours: decode ranks D of a disaggregated world (they admit the KV sent to them resident-first or "
               "host-first and decode; default: 1 when only --disaggregation-mode is given)"),
    Flag("--disaggregation-prefill-host-pool-bytes", "disaggregation_prefill_host_pool_bytes", positive_int,
         help_="ours: a prefill rank's host pool in bytes (default: --host-pool-bytes, as every rank); prefill ranks "
               "hold only their in-flight prompts, decode ranks every session's history"),
    Flag("--hot-cache-rows", "hot_cache_rows", positive_int,
         "hot-cache rows B per request and KV source in hierarchical presets (default 2 x index_topk)"),
    Flag("--source-hot-cache-rows", "source_hot_cache_rows", positive_ints,
         "one hot-cache budget per KV source, comma-separated in source order (the paper's V4.1: 8192,4096,...)"),
    Flag("--host-pool-bytes", "host_pool_bytes", positive_int,
         "host backing capacity in bytes (default 4 x the KV pool, capped at half of the available memory)"),
    Flag("--admission-reserve-pages", "admission_reserve_pages", nonneg_int,
         "adaptive: pages kept free for admissions (M_res); optional history never uses them (default: one "
         "request's hot cache, tail and index pages at --context-length, at most an eighth of the pool)"),
    Flag("--reclaim-order", "reclaim_order", help_="adaptive: who loses optional history first: remaining (fewest "
         "tokens left), largest, newest", choices=("remaining", "largest", "newest")),
    Flag("--repopulate-pages", "repopulate_pages", nonneg_int, "adaptive: optional pages refilled from host per step at most"),
    Flag("--backup-ahead-pages", "backup_ahead_pages", nonneg_int,
         "adaptive: host backups of optional pages started per step under memory pressure"),
    Flag("--decode-pages", "decode_pages", help_="adaptive: completed decode pages stay on device as optional "
         "history while memory is spare (optional: our extension) or come back only through the hot cache "
         "(hot-cache: the paper's rule)", choices=("optional", "hot-cache")),
    Flag("--cuda-graphs", "cuda_graphs", help_="piecewise CUDA graphs per token bucket of each layer's FFN block (ffn), "
         "and also its pre-attention piece and sparse attention (layer); step = layer plus one graph of the whole "
         "forward per request bucket for decode / verification passes; auto = step on CUDA where the model supports it",
         choices=("auto", "none", "ffn", "layer", "step")),
    Flag("--cuda-graph-max-bs", "cuda_graph_max_bs", positive_int, "the largest decode / verification batch "
         "(requests) CUDA graphs are captured for at start; whole-step graphs serve passes of up to this many requests, "
         "larger ones run layer by layer (default: --max-running-requests)"),
    Flag("--copy-stream", "copy_stream", help_="adaptive on CUDA: where page copies run", choices=("side", "compute")),
    Flag("--admission-placement", "admission_placement", help_="hierarchical presets: where a prompt's prepared "
         "prefix goes at admission (import: copied to the device first; host: its shared host pages are the history "
         "at once; auto: import while spare pages hold it)", choices=PLACEMENTS),
    Flag("--staging-mode", "staging_mode", help_="hierarchical presets with speculation: verification staging "
         "(paper: one arena per layer of a selection group, staged rows promoted into the hot cache with copy-back; "
         "single: one arena, staged rows dropped after each layer; auto: single, the faster on the H200)",
         choices=STAGING_MODES),
    Flag("--prefetch-stream", "prefetch_stream", help_="hierarchical presets on CUDA: where follower layers' "
         "copies of a shared selection run (side: HiSparse's layer-wise prefetch under the intervening layers)",
         choices=("compute", "side")),
    Flag("--resolver-copy", "resolver_copy", help_="hierarchical presets, Triton resolver: the producer layer's "
         "host -> device copies in a gather launch of their own (separate) or made by the plan kernel itself "
         "(fused: one launch plans and copies)", choices=RESOLVER_COPIES),
    Flag("--resolver-lookup", "resolver_lookup", help_="hierarchical presets: find hot-cache hits by scanning the "
         "hot cache (scan) or through a position -> hot entry index kept per request slot and group (index: 2 B a "
         "position of the longest request per group and slot)", choices=RESOLVER_LOOKUPS),
    Flag("--load-stream", "load_stream", help_="CUDA: where admission copies (prefix import, hisparse hand-off) run",
         choices=("compute", "side")),
    Flag("--speculative-algorithm", "speculative_algorithm",
         help_="speculative decoding over any preset (mtp / nextn: the checkpoint's own MTP layer; oracle: a benchmark tool)",
         choices=("dflash", "dflash2", "dspark", "mtp", "nextn", "ngram", "oracle")),
    Flag("--speculative-num-draft-tokens", "speculative_num_draft_tokens", positive_int,
         "K_max: target queries per request and round, anchor included"),
    Flag("--speculative-draft-window-size", "speculative_draft_window_size", positive_int,
         "W: positions the drafter's KV ring keeps (default: the drafter checkpoint's sliding window, the whole "
         "context if it attends to all of it; 2048 for random weights)"),
    Flag("--speculative-draft-model-path", "speculative_draft_model_path",
         help_="DFlash drafter checkpoint folder (default: seeded random weights)"),
    Flag("--speculative-policy", "speculative_policy", help_="verification width policy: fixed, static (by load) or online",
         choices=("fixed", "static", "online")),
    Flag("--speculative-oracle-tokens-per-round", "speculative_oracle_tokens_per_round", positive_float,
         "oracle drafter calibration, e.g. 2.88"),
    Flag("--speculative-oracle-drafter", "speculative_oracle_drafter",
         help_="costed oracle (a benchmark tool): this drafter's network runs every round, the oracle's tokens "
         "replace its drafts", choices=COSTED),
    Flag("--resolver", "resolver", help_="resolver implementation", choices=("auto", "torch", "triton")),
    Flag("--kernel-backend", "kernel_backend", help_="attention / indexer kernels (auto: Triton on CUDA)",
         choices=("auto", "torch", "triton")),
    Flag("--mla-split-rows", "mla_split_rows", nonneg_int,
         "sparse-MLA locations per program (flash-decoding split; 0 = off; default: 128 on the 16-head tile, 512 on the 64-head one)"),
    Flag("--indexer-topk", "indexer_topk", help_="form of the indexers' tie-ruled top-k (same selections, different cost)",
         choices=TOPK_FORMS),
    Flag("--admission-lookahead", "admission_lookahead", nonneg_int,
         "waiting requests admitted past one that does not fit yet (0 = strict FCFS)"),
    Flag("--admission-age-bound", "admission_age_bound_s", nonneg_float,
         "seconds after which a waiting request that does not fit blocks skip-ahead"),
    Flag("--cpu-threads", "cpu_threads", positive_int, "torch intra-op threads on CPU (default: 1)"),
    Flag("--seed", "seed", int, "seed of the built-in model's random weights and default sampling seed"),
]

# flag -> (EngineConfig field, type, help): the primary name of every flag that maps onto a field
ENGINE_FLAGS: dict[str, tuple[str, object, str]] = {f.names[0]: (f.field, f.type, f.help) for f in FLAGS if f.field}
