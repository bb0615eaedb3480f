"""Batch 1 behind a FIFO queue: one worker thread runs one generation at a time, the asyncio side submits jobs and
reads their events. A job can be cancelled while it waits (it leaves the queue) or while it runs (the decode loop
ends at its next round)."""

import asyncio
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

from dtrt.errors import DtrtError
from dtrt.frontend.text import complete
from dtrt.runtime.generate import Generation
from dtrt.runtime.sampling import SamplingConfig
from dtrt.serve.metrics import Metrics


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


@dataclass(eq=False)
class Job:
    ids: list[int]
    max_new_tokens: int
    sampling: SamplingConfig
    stop: tuple[str, ...]
    stream: bool
    loop: asyncio.AbstractEventLoop
    logprobs: int | None = None  # the top alternatives per token's logprob; None: no logprobs
    grammar: object = None  # the request's response_format compiled (dtrt.runtime.grammar.Grammar); None: text
    # ("text", (str, [(token, TokenLogprob)] since the last text or None)) ... then ("done", Completion),
    # or ("error", exception)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    why: str = "cancelled"  # the outcome a cancellation is counted as: cancelled (client gone), timeout
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None  # when its generation began

    def post(self, kind: str, value):
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def abandon(self, why: str):
        self.why = why
        self.cancel.set()


class Scheduler:
    def __init__(self, pipe, limit: int, metrics: Metrics, log):
        self.pipe, self.limit, self.metrics, self.log = pipe, limit, metrics, log
        self.waiting: deque[Job] = deque()
        self.running: Job | None = None
        self.closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="dtrt-generate", daemon=True)

    def start(self):
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job):
        with self._cond:
            if self.closed:
                raise ShuttingDown
            if len(self.waiting) + (self.running is not None) > self.limit:  # limit: jobs behind the one generating
                raise QueueFull
            self.waiting.append(job)
            self._cond.notify()

    def withdraw(self, job: Job, why: str):
        """The client is gone or out of time: drop the job from the queue, or end its generation at the next round."""
        job.abandon(why)
        with self._cond:
            if job in self.waiting:
                self.waiting.remove(job)
                self.metrics.finished(why)

    def close(self):
        """Take no more jobs; the waiting ones are answered 'shutting down'; the running one goes on."""
        with self._cond:
            self.closed = True
            for job in self.waiting:
                job.post("error", ShuttingDown())
                self.metrics.finished("cancelled")
            self.waiting.clear()
            self._cond.notify()

    def cancel_running(self):
        job = self.running
        if job is not None:
            job.abandon("cancelled")

    def join(self, timeout: float | None = None):
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _work(self):
        while True:
            with self._cond:
                while not self.waiting and not self.closed:
                    self._cond.wait()
                if not self.waiting:
                    return
                job = self.running = self.waiting.popleft()
            event = self._run(job)
            with self._cond:
                self.running = None
            job.post(*event)  # after the bookkeeping, so a client that has its answer sees the server idle
            if event[0] == "done" and event[1].stop_reason != "cancelled":
                self._remember(job, event[1])

    def _remember(self, job: Job, c):
        """The answered conversation into the prefix cache (its prompt and generated tokens prefilled), while no
        request waits: its next turn restores them (dtrt.runtime.prefix_cache). A request that comes in meanwhile
        stops it at the next prefill call (what it prefilled is kept)."""
        if getattr(self.pipe, "prefix_cache", None) is None or self.waiting:
            return
        try:
            self.pipe.remember(job.ids + c.tokens, stop_early=lambda: bool(self.waiting) or self.closed)
        except Exception as e:  # the cache is an optimization: serving goes on without it
            self.log(f"prefix cache: keeping the answered tokens failed: {e.__class__.__name__}: {e}")

    def _run(self, job: Job) -> tuple[str, object]:
        started = job.started = time.perf_counter()
        gen, sent = Generation(), 0

        def on_text(text: str):
            nonlocal sent
            lps = None
            if job.logprobs is not None:
                lps = list(zip(gen.tokens[sent:], gen.logprobs[sent:]))
                sent = len(gen.tokens)
            job.post("text", (text, lps))

        try:
            c = complete(
                self.pipe,
                job.ids,
                job.max_new_tokens,
                job.sampling,
                job.stop,
                on_text if job.stream else None,
                job.cancel.is_set,
                job.logprobs,
                gen,
                job.grammar,
            )
        except DtrtError as e:  # the request's own fault (400)
            self.metrics.finished("error")
            return "error", e
        except Exception as e:  # a backend fault or a bug (500): logged with its traceback, and serving goes on
            self.log(f"generation failed: {e.__class__.__name__}: {e}\n{traceback.format_exc().rstrip()}")
            self.metrics.finished("error")
            return "error", e
        outcome = job.why if c.stop_reason == "cancelled" else "ok"
        self.metrics.finished(outcome, c, started - job.submitted + c.generation.prefill_s)
        return "done", c
