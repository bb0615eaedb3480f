"""`dtrt serve --replicas N`: N replicas of the pipeline on Ray Serve behind the same HTTP server.

The HTTP side (dtrt.serve.server: routes, API key, limits, the OpenAI bodies) stays in the `dtrt serve` process;
what generates moves into Ray Serve replicas. Each replica loads the pipeline itself from the RunSpec and runs one
Worker, the single-process server's: batch 1 behind its own bounded queue, the same checks, events and errors.
Ray Serve routes each choice to a replica by queue length (its power-of-two-choices router over the requests in
flight on each replica, at most --queue-limit + 1 there), replaces a replica that dies, and scales the count
between --replicas and --max-replicas from queue length. A request whose replica dies before it has sent anything
to the client is sent again (the output is the same: decoding is deterministic for its seed); otherwise its client
gets a 503 (or, streaming, a last error event).

A small Ray actor, the board, carries what Ray Serve has no route for: each replica reports its metrics there
every REPORT_S seconds (what /metrics shows per replica, and which replicas are alive for /health), and reads
whether the server is shutting down (then its waiting requests are answered 503) or cancelling the generations in
flight (after the shutdown grace).

Ray is imported here only when replicas are asked for: the single-process server needs none."""

import asyncio
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, replace

from dtrt.errors import DtrtError
from dtrt.runtime.spec import RunSpec, device_kind
from dtrt.serve.config import ServeConfig
from dtrt.serve.metrics import Metrics, summed_caches
from dtrt.serve.worker import ServeError, Worker, timed_out

RAY_INSTALL = 'pip install "dtrt[ray]"'
REPORT_S = 0.5  # how often a replica reports to the board
STALE_S = 3.0  # a replica not heard from for this long is not counted alive
FORGET_S = 120.0  # nor listed at all after this long
RETRIES = 1  # times a request is sent again when its replica dies before it has sent anything
TARGET_ONGOING = 2.0  # autoscaling: requests in flight per replica (one generating, one waiting) Ray Serve aims at
DEPLOYMENT = "dtrt"
OUTCOMES = {400: None, 404: None, 429: "rejected", 504: "timeout"}  # what /metrics counts a replica's error as


def import_ray(flag: str):
    """(ray, ray.serve), or the one-line error naming the install command.

    Ray Serve's router caches each replica's queue length for 10 s and, while one replica's entry is fresh, sends
    to it without asking the other (counting each request it sends): a burst then piles onto the replica it last
    heard from until that one's queue is full. Batch-1 replicas want every choice on the shorter queue of two, so
    the router here asks them each time (RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S=0, unless set otherwise); the
    asking costs a round trip of about a millisecond per request."""
    os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S", "0")
    try:
        import ray
        from ray import serve
    except ImportError:
        raise DtrtError(f"{flag}: serving replicas needs Ray Serve, which is not installed: {RAY_INSTALL}") from None
    return ray, serve


@dataclass(frozen=True)
class ReplicaPlan:
    """How many replicas, where, and what each one reserves."""

    replicas: int = 2  # at start, and the minimum when autoscaling
    max_replicas: int | None = None  # autoscale between replicas and this (None: a fixed count)
    ray_address: str | None = None  # join this Ray cluster (None: start Ray on this machine)
    threads: int | None = None  # intra-op threads per replica (None: the cluster's CPUs over max_replicas)

    def __post_init__(self):
        if self.replicas < 1:
            raise DtrtError(f"--replicas {self.replicas}: must be >= 1")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise DtrtError(f"--max-replicas {self.max_replicas}: must be >= --replicas {self.replicas}")

    @property
    def most(self) -> int:
        return self.max_replicas or self.replicas

    def deployment_options(self, cfg: ServeConfig, threads: int, gpus: float) -> dict:
        """Ray Serve's options for the replica deployment."""
        opts = {
            "name": DEPLOYMENT,
            "ray_actor_options": {"num_cpus": threads, "num_gpus": gpus},
            "max_ongoing_requests": cfg.queue_limit + 1,  # the one generating and the bounded queue behind it
            "health_check_period_s": 2.0,
            "health_check_timeout_s": 30.0,
            "graceful_shutdown_timeout_s": cfg.shutdown_grace + 5,
            "max_constructor_retry_count": 2,
        }
        if self.max_replicas is not None and self.max_replicas > self.replicas:
            opts["autoscaling_config"] = {
                "min_replicas": self.replicas,
                "initial_replicas": self.replicas,
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": TARGET_ONGOING,
            }
        else:
            opts["num_replicas"] = self.replicas
        return opts


class Board:
    """The replicas' reports and the server's shutdown state (a Ray actor, see the module's doc)."""

    def __init__(self):
        self.reports: dict[str, dict] = {}
        self.closing = False
        self.cancels = 0

    def report(self, replica: str, info: dict) -> tuple[bool, int]:
        self.reports[replica] = info | {"seen": time.time()}
        return self.closing, self.cancels

    def read(self) -> dict:
        now = time.time()
        self.reports = {k: v for k, v in self.reports.items() if now - v["seen"] < FORGET_S}
        return {k: v | {"age_s": now - v["seen"]} for k, v in self.reports.items()}

    def close(self):
        self.closing = True

    def cancel_running(self):
        self.cancels += 1


def _log(msg: str):
    print(msg, file=sys.stderr, flush=True)


class Replica:
    """One Ray Serve replica: its own pipeline (loaded here from the RunSpec), Worker and bounded queue."""

    def __init__(self, spec: RunSpec, cfg: ServeConfig, board):
        from ray import serve

        from dtrt.launch import pipeline

        self.pipe = pipeline(spec, _log)
        self.worker = Worker(self.pipe, cfg, _log)
        self.worker.start()
        self.id = serve.get_replica_context().replica_tag
        self.board, self.threads = board, spec.threads
        self._stop = threading.Event()
        self._cancels = 0
        self._reporter = threading.Thread(target=self._report, name="dtrt-report", daemon=True)
        self._reporter.start()

    def _report(self):
        import ray

        info = {"pid": os.getpid(), "node": ray.util.get_node_ip_address(), "threads": self.threads}
        while True:
            try:
                ref = self.board.report.remote(self.id, info | {"metrics": self.worker.snapshot()})
                closing, cancels = ray.get(ref, timeout=10)
            except Exception:  # the board is gone or slow (the server is stopping): try again
                closing, cancels = False, self._cancels
            if closing:
                self.worker.close()
            if cancels > self._cancels:
                self._cancels = cancels
                self.worker.cancel_running()
            if self._stop.wait(REPORT_S):
                return

    async def stream(self, o, chat: bool, index: int, timeout: float):
        """Worker.stream with its ServeError as the last event (a value, not a Ray task error)."""
        try:
            async for event in self.worker.stream(o, chat, index, timeout):
                yield event
        except ServeError as e:
            yield "error", e

    def check_health(self):
        if not self.worker.alive() and not self.worker.scheduler.closed:
            raise RuntimeError("the generating thread has stopped")

    def __del__(self):
        self._stop.set()
        self.worker.close()
        self.worker.cancel_running()


def _replica_died(e: BaseException) -> bool:
    from ray.exceptions import RayActorError

    return isinstance(e, RayActorError)


class ReplicaWorkers:
    """What the HTTP server drives in front of the replicas (the workers protocol of dtrt.serve.server.Server)."""

    def __init__(self, spec: RunSpec, cfg: ServeConfig, plan: ReplicaPlan, log=None):
        self.spec, self.cfg, self.plan, self.log = spec, cfg, plan, log or (lambda msg: None)
        self.method = spec.method
        self.metrics = Metrics()  # every request, whichever replica served it
        self.outstanding = 0  # choices admitted and not finished
        self.retried = 0
        self.threads = None
        self._ray = self._serve = self.handle = self.board = None
        self._started_ray = False
        self.app_name = f"dtrt-{os.getpid()}"

    # start and stop
    def deploy(self):
        """Start Ray (or join --ray-address), start the replicas and wait until they serve; one-line errors."""
        ray, serve = self._ray, self._serve = import_ray(f"--replicas {self.plan.replicas}")
        for name in ("ray", "ray.serve"):
            logging.getLogger(name).setLevel(logging.WARNING)
        if not ray.is_initialized():
            try:
                ray.init(
                    address=self.plan.ray_address or "local",  # a Ray of its own, even beside another one
                    include_dashboard=False,
                    logging_level=logging.WARNING,
                    log_to_driver=True,
                )
            except (ConnectionError, ValueError, RuntimeError) as e:
                where = f"--ray-address {self.plan.ray_address}" if self.plan.ray_address else "Ray"
                raise DtrtError(f"{where}: cannot start or reach Ray ({str(e).splitlines()[0]})") from None
            self._started_ray = self.plan.ray_address is None
        try:
            threads, gpus = self._resources(ray)
        except DtrtError:
            if self._started_ray:
                ray.shutdown()
            raise
        self.threads = threads
        spec = replace(self.spec, threads=threads, device="cuda" if device_kind(self.spec.device) == "cuda" else "cpu")
        serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING", "enable_access_log": False})
        self.board = ray.remote(num_cpus=0)(Board).options(name=f"{self.app_name}-board").remote()
        deployment = serve.deployment(Replica).options(**self.plan.deployment_options(self.cfg, threads, gpus))
        try:
            self.handle = serve.run(
                deployment.bind(spec, self.cfg, self.board),
                name=self.app_name,
                route_prefix=None,
                logging_config={"log_level": "WARNING", "enable_access_log": False},
            )
        except Exception as e:
            self.shutdown()
            cause = next((line for line in str(e).splitlines() if "Error" in line), str(e).splitlines()[0])
            raise DtrtError(
                f"--replicas {self.plan.replicas}: the replicas failed to start ({cause.strip()})"
            ) from None
        self._streams = self.handle.options(stream=True)

    def _resources(self, ray) -> tuple[int, float]:
        """Threads and GPUs per replica: the cluster's CPUs (GPUs) shared by the most replicas there can be, so
        replicas never oversubscribe a node (Ray reserves them); refused when the replicas cannot fit."""
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        cpus = sum(n.get("CPU", 0) for n in nodes)
        largest = max((n.get("CPU", 0) for n in nodes), default=0)
        threads = self.plan.threads or max(1, min(int(cpus // self.plan.most), int(largest)))
        need = self.plan.replicas * threads
        if need > cpus or threads > largest:
            raise DtrtError(
                f"--replicas {self.plan.replicas} x {threads} threads need {need} CPUs ({threads} on one node), and "
                f"the Ray cluster has {cpus:g} (at most {largest:g} on a node); lower --replicas or --threads"
            )
        gpus = 0.0
        if device_kind(self.spec.device) == "cuda":
            total = sum(n.get("GPU", 0) for n in nodes)
            if total == 0:
                raise DtrtError(f"--device {self.spec.device}: the Ray cluster has no GPU")
            gpus = min(1.0, total / self.plan.most)
        return threads, gpus

    def start(self):
        """The replicas serve already (deploy)."""

    def close(self):
        """No new requests reach the replicas' queues; their waiting requests are answered 503."""
        if self.board is not None:
            self.board.close.remote()

    def cancel_running(self):
        if self.board is not None:
            self.board.cancel_running.remote()

    def join(self, timeout: float | None = None):
        self.shutdown()

    def shutdown(self):
        """Delete the replicas (and stop Ray when this process started it)."""
        serve, ray = self._serve, self._ray
        if serve is None:
            return
        try:
            serve.delete(self.app_name)
        except Exception as e:  # already gone with the cluster: nothing left to delete
            self.log(f"dtrt serve: deleting the replicas: {e.__class__.__name__}: {e}")
        if self.board is not None:
            ray.kill(self.board)
            self.board = None
        if self._started_ray:
            serve.shutdown()
            ray.shutdown()
        self._serve = None

    # requests
    async def stream(self, o, chat: bool, index: int = 0, timeout: float | None = None):
        """Choice `index` of request `o` on a replica Ray Serve picks: Worker.stream's events and errors."""
        timeout = self.cfg.request_timeout if timeout is None else timeout
        capacity = self.plan.most * (self.cfg.queue_limit + 1)
        if self.outstanding >= capacity:
            self.metrics.finished("rejected")
            raise ServeError(
                429,
                f"every replica's queue is full ({self.plan.most} replicas, {self.cfg.queue_limit} requests waiting "
                "on each); retry later",
                "rate_limit_exceeded",
            )
        self.outstanding += 1
        outcome = "cancelled"  # unless it ends otherwise: the client went away
        deadline = asyncio.get_running_loop().time() + timeout + 10  # the replica times it; this is for a stuck one
        try:
            for attempt in range(RETRIES + 1):
                response = self._streams.stream.remote(o, chat, index, timeout)
                sent = done = False
                try:
                    while not done:
                        try:
                            async with asyncio.timeout_at(deadline):
                                kind, value = await anext(response)
                        except StopAsyncIteration:
                            why = "a replica ended a request without an answer"
                            raise ServeError(500, why, "server_error") from None
                        if kind == "error":
                            raise value
                        if kind == "done":
                            done, outcome = True, "ok"
                            self.metrics.finished("ok", value.completion, value.ttft_s)
                        sent = True
                        yield kind, value
                    return
                except ServeError as e:
                    outcome = OUTCOMES.get(e.status, "error")
                    if e.status == 503 and e.message == "the server is shutting down":
                        outcome = "cancelled"
                    raise
                except TimeoutError:
                    outcome = "timeout"
                    raise timed_out(timeout) from None
                except Exception as e:
                    outcome = "error"
                    if not _replica_died(e):
                        self.log(f"dtrt serve: a replica failed: {e.__class__.__name__}: {e}")
                        why = f"the generation failed ({e.__class__.__name__})"
                        raise ServeError(500, why, "server_error") from None
                    if sent or attempt == RETRIES:
                        raise ServeError(
                            503, "the replica serving this request stopped before it finished; retry", "unavailable"
                        ) from None
                    outcome = "cancelled"
                    self.retried += 1
                    self.log(f"dtrt serve: a replica stopped; choice {index} of a request is sent again")
                finally:
                    if not done:
                        response.cancel()
        finally:
            self.outstanding -= 1
            if outcome not in ("ok", None):
                self.metrics.finished(outcome)

    # what /metrics and /health read
    async def replicas(self) -> list[dict]:
        reports = await self.board.read.remote()
        out = []
        for rid, r in sorted(reports.items(), key=lambda kv: kv[1]["seen"]):
            alive = r["age_s"] < STALE_S
            out.append({"replica": rid, "pid": r["pid"], "node": r["node"], "alive": alive} | r["metrics"])
        return out

    async def metrics_snapshot(self) -> dict:
        replicas = await self.replicas()
        live = [r for r in replicas if r["alive"]]
        running = sum(r["in_flight"] for r in live)
        snap = self.metrics.snapshot(max(0, self.outstanding - running), running, summed_caches(live))
        return snap | {"replicas": replicas, "live_replicas": len(live), "retried": self.retried}

    def _running(self) -> int:
        """Replicas Ray Serve routes to (a replacement reports before it is routed to)."""
        app = self._serve.status().applications.get(self.app_name)
        return app.deployments[DEPLOYMENT].replica_states.get("RUNNING", 0) if app is not None else 0

    async def health(self) -> tuple[int, dict]:
        live = [r for r in await self.replicas() if r["alive"]]
        running = await asyncio.get_running_loop().run_in_executor(None, self._running)
        serving = min(len(live), running)
        body = {"model": self.cfg.model_name, "replicas": serving, "min_replicas": self.plan.replicas}
        if not serving:
            return 503, {"status": "no replica is serving"} | body
        return 200, {"status": "ok"} | body
