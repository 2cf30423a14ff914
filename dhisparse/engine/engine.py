"""The engine: requests in, one batched model pass per `step()`, outputs out.

Life of a step: schedule (admit + chunks) -> build ForwardBatch -> KV context from the store ->
model forward -> logits at the last token of chunks that complete a request's pending tokens ->
sample -> stop checks -> outputs; finished requests free their KV.

`Engine` holds the state and the public surface; the work lives in modules of one concern each:
admission (`admission.py`), prepared prefixes (`prefixes.py`), disaggregation's kept and arrived
prompts (`handoff.py`), the step and its phases (`step_loop.py`, `forward.py`, `sample.py`,
`verification.py`, `outputs.py`), a request's end and failure isolation (`finish.py`) and the
stats snapshot (`stats.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from functools import partial

import torch

from dhisparse.core.logits import TokenLogprob
from dhisparse.core.params import SamplingParams
from dhisparse.core.sampling import Sampler, make_generator
from dhisparse.engine import finish, forward, graph_setup, handoff, outputs, prefixes, sample, step_loop, verification
from dhisparse.engine.admission import on_admit
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.disagg_kv import PromptKV
from dhisparse.engine.grammar import Grammars
from dhisparse.engine.memory import format_bytes, kv_pool_bytes, release_memory, resolve_device
from dhisparse.engine.replay import ReferenceReplay
from dhisparse.engine.request import Request, RequestOutput, next_request_id
from dhisparse.engine.scheduler import Chunk, Scheduler
from dhisparse.engine.series import SeriesRecorder
from dhisparse.engine.spec_memory import spec_memory
from dhisparse.engine.speculative import SpecRuntime
from dhisparse.engine.stats import EngineStats, engine_stats
from dhisparse.engine.step_graphs import StepGraphs
from dhisparse.engine.stops import FeedDetokenizer, StopChecker
from dhisparse.kernels import backend as kernel_backend
from dhisparse.kv.build import build_store
from dhisparse.kv.memory.prefix_store import PrefixStore, StoredPrefix
from dhisparse.layers.fp8_linear import resolve_fp8_activations
from dhisparse.models.dsa import ModelOutput
from dhisparse.models.graphs import CudaGraphRunner
from dhisparse.models.registry import LoadedModel, load_for_config
from dhisparse.models.tokenizer import stream_detokenizer

log = logging.getLogger("dhisparse.engine")


class Engine:
    """One engine over one model and one KV store (see the module docstring for its modules).

    Request state the modules share: `requests` (unfinished, by id), `_matches` (a waiting
    request's prefix match), `_failed` (a request's own failure, until reported), `_held_outputs`
    (outputs of steps `prepare_prefix` ran), `_keeping` / `kept_prompts` / `_arrived` /
    `_first_outputs` / `arrival_placements` (disaggregation), `_verify_lps` (a round's logprobs);
    counters `_steps`, `_generated`, `_prefilled`, `_peak`, `_decoding`, `_admitted`, `_alloc_wait`.
    """

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None, oracle_reference=None) -> None:
        """oracle_reference: prompt ids -> reference output ids (a dict or callable), needed only by
        the oracle drafter and by `replay_reference` (benchmark measurement tools)."""
        self.config = config = config or EngineConfig()
        if config.replay_reference and oracle_reference is None:
            raise ValueError("replay_reference: the engine needs the reference outputs to replay "
                             "(Engine(oracle_reference=...): bench/gpu_serving.py --replay-reference passes them)")
        self.replay = ReferenceReplay(oracle_reference) if config.replay_reference else None
        if config.disaggregated:
            raise ValueError("prefill/decode disaggregation (--disaggregation-mode, --disaggregation-prefill-size / "
                             "-decode-size) runs one engine per rank: build it with engine/disagg_launch.build_disagg "
                             "(`dhisparse serve` does), not as one Engine")
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.cpu_threads or 1)
        kernel_backend.configure(config.kernel_settings().with_env())  # env overrides read here, not at import
        self.loaded = loaded or load_for_config(config, self.device)  # revision, tokenizer, chat template, quantization
        if self.loaded.model.device.type != self.device.type:  # a model loaded elsewhere (e.g. a CPU test fixture)
            log.info("moving the model from %s to %s", self.loaded.model.device, self.device)
            self.loaded.model.to(self.device)
        self.model, self.model_config, self.tokenizer = self.loaded.model, self.loaded.config, self.loaded.tokenizer
        self.fp8_activations, n_fp8 = resolve_fp8_activations(self.model, config.fp8_activations,
                                                              self.model_config.fp8_activation_scheme)
        if n_fp8 == 0 and config.fp8_activations == "dynamic":
            raise ValueError(f"fp8_activations (--fp8-activations) {config.fp8_activations!r} needs a model with FP8 "
                             f"weights (glm5-faithful, v41-faithful); {config.model!r} has none")
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        graph_setup.set_graphs(self, config.cuda_graphs)
        spec_cfg = config.spec_config()
        if spec_cfg is not None:  # a full-attention drafter's window is the whole context
            spec_cfg = dataclasses.replace(spec_cfg, max_context=self.max_model_len)
        # the drafter (weights, ring) first: a pool sized from free device memory leaves it out
        self.spec = SpecRuntime(spec_cfg, self.model, config.max_running_requests, oracle_reference,
                                self.replay) if spec_cfg else None
        graph_setup.drafter_graphs(self, config)
        self.store, pages = self._build_kv(config)
        self.prefixes = PrefixStore(pin=self.device.type == "cuda")
        self.scheduler = Scheduler(self.store, config.max_running_requests, config.max_num_batched_tokens, partial(on_admit, self),
                                   config.admission_lookahead, config.admission_age_bound_s)
        self.sampler = Sampler()
        self._init_state()
        self.store.set_prefix_match(partial(prefixes.prefix_match, self))  # the hierarchy's admission reserves no host page it will borrow
        graph_setup.capture_graphs(self, config)
        self.step_graphs = self.make_step_graphs(CudaGraphRunner()) if self.graph_mode == "step" else None
        if self.step_graphs is not None and config.step_graph_warmup:
            self.step_graphs.warm(config.graph_max_reqs, self.spec.capture if self.spec else ())
        log.info("KV pool: %d pages x %s = %s on %s; %s", pages, format_bytes(self.page_bytes),
                 format_bytes(pages * self.page_bytes), self.device, self._row_format_note(config))
        self.spec_memory = None if self.spec is None else spec_memory(
            self.store, self.spec.drafter.device_bytes(), self.page_bytes, self.max_model_len, self._fixed_pages)
        if self.spec_memory is not None:
            log.info("%s", self.spec_memory.note())

    def _init_state(self) -> None:
        """Requests, their bookkeeping and the counters (the class docstring lists them)."""
        self.requests: dict[str, Request] = {}
        self._matches: dict[str, tuple] = {}  # request id -> its stored prefix match, until admitted
        self._failed: dict[str, str] = {}  # request id -> why its own work failed, until reported
        self._steps = self._generated = self._prefilled = self._peak = self._decoding = self._admitted = 0
        self._alloc_wait = 0.0
        self._t0 = time.perf_counter()
        self._held_outputs: list[RequestOutput] = []
        # prefill/decode disaggregation (engine/disagg.py): prompts kept for a decode engine, and arrived ones
        self._keeping: dict[str, StoredPrefix | None] = {}  # keep_prompt request id -> its prompt's KV once read (else None)
        self.kept_prompts: dict[str, PromptKV] = {}  # request id -> what a decode engine needs; taken by the caller
        self._arrived: dict[str, PromptKV] = {}  # add_prompt_kv request id -> its KV and first token, until admitted
        self._first_outputs: list[RequestOutput] = []  # first tokens of arrived requests admitted this step
        self.arrival_placements: dict[str, bool] = {}  # arrived request id -> admitted host-first; taken by the caller
        # expert parallelism (engine/launch.py): called once a step with "this rank has work"; True
        # when any rank has, so a rank with none joins the pass's MoE exchanges (`idle_pass`)
        self.lockstep = None
        self._verify_lps: dict[str, list[TokenLogprob]] = {}  # request id -> this round's emitted logprobs
        self._grammars: Grammars | None = None
        self.series = SeriesRecorder(1.0)  # per-second engine counters (see EngineStats.as_dict)

    def _row_format_note(self, config: EngineConfig) -> str:
        """'<kv_cache_dtype> rows: <latent> B latent, <index> B index keys' for the start-up log."""
        if self.arena is None:  # DeepSeek-V4 resident: rows live in its dense store
            return f"--kv-cache-dtype {config.kv_cache_dtype}"
        f = self.arena.formats
        return f"--kv-cache-dtype {config.kv_cache_dtype}: {f.latent.nbytes}-B rows, {f.index.nbytes}-B index keys"

    @property
    def grammars(self) -> Grammars:
        """Structured output (engine/grammar.py): built on the first request with a grammar."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.model_config.vocab_size)
        return self._grammars

    def make_step_graphs(self, runner) -> StepGraphs | None:
        """Whole-step graphs of this engine's passes, replayed by `runner` (`StepGraphs.for_engine`)."""
        return StepGraphs.for_engine(self, runner)

    def _row_spaces(self, layer: int) -> list:
        """Row spaces a layer's sparse attention reads: the arena's rows, and with a staging arena
        (speculative verification over the hierarchy) also the (rows, stage) pair."""
        rows = self.arena.latent_rows(layer)
        stage = self.store.staging_rows(layer)
        return [rows] if stage is None else [rows, (rows, stage)]

    def _build_kv(self, config: EngineConfig):
        """The KV store of the preset and its pool size in pages (kv/build.py)."""
        if self.device.type == "cuda":
            release_memory()  # an earlier engine not yet collected must not hold its pools (or shrink ours)
        pool = kv_pool_bytes(config.kv_pool_bytes, config.kv_pool_fraction, self.device)
        built = build_store(config.store_settings(), self.model_config, pool, self.device, self.model.dtype, self.max_model_len)
        self.arena, self.page_bytes = built.arena, built.page_bytes
        return built.store, built.pages

    # -- requests --------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Prompt text or ids -> token ids: an empty prompt becomes [BOS]; ids outside the
        vocabulary are a ValueError."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            if self.model_config.bos_token_id is None and self.tokenizer.bos_token_id is None:
                raise ValueError("prompt is empty and the model has no BOS token; send at least one token")
            ids = [self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.model_config.bos_token_id]
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.model_config.vocab_size})")
        return ids

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """ValueError unless prompt + max_tokens fits `max_model_len` and every pool it will need
        (`KVStore.never_fits`): a request that can never fit is refused at once."""
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens and max_tokens is {params.max_tokens}: {total} exceeds "
                f"max_model_len {self.max_model_len}; shorten the prompt or lower max_tokens"
            )
        why = self.store.never_fits(total, len(prompt_ids))
        if why is not None:
            raise ValueError(why)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None, *,
                    export_prefix: bool = False, keep_prompt: bool = False) -> str:
        """Queue a request; returns its id. Raises ValueError for bad input (nothing is queued).
        keep_prompt (a prefill engine of prefill/decode disaggregation): once its first token is sampled,
        its whole prompt's KV and sampling state wait in `kept_prompts` (`PromptKV`) for a decode engine."""
        params = params or SamplingParams()
        ids = self.encode_prompt(prompt)
        self.validate(ids, params)
        rid = request_id or next_request_id()
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        matcher = self.grammars.matcher(params.grammar) if params.grammar is not None else None
        detok = FeedDetokenizer(stream_detokenizer(self.tokenizer, params.skip_special_tokens))
        # a grammar allows EOS only where its document is complete, so EOS ends it even with ignore_eos
        eos = () if params.ignore_eos and params.grammar is None else \
            tuple(self.tokenizer.eos_token_ids or self.model_config.eos_token_ids)
        req = Request(rid, ids, params, make_generator(params.seed, self.device), StopChecker(params, eos, detok), export_prefix=export_prefix,
                      eos=eos, prompt_logprobs=None if params.prompt_logprobs is None else [None], matcher=matcher)
        self.requests[rid] = req
        self.scheduler.add(req)
        if keep_prompt:
            self._keeping[rid] = None
        return rid

    def add_prompt_kv(self, kv: PromptKV, params: SamplingParams, request_id: str) -> str:
        """Queue a request whose whole prompt's KV and first token were computed by a prefill engine
        (prefill/decode disaggregation, engine/disagg.py). It waits for admission like any request (its
        wait is this engine's allocation wait), imports all n prompt rows (`StoredPrefix.whole_prompt`:
        placed resident-first or host-first, kv/hier/arrival.py), reports the first token with its first
        output at admission, and decodes from it at position n: no prompt token runs here."""
        return handoff.add_prompt_kv(self, kv, params, request_id)

    def forget_learning(self) -> None:
        """Speculation back to its priors: the online width policy's acceptance and the measured
        round costs (`SpecRuntime.forget_learning`; nothing without speculation). `warm_up` calls
        it: what synthetic warm-up requests taught says nothing about real traffic."""
        if self.spec is not None:
            self.spec.forget_learning()

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request and free its KV; False if unknown/finished."""
        return finish.abort(self, request_id)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.has_work()

    def prepare_prefix(self, prompt: str | list[int]) -> int:
        """Prefill `prompt` once and keep its KV for later requests to import; returns its length.
        A prefix already stored is kept as it is (no second prefill), unless it lacks hidden
        features this engine's drafter reads (`SpecRuntime.serves`): then it is prefilled again,
        in full, and replaced."""
        return prefixes.prepare_prefix(self, prompt)

    # -- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step: the outputs of every request that advanced or finished. A request whose
        own work fails (sampling, KV upkeep, admission, drafting, stop checks) finishes with
        finish_reason "error" and its message; the others are unaffected. A failure of the step's
        batched model pass, which cannot be told apart per request, finishes that pass's requests
        with "error"; waiting requests and the engine go on. An AssertionError (a violated invariant,
        a debug check) is never isolated: it propagates, as the store's state is not trusted."""
        return step_loop.run_step(self)

    # The step's phases, called through these methods so that a wrapper on the instance sees
    # every call (bench/host_phases.py times them; tests wrap `_split`).
    def _step(self, chunks: list[Chunk]) -> list[RequestOutput]:
        return step_loop.step_pass(self, chunks)

    def _forward(self, chunks: list[Chunk]) -> tuple[list[Chunk], list[int], ModelOutput]:
        return forward.forward(self, chunks)

    def _split(self, chunks: list[Chunk]) -> list[list[Chunk]]:
        return forward.split(self, chunks)

    def _verify(self, verifying: list[tuple[Chunk, int, int]], hidden: torch.Tensor):
        return verification.verify(self, verifying, hidden)

    def _sample(self, sampled: list[tuple[Chunk, int]], hidden: torch.Tensor) -> list[RequestOutput]:
        return sample.sample(self, sampled, hidden)

    def _append_tokens(self, req: Request, toks: list[int], now: float,
                       logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        return outputs.append_tokens(self, req, toks, now, logprobs)

    def _commit(self, verifying, accs, captured) -> list[RequestOutput]:
        return verification.commit(self, verifying, accs, captured)

    # -- the engine ------------------------------------------------------------------------------
    @property
    def _fixed_pages(self) -> int:
        """Pool pages the engine itself holds for its whole life (the step graphs' scratch page):
        left out of the reported pool, so an idle engine reports 0 pages used."""
        return StepGraphs.SCRATCH_PAGES if self.step_graphs is not None else 0

    def close(self) -> None:
        """Release the engine (the Engine surface's end; a data-parallel `Coordinator` stops its
        ranks). One process holds nothing that garbage collection does not free."""

    def stats(self) -> EngineStats:
        """A snapshot of the engine's requests, pool, totals and counters (`stats.engine_stats`)."""
        return engine_stats(self)
