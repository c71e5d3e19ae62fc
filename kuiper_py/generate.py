"""The one generation core that `kuiper generate` and `kuiper bench` both consume."""
from __future__ import annotations

import bisect
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from . import loader
from .errors import KuiperError
from .model import Qwen3
from .sampling import SamplingParams, sample, token_logprobs
from .tokenizer import ChatTokenizer, StreamDecoder


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pick_device(device: str | None) -> str:
    if device in ("cpu", "cuda"):
        return device
    if device not in (None, "auto"):
        raise KuiperError(f"--device {device!r}: choose cuda or cpu")
    try:
        from .cuda.runtime.device import cuda_available
        if cuda_available():
            return "cuda"
    except ImportError:
        pass
    log("notice: no usable CUDA GPU found, running on the CPU (--device cpu)")
    return "cpu"


def ops_class(device: str):
    if device == "cpu":
        from .ops_numpy import NumpyOps
        return NumpyOps
    try:
        from .cuda.backend import CupyOps
        from .cuda.runtime.device import check_device
    except ImportError as e:
        raise KuiperError(f"--device cuda needs CuPy (pip install 'kuiper[cuda13]'): {e}") from None
    check_device()
    return CupyOps


@dataclass
class Engine:
    file: loader.ModelFile
    device: str
    tokenizer: ChatTokenizer | None
    model: Qwen3 | None = None
    load_seconds: float = 0.0
    sessions: int = 0  # session() calls: a Chat notices that its cache was reset under it
    tp: int = 1  # tensor-parallel ranks (parallel/): on the CPU, threads of this process

    @classmethod
    def load(cls, path: str | Path, device: str | None = "auto", tokenizer_dir=None,
             need_tokenizer: bool = True, tp: int = 1) -> "Engine":
        """The engine for an ak48 file; a hub id is exported once into the kuiper cache and that file loaded
        (hub.resolve_model), so every command's -m takes one. tp > 1 splits the model over tp ranks (parallel/)."""
        from . import hub
        if hub.is_hub_id(str(path)):
            path = hub.resolve_model(str(path))
        t0 = time.perf_counter()
        mf = loader.load(path, tokenizer_dir)
        tok = ChatTokenizer(mf.trailer) if need_tokenizer else None
        if tok is not None:
            V = mf.args.vocab_size
            if tok.vocab_size > V:
                raise KuiperError(f"tokenizer has {tok.vocab_size} tokens but the model only {V} embeddings")
            if tok.vocab_size < V - 1024:  # beyond the usual padding of the embedding to a round size
                raise KuiperError(f"tokenizer has only {tok.vocab_size} tokens for a model that emits {V} ids: "
                                  f"wrong tokenizer?")
            bad = [i for i in mf.args.eos_token_ids if not 0 <= i < tok.vocab_size]
            if bad:
                raise KuiperError(f"end-of-sequence ids {bad} are outside the tokenizer's {tok.vocab_size} tokens")
        eng = cls(mf, pick_device(device), tok, tp=tp)
        if tp != 1:
            from .parallel.group import check_request
            check_request(mf, tp, eng.device)
        eng.load_seconds = time.perf_counter() - t0
        return eng

    def session(self, max_context: int) -> Qwen3:
        """A model with a KV cache of max_context positions (reused when big enough)."""
        if self.model is None:
            t0 = time.perf_counter()
            if self.tp > 1:
                from .parallel.group import ParallelModel
                self.model = ParallelModel(self.file, ops_class(self.device), self.tp, max_context)
            else:
                self.model = Qwen3(self.file, ops_class(self.device), max_context)
            self.load_seconds += time.perf_counter() - t0
        self.model.set_context(max_context)
        self.sessions += 1
        return self.model

    @property
    def n_valid_tokens(self) -> int:
        """Ids the tokenizer knows; Qwen pads the embedding to 151936 rows and the rest are never sampled."""
        v = self.file.args.vocab_size
        return min(v, self.tokenizer.vocab_size) if self.tokenizer else v


@dataclass
class Record:
    token: int | None
    text: str
    finish_reason: str | None = None  # "stop", "length" or "context" on the last record
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    gen_tokens: int = 0
    gen_seconds: float = 0.0
    decode_steps: int = 0  # model evaluations after the prompt, the count tg speed is measured over
    tokens: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # the prompt's leading tokens the cache already held (a chat's earlier turns)
    warmup_seconds: float = 0.0  # before the prompt: the decode graphs captured (kernels built on a first run)
    # (asked for with logprobs=k) this record's token's log-probability under the model and the k likeliest ids'
    logprob: tuple[float, list[tuple[int, float]]] | None = None


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that could still grow into a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if s.startswith(text[-n:]):
                best = n
                break
    return best


def _covering(decoded: list[int], n_chars: int) -> int:
    """How many tokens it takes for the text to reach n_chars characters (decoded[i]: after token i)."""
    return 0 if n_chars <= 0 else bisect.bisect_left(decoded, n_chars) + 1


def _check_request(engine: Engine, prompt_ids: list[int], max_tokens: int) -> None:
    args = engine.file.args
    if max_tokens < 0:
        raise KuiperError(f"--max-tokens {max_tokens} must be >= 0")
    if not prompt_ids:
        raise KuiperError("the prompt is empty")
    if not all(0 <= t < args.vocab_size for t in prompt_ids):
        raise KuiperError(f"prompt token ids must be in 0..{args.vocab_size - 1}")


def generate(engine: Engine, prompt_ids: list[int], max_tokens: int, params: SamplingParams,
             stop: list[str] | None = None, max_context: int | None = None,
             eos_ids: list[int] | None = None, logprobs: int | None = None) -> Iterator[Record]:
    """Records of a generation on a fresh cache. With stop strings, the last record's text ends before the stop
    string and its `tokens` are the fewest drawn tokens whose text covers that text: a token that straddles the
    boundary (part of its text before the stop string) is kept, the tokens wholly inside or after the stop string
    are not. logprobs=k (0..20) gives each record the log-probabilities of its token and the k likeliest (host
    side: the logits are copied back for such a request)."""
    args = engine.file.args
    _check_request(engine, prompt_ids, max_tokens)
    ctx = max_context or min(len(prompt_ids) + max_tokens, args.max_position_embeddings)
    if len(prompt_ids) > ctx:
        raise KuiperError(f"prompt of {len(prompt_ids)} tokens does not fit a context of {ctx} "
                          f"(--max-context; the model's maximum is {args.max_position_embeddings})")
    model = engine.session(ctx)
    # the decode graphs this generation's steps replay are captured before the prompt, so their capture (and on a
    # machine's first run the compiles it causes) is not counted in the decode speed; a chat does the same at its start
    t0 = time.perf_counter()
    if max_tokens > 1:
        n = len(prompt_ids)
        model.warm_decode_graphs(engine.n_valid_tokens, keys=(n + 1, n + max_tokens - 1))
    return _stream(engine, model, prompt_ids, 0, max_tokens, params, stop, eos_ids, time.perf_counter() - t0,
                   logprobs)


def _stream(engine: Engine, model: Qwen3, prompt_ids: list[int], cached: int, max_tokens: int,
            params: SamplingParams, stop: list[str] | None, eos_ids: list[int] | None,
            warmup: float = 0.0, logprobs: int | None = None) -> Iterator[Record]:
    """The generation loop over a model whose cache holds prompt_ids[:cached] (model.pos == cached): the rest of
    the prompt is prefilled, then tokens are drawn until a stop, max_tokens or the cache's end. A request the
    device's draw does not serve (presence/frequency penalties, logprobs) draws on the host from copied logits."""
    args = engine.file.args
    assert model.pos == cached < len(prompt_ids)
    eos = set(args.eos_token_ids if eos_ids is None else eos_ids)
    stops = [s for s in (stop or []) if s]
    rng = np.random.default_rng(params.seed)
    dec = StreamDecoder(engine.tokenizer) if engine.tokenizer else None
    history = list(prompt_ids)
    out_ids: list[int] = []
    decoded: list[int] = []  # characters of text after each drawn token (held back or not): where stops cut
    emitted = 0  # characters yielded so far
    pending = ""
    t0 = time.perf_counter()
    logits = model.prefill(prompt_ids[cached:])
    model.ops.synchronize()  # GPU work is asynchronous: the prompt's time ends when its kernels do
    t_prompt = time.perf_counter() - t0
    t1 = time.perf_counter()

    # With a GPU that replays graphs, each step is queued on the device's drawn token before the host
    # reads that token back (Qwen3.decode_sampled), so the GPU is not idle while the host copies the id,
    # decodes text and launches the next step. A step queued ahead of a token that ends the generation
    # is taken back (discard).
    host = params.needs_host or logprobs is not None
    ahead_ok = model.can_queue_ahead and not host
    ahead = None  # logits of the step queued ahead of the host, not yet taken
    lp = None

    def rec(tok, text, reason=None, tokens=None):
        return Record(tok, text, reason, len(prompt_ids) - cached, t_prompt, len(out_ids), time.perf_counter() - t1,
                      model.pos - len(prompt_ids) - (ahead is not None), out_ids if tokens is None else tokens,
                      cached, warmup, lp)

    if max_tokens == 0:
        yield rec(None, "", "length")
        return
    n_valid = engine.n_valid_tokens
    try:
        if ahead_ok:
            model.ops.sample_launch(logits, params, rng, history, n_valid)
        while True:
            pos = model.pos  # the position the next step (this token's) takes
            if ahead_ok:
                if len(out_ids) + 1 < max_tokens and pos < model.max_context:
                    ahead = model.decode_sampled()
                tok = model.ops.sample_result()
            elif host:
                x = model.ops.to_host(logits)
                tok = sample(x, params, rng, history, n_valid, generated=out_ids)
                lp = None if logprobs is None else token_logprobs(x, tok, logprobs, n_valid)
            else:
                tok = model.ops.sample(logits, params, rng, history, n_valid)
            if tok in eos:
                yield rec(None, pending + (dec.flush() if dec else ""), "stop")
                return
            out_ids.append(tok)
            history.append(tok)
            pending += dec.push(tok) if dec else ""
            if stops:
                decoded.append(emitted + len(pending))
                hit = min((pending.find(s) for s in stops if s in pending), default=-1)
                if hit >= 0:
                    yield rec(tok, pending[:hit], "stop", out_ids[:_covering(decoded, emitted + hit)])
                    return
                keep = held_back(pending, stops)
                text, pending = pending[:len(pending) - keep], pending[len(pending) - keep:]
                emitted += len(text)
            else:
                text, pending = pending, ""
            if len(out_ids) >= max_tokens:
                yield rec(tok, text + pending + (dec.flush() if dec else ""), "length")
                return
            if pos >= model.max_context:
                yield rec(tok, text + pending + (dec.flush() if dec else ""), "context")
                return
            yield rec(tok, text)
            if ahead_ok:  # (a step was queued: every ending that does not queue one has returned above)
                logits, ahead = ahead, None
                model.ops.sample_launch(logits, params, rng, history, n_valid)
            else:
                logits = model.decode(tok)
    finally:
        if ahead_ok:
            model.ops.cancel_draw()  # a draw left queued by an interruption
        if ahead is not None:  # queued ahead of a token that ended the generation (or the consumer left)
            model.discard()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Chat:
    """A conversation on one KV cache (`kuiper chat`). Each turn renders the whole conversation through the chat
    template and prefills only the tokens after the longest prefix the cache already holds. Matching tokens, not
    assuming the rendering only grows, keeps the cache exact where a template renders earlier turns differently
    (Qwen3's drops the reasoning of answered turns) or a reply's text encodes to other ids than were drawn. When a
    turn and its reply would not fit, the oldest exchanges are dropped (the system message stays)."""

    stats = None  # a speculative chat's counts of its last reply's guesses (speculative.SpeculativeChat)

    def __init__(self, engine: Engine, max_context: int, system: str | None = None,
                 enable_thinking: bool | None = None, warm: bool = True):
        if engine.tokenizer is None:
            raise KuiperError("a chat needs the model's tokenizer")
        self.engine, self.system, self.enable_thinking, self.max_context = engine, system, enable_thinking, max_context
        self.model = engine.session(max_context)
        self._session = engine.sessions
        self.warmed: list[int] = []  # the prefill buckets and decode regimes _warm captured
        self.warmed_decode: list[int] = []
        if warm:
            self._warm()
        self.messages: list[dict] = []  # the user and assistant turns, oldest first
        self.cached: list[int] = []  # the ids the cache holds at positions 0 .. model.pos - 1
        self.dropped = 0  # exchanges dropped to fit the context by the last turn
        self._pieces: dict[str, list[int]] = {}  # render()'s pieces of the last conversation rendered, and their ids

    def _warm(self) -> None:
        """(CUDA) every prefill bucket's graph and every decode regime's captured now: no turn pays a capture."""
        self.warmed = self.model.warm_prefill_graphs()
        self.warmed_decode = self.model.warm_decode_graphs(self.engine.n_valid_tokens)

    def reset(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.messages, self.cached = [], []
        self.model.reset()

    def render(self, messages: list[dict]) -> list[int]:
        """The ids of the conversation through the chat template. The text is encoded piece by piece, cut before
        each "<|im_start|>" (a special token, which the tokenizer splits out before anything else, so the pieces'
        ids joined are the whole text's), and each piece's ids are kept for the next turn: a turn encodes only its
        new pieces, not the whole conversation again (~100 ms for 27k tokens on a slow host core)."""
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        tok = self.engine.tokenizer
        text = tok.apply_chat_template(head + messages, enable_thinking=self.enable_thinking)
        mark = "<|im_start|>"
        if tok.token_id(mark) is None:  # (another chat format: no safe place to cut)
            return tok.encode(text)
        pieces = [p for p in text.replace(mark, "\0" + mark).split("\0") if p] if "\0" not in text else [text]
        known, self._pieces = self._pieces, {}
        ids: list[int] = []
        for p in pieces:
            got = known.get(p)
            if got is None:
                got = tok.encode(p)
            self._pieces[p] = got
            ids += got
        return ids

    def turn(self, text: str, max_tokens: int, params: SamplingParams, stop: list[str] | None = None,
             eos_ids: list[int] | None = None) -> Iterator[Record]:
        """The reply to one user message, streamed as generate()'s records. The reply joins the conversation as
        it was streamed, also when the consumer stops early (an interrupted reply keeps its text so far)."""
        self.dropped = 0
        if self.engine.sessions != self._session:  # (the engine's model served something else meanwhile)
            self.model, self.cached = self.engine.session(self.max_context), []
            self._session = self.engine.sessions
            if self.warmed or self.warmed_decode:  # (a cache of another size dropped the graphs)
                self._warm()
        ctx = self.max_context
        msgs = self.messages + [{"role": "user", "content": text}]
        ids = self.render(msgs)
        # drop whole exchanges (user + assistant) from the front until the reply has room for max_tokens (at most
        # half the context: a longer reply stops at the context's end), or none are left
        dropped, room = 0, min(max_tokens, ctx // 2)
        while len(ids) + room > ctx and len(msgs) > 2:
            msgs, dropped = msgs[2:], dropped + 1
            ids = self.render(msgs)
        if len(ids) > ctx:
            raise KuiperError(f"this message makes a prompt of {len(ids)} tokens, more than the context of {ctx} "
                              f"(--max-context)")
        _check_request(self.engine, ids, max_tokens)
        keep = min(common_prefix(self.cached, ids), len(ids) - 1)  # (at least one token gives the logits)
        self.model.rewind(keep)
        self.cached = ids[:keep]
        pieces, out, finished = [], [], False
        try:
            for r in self._reply(ids, keep, max_tokens, params, stop, eos_ids):
                pieces.append(r.text)
                out = r.tokens
                yield r
            finished = True
        finally:
            # what the cache holds now: the prompt, then the reply's tokens that were fed back (not its last)
            self.cached = (ids + out)[:self.model.pos]
            reply = "".join(pieces)
            if finished or reply:  # (a turn stopped before any of its reply is forgotten)
                self.messages = msgs + [{"role": "assistant", "content": reply}]
                self.dropped = dropped


    def _reply(self, ids: list[int], keep: int, max_tokens: int, params: SamplingParams, stop, eos_ids):
        """The reply's records after `keep` cached tokens of the prompt ids (a subclass may draw them otherwise)."""
        return _stream(self.engine, self.model, ids, keep, max_tokens, params, stop, eos_ids)


class PrefixCache:
    """One KV cache serving a stream of unrelated requests (`kuiper serve`): each prefills only the tokens after
    the longest prefix it shares with what the cache holds (the last request's prompt and the reply tokens fed
    back), as a Chat does between its turns. A request is one sequence; a batching scheduler would keep one such
    record per sequence."""

    def __init__(self, engine: Engine, max_context: int, warm: bool = True):
        self.engine, self.max_context = engine, max_context
        self.model = engine.session(max_context)
        self.cached: list[int] = []  # the ids the cache holds at positions 0 .. model.pos - 1
        if warm:  # (CUDA) every prefill bucket's and decode regime's graph captured now: no request pays one
            self.model.warm_prefill_graphs()
            self.model.warm_decode_graphs(engine.n_valid_tokens)

    def run(self, ids: list[int], max_tokens: int, params: SamplingParams, stop: list[str] | None = None,
            eos_ids: list[int] | None = None, logprobs: int | None = None) -> Iterator[Record]:
        """generate()'s records for prompt ids on the shared cache; closing the iterator early (a cancelled
        request) leaves the cache consistent. Record.cached_tokens tells how much of the prompt was reused."""
        return self.serve(ids, max_tokens, lambda keep: _stream(self.engine, self.model, ids, keep, max_tokens, params,
                                                                stop, eos_ids, logprobs=logprobs))

    def serve(self, ids: list[int], max_tokens: int, records_from) -> Iterator[Record]:
        """The records records_from(keep) yields for prompt ids, keep being the prefix of ids the cache already holds
        (model.pos == keep when it is called): run()'s loop, and speculative.run_cached's. Closed early, the inner
        records are closed first (their cleanup may take back a step queued ahead, or a verify step's guesses), then
        the cache is recorded as holding what the model holds."""
        _check_request(self.engine, ids, max_tokens)
        if len(ids) > self.max_context:
            raise KuiperError(f"prompt of {len(ids)} tokens does not fit the context of {self.max_context}")
        keep = min(common_prefix(self.cached, ids), len(ids) - 1)  # (at least one token gives the logits)
        self.model.rewind(keep)
        self.cached = ids[:keep]
        drawn: list[int] = []
        records = records_from(keep)
        try:
            for r in records:
                if r.token is not None:
                    drawn.append(r.token)
                yield r
        finally:
            records.close()
            # the prompt, then the reply's tokens that were fed back (not its last)
            self.cached = (ids + drawn)[:self.model.pos]
