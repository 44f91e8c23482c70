"""The HTTP server: OpenAI's completion endpoints over one `Engine`, with /health and Prometheus /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import Callable

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException

from s3d_jax import api
from s3d_jax.metrics import acceptance_per_depth, tokens_per_iteration
from s3d_jax.options import SEED_LIMIT
from s3d_jax.serve import protocol
from s3d_jax.serve.engine import Engine, QueueFull
from s3d_jax.serve.request import Delta, Request

RETRY_AFTER_SECONDS = 1
DISCONNECT_POLL_SECONDS = 0.25


@dataclasses.dataclass(frozen=True)
class Defaults:
    """What a request leaves unset: the server's command line."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


def max_prompt_chars(engine: Engine) -> int:
    """The most characters of text a full context window can hold: `max_len` tokens of the vocabulary's
    longest entry. An entry is at least as long as the text it decodes to (byte-level entries spell
    each byte with one character), so a longer text cannot fit."""
    return engine.max_len * max(map(len, engine.model.tokenizer.get_vocab()))


def default_max_request_bytes(prompt_chars: int) -> int:
    """The largest body a full window can need, with room to spare: `prompt_chars` characters, each
    JSON-escaped at up to 12 bytes, and 1 MiB for the rest."""
    return prompt_chars * 12 + (1 << 20)


class Refused(Exception):
    """A request answered with an OpenAI error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None, code=None, headers=None,
                 counted: bool = False):
        super().__init__(message)
        self.status, self.body, self.headers = status, protocol.error_body(message, kind, param, code), headers
        self.counted = counted  # the engine took the request and has counted its outcome


def create_app(engine: Engine, model_name: str, defaults: Defaults = Defaults(), max_request_bytes: int | None = None) -> FastAPI:
    """The ASGI app. The engine is started by the caller and stopped, after the last response, on shutdown.
    A body over `max_request_bytes` (default: `default_max_request_bytes`) is refused with 413 unread;
    a prompt over `max_prompt_chars` is refused before it is tokenized."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(engine.stop, True)  # after uvicorn has finished the requests in flight

    app = FastAPI(title="s3d-jax", lifespan=lifespan)
    outcomes = engine.totals.requests  # a request the engine took is counted there, once, when it ends
    prompt_chars = max_prompt_chars(engine)
    app.add_middleware(BodyLimit, limit=max_request_bytes or default_max_request_bytes(prompt_chars),
                       refused=lambda: outcomes.update(invalid=1))

    @app.exception_handler(Refused)
    async def refused(_, e: Refused):
        if not e.counted:
            outcomes["refused" if e.status in (429, 503) else "invalid"] += 1
        return JSONResponse(e.body, e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        error = e.errors()[0]
        where = [str(part) for part in error.get("loc", ()) if part != "body"]
        if error.get("type") == "json_invalid":
            message, param = f"the body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}", None
        else:
            message, param = f"{'.'.join(where) or 'body'}: {error['msg']}", ".".join(where) or None
        outcomes["invalid"] += 1
        return JSONResponse(protocol.error_body(message, param=param), 400)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(protocol.error_body(str(e.detail), kind), e.status_code, headers=e.headers)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "s3d-jax"}]}

    @app.get("/metrics")
    async def metrics():
        registry = CollectorRegistry()
        registry.register(_Collector(engine))
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat(body: protocol.ChatRequest, http: HTTPRequest):
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        ids = await _encode(engine, messages, prompt_chars, chat=True)
        return await _complete(engine, model_name, defaults, body, ids, http, chat=True,
                               max_tokens=body.max_completion_tokens or body.max_tokens)

    @app.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest, http: HTTPRequest):
        prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) else body.prompt
        ids = await _encode(engine, prompt, prompt_chars, chat=False)
        return await _complete(engine, model_name, defaults, body, ids, http, chat=False, max_tokens=body.max_tokens)

    return app


@contextlib.contextmanager
def _full_queue_is_429():
    """A full queue (the engine's QueueFull) answered as OpenAI's rate limit, with a Retry-After."""
    try:
        yield
    except QueueFull as e:
        raise Refused(429, f"the server is busy: {e}; retry shortly", "rate_limit_error", code="queue_full",
                      headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None


async def _encode(engine: Engine, prompt, prompt_chars: int, chat: bool) -> list[int]:
    """The prompt's token ids, tokenized (and templated) off the event loop's thread. Text of more than
    `prompt_chars` characters, or more token ids than the window, cannot fit and is refused unread; so
    is any prompt while the queue is full, so that a client retrying a full server costs no tokenization."""
    with _full_queue_is_429():
        engine.check_room()
    param = "messages" if chat else "prompt"
    if isinstance(prompt, list) and not chat:  # token ids
        length, limit, unit = len(prompt), engine.max_len, "token ids"
    else:
        length, limit, unit = sum(len(m["content"]) for m in prompt) if chat else len(prompt), prompt_chars, "characters"
    if length > limit:
        raise Refused(400, f"this model's context window is {engine.max_len} tokens; the prompt's {length} {unit} are more than "
                      f"that many tokens can hold", param=param, code="context_length_exceeded")
    try:
        (ids,), _ = await asyncio.to_thread(api.encode, engine.model, prompt, chat)
    except (ValueError, TypeError) as e:
        raise Refused(400, str(e), param=param) from None
    return ids


async def _complete(engine: Engine, model_name: str, defaults: Defaults, body: protocol.Sampling, ids: list[int], http: HTTPRequest,
                    chat: bool, max_tokens: int | None):
    if body.model != model_name:
        raise Refused(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}", "not_found_error", "model",
                      "model_not_found")
    room = engine.room(len(ids))
    if room < 1 or (max_tokens or 1) > room:
        wanted = f" + max_tokens {max_tokens}" if max_tokens else ""
        raise Refused(400, f"this model's context window is {engine.max_len} tokens; the prompt has {len(ids)}{wanted} and S3D's draft "
                      f"block needs {engine.block} more", param="max_tokens" if max_tokens else "messages" if chat else "prompt",
                      code="context_length_exceeded")
    loop, deltas = asyncio.get_running_loop(), asyncio.Queue()
    temperature = defaults.temperature if body.temperature is None else body.temperature
    request = Request(ids, min(max_tokens or defaults.max_tokens, room), lambda d: loop.call_soon_threadsafe(deltas.put_nowait, d),
                      temperature=temperature, top_p=defaults.top_p if body.top_p is None else body.top_p,
                      seed=(defaults.seed if body.seed is None else body.seed) % SEED_LIMIT, stop=body.stops())
    try:
        with _full_queue_is_429():
            engine.submit(request)
    except ValueError as e:
        raise Refused(400, str(e), code="context_length_exceeded") from None
    reply = protocol.Reply(model_name, chat)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_stream(request, deltas, reply, include_usage), media_type="text/event-stream")
    text, last = "", None
    try:
        while last is None or last.finish_reason is None:
            try:
                last = await asyncio.wait_for(deltas.get(), DISCONNECT_POLL_SECONDS)
            except TimeoutError:
                if await http.is_disconnected():
                    return Response(status_code=499)
                continue
            text += last.text
    finally:
        request.cancelled.set()  # a no-op once finished; else (a disconnect) the engine frees the slot at its next chunk
    if last.error:
        raise Refused(500, last.error, "server_error", counted=True)
    return reply.whole(text, last)


async def _stream(request: Request, deltas: asyncio.Queue, reply: protocol.Reply, include_usage: bool):
    """Server-sent events: a chunk per engine chunk, the finish reason, usage if asked, then [DONE]."""
    def event(body: dict) -> str:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    try:
        first = True
        while True:
            delta: Delta = await deltas.get()
            if delta.error:
                yield event(protocol.error_body(delta.error, "server_error"))
                break
            if delta.text or first:
                yield event(reply.chunk(delta.text, first=first))
                first = False
            if delta.finish_reason:
                yield event(reply.chunk("", delta.finish_reason))
                if include_usage:
                    yield event(reply.usage_chunk(delta))
                break
        yield "data: [DONE]\n\n"
    finally:
        request.cancelled.set()  # the client went away mid-stream, or it ended: the slot is freed either way


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered with 413 and an OpenAI error body,
    by its Content-Length before any of it is read, or (a chunked body) as soon as it passes the limit.
    What passes is held once, at most `limit` bytes, and handed on whole."""

    def __init__(self, app, limit: int, refused: Callable[[], None]):
        self.app, self.limit, self.refused = app, limit, refused

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.limit:
            return await self.refuse(send, declared.decode("latin-1"))
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            size, more = size + len(chunks[-1]), message.get("more_body", False)
            if size > self.limit:
                return await self.refuse(send, f"more than {size}")
        body, handed = b"".join(chunks), False
        del chunks

        async def once():
            nonlocal handed
            if handed:
                return await receive()  # after the body, only a disconnect is left to wait for
            handed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, once, send)

    async def refuse(self, send, size: str):
        self.refused()
        payload = json.dumps(protocol.error_body(f"the request body ({size} bytes) is over this server's limit of {self.limit} "
                                                 "bytes (--max-request-bytes)", code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


class _Collector:
    """The engine's totals as Prometheus metrics, read when scraped."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        engine, totals = self.engine, self.engine.totals
        requests = CounterMetricFamily("s3d_requests", "Requests by outcome", labels=["outcome"])
        for outcome, count in sorted(totals.requests.items()):
            requests.add_metric([outcome], count)
        yield requests
        yield CounterMetricFamily("s3d_generated_tokens", "Tokens generated", value=totals.generated_tokens)
        speed = totals.generated_tokens / totals.decode_seconds if totals.decode_seconds else 0.0
        yield GaugeMetricFamily("s3d_tokens_per_second", "Generated tokens per second of decoding", value=speed)
        busy, slots = engine.occupancy()
        yield GaugeMetricFamily("s3d_queue_depth", "Requests waiting for a slot", value=len(engine.waiting))
        yield GaugeMetricFamily("s3d_batch_occupancy", "Busy slots over all slots", value=busy / slots)
        rows = GaugeMetricFamily("s3d_lane_rows", "Rows each lane's loop runs at now (its batch size)", labels=["lane"])
        plans = GaugeMetricFamily("s3d_lane_plan", "Each lane's plan at each batch size, and what chose it (1: in force now)",
                                  labels=["lane", "rows", "plan", "chosen_by"])
        for sampling, lane in list(engine.lanes.items()):
            name = f"temperature={sampling.temperature:g},top_p={sampling.top_p:g}"
            rows.add_metric([name], len(lane.requests))
            for batch, plan in lane.plans.items():
                what = "plain steps" if plan.method == "ar" else f"{plan.method} gamma={plan.gamma} tree={plan.tree} " \
                       f"lookup={plan.lookup} min_certainty={plan.min_certainty:g}"
                plans.add_metric([name, str(batch), what, lane.policies.get(batch, "")], float(batch == len(lane.requests)))
        yield rows
        yield plans
        histogram = totals.accept_histogram
        drafted = histogram.sum() > 0
        yield GaugeMetricFamily("s3d_tokens_per_iteration", "E: tokens per drafted iteration of finished requests",
                                value=tokens_per_iteration(histogram) if drafted else 0.0)
        acceptance = GaugeMetricFamily("s3d_acceptance", "Acceptance per draft depth of finished requests", labels=["depth"])
        for depth, rate in enumerate(acceptance_per_depth(histogram) if drafted else [], start=1):
            acceptance.add_metric([str(depth)], rate)
        yield acceptance
