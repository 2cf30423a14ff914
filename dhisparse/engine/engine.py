"""The engine: requests in, one batched model pass per `step()`, outputs out.

Life of a step: schedule (admit + chunks) -> build ForwardBatch -> KV context from the store ->
model forward -> logits at the last token of chunks that complete a request's pending tokens ->
sample -> stop checks -> outputs; finished requests free their KV.
"""

from __future__ import annotations

import dataclasses

import logging
import time

import torch

from dhisparse.core.contracts import RequestFailures
from dhisparse.core.logits import History, TokenLogprob, apply_processors, needs_history, token_logprobs
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.disagg_kv import PromptKV, whole_prompt
from dhisparse.engine.disagg_v4 import whole_state
from dhisparse.engine.grammar import Grammars
from dhisparse.kernels import backend as kernel_backend
from dhisparse.engine.memory import format_bytes, kv_pool_bytes, release_memory, resolve_device
from dhisparse.core.params import SamplingParams
from dhisparse.engine.request import Request, RequestOutput, Status, next_request_id
from dhisparse.engine.spec_memory import spec_memory
from dhisparse.core.sampling import Sampler, make_generator
from dhisparse.engine.scheduler import Chunk, Scheduler
from dhisparse.engine.series import SeriesRecorder
from dhisparse.engine.speculative import SpecRuntime
from dhisparse.spec.verify import row_history
from dhisparse.engine.stats import EngineStats, pool_counters, store_counters
from dhisparse.engine.stops import StopChecker
from dhisparse.core.batch import ForwardBatch
from dhisparse.kv.memory.prefix_store import PrefixStore, StoredPrefix
from dhisparse.kv.v4.prefix import V4Prefix
from dhisparse.kv.build import build_store
from dhisparse.engine.step_graphs import StepGraphs
from dhisparse.models.graphs import CudaGraphRunner, auto_graph_mode, graph_counters, graphs_for
from dhisparse.layers.ep_moe import idle_pass
from dhisparse.models.dsa import ModelOutput
from dhisparse.models.registry import LoadedModel, load_for_config
from dhisparse.models.tokenizer import stream_detokenizer

log = logging.getLogger("dhisparse.engine")


class Engine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None, oracle_reference=None) -> None:
        """oracle_reference: prompt ids -> reference output ids (a dict or callable), needed only by
        the oracle drafter (a benchmark measurement tool)."""
        self.config = config = config or EngineConfig()
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
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self._set_graphs(config.cuda_graphs)
        spec_cfg = config.spec_config()
        if spec_cfg is not None:  # a full-attention drafter's window is the whole context
            spec_cfg = dataclasses.replace(spec_cfg, max_context=self.max_model_len)
        # the drafter (weights, ring) first: a pool sized from free device memory leaves it out
        self.spec = SpecRuntime(spec_cfg, self.model, config.max_running_requests, oracle_reference) if spec_cfg else None
        self.store, pages = self._build_kv(config)
        self.prefixes = PrefixStore(pin=self.device.type == "cuda")
        self.scheduler = Scheduler(self.store, config.max_running_requests, config.max_num_batched_tokens, self._on_admit,
                                   config.admission_lookahead, config.admission_age_bound_s)
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self._matches: dict[str, tuple] = {}  # request id -> its stored prefix match, until admitted
        self._failed: dict[str, str] = {}  # request id -> why its own work failed, until reported
        self.store.set_prefix_match(self._prefix_match)  # the hierarchy's admission reserves no host page it will borrow
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
        self._capture_graphs(config)
        self.step_graphs = self.make_step_graphs(CudaGraphRunner()) if self.graph_mode == "step" else None
        if self.step_graphs is not None and config.step_graph_warmup:
            self.step_graphs.warm(config.graph_max_reqs, self.spec.capture if self.spec else ())
        log.info("KV pool: %d pages x %s = %s on %s; %s", pages, format_bytes(self.page_bytes),
                 format_bytes(pages * self.page_bytes), self.device, self._row_format_note(config))
        self.spec_memory = None if self.spec is None else spec_memory(
            self.store, self.spec.drafter.device_bytes(), self.page_bytes, self.max_model_len, self._fixed_pages)
        if self.spec_memory is not None:
            log.info("%s", self.spec_memory.note())

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

    def _set_graphs(self, mode: str) -> None:
        experts = self.model_config.n_routed_experts
        if mode == "auto":
            mode = auto_graph_mode(self.device, self.model.supports_cuda_graphs, experts)
        self.graph_mode = mode
        if not self.model.supports_cuda_graphs:
            if mode != "none":
                raise ValueError(f"cuda_graphs {mode!r} is available for DSA models (GLM-5.x, DeepSeek-V3.2) only")
            return
        self.model.graphs = graphs_for(self.device, mode, experts, self.model.graphs)

    def _capture_graphs(self, config: EngineConfig) -> None:
        """Graph pieces for every decode / verification batch size, captured before serving."""
        if self.model.graphs is None:
            return
        t0 = time.perf_counter()
        per_request = config.speculative_num_draft_tokens if config.speculative else 1
        n = self.model.capture_graphs(config.graph_max_reqs * per_request, self._row_spaces,
                                      self.arena.formats.latent)
        if n:
            log.info("captured %d CUDA graphs (pieces x layers x buckets <= %d tokens) in %.1f s", n,
                     self.model.graphs.limit, time.perf_counter() - t0)

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
        detok = _Detok(stream_detokenizer(self.tokenizer, params.skip_special_tokens))
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
        if params.max_tokens < 2:
            raise ValueError(f"request {request_id!r}: a request handed over after its first token needs max_tokens >= 2")
        if self.spec is not None and not self.spec.serves(kv.item):
            raise ValueError(f"request {request_id!r}: its prompt KV lacks the hidden features the drafter reads")
        rid = self.add_request(list(kv.item.token_ids), params, request_id)
        req = self.requests[rid]
        req.generator.set_state(kv.generator_state)
        req.prompt_logprobs = kv.prompt_logprobs
        self._matches[rid] = (kv.item, kv.prompt_len)
        self._arrived[rid] = kv
        return rid

    def forget_learning(self) -> None:
        """Speculation back to its priors: the online width policy's acceptance and the measured
        round costs (`SpecRuntime.forget_learning`; nothing without speculation). `warm_up` calls
        it: what synthetic warm-up requests taught says nothing about real traffic."""
        if self.spec is not None:
            self.spec.forget_learning()

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request and free its KV; False if unknown/finished."""
        req = self.requests.pop(request_id, None)
        self._keeping.pop(request_id, None)
        if req is None or req.status is Status.FINISHED:
            return False
        self._finish(req, "abort")
        return True

    def _prefix_match(self, request_id: str) -> tuple:
        """(stored prefix or None, rows to import) for a waiting request, matched once. A prefix
        without the features this engine's drafter reads is not imported (the prompt is prefilled)."""
        m = self._matches.get(request_id)
        if m is None and self.requests[request_id].params.prompt_logprobs is not None:
            m = self._matches[request_id] = (None, 0)  # prompt logprobs need every prompt position's logits
        if m is None:
            m = self.prefixes.match(self.requests[request_id].prompt_ids)
            if m[0] is not None and self.spec is not None and not self.spec.serves(m[0]):
                m = (None, 0)
            self._matches[request_id] = m
        return m

    def _finish(self, req: Request, reason: str) -> None:
        self.scheduler.finish(req, reason)
        self.requests.pop(req.request_id, None)
        self._matches.pop(req.request_id, None)
        self._arrived.pop(req.request_id, None)
        if self.spec is not None:
            self.spec.release(req.request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def _on_admit(self, req: Request) -> None:
        """A request was admitted: its drafter state and prefix import. A failure here is that
        request's alone (reported after the schedule, `_fail_pending`)."""
        try:
            self._admitted_work(req)
        except AssertionError:  # a violated invariant or debug check: never a request's own fault
            raise
        except Exception as e:  # noqa: BLE001 - one request's failure aborts it alone
            self._failed[req.request_id] = f"admission failed: {type(e).__name__}: {e}"

    def _admitted_work(self, req: Request) -> None:
        if self.spec is not None:
            self.spec.admit(req.request_id)
        self._admitted += 1
        self._alloc_wait += (req.admitted_at or req.arrival) - req.arrival
        item, n = self._prefix_match(req.request_id)
        self._matches.pop(req.request_id, None)
        n = self.store.import_len(item, n) if item is not None else 0  # V4: whole prefixes only
        if n > 0:
            self.store.import_prefix(req.request_id, item, n)  # whole pages where the store has a page layout
            req.num_computed = req.imported_len = n
            if self.spec is not None:
                self.spec.observe_import(req.request_id, item, n)
        kv = self._arrived.pop(req.request_id, None)
        if kv is not None:  # its first token: reported now, decoded from in this step's chunks
            self.arrival_placements[req.request_id] = self.store.prompt_chunk_limit(req.request_id) is not None
            if req.matcher is not None:
                req.matcher.consume([kv.first_token])
            self._first_outputs.append(self._append_tokens(req, [kv.first_token], time.perf_counter(), kv.logprobs))

    # -- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step: the outputs of every request that advanced or finished. A request whose
        own work fails (sampling, KV upkeep, admission, drafting, stop checks) finishes with
        finish_reason "error" and its message; the others are unaffected. A failure of the step's
        batched model pass, which cannot be told apart per request, finishes that pass's requests
        with "error"; waiting requests and the engine go on. An AssertionError (a violated invariant,
        a debug check) is never isolated: it propagates, as the store's state is not trusted."""
        held, self._held_outputs = self._held_outputs, []
        chunks = self.scheduler.schedule()
        failed = self._fail_pending()
        failed, self._first_outputs = failed + self._first_outputs, []
        chunks = [c for c in chunks if c.req.status is not Status.FINISHED]
        if self.lockstep is not None and self.lockstep(bool(chunks)) and not chunks:
            idle_pass(self.model, self.model.dtype, self.device)  # others run a pass: join its MoE exchanges
        if not chunks:
            self.store.idle()  # nothing to run: settle copies in flight (an idle pool holds no dead pages)
            return held + failed
        try:
            outs = held + failed + self._step(chunks)
        except AssertionError:  # a violated invariant or debug check: never a request's own fault
            raise
        except Exception as e:  # noqa: BLE001 - the batched pass failed: its requests fail, the engine serves on
            if self.lockstep is not None:  # peers are inside the same pass's exchanges: the group cannot go on
                raise
            log.exception("engine step failed; its %d requests are aborted", len(chunks))
            msg = f"engine step failed: {type(e).__name__}: {e}"
            return held + failed + [self._fail(c.req, msg) for c in chunks if c.req.status is not Status.FINISHED]
        if not self.has_unfinished():
            self.store.idle()  # the last request just finished: its draining pages go now
        return outs

    def _fail(self, req: Request, msg: str) -> RequestOutput:
        """Finish `req` with finish_reason "error" (its KV freed) and report it."""
        log.warning("request %s failed: %s", req.request_id, msg)
        req.error = msg
        self._keeping.pop(req.request_id, None)
        self._finish(req, "error")
        pieces = req.stop.pieces
        return RequestOutput(req.request_id, [], "", True, "error", req.metrics(), req.output_ids, len(req.output_ids),
                             pieces, len(pieces), error=msg)

    def _fail_pending(self) -> list[RequestOutput]:
        failed, self._failed = self._failed, {}
        return [self._fail(self.requests[r], m) for r, m in failed.items() if r in self.requests]

    def _step(self, chunks: list[Chunk]) -> list[RequestOutput]:
        if self.spec is not None:
            chunks = self.spec.expand(chunks, len(self.scheduler.running))
        t_start = time.perf_counter()
        chunks, qs, out = self._forward(chunks)
        self.store.before_sync()  # KV upkeep that needs no result of this step runs while it computes
        self._steps += 1
        self._peak = max(self._peak, self.store.usage().used - self._fixed_pages)
        sampled: list[tuple[Chunk, int]] = []
        verifying: list[tuple[Chunk, int, int]] = []
        for i, c in enumerate(chunks):
            a, b = qs[i], qs[i + 1]
            if c.verify:
                verifying.append((c, a, b))
                continue
            self._prefilled += max(0, min(len(c.req.prompt_ids), c.start + len(c.tokens)) - c.start)
            c.req.num_computed = c.start + len(c.tokens)
            if self.spec is not None and not c.decodes:
                self.spec.observe_prefill(c, out.captured, a, b)
                if c.req.export_prefix or c.req.request_id in self._keeping:
                    self.spec.keep_features(c.req.request_id, out.captured, a, b)
            if c.req.prompt_logprobs is not None and not c.decodes:
                self._prompt_logprobs(c, out.hidden, a, b)
            if c.sample:
                sampled.append((c, b - 1))
        accs = self._verify(verifying, out.hidden)
        for c, _ in sampled:
            if c.req.export_prefix:
                self._export(c.req)
            elif c.req.request_id in self._keeping:  # read before the store's hand-off moves the workspace
                self._keeping[c.req.request_id] = self._prompt_rows(c.req)
        try:
            self.store.after_step({c.req.request_id: (c.req.num_computed, not c.req.in_prefill) for c in chunks})
        except RequestFailures as f:  # the store did every other request's upkeep
            self._failed.update({r: f"KV upkeep failed: {type(e).__name__}: {e}" for r, e in f.failures.items()})
        outputs = self._fail_pending()
        outputs += self._sample([(c, i) for c, i in sampled if not c.req.export_prefix and c.req.status is not Status.FINISHED], out.hidden)
        self._keep_prompts([c.req for c, _ in sampled])
        outputs += self._commit([v for v in verifying if v[0].req.status is not Status.FINISHED],
                                [a for v, a in zip(verifying, accs) if v[0].req.status is not Status.FINISHED], out.captured)
        self._verify_lps.clear()
        if self.spec is not None:
            self.spec.observe_step(time.perf_counter() - t_start, all(c.decodes for c in chunks))
        self._decoding = sum(1 for c in chunks if c.decodes)
        self.series.observe(time.perf_counter() - self._t0, len(outputs), self._decoding, lambda: self.stats().as_dict())
        if self.config.debug_checks:
            self.store.check_integrity()
        return outputs

    def _forward(self, chunks: list[Chunk]) -> tuple[list[Chunk], list[int], ModelOutput]:
        """The step's model pass(es): (chunks in pass order, their N+1 token offsets, output).
        With step graphs a mixed step runs as two passes, its decodes (replayed from a graph) and
        then its prefill chunks (eagerly), so a few prompt tokens do not send every decode down
        the eager path. Requests are independent, so the split changes no result."""
        capture = self.spec.capture if self.spec else ()
        parts = self._split(chunks)
        outs, qs = [], [0]
        for part in parts:
            batch = ForwardBatch.build([(c.tokens, c.start) for c in part], self.device)
            ctx = self.store.context(batch, [c.req.request_id for c in part])
            out = self.step_graphs.forward(batch, ctx, capture) if self.step_graphs is not None else None
            outs.append(out if out is not None else self.model(batch, ctx, capture_layers=capture))
            base = qs[-1]
            qs.extend(base + x for x in batch.query_start[1:])
        ordered = [c for part in parts for c in part]
        if len(outs) == 1:
            return ordered, qs, outs[0]
        captured = {l: torch.cat([o.captured[l] for o in outs]) for l in outs[0].captured}
        return ordered, qs, ModelOutput(torch.cat([o.hidden for o in outs]), captured)

    def _split(self, chunks: list[Chunk]) -> list[list[Chunk]]:
        return [chunks] if self.step_graphs is None else self.step_graphs.split(chunks)

    def _verify(self, verifying: list[tuple[Chunk, int, int]], hidden: torch.Tensor):
        """Accept drafts; the committed frontier becomes n + 1 + A (eq. 7)."""
        if not verifying:
            return []
        rows = [i for _, a, b in verifying for i in range(a, b)]
        if rows != list(range(hidden.shape[0])):  # a verification-only pass uses every row, in order
            hidden = hidden.index_select(0, torch.tensor(rows).to(hidden.device, non_blocking=True))
        raw = self.model.logits(hidden)
        consumed: dict[str, int] = {}
        accs = self.spec.verify(verifying, self._processed_verify_logits(verifying, raw, consumed))
        off = 0
        for (c, a, b), acc in zip(verifying, accs):
            c.req.num_computed = c.start + acc.committed
            if c.req.matcher is not None:  # rejected drafts rolled back, the bonus consumed
                try:
                    c.req.matcher.settle(consumed[c.req.request_id], acc.accepted, acc.bonus)
                except Exception as e:  # noqa: BLE001 - that request alone fails (reported before the commit)
                    self._failed[c.req.request_id] = f"grammar: {type(e).__name__}: {e}"
            k = c.req.params.logprobs
            if k is not None:
                rows = raw[off : off + len(acc.emitted)]
                self._verify_lps[c.req.request_id] = token_logprobs(rows, acc.emitted, [k] * len(acc.emitted))
            off += b - a
        return accs

    @staticmethod
    def _processed_verify_logits(verifying, raw: torch.Tensor, consumed: dict[str, int]) -> torch.Tensor:
        """Verification rows through the requests' logit processors (core/logits.py): row i of a
        chunk [anchor, d_1..] sees the output so far + d_1..d_i, as decoding one token at a time
        would, and the grammar mask after d_1..d_i (`Matcher.round_masks`; `consumed`: drafts the
        matcher took, rolled back in `_verify`); the verifier then judges drafts against exactly
        what the Sampler samples from."""
        if not any(needs_history(c.req.params) for c, _, _ in verifying):
            return raw
        params, hist = [], []
        for c, a, b in verifying:
            r, masks = c.req, None
            if r.matcher is not None:
                masks, consumed[r.request_id] = r.matcher.round_masks(c.tokens[1:])
            h = History(r.prompt_ids, r.output_ids, r.eos) if needs_history(r.params) else None
            params.extend([r.params] * (b - a))
            hist.extend(row_history(h, c.tokens[1:], masks))
        return apply_processors(raw, params, hist)

    def _prompt_logprobs(self, c: Chunk, hidden: torch.Tensor, a: int, b: int) -> None:
        """Logprobs of the prompt tokens this prefill chunk predicts (row j -> position start+j+1)."""
        prompt = c.req.prompt_ids
        n = min(b - a, len(prompt) - 1 - c.start)
        if n <= 0:
            return
        logits = self.model.logits(hidden[a : a + n])
        toks = prompt[c.start + 1 : c.start + 1 + n]
        c.req.prompt_logprobs.extend(token_logprobs(logits, toks, [c.req.params.prompt_logprobs] * n))

    def _commit(self, verifying, accs, captured) -> list[RequestOutput]:
        """The drafter commits of a round at once; a request whose commit fails fails alone (an
        AssertionError, a violated invariant or debug check, is never a request's fault: it propagates)."""
        now, outs = time.perf_counter(), []
        if not verifying:
            return outs
        errors = self.spec.commit_all([(c, acc, a) for (c, a, _), acc in zip(verifying, accs)], captured)
        for ((c, _, _), acc), e in zip(zip(verifying, accs), errors):
            if e is not None:  # that request's drafter state: it alone fails
                outs.append(self._fail(c.req, f"drafter commit failed: {type(e).__name__}: {e}"))
                continue
            outs.append(self._append_tokens(c.req, acc.emitted, now, self._verify_lps.get(c.req.request_id)))
        return outs

    def _sample(self, sampled: list[tuple[Chunk, int]], hidden: torch.Tensor) -> list[RequestOutput]:
        """Sample the next token of each (chunk, flattened index of its last token)."""
        if not sampled:
            return []
        reqs = [c.req for c, _ in sampled]
        idx = [i for _, i in sampled]
        if idx != list(range(hidden.shape[0])):  # a decode pass samples every row, in order
            hidden = hidden.index_select(0, torch.tensor(idx).to(hidden.device, non_blocking=True))  # no sync
        logits = self.model.logits(hidden)
        params = [r.params for r in reqs]
        hist = [r.history() if needs_history(p) else None for r, p in zip(reqs, params)]
        sample = self.sampler.sample(logits, params, [r.generator for r in reqs],
                                     hist if any(h is not None for h in hist) else None)
        tokens, now = sample.tokens.tolist(), time.perf_counter()
        failed = dict(sample.failed)
        for i, r in enumerate(reqs):
            if r.matcher is not None and i not in failed:
                try:
                    r.matcher.consume([tokens[i]])
                except Exception as e:  # noqa: BLE001 - that request alone fails
                    failed[i] = f"grammar: {type(e).__name__}: {e}"
        lps: list = [None] * len(reqs)
        want = [i for i, p in enumerate(params) if p.logprobs is not None and i not in failed]
        if want:
            rows = logits if len(want) == len(reqs) else logits[torch.tensor(want, device=logits.device)]
            for i, lp in zip(want, token_logprobs(rows, [tokens[i] for i in want], [params[i].logprobs for i in want])):
                lps[i] = [lp]
        return [self._fail(r, failed[i]) if i in failed else self._append_tokens(r, [tok], now, lps[i])
                for i, (r, tok) in enumerate(zip(reqs, tokens))]

    def _append_tokens(self, req: Request, toks: list[int], now: float,
                       logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        """Append tokens through the stop checks; tokens after a stop are dropped. A failure in the
        stop checks or detokenizer fails this request alone. `logprobs`: one per token (or None)."""
        try:
            return self._append_checked(req, toks, now, logprobs)
        except AssertionError:  # a violated invariant or debug check: never a request's own fault
            raise
        except Exception as e:  # noqa: BLE001
            return self._fail(req, f"stop check failed: {type(e).__name__}: {e}")

    def _append_checked(self, req: Request, toks: list[int], now: float,
                        logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        new, delta = [], ""
        if req.first_token_at is None:
            req.first_token_at = now
        for tok in toks:
            req.output_ids.append(tok)
            new.append(tok)
            self._generated += 1
            upd = req.stop.update(tok)
            delta += upd.text_delta
            if upd.finished:
                self._finish(req, upd.reason)
                break
        pieces = req.stop.pieces
        return RequestOutput(req.request_id, new, delta, req.status is Status.FINISHED, req.finish_reason,
                             req.metrics(), req.output_ids, len(req.output_ids), pieces, len(pieces),
                             logprobs=None if logprobs is None else logprobs[: len(new)],
                             prompt_logprobs=req.prompt_logprobs)

    def _export(self, req: Request) -> None:
        """Keep req's prompt KV as a prefix: the store's own item (`export_prefix`, DeepSeek-V4's
        streaming state), else its rows by position (`read_rows`) as a `StoredPrefix`."""
        feats = (self.spec.take_features(req.request_id) if self.spec is not None else None) or {}
        own = self.store.export_prefix(req.request_id, req.prompt_ids, feats, self.prefixes.pin)
        if own is not None:
            self.prefixes.put(own)
        else:
            latent, index = self.store.read_rows(req.request_id, len(req.prompt_ids))
            item = self.prefixes.add(req.prompt_ids, latent, index, feats)
            layout = self.store.prefix_layout()
            if layout is not None:  # its page layout now, not on the first import
                item.paged(*layout)
        self._finish(req, "prefix")

    def _prompt_rows(self, req: Request) -> StoredPrefix | V4Prefix:
        """A keep_prompt request's whole prompt as host rows (`whole_prompt`), with the drafter's features;
        a DeepSeek-V4 store's own export instead (its whole streaming state, engine/disagg_v4.py)."""
        feats = (self.spec.take_features(req.request_id) if self.spec is not None else None) or {}
        own = self.store.export_prefix(req.request_id, req.prompt_ids, feats, self.prefixes.pin)
        if own is not None:
            return whole_state(own)
        latent, index = self.store.read_rows(req.request_id, len(req.prompt_ids))
        return whole_prompt(req.prompt_ids, latent, index, feats, self.prefixes.pin)

    def _keep_prompts(self, reqs: list[Request]) -> None:
        """keep_prompt requests whose first token was just sampled -> `kept_prompts` (one that failed
        is reported as failed and keeps nothing)."""
        now = time.time()
        for req in reqs:
            item = self._keeping.pop(req.request_id, None)
            if item is None or req.error is not None or not req.output_ids:
                continue
            queue = (req.admitted_at or req.arrival) - req.arrival
            self.kept_prompts[req.request_id] = PromptKV(item, req.output_ids[0], req.generator.get_state(),
                                                         None, req.prompt_logprobs, req.imported_len, queue, now)

    def prepare_prefix(self, prompt: str | list[int]) -> int:
        """Prefill `prompt` once and keep its KV for later requests to import; returns its length.
        A prefix already stored is kept as it is (no second prefill), unless it lacks hidden
        features this engine's drafter reads (`SpecRuntime.serves`): then it is prefilled again,
        in full, and replaced."""
        if not self.store.supports_prefix:
            raise ValueError(f"prefix KV export (prepare_prefix) is not available for {type(self.store).__name__}")
        ids = self.encode_prompt(prompt)
        stored = self.prefixes.get(ids)
        if stored is not None and (self.spec is None or self.spec.serves(stored)):
            return len(ids)
        rid = self.add_request(ids, SamplingParams(max_tokens=1), export_prefix=True)
        while rid in self.requests:
            self._held_outputs.extend(self.step())  # other requests' outputs wait for the next step()
        return len(ids)

    @property
    def _fixed_pages(self) -> int:
        """Pool pages the engine itself holds for its whole life (the step graphs' scratch page):
        left out of the reported pool, so an idle engine reports 0 pages used."""
        return StepGraphs.SCRATCH_PAGES if self.step_graphs is not None else 0

    def close(self) -> None:
        """Release the engine (the Engine surface's end; a data-parallel `Coordinator` stops its
        ranks). One process holds nothing that garbage collection does not free."""

    def stats(self) -> EngineStats:
        u, fixed = self.store.usage(), self._fixed_pages
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), u.total - fixed, u.used - fixed,
                           self._peak, self.page_bytes, self._steps, self._generated, self._prefilled,
                           self._decoding, self._admitted, self._alloc_wait,
                           store_counters(self.store, self.spec.stats() if self.spec else {})
                           | (self.spec_memory.counters() if self.spec_memory is not None else {})
                           | pool_counters(self.store, len(self.scheduler.running), self.config.max_running_requests)
                           | graph_counters(self.model.graphs)
                           | (self.step_graphs.counters() if self.step_graphs is not None else {}))

class _Detok:
    """Adapts the tokenizer's incremental detokenizer to the StopChecker's `add` protocol."""

    def __init__(self, inner) -> None:
        self.add = inner.feed
