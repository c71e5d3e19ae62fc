"""Qwen3's `<think>...</think>` split from the answer as text streams in (what vLLM's qwen3 reasoning parser
returns as reasoning_content). The same pushes give the same split whether the text comes in one piece or many."""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether the rendered prompt ends inside an open think block (templates that start the reasoning)."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest tail of text that is a proper prefix of tag (it may still become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """push(text) -> (reasoning, content) pieces; finish() flushes what was held back. Reasoning is the text
    after a leading <think> (or from the start when the prompt opened the block) up to </think>; an output that
    never closes the block is all reasoning; one that does not start with <think> is all content."""

    def __init__(self, in_think: bool = False):
        self.state = "think" if in_think else "start"
        self.buf = ""

    def push(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(OPEN):
                    self.buf, self.state = head[len(OPEN):], "think"
                    continue
                if OPEN.startswith(head):  # (still might become the tag: wait)
                    return reasoning, content
                self.state = "content"
                continue
            if self.state == "think":
                end = self.buf.find(CLOSE)
                if end >= 0:
                    reasoning += self.buf[:end]
                    self.buf, self.state = self.buf[end + len(CLOSE):], "content"
                    continue
                keep = _partial_tail(self.buf, CLOSE)
                reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return reasoning, content
            content += self.buf
            self.buf = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        return (rest, "") if self.state == "think" else ("", rest)
