"""An OpenAI-compatible HTTP server over a :class:`~.scheduler.ServingEngine` (FastAPI).

Scope: HTTP only — request validation, OpenAI request/response shapes, SSE streaming, errors,
and the ``/metrics`` exposition; generation is the engine's.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (prompt: a string or a list of
token ids), both non-streaming and streaming (SSE ``data: {...}`` chunks, then ``data: [DONE]``;
``stream_options.include_usage`` adds a final chunk with ``usage`` and no choices),
``GET /v1/models``, ``GET /health`` (with the engine's load), ``GET /metrics`` (Prometheus text).

Requests are strict: unknown fields, wrong types, an unknown model, an empty prompt, prompt +
max_tokens beyond the context, out-of-range temperature/top_p/top_k/max_tokens or ``n != 1``
answer 400 (404 for an unknown model, as OpenAI does) with OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``; a full queue answers 429. Extensions (the
client's ``extra_body``): ``top_k`` and ``speculate`` (false: plain decoding for this request).
Every ``usage`` carries ``speculative_decoding``: tau, acceptance_by_position, drafted, accepted.

``stop`` strings are matched on the output text: the text ends before the first match, the
request is cancelled in the engine (its slot frees) and finishes with ``"stop"``; streamed text
that could be the start of a stop string is held back until it is decided. A client that
disconnects (or a request task that is cancelled) cancels its engine request, freeing its slot.

Thread-safety: the app runs on one asyncio loop; the engine runs on its own thread and delivers
events to the loop thread-safely (``ServingEngine.submit(..., loop=...)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .scheduler import QueueFull, Request, ServingEngine

# -- request models ------------------------------------------------------------------------------

_STRICT = ConfigDict(extra="forbid", strict=True)
MAX_STOPS = 16
MAX_BODY_BYTES = 4 << 20  # contexts are <= 4096 tokens: far more than any valid request needs


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = None


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]  # text parts are joined
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class _Common(BaseModel):
    model_config = _STRICT
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    seed: int | None = Field(default=None, ge=-(2 ** 63), le=2 ** 63 - 1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(default=1, ge=1, le=1)
    user: str | None = None
    speculate: bool | None = True


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(_Common):
    prompt: str | list[int]


# -- errors --------------------------------------------------------------------------------------

class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[A-Z]\w*)$")
_HINTS = {"prompt": "prompt must be a non-empty string or a list of token ids (integers)",
          "messages": "messages must be a non-empty list of {role: system|user|assistant, content: a string "
                      "or a list of {type: text, text}}",
          "stop": "stop must be a string or a list of strings"}


def _validation_error(e: ValidationError | RequestValidationError) -> APIError:
    errs = e.errors()
    first = errs[0] if errs else {"loc": (), "msg": str(e), "type": "value_error"}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    loc = [x for x in loc if not _UNION_TAG.match(x)]  # pydantic's union-member tags
    param = ".".join(loc) or None
    kind = first.get("type")
    if kind == "extra_forbidden":
        msg = f"unknown field {param!r}"
    elif kind == "missing":
        msg = f"{param!r} is required"
    elif loc and loc[0] in _HINTS:
        msg = _HINTS[loc[0]] + (f" ({param}: {first.get('msg')})" if len(errs) == 1 else "")
    else:
        msg = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return APIError(400, msg, param=param, code=kind)


def _engine_error(msg: str) -> APIError:
    param = ("max_tokens" if "max_new_tokens" in msg else "prompt" if "prompt" in msg else
             next((p for p in ("temperature", "top_p", "top_k", "seed") if msg.startswith(p)), None))
    return APIError(400, msg.replace("max_new_tokens", "max_tokens"), param=param)


# -- stop strings --------------------------------------------------------------------------------

class _StopMatcher:
    """Text deltas with stop strings cut out: :meth:`feed` returns the text safe to emit and
    whether a stop string was found (the text then ends before it)."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self.text = ""
        self.sent = 0
        self.stopped = False

    def feed(self, delta: str) -> str:
        if self.stopped:
            return ""
        self.text += delta
        if not self.stops:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out
        start = max(0, self.sent - self.longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            cut = min(hits)
            out = self.text[self.sent:cut]
            self.text, self.sent, self.stopped = self.text[:cut], cut, True
            return out
        hold = 0  # the longest tail that may still grow into a stop string
        for k in range(min(self.longest - 1, len(self.text) - self.sent), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                hold = k
                break
        end = len(self.text) - hold
        out, self.sent = self.text[self.sent:end], end
        return out

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


# -- the app -------------------------------------------------------------------------------------

def _usage(prompt_tokens: int, completion_tokens: int, stats: dict | None) -> dict:
    stats = stats or {}
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "speculative_decoding": {"tau": stats.get("tau", 0.0),
                                     "acceptance_by_position": stats.get("acceptance_by_position", []),
                                     "drafted": stats.get("drafted", 0), "accepted": stats.get("accepted", 0)}}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Run:
    """One engine request as the HTTP side sees it: text deltas (stop strings applied), then the
    finish reason, completion tokens and the engine's stats. Cancels the engine request when the
    client disconnects, when it is abandoned, or when a stop string ends it."""

    def __init__(self, engine: ServingEngine, http: HTTPRequest, req: Request, stops: list[str], metrics=None):
        self.engine, self.http, self.req, self.metrics = engine, http, req, metrics
        self.matcher = _StopMatcher(stops)
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.stats: dict | None = None
        self.error: str | None = None
        self.handle = None

    def submit(self) -> None:
        try:
            self.handle = self.engine.submit(self.req, loop=asyncio.get_running_loop())
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_exceeded", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from None
        except ValueError as e:
            raise _engine_error(str(e)) from None
        except RuntimeError as e:  # the engine is closed
            raise APIError(503, str(e), type="server_error", code="service_unavailable") from None

    async def _watch_disconnect(self) -> None:
        try:
            while (await self.http.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # the connection is gone in some other way
            pass
        self.handle.cancel()

    async def deltas(self):
        """Text deltas (possibly empty strings are skipped); sets the finish fields at the end."""
        watcher = asyncio.ensure_future(self._watch_disconnect())
        try:
            async for ev in self.handle.aiter():
                self.completion_tokens += len(ev.token_ids)
                if ev.stats is not None:
                    self.stats = ev.stats
                text = self.matcher.feed(ev.text) if ev.text else ""
                if self.matcher.stopped and self.finish_reason is None:
                    # a stop string: end it in the engine now (the next events drain one step)
                    self.finish_reason = "stop"
                    if ev.finish_reason is None:
                        self.handle.cancel()
                if ev.finish_reason is not None:
                    if ev.finish_reason == "error":
                        self.error = ev.error or "generation failed"
                    if self.finish_reason is None:
                        self.finish_reason = ev.finish_reason
                        text += self.matcher.flush()
                if text:
                    yield text
        finally:
            watcher.cancel()
            if self.handle is not None and not self.handle.finished.is_set():
                self.handle.cancel()
            if self.metrics is not None:
                reason = self.finish_reason if self.finish_reason in ("stop", "length", "error") else "cancelled"
                self.metrics.completions.labels(finish_reason=reason).inc()
        if self.stats is not None:
            self.completion_tokens = self.stats.get("new_tokens", self.completion_tokens)


class _EngineStream(StreamingResponse):
    """A streaming response that cancels its engine request however the response ends, even when
    the client is gone before the first chunk (the body iterator then never starts)."""

    def __init__(self, content, handle, **kw):
        super().__init__(content, **kw)
        self.handle = handle

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.handle.finished.is_set():
                self.handle.cancel()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


class _CountResponses:
    """ASGI middleware counting responses by path and status (a plain ASGI wrapper: Starlette's
    BaseHTTPMiddleware would get in the way of streaming and of disconnect detection)."""

    PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        path = path if path in self.PATHS else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.http_responses.labels(path=path, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(engine: ServingEngine, model_name: str, metrics=None) -> FastAPI:
    """The FastAPI app serving ``engine`` as model ``model_name``; ``metrics`` (a
    :class:`~.metrics.PrometheusMetrics`, normally also passed to the engine) backs ``/metrics``."""
    app = FastAPI(title="specfoundry", docs_url=None, redoc_url=None, openapi_url=None)
    if metrics is not None:
        app.add_middleware(_CountResponses, metrics=metrics)
    app.state.engine, app.state.model_name, app.state.metrics = engine, model_name, metrics
    target = engine.target
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _req_validation(_, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    async def parse(http: HTTPRequest, model: type[BaseModel]):
        too_big = APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code="body_too_large")
        declared = http.headers.get("content-length") or "0"
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise too_big
        chunks, size = [], 0
        async for part in http.stream():
            size += len(part)
            if size > MAX_BODY_BYTES:
                raise too_big
            chunks.append(part)
        raw = b"".join(chunks)
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        except RecursionError:
            raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            body = model.model_validate_json(raw)
        except ValidationError as e:
            raise _validation_error(e) from None
        if body.model != model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(s == "" for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        if len(stops) > MAX_STOPS:
            raise APIError(400, f"at most {MAX_STOPS} stop strings", param="stop")
        return body, stops

    def engine_request(body, prompt_ids: list[int], max_tokens: int | None) -> Request:
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if max_tokens is None:  # until the context is full (OpenAI's chat default)
            max_tokens = max(1, engine.max_context - len(prompt_ids))
        # (the engine treats a temperature below 1e-5 as greedy and floors top_p: float32-safe)
        temperature = 0.0 if body.temperature is None else float(body.temperature)
        top_p = None if body.top_p is None else float(body.top_p)
        return Request(prompt_ids=prompt_ids, max_new_tokens=max_tokens, temperature=temperature,
                       top_k=body.top_k, top_p=top_p, seed=body.seed, speculate=body.speculate is not False)

    async def respond(http: HTTPRequest, body, req: Request, stops: list[str], chat: bool):
        run = _Run(engine, http, req, stops, metrics)
        run.submit()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        now = int(time.time())
        n_prompt = len(req.prompt_ids)
        obj = "chat.completion" if chat else "text_completion"

        def choice(text: str | None, finish: str | None, first: bool = False) -> dict:
            if chat:
                delta = {} if text is None else ({"role": "assistant", "content": text} if first else {"content": text})
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

        if not body.stream:
            try:
                parts = [t async for t in run.deltas()]
            except asyncio.CancelledError:
                run.handle.cancel()
                raise
            if run.error is not None:
                raise APIError(500, f"generation failed: {run.error}", type="server_error")
            if run.finish_reason == "cancelled":
                raise APIError(503, "the request was cancelled (the server is shutting down)", type="server_error",
                               code="service_unavailable")
            text = "".join(parts)
            ch = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": run.finish_reason} if chat else
                  {"index": 0, "text": text, "logprobs": None, "finish_reason": run.finish_reason})
            return JSONResponse({"id": rid, "object": obj, "created": now, "model": model_name, "choices": [ch],
                                 "usage": _usage(n_prompt, run.completion_tokens, run.stats)})

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, usage=None) -> str:
            c = {"id": rid, "object": chunk_obj, "created": now, "model": model_name, "choices": choices}
            if include_usage:
                c["usage"] = usage
            return _sse(c)

        async def stream():
            try:
                if chat:
                    yield chunk([choice("", None, first=True)])
                async with contextlib.aclosing(run.deltas()) as deltas:  # closed however this ends
                    async for text in deltas:
                        yield chunk([choice(text, None)])
                if run.error is not None:
                    yield _sse(APIError(500, f"generation failed: {run.error}", type="server_error").body())
                elif run.finish_reason == "cancelled":
                    yield _sse(APIError(503, "the request was cancelled (the server is shutting down)",
                                        type="server_error", code="service_unavailable").body())
                else:
                    yield chunk([choice(None, run.finish_reason)])
                    if include_usage:
                        yield chunk([], _usage(n_prompt, run.completion_tokens, run.stats))
                yield "data: [DONE]\n\n"
            finally:
                if run.handle is not None and not run.handle.finished.is_set():
                    run.handle.cancel()

        return _EngineStream(stream(), run.handle, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        body, stops = await parse(http, ChatCompletionRequest)
        if target.tokenizer is None:
            raise APIError(400, "this model has no tokenizer (and no chat template): use /v1/completions with "
                                "the prompt as a list of token ids", param="messages")
        try:
            ids = target.encode_chat([{"role": m.role, "content": m.text()} for m in body.messages])
        except Exception as e:  # a template that rejects this conversation
            raise APIError(400, f"could not apply the chat template: {e}", param="messages") from None
        if body.max_tokens is not None and body.max_completion_tokens is not None \
                and body.max_tokens != body.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens disagree; send one", param="max_tokens")
        mt = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await respond(http, body, engine_request(body, ids, mt), stops, chat=True)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        body, stops = await parse(http, CompletionRequest)
        if isinstance(body.prompt, str):
            if body.prompt == "":
                raise APIError(400, "the prompt is empty", param="prompt")
            if target.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as a list of token ids",
                               param="prompt")
            ids = list(target.tokenizer(body.prompt)["input_ids"])
        else:
            ids = list(body.prompt)
        mt = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's completions default
        return await respond(http, body, engine_request(body, ids, mt), stops, chat=False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "specfoundry", "max_model_len": engine.max_context}]}

    @app.get("/health")
    async def health():
        thread = getattr(engine, "_thread", None)
        ok = (thread is None or thread.is_alive()) and not getattr(engine, "_stop", False)
        return JSONResponse({"status": "ok" if ok else "unavailable", "model": model_name, **engine.load()},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_endpoint():
        if metrics is None:
            raise APIError(404, "metrics are not enabled on this server", type="not_found")
        metrics.observe_load(engine.load())
        return Response(metrics.render(), media_type=metrics.content_type)

    return app
