"""The OpenAI-compatible HTTP API (aiohttp), served on the router's event loop.

Handlers are thin: protocol.py turns bodies into engine inputs, responses.py deltas into JSON; this module
runs a request's choices (one `Frontend.generate` per prompt × n, concurrently), streams them as
server-sent events, and maps every error to OpenAI's error body.

A client that goes away cancels every choice, which closes their generate iterators (the router
then cancels the request on its workers): `start_http` turns on aiohttp's handler cancellation,
and for runners built without it the choice loop notices the closed connection within
DISCONNECT_POLL_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import prometheus_client
from aiohttp import web

from services.common.errors import ServiceError, http_status
from services.common.security import API_KEY_MISSING, API_KEY_WRONG, ApiKeys
from services.openai.limits import BODY_TIMEOUT_S, GuardedRunner, read_body
from services.openai.protocol import (
    ApiError,
    ParsedRequest,
    error_body,
    generations,
    param_from_message,
    parse_chat,
    parse_completion,
    parse_json,
)
from services.openai.responses import (
    ChoiceOutput,
    TokenStrings,
    chunk_json,
    model_json,
    models_json,
    response_json,
    usage_json,
)
from services.openai.tokenization import PATHS as TOKENIZER_PATHS
from services.openai.tokenization import TokenizerRoutes
from services.router.api import ConstraintError, Delta, Frontend, GenerateInput, check_generations

logger = logging.getLogger(__name__)

LARGE_TOKENS = 4096
"""A non-streaming response of more tokens than this (every choice's) is built off the event loop."""
DISCONNECT_POLL_S = 0.2
"""How often a running request checks that its client is still connected."""
_MAX_BODY = web.AppKey("max_body_bytes", int)
_REQUEST_ID = web.RequestKey("request_id", str)


def request_client(frontend: Frontend, request: web.Request) -> str:
    """Who an HTTP request comes from: its checked API key, else its peer address."""
    return frontend.client(request.headers.get("Authorization"), request.remote)


class ClientGone(Exception):
    """The client closed the connection while its request ran."""


def build_app(
    frontend: Frontend,
    metrics_registry: prometheus_client.CollectorRegistry | None = None,
    max_body_bytes: int = 1 << 20,
    body_timeout_s: float = 30.0,
    api_keys: ApiKeys | None = None,
) -> web.Application:
    """The OpenAI API over `frontend`: /v1/completions, /v1/chat/completions, /v1/models,
    vLLM's /tokenize, /detokenize and /tokenizer_info (tokenization.py), /health and /metrics
    (`metrics_registry` in Prometheus text format; empty when None). Request bodies over
    max_body_bytes get 413, bodies not received within body_timeout_s 408 (`limits.read_body`).
    With api_keys, every /v1/* and tokenizer request needs `Authorization: Bearer KEY` (401 in
    OpenAI's error shape before anything is read); /health and /metrics stay open."""
    if not body_timeout_s > 0:
        raise ValueError(f"body_timeout_s must be > 0, got {body_timeout_s}")
    api = _Api(frontend, metrics_registry)
    middlewares = [_errors, _api_key_check(api_keys)] if api_keys else [_errors]
    app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
    app[_MAX_BODY] = max_body_bytes
    app[BODY_TIMEOUT_S] = body_timeout_s
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/v1/models/{model:.+}", api.model)
    TokenizerRoutes(frontend).add_to(app)
    app.router.add_get("/health", api.health)
    app.router.add_get("/metrics", api.metrics)
    return app


async def start_http(
    app: web.Application,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    header_timeout_s: float = 10.0,
    max_connections: int = 1024,
) -> web.AppRunner:
    """Serve `app` on host:port from the running loop (port 0: any free port, see runner.addresses);
    HTTPS with `ssl_context` (see `server_ssl_context`). A connection must deliver each request
    head within header_timeout_s (from connecting, or from its previous response); past
    max_connections open ones, new connections get 503 and are closed (services/openai/limits.py).
    The caller stops it with `await runner.cleanup()`."""
    runner = GuardedRunner(
        app, header_timeout_s=header_timeout_s, max_connections=max_connections, handler_cancellation=True
    )
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    logger.info(
        "OpenAI API listening on %s (%s)", runner.addresses, "https" if ssl_context is not None else "http"
    )
    return runner


def server_ssl_context(cert: str, key: str) -> ssl.SSLContext:
    """Server-side TLS from a PEM certificate chain and its key; clients are not asked for
    certificates."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


def _error_of(exc: BaseException, request: web.Request) -> tuple[int, dict]:
    """HTTP status and OpenAI error body for an exception; an unexpected one is logged."""
    if isinstance(exc, ApiError):
        return exc.status, error_body(exc.message, exc.status, exc.param, exc.code)
    if isinstance(exc, ServiceError):
        status = http_status(exc.code)
        param = param_from_message(exc.message) if status == 400 else None
        return status, error_body(exc.message, status, param, exc.code.name.lower())
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        limit = request.app[_MAX_BODY]
        return 413, error_body(f"request body is larger than the limit of {limit} bytes", 413)
    if isinstance(exc, web.HTTPException):
        return exc.status, error_body(f"{exc.reason}: {request.method} {request.path}", exc.status)
    request_id = request.get(_REQUEST_ID)
    logger.error("%s %s failed (request id %s)", request.method, request.path, request_id, exc_info=exc)
    return 500, error_body(f"internal server error (request id {request_id})", 500)


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        error: BaseException = e
    except ClientGone:
        return web.Response(status=499)  # nobody reads it
    except Exception as e:
        error = e
    status, body = _error_of(error, request)
    retry_after = getattr(error, "retry_after_s", None)
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after is not None else {}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return web.json_response(body, status=status, headers=headers or None)


def _api_key_check(keys: ApiKeys):
    """Middleware: /v1/* and the tokenizer routes need one of the keys (an unknown /v1 path too:
    no probing without one)."""

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        path = request.path
        if path == "/v1" or path.startswith("/v1/") or path in TOKENIZER_PATHS:
            got = request.headers.get("Authorization")
            if not keys.check(got):
                raise ApiError(
                    API_KEY_MISSING if got is None else API_KEY_WRONG, status=401, code="invalid_api_key"
                )
        return await handler(request)

    return check


def _sse(data: dict) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def _chunk_encoder(
    request_id: str, created: int, model: str, chat: bool, include_usage: bool
) -> Callable[..., bytes]:
    """-> chunk(choices, **extra): a stream's SSE event, _sse(chunk_json(...)) with "usage": null
    where include_usage and no extra is given. The fields every chunk of the stream repeats are
    encoded once; a token's chunk then encodes only its choices (the same bytes)."""
    head = _sse(chunk_json(request_id, created, model, chat, []))[: -len(b"[]}\n\n")]  # ..."choices":
    tail = b',"usage":null}\n\n' if include_usage else b"}\n\n"

    def chunk(choices: list[dict], **extra) -> bytes:
        if extra:
            return _sse(chunk_json(request_id, created, model, chat, choices, **extra))
        return head + json.dumps(choices, separators=(",", ":")).encode() + tail

    return chunk


def _encoded_whole_choice(output: ChoiceOutput) -> bytes:
    return json.dumps(output.choice()).encode()


def _encoded_choice(output: ChoiceOutput, delta: Delta, chunk) -> bytes | None:
    """The stream chunk for a delta (output.add), encoded; None when it carries nothing to send."""
    choice = output.add(delta)
    return None if choice is None else chunk([choice])


async def _watch_connection(request: web.Request, gone: Callable[[], None]) -> None:
    """Calls gone() once the client's connection is closed (checked every DISCONNECT_POLL_S)."""
    while request.transport is not None and not request.transport.is_closing():
        await asyncio.sleep(DISCONNECT_POLL_S)
    gone()


def _choices(
    request: web.Request, frontend: Frontend, inputs: list[GenerateInput]
) -> AsyncGenerator[tuple[int, Delta], None]:
    """Every choice's deltas as they come, as (choice index, delta): _one_choice or _run_choices."""
    if len(inputs) == 1:
        return _one_choice(request, frontend, inputs[0])
    return _run_choices(request, frontend, inputs)


async def _one_choice(
    request: web.Request, frontend: Frontend, inp: GenerateInput
) -> AsyncGenerator[tuple[int, Delta], None]:
    """One choice's deltas on the caller's task, straight from frontend.generate (a single-choice
    request's token then costs the router's event loop one task wake-up; _run_choices runs one of
    these per choice on a task of its own). A client that disconnects while this waits on the
    generation cancels that wait; while the caller is elsewhere (writing a chunk), it is found
    before the next wait. Either way it comes out as ClientGone, the generation closed."""
    task = asyncio.current_task()
    waiting = gone = False

    def on_gone() -> None:
        nonlocal gone
        gone = True
        if waiting:
            task.cancel()

    stream: AsyncIterator[Delta] = frontend.generate(inp)
    closing = contextlib.aclosing(stream) if isinstance(stream, AsyncGenerator) else contextlib.nullcontext()
    watcher = asyncio.create_task(_watch_connection(request, on_gone))
    finished = False
    try:
        async with closing:
            while not gone:
                waiting = True
                try:
                    delta = await anext(stream)
                except StopAsyncIteration:
                    break
                except asyncio.CancelledError:
                    if gone and task.uncancel() == 0:  # our cancel, and no one else's
                        raise ClientGone() from None
                    raise
                finally:
                    waiting = False
                finished = finished or delta.finish_reason is not None
                yield 0, delta
        if gone:
            raise ClientGone()
        if not finished:
            raise RuntimeError(f"generate for {inp.request_id} ended without a finish_reason")
    finally:
        watcher.cancel()


async def _run_choices(
    request: web.Request, frontend: Frontend, inputs: list[GenerateInput]
) -> AsyncGenerator[tuple[int, Delta], None]:
    """Every choice's deltas as they come, as (choice index, delta), until all generate iterators
    end: each choice's _one_choice on a task of its own. Raises the first error (ClientGone when
    the client disconnects); on any exit, cancels the choices still running."""
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, inp: GenerateInput) -> None:
        try:
            async with contextlib.aclosing(_one_choice(request, frontend, inp)) as deltas:
                async for _, delta in deltas:
                    queue.put_nowait((index, delta))
            queue.put_nowait((index, None))
        except Exception as e:
            queue.put_nowait((index, e))

    tasks = [asyncio.create_task(pump(i, inp), name=inp.request_id) for i, inp in enumerate(inputs)]
    running = len(tasks)
    try:
        while running:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                running -= 1
            else:
                yield index, item
    finally:
        running_ids = [task.get_name() for task in tasks if not task.done()]
        if running_ids:
            logger.info("cancelling %s", ", ".join(running_ids))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Api:
    """The route handlers; one instance per app."""

    def __init__(self, frontend: Frontend, registry: prometheus_client.CollectorRegistry | None):
        self.frontend = frontend
        self.registry = registry
        self.strings = TokenStrings(frontend.tokenizer)
        self.created = int(time.time())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        request[_REQUEST_ID] = request_id
        client = request_client(self.frontend, request)
        # Parsing and tokenizing cost time linear in the body: off the event loop, fairly among
        # clients. Tokenizing waits for admission, which counts the generations it asks for.
        body = await self.frontend.prepare(client, parse_json, await read_body(request))
        num_prompts, n = generations(body, chat)
        try:
            weight = check_generations(num_prompts, n, self.frontend.max_generations_per_request)
        except ValueError as e:
            raise ApiError(str(e), "n") from None
        async with self.frontend.admit(weight, None) as queued:
            parsed = await self.frontend.prepare(
                client, parse_chat if chat else parse_completion, body, self.frontend
            )
            try:
                await self.frontend.check_constraints(client, parsed.checks)
            except ConstraintError as e:
                raise ApiError(str(e), e.param) from None
            return await self._run(request, request_id, parsed, queued, client)

    async def _run(
        self, request: web.Request, request_id: str, parsed: ParsedRequest, queued: float, client: str
    ) -> web.StreamResponse:
        chat = parsed.chat
        try:
            for prompt in parsed.prompts:
                self.frontend.validate(prompt, parsed.params)
            self.frontend.check_fits(parsed.prompts, parsed.n, parsed.mode)
        except ValueError as e:
            raise ApiError(str(e), param_from_message(str(e))) from None
        inputs = parsed.generate_inputs(request_id)
        for inp in inputs:
            inp.queued, inp.client = queued, client
        outputs = [
            ChoiceOutput(
                chat,
                i,
                parsed.top_logprobs,
                self.strings,
                echo=None
                if parsed.echo is None
                else (parsed.echo[i // parsed.n], parsed.prompts[i // parsed.n]),
                prompt_logprobs=parsed.prompt_logprobs,
                skip_special_tokens=parsed.params.skip_special_tokens,
                tools=parsed.tools,
            )
            for i in range(len(inputs))
        ]
        logger.debug("request %s: %d choice(s), stream=%s", request_id, len(inputs), parsed.stream)
        deltas = _choices(request, self.frontend, inputs)
        if parsed.stream:
            return await self._stream(request, request_id, parsed, outputs, deltas, client)
        async with contextlib.aclosing(deltas):
            async for index, delta in deltas:
                if delta.prompt_logprobs is not None:  # a prompt's logprobs: sizeable, off the loop
                    await self.frontend.prepare(client, outputs[index].add, delta)
                else:
                    outputs[index].add(delta)
        usage = usage_json(parsed.prompts, parsed.n, outputs)
        whole = response_json(request_id, int(time.time()), self.frontend.model_name, chat, [], usage=usage)
        large = parsed.params.prompt_logprobs is not None or sum(o.num_tokens for o in outputs) > LARGE_TOKENS
        if not large:
            whole["choices"] = [o.choice() for o in outputs]
            return web.json_response(whole)
        # Many tokens or logprobs take long to encode (a 23.8 MB echo took 0.8 s), and json.dumps
        # holds the GIL while it runs, on whatever thread: the body goes out a choice at a time,
        # each encoded off the event loop, so the loop (the other streams, /health) waits for one
        # choice's encoding at most.
        resp = web.StreamResponse(headers={"Content-Type": "application/json; charset=utf-8"})
        await resp.prepare(request)
        head, tail = json.dumps(whole).split('"choices": []', 1)
        await resp.write(f'{head}"choices": ['.encode())
        for i, output in enumerate(outputs):
            piece = await self.frontend.prepare(client, _encoded_whole_choice, output)
            await resp.write(b", " + piece if i else piece)
        await resp.write(f"]{tail}".encode())
        await resp.write_eof()
        return resp

    async def _stream(
        self,
        request: web.Request,
        request_id: str,
        parsed: ParsedRequest,
        outputs: list[ChoiceOutput],
        deltas: AsyncGenerator[tuple[int, Delta], None],
        client: str,
    ) -> web.StreamResponse:
        """SSE chunks. Headers go out with the first delta, so an error before it (overload, no
        worker) still gets its own HTTP status; a later one is sent as a `data: {"error": ...}`
        event that ends the stream."""
        chunk = _chunk_encoder(
            request_id, int(time.time()), self.frontend.model_name, parsed.chat, parsed.include_usage
        )

        resp: web.StreamResponse | None = None
        async with contextlib.aclosing(deltas):
            try:
                async for index, delta in deltas:
                    if resp is None:
                        resp = await self._start_stream(request, outputs, chunk)
                    if delta.prompt_logprobs is not None:  # a prompt's logprobs: encoded off the loop
                        data = await self.frontend.prepare(
                            client, _encoded_choice, outputs[index], delta, chunk
                        )
                    else:
                        data = _encoded_choice(outputs[index], delta, chunk)
                    if data is not None:
                        await resp.write(data)
                if resp is None:
                    resp = await self._start_stream(request, outputs, chunk)
                if parsed.include_usage:
                    await resp.write(chunk([], usage=usage_json(parsed.prompts, parsed.n, outputs)))
                await resp.write(b"data: [DONE]\n\n")
            except (ClientGone, ConnectionResetError):
                logger.info("request %s: client disconnected; cancelled", request_id)
                return resp or web.Response(status=499)
            except Exception as e:
                if resp is None:
                    raise
                _, body = _error_of(e, request)
                with contextlib.suppress(ConnectionResetError):
                    await resp.write(_sse(body))
        return resp

    async def _start_stream(
        self, request: web.Request, outputs: list[ChoiceOutput], chunk
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        if outputs[0].chat:  # each choice's first chunk carries the role
            for o in outputs:
                first = {"index": o.index, "delta": {"role": "assistant", "content": ""}}
                await resp.write(chunk([first | {"logprobs": None, "finish_reason": None}]))
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(models_json(self.frontend, self.created))

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.frontend.model_name:
            raise ApiError(f"The model {name!r} does not exist", "model", status=404, code="model_not_found")
        return web.json_response(model_json(self.frontend, self.created))

    async def health(self, request: web.Request) -> web.Response:
        """200 once a request can be routed, 503 (naming why) until then and whenever none can:
        what a load balancer polls, as vLLM's /health."""
        why = self.frontend.not_ready()
        if why is None:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "unavailable", "reason": why}, status=503)

    async def metrics(self, request: web.Request) -> web.Response:
        if self.registry is None:
            return web.Response(body=b"", content_type="text/plain")
        data = prometheus_client.generate_latest(self.registry)
        return web.Response(body=data, headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})
