"""`kuiper serve` end to end on the CPU: one server subprocess for the module, on a tiny synthetic model whose chat
template takes tools (written for this test in the manner of Qwen3's), driven by the official openai client and
httpx. The oracle for generated text is `kuiper generate` (the same engine without the server)."""
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from conftest import ROOT, child_env, run_cli
from kuiper_py.export import export
from kuiper_py.generate import Engine

# Qwen3's template shape: tools listed in the system turn, assistant tool calls as <tool_call> blocks, tool results
# in a user turn as <tool_response> blocks, and the empty think block that enable_thinking=false puts in the prompt
TOOL_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n<tools>' }}{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\nCall a function as <tool_call>\\n{\"name\": ..., \"arguments\": {...}}\\n</tool_call>"
    "<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' + m.content }}"
    "{%- for c in m.tool_calls or [] %}{{ '\\n<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' }}"
    "{%- if c.function.arguments is string %}{{ c.function.arguments }}{% else %}{{ c.function.arguments | tojson }}"
    "{%- endif %}{{ '}\\n</tool_call>' }}{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{%- endif %}")
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
CTX = 1024


@pytest.fixture(scope="module")
def model_file(tiny_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    ck = d / "ck"
    shutil.copytree(tiny_dir, ck)
    cfg = json.loads((ck / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TOOL_TEMPLATE
    (ck / "tokenizer_config.json").write_text(json.dumps(cfg))
    out = d / "tooly.bin"
    export(ck, out, progress=False, log=lambda m: None)
    return out


def start_server(model, *extra):
    """A `kuiper serve` subprocess on a free port; (process, base URL) once /health says 200."""
    env = child_env()
    p = subprocess.Popen([sys.executable, "-m", "kuiper_py", "serve", "-m", str(model), "--device", "cpu",
                          "--port", "0", *map(str, extra)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    line = p.stderr.readline()
    m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
    assert m, line + p.stderr.read()
    threading.Thread(target=p.stderr.read, daemon=True).start()  # (keep the pipe drained)
    url = f"http://127.0.0.1:{m.group(1)}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health").status_code == 200:
                return p, url
        except httpx.TransportError:
            pass
        assert p.poll() is None, "the server died while loading"
        time.sleep(0.1)
    raise AssertionError("the server did not become ready")


@pytest.fixture(scope="module")
def server(model_file):
    p, url = start_server(model_file, "--max-context", CTX, "--max-queue", 4, "--served-model-name", "tiny")
    yield url
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 0
    assert p.stdout.read() == ""  # (stdout carries nothing but generated text, and a server generates none there)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


def cli_json(model, *args):
    r = run_cli("generate", "-m", model, "--device", "cpu", "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_health_models_and_metrics(server, client):
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == ["tiny"]
    client.completions.create(model="tiny", prompt="count", max_tokens=2)
    text = httpx.get(server + "/metrics").text
    for name in ("kuiper_requests_total", "kuiper_time_to_first_token_seconds_bucket",
                 "kuiper_time_per_output_token_seconds_count", "kuiper_num_requests_waiting",
                 "kuiper_generation_tokens_total", "kuiper_prompt_tokens_total"):
        assert name in text, name
    assert re.search(r'kuiper_requests_total\{endpoint="/v1/completions",status="200"\} [1-9]', text)


@pytest.mark.parametrize("sampling", [["--temp", "0"], ["--temp", "0.9", "--seed", "7", "--top-k", "0"]])
def test_chat_and_completion_equal_kuiper_generate(server, client, model_file, sampling):
    """The same tokens as the CLI's, greedy and seeded sampling (the CPU draws on the host with the same rng)."""
    kw = dict(temperature=float(sampling[1]), max_tokens=12)
    extra = {}
    if len(sampling) > 2:
        kw, extra = dict(kw, seed=7), {"top_k": 0}
    want = cli_json(model_file, "-p", "Tell me about Mars.", "--no-think", "-n", 12, *sampling)
    got = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Tell me about Mars."}],
                                         **kw, extra_body={**extra, **NO_THINK})
    assert got.choices[0].message.content == want["text"]
    assert got.usage.completion_tokens == len(want["tokens"]) and got.usage.prompt_tokens == want["prompt_tokens"]
    want = cli_json(model_file, "-p", "Once upon a time", "--raw", "-n", 12, *sampling)
    got = client.completions.create(model="tiny", prompt="Once upon a time", **kw, extra_body=extra)
    assert got.choices[0].text == want["text"] and got.choices[0].finish_reason == "length"


def _stream_chat(client, **kw):
    reasoning, content, calls, reasons, usage = "", "", [], [], None
    for ch in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            d = c.delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            calls += d.tool_calls or []
            if c.finish_reason:
                reasons.append(c.finish_reason)
    return reasoning, content, calls, reasons, usage


@pytest.mark.parametrize("think", [None, False])
def test_streamed_equals_non_streamed(client, think):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Write a poem."}], max_tokens=20,
              temperature=0.8, seed=11, stop=["e"])
    if think is not None:
        kw["extra_body"] = {"chat_template_kwargs": {"enable_thinking": think}}
    whole = client.chat.completions.create(**kw)
    reasoning, content, _, reasons, usage = _stream_chat(client, **kw)
    msg = whole.choices[0].message
    assert content == (msg.content or "") and reasoning == (getattr(msg, "reasoning_content", None) or "")
    assert reasons == [whole.choices[0].finish_reason]
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert "e" not in content + reasoning  # (the stop string ends the reply and is not part of it)
    c = client.completions.create(model="tiny", prompt="Roses are", max_tokens=15, temperature=0.8, seed=3)
    s = "".join(ch.choices[0].text for ch in client.completions.create(model="tiny", prompt="Roses are",
                                                                        max_tokens=15, temperature=0.8, seed=3,
                                                                        stream=True) if ch.choices)
    assert s == c.choices[0].text


def _tokenize(server, **body):
    r = httpx.post(server + "/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


def test_tool_round_trip(server, client, model_file):
    """Tools and a tool result reach the model through the template, and the answer has OpenAI's shape."""
    tok = Engine.load(model_file, "cpu").tokenizer
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    prompt = tok.decode(_tokenize(server, messages=msgs, tools=[WEATHER], **NO_THINK))
    assert json.dumps(WEATHER["function"]["parameters"]) in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert prompt.endswith("<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
                           "<think>\n\n</think>\n\n")
    got = client.chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER], max_tokens=8,
                                         temperature=0, extra_body=NO_THINK)
    assert got.usage.prompt_tokens == len(tok.encode(prompt))
    assert got.choices[0].finish_reason in ("stop", "length") and got.choices[0].message.role == "assistant"
    _, content, calls, reasons, _ = _stream_chat(client, model="tiny", messages=msgs, tools=[WEATHER], max_tokens=8,
                                                 temperature=0, extra_body=NO_THINK)
    assert content == (got.choices[0].message.content or "") and not calls and not got.choices[0].message.tool_calls
    none = client.chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER], tool_choice="none",
                                          max_tokens=1, extra_body=NO_THINK)
    assert none.usage.prompt_tokens < got.usage.prompt_tokens  # ("none": the tools are not offered)


def test_conversation_reuses_the_cache(server, client):
    """A request that continues the last one prefills only what follows the prefix the cache holds."""
    msgs = [{"role": "user", "content": "Name three rivers in Europe and say something about each."}]
    first = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "More"}]
    second = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    # thinking off: the earlier turn renders without its empty think block, so the reuse stops where they differ
    a, b = _tokenize(server, messages=msgs[:1], **NO_THINK), _tokenize(server, messages=msgs, **NO_THINK)
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    client.chat.completions.create(model="tiny", messages=msgs[:1], max_tokens=6, temperature=0, extra_body=NO_THINK)
    again = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0,
                                           extra_body=NO_THINK)
    assert again.usage.prompt_tokens_details.cached_tokens == shared


def test_logprobs_and_host_penalties(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3, extra_body=NO_THINK)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens
    for e in lp:  # greedy: the drawn token is the likeliest
        assert len(e.top_logprobs) == 3 and e.logprob == max(t.logprob for t in e.top_logprobs) <= 0
    assert "".join(e.token for e in lp) == r.choices[0].message.content
    # a frequency penalty makes a greedy reply that repeats itself change
    plain = client.completions.create(model="tiny", prompt="hi", max_tokens=10, temperature=0)
    pen = client.completions.create(model="tiny", prompt="hi", max_tokens=10, temperature=0, frequency_penalty=2.0,
                                    presence_penalty=2.0)
    toks = _tokenize_text(client, plain.choices[0].text)
    if len(set(toks)) < len(toks):
        assert pen.choices[0].text != plain.choices[0].text


def _tokenize_text(client, text):
    return httpx.post(str(client.base_url).replace("/v1/", "") + "/tokenize", json={"prompt": text}).json()["tokens"]


BAD = [
    ("/v1/chat/completions", b'{"messages": [', 400),
    ("/v1/chat/completions", b'[1, 2]', 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 1100}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": CTX}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a lone \\ud800 surrogate"}]}', 400),
    ("/v1/completions", b'{"prompt": "\\udcff"}', 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tool_choice": {"type": "function", "function": {"name": "f"}}}, 400),
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"prompt": [151936]}, 400),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400),
    ("/v1/completions", {}, 400),
]


@pytest.mark.parametrize("path,body,status", BAD)
def test_bad_requests_get_4xx_and_the_server_stays_up(server, path, body, status):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body}
    r = httpx.post(server + path, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and "Traceback" not in r.text
    assert httpx.get(server + "/health").status_code == 200


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p"])
def test_a_number_that_is_not_finite_is_a_400_naming_its_field(server, field):
    body = b'{"messages": [{"role": "user", "content": "hi"}], "%s": 1e999}' % field.encode()
    r = httpx.post(server + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def _counter(server, name):
    m = re.search(rf"^{name} (\S+)$", httpx.get(server + "/metrics").text, flags=re.M)
    return float(m.group(1))


def test_client_disconnect_cancels_its_generation(server, client):
    before = _counter(server, "kuiper_generation_tokens_total")
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 800, "stream": True, "temperature": 0.7,
            "seed": 1}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    t0 = time.time()
    r = client.completions.create(model="tiny", prompt="after", max_tokens=2)
    assert r.usage.completion_tokens == 2 and time.time() - t0 < 60
    assert _counter(server, "kuiper_requests_cancelled_total") >= 1
    assert _counter(server, "kuiper_generation_tokens_total") - before < 400


def test_a_non_streamed_client_that_leaves_cancels_its_generation(server, client):
    """The client gives up (a read timeout) while tokens keep coming: the job stops, it does not run to max_tokens."""
    before = _counter(server, "kuiper_generation_tokens_total")
    cancelled = _counter(server, "kuiper_requests_cancelled_total")
    body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 800, "temperature": 0.7, "seed": 2,
            "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server + "/v1/chat/completions", json=body, timeout=1.0)
    r = client.completions.create(model="tiny", prompt="after", max_tokens=2)
    assert r.usage.completion_tokens == 2
    assert _counter(server, "kuiper_requests_cancelled_total") == cancelled + 1
    assert _counter(server, "kuiper_generation_tokens_total") - before < 400


def test_four_concurrent_clients_each_get_what_they_get_alone(client):
    prompts = [f"Story number {i} begins" for i in range(4)]

    def ask(p):
        return client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0.9, seed=5).choices[0].text
    alone = [ask(p) for p in prompts]
    got = [None] * 4
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, ask(prompts[i]))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone


def test_full_queue_answers_503_with_retry_after(server):
    """--max-queue 4: one long stream runs, and of eight more at once some find the queue full."""
    import asyncio

    async def go():
        async with httpx.AsyncClient(base_url=server, timeout=60) as ac:
            body = {"prompt": "x", "max_tokens": 300, "stream": True}
            async with ac.stream("POST", "/v1/completions", json=body) as long:
                await long.aiter_lines().__anext__()
                rs = await asyncio.gather(*(ac.post("/v1/completions", json={"prompt": "y", "max_tokens": 1})
                                            for _ in range(8)))
            return rs
    rs = asyncio.run(go())
    busy = [r for r in rs if r.status_code == 503]
    assert busy and all(r.headers.get("retry-after") for r in busy)
    assert all(r.status_code in (200, 503) for r in rs)
    assert httpx.get(server + "/health").status_code == 200


def test_sigterm_mid_stream_exits_0(model_file):
    p, url = start_server(model_file, "--max-context", 256)
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "a", "max_tokens": 60, "stream": True},
                      timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        p.send_signal(signal.SIGTERM)
        rest = [x for x in lines if x]  # the running request finishes (or is cut at the grace period's end)
    assert p.wait(60) == 0
    assert rest[-1] == "data: [DONE]" or not rest


def test_bench_serve_reports_latency_percentiles(server):
    cmd = [sys.executable, str(ROOT / "tools" / "bench_serve.py"), "--base-url", server, "-n", 4,
           "--max-concurrency", 2, "--input-len", 16, "--output-len", 6]
    r = subprocess.run([*map(str, cmd), "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["completed"] == 4 and s["failed"] == 0
    assert s["total_output_tokens"] == 24 and s["total_input_tokens"] == 64  # (ignore_eos: exact lengths)
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert 0 < s[k]["p50"] <= s[k]["p90"] <= s[k]["p99"], k
    assert s["ttft_ms"]["p99"] <= s["e2e_ms"]["p99"] and s["output_throughput"] > 0
    r = subprocess.run([*map(str, cmd), "--single", "--repeats", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "tok/s" in r.stdout and "TTFT" in r.stdout, r.stderr


def test_loading_answers_503_and_a_bad_model_or_port_is_one_error_line(tmp_path, model_file):
    from fastapi.testclient import TestClient

    from kuiper_py.serve.app import create_app
    from kuiper_py.serve.engine_worker import EngineWorker
    from kuiper_py.serve.metrics import Metrics
    app = TestClient(create_app(EngineWorker(str(model_file), "cpu", None, 4, Metrics()), "tiny"))  # (not started)
    assert app.get("/health").status_code == 503
    r = app.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and r.json()["error"]["message"] == "the model is loading"
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"not a model" * 100)
    r = run_cli("serve", "-m", bad, "--port", 0, "--device", "cpu", timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("kuiper: error: ")
    assert "Traceback" not in r.stderr and r.stdout == ""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        r = run_cli("serve", "-m", model_file, "--port", s.getsockname()[1], "--device", "cpu", timeout=60)
    assert r.returncode == 2 and "kuiper: error: cannot listen on 127.0.0.1:" in r.stderr
