"""What an operator runs `rlx serve` with: Prometheus metrics (a registry per app), the API
key, the gate every request passes (key, shutdown, in-flight count, requests counted by
endpoint and status) and the drain of a graceful shutdown.

Which paths need the key (`Authorization: Bearer <key>`, as OpenAI's clients send it):
/v1/*, /tokenize, /detokenize and /metrics. /health and the chat page at / stay public, as
the common OpenAI-compatible servers keep them (a load balancer probes /health without a secret; the page asks for
the key itself). Keys are compared in constant time."""
from __future__ import annotations

import asyncio
import hmac
import time
import weakref

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import JSONResponse

from .protocol import ApiError

PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/metrics", "/debug/")   # a path starting so needs the key
UNDRAINED = ("/health", "/metrics")          # answered while shutting down (not counted in flight)
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
KV_WAIT_S = 0.25             # how long a scrape waits for a model's lock to read its KV bytes
# seconds; from a tiny model on a CPU (ms) to a long prompt queued behind a full batch
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 10.0)
# gauges that are ratios of two other series: recomputed from their sums, never summed
RATIOS = {"rlx_batch_occupancy": ("rlx_batch_running", "rlx_batch_size"),
          "rlx_prefix_cache_hit_rate": ("rlx_prefix_cache_hit_tokens_total",
                                        "rlx_prefix_cache_query_tokens_total")}


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def needs_key(path: str) -> bool:
    return any(path.startswith(p) if p.endswith("/") else path == p for p in PROTECTED)


def key_matches(authorization: str | None, key: str) -> bool:
    """Whether an Authorization header is `Bearer <key>` (compared in constant time)."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def ratio(num: float, den: float) -> float:
    """A ratio gauge's value: 0 while its denominator is (nothing happened yet)."""
    return num / den if den else 0.0


class SchedulerCollector:
    """The schedulers' state at scrape time: batch occupancy, queue depth, prefix-cache
    tokens looked up and hit, KV-cache bytes (not for a model run tensor-parallel: its cache
    lives in the rank processes). Reading the KV bytes needs the model's lock; while a long
    step holds it past KV_WAIT_S, the last value read is given (a scrape never waits a
    whole prefill)."""

    def __init__(self, served):
        self.served = served
        self.kv: dict = {}                   # model -> the KV bytes last read

    def describe(self):
        return []

    def collect(self):
        fams = {
            "rlx_batch_running": Metric("rlx_batch_running", "Requests (choices) in the decode batch",
                                        "gauge"),
            "rlx_batch_size": Metric("rlx_batch_size", "Most requests one decode batch holds (--max-batch)",
                                     "gauge"),
            "rlx_batch_occupancy": Metric("rlx_batch_occupancy", "Running requests / batch size", "gauge"),
            "rlx_queue_waiting": Metric("rlx_queue_waiting", "Requests (choices) waiting for a batch row",
                                        "gauge"),
            "rlx_prefix_cache_query_tokens": Metric("rlx_prefix_cache_query_tokens",
                                                    "Prompt tokens looked up in the prefix cache", "counter"),
            "rlx_prefix_cache_hit_tokens": Metric("rlx_prefix_cache_hit_tokens",
                                                  "Prompt tokens found in the prefix cache (prefill skipped)",
                                                  "counter"),
            "rlx_prefix_cache_hit_rate": Metric("rlx_prefix_cache_hit_rate",
                                                "Prefix-cache hit tokens / looked-up tokens", "gauge"),
            "rlx_prefix_cache_bytes": Metric("rlx_prefix_cache_bytes", "Bytes the prefix cache holds",
                                             "gauge"),
            "rlx_prefix_cache_evictions": Metric("rlx_prefix_cache_evictions",
                                                 "Prefix-cache blocks evicted (least recently used)",
                                                 "counter"),
            "rlx_kv_cache_bytes": Metric("rlx_kv_cache_bytes", "Bytes of KV cache and recurrent state held",
                                         "gauge"),
        }
        for name, sched in self.served.schedulers.items():
            s, labels = sched.stats(), {"model": name}
            for fam, value in (("rlx_batch_running", s["running"]), ("rlx_batch_size", s["max_batch"]),
                               ("rlx_batch_occupancy", ratio(s["running"], s["max_batch"])),
                               ("rlx_queue_waiting", s["waiting"]),
                               ("rlx_prefix_cache_hit_rate", ratio(s["prefix_hit_tokens"],
                                                                   s["prefix_query_tokens"]))):
                fams[fam].add_sample(fam, labels, float(value))
            fams["rlx_prefix_cache_query_tokens"].add_sample("rlx_prefix_cache_query_tokens_total", labels,
                                                             float(s["prefix_query_tokens"]))
            fams["rlx_prefix_cache_hit_tokens"].add_sample("rlx_prefix_cache_hit_tokens_total", labels,
                                                           float(s["prefix_hit_tokens"]))
            fams["rlx_prefix_cache_bytes"].add_sample("rlx_prefix_cache_bytes", labels,
                                                      float(s.get("prefix_cache_bytes", 0)))
            fams["rlx_prefix_cache_evictions"].add_sample("rlx_prefix_cache_evictions_total", labels,
                                                          float(s.get("prefix_cache_evictions", 0)))
            if name not in self.served.groups:
                lock = sched.model._lock
                if lock.acquire(timeout=KV_WAIT_S):
                    try:
                        self.kv[name] = sched.memory_report()["kv_bytes"]
                    finally:
                        lock.release()
                if name in self.kv:
                    fams["rlx_kv_cache_bytes"].add_sample("rlx_kv_cache_bytes", labels, float(self.kv[name]))
        return list(fams.values())


class Metrics:
    """One app's Prometheus registry (an app each, so many apps live in one process)."""

    def __init__(self, served):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("rlx_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("rlx_prompt_tokens", "Prompt tokens of generation requests", ["model"],
                                     registry=r)
        self.generation_tokens = Counter("rlx_generation_tokens", "Tokens generated", ["model"], registry=r)
        self.ttft = Histogram("rlx_time_to_first_token_seconds",
                              "From a request's arrival to its first generated token", ["model"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("rlx_inter_token_latency_seconds",
                             "Between a request's successive generated tokens", ["model"],
                             buckets=ITL_BUCKETS, registry=r)
        r.register(SchedulerCollector(served))

    def text(self) -> str:
        return generate_latest(self.registry).decode()


class Timing:
    """One generation request's token clock into `metrics`: the time from its arrival to its
    first token, then each choice's time between tokens (an event of k tokens: k gaps of its
    interval / k; tokens arriving with a choice's first one: none)."""

    def __init__(self, metrics: Metrics, model: str, arrived: float):
        self.metrics, self.model, self.arrived = metrics, model, arrived
        self.last: dict = {}                 # choice index -> when its last tokens came

    def tokens(self, index: int, count: int) -> None:
        if not count:
            return
        now = time.monotonic()
        self.metrics.generation_tokens.labels(self.model).inc(count)
        if not self.last:
            self.metrics.ttft.labels(self.model).observe(now - self.arrived)
        prev = self.last.get(index)
        gaps = [0.0] * (count - 1) if prev is None else [(now - prev) / count] * count
        for gap in gaps:
            self.metrics.itl.labels(self.model).observe(gap)
        self.last[index] = now


def merge_metrics(texts: list) -> str:
    """Prometheus texts of several replicas as one: every sample with the same name and
    labels summed (counters, histogram buckets, sums and counts, and the gauges of requests
    and bytes), the ratio gauges (RATIOS) recomputed from the summed series they divide, and
    *_created the earliest; rlx_replicas says how many texts were merged."""
    fams: dict = {}
    values: dict = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            fams.setdefault(fam.name, (fam.documentation, fam.type))
            for s in fam.samples:
                key = (fam.name, s.name, tuple(sorted(s.labels.items())))
                old = values.get(key)
                if old is None:
                    values[key] = s.value
                else:
                    values[key] = min(old, s.value) if fam.name.endswith("_created") else old + s.value
    summed = {(k[1], k[2]): v for k, v in values.items()}
    for key in list(values):
        fam, sample, labels = key
        if fam in RATIOS:
            num, den = RATIOS[fam]
            values[key] = ratio(summed.get((num, labels), 0.0), summed.get((den, labels), 0.0))
    out = {name: Metric(name, doc, typ) for name, (doc, typ) in fams.items()}
    for (fam, sample, labels), v in values.items():
        out[fam].add_sample(sample, dict(labels), v)
    replicas = Metric("rlx_replicas", "Replicas whose metrics this text sums", "gauge")
    replicas.add_sample("rlx_replicas", {}, float(len(texts)))
    registry = CollectorRegistry()
    registry.register(_Fixed([*out.values(), replicas]))
    return generate_latest(registry).decode()


class _Fixed:
    def __init__(self, families):
        self.families = families

    def describe(self):
        return []

    def collect(self):
        return self.families


class Ops:
    """An app's operating state: its health ("loading" until every model is warm, then "ok";
    "failed" when warming failed; "shutting down" once a drain starts), the requests in
    flight, the generation requests running (cancelled when a drain's grace ends), its
    metrics, the API key and an optional `metrics_merge` (async: this app's metrics text ->
    the text /metrics answers, e.g. summed over replicas)."""

    def __init__(self, served, api_key: str | None = None, metrics_merge=None, paths=()):
        self.served, self.api_key, self.metrics_merge = served, api_key or None, metrics_merge
        self.status = "loading"
        self.error: str | None = None
        self.inflight = 0
        self.live: weakref.WeakSet = weakref.WeakSet()   # (a stream never started is not kept)
        self.metrics = Metrics(served)
        self.paths = set(paths)

    @property
    def draining(self) -> bool:
        return self.status == "shutting down"

    def endpoint(self, path: str) -> str:
        """The endpoint label of a path: a route's path, else "other" (bounded label values)."""
        return path if path in self.paths else "other"

    def refusal(self, path: str, authorization: str | None) -> ApiError | None:
        """Why the gate answers a request itself (401 without the key, 503 while draining), or None."""
        if self.api_key is not None and needs_key(path) and not key_matches(authorization, self.api_key):
            return ApiError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>' "
                            "(rlx serve --api-key / RLX_API_KEY)", code="invalid_api_key",
                            type="authentication_error", headers={"WWW-Authenticate": "Bearer"})
        if self.draining and path not in UNDRAINED:
            return ApiError(503, "the server is shutting down; it takes no new requests",
                            code="shutting_down")
        return None

    async def drain(self, grace: float, settle: float = 5.0) -> None:
        """A graceful shutdown's first part: take no new requests (503), let those in flight
        finish for up to `grace` seconds, then cancel the generations left (their streams end
        with finish_reason "abort" and [DONE]) and wait up to `settle` seconds for them to be
        sent."""
        self.status = "shutting down"
        if not await self._idle_within(grace):
            for gen in list(self.live):
                gen.cancel()
            await self._idle_within(settle)

    async def _idle_within(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.inflight


class Gate:
    """ASGI middleware in front of the app: refuses what Ops.refusal says, counts the
    requests in flight (for the drain) and every answer by endpoint and status."""

    def __init__(self, app, ops: Ops):
        self.app, self.ops = app, ops

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        ops, path = self.ops, scope["path"]
        seen = {"status": 500}              # (an app that raised before answering: a 500)

        async def counted(msg):
            if msg["type"] == "http.response.start":
                seen["status"] = msg["status"]
            await send(msg)

        try:
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1") or None
            refused = ops.refusal(path, auth)
            if refused is not None:
                return await error_response(refused)(scope, receive, counted)
            tracked = path not in UNDRAINED
            ops.inflight += tracked
            try:
                await self.app(scope, receive, counted)
            finally:
                ops.inflight -= tracked
        finally:
            ops.metrics.requests.labels(ops.endpoint(path), str(seen["status"])).inc()


__all__ = ["Ops", "Gate", "Metrics", "Timing", "merge_metrics", "graceful_server", "SETTLE_S", "needs_key",
           "key_matches", "error_response",
           "PROTECTED", "METRICS_TYPE"]


SETTLE_S = 5.0               # after a drain: how long cancelled streams (and clients that read nothing) get


def graceful_server(app, grace: float, **config):
    """A uvicorn.Server for `app` whose first SIGTERM (or SIGINT) drains it (Ops.drain with
    `grace` seconds) and then exits (status 0); a second signal is uvicorn's own: exit now."""
    import uvicorn

    class Server(uvicorn.Server):
        loop = None
        draining = False

        async def serve(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig, frame):
            if self.draining or self.should_exit or self.loop is None:
                return super().handle_exit(sig, frame)
            self.draining = True
            loop = self.loop
            loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))

        async def _drain(self):
            try:
                await app.state.ops.drain(grace, SETTLE_S)
            finally:
                self.should_exit = True

    return Server(uvicorn.Config(app, timeout_graceful_shutdown=int(SETTLE_S), **config))
