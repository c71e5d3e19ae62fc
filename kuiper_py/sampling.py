"""Token sampling as plain functions over float32 logits, shared by every backend.

Order as in Hugging Face generate: repetition penalty, then temperature, top-k, top-p, min-p.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import KuiperError


@dataclass
class SamplingParams:
    temperature: float = 0.6
    top_k: int = 20  # 0 = off
    top_p: float = 0.95  # 1 = off
    min_p: float = 0.0  # 0 = off
    repeat_penalty: float = 1.0  # 1 = off
    repeat_last_n: int = 64
    seed: int | None = None
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from each generated id's logit (0 = off)
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the generated ids (0 = off)

    @property
    def needs_host(self) -> bool:
        """Whether drawing needs what only the host sampler does (the device's draw has no OpenAI penalties)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> "SamplingParams":
        checks = [
            (self.temperature >= 0 and np.isfinite(self.temperature), f"--temp {self.temperature} must be >= 0"),
            (self.top_k >= 0, f"--top-k {self.top_k} must be >= 0 (0 disables it)"),
            (0 < self.top_p <= 1, f"--top-p {self.top_p} must be in (0, 1]"),
            (0 <= self.min_p < 1, f"--min-p {self.min_p} must be in [0, 1)"),
            (self.repeat_penalty > 0 and np.isfinite(self.repeat_penalty),
             f"--repeat-penalty {self.repeat_penalty} must be > 0"),
            (self.repeat_last_n >= 0, f"--repeat-last-n {self.repeat_last_n} must be >= 0"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty {self.presence_penalty} must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty {self.frequency_penalty} must be in [-2, 2]"),
        ]
        for ok, msg in checks:
            if not ok:
                raise KuiperError(msg)
        return self

    @classmethod
    def from_generation_config(cls, gen: dict | None, **overrides) -> "SamplingParams":
        gen = gen or {}
        p = cls()
        if gen.get("do_sample") is False:
            p.temperature = 0.0
        else:
            p.temperature = float(gen.get("temperature", p.temperature))
            p.top_k = int(gen.get("top_k", p.top_k) or 0)
            p.top_p = float(gen.get("top_p", p.top_p) or 1.0)
            p.min_p = float(gen.get("min_p", p.min_p) or 0.0)
        p.repeat_penalty = float(gen.get("repetition_penalty", 1.0) or 1.0)
        for k, v in overrides.items():
            if v is not None:
                setattr(p, k, v)
        return p.validate()


def apply_repetition_penalty(logits: np.ndarray, history: list[int], penalty: float) -> np.ndarray:
    """Divide positive and multiply negative logits of seen tokens by `penalty` (CTRL / HF rule)."""
    if penalty == 1.0 or not history:
        return logits
    ids = np.unique(np.asarray(history, dtype=np.int64))
    out = logits.copy()
    sel = out[ids]
    out[ids] = np.where(sel > 0, sel / penalty, sel * penalty)
    return out


def apply_openai_penalties(logits: np.ndarray, generated: list[int], presence: float,
                           frequency: float) -> np.ndarray:
    """OpenAI's presence and frequency penalties over the generated ids (not the prompt): each id seen c times
    loses frequency * c + presence from its logit."""
    if not generated or (presence == 0.0 and frequency == 0.0):
        return logits
    ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
    keep = ids < logits.size
    out = logits.astype(np.float32, copy=True)
    out[ids[keep]] -= (frequency * counts[keep] + presence).astype(np.float32)
    return out


def token_logprobs(logits, token: int, k: int, n_valid: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of `token` and the k likeliest (id, log-probability) pairs, from the raw
    logits (before penalties, temperature and truncation, as vLLM reports them)."""
    x = np.asarray(logits, dtype=np.float64)[:n_valid]
    lse = x.max() + np.log(np.exp(x - x.max()).sum())
    top = np.argpartition(-x, k)[:k] if 0 < k < x.size else np.arange(x.size if k else 0)
    top = top[np.argsort(-x[top], kind="stable")]
    return float(x[token] - lse), [(int(i), float(x[i] - lse)) for i in top]


def filter_logits(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Temperature-scaled logits with everything outside top-k / top-p / min-p set to -inf."""
    x = logits / p.temperature
    if p.top_k and p.top_k < x.size:
        kth = np.partition(x, -p.top_k)[-p.top_k]
        x = np.where(x < kth, -np.inf, x)
    if p.top_p < 1.0:
        # only the tokens top-k left are sorted: a stable sort of the whole vocabulary puts the masked ones after
        # them with zero mass, and a running sum (not np.sum's pairwise one) adds those zeros exactly, so the cut
        # is the one the whole vocabulary gives
        cand = np.flatnonzero(x > -np.inf) if p.top_k and p.top_k < x.size else np.arange(x.size)
        order = cand[np.argsort(-x[cand], kind="stable")]
        mass = np.cumsum(np.exp(x[order] - x[order[0]]))
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        cut = int(np.searchsorted(mass / mass[-1], p.top_p)) + 1
        x = x.copy()
        x[order[cut:]] = -np.inf
    if p.min_p > 0.0:
        mx = x.max()
        x = np.where(x < mx + np.log(p.min_p), -np.inf, x)
    return x


def sample(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator, history: list[int],
           n_valid: int, generated: list[int] | None = None) -> int:
    """Pick the next token from float32 logits [V]; ids >= n_valid (vocabulary padding) are never chosen.
    history: the ids the repetition penalty looks back over (prompt and reply); generated: the reply's ids
    alone, which the presence and frequency penalties count."""
    x = np.asarray(logits, dtype=np.float32)[:n_valid]
    x = apply_repetition_penalty(x, history[-p.repeat_last_n:] if p.repeat_last_n else [], p.repeat_penalty)
    x = apply_openai_penalties(x, generated or [], p.presence_penalty, p.frequency_penalty)
    if p.temperature == 0.0:
        return int(np.argmax(x))
    x = filter_logits(x.astype(np.float64), p)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    return int(rng.choice(probs.size, p=probs))


@dataclass
class RowDraw:
    """One sequence's draw in a step of several (Backend.sample_rows): its settings; its own rng (the host's draws);
    seed and step, the device's counter-based draws (device_seed; step: the draws made before this one), so a
    sequence draws the tokens it would alone on either backend; history, the ids the repetition penalty looks back
    over (prompt and reply); generated, the reply's ids alone (the OpenAI penalties)."""
    params: SamplingParams
    rng: np.random.Generator
    seed: int
    step: int
    history: list[int]
    generated: list[int]


def device_seed(params: SamplingParams) -> int:
    """The seed of a generation's device draws: the first draw of a generator seeded with params.seed, as
    generate()'s device sampler takes it (so a seeded request draws alike alone and in a batch)."""
    return int(np.random.default_rng(params.seed).integers(0, 2**63))
