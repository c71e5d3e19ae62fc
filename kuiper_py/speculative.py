"""Speculative decoding at batch 1: a proposer guesses K tokens, one verify step (a prefill of the pending token and
the K guesses, all logits kept) checks them against the target, and the longest valid prefix is kept.

Exact: greedy keeps a guess only where it is the target's argmax; with temperature > 0 a guess d with proposal
probability q(d) is kept with probability min(1, p(d)/q(d)) and a rejection draws from max(0, p - q) normalized
(Leviathan et al. 2023), so every token is distributed as plain sampling's. A deterministic proposal (prompt
lookup) is the case q = one-hot. p and q are the distributions sampling.sample() draws from (penalties,
temperature, top-k/top-p/min-p applied to each).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Protocol

import numpy as np

from .errors import KuiperError
from .generate import Chat, Engine, Record, _check_request, _covering, common_prefix, held_back
from .model import Qwen3
from .sampling import SamplingParams, apply_openai_penalties, apply_repetition_penalty, filter_logits
from .tokenizer import StreamDecoder

DEFAULT_K = 4  # guesses per verify step (--draft-tokens), until the GPU measurement says otherwise


def penalized(logits, p: SamplingParams, history: list[int], generated: list[int], n_valid: int) -> np.ndarray:
    """The logits after the penalties, as sampling.sample() computes them before its argmax or draw."""
    x = np.asarray(logits, dtype=np.float32)[:n_valid]
    x = apply_repetition_penalty(x, history[-p.repeat_last_n:] if p.repeat_last_n else [], p.repeat_penalty)
    return apply_openai_penalties(x, generated, p.presence_penalty, p.frequency_penalty)


def distribution(logits, p: SamplingParams, history: list[int], generated: list[int], n_valid: int) -> np.ndarray:
    """The float64 probability vector [n_valid] that sampling.sample() draws from at temperature > 0 (greedy: the
    one-hot of its argmax)."""
    x = penalized(logits, p, history, generated, n_valid)
    if p.temperature == 0.0:
        out = np.zeros(x.size)
        out[int(np.argmax(x))] = 1.0
        return out
    x = filter_logits(x.astype(np.float64), p)
    probs = np.exp(x - x.max())
    return probs / probs.sum()


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One id from a probability vector (inverse CDF; never an id of zero mass)."""
    c = np.cumsum(probs)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), np.flatnonzero(probs)[-1]))


class Proposer(Protocol):
    """What speculative decoding asks of a source of guesses (Lookup, Draft, Replay)."""

    def start(self, max_context: int) -> None:
        """Called before each generation or chat reply: a proposer with a cache of its own sizes it to the
        target's context."""

    def propose(self, seq: list[int], k: int, params, n_valid: int, rng,
                n_prompt: int = 0) -> tuple[list[int], list[np.ndarray] | None]:
        """Up to k guesses to follow seq, and the distributions they were drawn from (None: drawn from none, each
        guess proposed with certainty)."""


class Lookup:
    """Prompt lookup (--lookup N): the continuation of the latest earlier occurrence of the last N tokens of the
    prompt and output so far; no guess where there is none."""

    def __init__(self, n: int):
        if n < 1:
            raise KuiperError(f"--lookup {n} must be >= 1")
        self.n = n

    def start(self, max_context: int) -> None:
        """Nothing to size: the guesses come from the sequence itself."""

    def propose(self, seq: list[int], k: int, params, n_valid: int, rng, n_prompt: int = 0) -> tuple[list[int], None]:
        n = self.n
        if k < 1 or len(seq) <= n:
            return [], None
        a = np.asarray(seq, dtype=np.int64)
        starts = np.flatnonzero(a[:len(a) - n] == a[-n])  # (occurrences that end before the last token)
        for j in starts[::-1]:
            if np.array_equal(a[j:j + n], a[-n:]):
                return a[j + n:j + n + k].tolist(), None
        return [], None


class Draft:
    """A smaller model of the same vocabulary (--draft): it samples K guesses with the same sampling parameters;
    its cache holds exactly a prefix of the accepted tokens before it proposes again."""

    def __init__(self, engine: Engine, target: Engine):
        if engine is target:
            raise KuiperError("a draft needs its own engine (its own KV cache), not the target's")
        self.engine = engine
        check_vocabulary(engine, target)
        self.model: Qwen3 | None = None
        self.cached: list[int] = []  # the ids the draft's cache holds at positions 0 .. model.pos - 1

    def start(self, max_context: int) -> None:
        """A cache of the target's size; one already that size keeps what it holds (a chat's earlier turns)."""
        if self.model is None or self.model.max_context != max_context:
            self.model, self.cached = self.engine.session(max_context), []

    def propose(self, seq: list[int], k: int, params, n_valid: int, rng,
                n_prompt: int = 0) -> tuple[list[int], list[np.ndarray]]:
        m = self.model
        k = min(k, m.max_context - len(seq) + 1)
        if k < 1:
            return [], []
        keep = min(common_prefix(self.cached, seq), len(seq) - 1)  # (at least one token fed gives the logits)
        m.rewind(keep)
        feed = seq[keep:]
        # (one token, as after most verify steps: a decode step, which a GPU replays as its graph; a one-token
        # prefill runs eagerly, launch by launch)
        logits = m.decode(feed[0]) if len(feed) == 1 else m.prefill(feed)
        self.cached = list(seq)
        guesses, qs = [], []
        for i in range(k):
            hist = seq + guesses
            q = distribution(m.ops.to_host(logits), params, hist, hist[n_prompt:], n_valid)
            d = int(np.argmax(q)) if params.temperature == 0.0 else draw(q, rng)
            guesses.append(d)
            qs.append(q)
            if i + 1 < k:
                logits = m.decode(d)
                self.cached.append(d)
        return guesses, qs


class Replay:
    """Guesses replayed from a known continuation of the prompt (the target's own output), each replaced by another
    id with probability 1 - rate: forced acceptance rates for benchmarks and tests."""

    def __init__(self, n_prompt: int, continuation: list[int], rate: float = 1.0, seed: int = 0):
        self.n_prompt, self.cont, self.rate = n_prompt, list(continuation), rate
        self.rng = np.random.default_rng(seed)

    def start(self, max_context: int) -> None:
        """Nothing to size: the guesses come from the continuation given."""

    def propose(self, seq: list[int], k: int, params, n_valid: int, rng, n_prompt: int = 0) -> tuple[list[int], None]:
        i = len(seq) - self.n_prompt
        out = self.cont[i:i + k]
        return [t if self.rng.random() < self.rate else (t + 1) % n_valid for t in out], None


def check_vocabulary(draft: Engine, target: Engine) -> None:
    """A draft's ids must mean the target's: the same embedding rows and the same tokenizer."""
    a, b = draft.file.args, target.file.args
    ta, tb = (draft.file.trailer or {}).get("tokenizer"), (target.file.trailer or {}).get("tokenizer")
    if a.vocab_size != b.vocab_size or (ta and tb and ta != tb):
        raise KuiperError(f"--draft {draft.file.path}: its vocabulary ({a.vocab_size} ids) or tokenizer differs "
                          f"from the model's ({b.vocab_size} ids); a draft must share the model's tokenizer")


def check_flags(draft: str | None, lookup: int | None, k: int | None) -> None:
    """--draft, --lookup and --draft-tokens as the command line gives them, checked before any loading."""
    if draft is not None and lookup is not None:
        raise KuiperError("give one of --draft and --lookup")
    if lookup is not None and lookup < 1:
        raise KuiperError(f"--lookup {lookup} must be >= 1 (tokens matched)")
    if k is not None and k < 1:
        raise KuiperError(f"--draft-tokens {k} must be >= 1")
    if k is not None and draft is None and lookup is None:
        raise KuiperError("--draft-tokens needs --draft or --lookup")


def proposer(engine: Engine, draft: str | None, lookup: int | None, tokenizer_dir=None):
    """The proposer those flags ask for (None: plain decoding); a draft loads on the target's device."""
    if lookup is not None:
        return Lookup(lookup)
    if draft is None:
        return None
    return Draft(Engine.load(draft, engine.device, tokenizer_dir, need_tokenizer=False), engine)


def summary(s: dict) -> str:
    """Stats.as_dict() as the -v and statistics lines give it."""
    return (f"speculative: {s['verify_steps']} verify steps, {s['accepted']} of {s['proposed']} guesses accepted "
            f"({100 * s['acceptance_rate']:.0f}%), mean accepted length {s['mean_accepted_length']:.2f}")


@dataclass
class Stats:
    """What -v and --json report: guesses proposed and accepted, verify steps."""
    proposed: int = 0
    accepted: int = 0
    steps: int = 0

    @property
    def mean_accepted(self) -> float:
        """Tokens gained per verify step (the accepted guesses plus the target's own token)."""
        return (self.accepted + self.steps) / max(self.steps, 1)

    def as_dict(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted, "verify_steps": self.steps,
                "acceptance_rate": round(self.accepted / max(self.proposed, 1), 4),
                "mean_accepted_length": round(self.mean_accepted, 3)}


def plain_greedy(p: SamplingParams) -> bool:
    """Greedy with no penalty: a row's draw is its argmax, which the backend finds without copying the row out."""
    return p.temperature == 0.0 and p.repeat_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty


def verify(rows, guesses: list[int], qs, params: SamplingParams, history: list[int],
           generated: list[int], n_valid: int, rng) -> list[int]:
    """The tokens a verify step yields: the accepted guesses, then the target's own token (a rejection's
    resample, or the bonus token after K accepted). rows[i]: the target's logits after guesses[:i] (for
    plain_greedy params, the ids of their argmaxes)."""
    out: list[int] = []
    for i, d in enumerate(guesses + [None]):
        h, g = history + out, generated + out
        if plain_greedy(params):
            best = int(rows[i])
            out.append(best)
            if best != d:
                return out
            continue
        if params.temperature == 0.0:
            best = int(np.argmax(penalized(rows[i], params, h, g, n_valid)))
            out.append(best)
            if best != d:
                return out
            continue
        p = distribution(rows[i], params, h, g, n_valid)
        if d is None:
            return out + [draw(p, rng)]
        q_d = 1.0 if qs is None else qs[i][d]
        if q_d > 0 and rng.random() < min(1.0, p[d] / q_d):
            out.append(d)
            continue
        resid = np.maximum(p - (qs[i] if qs is not None else np.eye(1, p.size, d)[0]), 0.0)
        return out + [draw(resid if resid.sum() > 0 else p, rng)]
    return out


def generate(engine: Engine, proposer: Proposer, prompt_ids: list[int], max_tokens: int, params: SamplingParams,
             k: int = DEFAULT_K, stop: list[str] | None = None, max_context: int | None = None,
             eos_ids: list[int] | None = None, stats: Stats | None = None) -> Iterator[Record]:
    """generate.generate()'s records, drawn speculatively; `stats` (given) is filled as it goes."""
    args = engine.file.args
    _check_request(engine, prompt_ids, max_tokens)
    if k < 1:
        raise KuiperError(f"--draft-tokens {k} must be >= 1")
    ctx = max_context or min(len(prompt_ids) + max_tokens, args.max_position_embeddings)
    if len(prompt_ids) > ctx:
        raise KuiperError(f"prompt of {len(prompt_ids)} tokens does not fit a context of {ctx} "
                          f"(--max-context; the model's maximum is {args.max_position_embeddings})")
    model = engine.session(ctx)
    proposer.start(ctx)
    return stream(engine, model, proposer, prompt_ids, 0, max_tokens, params, k, stop, eos_ids, stats or Stats())


class _Emitter:
    """Turns drawn tokens into generate()'s records one by one, with its stop-string and EOS rules."""

    def __init__(self, engine, prompt_ids, max_tokens, stop, eos_ids):
        self.eos = set(engine.file.args.eos_token_ids if eos_ids is None else eos_ids)
        self.stops = [s for s in (stop or []) if s]
        self.dec = StreamDecoder(engine.tokenizer) if engine.tokenizer else None
        self.max_tokens, self.n_prompt = max_tokens, len(prompt_ids)
        self.out: list[int] = []
        self.decoded: list[int] = []
        self.emitted, self.pending = 0, ""

    def flush(self) -> str:
        return self.pending + (self.dec.flush() if self.dec else "")

    def push(self, tok: int, at_end: bool) -> tuple[int | None, str, str | None, list[int] | None]:
        """(token, text, finish reason or None, the record's tokens or None); at_end: the context is full."""
        if tok in self.eos:
            return None, self.flush(), "stop", None
        self.out.append(tok)
        self.pending += self.dec.push(tok) if self.dec else ""
        if self.stops:
            self.decoded.append(self.emitted + len(self.pending))
            hit = min((self.pending.find(s) for s in self.stops if s in self.pending), default=-1)
            if hit >= 0:
                return tok, self.pending[:hit], "stop", self.out[:_covering(self.decoded, self.emitted + hit)]
            keep = held_back(self.pending, self.stops)
            text, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
            self.emitted += len(text)
        else:
            text, self.pending = self.pending, ""
        if len(self.out) >= self.max_tokens:
            return tok, text + self.flush(), "length", None
        if at_end:
            return tok, text + self.flush(), "context", None
        return tok, text, None, None


def stream(engine, model: Qwen3, proposer: Proposer, prompt_ids, cached: int, max_tokens, params, k, stop, eos_ids,
           stats: Stats) -> Iterator[Record]:
    """The loop over a model whose cache holds prompt_ids[:cached]: the rest of the prompt is prefilled and the first
    token drawn from its logits; then each verify step runs the pending token (drawn, not yet in the cache) and the
    guesses, keeps what verify() yields and rewinds the cache to the pending token and the accepted guesses."""
    assert model.pos == cached < len(prompt_ids)
    rng = np.random.default_rng(params.seed)
    n_valid = engine.n_valid_tokens
    em = _Emitter(engine, prompt_ids, max_tokens, stop, eos_ids)
    seq = list(prompt_ids)
    t0 = time.perf_counter()
    logits = model.prefill(prompt_ids[cached:])
    model.ops.synchronize()
    t_prompt = time.perf_counter() - t0
    t1 = time.perf_counter()

    def rec(tok, text, reason=None, tokens=None):
        n = len(em.out)
        return Record(tok, text, reason, len(prompt_ids) - cached, t_prompt, n, time.perf_counter() - t1,
                      max(n - 1, 0), list(em.out) if tokens is None else tokens, cached)

    if max_tokens == 0:
        yield rec(None, "", "length")
        return
    first = model.ops.argmax_rows(logits[None], n_valid) if plain_greedy(params) else model.ops.to_host(logits)[None]
    drawn = verify(first, [], None, params, seq, [], n_valid, rng)
    try:
        while True:
            for j, tok in enumerate(drawn):
                # a token's feed position is len(seq): at the cache's end it is the last one (as plain decoding)
                t, text, reason, tokens = em.push(tok, len(seq) >= model.max_context)
                if reason is not None:
                    yield rec(t, text, reason, tokens)
                    return
                seq.append(tok)
                yield rec(t, text)
            pos0 = len(seq) - 1  # the pending token's position; the cache holds seq[:pos0]
            model.rewind(pos0)
            room = min(k, model.max_context - pos0 - 1, max_tokens - len(em.out) - 1)
            guesses, qs = proposer.propose(seq, room, params, n_valid, rng, len(prompt_ids)) if room > 0 else ([], None)
            guesses = guesses[:max(room, 0)]
            logits = model.prefill([seq[-1]] + guesses, all_logits=True)
            rows = model.ops.argmax_rows(logits, n_valid) if plain_greedy(params) else model.ops.to_host(logits)
            drawn = verify(rows, guesses, qs or None, params, seq, em.out, n_valid, rng)
            stats.steps += 1
            stats.proposed += len(guesses)
            stats.accepted += len(drawn) - 1
    finally:
        model.rewind(min(model.pos, len(seq) - 1))  # (the cache keeps a prefix of prompt + reply, no rejected guess)


class SpeculativeChat(Chat):
    """generate.Chat whose replies are drawn speculatively; `stats` counts the last reply's guesses, `total` the
    conversation's."""

    def __init__(self, engine: Engine, max_context: int, proposer: Proposer, k: int = DEFAULT_K, **kw):
        super().__init__(engine, max_context, **kw)
        self.proposer, self.k = proposer, k
        self.stats, self.total = Stats(), Stats()

    def _reply(self, ids: list[int], keep: int, max_tokens: int, params: SamplingParams, stop, eos_ids):
        """Chat.turn's reply drawn by stream(); the reply's guesses are counted in `stats` and added to `total`."""
        self.proposer.start(self.max_context)
        self.stats = Stats()
        try:
            yield from stream(self.engine, self.model, self.proposer, ids, keep, max_tokens, params, self.k, stop,
                              eos_ids, self.stats)
        finally:
            for f in ("proposed", "accepted", "steps"):
                setattr(self.total, f, getattr(self.total, f) + getattr(self.stats, f))


def run_cached(cache, proposer: Proposer, ids: list[int], max_tokens: int, params: SamplingParams, k: int = DEFAULT_K,
               stop: list[str] | None = None, eos_ids: list[int] | None = None,
               stats: Stats | None = None) -> Iterator[Record]:
    """generate.PrefixCache.run()'s records drawn speculatively (`kuiper serve --draft/--lookup`): the prompt's
    prefix the shared cache holds is reused, and the cache is left holding a prefix of prompt + reply, also when the
    iterator is closed early (PrefixCache.serve)."""
    stats = stats if stats is not None else Stats()
    return cache.serve(ids, max_tokens, lambda keep: stream(cache.engine, cache.model, proposer, ids, keep, max_tokens,
                                                            params, k, stop, eos_ids, stats))
