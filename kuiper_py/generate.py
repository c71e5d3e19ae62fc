"""The one generation core that `kuiper generate` and `kuiper bench` both consume."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from . import loader
from .errors import KuiperError
from .model import Qwen3
from .sampling import SamplingParams
from .tokenizer import ChatTokenizer, StreamDecoder


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pick_device(device: str | None) -> str:
    if device in ("cpu", "cuda"):
        return device
    if device not in (None, "auto"):
        raise KuiperError(f"--device {device!r}: choose cuda or cpu")
    try:
        from .ops_cupy import cuda_available
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
        from .ops_cupy import CupyOps, check_device
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

    @classmethod
    def load(cls, path: str | Path, device: str | None = "auto", tokenizer_dir=None,
             need_tokenizer: bool = True) -> "Engine":
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
        eng = cls(mf, pick_device(device), tok)
        eng.load_seconds = time.perf_counter() - t0
        return eng

    def session(self, max_context: int) -> Qwen3:
        """A model with a KV cache of max_context positions (reused when big enough)."""
        if self.model is None:
            t0 = time.perf_counter()
            self.model = Qwen3(self.file, ops_class(self.device), max_context)
            self.load_seconds += time.perf_counter() - t0
        self.model.set_context(max_context)
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


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that could still grow into a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if s.startswith(text[-n:]):
                best = n
                break
    return best


def generate(engine: Engine, prompt_ids: list[int], max_tokens: int, params: SamplingParams,
             stop: list[str] | None = None, max_context: int | None = None,
             eos_ids: list[int] | None = None) -> Iterator[Record]:
    args = engine.file.args
    if max_tokens < 0:
        raise KuiperError(f"--max-tokens {max_tokens} must be >= 0")
    if not prompt_ids:
        raise KuiperError("the prompt is empty")
    if not all(0 <= t < args.vocab_size for t in prompt_ids):
        raise KuiperError(f"prompt token ids must be in 0..{args.vocab_size - 1}")
    ctx = max_context or min(len(prompt_ids) + max_tokens, args.max_position_embeddings)
    if len(prompt_ids) > ctx:
        raise KuiperError(f"prompt of {len(prompt_ids)} tokens does not fit a context of {ctx} "
                          f"(--max-context; the model's maximum is {args.max_position_embeddings})")
    model = engine.session(ctx)
    eos = set(args.eos_token_ids if eos_ids is None else eos_ids)
    stops = [s for s in (stop or []) if s]
    rng = np.random.default_rng(params.seed)
    dec = StreamDecoder(engine.tokenizer) if engine.tokenizer else None
    history = list(prompt_ids)
    out_ids: list[int] = []
    pending = ""
    t0 = time.perf_counter()
    logits = model.prefill(prompt_ids)
    model.ops.synchronize()  # GPU work is asynchronous: the prompt's time ends when its kernels do
    t_prompt = time.perf_counter() - t0
    t1 = time.perf_counter()

    # With a GPU that replays graphs, each step is queued on the device's drawn token before the host
    # reads that token back (Qwen3.decode_sampled), so the GPU is not idle while the host copies the id,
    # decodes text and launches the next step. A step queued ahead of a token that ends the generation
    # is taken back (discard).
    ahead_ok = model.can_queue_ahead
    ahead = None  # logits of the step queued ahead of the host, not yet taken

    def rec(tok, text, reason=None):
        return Record(tok, text, reason, len(prompt_ids), t_prompt, len(out_ids), time.perf_counter() - t1,
                      model.pos - len(prompt_ids) - (ahead is not None), out_ids)

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
            else:
                tok = model.ops.sample(logits, params, rng, history, n_valid)
            if tok in eos:
                yield rec(None, pending + (dec.flush() if dec else ""), "stop")
                return
            out_ids.append(tok)
            history.append(tok)
            pending += dec.push(tok) if dec else ""
            if stops:
                hit = min((pending.find(s) for s in stops if s in pending), default=-1)
                if hit >= 0:
                    yield rec(tok, pending[:hit], "stop")
                    return
                keep = _held_back(pending, stops)
                text, pending = pending[:len(pending) - keep], pending[len(pending) - keep:]
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
