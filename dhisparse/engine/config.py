"""`EngineConfig`: the one frozen configuration shared by the Python API, the CLI and the server."""

from __future__ import annotations

from dataclasses import dataclass, fields

from dhisparse.core.kvformat import KV_CACHE_DTYPES  # auto, bfloat16, fp8_e4m3
from dhisparse.core.parallel import ParallelConfig, ParallelConfigError
from dhisparse.engine.disagg_layout import DisaggConfigError, DisaggLayout
from dhisparse.kernels.backend import KernelSettings
from dhisparse.kernels.fp8_gemm_ref import FP8_ACTIVATIONS as _KERNEL_ACTIVATIONS  # none, dynamic
from dhisparse.kernels.resolver import MAX_B  # hot rows a slot the plan kernel ranks
from dhisparse.kv.build import StoreSettings
from dhisparse.kv.hier.context import RESOLVER_COPIES, RESOLVER_LOOKUPS  # separate, fused; scan, index
from dhisparse.kv.hier.hierarchy import PLACEMENTS, STAGING_MODES  # import, host, auto; auto, paper, single
from dhisparse.models.registry import builtin_drafter
from dhisparse.spec.config import SpecConfig

QUANTIZATIONS = ("none", "fp8")
PRESETS = ("resident", "hisparse", "adaptive", "resident+spec", "adaptive+spec")
AVAILABLE_PRESETS = PRESETS


class ConfigValueError(ValueError):
    """A setting with a bad value; the message names the setting and the fix."""


DECODE_PAGES = ("optional", "hot-cache")  # adaptive: where completed decode pages go (see decode_pages)


FP8_ACTIVATIONS = ("auto", *_KERNEL_ACTIVATIONS)  # --fp8-activations: auto = the checkpoint's activation_scheme


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings (CLI flags in brackets).

    model [--model-path]: "tiny" (built-in, random weights), "tiny-code" (built-in, trained), a
        Hugging Face checkpoint folder, or a Hub id org/name in the local Hugging Face cache
        (models/registry.py resolve_hub; offline).
    preset [--preset]: KV policy, one of PRESETS.
    device [--device]: "auto" (cuda if available), "cpu" or "cuda".
    dtype [--dtype]: weights/KV dtype; None = checkpoint dtype (fp32 for tiny).
    page_size [--page-size]: token positions per KV page.
    kv_pool_bytes [--kv-pool-bytes]: KV pool capacity in bytes; None = kv_pool_fraction of free
        device memory on CUDA, 256 MiB on CPU.
    kv_pool_fraction [--kv-pool-fraction]: share of free device memory used when bytes unset.
    max_running_requests [--max-running-requests]: concurrent requests in decode/prefill.
    max_num_batched_tokens [--max-num-batched-tokens]: token budget of one step (chunked prefill).
    max_model_len [--max-model-len]: prompt + output limit; None = model's max positions.
    hot_cache_rows [--hot-cache-rows]: hot-cache rows B per request and source (hierarchical
        presets); None = 2 x the model's index_topk. Must be >= index_topk and <= 32,768.
    source_hot_cache_rows [--source-hot-cache-rows]: one budget per KV source / selection group
        instead (comma list in source order; the paper's V4.1 setting: 8192 for the shared source,
        4096 for the others); each >= index_topk. A request's hot-cache pages hold the largest.
    host_pool_bytes [--host-pool-bytes]: host backing capacity; None = 4 x the KV pool bytes, capped at
        half of the host's available memory.
    admission_reserve_pages [--admission-reserve-pages]: pages M_res kept free for admissions
        (adaptive); optional history never eats into them. None = one request's lifelong pages at
        max_model_len (hot cache, tail, index history), at most an eighth of the pool.
    reclaim_order [--reclaim-order]: which requests lose optional history first under pressure:
        "remaining" (fewest expected remaining tokens: they finish soonest), "largest", "newest".
    repopulate_pages [--repopulate-pages]: optional pages refilled from host per step at most.
    backup_ahead_pages [--backup-ahead-pages]: adaptive: under memory pressure (the latest
        admission's pages exceed what is free beyond the reserve), host backups of published
        optional pages started per step ahead of a reclaim (0: back up only when reclaiming).
    decode_pages [--decode-pages]: adaptive: "optional" (ours, the default) keeps a completed decode
        page on device as published optional history while a page beyond the reserve is free;
        "hot-cache" (the paper's) backs it up and reuses the tail page, so decode rows come back only
        through the hot cache.
    cuda_graphs [--cuda-graphs]: "auto", "none", "ffn" or "layer": replay each decoder layer's FFN
        block (norm, experts, residual) -- and with "layer" also its pre-attention piece (norm,
        projections, RoPE, indexer projections) and the sparse attention -- from CUDA graphs per token
        bucket (piecewise graphs; storing, selecting and locating KV stay eager). DSA models with <= 64 routed experts, CUDA.
        "step": "layer", and every pass whose requests all run the same number of tokens (decode,
        verification) replays as one graph of the whole forward per request bucket
        (engine/step_graphs.py). "auto" (default) = "step" where available, else "none".
    cuda_graph_max_bs [--cuda-graph-max-bs]: the largest decode / verification pass, in requests,
        that CUDA graphs are captured for at start (SGLang's flag): piecewise graphs for up to this
        many requests' tokens; whole-step graphs serve only passes of up to this many requests (a
        larger pass runs as layers, eagerly or from piecewise graphs). None (default):
        max_running_requests. A server that never runs more than N requests at once captures only
        what N needs.
    step_graph_warmup [--step-graph-warmup]: with "step" graphs, capture the decode / verification
        graphs of every request bucket up to max_running_requests (or cuda_graph_max_bs) at engine start (full table
        width), instead of on first use while serving; costs start-up time per engine.
    copy_stream [--copy-stream]: adaptive: where backup / repopulation page copies run on CUDA:
        "side" (a side stream, completion by events) or "compute" (the compute stream).
    admission_placement [--admission-placement]: where a request whose prompt starts with a
        prepared prefix (shared on host) keeps that prefix when admitted to a hierarchical preset:
        "import" (the prefix's pages are copied onto the device as the prefill workspace, then
        handed off), "host" (host-first: the shared host pages are its history at once, only the
        index keys and the partial last page come to the device, and the rest of the prompt runs
        K_max tokens a pass through the resolver) or "auto" (default: import while the workspace
        fits in spare pages, else host-first).
    staging_mode [--staging-mode]: verification staging over the hierarchical presets
        (kv/hier/promotion.py): "paper" (chi arenas, one per layer of a selection group; staged
        rows of higher rank than the round's weakest hot rows are promoted into the hot cache and
        copied back once the group's readers are done; stamps rank rows within a round), "single"
        (one arena, staged rows dropped after each layer) or "auto" (default: single; on the H200
        paper staging ran 0.76x single's throughput at 8K C18; paper is refused on DeepSeek-V4,
        whose sources are read again after other sources' calls).
    prefetch_stream [--prefetch-stream]: where a selection group's follower layers copy their
        missed rows on CUDA (kv/hier/prefetch.py): "compute" (default: one layered copy of every
        layer of the group by the producer, before its attention) or "side" (HiSparse's layer-wise
        prefetch: each follower's copy on a side stream, waited on by that follower alone, so it
        runs under the intervening layers' compute).
    resolver_copy [--resolver-copy]: how a deferred (Triton) resolver plan's copies for the group's
        producer reach the device: "separate" (default: the plan kernel, then one gather launch) or
        "fused" (the plan kernel copies each request's planned rows itself: one launch, issue 33;
        `kernels/resolver.py`'s `plan_triton(copy=...)`). Follower layers' copies under
        prefetch_stream "side" and staged rows keep their own launches either way.
    resolver_lookup [--resolver-lookup]: how the resolver finds hot-cache hits: "scan" (default: the
        hot cache is scanned against each call's selection) or "index" (the store keeps a position ->
        hot entry table per request slot and selection group, int16, 2 B a position of max_model_len
        per group and slot, and the Triton plan looks each selected row up: issue 33). Same plans;
        on one H100 (session 35) the lookup planned faster at batch 100 and slower at 8-32.
    load_stream [--load-stream]: where a request's admission copies run on CUDA (prefix import
        host -> device; hisparse's hand-off backup device -> host): "compute" (default: in stream
        order on the compute stream; the batch waits, the request does not) or "side" (side
        streams: the batch keeps running, the request waits for its copies). At 32K C18 on the
        H200, where memory lets one admission through at a time, "compute" gave more output
        (bench/results/gpu_serving_32k_c18_load*_s9c_h200.json).
    speculative_algorithm [--speculative-algorithm]: dflash, dspark, ngram or oracle; turns
        speculative decoding on over any preset (the "+spec" presets default to dflash).
    speculative_num_draft_tokens [--speculative-num-draft-tokens]: K_max, target queries per
        request and round, anchor included.
    speculative_draft_window_size [--speculative-draft-window-size]: W, positions the drafter sees;
        None = the drafter checkpoint's (its sliding window, the whole context for full attention;
        2048 for random weights).
    speculative_draft_model_path [--speculative-draft-model-path]: DFlash checkpoint folder (None =
        the built-in trained model's own drafter for `tiny-code`, else seeded random weights).
    speculative_policy [--speculative-policy]: fixed (K_max), static (8 up to C32, 6 up to C127, 4
        beyond, capped by K_max) or online.
    speculative_oracle_tokens_per_round [--speculative-oracle-tokens-per-round]: oracle calibration.
    speculative_oracle_drafter [--speculative-oracle-drafter]: with the oracle, the network drafter
        (dflash, dflash2, dspark, mtp) that runs every round for its cost and memory while the
        oracle's tokens replace its drafts (a costed oracle, spec/oracle.py `CostedOracle`).
    replay_reference (benchmarks only: bench/gpu_serving.py --replay-reference): MEASUREMENT TOOL
        (engine/replay.py): requests emit the oracle reference's tokens in place of their own (the target
        still runs every pass) and rounds are judged against them, so every preset decodes the
        reference's histories and the oracle's acceptance is the one set; `replay_agreement` counts the
        target's own agreement. Needs the reference (`Engine(oracle_reference=...)`). Not exact serving:
        label results "replayed".
    resolver [--resolver]: "auto" (triton on CUDA, torch on CPU), "torch" or "triton".
    kernel_backend [--kernel-backend]: attention / indexer kernels: "auto" (Triton for CUDA
        tensors, the PyTorch references on CPU), "torch" or "triton" (on CPU: TRITON_INTERPRET=1).
    mla_split_rows [--mla-split-rows]: sparse-MLA locations per program (flash-decoding split;
        0 = off; None, the default: 128 on the 16-head tile, 512 on the 64-head wide tile).
    indexer_group: grouped indexer scoring of verification rounds.
    indexer_topk [--indexer-topk]: the form of the indexers' tie-ruled top-k, "stable" (two top-k passes
        and two sorts), "packed" (one top-k over int64 (score, index) keys), "lean" (one sort) or
        "auto" (the default: packed for a decode pass on CUDA, lean for a verification round,
        stable on the CPU): the same selections, different costs (core/topk.py; bench/topk_bench.py).
        The environment overrides of kernels/backend.py apply on top, read when the engine is built.
    admission_lookahead [--admission-lookahead]: waiting requests that may be admitted past one
        that does not fit yet (0: strict first-come-first-served).
    admission_age_bound_s [--admission-age-bound]: once the first waiting request that does not
        fit has waited this long, nothing is admitted past it (engine/scheduler.py).
    cpu_threads [--cpu-threads]: torch intra-op threads when running on CPU (default 1: the
        tensors of one step are small, and thread hand-offs cost more than they gain).
    seed [--seed]: seed of the built-in model's random weights.
    dp_size / tp_size / ep_size / enable_dp_attention / nnodes / node_rank / dist_init_addr /
        dist_timeout_s [--dp-size, --tp-size, --ep-size, --enable-dp-attention, --nnodes,
        --node-rank, --dist-init-addr, --dist-timeout]: the process layout (core/parallel.py;
        `parallel_config()`). dp_size N > 1: N ranks, each its own engine and KV hierarchy with
        replicated weights (engine/distributed.py); tp = dp = ep = N with enable_dp_attention:
        the routed experts sharded over them too (layers/ep_moe.py); tp_size N alone (dp 1, ep 1):
        tensor parallelism, every rank the same requests with 1/N of the heads, index heads and FFN
        intermediate blocks (layers/tp.py; the Coordinator's replicate mode). DP x TP and MoE TP
        under DP attention are refused. dist_timeout_s bounds every control round and the start-up
        rendezvous.
    disaggregation_mode / disaggregation_prefill_size / disaggregation_decode_size
        [--disaggregation-mode (SGLang's), --disaggregation-prefill-size, --disaggregation-decode-size
        (ours)]: prefill/decode disaggregation (engine/disagg.py, engine/disagg_layout.py): P prefill
        ranks compute prompts and sample first tokens, D decode ranks admit the KV they are sent and
        decode; sizes 0 / mode "null" = off. On one host give both sizes; on several, each host's
        mode names its role. Inside each role: ep_size E with enable_dp_attention, E dividing
        both sizes (EP groups of E ranks, attention data-parallel); other dp / tp / ep > 1 refused.
    disaggregation_prefill_host_pool_bytes [--disaggregation-prefill-host-pool-bytes]: a prefill rank's
        host pool (None = host_pool_bytes, as every rank). A prefill rank holds its in-flight prompts
        (a shared prefix once, each request's own pages) and sends their KV on; a decode rank keeps
        every session's whole history, so the two roles' pools can differ by the sessions' histories.
    revision [--revision]: Hub revision of a `model` given as org/name (None = "main").
    tokenizer [--tokenizer]: tokenizer folder or Hub id (None = the model's).
    chat_template [--chat-template]: a Jinja file or the template text (None = the tokenizer's).
    kv_cache_dtype [--kv-cache-dtype]: "auto" (the model dtype), "bfloat16" (needs a bfloat16
        model) or "fp8_e4m3": FP8 rows in every tier (core/kvformat.py: 656-B MLA latent rows and
        132-B index keys at GLM-5's shape, 584-B DeepSeek-V4 compressed rows), quantized once when
        written; needs a CPU or a CUDA GPU of compute capability >= 8.9.
    quantization [--quantization]: None / "none" (weights as stored: block-scaled FP8 checkpoints
        are dequantized at load) or "fp8" (require a block-scaled FP8 checkpoint; no online
        quantization).
    fp8_activations [--fp8-activations]: how a model's FP8 weight GEMMs (glm5-faithful, v41-faithful) take
        their activations: "auto" (default: the checkpoint's quantization_config.activation_scheme, "dynamic"
        for DeepSeek-V3 / GLM-5 FP8 checkpoints and the faithful models, as SGLang and vLLM serve them;
        "none" for a model without FP8 weights), "none" (kept in the model's dtype, w8a16) or "dynamic" (FP8
        per token and group of 128 columns, w8a8; kernels/fp8_w8a8.py). "dynamic" on a model without FP8
        weights is refused at engine start; the engine's `fp8_activations` says what was set.
    debug_checks [--debug-checks]: run pool integrity checks after every step.
    """

    model: str = "tiny"
    preset: str = "resident"
    device: str = "auto"
    dtype: str | None = None
    page_size: int = 16
    kv_pool_bytes: int | None = None
    kv_pool_fraction: float = 0.85
    max_running_requests: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    hot_cache_rows: int | None = None
    source_hot_cache_rows: tuple[int, ...] | None = None
    host_pool_bytes: int | None = None
    admission_reserve_pages: int | None = None
    reclaim_order: str = "remaining"
    repopulate_pages: int = 8
    backup_ahead_pages: int = 32
    decode_pages: str = "optional"
    copy_stream: str = "side"
    load_stream: str = "compute"
    prefetch_stream: str = "compute"
    resolver_copy: str = "separate"
    resolver_lookup: str = "scan"
    admission_placement: str = "auto"
    staging_mode: str = "auto"
    cuda_graphs: str = "auto"
    cuda_graph_max_bs: int | None = None
    step_graph_warmup: bool = False
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 4
    speculative_draft_window_size: int | None = None
    speculative_draft_model_path: str | None = None
    speculative_policy: str = "fixed"
    speculative_oracle_tokens_per_round: float | None = None
    speculative_oracle_drafter: str | None = None
    replay_reference: bool = False
    resolver: str = "auto"
    kernel_backend: str = "auto"
    mla_split_rows: int | None = None
    indexer_group: bool = True
    indexer_topk: str = "auto"
    admission_lookahead: int = 8
    admission_age_bound_s: float = 10.0
    cpu_threads: int | None = None
    seed: int = 0
    dp_size: int = 1
    tp_size: int = 1
    ep_size: int = 1
    enable_dp_attention: bool = False
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout_s: float = 300.0
    disaggregation_mode: str = "null"
    disaggregation_prefill_size: int = 0
    disaggregation_decode_size: int = 0
    disaggregation_prefill_host_pool_bytes: int | None = None
    debug_checks: bool = False
    revision: str | None = None
    tokenizer: str | None = None
    chat_template: str | None = None
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    fp8_activations: str = "auto"

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ConfigValueError(f"preset must be one of {', '.join(PRESETS)}; got {self.preset!r}")
        if self.preset not in AVAILABLE_PRESETS:
            raise ConfigValueError(
                f"preset {self.preset!r} is not available in this build yet; available: {', '.join(AVAILABLE_PRESETS)}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigValueError(f"device must be auto, cpu or cuda[:N]; got {self.device!r}")
        if self.dtype not in (None, "float32", "bfloat16", "float16", "float64"):
            raise ConfigValueError(f"dtype must be float32, bfloat16, float16 or float64; got {self.dtype!r}")
        for name in ("page_size", "max_running_requests", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ConfigValueError(f"cuda_graph_max_bs must be >= 1; got {self.cuda_graph_max_bs}")
        if self.kv_pool_bytes is not None and self.kv_pool_bytes < 1:
            raise ConfigValueError(f"kv_pool_bytes must be positive; got {self.kv_pool_bytes}")
        if not 0 < self.kv_pool_fraction <= 1:
            raise ConfigValueError(f"kv_pool_fraction must be in (0, 1]; got {self.kv_pool_fraction}")
        if self.reclaim_order not in ("remaining", "largest", "newest"):
            raise ConfigValueError(f"reclaim_order must be remaining, largest or newest; got {self.reclaim_order!r}")
        if self.cuda_graphs not in ("auto", "none", "ffn", "layer", "step"):
            raise ConfigValueError(f"cuda_graphs must be 'auto', 'none', 'ffn', 'layer' or 'step', got {self.cuda_graphs!r}")
        if self.admission_placement not in PLACEMENTS:
            raise ConfigValueError(f"admission_placement must be one of {PLACEMENTS}; got {self.admission_placement!r}")
        if self.staging_mode not in STAGING_MODES:
            raise ConfigValueError(f"staging_mode must be one of {STAGING_MODES}; got {self.staging_mode!r}")
        if self.resolver_copy not in RESOLVER_COPIES:
            raise ConfigValueError(f"resolver_copy must be one of {RESOLVER_COPIES}, got {self.resolver_copy!r}")
        if self.resolver_lookup not in RESOLVER_LOOKUPS:
            raise ConfigValueError(f"resolver_lookup must be one of {RESOLVER_LOOKUPS}, got {self.resolver_lookup!r}")
        for name in ("copy_stream", "load_stream", "prefetch_stream"):
            if getattr(self, name) not in ("side", "compute"):
                raise ConfigValueError(f"{name} must be 'side' or 'compute', got {getattr(self, name)!r}")
        if self.admission_lookahead < 0 or not self.admission_age_bound_s >= 0:
            raise ConfigValueError(f"admission_lookahead must be >= 0 and admission_age_bound_s >= 0; got "
                                   f"{self.admission_lookahead}, {self.admission_age_bound_s}")
        if self.decode_pages not in DECODE_PAGES:
            raise ConfigValueError(f"decode_pages must be one of {DECODE_PAGES}; got {self.decode_pages!r}")
        if (self.admission_reserve_pages or 0) < 0 or self.repopulate_pages < 0 or self.backup_ahead_pages < 0:
            raise ConfigValueError("admission_reserve_pages, repopulate_pages and backup_ahead_pages must be >= 0")
        self.spec_config()  # validates the speculative settings (SpecConfigError names the flag)
        if self.resolver not in ("auto", "torch", "triton"):
            raise ConfigValueError(f"resolver must be auto, torch or triton; got {self.resolver!r}")
        self.kernel_settings()  # validates the kernel settings (the message names the setting)
        self._check_disaggregation()  # before parallel_config, which reads the layout
        try:
            self.parallel_config()
        except ParallelConfigError as e:
            raise ConfigValueError(str(e)) from None
        if self.cpu_threads is not None and (isinstance(self.cpu_threads, bool) or self.cpu_threads < 1):
            raise ConfigValueError(f"cpu_threads must be >= 1 (or unset); got {self.cpu_threads}")
        for name in ("hot_cache_rows", "host_pool_bytes", "disaggregation_prefill_host_pool_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigValueError(f"{name} must be positive; got {getattr(self, name)}")
        per = self.source_hot_cache_rows
        if per is not None and (not isinstance(per, tuple) or not per or any(isinstance(b, bool) or not isinstance(b, int)
                                                                              or b < 1 for b in per)):
            raise ConfigValueError(f"source_hot_cache_rows (--source-hot-cache-rows) must be a tuple of positive ints, "
                                   f"one per KV source; got {per!r}")
        for name, rows in (("hot_cache_rows", (self.hot_cache_rows,)), ("source_hot_cache_rows", per or ())):
            if any(b is not None and b > MAX_B for b in rows):  # the plan kernel's packed victim ranks
                raise ConfigValueError(f"{name} must be at most {MAX_B} rows a request and source; got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigValueError(f"max_model_len must be >= 2; got {self.max_model_len}")
        self._check_new_fields()

    def _check_new_fields(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigValueError(f"kv_cache_dtype (--kv-cache-dtype) must be one of {', '.join(KV_CACHE_DTYPES)}; "
                                   f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "bfloat16" and self.dtype not in (None, "bfloat16"):
            raise ConfigValueError(f"--kv-cache-dtype bfloat16 needs a bfloat16 model; got --dtype {self.dtype} "
                                   "(the KV cache has the model's dtype: pass --dtype bfloat16 or --kv-cache-dtype auto)")
        if self.fp8_activations not in FP8_ACTIVATIONS:
            raise ConfigValueError(f"fp8_activations (--fp8-activations) must be one of {', '.join(FP8_ACTIVATIONS)}; "
                                   f"got {self.fp8_activations!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ConfigValueError(f"quantization (--quantization) must be none or fp8 (block-scaled FP8 checkpoints); "
                                   f"got {self.quantization!r}")
        for name in ("revision", "tokenizer", "chat_template"):
            if getattr(self, name) is not None and not str(getattr(self, name)).strip():
                raise ConfigValueError(f"{name} (--{name.replace('_', '-')}) is empty; give a value or leave it out")

    def _check_disaggregation(self) -> None:
        try:
            self.disagg_layout()
        except DisaggConfigError as e:
            raise ConfigValueError(str(e)) from None

    @property
    def disaggregated(self) -> bool:
        """Prefill/decode disaggregation is on (engine/disagg.py)."""
        return self.disagg_layout().enabled

    def disagg_layout(self) -> DisaggLayout:
        """The prefill/decode layout of this engine's world (engine/disagg_layout.py)."""
        return DisaggLayout(mode=self.disaggregation_mode, prefill_size=self.disaggregation_prefill_size,
                            decode_size=self.disaggregation_decode_size, nnodes=self.nnodes, node_rank=self.node_rank,
                            dist_init_addr=self.dist_init_addr, timeout_s=self.dist_timeout_s, ep_size=self.ep_size,
                            enable_dp_attention=self.enable_dp_attention, tp_size=self.tp_size, dp_size=self.dp_size)

    @property
    def graph_max_reqs(self) -> int:
        """The most requests a CUDA-graph pass serves: min(max_running_requests, cuda_graph_max_bs)."""
        return min(self.max_running_requests, self.cuda_graph_max_bs or self.max_running_requests)

    @property
    def base_preset(self) -> str:
        """The KV policy without speculation: resident, hisparse or adaptive."""
        return self.preset.split("+")[0]

    @property
    def speculative(self) -> bool:
        return self.preset.endswith("+spec") or self.speculative_algorithm is not None

    def spec_config(self):
        """The SpecConfig of this engine (None without speculation)."""
        if not self.speculative:
            return None
        algorithm = self.speculative_algorithm or "dflash"
        network = self.speculative_oracle_drafter or algorithm  # a costed oracle runs that drafter's network
        path = self.speculative_draft_model_path or builtin_drafter(self.model, network)  # tiny-code ships its own
        return SpecConfig(algorithm=algorithm, num_draft_tokens=self.speculative_num_draft_tokens,
                          draft_window_size=self.speculative_draft_window_size, page_size=self.page_size,
                          draft_model_path=path, policy=self.speculative_policy,
                          oracle_tokens_per_round=self.speculative_oracle_tokens_per_round,
                          oracle_drafter=self.speculative_oracle_drafter, seed=self.seed)

    def parallel_config(self) -> ParallelConfig:
        """The process layout of this engine (core/parallel.py). Under prefill/decode disaggregation
        every rank is one engine of world size 1 here: the world is `disagg_layout()`."""
        if self.disaggregated:
            return ParallelConfig(timeout_s=self.dist_timeout_s)
        return ParallelConfig(dp_size=self.dp_size, tp_size=self.tp_size, ep_size=self.ep_size,
                              enable_dp_attention=self.enable_dp_attention, nnodes=self.nnodes, node_rank=self.node_rank,
                              dist_init_addr=self.dist_init_addr, timeout_s=self.dist_timeout_s)

    def store_settings(self) -> StoreSettings:
        """The KV store settings of this engine (kv/build.py)."""
        return StoreSettings(
            preset=self.base_preset, page_size=self.page_size, hot_cache_rows=self.hot_cache_rows,
            source_hot_cache_rows=self.source_hot_cache_rows,
            host_pool_bytes=self.host_pool_bytes, resolver=self.resolver, copy_stream=self.copy_stream,
            load_stream=self.load_stream, prefetch_stream=self.prefetch_stream, resolver_copy=self.resolver_copy,
            resolver_lookup=self.resolver_lookup,
            admission_placement=self.admission_placement, staging_mode=self.staging_mode, reserve_pages=self.admission_reserve_pages, reclaim_order=self.reclaim_order,
            repopulate_pages=self.repopulate_pages, backup_ahead_pages=self.backup_ahead_pages,
            decode_pages=self.decode_pages,
            max_running=self.max_running_requests, max_queries=self.speculative_num_draft_tokens if self.speculative else 1,
            debug=self.debug_checks, kv_cache_dtype=self.kv_cache_dtype)

    def kernel_settings(self) -> KernelSettings:
        """The kernel choice of this engine, before the environment overrides (`with_env`)."""
        try:
            return KernelSettings(self.kernel_backend, self.mla_split_rows, self.indexer_group, self.indexer_topk)
        except ValueError as e:
            raise ConfigValueError(str(e)) from None

    @classmethod
    def from_kwargs(cls, **kw: object) -> "EngineConfig":
        """Build from keyword settings, rejecting unknown names with the list of valid ones."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kw) - names)
        if unknown:
            raise ConfigValueError(f"unknown engine setting(s) {unknown}; valid settings: {sorted(names)}")
        return cls(**kw)  # type: ignore[arg-type]
