"""`kuiper serve --lookup N` and `--draft DRAFT.bin` on the CPU: greedy replies equal the plain server's (the oracle:
the same model served without speculation), streamed and not, with stop strings, at the max_tokens limit, after a
cancelled request and when the prompt's prefix is reused; seeded sampling gives a valid reply; the guesses are
counted in /metrics and in the response's `kuiper` field. One server per mode, driven by the official openai
client.

Random-weight models never agree on a guess, so the two servers cover the two outcomes of a verify step: --lookup 1
proposes where the last token occurred before and is rejected (the target's own token is kept), and --draft is a
second export of the target's checkpoint (its own file and cache, the same weights), whose guesses are accepted:
several tokens per step, up to a stop string, max_tokens or the context's end inside a step."""
import json
import re
import signal

import httpx
import openai
import pytest

from conftest import run_cli, slow_cases
from kuiper_py import speculative
from kuiper_py.generate import Engine, PrefixCache
from kuiper_py.sampling import SamplingParams
from test_serve import NO_THINK, start_server
from test_speculative import other_tokenizer_file, spec_files

CTX = 128
MODES = ("lookup", "draft")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return spec_files(tmp_path_factory.mktemp("serve_spec"), (("target", "tiny", 11), ("draft", "tiny", 11)))


def _server(files, *extra):
    p, url = start_server(files["target"], "--max-context", CTX, "--served-model-name", "tiny", *extra)
    return p, url


def _stop(p):
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 0
    assert p.stdout.read() == ""


@pytest.fixture(scope="module")
def plain(files):
    p, url = _server(files)
    yield url
    _stop(p)


@pytest.fixture(scope="module", params=MODES)
def spec(request, files):
    extra = ("--lookup", 1, "--draft-tokens", 3) if request.param == "lookup" else \
        ("--draft", files["draft"], "--draft-tokens", 4)
    p, url = _server(files, *extra)
    yield request.param, url
    _stop(p)


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _counter(url, name):
    m = re.search(rf"^{name} (\S+)$", httpx.get(url + "/metrics").text, flags=re.M)
    return float(m.group(1))


def _chat(url, stream=False, **kw):
    """(content, finish reason, usage, the response's kuiper field) of a chat request, streamed or not."""
    c = _client(url)
    kw = dict(model="tiny", extra_body=NO_THINK, **kw)
    if not stream:
        r = c.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage, (r.model_extra or {}).get("kuiper")
    text, reason, usage, ext = "", None, None, None
    for ch in c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if ch.usage is not None:
            usage, ext = ch.usage, (ch.model_extra or {}).get("kuiper")
        for choice in ch.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason, usage, ext


def _completion(url, stream=False, **kw):
    c = _client(url)
    if not stream:
        r = c.completions.create(model="tiny", **kw)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage, (r.model_extra or {}).get("kuiper")
    text, reason, usage, ext = "", None, None, None
    for ch in c.completions.create(model="tiny", stream=True, stream_options={"include_usage": True}, **kw):
        if ch.usage is not None:
            usage, ext = ch.usage, (ch.model_extra or {}).get("kuiper")
        for choice in ch.choices:
            text += choice.text or ""
            reason = choice.finish_reason or reason
    return text, reason, usage, ext


def _same(got, want):
    """The same reply: text, finish reason and token counts (the usage unchanged by speculation)."""
    assert got[0] == want[0]
    assert got[1] == want[1]
    assert (got[2].prompt_tokens, got[2].completion_tokens) == (want[2].prompt_tokens, want[2].completion_tokens)


def _stop_in(text: str) -> str:
    """A stop string the reply meets part way: two characters from its middle."""
    mid = len(text) // 2
    return text[mid:mid + 2]


REQUESTS = [
    ("chat", dict(messages=[{"role": "user", "content": "Count: one two three one two three one two"}],
                  max_tokens=30)),
    ("chat", dict(messages=[{"role": "user", "content": "Tell me about Mars."}], max_tokens=7)),
    ("completion", dict(prompt="hi hi hi", max_tokens=25)),
    ("completion", dict(prompt="Once upon a time", max_tokens=1)),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind,req", REQUESTS)
def test_greedy_equals_the_plain_server(plain, spec, kind, req, stream):
    spec = spec[1]
    ask = _chat if kind == "chat" else _completion
    want = ask(plain, temperature=0, **req)
    got = ask(spec, stream=stream, temperature=0, **req)
    _same(got, want)
    assert got[3]["speculative"]["verify_steps"] >= 1 or req["max_tokens"] == 1
    if want[1] == "length":
        assert want[2].completion_tokens == req["max_tokens"]
    stop = _stop_in(want[0])
    if stop.strip():
        want = ask(plain, temperature=0, stop=[stop], **req)
        assert want[1] == "stop" and stop not in want[0]
        _same(ask(spec, stream=stream, temperature=0, stop=[stop], **req), want)


def test_the_context_limit_and_prefix_reuse(plain, spec):
    """A reply that fills the context to its last position, then a conversation that continues a reply: the cached
    prefix is reused as by the plain server and the replies stay the same."""
    spec = spec[1]
    prompt = "x y z " * 30
    n = _completion(plain, prompt=prompt, max_tokens=1)[2].prompt_tokens
    assert 20 <= CTX - n <= 60
    req = dict(prompt=prompt, max_tokens=CTX - n, temperature=0)
    _same(_completion(spec, **req), _completion(plain, **req))
    msgs = [{"role": "user", "content": "Name three rivers and say something about each."}]
    first = _chat(spec, messages=msgs, max_tokens=12, temperature=0)
    _same(first, _chat(plain, messages=msgs, max_tokens=12, temperature=0))
    msgs += [{"role": "assistant", "content": first[0]}, {"role": "user", "content": "More"}]
    want = _chat(plain, messages=msgs, max_tokens=20, temperature=0)
    got = _chat(spec, messages=msgs, max_tokens=20, temperature=0)
    _same(got, want)
    assert got[2].prompt_tokens_details.cached_tokens == want[2].prompt_tokens_details.cached_tokens > 0


def test_a_cancelled_stream_leaves_the_cache_consistent(plain, spec):
    spec = spec[1]
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 200, "stream": True, "temperature": 0,
            **NO_THINK}
    with httpx.stream("POST", spec + "/v1/chat/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    req = dict(messages=[{"role": "user", "content": "go"}], max_tokens=30, temperature=0)
    _same(_chat(spec, **req), _chat(plain, **req))  # (reuses the cancelled request's prefix)
    req = dict(prompt="the weather today", max_tokens=12, temperature=0)
    _same(_completion(spec, **req), _completion(plain, **req))


def test_seeded_sampling_gives_a_valid_reply(spec):
    spec = spec[1]
    req = dict(messages=[{"role": "user", "content": "Write a poem."}], max_tokens=24, temperature=0.9, seed=5,
               extra_body={**NO_THINK, "top_k": 0})
    c = _client(spec)
    a = c.chat.completions.create(model="tiny", **req)
    assert a.choices[0].finish_reason in ("stop", "length") and 1 <= a.usage.completion_tokens <= 24
    assert isinstance(a.choices[0].message.content, str)
    b = c.chat.completions.create(model="tiny", **req)
    assert b.choices[0].message.content == a.choices[0].message.content  # (the seed fixes the draws)
    s = a.model_extra["kuiper"]["speculative"]
    assert s["verify_steps"] >= 1 and 0 <= s["accepted"] <= s["proposed"] <= 4 * s["verify_steps"]


def test_logprobs_and_penalties_are_served(plain, spec):
    """logprobs: the request is decoded plainly (counted); penalties: speculatively, the same as the plain server."""
    spec = spec[1]
    before = _counter(spec, "kuiper_spec_decode_plain_requests_total")
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, logprobs=True,
              top_logprobs=2, extra_body=NO_THINK)
    want, got = _client(plain).chat.completions.create(**kw), _client(spec).chat.completions.create(**kw)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert [e.token for e in got.choices[0].logprobs.content] == [e.token for e in want.choices[0].logprobs.content]
    assert "kuiper" not in (got.model_extra or {})
    assert _counter(spec, "kuiper_spec_decode_plain_requests_total") == before + 1
    req = dict(prompt="hi hi hi", max_tokens=16, temperature=0, frequency_penalty=1.5, presence_penalty=0.5)
    _same(_completion(spec, **req), _completion(plain, **req))


def test_metrics_count_the_guesses(spec):
    mode, spec = spec
    names = ("kuiper_spec_decode_num_drafts_total", "kuiper_spec_decode_num_draft_tokens_total",
             "kuiper_spec_decode_num_accepted_tokens_total")
    before = [_counter(spec, n) for n in names]
    r = _completion(spec, prompt="hi hi hi", max_tokens=60, temperature=0, extra_body={"ignore_eos": True})
    s = r[3]["speculative"]
    after = [_counter(spec, n) for n in names]
    assert [b - a for a, b in zip(before, after)] == [s["verify_steps"], s["proposed"], s["accepted"]]
    assert s["proposed"] > 0 and 0 <= s["accepted"] <= s["proposed"]
    assert s["verify_steps"] + s["accepted"] == r[2].completion_tokens - 1  # (the first token; a step: accepted + 1)
    if mode == "draft":  # (the twin's guesses are the target's)
        assert s["accepted"] > s["proposed"] // 2 and s["verify_steps"] < r[2].completion_tokens // 2


def test_flag_errors_and_a_draft_of_another_vocabulary_are_one_line(files, tiny_dir, tmp_path):
    for extra, msg in ((["--lookup", 0], "--lookup"), (["--lookup", 2, "--draft-tokens", 0], "--draft-tokens"),
                       (["--draft-tokens", 3], "--draft-tokens needs"),
                       (["--draft", files["draft"], "--lookup", 2], "one of")):
        r = run_cli("serve", "-m", files["target"], "--port", 0, "--device", "cpu", *extra, timeout=60)
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("kuiper: error:"), r.stderr
        assert msg in r.stderr and "Traceback" not in r.stderr and r.stdout == ""
    other = other_tokenizer_file(tiny_dir, tmp_path)
    r = run_cli("serve", "-m", files["target"], "--port", 0, "--device", "cpu", "--draft", other, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == ""
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("kuiper: error: --draft") and "tokenizer" in last


def test_a_reply_cut_short_inside_a_step_leaves_the_cache_a_prefix_of_it(files):
    """speculative.run_cached (the engine worker's path) closed between two tokens of one verify step: the shared
    cache holds only tokens drawn, so a request that continues them reuses them and replies as a fresh cache does."""
    eng = Engine.load(files["target"], "cpu")
    cache, draft = PrefixCache(eng, CTX, warm=False), speculative.Draft(Engine.load(files["draft"], "cpu"), eng)
    draft.start(CTX)
    greedy = SamplingParams(temperature=0.0)
    ids = eng.tokenizer.encode("hi hi hi")
    it = speculative.run_cached(cache, draft, ids, 40, greedy, 4)
    drawn = [next(it).token for _ in range(4)]  # (the first token, then 3 of the first step's 5)
    it.close()
    assert cache.cached == (ids + drawn)[:cache.model.pos] and len(cache.cached) == cache.model.pos
    more = ids + drawn + eng.tokenizer.encode(" and")
    got = list(speculative.run_cached(cache, draft, more, 10, greedy, 4))
    assert got[-1].cached_tokens == len(ids + drawn) - 1
    want = list(PrefixCache(Engine.load(files["target"], "cpu"), CTX, warm=False).run(more, 10, greedy))
    assert [r.token for r in got] == [r.token for r in want]


@pytest.mark.gpu
# (lookup is the slow tier's: test_gpu_speculative runs it on the GPU, and the draft is what the server adds there)
@pytest.mark.parametrize("mode", slow_cases(MODES, ("lookup",)))
def test_gpu_server_equals_generate(files, mode):
    """--device cuda (device machine only): the draft loads and warms its graphs on the GPU; a fresh server's first
    greedy reply is `kuiper generate`'s with the same flags (the same verify steps on the same kernels), counted
    alike; seeded sampling gives a valid reply."""
    extra = ["--lookup", "1"] if mode == "lookup" else ["--draft", str(files["draft"])]
    r = run_cli("generate", "-m", files["target"], "--device", "cuda", "--json", "-p", "hi hi hi", "--raw", "--temp",
                "0", "-n", 40, *extra)
    assert r.returncode == 0, r.stderr
    want = json.loads(r.stdout)
    p, url = start_server(files["target"], "--max-context", CTX, "--device", "cuda", "--served-model-name", "tiny",
                          *extra)
    try:
        c = _client(url)
        got = c.completions.create(model="tiny", prompt="hi hi hi", max_tokens=40, temperature=0)
        assert got.choices[0].text == want["text"] and got.usage.completion_tokens == len(want["tokens"])
        s = got.model_extra["kuiper"]["speculative"]
        assert s["verify_steps"] >= 1 and (mode == "lookup" or s["accepted"] > 0)
        a = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0.8, seed=4)
        assert a.choices[0].finish_reason in ("stop", "length") and 1 <= a.usage.completion_tokens <= 20
        assert _counter(url, "kuiper_spec_decode_num_drafts_total") >= s["verify_steps"]
    finally:
        _stop(p)
