"""Chats on one KV cache (generate.Chat, `kuiper chat`): each turn prefills only what the cache lacks, and its reply
is the one a fresh session gives the whole conversation (the CPU backend; test_gpu_e2e.py checks the GPU's)."""
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import child_env, run_cli
from kuiper_py.generate import Chat, Engine, common_prefix, generate
from kuiper_py.sampling import SamplingParams
from reference import reference_engine

GREEDY = SamplingParams(temperature=0.0)
WORDS = ["sea", "stone", "river", "cloud", "lamp", "garden", "winter", "bridge", "violin", "harbour", "maple"]


def _message(rng, n=6):
    return " ".join(rng.choice(WORDS, n))


def _spy_prefills(chat):
    """The lengths of the model's prefills, in order."""
    seen, real = [], chat.model.prefill

    def prefill(ids, *a, **kw):
        seen.append(len(ids))
        return real(ids, *a, **kw)
    chat.model.prefill = prefill
    return seen


def _fresh_reply(binf, ids, n):
    """What a new CPU session replies to the whole rendered conversation: (tokens, text)."""
    recs = list(generate(reference_engine(binf), ids, n, GREEDY, max_context=len(ids) + n))
    return recs[-1].tokens, "".join(r.text for r in recs)


def _assert_parted_at_a_tie(binf, ids, got, want):
    """A chat's reply may part from a fresh session's only where the fresh session's two best logits tie to float32
    precision (the chat's prefix was prefilled in other chunks, so its sums are in another order): there, both ids
    are within that precision of the best logit (recomputed here in one prefill, itself another order)."""
    j = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    eng = reference_engine(binf)
    m = eng.session(len(ids) + len(want))
    m.reset()
    lg = np.asarray(m.prefill(ids + want[:j]), np.float64)[:eng.n_valid_tokens]
    top = np.sort(lg)[::-1]  # (the best few, for the failure message)
    tol = 1e-4 * np.abs(lg).max()
    print(f"parted at reply token {j}: {got[j]} ({lg[got[j]]:.6f}) against {want[j]} ({lg[want[j]]:.6f})")
    assert top[0] - lg[want[j]] < tol and top[0] - lg[got[j]] < tol, (j, top[:3])


def _run_bytes(*args, input: bytes):
    """run_cli with bytes in and out (no text-mode newline translation)."""
    return subprocess.run([sys.executable, "-m", "kuiper_py", *map(str, args)], input=input, capture_output=True,
                          env=child_env(), timeout=300)


def _turn(chat, text, n, binf, prefills, reset=False):
    """One turn, checked: it prefilled only the tokens after the cache's common prefix with the rendering (reset:
    after the cache was reset under the chat, all of them), its reply is a fresh session's, and the cache and the
    conversation hold what they should. Returns the records."""
    before = [] if reset else list(chat.cached)
    recs = list(chat.turn(text, n, GREEDY))
    ids = chat.render(chat.messages[:-1])
    keep = min(common_prefix(before, ids), len(ids) - 1)
    assert recs[-1].cached_tokens == keep and prefills[-1] == len(ids) - keep == recs[-1].prompt_tokens
    reply = "".join(r.text for r in recs)
    fresh_tokens, fresh_text = _fresh_reply(binf, ids, n)
    if recs[-1].tokens == fresh_tokens:
        assert reply == fresh_text
    else:
        _assert_parted_at_a_tie(binf, ids, recs[-1].tokens, fresh_tokens)
    assert chat.cached == (ids + recs[-1].tokens)[:chat.model.pos]
    assert chat.messages[-2:] == [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
    return recs


@pytest.mark.parametrize("think", [None, False])
def test_chat_turns_prefill_only_what_the_cache_lacks(tiny_bin, think):
    rng = np.random.default_rng()
    chat = Chat(Engine.load(tiny_bin, "cpu"), 256, system="Answer briefly.", enable_thinking=think)
    prefills = _spy_prefills(chat)
    for turn in range(3):
        recs = _turn(chat, _message(rng), 10, tiny_bin, prefills)
        if turn:  # the system message and the earlier turns were not prefilled again
            assert recs[-1].cached_tokens > 20
    assert len(chat.messages) == 6 and chat.dropped == 0
    if think is None:  # (the test template renders a reply after the prompt that drew it: that prompt stays cached)
        assert recs[-1].cached_tokens >= len(chat.render(chat.messages[:-3]))
    chat.reset()
    assert chat.messages == [] and chat.cached == [] and chat.model.pos == 0
    recs = _turn(chat, _message(rng), 4, tiny_bin, prefills)
    assert recs[-1].cached_tokens == 0


def test_chat_drops_the_oldest_exchanges_to_fit(tiny_bin):
    rng = np.random.default_rng()
    chat = Chat(Engine.load(tiny_bin, "cpu"), 80, enable_thinking=False)
    prefills, dropped = _spy_prefills(chat), []
    for _ in range(6):
        _turn(chat, _message(rng), 12, tiny_bin, prefills)
        dropped.append(chat.dropped)
        ids = chat.render(chat.messages[:-1])
        assert len(ids) + 12 <= 80  # the reply had room for its 12 tokens
    assert sum(dropped) > 0 and len(chat.messages) < 12


def test_chat_keeps_an_interrupted_reply(tiny_bin):
    rng = np.random.default_rng()
    chat = Chat(Engine.load(tiny_bin, "cpu"), 256)
    prefills = _spy_prefills(chat)
    turn = chat.turn(_message(rng), 20, GREEDY)
    recs = [next(turn) for _ in range(5)]
    turn.close()  # as the CLI does on Ctrl-C
    assert chat.messages[-1] == {"role": "assistant", "content": "".join(r.text for r in recs)}
    assert chat.model.pos == len(chat.cached) and chat.cached[-4:] == recs[-1].tokens[:4]
    _turn(chat, _message(rng), 8, tiny_bin, prefills)


def test_chat_message_past_the_context_is_an_error(tiny_bin):
    from kuiper_py.errors import KuiperError
    chat = Chat(Engine.load(tiny_bin, "cpu"), 24)
    with pytest.raises(KuiperError, match="more than the context"):
        list(chat.turn(" ".join(WORDS * 3), 4, GREEDY))
    assert chat.messages == [] and chat.cached == []


def test_cli_chat_json_lines_reset_and_plain_text(tiny_bin):
    rng = np.random.default_rng()
    a, b = _message(rng), _message(rng)
    lines = f"{a}\n{b}\n/reset\n{a}\n"
    r = run_cli("chat", "-m", tiny_bin, "--device", "cpu", "--temp", "0", "-n", 8, "--json", "-v", input=lines)
    assert r.returncode == 0, r.stderr
    recs = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(recs) == 3 and [x["finish_reason"] for x in recs] == ["length"] * 3
    # the first turn's prompt stays cached; its reply's tokens may not (their text can re-encode to other ids: the
    # cache keeps only the common token prefix)
    assert recs[0]["cached_tokens"] == 0 and recs[1]["cached_tokens"] >= recs[0]["prompt_tokens"]
    assert recs[2]["cached_tokens"] == 0 and recs[2]["tokens"] == recs[0]["tokens"]  # /reset: the same first turn
    assert r.stderr.count("new tokens") == 3 and "conversation reset" in r.stderr
    # the replies as text: each streamed to stdout, then a newline; nothing else on stdout (read as bytes: a reply
    # may hold a carriage return, which text mode's universal newlines would rewrite)
    plain = _run_bytes("chat", "-m", tiny_bin, "--device", "cpu", "--temp", "0", "-n", 8, input=lines.encode())
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == "".join(x["text"] + "\n" for x in recs).encode()
    # a line ending in a backslash continues the message; /exit ends the chat before the rest of the input
    cont = run_cli("chat", "-m", tiny_bin, "--device", "cpu", "--temp", "0", "-n", 8, "--json",
                   input=f"{a[:5]}\\\n{a[5:]}\n/exit\n{b}\n")
    one = [json.loads(x) for x in cont.stdout.splitlines()]
    assert cont.returncode == 0 and len(one) == 1
    assert one[0]["prompt_tokens"] > recs[0]["prompt_tokens"]  # (the message holds a newline the first did not)


def test_cli_chat_errors_are_one_line(tiny_bin):
    def one_line(r, match):
        assert r.returncode == 2, (r.returncode, r.stderr)
        errs = [ln for ln in r.stderr.splitlines() if ln.startswith("kuiper: error")]
        assert len(errs) == 1 and match in errs[0] and "Traceback" not in r.stderr, r.stderr
    one_line(run_cli("chat", "-m", tiny_bin, "--device", "cpu", "--max-context", 16, input=" ".join(WORDS * 3)),
             "more than the context")
    one_line(run_cli("chat", "-m", tiny_bin, "--device", "cpu", "-n", 0, input="hi"), "--max-tokens")
    r = _run_bytes("chat", "-m", tiny_bin, "--device", "cpu", "-n", 4, "--json", input=b"hi\ncaf\xe9\n")
    r.stdout, r.stderr = r.stdout.decode(), r.stderr.decode()
    one_line(r, "UTF-8")
    assert len(r.stdout.splitlines()) == 1  # the turn before the bad line was answered


def test_cli_generate_prompt_not_utf8_is_one_line(tiny_bin):
    """A prompt argument with a byte that is not UTF-8 (Python holds it as a lone surrogate) is the user's error."""
    r = subprocess.run([sys.executable, "-m", "kuiper_py", "generate", "-m", str(tiny_bin), "--device", "cpu",
                        "-n", "2", "-p", b"ab\xffcd"], capture_output=True, text=True, timeout=300,
                       env=child_env())
    errs = [ln for ln in r.stderr.splitlines() if ln.startswith("kuiper: error")]
    assert r.returncode == 2 and len(errs) == 1 and "Unicode" in errs[0] and "internal" not in errs[0], r.stderr
    assert r.stdout == ""


def test_chat_after_its_engine_served_another_prompt(tiny_bin):
    """generate() on the chat's engine resets the model's cache under the chat: the chat's next turn prefills its
    whole conversation again, even where the other prompt left the cache as many positions as the chat had."""
    rng = np.random.default_rng()
    eng = Engine.load(tiny_bin, "cpu")
    chat = Chat(eng, 256)
    prefills = _spy_prefills(chat)
    _turn(chat, _message(rng), 6, tiny_bin, prefills)
    other = rng.integers(0, 151643, len(chat.cached) - 2).tolist()
    list(generate(eng, other, 3, GREEDY, max_context=128, eos_ids=[]))
    assert eng.model.pos == len(chat.cached)  # (a position count alone would not tell)
    recs = _turn(chat, _message(rng), 6, tiny_bin, prefills, reset=True)
    assert recs[-1].cached_tokens == 0 and chat.model.max_context == 256 and len(chat.messages) == 4


def test_cli_chat_ctrl_c_during_a_reply(tiny_bin):
    """Piped input: Ctrl-C while a reply streams ends the chat with exit 130, the reply so far on stdout and its
    JSON record marked interrupted, no traceback."""
    import signal
    p = subprocess.Popen([sys.executable, "-m", "kuiper_py", "chat", "-m", str(tiny_bin), "--device", "cpu", "--temp",
                          "0", "-n", "4000", "--max-context", "4096", "-v"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env())
    p.stdin.write(b"Tell me a long story\nand another\n")
    p.stdin.flush()
    first = p.stdout.read(8)  # some of the reply has streamed: we are in its decode loop
    assert first
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    err = err.decode()
    assert "Traceback" not in err and "finish: interrupted" in err and err.count("new tokens") == 1
    assert (first + out).endswith(b"\n")  # (the reply ended with its newline)


def test_chat_render_encodes_only_new_pieces_and_equals_whole_text(tiny_bin):
    """Chat.render encodes the conversation piece by piece (cut before each <|im_start|>) and keeps the pieces' ids:
    the ids equal the whole text's encoding, for text with multi-byte characters, spaces at the cuts and a literal
    special token inside a message (and a NUL, where it encodes the whole text), and a later render encodes only
    the pieces that are new."""
    eng = Engine.load(tiny_bin, "cpu")
    tok = eng.tokenizer
    texts = ["héllo wörld 你好", " leading space", "tab\tand\nnewline ", "quote <|im_start|>user\nx", "🙂" * 3]
    for extra in ([], [{"role": "user", "content": "a\0b"}]):
        chat = Chat(eng, 256, system="Be brief. é")
        msgs = list(extra)
        for k, t in enumerate(texts):
            msgs.append({"role": "user" if k % 2 == 0 else "assistant", "content": t})
            whole = tok.encode(tok.apply_chat_template([{"role": "system", "content": chat.system}] + msgs))
            assert chat.render(msgs) == whole
    seen, real = [], tok.encode
    tok.encode = lambda text: seen.append(text) or real(text)
    try:
        msgs = msgs[1:] + [{"role": "user", "content": "one more"}]  # (the NUL message gone)
        chat = Chat(eng, 256, system="Be brief. é")
        chat.render(msgs[:-1])
        seen.clear()
        assert chat.render(msgs) == real(tok.apply_chat_template([{"role": "system", "content": chat.system}] + msgs))
    finally:
        tok.encode = real
    assert seen == ["<|im_start|>user\none more<|im_end|>\n"]  # (the generation prompt's piece was known)


def test_prefix_cache_serves_unrelated_requests_as_fresh_generations(tiny_bin):
    """generate.PrefixCache (the server's): each request's records equal a fresh generate()'s, prefilling only
    what follows the prefix shared with the last request (its prompt and the reply tokens fed back)."""
    from kuiper_py.generate import PrefixCache, generate
    eng = Engine.load(tiny_bin, "cpu")
    pc = PrefixCache(eng, 128)
    p = SamplingParams(temperature=0.8, top_k=0, top_p=1.0, seed=9)
    a = [785, 6722, 315, 9625, 374]
    first = list(pc.run(a, 6, p))
    b = a + first[-1].tokens[:3] + [11, 323]  # continues the first request's prompt and part of its reply
    c = [40, 1079, 264]  # unrelated
    for ids, cached in ((b, len(a) + 3), (c, 0), (c + [13], 3), (c[:2], 1)):
        got = list(pc.run(ids, 5, p))
        fresh = list(generate(reference_engine(tiny_bin), ids, 5, p))
        assert [r.token for r in got] == [r.token for r in fresh] and got[-1].text == fresh[-1].text
        assert got[-1].cached_tokens == cached and got[-1].prompt_tokens == len(ids) - cached
    it = pc.run(a, 20, p)  # a consumer that leaves early leaves the cache consistent
    next(it), next(it)
    it.close()
    got = list(pc.run(a + [11], 4, p))
    assert [r.token for r in got] == [r.token for r in generate(reference_engine(tiny_bin), a + [11], 4, p)]


def test_a_reply_parting_without_a_tie_is_caught(tiny_bin):
    """_turn's allowance for a float32 tie does not excuse another token: a fresh reply with one token changed to
    the fresh session's least likely one fails it."""
    eng = reference_engine(tiny_bin)
    ids = eng.tokenizer.encode("The capital of France is")
    want, _ = _fresh_reply(tiny_bin, ids, 6)
    m = eng.session(len(ids) + 6)
    m.reset()
    worst = int(np.argmin(np.asarray(m.prefill(ids + want[:3]))[:eng.n_valid_tokens]))
    with pytest.raises(AssertionError):
        _assert_parted_at_a_tie(tiny_bin, ids, want[:3] + [worst] + want[4:], want)
