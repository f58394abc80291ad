"""The HTTP side: Starlette routes, bearer-token check, OpenAI-shaped answers and errors, and a
uvicorn server on its own thread (:class:`ApiServer`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.backend import Backend, JobQueue
from app.api.errors import ApiError, bad_request, from_veil
from app.api.schema import ChatRequest, CompletionRequest, parse
from engine.chat import prompt_ids
from engine.errors import VeilError
from engine.generate import CancelToken, GenerationResult

log = logging.getLogger("veil.api")

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
MAX_BODY = 8 * 1024 * 1024


def new_token() -> str:
    return "veil-" + secrets.token_urlsafe(24)


def _error(err: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


class _Auth:
    """Every /v1 request needs ``Authorization: Bearer <token>`` (checked in constant time)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.token = app, token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization", b"")
            given = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not secrets.compare_digest(given, self.token):
                msg = (
                    "no API key given: send the token Veil shows as 'Authorization: Bearer TOKEN'"
                    if not given
                    else "incorrect API key: use the token Veil shows (Settings → Other programs, "
                    "or what `veil api` printed)"
                )
                await _error(ApiError(401, msg, code="invalid_api_key"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Api:
    """Request handling over a backend and its queue."""

    def __init__(self, backend: Backend, jobs: JobQueue) -> None:
        self.backend, self.jobs = backend, jobs

    # --- helpers ----------------------------------------------------------------------------

    async def _body(self, request: Request) -> Any:
        raw = await request.body()
        if len(raw) > MAX_BODY:
            raise ApiError(413, f"the request is larger than {MAX_BODY // (1024 * 1024)} MB")
        try:
            return json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(
                f"the body is not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc})"
            ) from None

    def _check_model(self, name: str) -> str:
        mine = self.backend.model_id()
        if name not in (mine, "veil"):
            raise ApiError(
                404,
                f"the model '{name}' does not exist here; this server has '{mine}'",
                code="model_not_found",
                param="model",
            )
        return mine

    def _plan(self, ids: list[int], wanted: int | None) -> int:
        """Tokens the reply may have: what was asked for (else the default), within context."""
        ctx = self.backend.context_length()
        if len(ids) >= ctx:
            raise bad_request(
                f"this model's maximum context length is {ctx} tokens; the prompt has {len(ids)}",
                "messages",
                "context_length_exceeded",
            )
        room = ctx - len(ids)
        if wanted is None:
            return min(self.backend.defaults().max_new_tokens, room)
        if wanted > room:
            raise bad_request(
                f"this model's maximum context length is {ctx} tokens; you requested "
                f"{len(ids) + wanted} ({len(ids)} in the prompt, {wanted} for the reply)",
                "max_tokens",
                "context_length_exceeded",
            )
        return wanted

    async def _run(
        self,
        request: Request,
        prepare: Callable[[Any], list[int]],
        req: Any,
        on_text: Callable[[str], None],
        started: Callable[[int], None],
    ) -> tuple[GenerationResult, int]:
        """Queue the job; cancel it when the client goes away. ``prepare`` tokenizes on the
        engine thread; ``started(prompt_tokens)`` is called before the first token."""
        cancel = CancelToken()

        def job() -> tuple[GenerationResult, int]:
            tokenizer = self.backend.ready()
            ids = prepare(tokenizer)
            params = req.sampling(self.backend.defaults(), self._plan(ids, req.wanted_tokens()))
            started(len(ids))
            return self.backend.generate(ids, params, on_text, cancel), len(ids)

        fut = self.jobs.submit(job)
        wrapped = asyncio.wrap_future(fut)
        while True:
            done, _ = await asyncio.wait({wrapped}, timeout=0.5)
            if done:
                if wrapped.cancelled():
                    raise ApiError(499, "the client closed the connection")
                return wrapped.result()  # type: ignore[no-any-return]
            if await request.is_disconnected():
                cancel.cancel()
                fut.cancel()

    # --- routes -----------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.backend.model_id(),
                        "object": "model",
                        "created": 0,
                        "owned_by": "veil",
                    }
                ],
            }
        )

    async def chat(self, request: Request) -> Response:
        req: ChatRequest = parse(ChatRequest, await self._body(request))
        model = self._check_model(req.model)
        messages = req.chat()
        return await self._respond(
            request,
            req,
            model,
            lambda tok: prompt_ids(tok, messages),
            "chatcmpl",
            chat=True,
        )

    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = parse(CompletionRequest, await self._body(request))
        model = self._check_model(req.model)
        return await self._respond(request, req, model, req.prompt_ids, "cmpl", chat=False)

    async def _respond(
        self,
        request: Request,
        req: Any,
        model: str,
        prepare: Callable[[Any], list[int]],
        prefix: str,
        chat: bool,
    ) -> Response:
        rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if not req.stream:
            result, n_prompt = await self._run(
                request, prepare, req, lambda _d: None, lambda _n: None
            )
            usage = _usage(n_prompt, result)
            finish = FINISH.get(result.finish_reason, "stop")
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": result.text}
            else:
                choice["text"] = result.text
            return JSONResponse(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": usage,
                }
            )
        return await self._stream(request, req, model, prepare, rid, created, chat)

    async def _stream(
        self,
        request: Request,
        req: Any,
        model: str,
        prepare: Callable[[Any], list[int]],
        rid: str,
        created: int,
        chat: bool,
    ) -> Response:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def put(kind: str, value: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, (kind, value))

        task = asyncio.ensure_future(
            self._run(request, prepare, req, lambda d: put("text", d), lambda n: put("start", n))
        )

        def ended(t: asyncio.Future[Any]) -> None:
            if not t.cancelled():
                t.exception()  # retrieved here too: the client may be gone
            put("end", None)

        task.add_done_callback(ended)
        kind, _ = await events.get()
        if kind == "end":  # failed before the first token: an ordinary error answer
            task.result()  # raises the ApiError / VeilError
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                d: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                if delta:
                    d["content"] = delta
                choice: dict[str, Any] = {"index": 0, "delta": d, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish}
            choice["logprobs"] = None
            body = {"id": rid, "object": obj, "created": created, "model": model}
            return _sse({**body, "choices": [choice]})

        async def body() -> AsyncIterator[str]:
            if chat:
                yield chunk(None, None, role=True)
            while True:
                kind, value = await events.get()
                if kind == "text":
                    yield chunk(value, None)
                    continue
                break
            try:
                result, n_prompt = task.result()
            except (ApiError, VeilError) as exc:
                err = exc if isinstance(exc, ApiError) else from_veil(exc)
                yield _sse(err.body())
                yield "data: [DONE]\n\n"
                return
            except asyncio.CancelledError:
                return
            yield chunk(None, FINISH.get(result.finish_reason, "stop"))
            if req.include_usage():
                usage = {"id": rid, "object": obj, "created": created, "model": model}
                yield _sse({**usage, "choices": [], "usage": _usage(n_prompt, result)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(
            body(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _usage(n_prompt: int, result: GenerationResult) -> dict[str, int]:
    n = len(result.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}


def create_app(backend: Backend, token: str, jobs: JobQueue | None = None) -> Starlette:
    """The ASGI app: /v1/models, /v1/chat/completions, /v1/completions behind the token."""
    if not token:
        raise VeilError("the API needs a token")
    api = Api(backend, jobs or JobQueue())

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return _error(exc)

    async def veil_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, VeilError)
        return _error(from_veil(exc))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            return _error(
                ApiError(404, f"no such endpoint: {request.url.path}", code="unknown_url")
            )
        if exc.status_code == 405:
            return _error(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))
        return _error(ApiError(exc.status_code, str(exc.detail)))

    async def internal(request: Request, exc: Exception) -> Response:
        log.exception("API request failed")  # the traceback goes to the log only
        return _error(ApiError(500, f"internal error: {type(exc).__name__}", "server_error"))

    return Starlette(
        routes=[
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/v1/chat/completions", api.chat, methods=["POST"]),
            Route("/v1/completions", api.completions, methods=["POST"]),
        ],
        middleware=[Middleware(_Auth, token=token)],
        exception_handlers={
            ApiError: api_error,
            VeilError: veil_error,
            HTTPException: http_error,
            Exception: internal,
        },
    )


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, or a one-line :class:`VeilError` (port in use, bad address)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise VeilError(f"cannot use the address '{host}': {exc.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(64)
    except OSError as exc:
        sock.close()
        if exc.errno in (98, 48, 10048):  # EADDRINUSE on Linux, macOS, Windows
            raise VeilError(
                f"port {port} on {host} is already in use",
                hint="choose another port (--port, or in Settings)",
            ) from None
        raise VeilError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")


class ApiServer:
    """uvicorn serving :func:`create_app` on a thread of its own."""

    def __init__(self, backend: Backend, token: str, host: str = "127.0.0.1", port: int = 8000):
        import uvicorn

        self.backend, self.token = backend, token
        self.jobs = JobQueue()
        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(
            create_app(backend, token, self.jobs),
            log_level="warning",
            access_log=False,  # request bodies never reach the log anyway; paths need not either
            lifespan="off",
        )
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in str(self.host) else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self) -> ApiServer:
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="veil-api", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            self.stop()
            raise VeilError("the API server did not start (see the log)")
        return self

    def serve_forever(self) -> None:
        """Serve on the calling thread until interrupted (``veil api``)."""
        self.server.run(sockets=[self.sock])

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self.jobs.close()
        with contextlib.suppress(OSError):
            self.sock.close()
