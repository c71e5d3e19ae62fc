"""generate()'s queued-ahead decode (each step queued on the device's drawn token before the host reads
it: Qwen3.decode_sampled) against the serial loop, on the CPU through a NumPy backend that mimics the
CUDA backend's draw interface. The GPU runs the same checks in test_gpu_e2e."""
import numpy as np
import pytest

from kuiper_py.backend import Step
from kuiper_py.generate import Engine, generate
from kuiper_py.loader import load
from kuiper_py.model import Qwen3
from kuiper_py.ops_numpy import NumpyOps
from kuiper_py.sampling import SamplingParams

PROMPT = [785, 6722, 315, 9625, 374, 11, 323]


class QueuedOps(NumpyOps):
    """NumpyOps with CupyOps's draw interface: sample_launch keeps the id where only the next step
    (token SAMPLED_TOKEN) reads it until sample_result hands it to the host."""
    graphs = queues_draws = True

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.device_token, self.queued, self.ahead_steps, self.forgotten = None, False, 0, 0

    def sample_launch(self, logits, p, rng, history, n_valid):
        assert not self.queued
        self.device_token, self.queued = self.sample(logits, p, rng, list(history), n_valid), True

    def sample_result(self):
        assert self.queued
        self.queued = False
        return self.device_token

    def cancel_draw(self):
        self.queued = False

    def decode_step(self, body, step):
        token = step.one().ids[0]
        if token == self.SAMPLED_TOKEN:
            assert self.device_token is not None
            self.ahead_steps += 1
        else:
            self.device_token = token
        return super().decode_step(body, step)

    def embed(self, step):
        s = step.one()
        return super().embed(Step.single([self.device_token], s.pos0) if s.ids == (self.SAMPLED_TOKEN,) else step)

    def forget_position(self):
        self.forgotten += 1


def _engine(binf, ops_cls, ctx):
    mf = load(binf)
    eng = Engine(mf, "cpu", None)
    eng.model = Qwen3(mf, ops_cls, ctx)
    return eng


def _run(binf, ops_cls, ctx, **kw):
    eng = _engine(binf, ops_cls, ctx)
    recs = list(generate(eng, PROMPT, params=SamplingParams(temperature=0.9, top_k=40, top_p=0.95,
                                                            repeat_penalty=1.3, seed=11), max_context=ctx, **kw))
    return eng.model, recs


@pytest.mark.parametrize("case", ["length", "eos", "context"])
def test_queued_ahead_generation_equals_serial(tiny_bin, case):
    ctx = len(PROMPT) + (9 if case == "context" else 24)
    serial, ref = _run(tiny_bin, NumpyOps, ctx, max_tokens=16, eos_ids=[])
    eos = []
    if case == "eos":  # end at the first occurrence of the 6th token
        eos = [ref[5].token]
    serial, ref = _run(tiny_bin, NumpyOps, ctx, max_tokens=16, eos_ids=eos)
    model, recs = _run(tiny_bin, QueuedOps, ctx, max_tokens=16, eos_ids=eos)
    assert [(r.token, r.finish_reason, r.gen_tokens, r.decode_steps) for r in recs] == \
           [(r.token, r.finish_reason, r.gen_tokens, r.decode_steps) for r in ref]
    assert recs[-1].finish_reason == {"length": "length", "eos": "stop", "context": "context"}[case]
    assert model.pos == serial.pos and not model.ops.queued
    # every step was queued ahead of the host, and one more before a stop
    assert model.ops.ahead_steps == ref[-1].decode_steps + (case == "eos")
    assert model.ops.forgotten == (1 if case == "eos" else 0)  # only a stop can leave a step queued ahead
    if case == "context":
        return
    # the session goes on from the same place: the discarded step's cache row is overwritten
    more = [151644, 872, 198]
    a = model.prefill(more)
    b = serial.prefill(more)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(model.decode(int(np.argmax(a))), serial.decode(int(np.argmax(b))))


def test_consumer_leaving_takes_the_queued_step_back(tiny_bin):
    eng = _engine(tiny_bin, QueuedOps, 64)
    gen = generate(eng, PROMPT, 16, SamplingParams(temperature=0.0, top_k=0, top_p=1.0), eos_ids=[], max_context=64)
    first = [next(gen) for _ in range(4)]
    pos = eng.model.pos  # one step queued ahead of the host
    gen.close()
    assert eng.model.pos == pos - 1 == len(PROMPT) + 3 and eng.model.ops.forgotten == 1
    assert first[-1].decode_steps == 3


def test_generation_asks_for_its_decode_graphs_before_the_prompt(tiny_bin, monkeypatch):
    """generate() has the model capture the decode graphs of its steps' key range (prompt + 1 .. prompt + max tokens -
    1: the last token needs no step) before the prompt runs, none for a one-token generation, and its records carry
    the seconds that took (warmup_seconds; on the CPU nothing is captured). The GPU side: test_gpu_e2e.py."""
    calls = []
    real = Qwen3.warm_decode_graphs

    def spy(self, n_valid, keys=None):
        calls.append((self.pos, n_valid, keys))
        return real(self, n_valid, keys)

    monkeypatch.setattr(Qwen3, "warm_decode_graphs", spy)
    eng = Engine.load(tiny_bin, "cpu", need_tokenizer=False)
    prompt = np.random.default_rng().integers(0, 200, size=int(np.random.default_rng().integers(3, 20))).tolist()
    greedy = SamplingParams(temperature=0.0)
    last = list(generate(eng, prompt, 7, greedy, eos_ids=[]))[-1]
    assert calls == [(0, eng.n_valid_tokens, (len(prompt) + 1, len(prompt) + 6))]
    assert len(last.tokens) == 7 and last.decode_steps == 6 and last.warmup_seconds >= 0
    assert eng.model.warm_decode_graphs(eng.n_valid_tokens, (1, 5)) == []
    calls.clear()
    list(generate(eng, prompt, 1, greedy, eos_ids=[]))
    assert calls == []


def test_host_only_requests_draw_on_the_host_with_the_same_tokens(tiny_bin):
    """Presence/frequency penalties and logprobs are not the device draw's: such a request takes the serial loop
    with the logits copied back, and gives what the NumPy backend gives."""
    p = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=5, presence_penalty=0.5, frequency_penalty=1.0)
    refs = list(generate(_engine(tiny_bin, NumpyOps, 64), PROMPT, 12, p, eos_ids=[], max_context=64, logprobs=2))
    eng = _engine(tiny_bin, QueuedOps, 64)
    recs = list(generate(eng, PROMPT, 12, p, eos_ids=[], max_context=64, logprobs=2))
    assert [r.token for r in recs] == [r.token for r in refs] and eng.model.ops.ahead_steps == 0
    assert all(r.logprob is not None and len(r.logprob[1]) == 2 and r.logprob[0] <= 0 for r in recs)
    plain = list(generate(_engine(tiny_bin, QueuedOps, 64), PROMPT, 12, SamplingParams(temperature=0.0), eos_ids=[],
                          max_context=64))
    assert all(r.logprob is None for r in plain)


def test_stop_string_trims_the_tokens_with_the_text(tiny_bin):
    """With a stop string the record's tokens are the fewest whose text covers the trimmed text: a token that
    straddles the stop string's start stays, those after it go (also in `kuiper generate --json`)."""
    from conftest import run_cli
    eng = Engine.load(tiny_bin, "cpu")
    tok = eng.tokenizer
    p = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, seed=3)
    ref = list(generate(eng, PROMPT, 24, p, eos_ids=[]))[-1].tokens
    full = tok.decode(ref)
    # a stop string that starts inside a token: the last character of one token's text and the next one's first
    ends = [len(tok.decode(ref[:n])) for n in range(1, len(ref) + 1)]
    i = next(n for n in range(4, len(ref) - 1) if ends[n] - ends[n - 1] >= 2 and "\ufffd" not in full[:ends[n + 1]])
    stop = full[ends[i] - 1:ends[i] + 1]
    text = full[:full.index(stop)]
    last = list(generate(eng, PROMPT, 24, p, stop=[stop], eos_ids=[]))
    assert "".join(r.text for r in last) == text and last[-1].finish_reason == "stop"
    want = min(n for n in range(len(ref) + 1) if tok.decode(ref[:n]).startswith(text))
    assert last[-1].tokens == ref[:want] and last[-1].gen_tokens >= want
    if text == full[:ends[i] - 1]:  # (the stop string's first occurrence is the chosen one: token i straddles it)
        assert want == i + 1
    r = run_cli("generate", "-m", tiny_bin, "--raw", "-p", tok.decode(PROMPT), "--temp", 0.9, "--top-k", 0,
                "--top-p", 1, "--seed", 3, "-n", 24, "--stop", stop, "--json", "--device", "cpu")
    rec = __import__("json").loads(r.stdout)
    assert rec["text"] == text and rec["tokens"] == ref[:want]
