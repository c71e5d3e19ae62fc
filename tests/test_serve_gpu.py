"""`kuiper serve --device cuda` (device machine only): the server's replies equal `kuiper generate`'s on the GPU,
across the device draw (queued ahead), the host draw (logprobs, OpenAI penalties) and the prompt cache's reuse."""
import json
import signal

import openai
import pytest

from conftest import run_cli
from kuiper_py.generate import Engine
from kuiper_py.loader import load
from reference import gpu_near_tie
from test_serve import NO_THINK, start_server

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
oc = pytest.importorskip("kuiper_py.ops_cupy")


@pytest.fixture(scope="module")
def gpu_server(tiny_bin):
    p, url = start_server(tiny_bin, "--max-context", 1024, "--device", "cuda")
    yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 0


def _cli(tiny_bin, *args):
    r = run_cli("generate", "-m", tiny_bin, "--device", "cuda", "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _chat(client, text, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                          extra_body=NO_THINK, **kw)


def _near_tie(tiny_bin, text: str, before: list[int], a: int, b_text: str) -> bool:
    """Whether generate's token a and the server's token (b_text) are the CPU reference's top two after the chat
    prompt of text and the tokens before, closer than the GPU's own logit error there (reference.gpu_near_tie): a
    reply that reuses the cached prompt recomputes its last token alone, with other kernels than the whole prompt's
    prefill, so its greedy tokens may part from a fresh run's at such a tie (as test_gpu_paged's batches may)."""
    eng = Engine.load(tiny_bin, "cpu")
    tok = eng.tokenizer
    ctx = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], enable_thinking=False)) + before
    tie, _ = gpu_near_tie(load(tiny_bin), ctx, eng.n_valid_tokens)
    return a in tie and tok.decode(list(tie - {a})) == b_text


def _same_greedy_up_to_a_tie(entries, want: dict, tiny_bin, text: str) -> None:
    """The reply's tokens spell want's text, or part from it only at a near tie (_near_tie) of its chosen token and
    the runner-up, want's token."""
    got = ""
    for j, e in enumerate(entries):
        if not want["text"].startswith(got + e.token):
            top = sorted(e.top_logprobs, key=lambda t: -t.logprob)
            assert len(top) == 2 and want["text"][len(got):].startswith(top[1].token), (got, e)
            assert _near_tie(tiny_bin, text, want["tokens"][:j], want["tokens"][j], top[0].token), (got, e)
            return
        got += e.token
    assert got == want["text"]


def test_gpu_server_equals_generate_across_draw_paths(gpu_server, tiny_bin):
    want = _cli(tiny_bin, "-p", "Tell me about Mars.", "--no-think", "--temp", "0", "-n", 16)
    first = _chat(gpu_server, "Tell me about Mars.", max_tokens=16, temperature=0)
    assert first.choices[0].message.content == want["text"]
    # the host draw (logprobs and penalties) between two device draws, the second reusing the whole prompt
    lp = _chat(gpu_server, "Tell me about Mars.", max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    _same_greedy_up_to_a_tie(lp.choices[0].logprobs.content, want, tiny_bin, "Tell me about Mars.")
    assert all(e.logprob == max(t.logprob for t in e.top_logprobs) for e in lp.choices[0].logprobs.content)
    _chat(gpu_server, "Tell me about Mars.", max_tokens=8, temperature=0, frequency_penalty=1.5)
    again = _chat(gpu_server, "Tell me about Mars.", max_tokens=16, temperature=0)
    # lp and again both reuse the cached prompt and recompute its last token alone (a one-token prefill, not part
    # of the whole prompt's): the same logits, drawn on the host (lp) and by the device's fused argmax (again)
    assert again.choices[0].message.content == lp.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_gpu_server_seeded_sampling_and_stream(gpu_server, tiny_bin):
    want = _cli(tiny_bin, "-p", "Once upon a time", "--raw", "--temp", "0.8", "--seed", "4", "-n", 20)
    got = gpu_server.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0.8,
                                        seed=4)
    assert got.choices[0].text == want["text"]
    streamed = "".join(c.choices[0].text for c in gpu_server.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0.8, seed=4, stream=True) if c.choices)
    assert streamed == want["text"]
