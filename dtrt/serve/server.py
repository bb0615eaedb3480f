"""`dtrt serve`: an OpenAI-compatible HTTP server (aiohttp) in front of one pipeline loaded once (a Worker in this
process), or in front of Ray Serve replicas of it (dtrt.serve.replicas): the same routes, checks and bodies.

The HTTP side is asyncio; generations run one at a time in a worker thread per pipeline. Every error is a JSON
body {"error": {"message", "type", "param", "code"}}; a client that disconnects cancels its request (aiohttp's
handler cancellation), SIGINT/SIGTERM stop taking requests, answer the waiting ones 503, let the ones generating
finish within the shutdown grace, and exit 0."""

import asyncio
import hashlib
import hmac
import ipaddress
import json
import os
import signal
import socket
import threading
import time
import traceback

from dtrt.errors import DtrtError

try:
    from aiohttp import web
except ImportError:
    raise DtrtError('dtrt serve needs aiohttp: pip install "dtrt[serve]"') from None

from dtrt.frontend.requests import RequestError
from dtrt.serve.config import ServeConfig
from dtrt.serve.metrics import prometheus
from dtrt.serve.schema import chunk_body, completion_body, error_body, logprobs_body, new_id, parse_openai, usage
from dtrt.serve.worker import ServeError, Worker, shutting_down

ROUTES = "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics"
OPEN = ("/health",)  # routes that need no API key

__all__ = ["BackgroundServer", "ServeConfig", "ServeError", "Server", "bind", "serve_forever"]


def json_error(status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
    return web.json_response(error_body(message, kind, param, code), status=status)


def sse(body) -> bytes:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n".encode()


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Choices:
    """The n choices of one request, each a workers stream run in its own task, merged into one sequence of
    (index, kind, value) in the order they come. The first error of any choice raises (the others are cancelled
    on close)."""

    def __init__(self, streams):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._left = len(streams)
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, index: int, stream):
        try:
            async for kind, value in stream:
                self._queue.put_nowait((index, kind, value))
            self._queue.put_nowait((index, "end", None))
        except Exception as e:  # ServeError, or a bug: the request's answer either way
            self._queue.put_nowait((index, "error", e))
        finally:
            await stream.aclose()

    def __aiter__(self):
        return self

    async def __anext__(self):
        while self._left:
            index, kind, value = await self._queue.get()
            if kind == "end":
                self._left -= 1
                continue
            if kind == "error":
                raise value
            return index, kind, value
        raise StopAsyncIteration

    async def aclose(self):
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class Server:
    """The HTTP side over its workers: a Worker of `pipe` in this process (the default), or `workers` (Ray Serve
    replicas). Workers have `method`, `start()`, `close()`, `cancel_running()`, `join()`, `stream(o, chat, index,
    timeout)`, `metrics_snapshot()` and `health()`."""

    def __init__(self, pipe, cfg: ServeConfig, log=None, workers=None):
        self.pipe, self.cfg, self.log = pipe, cfg, log or (lambda msg: None)
        self.workers = workers if workers is not None else Worker(pipe, cfg, self.log)
        self.closing = False
        self.created = int(time.time())
        self._key = _digest(cfg.api_key) if cfg.api_key is not None else None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=self.cfg.max_request_bytes)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    def _authorize(self, request):
        """401 unless the request carries `Authorization: Bearer <the key>` (compared in constant time)."""
        if self._key is None or request.path in OPEN:
            return
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise ServeError(
                401,
                "this server needs an API key: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        if not hmac.compare_digest(_digest(given.strip()), self._key):
            raise ServeError(401, "the API key is not this server's (--api-key)", code="invalid_api_key")

    @web.middleware
    async def _errors(self, request, handler):
        try:
            self._authorize(request)
            return await handler(request)
        except ServeError as e:
            return web.json_response(e.body, status=e.status)
        except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method, body too large
            if e.status == 404:
                msg = f"no route {request.path}; dtrt serves {ROUTES}"
            elif e.status == 413:
                limit = self.cfg.max_request_bytes
                msg = f"the request body is larger than {limit} bytes (the server's --max-request-bytes)"
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
        status, body = await self.workers.health()
        return web.json_response(body, status=status)

    async def snapshot(self) -> dict:
        return await self.workers.metrics_snapshot()

    async def _metrics(self, request):
        snap = await self.snapshot()
        if request.query.get("format") == "json":
            return web.json_response(snap)
        return web.Response(text=prometheus(snap), content_type="text/plain")

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
            raise ServeError(
                400, f"the request body is not valid JSON ({getattr(e, 'msg', e.__class__.__name__)})"
            ) from None

    def _parse(self, body, chat: bool):
        try:
            o = parse_openai(body, self.cfg.defaults, chat)
        except RequestError as e:
            raise ServeError(400, str(e), param=e.param) from None
        if o.model is not None and o.model != self.cfg.model_name:
            raise ServeError(
                404,
                f"model {o.model!r} not found; this server serves {self.cfg.model_name!r} (see /v1/models)",
                param="model",
                code="model_not_found",
            )
        return o

    async def _generate(self, request, chat: bool):
        if self.closing:
            raise shutting_down()
        o = self._parse(await self._body(request), chat)
        timeout = self.cfg.request_timeout
        choices = Choices([self.workers.stream(o, chat, i, timeout) for i in range(o.n)])
        rid = new_id(chat)
        try:
            if o.stream:
                return await self._stream(request, choices, rid, chat, o)
            done = [None] * o.n
            async for index, kind, value in choices:
                if kind == "done":
                    done[index] = value
            return web.json_response(completion_body(rid, self.cfg.model_name, chat, done, self.workers.method))
        finally:  # an error, the client gone, or done: nothing of this request runs on
            await choices.aclose()

    async def _stream(self, request, choices: Choices, rid: str, chat: bool, o):
        # the first event comes before the headers, so an error that ends the request early is still a status
        event = await choices.__anext__()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        name = self.cfg.model_name
        offsets = [0] * o.n  # completions' text_offset per choice
        finished = []

        def logprobs(index, entries):
            if entries is None:
                return None
            body = logprobs_body(entries, chat, offsets[index])
            offsets[index] += sum(len(e["token"]) for e in entries)
            return body

        try:
            try:
                if chat:
                    for i in range(o.n):
                        await resp.write(sse(chunk_body(rid, name, chat, role=True, index=i)))
                while event is not None:
                    index, kind, value = event
                    if kind == "text":
                        text, entries = value
                        lps = logprobs(index, entries)
                        await resp.write(sse(chunk_body(rid, name, chat, text, index=index, logprobs=lps)))
                    else:  # done: the rest of its logprobs (tokens without text of their own) and the finish
                        finished.append(value)
                        lps = logprobs(index, value.logprobs) if value.logprobs else None
                        body = chunk_body(rid, name, chat, finish=value.finish, index=index, logprobs=lps)
                        await resp.write(sse(body))
                    event = await anext(choices, None)
                if o.include_usage:
                    usage_ = usage([ch.completion for ch in finished])
                    await resp.write(sse(chunk_body(rid, name, chat, usage_=usage_)))
                await resp.write(sse("[DONE]"))
            except ServeError as e:  # timed out (or failed) after the headers went out: the error is the last event
                await resp.write(sse(e.body))
            await resp.write_eof()
        except ConnectionError:  # the client went away mid-write: closing the choices cancels them
            pass
        return resp

    async def run(self, sock: socket.socket, stop: asyncio.Event, on_ready=None):
        """Serve on the bound socket `sock` until `stop` is set, then shut down gracefully."""
        runner = web.AppRunner(
            self.app(), handler_cancellation=True, access_log=None, shutdown_timeout=self.cfg.shutdown_grace + 5
        )
        await runner.setup()
        await web.SockSite(runner, sock).start()
        self.workers.start()
        if on_ready is not None:
            on_ready()
        try:
            await stop.wait()
        finally:
            self.closing = True
            self.workers.close()
            loop = asyncio.get_running_loop()
            late = loop.call_later(self.cfg.shutdown_grace, self.workers.cancel_running)
            await runner.cleanup()  # stops listening, then waits for the handlers still answering
            late.cancel()
            self.workers.cancel_running()
            await loop.run_in_executor(None, self.workers.join)


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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, cfg: ServeConfig) -> str | None:
    """The warning for a server reachable beyond this machine without an API key (None when there is none)."""
    if cfg.api_key is not None or is_loopback(host):
        return None
    return (
        f"warning: --host {host} listens beyond this machine and no --api-key is set: anyone who reaches it can "
        "use it (set --api-key or DTRT_API_KEY)"
    )


def serve_forever(pipe, cfg: ServeConfig, sock: socket.socket, log, workers=None, what: str | None = None):
    """`dtrt serve` on the bound `sock` until SIGINT/SIGTERM (a second one cancels the generations in flight)."""
    url = url_of(sock)

    async def main():
        stop = asyncio.Event()
        server = Server(pipe, cfg, log, workers)
        loop = asyncio.get_running_loop()

        def on_signal(name):
            if stop.is_set():
                log(f"{name} again: cancelling the generations in flight")
                server.workers.cancel_running()
                return
            log(f"{name}: shutting down (no new requests; the ones generating have {cfg.shutdown_grace:g} s)")
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig.name)
        label = what or f"{cfg.model_name} ({server.workers.method})"
        await server.run(sock, stop, lambda: log(f"dtrt serve: {label} on {url}"))
        log("dtrt serve: stopped")

    asyncio.run(main())


class BackgroundServer:
    """The server in a thread of this process on a loopback port (tests, benchmarks, embedding in an application):
    `with BackgroundServer(pipe, cfg) as s: s.url ...`; leaving the block shuts it down gracefully."""

    def __init__(self, pipe, cfg: ServeConfig, host: str = "127.0.0.1", port: int = 0, log=None, workers=None):
        self.server = Server(pipe, cfg, log, workers)
        self.sock = bind(host, port)
        self.url = url_of(self.sock)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="dtrt-serve", daemon=True)

    async def _main(self):
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        await self.server.run(self.sock, self._stop, self._ready.set)

    def __enter__(self):
        self._thread.start()
        if not self._ready.wait(120):
            raise RuntimeError("the server did not start within 120 s")
        return self

    def stop(self, timeout: float = 60):
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout)

    def __exit__(self, *exc):
        self.stop()
        return False
