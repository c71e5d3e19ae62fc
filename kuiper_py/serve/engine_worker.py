"""The one thread that owns the model: it loads it, then takes jobs from a bounded queue one at a time and hands
each one's records back through the job's emit callback (the HTTP layer turns that into an asyncio queue).

A job is one sequence. With max_seqs > 1 on a backend that runs several sequences a step (max_batch > 1), the
thread takes up to max_seqs jobs from the queue and steps them together through a batch.BatchEngine (continuous
batching, paged KV cache, prefix caching); otherwise it runs one job at a time on a PrefixCache. The HTTP side is
the same for both."""
from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from .. import speculative
from ..errors import KuiperError
from ..generate import Engine, PrefixCache, ops_class
from ..sampling import SamplingParams
from .metrics import Metrics


class QueueFull(Exception):
    """The bounded request queue has no room (the server answers 503 with Retry-After)."""


class ShuttingDown(Exception):
    """The server stopped accepting requests."""


@dataclass
class Job:
    ids: list[int]
    max_tokens: int
    params: SamplingParams
    emit: Callable[[object], None]  # called on the engine thread: a Record, an Exception, then None (the end)
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    eos_ids: list[int] | None = None  # None: the model's; [] never stops at an end-of-sequence token
    queue: object = None  # where the HTTP side reads emit's items (an asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    spec_stats: speculative.Stats | None = None  # (set when the job is drawn speculatively) its guesses counted


class EngineWorker:
    def __init__(self, model: str, device: str, max_context: int | None, max_queue: int, metrics: Metrics,
                 tokenizer_dir: str | None = None, warm: bool = True, tp: int = 1, max_seqs: int = 1,
                 draft: str | None = None, lookup: int | None = None, draft_tokens: int | None = None,
                 batching: dict | None = None):
        self.model_path, self.device, self.want_context, self.tp = model, device, max_context, tp
        self.max_seqs = max_seqs
        self.batching = dict(batching or {})  # (max_seqs > 1) BatchConfig settings: utilization, step_tokens, ...
        self._pool_seen = (0, 0)  # (batching) the pool's prefix-cache block counts already added to the metrics
        self.batch = None  # the BatchEngine, where batching is on (max_seqs > 1 and the backend runs several)
        self.active: list[_Live] = []  # (batching) the jobs being stepped
        self.draft, self.lookup, self.draft_tokens = draft, lookup, draft_tokens or speculative.DEFAULT_K
        self.proposer = None  # (--draft or --lookup) what guesses each request's tokens
        self.tokenizer_dir, self.warm, self.metrics = tokenizer_dir, warm, metrics
        self.jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self.engine: Engine | None = None
        self.cache: PrefixCache | None = None
        self.max_context = 0
        self.current: Job | None = None
        self.ready = threading.Event()
        self.load_error: Exception | None = None  # why loading failed (a KuiperError keeps its exit code)
        self.accepting = True
        self.on_failure: Callable[[], None] = lambda: None  # (the server stops when the model cannot load)
        self._thread = threading.Thread(target=self._main, name="kuiper-engine", daemon=True)

    @property
    def error(self) -> str | None:
        """Why loading failed, as one line (None: it has not)."""
        e = self.load_error
        if e is None:
            return None
        return str(e) if isinstance(e, KuiperError) else f"{type(e).__name__}: {e}"

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        if not self.accepting:
            raise ShuttingDown()
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull() from None
        self.metrics.waiting.set(self.jobs.qsize())

    def drain(self) -> None:
        """Stop accepting and cancel what waits (signal-safe: only flags); the running job finishes."""
        self.accepting = False
        for job in list(self.jobs.queue):
            job.cancelled.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel everything and end the thread."""
        self.drain()
        for job in [self.current, *(live.job for live in list(self.active))]:
            if job is not None:
                job.cancelled.set()
        try:
            self.jobs.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def _load(self) -> None:
        """The engine, its context (the model's maximum or --max-context) and the warmed cache."""
        eng = Engine.load(self.model_path, self.device, self.tokenizer_dir, tp=self.tp)
        ctx = self.want_context or eng.file.args.max_position_embeddings
        if not 0 < ctx <= eng.file.args.max_position_embeddings:
            raise KuiperError(f"--max-context {ctx} must be in 1..{eng.file.args.max_position_embeddings}")
        if self.max_seqs > 1 and ops_class(eng.device).max_batch > 1:
            self.batch = self._batch_engine(eng, ctx)
        else:
            self.cache = PrefixCache(eng, ctx, warm=self.warm)
        self.engine, self.max_context = eng, ctx
        self.proposer = self._load_proposer(eng, ctx)

    def _batch_engine(self, eng: Engine, ctx: int):
        """The BatchEngine of the server's settings; a pool too small for one sequence names the option to raise."""
        from ..batch import BatchConfig, BatchEngine, PoolTooSmall
        try:
            return BatchEngine(eng, BatchConfig(max_context=ctx, max_seqs=self.max_seqs, **self.batching))
        except PoolTooSmall as e:
            share = self.batching.get("utilization", BatchConfig.utilization)
            raise PoolTooSmall(f"{e}: raise --gpu-memory-utilization (now {share}) or lower --max-context") from None

    def _load_proposer(self, eng: Engine, ctx: int):
        """--draft or --lookup's proposer (None: plain decoding); a draft is loaded on the model's device, its
        vocabulary checked, its cache sized to the context and (CUDA) its graphs captured."""
        p = speculative.proposer(eng, self.draft, self.lookup, self.tokenizer_dir)
        if isinstance(p, speculative.Draft):
            p.start(ctx)
            if self.warm:
                p.model.warm_prefill_graphs()
                p.model.warm_decode_graphs(eng.n_valid_tokens)
        return p

    def _records(self, job: Job):
        """The job's records: drawn speculatively when the server proposes and the request needs nothing that
        speculative decoding lacks (logprobs: those requests are decoded plainly)."""
        if self.proposer is None or job.logprobs is not None:
            if self.proposer is not None:
                self.metrics.spec_fallbacks.inc()
            return self.cache.run(job.ids, job.max_tokens, job.params, job.stop, job.eos_ids, job.logprobs)
        job.spec_stats = speculative.Stats()
        return speculative.run_cached(self.cache, self.proposer, job.ids, job.max_tokens, job.params,
                                      self.draft_tokens, job.stop, job.eos_ids, job.spec_stats)

    def _main(self) -> None:
        try:
            self._load()
        except Exception as e:  # noqa: BLE001 - reported as one line by the command, which then exits
            self.load_error = e
            self.on_failure()
            return
        self.ready.set()
        if self.batch is not None:
            return self._batch_loop()
        while True:
            job = self.jobs.get()
            self.metrics.waiting.set(self.jobs.qsize())
            if job is None:
                return
            self.current = job
            try:
                self._run(job)
            finally:
                self.current = None

    def _run(self, job: Job) -> None:
        """One job's records to its emit callback, stopping at the next token once it is cancelled."""
        if job.cancelled.is_set():
            if not self.accepting:
                _safe(job.emit, ShuttingDown())
            _safe(job.emit, None)
            return
        m = self.metrics
        m.running.inc()
        last_t, last = None, None
        it = self._records(job)
        try:
            for r in it:
                now = time.perf_counter()
                if r.token is not None or r.finish_reason:
                    if last_t is None:
                        m.ttft.observe(now - job.arrived)
                    elif r.token is not None:
                        m.tpot.observe(now - last_t)
                    last_t = now
                last = r
                if job.cancelled.is_set():
                    m.cancelled.inc()
                    break
                if not _safe(job.emit, r):
                    break
        except Exception as e:  # noqa: BLE001 - the request fails, the server stays up
            if not isinstance(e, KuiperError):
                print(f"kuiper serve: request failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                traceback.print_exc(file=sys.stderr)
            _safe(job.emit, e)
        finally:
            it.close()
            m.running.dec()
            if last is not None:
                m.prompt_tokens.inc(len(job.ids))
                m.cached_tokens.inc(last.cached_tokens)
                m.prefix_cache_queries.inc(len(job.ids) - 1)  # (the last prompt token is always computed)
                m.prefix_cache_hits.inc(last.cached_tokens)
                m.generation_tokens.inc(last.gen_tokens)
                m.e2e.observe(time.perf_counter() - job.arrived)
            if job.spec_stats is not None:
                m.count_speculative(job.spec_stats)
            _safe(job.emit, None)

    def _batch_loop(self) -> None:
        """Continuous batching: jobs join between steps (up to max_seqs at once), each step's records go to their
        jobs, and a cancelled job leaves at the next step."""
        while True:
            if not self._take_jobs():
                return
            for live in self.active:
                if live.job.cancelled.is_set() and not live.handle.cancelled:
                    self.metrics.cancelled.inc()
                    live.handle.cancel()
            try:
                self.batch.step()
            except Exception as e:  # noqa: BLE001 - the step's requests fail, the server stays up
                print(f"kuiper serve: step failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                traceback.print_exc(file=sys.stderr)
                for live in self.active:
                    live.handle.cancel()
                    live.handle.take()  # (records drawn before the failure are not sent after the error)
                    _safe(live.job.emit, e)
                self.batch.step()  # (the cancelled requests leave, their blocks back in the pool)
            self._count_prefix_cache()
            for live in list(self.active):
                self._deliver(live)

    def _count_prefix_cache(self) -> None:
        """The step's prefix-cache lookups into the metrics, in tokens: the pool counts whole blocks queried and
        found as it admits requests (a preempted request's return counts again)."""
        st, bs = self.batch.pool.stats, self.batch.pool.block_size
        seen_q, seen_h = self._pool_seen
        self.metrics.prefix_cache_queries.inc((st.queried_blocks - seen_q) * bs)
        self.metrics.prefix_cache_hits.inc((st.hit_blocks - seen_h) * bs)
        self._pool_seen = (st.queried_blocks, st.hit_blocks)

    def _take_jobs(self) -> bool:
        """Move queued jobs into the batch (waiting for one when none runs); False once the queue says stop."""
        while len(self.active) < self.max_seqs:
            try:
                job = self.jobs.get(block=not self.active)
            except queue.Empty:
                return True
            self.metrics.waiting.set(self.jobs.qsize())
            if job is None:
                for live in self.active:
                    live.job.cancelled.set()
                    _safe(live.job.emit, ShuttingDown())
                    _safe(live.job.emit, None)
                    self.metrics.running.dec()
                return False
            if job.cancelled.is_set():
                if not self.accepting:
                    _safe(job.emit, ShuttingDown())
                _safe(job.emit, None)
                continue
            try:
                h = self.batch.submit(job.ids, job.params, job.max_tokens, job.stop, job.eos_ids, job.logprobs)
            except KuiperError as e:
                _safe(job.emit, e)
                _safe(job.emit, None)
                continue
            self.metrics.running.inc()
            self.active.append(_Live(job, h))
        return True

    def _deliver(self, live: "_Live") -> None:
        """A job's new records to its emit callback (metrics as _run counts them), and its end once finished."""
        m, job = self.metrics, live.job
        for r in live.handle.take():
            now = time.perf_counter()
            if r.token is not None or r.finish_reason:
                if live.last_t is None:
                    m.ttft.observe(now - job.arrived)
                elif r.token is not None:
                    m.tpot.observe(now - live.last_t)
                live.last_t = now
            live.last = r
            if not job.cancelled.is_set() and not _safe(job.emit, r):
                job.cancelled.set()
        if live.handle.done:
            self.active.remove(live)
            m.running.dec()
            if live.last is not None:
                m.prompt_tokens.inc(len(job.ids))
                m.cached_tokens.inc(live.last.cached_tokens)
                m.generation_tokens.inc(live.last.gen_tokens)
                m.e2e.observe(time.perf_counter() - job.arrived)
            _safe(job.emit, None)


@dataclass
class _Live:
    """A job in the batch: its BatchEngine handle, and when its last record came (for the token latencies)."""
    job: Job
    handle: object
    last_t: float | None = None
    last: object = None


def _safe(emit: Callable[[object], None], item) -> bool:
    """emit(item), False when the receiving event loop is gone (the server is shutting down)."""
    try:
        emit(item)
        return True
    except RuntimeError:
        return False
