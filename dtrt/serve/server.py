"""`dtrt serve`: an OpenAI-compatible HTTP server (aiohttp) in front of one pipeline, loaded once.

The HTTP side is asyncio; generations run one at a time in the scheduler's worker thread. Every error is a JSON
body {"error": {"message", "type", "param", "code"}}; a client that disconnects cancels its request (aiohttp's
handler cancellation), SIGINT/SIGTERM stop taking requests, answer the waiting ones 503, let the one generating
finish within the shutdown grace, and exit 0."""

import asyncio
import json
import os
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field

from dtrt.errors import BackendFault, DtrtError

try:
    from aiohttp import web
except ImportError:
    raise DtrtError('dtrt serve needs aiohttp: pip install "dtrt[serve]"') from None

from dtrt.runtime.requests import Request, RequestError, encode, fit_prompt, has_chat_template
from dtrt.serve.metrics import Metrics, prometheus
from dtrt.serve.scheduler import Job, QueueFull, Scheduler, ShuttingDown
from dtrt.serve.schema import FINISH, chunk_body, completion_body, error_body, new_id, parse_openai, usage

MAX_BODY = 32 * 2**20
ROUTES = "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics"


@dataclass
class ServeConfig:
    model_name: str
    defaults: Request = field(default_factory=Request)  # what a request leaves out
    queue_limit: int = 64  # requests waiting behind the one generating; more get 429
    request_timeout: float = 600.0  # seconds, waiting included; then the request is cancelled (504)
    shutdown_grace: float = 30.0  # seconds the generation in flight may run on after a shutdown signal
    truncate: bool = False  # keep the prompt's tail when it does not fit, instead of a 400

    def __post_init__(self):
        for flag, value, ok in (
            ("--queue-limit", self.queue_limit, self.queue_limit >= 0),
            ("--request-timeout", self.request_timeout, self.request_timeout > 0),
            ("--shutdown-grace", self.shutdown_grace, self.shutdown_grace >= 0),
        ):
            if not ok:
                raise DtrtError(f"{flag} {value}: must be {'>= 0' if flag != '--request-timeout' else '> 0'}")


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, kind, param, code)


def json_error(status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
    return web.json_response(error_body(message, kind, param, code), status=status)


def sse(body) -> bytes:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n".encode()


class Server:
    def __init__(self, pipe, cfg: ServeConfig, log=None):
        self.pipe, self.cfg, self.log = pipe, cfg, log or (lambda msg: None)
        self.metrics = Metrics()
        self.scheduler = Scheduler(pipe, cfg.queue_limit, self.metrics, self.log)
        self.closing = False
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=MAX_BODY)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except HttpError as e:
            return web.json_response(e.body, status=e.status)
        except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method, body too large
            if e.status == 404:
                msg = f"no route {request.path}; dtrt serves {ROUTES}"
            elif e.status == 413:
                msg = f"the request body is larger than {MAX_BODY} bytes"
            elif e.status == 405:
                msg = f"{request.method} {request.path}: method not allowed"
            else:
                msg = f"{request.method} {request.path}: {e.reason}"
            return json_error(e.status, msg, code=str(e.status))
        except Exception as e:  # a fault: a JSON 500 to the client, the traceback to the server's log
            self.log(f"{request.method} {request.path}: {e.__class__.__name__}: {e}\n{traceback.format_exc().rstrip()}")
            return json_error(500, f"internal error ({e.__class__.__name__})", "server_error")

    # read-only endpoints
    async def _models(self, request):
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.cfg.model_name, "object": "model", "created": self.created, "owned_by": "dtrt"}],
            }
        )

    async def _health(self, request):
        if self.closing:
            return web.json_response({"status": "shutting down"}, status=503)
        return web.json_response({"status": "ok", "model": self.cfg.model_name})

    def snapshot(self) -> dict:
        return self.metrics.snapshot(len(self.scheduler.waiting), int(self.scheduler.running is not None))

    async def _metrics(self, request):
        if request.query.get("format") == "json":
            return web.json_response(self.snapshot())
        return web.Response(text=prometheus(self.snapshot()), content_type="text/plain")

    # generation
    async def _completions(self, request):
        return await self._generate(request, chat=False)

    async def _chat_completions(self, request):
        return await self._generate(request, chat=True)

    async def _body(self, request):
        raw = await request.read()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HttpError(
                400, f"the request body is not valid JSON ({getattr(e, 'msg', e.__class__.__name__)})"
            ) from None

    def _job(self, body, chat: bool, loop) -> tuple[Job, object]:
        try:
            o = parse_openai(body, self.cfg.defaults, chat)
            if o.model is not None and o.model != self.cfg.model_name:
                raise HttpError(
                    404,
                    f"model {o.model!r} not found; this server serves {self.cfg.model_name!r} (see /v1/models)",
                    param="model",
                    code="model_not_found",
                )
            if chat and not has_chat_template(self.pipe.tokenizer):
                raise HttpError(
                    400,
                    f"model {self.cfg.model_name!r} has no chat template; send raw text to /v1/completions",
                    param="messages",
                )
            req = o.request
            ids = fit_prompt(
                self.pipe,
                encode(self.pipe.tokenizer, req, chat=False),
                req.max_new_tokens,
                self.cfg.truncate,
                "max_tokens",
                "`dtrt serve --truncate`",
            )
        except RequestError as e:
            raise HttpError(400, str(e), param=e.param) from None
        return Job(ids, req.max_new_tokens, req.sampling, req.stop, o.stream, loop), o

    async def _generate(self, request, chat: bool):
        if self.closing:
            raise HttpError(503, "the server is shutting down", "unavailable")
        job, o = self._job(await self._body(request), chat, asyncio.get_running_loop())
        try:
            self.scheduler.submit(job)
        except QueueFull:
            self.metrics.finished("rejected")
            raise HttpError(
                429, f"the queue is full ({self.cfg.queue_limit} requests waiting); retry later", "rate_limit_exceeded"
            ) from None
        except ShuttingDown:
            raise HttpError(503, "the server is shutting down", "unavailable") from None
        deadline = job.loop.time() + self.cfg.request_timeout
        rid = new_id(chat)
        try:
            if o.stream:
                return await self._stream(request, job, rid, chat, o.include_usage, deadline)
            kind, value = await self._next(job, deadline, wait_for=("done", "error"))
            return web.json_response(completion_body(rid, self.cfg.model_name, chat, value, self.pipe.spec.method))
        except asyncio.CancelledError:  # the client disconnected
            self.scheduler.withdraw(job, "cancelled")
            raise

    async def _next(self, job: Job, deadline: float, wait_for=("text", "done", "error")):
        """The job's next event of the kinds in `wait_for`; an error event raises as HttpError; past the deadline
        the job is withdrawn and HttpError 504 raised."""
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    kind, value = await job.events.get()
            except TimeoutError:
                self.scheduler.withdraw(job, "timeout")
                raise HttpError(
                    504,
                    f"the request took longer than {self.cfg.request_timeout:g} s (the server's "
                    "--request-timeout) and was cancelled",
                    "timeout",
                ) from None
            if kind == "error":
                if isinstance(value, ShuttingDown):
                    raise HttpError(503, "the server is shutting down", "unavailable")
                if isinstance(value, DtrtError):
                    raise HttpError(400, str(value), param=getattr(value, "param", None))
                why = str(value) if isinstance(value, BackendFault) else value.__class__.__name__
                raise HttpError(500, f"the generation failed ({why})", "server_error")
            if kind in wait_for:
                return kind, value

    async def _stream(self, request, job: Job, rid: str, chat: bool, include_usage: bool, deadline: float):
        # the first event comes before the headers, so an error that ends the request early is still a status
        kind, value = await self._next(job, deadline)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        name = self.cfg.model_name
        try:
            try:
                if chat:
                    await resp.write(sse(chunk_body(rid, name, chat, role=True)))
                while kind == "text":
                    await resp.write(sse(chunk_body(rid, name, chat, value)))
                    kind, value = await self._next(job, deadline)
                await resp.write(sse(chunk_body(rid, name, chat, finish=FINISH[value.stop_reason])))
                if include_usage:
                    await resp.write(sse(chunk_body(rid, name, chat, usage_=usage(value))))
                await resp.write(sse("[DONE]"))
            except HttpError as e:  # timed out (or failed) after the headers went out: the error is the last event
                await resp.write(sse(e.body))
            await resp.write_eof()
        except ConnectionError:  # the client went away mid-write
            self.scheduler.withdraw(job, "cancelled")
        return resp

    async def run(self, sock: socket.socket, stop: asyncio.Event, on_ready=None):
        """Serve on the bound socket `sock` until `stop` is set, then shut down gracefully."""
        runner = web.AppRunner(
            self.app(), handler_cancellation=True, access_log=None, shutdown_timeout=self.cfg.shutdown_grace + 5
        )
        await runner.setup()
        await web.SockSite(runner, sock).start()
        self.scheduler.start()
        if on_ready is not None:
            on_ready()
        try:
            await stop.wait()
        finally:
            self.closing = True
            self.scheduler.close()
            loop = asyncio.get_running_loop()
            late = loop.call_later(self.cfg.shutdown_grace, self.scheduler.cancel_running)
            await runner.cleanup()  # stops listening, then waits for the handlers still answering
            late.cancel()
            self.scheduler.cancel_running()
            await loop.run_in_executor(None, self.scheduler.join)


def bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno and not isinstance(e, socket.gaierror) else e.strerror or str(e)
        raise DtrtError(
            f"--host {host} --port {port}: cannot listen there ({reason}); pick another --port "
            "(0: any free one) or --host"
        ) from None


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def serve_forever(pipe, cfg: ServeConfig, sock: socket.socket, log):
    """`dtrt serve` on the bound `sock` until SIGINT/SIGTERM (a second one cancels the generation in flight)."""
    url = url_of(sock)

    async def main():
        stop = asyncio.Event()
        server = Server(pipe, cfg, log)
        loop = asyncio.get_running_loop()

        def on_signal(name):
            if stop.is_set():
                log(f"{name} again: cancelling the generation in flight")
                server.scheduler.cancel_running()
                return
            log(f"{name}: shutting down (no new requests; the one generating has {cfg.shutdown_grace:g} s)")
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig.name)
        await server.run(sock, stop, lambda: log(f"dtrt serve: {cfg.model_name} ({pipe.spec.method}) on {url}"))
        log("dtrt serve: stopped")

    asyncio.run(main())


class BackgroundServer:
    """The server in a thread of this process on a loopback port (tests, benchmarks, embedding in an application):
    `with BackgroundServer(pipe, cfg) as s: s.url ...`; leaving the block shuts it down gracefully."""

    def __init__(self, pipe, cfg: ServeConfig, host: str = "127.0.0.1", port: int = 0, log=None):
        self.server = Server(pipe, cfg, log)
        self.sock = bind(host, port)
        self.url = url_of(self.sock)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="dtrt-serve", daemon=True)

    async def _main(self):
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        await self.server.run(self.sock, self._stop, self._ready.set)

    def __enter__(self):
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("the server did not start within 60 s")
        return self

    def stop(self, timeout: float = 60):
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout)

    def __exit__(self, *exc):
        self.stop()
        return False
