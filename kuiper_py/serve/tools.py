"""Qwen3's (Hermes-style) `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` output turned into OpenAI
tool_calls as text streams in. A block whose JSON does not parse, or names no function, stays content."""
from __future__ import annotations

import json
import uuid

from .reasoning import _partial_tail

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def parse_call(body: str) -> dict | None:
    """{"name", "arguments" (a JSON string)} of one block's JSON, or None when it is not a function call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}


class ToolCallParser:
    """push(text) -> (content, calls) with calls as OpenAI tool_call dicts (index, id, type, function);
    finish() flushes. Whitespace-only content next to tool calls is dropped, as it is only the model's
    separator; an unterminated block at the end is content."""

    def __init__(self):
        self.buf, self.ws, self.in_call, self.n_calls = "", "", False, 0

    def _text(self, text: str) -> str:
        """Content out, with trailing whitespace held until something other than a tool call follows."""
        text = self.ws + text
        stripped = text.rstrip()
        self.ws = text[len(stripped):]
        return stripped

    def push(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        content, calls = "", []
        while True:
            if not self.in_call:
                start = self.buf.find(OPEN)
                if start < 0:
                    keep = _partial_tail(self.buf, OPEN)
                    content += self._text(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return content, calls
                before = self.buf[:start]
                if before.strip():
                    content += self._text(before)
                self.ws, self.buf, self.in_call = "", self.buf[start + len(OPEN):], True
            end = self.buf.find(CLOSE)
            if end < 0:
                return content, calls
            body, self.buf, self.in_call = self.buf[:end], self.buf[end + len(CLOSE):], False
            call = parse_call(body)
            if call is None:
                content += self._text(OPEN + body + CLOSE)
            else:
                calls.append({"index": self.n_calls, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                              "function": call})
                self.n_calls += 1

    def finish(self) -> tuple[str, list[dict]]:
        rest = (OPEN if self.in_call else "") + self.buf
        self.buf, self.in_call = "", False
        tail = self.ws + rest if rest else ("" if self.n_calls else self.ws)
        self.ws = ""
        return tail, []
