"""The FastAPI routes: OpenAI's /v1/chat/completions, /v1/completions and /v1/models, vLLM's /tokenize, /health
and /metrics. Handlers validate and tokenize on the event loop, then hand a Job to the engine thread and read its
records from an asyncio queue, so the loop never waits on the model."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import KuiperError
from ..sampling import SamplingParams
from .engine_worker import EngineWorker, Job, QueueFull, ShuttingDown
from .protocol import ChatRequest, CompletionRequest, TokenizeRequest
from .reasoning import ReasoningParser, prompt_opens_thinking
from .tools import ToolCallParser


ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/health", "/metrics")


class ApiError(Exception):
    """An OpenAI-style error answer: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None,
                 code: str | int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers, self.code = status, message, param, headers, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else \
            "service_unavailable" if self.status == 503 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code or self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    @classmethod
    def of(cls, e: Exception) -> "ApiError":
        """What a request that failed with e answers (as a response, or as a stream's last event)."""
        if isinstance(e, ApiError):
            return e
        if isinstance(e, ShuttingDown):
            return cls(503, "the server is shutting down")
        if isinstance(e, KuiperError):  # (what the request's content made the engine refuse)
            return cls(400, str(e))
        return cls(500, f"internal error: {type(e).__name__}: {e}")


class _CountRequests:
    """Counts each answer by endpoint and status. A plain ASGI wrapper: unlike @app.middleware("http") it passes
    `receive` through untouched, so request.is_disconnected() sees a client that left."""

    def __init__(self, app, counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in ENDPOINTS else "other"  # (bounded label values)

        async def counted(message):
            if message["type"] == "http.response.start":
                self.counter.labels(path, str(message["status"])).inc()
            await send(message)
        await self.app(scope, receive, counted)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first problem pydantic found, as 'field.path: what is wrong'."""
    err = (exc.errors() or [{}])[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    path = ".".join(loc)
    return (f"{path}: {err.get('msg', 'invalid')}" if path else str(err.get("msg", "invalid request"))), path or None


def create_app(worker: EngineWorker, served_name: str) -> FastAPI:
    app = FastAPI(title="kuiper", docs_url=None, redoc_url=None, openapi_url=None)
    m = worker.metrics

    app.add_middleware(_CountRequests, counter=m.requests)

    async def answer(_: Request, exc: Exception):
        return ApiError.of(exc).response()

    for kind in (ApiError, KuiperError, ShuttingDown, Exception):
        app.add_exception_handler(kind, answer)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, exc: RequestValidationError):
        return ApiError(400, *_validation_message(exc)).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        return ApiError(exc.status_code, str(exc.detail)).response()

    @app.get("/health")
    async def health():
        if worker.error:
            raise ApiError(503, f"the model failed to load: {worker.error}")
        if not worker.ready.is_set():
            raise ApiError(503, "the model is loading", headers={"Retry-After": "1"})
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(m.render(), media_type=m.content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "kuiper", "max_model_len": worker.max_context or None}]}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        _ready(worker)
        _check_model(req.model, served_name)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages")
        ids = _chat_ids(worker, req, None)[0] if req.messages is not None else \
            worker.engine.tokenizer.encode(req.prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": worker.max_context}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        _ready(worker)
        _check_model(req.model, served_name)
        _check_common(req)
        if not req.messages:
            raise ApiError(400, "messages must not be empty", "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if req.tool_choice not in (None, "auto", "none"):  # (forcing a call needs constrained decoding)
            raise ApiError(400, f"tool_choice {req.tool_choice!r} is not supported: only 'auto' and 'none' (the "
                                f"model decides whether to call a tool)", "tool_choice")
        tools_on = bool(req.tools) and req.tool_choice != "none"
        ids, prompt_text = _chat_ids(worker, req, tools_on)
        max_tokens = _max_tokens(worker, len(ids), req.max_completion_tokens or req.max_tokens)
        k = (req.top_logprobs or 0) if req.logprobs else None
        out = _Output(ReasoningParser(prompt_opens_thinking(prompt_text)), ToolCallParser() if tools_on else None)
        job = _job(worker, req, ids, max_tokens, k)
        if req.stream:
            return StreamingResponse(_chat_stream(worker, job, out, served_name, req), media_type="text/event-stream",
                                     background=BackgroundTask(job.cancelled.set))
        return await _chat_whole(worker, job, out, served_name, request)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        _ready(worker)
        _check_model(req.model, served_name)
        _check_common(req)
        if req.echo:
            raise ApiError(400, "echo is not supported", "echo")
        ids = _prompt_ids(worker, req.prompt)
        max_tokens = _max_tokens(worker, len(ids), req.max_tokens if req.max_tokens is not None else 16)
        job = _job(worker, req, ids, max_tokens, req.logprobs)
        if req.stream:
            return StreamingResponse(_completion_stream(worker, job, served_name, req),
                                     media_type="text/event-stream", background=BackgroundTask(job.cancelled.set))
        return await _completion_whole(worker, job, served_name, request)

    return app


# ---- request checks ---------------------------------------------------------------------------------------------

def _ready(worker: EngineWorker) -> None:
    if worker.error:
        raise ApiError(503, f"the model failed to load: {worker.error}")
    if not worker.ready.is_set():
        raise ApiError(503, "the model is loading", headers={"Retry-After": "1"})
    if not worker.accepting:
        raise ApiError(503, "the server is shutting down")


def _check_model(name: str | None, served: str) -> None:
    """As vLLM: a request may leave the model out; a name other than the served one is a 404."""
    if name is not None and name != served:
        raise ApiError(404, f"the model `{name}` does not exist (this server serves `{served}`)", "model",
                       code="model_not_found")


def _check_common(req) -> None:
    if req.n != 1:
        raise ApiError(400, f"n = {req.n}: only one choice per request is supported", "n")
    if any(not s for s in req.stop_list()):
        raise ApiError(400, "stop strings must not be empty", "stop")


def _chat_ids(worker: EngineWorker, req, tools_on: bool | None) -> tuple[list[int], str]:
    """The conversation through the checkpoint's chat template: (ids, text)."""
    tok = worker.engine.tokenizer
    kwargs = dict(req.chat_template_kwargs or {})
    think = kwargs.pop("enable_thinking", None)
    if think is not None and not isinstance(think, bool):
        raise ApiError(400, "chat_template_kwargs.enable_thinking must be a boolean", "chat_template_kwargs")
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if (req.tools and tools_on is not False) else None
    if tools and not tok.template_knows_tools:
        raise ApiError(400, "this model's chat template does not take tools", "tools")
    try:
        text = tok.apply_chat_template([msg.template_dict() for msg in req.messages], enable_thinking=think,
                                       tools=tools, extra=kwargs)
    except KuiperError as e:
        raise ApiError(400, str(e), "messages") from None
    return tok.encode(text), text


def _prompt_ids(worker: EngineWorker, prompt) -> list[int]:
    """A completion's prompt: text, one text in a list, or token ids."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise ApiError(400, f"{len(prompt)} prompts: only one prompt per request is supported", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = worker.engine.tokenizer.encode(prompt)
    else:
        V = worker.engine.n_valid_tokens
        if not all(0 <= t < V for t in prompt):
            raise ApiError(400, f"prompt token ids must be in 0..{V - 1}", "prompt")
        ids = list(prompt)
    if not ids:
        raise ApiError(400, "the prompt is empty", "prompt")
    return ids


def _max_tokens(worker: EngineWorker, n_prompt: int, asked: int | None) -> int:
    """The tokens a request may generate; as vLLM, a prompt and max_tokens beyond the context are a 400, and a
    request that names none gets the rest of the context."""
    ctx = worker.max_context
    if n_prompt >= ctx:
        raise ApiError(400, f"the prompt has {n_prompt} tokens; this server's context is {ctx} tokens "
                            f"(prompt and completion together)", "messages")
    if asked is None:
        return ctx - n_prompt
    if n_prompt + asked > ctx:
        raise ApiError(400, f"the prompt's {n_prompt} tokens and max_tokens {asked} exceed this server's context of "
                            f"{ctx} tokens", "max_tokens")
    return asked


def _params(worker: EngineWorker, req) -> SamplingParams:
    """The request's sampling over the checkpoint's generation_config defaults."""
    gen = (worker.engine.file.trailer or {}).get("generation_config")
    top_k = None if req.top_k is None else max(req.top_k, 0)  # (vLLM's -1 = off)
    try:
        return SamplingParams.from_generation_config(
            gen, temperature=req.temperature, top_k=top_k, top_p=req.top_p, min_p=req.min_p,
            repeat_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, seed=None if req.seed is None else req.seed % 2**64)
    except KuiperError as e:
        raise ApiError(400, str(e).lstrip("-").replace("--", "")) from None


def _job(worker: EngineWorker, req, ids: list[int], max_tokens: int, logprobs: int | None) -> Job:
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    job = Job(ids, max_tokens, _params(worker, req), lambda item: loop.call_soon_threadsafe(q.put_nowait, item),
              req.stop_list(), logprobs, [] if req.ignore_eos else None, queue=q)
    try:
        worker.submit(job)
    except QueueFull:
        raise ApiError(503, "the server is busy: the request queue is full; retry later",
                       headers={"Retry-After": "1"}) from None
    except ShuttingDown:
        raise ApiError(503, "the server is shutting down") from None
    return job


async def _records(job: Job, request: Request | None = None):
    """The job's records as they come; a client that leaves (checked every half second, whether tokens flow or
    not) cancels the job."""
    next_check = time.monotonic() + 0.5
    try:
        while True:
            try:
                item = await asyncio.wait_for(job.queue.get(), 0.5)
            except asyncio.TimeoutError:
                item = _WAITING
            if request is not None and time.monotonic() >= next_check:
                if await request.is_disconnected():
                    return
                next_check = time.monotonic() + 0.5
            if item is _WAITING:
                continue
            if item is None:
                return
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        job.cancelled.set()  # (a no-op once the job ended; else it stops at the next token)


_WAITING = object()  # (no record within the wait)


# ---- responses --------------------------------------------------------------------------------------------------

class _Output:
    """A chat reply's text split into reasoning, content and tool calls as it streams (parsers in sequence)."""

    def __init__(self, reasoning: ReasoningParser, tools: ToolCallParser | None):
        self.reasoning, self.tools, self.n_calls = reasoning, tools, 0

    def delta(self, text: str, final: bool = False) -> dict:
        """The message delta for the next piece of text (final: also what the parsers held back)."""
        r, c = self.reasoning.push(text)
        if final:
            r2, c2 = self.reasoning.finish()
            r, c = r + r2, c + c2
        calls: list[dict] = []
        if self.tools is not None:
            c, calls = self.tools.push(c)
            if final:
                c += self.tools.finish()[0]
        self.n_calls += len(calls)
        d = {}
        if r:
            d["reasoning_content"] = r
        if c:
            d["content"] = c
        if calls:
            d["tool_calls"] = calls
        return d


def _finish_reason(r, out: _Output | None = None) -> str:
    if out is not None and out.n_calls:
        return "tool_calls"
    return "stop" if r.finish_reason == "stop" else "length"


def _usage(job: Job, r) -> dict:
    n = r.gen_tokens if r is not None else 0
    cached = r.cached_tokens if r is not None else 0
    return {"prompt_tokens": len(job.ids), "completion_tokens": n, "total_tokens": len(job.ids) + n,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _extension(job: Job) -> dict:
    """kuiper's own response field, which the openai client keeps as an extra: a speculative reply's guesses."""
    return {} if job.spec_stats is None else {"kuiper": {"speculative": job.spec_stats.as_dict()}}


def _chat_logprob(worker: EngineWorker, r) -> dict:
    tok = worker.engine.tokenizer

    def entry(i, lp):
        s = tok.decode([i])
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
    lp, top = r.logprob
    return {**entry(r.token, lp), "top_logprobs": [entry(i, v) for i, v in top]}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _collect(job: Job, request: Request) -> tuple[str, list, object]:
    """A non-streamed request's (text, records with logprobs, last record); a job's error is raised as is."""
    recs = [r async for r in _records(job, request)]
    if not recs:
        raise ApiError(503, "the request was cancelled")
    return "".join(r.text for r in recs), [r for r in recs if r.logprob is not None and r.token is not None], recs[-1]


async def _chat_whole(worker: EngineWorker, job: Job, out: _Output, name: str, request: Request):
    text, recs, last = await _collect(job, request)
    lps = [_chat_logprob(worker, r) for r in recs]
    d = out.delta(text, final=True)
    msg = {"role": "assistant", "content": d.get("content") if (d.get("content") or not d.get("tool_calls")) else None,
           "reasoning_content": d.get("reasoning_content"), "tool_calls": d.get("tool_calls", [])}
    if msg["content"] is None and not msg["tool_calls"]:
        msg["content"] = ""
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": name, "choices": [{"index": 0, "message": msg, "finish_reason": _finish_reason(last, out),
                                        "logprobs": {"content": lps} if job.logprobs is not None else None}],
            "usage": _usage(job, last), **_extension(job)}


async def _chat_stream(worker: EngineWorker, job: Job, out: _Output, name: str, req: ChatRequest):
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": name}
    usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(delta: dict, reason=None, lps=None):
        c = {"index": 0, "delta": delta, "finish_reason": reason}
        if job.logprobs is not None:
            c["logprobs"] = {"content": lps} if lps else None
        return _sse({**head, "choices": [c], **({"usage": None} if usage else {})})

    yield chunk({"role": "assistant", "content": ""})
    last, lps = None, []
    try:
        async for r in _records(job):
            last = r
            if r.logprob is not None and r.token is not None:
                lps.append(_chat_logprob(worker, r))
            d = out.delta(r.text, final=r.finish_reason is not None)
            if d or (lps and r.finish_reason is None):
                yield chunk(d, lps=lps)
                lps = []
        if last is None:
            return
        yield chunk({}, _finish_reason(last, out), lps)
        if usage:
            yield _sse({**head, "choices": [], "usage": _usage(job, last), **_extension(job)})
    except Exception as e:  # noqa: BLE001 - the headers are sent: the error goes in the stream, as vLLM's does
        yield _sse(ApiError.of(e).body())
    yield "data: [DONE]\n\n"


def _completion_logprobs(worker: EngineWorker, records, text_start: int = 0) -> dict:
    tok = worker.engine.tokenizer
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    off = text_start
    for r in records:
        s = tok.decode([r.token])
        lp, top = r.logprob
        out["tokens"].append(s)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append({tok.decode([i]): v for i, v in top})
        out["text_offset"].append(off)
        off += len(s)
    return out


async def _completion_whole(worker: EngineWorker, job: Job, name: str, request: Request):
    text, recs, last = await _collect(job, request)
    lp = _completion_logprobs(worker, recs) if job.logprobs is not None else None
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": name, "choices": [{"index": 0, "text": text, "logprobs": lp,
                                        "finish_reason": _finish_reason(last)}],
            "usage": _usage(job, last), **_extension(job)}


async def _completion_stream(worker: EngineWorker, job: Job, name: str, req: CompletionRequest):
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": name}
    usage = bool(req.stream_options and req.stream_options.include_usage)
    last, recs, off = None, [], 0
    try:
        async for r in _records(job):
            last = r
            if r.logprob is not None and r.token is not None:
                recs.append(r)
            if r.text or recs:
                lp = _completion_logprobs(worker, recs, off) if job.logprobs is not None else None
                yield _sse({**head, "choices": [{"index": 0, "text": r.text, "logprobs": lp,
                                                 "finish_reason": None}]})
                off, recs = off + len(r.text), []
        if last is None:
            return
        yield _sse({**head, "choices": [{"index": 0, "text": "", "logprobs": None,
                                         "finish_reason": _finish_reason(last)}]})
        if usage:
            yield _sse({**head, "choices": [], "usage": _usage(job, last), **_extension(job)})
    except Exception as e:  # noqa: BLE001 - the headers are sent: the error goes in the stream, as vLLM's does
        yield _sse(ApiError.of(e).body())
    yield "data: [DONE]\n\n"
