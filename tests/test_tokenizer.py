"""Tokenizer built from qwen.tiktoken: ids, round trips, chat template, streaming detokenization."""
import pytest

from kuiper_py.generate import held_back
from kuiper_py.loader import load
from kuiper_py.tokenizer import ChatTokenizer, StreamDecoder

TEXTS = [
    "The capital of France is",
    "héllo wörld — naïve café",
    "你好，世界！今天天气很好。",
    "こんにちは、元気ですか？ 한국어도 됩니다.",
    "Здравствуй, мир! Ελληνικά. العربية עברית",
    "emoji 🤖👍🏽🇫🇷 👨‍👩‍👧‍👦 and ZWJ",
    "code:\n\tdef f(x):\n        return x ** 2  # spaces   \n\n\n",
    "numbers 1234567890 3.14159 -42",
]


@pytest.fixture(scope="module")
def tok(tiny_bin):
    return ChatTokenizer(load(tiny_bin).trailer)


def test_known_ids(tok):
    assert tok.encode("The capital of France is") == [785, 6722, 315, 9625, 374]
    assert tok.vocab_size == 151669
    assert tok.token_id("<|im_end|>") == 151645 and tok.token_id("</think>") == 151668


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_tiktoken_agreement(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids == _tiktoken().encode(text, disallowed_special=())


def _tiktoken():
    """The BPE ranks run by tiktoken itself: an encoder independent of our tokenizer.json conversion."""
    tiktoken = pytest.importorskip("tiktoken")
    import base64
    from kuiper_py.synth import QWEN_PATTERN, find_qwen_tiktoken
    ranks = {base64.b64decode(a): int(b) for a, b in
             (line.split() for line in find_qwen_tiktoken().read_text().splitlines() if line)}
    return tiktoken.Encoding("qwen-ref", pat_str=QWEN_PATTERN, mergeable_ranks=ranks, special_tokens={})


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert tok.apply_chat_template(msgs) == \
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs[1:], enable_thinking=False) == \
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ids = tok.encode(tok.apply_chat_template(msgs[1:]))
    assert ids[0] == 151644 and ids.count(151645) == 1


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decoder_never_emits_broken_utf8(tok, text):
    ids = tok.encode(text)
    d = StreamDecoder(tok)
    pieces = [d.push(i) for i in ids]
    pieces.append(d.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_emoji_split_over_byte_tokens_is_held_back(tok):
    ch = "\U00013000"  # EGYPTIAN HIEROGLYPH A001: 4 UTF-8 bytes, no merged token
    ids = tok.encode(ch)
    assert len(ids) > 1  # one character, several byte-level tokens
    d = StreamDecoder(tok)
    assert [d.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.push(ids[-1]) == ch


def test_stop_string_hold_back():
    assert held_back("hello wor", ["world"]) == 3
    assert held_back("hello", ["xyz"]) == 0
    assert held_back("a<", ["<|im_end|>", "<stop>"]) == 1
