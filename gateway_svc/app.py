"""The OpenAI-compatible ASGI app: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.

Each choice of a request is one Generate stream on the verifier, through the async SDK. A stream's
first chunk is awaited before the HTTP response starts, so a request the verifier refuses gets its
status (400/429/503…) instead of a 200 followed by an error event; errors after that arrive as one
SSE ``data: {"error": …}`` event before ``[DONE]``. A client that goes away closes the gRPC streams,
and the verifier frees their slots.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway_svc.auth import ApiKeyCheck, tenant_scope
from gateway_svc.config import GatewayConfig
from gateway_svc.errors import ApiError, from_grpc
from gateway_svc.metrics import GatewayMetrics
from gateway_svc.protocol import ChatCompletionRequest, CompletionRequest
from gateway_svc.responses import (
    chat_logprobs,
    completion_logprobs,
    finish,
    speculation,
    usage_of,
)
from specmesh.client import AsyncClient
from specmesh.credentials import TlsOptions
from specmesh.params import Chunk, Prompt, SamplingParams, SpecDecodeParams, Summary, TokenLogprob
from specmesh_server.metrics import REGISTRY

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_context: int
    created: int


@dataclass
class _Choice:
    """One generation of a request: its stream and what it produced."""

    index: int
    stream: AsyncIterator[Chunk | Summary]
    first: Chunk | Summary | None = None
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    summary: Summary | None = None

    def take(self, item: Chunk | Summary) -> None:
        if isinstance(item, Summary):
            self.summary = item
        else:
            self.text += item.text
            self.logprobs.extend(item.logprobs or ())


def _sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


class Gateway:
    """State of one gateway process: the verifier channel, the served model, metrics."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.config, self.metrics = config, metrics
        self.client: AsyncClient | None = None
        self._model: ModelInfo | None = None

    async def start(self) -> None:
        c = self.config
        tls = None
        if c.verifier_tls_ca:  # a client certificate of its own, else its https one (mutual TLS)
            cert, key = (c.verifier_tls_cert, c.verifier_tls_key) if c.verifier_tls_cert else (c.tls_cert, c.tls_key)
            tls = TlsOptions(ca=c.verifier_tls_ca, cert=cert or None, key=key or None)
        # the channel belongs to the serving loop; the token is the gateway's own, never a client's
        self.client = AsyncClient(c.verifier, tls=tls, token=c.verifier_token)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def model(self) -> ModelInfo:
        """The served model, asked of the verifier once (503 while it cannot be reached). A verifier
        that serves AdminService only on its --admin-address answers UNIMPLEMENTED here: then the
        name is --served-model-name and the context length unknown (0)."""
        if self._model is None:
            try:
                stats = (await self.client.stats(timeout=5.0)).server
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED and self.config.served_model_name:
                    self._model = ModelInfo(self.config.served_model_name, 0, int(time.time()))
                    return self._model
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    msg = "the verifier serves AdminService on a separate --admin-address: set --served-model-name"
                    raise ApiError(500, msg, "server_error") from None
                raise from_grpc(exc) from None
            name = self.config.served_model_name or stats.model
            self._model = ModelInfo(name, stats.max_context_tokens, int(time.time()))
        return self._model

    async def check_model(self, requested: str) -> ModelInfo:
        info = await self.model()
        if requested != info.name:
            raise ApiError(
                404,
                f"The model `{requested}` does not exist; this server serves `{info.name}`.",
                "not_found_error",
                "model",
                "model_not_found",
            )
        return info

    async def healthy(self) -> bool:
        try:
            resp = await health_pb2_grpc.HealthStub(self.client.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2.0
            )
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def open(
        self, prompts: list[Prompt], chat: bool, n: int, sampling_for, spec: SpecDecodeParams, rid: str, params: dict
    ) -> list[_Choice]:
        """Start every choice's stream and wait for its first item; refusals raise ApiError."""
        choices = []
        for p, prompt in enumerate(prompts):
            for j in range(n):
                sampling: SamplingParams = sampling_for(j)
                stream = self.client.generate(
                    prompt,
                    sampling,
                    spec,
                    chat=chat,
                    request_id=f"{rid}-{p * n + j}",
                    timeout=self.config.request_timeout_s,
                )
                choices.append(_Choice(p * n + j, stream))
        firsts = await asyncio.gather(*(anext(c.stream) for c in choices), return_exceptions=True)
        failure = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failure is not None:
            await _close(choices)
            if isinstance(failure, grpc.RpcError):
                raise from_grpc(failure, **params) from None
            raise failure
        for c, first in zip(choices, firsts, strict=True):
            c.first = first
        return choices


async def _close(choices: list[_Choice]) -> None:
    for c in choices:
        await c.stream.aclose()  # cancels the RPC if it is still running


async def _items(c: _Choice) -> AsyncIterator[Chunk | Summary]:
    if c.first is not None:
        yield c.first
    async for item in c.stream:
        yield item


async def _merged(choices: list[_Choice]) -> AsyncIterator[tuple[_Choice, Chunk | Summary]]:
    """Items of every choice as they come (one choice: read directly, no task hop)."""
    if len(choices) == 1:
        async for item in _items(choices[0]):
            yield choices[0], item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: _Choice) -> None:
        try:
            async for item in _items(c):
                await queue.put((c, item))
            await queue.put((c, None))
        except BaseException as exc:  # handed to the reader
            await queue.put((c, exc))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        live = len(choices)
        while live:
            c, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield c, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def create_app(config: GatewayConfig, metrics: GatewayMetrics | None = None) -> FastAPI:
    gw = Gateway(config, metrics or GatewayMetrics())
    m = gw.metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gw.start()
        yield
        await gw.close()

    app = FastAPI(title="SpecMesh OpenAI-compatible API", lifespan=lifespan)
    app.state.gateway = gw
    if config.api_keys:
        app.add_middleware(ApiKeyCheck, keys=config.api_keys)

    def error_response(err: ApiError, endpoint: str = "") -> JSONResponse:
        headers = {"Retry-After": str(config.retry_after_s)} if err.status == 429 else None
        if endpoint:
            m.requests.labels(endpoint, str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            err = ApiError(400, f"the request body is not valid JSON: {first.get('msg', '')}", code="json_invalid")
        else:
            loc = [str(x) for x in first.get("loc", ()) if x != "body"]
            param = ".".join(loc) or None
            err = ApiError(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param=param)
        return error_response(err, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(exc.status_code, str(exc.detail), kind), "")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error serving %s", request.url.path)
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}", "server_error"), request.url.path)

    @app.get("/health")
    async def health() -> Response:
        ok = await gw.healthy()
        return PlainTextResponse("ok" if ok else "verifier not serving", status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        info = await gw.model()
        card = {
            "id": info.name,
            "object": "model",
            "created": info.created,
            "owned_by": "specmesh",
            "root": info.name,
            "max_model_len": info.max_context,
        }
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        info = await gw.check_model(model_id)
        return {"id": info.name, "object": "model", "created": info.created, "owned_by": "specmesh"}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        body.check(config.max_n)
        info = await gw.check_model(body.model)
        params = {"max_tokens_param": body.max_tokens_param, "logprobs_param": "top_logprobs"}
        return await _generate(body, info, [body.chat()], True, params, "chat", _spec(body, request))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        body.check(config.max_n)
        info = await gw.check_model(body.model)
        params = {"max_tokens_param": "max_tokens", "logprobs_param": "logprobs"}
        return await _generate(body, info, body.prompts(), False, params, "completions", _spec(body, request))

    def _spec(body, request: Request) -> SpecDecodeParams:
        """The request's SpecDecodeParams; with API keys, its cache scope inside its key's tenant."""
        spec = body.spec()
        tenant = getattr(request.state, "tenant", None)
        return dataclasses.replace(spec, cache_scope=tenant_scope(tenant, spec.cache_scope))

    async def _generate(
        body, info: ModelInfo, prompts: list[Prompt], chat: bool, params: dict, kind: str, spec: SpecDecodeParams
    ) -> Response:
        endpoint = f"/v1/{'chat/' if chat else ''}completions"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        t0 = time.perf_counter()
        m.in_flight.inc()
        try:
            choices = await gw.open(prompts, chat, body.n, body.sampling_for, spec, rid, params)
        except BaseException:
            m.in_flight.dec()
            raise
        m.ttft.observe(time.perf_counter() - t0)
        head = {"id": rid, "created": int(time.time()), "model": info.name}
        want_logprobs = body.wants_logprobs
        if not body.stream:
            try:
                async for c, item in _merged(choices):
                    c.take(item)
            except grpc.RpcError as exc:
                raise from_grpc(exc, **params) from None
            finally:
                await _close(choices)
                m.in_flight.dec()
            summaries = {c.index: c.summary for c in choices}
            _count(m, summaries.values())
            m.requests.labels(endpoint, "200").inc()
            m.latency.labels(endpoint, "false").observe(time.perf_counter() - t0)
            out = []
            for c in choices:
                choice = {"index": c.index, **finish(c.summary)}
                if chat:
                    choice["message"] = {"role": "assistant", "content": c.text}
                    choice["logprobs"] = chat_logprobs(c.logprobs) if want_logprobs else None
                else:
                    choice["text"] = c.text
                    choice["logprobs"] = completion_logprobs(c.logprobs) if want_logprobs else None
                out.append(choice)
            return JSONResponse(
                {
                    **head,
                    "object": "chat.completion" if chat else "text_completion",
                    "choices": out,
                    "usage": usage_of(summaries, body.n),
                    "metrics": {"speculative_decoding": speculation(list(summaries.values()))},
                }
            )
        m.requests.labels(endpoint, "200").inc()
        stream = _events(choices, head, chat, want_logprobs, body.include_usage, body.n, params, endpoint, t0)
        return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _events(
        choices: list[_Choice],
        head: dict,
        chat: bool,
        want_logprobs: bool,
        include_usage: bool,
        n: int,
        params: dict,
        endpoint: str,
        t0: float,
    ) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        extra = {"usage": None} if include_usage else {}

        def event(choice: dict) -> bytes:
            return _sse({**head, "object": obj, "choices": [choice], **extra})

        last = {c.index: t0 for c in choices}
        offsets = dict.fromkeys(last, 0)
        finished = False
        try:
            if chat:
                for c in choices:
                    delta = {"role": "assistant", "content": ""}
                    yield event({"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None})
            async for c, item in _merged(choices):
                c.take(item)
                if isinstance(item, Summary):
                    fin = {"index": c.index, **finish(item)}
                    fin.update({"delta": {}, "logprobs": None} if chat else {"text": "", "logprobs": None})
                    yield event(fin)
                    continue
                now = time.perf_counter()
                if item.token_ids and last[c.index] != t0:
                    m.tokens_between(now - last[c.index], len(item.token_ids))
                last[c.index] = now
                if not item.text and not (want_logprobs and item.logprobs):
                    continue  # held-back text (a stop string's prefix, a partial character): nothing to show
                lp = None
                if want_logprobs and item.logprobs:
                    lp = chat_logprobs(item.logprobs) if chat else completion_logprobs(item.logprobs, offsets[c.index])
                offsets[c.index] += len(item.text)
                if chat:
                    yield event(
                        {"index": c.index, "delta": {"content": item.text}, "logprobs": lp, "finish_reason": None}
                    )
                else:
                    yield event({"index": c.index, "text": item.text, "logprobs": lp, "finish_reason": None})
            summaries = {c.index: c.summary for c in choices}
            _count(m, summaries.values())
            if include_usage:
                yield _sse(
                    {
                        **head,
                        "object": obj,
                        "choices": [],
                        "usage": usage_of(summaries, n),
                        "metrics": {"speculative_decoding": speculation(list(summaries.values()))},
                    }
                )
            finished = True
        except grpc.RpcError as exc:  # after the 200: the error travels in the stream
            yield _sse(from_grpc(exc, **params).body())
            finished = True
        finally:
            await _close(choices)
            m.in_flight.dec()
            m.latency.labels(endpoint, "true").observe(time.perf_counter() - t0)
            if not finished:
                m.disconnects.inc()
        yield _sse("[DONE]")

    return app


def _count(m: GatewayMetrics, summaries) -> None:
    for s in summaries:
        m.prompt_tokens.inc(s.prompt_tokens)
        m.completion_tokens.inc(s.completion_tokens)
        m.drafted.inc(s.speculation.drafted_tokens)
        m.accepted.inc(s.speculation.accepted_tokens)
