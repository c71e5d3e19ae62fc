"""The server's output parsers on crafted model output (synthetic models emit random text): Qwen3's <think> split
and <tool_call> blocks, fed whole and in every two-way and random many-way split, which must give the same result."""
import json
import random

import pytest

from kuiper_py.serve.reasoning import ReasoningParser, prompt_opens_thinking
from kuiper_py.serve.tools import ToolCallParser


def _reason(text, pieces, in_think=False):
    p = ReasoningParser(in_think)
    r = c = ""
    for piece in pieces:
        a, b = p.push(piece)
        r, c = r + a, c + b
    a, b = p.finish()
    return r + a, c + b


def _splits(text, rng):
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(5, len(text) + 1)))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("text,in_think,want", [
    ("<think>\nplan it\n</think>\n\nThe answer.", False, ("\nplan it\n", "\n\nThe answer.")),
    ("  <think>x</think>y", False, ("x", "y")),
    ("No thinking here.", False, ("", "No thinking here.")),
    ("<thin", False, ("", "<thin")),
    ("<think>cut off before the end", False, ("cut off before the end", "")),
    ("reasoning the prompt opened</think>answer", True, ("reasoning the prompt opened", "answer")),
    ("a </thin b", True, ("a </thin b", "")),
    ("answer <think>not at the start</think>", False, ("", "answer <think>not at the start</think>")),
])
def test_reasoning_split_same_in_any_pieces(text, in_think, want):
    rng = random.Random(hash(text) & 0xFFFF)
    for pieces in _splits(text, rng):
        assert _reason(text, pieces, in_think) == want, pieces


def test_prompt_opens_thinking():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


def _tools(pieces):
    p = ToolCallParser()
    content, calls = "", []
    for piece in pieces:
        c, k = p.push(piece)
        content, calls = content + c, calls + k
    c, k = p.finish()
    return content + c, calls


def _strip_ids(calls):
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)
    return [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("text,want_content,want_calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>', "",
     [(0, "get_weather", {"city": "Paris", "days": 2})]),
    ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
     '{"name": "b", "arguments": {"x": [1, "é"]}}\n</tool_call>', "Let me check.",
     [(0, "a", {}), (1, "b", {"x": [1, "é"]})]),
    ('<tool_call>\n{"name": "a", "arguments": {"x": 1}\n</tool_call>', '<tool_call>\n{"name": "a", "arguments": '
     '{"x": 1}\n</tool_call>', []),
    ('<tool_call>["not", "a", "call"]</tool_call>', '<tool_call>["not", "a", "call"]</tool_call>', []),
    ('<tool_call>\n{"name": "a", "arguments"', '<tool_call>\n{"name": "a", "arguments"', []),
    ("plain answer\n", "plain answer\n", []),
    ("a < b and <tool_ca", "a < b and <tool_ca", []),
])
def test_tool_calls_same_in_any_pieces(text, want_content, want_calls):
    rng = random.Random(len(text))
    for pieces in _splits(text, rng):
        content, calls = _tools(pieces)
        assert content == want_content, pieces
        assert _strip_ids(calls) == want_calls, pieces


def test_tool_call_arguments_given_as_a_string_stay_that_string():
    content, calls = _tools(['<tool_call>{"name": "f", "arguments": "{\\"q\\": 1}"}</tool_call>'])
    assert content == "" and calls[0]["function"]["arguments"] == '{"q": 1}'
