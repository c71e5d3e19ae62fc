"""The request bodies of the OpenAI API as pydantic models (what vLLM's server accepts, less what kuiper lacks).

Unknown fields are ignored, as OpenAI's and vLLM's servers do; a known field of the wrong type or out of range is a
400 naming it."""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: Union[str, dict] = "{}"


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def template_dict(self) -> dict:
        """The message as chat templates read it: text content, tool calls with their function."""
        text = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(p.text for p in self.content)
        d = {"role": "system" if self.role == "developer" else self.role, "content": text or ""}
        if self.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": c.type, "function": c.function.model_dump()}
                               for c in self.tool_calls]
        for k in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Sampling(_Body):
    """Fields both endpoints take; None means the checkpoint's generation_config (as `kuiper generate`)."""
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, lt=1, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int = Field(1, ge=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: StrictBool = False  # (vLLM's: generate max_tokens whatever the model says, for benchmarks)

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(_Sampling):
    messages: list[Message]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None
    chat_template_kwargs: dict | None = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: StrictBool = False


class TokenizeRequest(_Body):
    """vLLM's /tokenize: the ids a prompt or a conversation (through the chat template) becomes."""
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict | None = None
