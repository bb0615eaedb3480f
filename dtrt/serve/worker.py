"""One pipeline serving OpenAI requests: the prompt rendered and checked, the job queued on the batch-1 scheduler,
its events read with the request's deadline. The single-process server runs one Worker in its own process; each
Ray Serve replica (dtrt.serve.replicas) runs one of its own. Either way a request's answer is this code's."""

import asyncio
from dataclasses import replace

from dtrt.errors import BackendFault, DtrtError
from dtrt.frontend.requests import RequestError, encode, fit_prompt, has_chat_template
from dtrt.frontend.text import TokenPieces
from dtrt.runtime.grammar import compile_format
from dtrt.serve.config import ServeConfig
from dtrt.serve.metrics import Metrics
from dtrt.serve.scheduler import Job, QueueFull, Scheduler, ShuttingDown
from dtrt.serve.schema import Choice, OpenAIRequest, error_body


class ServeError(Exception):
    """A request's answer as an HTTP error: the status and OpenAI's error body. It crosses from a replica to the HTTP
    side as a value, so it pickles."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
        super().__init__(status, message, kind, param, code)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    @property
    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)

    def __str__(self):
        return self.message


def shutting_down() -> ServeError:
    return ServeError(503, "the server is shutting down", "unavailable")


def timed_out(timeout: float) -> ServeError:
    return ServeError(
        504,
        f"the request took longer than {timeout:g} s (the server's --request-timeout) and was cancelled",
        "timeout",
    )


class Worker:
    """A pipeline, its scheduler and its metrics: `stream` answers one choice of one request."""

    def __init__(self, pipe, cfg: ServeConfig, log=None):
        self.pipe, self.cfg, self.log = pipe, cfg, log or (lambda msg: None)
        self.method = pipe.spec.method
        self.metrics = Metrics()
        self.scheduler = Scheduler(pipe, cfg.queue_limit, self.metrics, self.log)
        self.pieces = TokenPieces(pipe.tokenizer)

    # lifecycle (the HTTP server's, or the replica's)
    def start(self):
        self.scheduler.start()

    def close(self):
        """No new jobs; the waiting ones are answered 503; the one generating goes on."""
        self.scheduler.close()

    def cancel_running(self):
        self.scheduler.cancel_running()

    def join(self, timeout: float | None = None):
        self.scheduler.join(timeout)

    def alive(self) -> bool:
        """Whether the generating thread runs (it ends only after close)."""
        return self.scheduler.alive()

    def snapshot(self) -> dict:
        cache = getattr(self.pipe, "prefix_cache", None)
        return self.metrics.snapshot(
            len(self.scheduler.waiting),
            int(self.scheduler.running is not None),
            cache.snapshot() if cache is not None else None,
        )

    async def metrics_snapshot(self) -> dict:
        return self.snapshot()

    async def health(self) -> tuple[int, dict]:
        if self.scheduler.closed:
            return 503, {"status": "shutting down"}
        return 200, {"status": "ok", "model": self.cfg.model_name}

    # one choice of one request
    def job(self, o: OpenAIRequest, chat: bool, index: int, loop) -> Job:
        """The choice's job: the prompt rendered, encoded and fitted; a bad one raises ServeError 400."""
        try:
            if chat and not has_chat_template(self.pipe.tokenizer):
                raise ServeError(
                    400,
                    f"model {self.cfg.model_name!r} has no chat template; send raw text to /v1/completions",
                    param="messages",
                )
            req = o.request
            ids = encode(self.pipe.tokenizer, req, chat=False)
            limit = self.cfg.max_prompt_tokens
            if limit is not None and len(ids) > limit:
                raise ServeError(
                    400,
                    f"the prompt is {len(ids)} tokens, more than this server's --max-prompt-tokens {limit}; shorten it",
                    param="prompt" if req.prompt is not None else "messages",
                    code="prompt_too_long",
                )
            ids = fit_prompt(
                self.pipe, ids, req.max_new_tokens, self.cfg.truncate, "max_tokens", "`dtrt serve --truncate`"
            )
        except RequestError as e:
            raise ServeError(400, str(e), param=e.param) from None
        grammar = None
        if req.response_format is not None:
            try:
                grammar = compile_format(req.response_format, self.pipe.tokenizer)
            except DtrtError as e:  # the schema, or llguidance missing
                raise ServeError(400, str(e), param="response_format") from None
        sampling = replace(req.sampling, seed=(req.sampling.seed + index) % 2**63)  # choice i: seed + i
        return Job(ids, req.max_new_tokens, sampling, req.stop, o.stream, loop, o.logprobs, grammar)

    async def stream(self, o: OpenAIRequest, chat: bool, index: int = 0, timeout: float | None = None):
        """Choice `index` of request `o` as events: ("text", (delta, logprobs entries or None)) while streaming,
        then ("done", Choice). A request that cannot be answered raises ServeError: 400 (bad input), 429 (queue
        full), 503 (shutting down, or cut by it), 504 (past `timeout` seconds, waiting included), 500 (a fault).
        Closing the stream early (the client gone) withdraws the job."""
        loop = asyncio.get_running_loop()
        job = self.job(o, chat, index, loop)
        try:
            self.scheduler.submit(job)
        except QueueFull:
            self.metrics.finished("rejected")
            raise ServeError(
                429, f"the queue is full ({self.cfg.queue_limit} requests waiting); retry later", "rate_limit_exceeded"
            ) from None
        except ShuttingDown:
            raise shutting_down() from None
        deadline = loop.time() + (self.cfg.request_timeout if timeout is None else timeout)
        sent = 0  # logprobs entries streamed
        finished = False
        try:
            while True:
                kind, value = await self._next(job, deadline)
                if kind == "text":
                    text, lps = value
                    entries = self.pieces.entries(*zip(*lps)) if lps else ([] if lps is not None else None)
                    sent += len(entries or ())
                    yield "text", (text, entries)
                    continue
                finished = True
                c = value
                if c.stop_reason == "cancelled":  # cut by a shutdown after its grace: not a finished answer
                    raise ServeError(503, "the server shut down before the generation finished", "unavailable")
                entries = None
                if c.generation.logprobs is not None:
                    entries = self.pieces.entries(c.tokens[sent:], c.generation.logprobs[sent:])
                yield "done", Choice(c, entries, job.started - job.submitted + c.generation.prefill_s)
                return
        finally:
            if not finished:  # the client is gone (cancelled, the stream closed) or out of time: stop its job
                self.scheduler.withdraw(job, job.why if job.cancel.is_set() else "cancelled")

    async def _next(self, job: Job, deadline: float):
        """The job's next event; an error event raises as ServeError; past the deadline the job is withdrawn and
        ServeError 504 raised."""
        try:
            async with asyncio.timeout_at(deadline):
                kind, value = await job.events.get()
        except TimeoutError:
            self.scheduler.withdraw(job, "timeout")
            raise timed_out(self.cfg.request_timeout) from None
        if kind == "error":
            if isinstance(value, ShuttingDown):
                raise shutting_down()
            if isinstance(value, DtrtError):
                raise ServeError(400, str(value), param=getattr(value, "param", None))
            why = str(value) if isinstance(value, BackendFault) else value.__class__.__name__
            raise ServeError(500, f"the generation failed ({why})", "server_error")
        return kind, value
