"""`rlx serve` as operators run it (issue 48 §2, §4): /health after the warm-up, Prometheus
/metrics, the API key, CORS, the queue bound (429 with Retry-After), the request timeout,
/tokenize and /detokenize, a client that reads nothing, and the graceful shutdown (in
process, and a real `rlx serve` subprocess sent SIGTERM). Tiny numpy models under a real
uvicorn on loopback; the `openai` client or raw HTTP. Where a test needs requests to stay
queued or running it holds the model's lock (the scheduler cannot step), so nothing here
depends on speed; every wait is bounded."""
from __future__ import annotations

import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

for mod in ("openai", "starlette", "uvicorn", "prometheus_client"):
    pytest.importorskip(mod)
pytest.importorskip("rlx_blocks_llama")
pytest.importorskip("rlx_blocks_bert")

from serve_tiny import Server, tiny_models  # noqa: E402

from rlx_core.runtime.scheduler import Scheduler  # noqa: E402

WAIT = 60
KEY = "sekrit-key"


@pytest.fixture(scope="module")
def models():
    return tiny_models()


def url(srv, path: str) -> str:
    return f"http://127.0.0.1:{srv.port}{path}"


def call(srv, path: str, body=None, method: str | None = None, key: str | None = None,
         headers: dict | None = None) -> tuple:
    """(status, headers, body: parsed JSON or text) of one request; errors returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    h = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url(srv, path), data=data, method=method or ("POST" if data else "GET"),
                                 headers=h)
    try:
        with urllib.request.urlopen(req, timeout=WAIT) as r:
            status, hdrs, raw = r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        status, hdrs, raw = e.code, e.headers, e.read()
    try:
        return status, hdrs, json.loads(raw)
    except ValueError:
        return status, hdrs, raw.decode()


def wait_ready(srv) -> None:
    deadline = time.monotonic() + WAIT
    while call(srv, "/health")[0] != 200:
        assert time.monotonic() < deadline, "the server never became ready"
        time.sleep(0.05)


def client(srv, key: str = "unused"):
    import openai

    return openai.OpenAI(base_url=url(srv, "/v1"), api_key=key, max_retries=0, timeout=WAIT)


def metric(text: str, name: str, **labels) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None


def until(check, what: str):
    deadline = time.monotonic() + WAIT
    while not (out := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
    return out


@pytest.fixture
def serving(models):
    """serving(**create_app keywords) -> a started Server (stopped after the test)."""
    from rlx_core.serve import create_app

    started = []

    def make(**kw):
        srv = Server(create_app(models, **kw))
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


def greedy(models, prompt: str, n: int) -> str:
    return models["tiny"].generate(prompt, max_new_tokens=n)


def test_health_says_loading_until_the_models_are_warm(serving, models):
    lock = models["tiny"]._lock
    with lock:                                      # the warm-up cannot step
        srv = serving(max_batch=2)
        status, _, body = call(srv, "/health")
        assert (status, body) == (503, {"status": "loading"})
    wait_ready(srv)
    assert call(srv, "/health")[2] == {"status": "ok"}
    for name in ("tiny", "plain"):                  # each warmed by one request of its own scheduler
        assert srv.app.state.served.schedulers[name].stats()["submitted"] == 1


def test_api_key_guards_the_api_and_metrics_not_health_or_the_page(serving, models):
    import openai

    srv = serving(max_batch=2, api_key=KEY)
    wait_ready(srv)                                  # /health needs no key
    assert call(srv, "/")[0] == 200                  # nor does the page
    for path, body in (("/v1/models", None), ("/metrics", None),
                       ("/tokenize", {"model": "tiny", "prompt": "w1"}),
                       ("/detokenize", {"model": "tiny", "tokens": [5]}),
                       ("/v1/completions", {"model": "tiny", "prompt": "w1"})):
        for key in (None, "wrong", KEY[:-1], KEY + "x"):
            status, hdrs, out = call(srv, path, body, key=key)
            assert status == 401, (path, key, out)
            assert (out["error"]["code"], out["error"]["type"]) == ("invalid_api_key", "authentication_error")
            assert hdrs["WWW-Authenticate"] == "Bearer"
        assert call(srv, path, body, key=KEY)[0] == 200, path
    with pytest.raises(openai.AuthenticationError):
        client(srv, "wrong").models.list()
    r = client(srv, KEY).completions.create(model="tiny", prompt="w1 w2", max_tokens=4, temperature=0)
    assert r.choices[0].text == greedy(models, "w1 w2", 4)
    status, _, out = call(srv, "/v1/models", headers={"Authorization": f"Basic {KEY}"})
    assert status == 401                             # only a bearer token


def test_cors_origins(serving):
    srv = serving(max_batch=2, cors_origins=["http://ok.example"], api_key=KEY)
    pre = {"Origin": "http://ok.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    status, hdrs, _ = call(srv, "/v1/chat/completions", method="OPTIONS", headers=pre)
    assert status == 200 and hdrs["access-control-allow-origin"] == "http://ok.example"
    assert "authorization" in hdrs["access-control-allow-headers"].lower()
    status, hdrs, _ = call(srv, "/v1/chat/completions", method="OPTIONS",
                           headers=dict(pre, Origin="http://evil.example"))
    assert status == 400 and "access-control-allow-origin" not in hdrs
    status, hdrs, _ = call(srv, "/v1/models", key="wrong", headers={"Origin": "http://ok.example"})
    assert status == 401 and hdrs["access-control-allow-origin"] == "http://ok.example"   # the page reads it
    plain = serving(max_batch=2)                     # none by default
    status, hdrs, _ = call(plain, "/v1/models", headers={"Origin": "http://ok.example"})
    assert status == 200 and "access-control-allow-origin" not in hdrs


def test_tokenize_and_detokenize(serving, models):
    srv = serving(max_batch=2)
    m = models["tiny"]
    status, _, out = call(srv, "/tokenize", {"model": "tiny", "prompt": "w3 w5 w7"})
    want = m.tokenizer.encode("w3 w5 w7")
    assert status == 200 and out == {"tokens": want, "count": len(want), "max_model_len": m.max_positions}
    msgs = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w9"}]
    status, _, out = call(srv, "/tokenize", {"model": "tiny", "messages": msgs})
    assert status == 200 and out["tokens"] == m.encode_chat(msgs) and out["count"] == len(out["tokens"])
    status, _, out = call(srv, "/tokenize", {"model": "enc", "prompt": "w1 w2"})
    assert status == 200 and out["tokens"] == models["enc"].tokenizer.encode("w1 w2")
    status, _, out = call(srv, "/detokenize", {"model": "tiny", "tokens": want})
    assert status == 200 and out == {"prompt": m.tokenizer.decode(want)}
    for path, body, param in (
            ("/tokenize", {"model": "tiny"}, "prompt"),
            ("/tokenize", {"model": "tiny", "prompt": "w1", "messages": msgs}, "prompt"),
            ("/tokenize", {"model": "tiny", "prompt": ["w1"]}, "prompt"),
            ("/tokenize", {"model": "tiny", "messages": msgs, "add_special_tokens": False},
             "add_special_tokens"),
            ("/tokenize", {"model": "tiny", "prompt": "w1", "extra": 1}, "extra"),
            ("/tokenize", {"model": "nope", "prompt": "w1"}, "model"),
            ("/detokenize", {"model": "tiny", "tokens": [m.vocab_size]}, "tokens"),
            ("/detokenize", {"model": "tiny", "tokens": [-1]}, "tokens"),
            ("/detokenize", {"model": "tiny", "tokens": "w1"}, "tokens"),
            ("/detokenize", {"model": "tiny", "tokens": [1.5]}, "tokens")):
        status, _, out = call(srv, path, body)
        assert status in (400, 404) and out["error"]["param"] == param, (body, out)


def test_metrics_count_requests_tokens_and_latencies(serving, models, monkeypatch):
    monkeypatch.setattr("rlx_core.runtime.scheduler.IDLE_RELEASE_S", 3600.0)   # keep the KV cache to compare
    srv = serving(max_batch=4)
    wait_ready(srv)
    c = client(srv)
    uses = []
    for i, p in enumerate(["w1 w2", "w3", "w4 w5 w6"]):
        r = c.completions.create(model="tiny", prompt=p, max_tokens=3 + i, temperature=0)
        uses.append((r.usage.prompt_tokens, r.usage.completion_tokens))
    chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w7"}],
                                            max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    uses.append((chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens))
    shared = " ".join(f"w{3 + i % 50}" for i in range(70))  # twice: its first blocks hit the prefix cache
    for p in (shared, shared):
        r = c.completions.create(model="tiny", prompt=p, max_tokens=2, temperature=0)
        uses.append((r.usage.prompt_tokens, r.usage.completion_tokens))
    c.embeddings.create(model="enc", input=["w1"], encoding_format="float")
    assert call(srv, "/v1/completions", {"model": "tiny", "prompt": "w1", "top_p": 7})[0] == 400
    status, hdrs, text = call(srv, "/metrics")
    assert status == 200 and hdrs["Content-Type"].startswith("text/plain")
    assert metric(text, "rlx_requests_total", endpoint="/v1/completions", status="200") == 5
    assert metric(text, "rlx_requests_total", endpoint="/v1/completions", status="400") == 1
    assert metric(text, "rlx_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert metric(text, "rlx_requests_total", endpoint="/v1/embeddings", status="200") == 1
    assert metric(text, "rlx_prompt_tokens_total", model="tiny") == sum(p for p, _ in uses)
    assert metric(text, "rlx_generation_tokens_total", model="tiny") == sum(g for _, g in uses)
    assert metric(text, "rlx_time_to_first_token_seconds_count", model="tiny") == len(uses)
    assert metric(text, "rlx_inter_token_latency_seconds_count", model="tiny") == sum(g - 1 for _, g in uses)
    assert metric(text, "rlx_time_to_first_token_seconds_sum", model="tiny") > 0
    assert metric(text, "rlx_batch_size", model="tiny") == 4
    assert metric(text, "rlx_batch_running", model="tiny") == 0
    assert metric(text, "rlx_batch_occupancy", model="tiny") == 0
    assert metric(text, "rlx_queue_waiting", model="tiny") == 0
    stats = srv.app.state.served.schedulers["tiny"].stats()
    hits, queries = stats["prefix_hit_tokens"], stats["prefix_query_tokens"]
    assert metric(text, "rlx_prefix_cache_hit_tokens_total", model="tiny") == hits
    assert metric(text, "rlx_prefix_cache_query_tokens_total", model="tiny") == queries
    rate = metric(text, "rlx_prefix_cache_hit_rate", model="tiny")
    assert rate == pytest.approx(hits / queries if queries else 0)
    assert metric(text, "rlx_prefix_cache_bytes", model="tiny") == stats.get("prefix_cache_bytes", 0)
    if "prefix_cache_mb" in inspect.signature(Scheduler).parameters:     # (a runtime with the prefix cache)
        assert hits >= 64                            # the shared prompt's first two blocks, at least
        assert stats["prefix_cache_bytes"] > 0
    kv = srv.app.state.served.schedulers["tiny"].memory_report()["kv_bytes"]
    assert kv > 0 and metric(text, "rlx_kv_cache_bytes", model="tiny") == kv
    assert metric(text, "rlx_batch_size", model="enc") is None          # an encoder has no batch


def test_metrics_merge_sums_replicas_and_recomputes_ratios():
    from rlx_core.serve.ops import merge_metrics

    def replica(requests, running, size, hits, queries, ttft):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

        r = CollectorRegistry()
        Counter("rlx_requests", "r", ["endpoint", "status"], registry=r).labels("/v1/x", "200").inc(requests)
        for name, v in (("rlx_batch_running", running), ("rlx_batch_size", size),
                        ("rlx_batch_occupancy", running / size),
                        ("rlx_prefix_cache_hit_rate", hits / queries)):
            Gauge(name, name, ["model"], registry=r).labels("m").set(v)
        Counter("rlx_prefix_cache_hit_tokens", "h", ["model"], registry=r).labels("m").inc(hits)
        Counter("rlx_prefix_cache_query_tokens", "q", ["model"], registry=r).labels("m").inc(queries)
        h = Histogram("rlx_time_to_first_token_seconds", "t", ["model"], buckets=(0.1, 1.0), registry=r)
        for t in ttft:
            h.labels("m").observe(t)
        return generate_latest(r).decode()

    text = merge_metrics([replica(3, 1, 4, 10, 40, [0.05, 0.5]), replica(5, 3, 4, 30, 40, [2.0])])
    assert metric(text, "rlx_replicas") == 2
    assert metric(text, "rlx_requests_total", endpoint="/v1/x", status="200") == 8
    assert metric(text, "rlx_batch_running", model="m") == 4
    assert metric(text, "rlx_batch_size", model="m") == 8
    assert metric(text, "rlx_batch_occupancy", model="m") == 0.5               # 4 / 8, not 0.25 + 0.75
    assert metric(text, "rlx_prefix_cache_hit_rate", model="m") == 0.5         # 40 / 80
    for le, n in (("0.1", 1), ("1.0", 2), ("+Inf", 3)):
        assert metric(text, "rlx_time_to_first_token_seconds_bucket", model="m", le=le) == n
    assert metric(text, "rlx_time_to_first_token_seconds_sum", model="m") == pytest.approx(2.55)


def test_queue_bound_429_with_retry_after_others_unaffected(serving, models):
    import openai

    srv = serving(max_batch=1, max_queue=2)
    wait_ready(srv)
    prompts = [f"w{i} w{i + 1}" for i in range(1, 11)]
    streams, refused = {}, {}

    def open_stream(i):
        try:
            streams[i] = client(srv).completions.create(model="tiny", prompt=prompts[i], max_tokens=4,
                                                        temperature=0, stream=True)
        except openai.RateLimitError as e:
            refused[i] = e

    with models["tiny"]._lock:                      # nothing finishes: 1 in the batch + 2 waiting
        threads = [threading.Thread(target=open_stream, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        assert len(streams) == 3 and len(refused) == 7, (sorted(streams), sorted(refused))
        for e in refused.values():
            assert e.status_code == 429 and e.response.headers["Retry-After"] == "1"
            assert "--max-queue 2" in e.message

        def two_waiting():
            text = call(srv, "/metrics")[2]          # (answers while the model is busy)
            return text if metric(text, "rlx_queue_waiting", model="tiny") == 2 else None
        text = until(two_waiting, "two requests never showed as waiting")
        assert metric(text, "rlx_requests_total", endpoint="/v1/completions", status="429") == 7
    for i, stream in streams.items():               # the admitted ones answer as alone
        assert "".join(ch.choices[0].text for ch in stream) == greedy(models, prompts[i], 4)
    r = client(srv).completions.create(model="tiny", prompt="w1", max_tokens=2, temperature=0)
    assert r.choices[0].text == greedy(models, "w1", 2)
    assert until(lambda: srv.app.state.served._admitted["tiny"] == 0, "admissions were not given back")


def raw_stream(port: int, body: dict, rcvbuf: int | None = None, key: str | None = None,
               path: str = "/v1/chat/completions") -> socket.socket:
    """A socket that sent a streamed request (a small receive buffer when `rcvbuf`)."""
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(WAIT)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
              f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    return s


def read_all(s: socket.socket) -> bytes:
    out = b""
    while part := s.recv(1 << 16):
        out += part
    return out


def events(raw: bytes) -> list:
    """The data of the server-sent events in a chunked HTTP response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0], head
    data, rest = b"", body
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        data, rest = data + rest[:n], rest[n + 2:]
    return [e[len("data: "):] for e in data.decode().split("\n\n") if e]


def test_a_client_that_reads_nothing_does_not_hold_others(serving, models):
    srv = serving(max_batch=2)
    wait_ready(srv)
    sched = srv.app.state.served.schedulers["tiny"]
    before = sched.stats()["submitted"]
    slow = raw_stream(srv.port, {"model": "tiny", "messages": [{"role": "user", "content": "w1"}],
                                 "max_tokens": 200, "logprobs": True, "top_logprobs": 20, "stream": True,
                                 "ignore_eos": True},
                      rcvbuf=4096)
    try:
        until(lambda: sched.stats()["submitted"] > before, "the slow request was not submitted")
        c = client(srv)
        for p in ("w2 w3", "w4", "w5 w6 w7"):       # others get their answers meanwhile
            assert c.completions.create(model="tiny", prompt=p, max_tokens=5, temperature=0).choices[0].text \
                == greedy(models, p, 5)
        # its generation ended at its max_tokens and gave its batch row back, unread
        until(lambda: sched.stats()["running"] == 0 and srv.app.state.served._admitted["tiny"] == 0,
              "the unread request kept its batch row")
    finally:
        slow.close()
    assert c.completions.create(model="tiny", prompt="w1", max_tokens=2, temperature=0).choices[0].text \
        == greedy(models, "w1", 2)


def test_request_timeout_cancels(serving, models):
    import openai

    srv = serving(max_batch=2, request_timeout=0.5)
    wait_ready(srv)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 5}
    with models["tiny"]._lock:                      # the request cannot finish in time
        status, _, out = call(srv, "/v1/chat/completions", body)
        assert status == 504 and out["error"]["code"] == "request_timeout"
        assert "0.5 s" in out["error"]["message"] and "--request-timeout" in out["error"]["message"]
        s = raw_stream(srv.port, dict(body, stream=True))
        got = events(read_all(s))
        s.close()
    err = json.loads(got[-2])["error"]
    assert err["code"] == "request_timeout" and got[-1] == "[DONE]"
    until(lambda: srv.app.state.served._admitted["tiny"] == 0, "timed-out requests kept their rows")
    r = client(srv).chat.completions.create(model="tiny", messages=body["messages"], max_tokens=3,
                                            temperature=0)
    assert r.choices[0].message.content == models["tiny"].generate("w1", max_new_tokens=3, chat=True)
    with pytest.raises(openai.InternalServerError):  # (504 through the client)
        with models["tiny"]._lock:
            client(srv).chat.completions.create(model="tiny", messages=body["messages"], max_tokens=3)


def test_drain_refuses_new_requests_then_aborts_what_outlives_the_grace(models):
    """In process: a stream the scheduler cannot finish (its lock held) when SIGTERM comes;
    new requests get 503 and /health says shutting down; after the grace the stream ends
    with finish_reason "abort" and [DONE] and the server stops."""
    from rlx_core.serve import create_app
    from rlx_core.serve.ops import graceful_server

    app = create_app(models, max_batch=2)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = graceful_server(app, 0.5, log_level="warning")
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    port = sock.getsockname()[1]
    at = SimpleNamespace(port=port)
    until(lambda: srv.started, "the server did not start")
    wait_ready(at)
    sched = app.state.served.schedulers["tiny"]
    with models["tiny"]._lock:
        before = sched.stats()["submitted"]
        s = raw_stream(port, {"model": "tiny", "messages": [{"role": "user", "content": "w1"}],
                              "max_tokens": 20, "stream": True})
        until(lambda: sched.stats()["submitted"] > before, "the stream was not submitted")
        until(lambda: app.state.ops.live, "the stream's generation was not registered")
        srv.handle_exit(signal.SIGTERM, None)
        until(lambda: call(at, "/health")[0] == 503, "/health did not say shutting down")
        assert call(at, "/health")[2] == {"status": "shutting down"}
        status, _, out = call(at, "/v1/models")
        assert status == 503 and out["error"]["code"] == "shutting_down"
        until(lambda: all(c.cancelled for g in list(app.state.ops.live) for c in g.choices),
              "the grace ended and nothing was cancelled")
    got = events(read_all(s))
    s.close()
    assert got[-1] == "[DONE]" and json.loads(got[-2])["choices"][0]["finish_reason"] == "abort", got[-3:]
    th.join(WAIT)
    sock.close()
    assert not th.is_alive()


def test_rlx_serve_sigterm_lets_a_running_stream_finish(tmp_path):
    """A real `rlx serve` (a tiny LLaMA folder, numpy) with RLX_API_KEY, sent SIGTERM while
    a streamed request is running: its client sent the headers with `Expect: 100-continue`,
    got the 100 (so the request is in the handler) and holds its body back. /health and new
    requests then get 503; the body sent, the stream runs to its max_tokens and ends with its
    finish_reason and [DONE]; the process exits 0."""
    from tiny_models import tiny_llama_folder

    folder = tiny_llama_folder(tmp_path / "tiny")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, RLX_API_KEY=KEY)
    proc = subprocess.Popen([sys.executable, "-m", "rlx_core.cli", "serve", folder, "--backend", "numpy",
                             "--port", str(port), "--shutdown-grace", "60", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    at = SimpleNamespace(port=port)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if call(at, "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "rlx serve never became ready"
            time.sleep(0.2)
        assert call(at, "/v1/models")[0] == 401                    # the key came from RLX_API_KEY
        body = json.dumps({"model": folder, "prompt": "w1 w2", "max_tokens": 20, "ignore_eos": True,
                           "stream": True, "stream_options": {"include_usage": True}}).encode()
        s = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\nExpect: 100-continue\r\n"
                  "Connection: close\r\n\r\n".encode())
        interim = b""
        while not interim.endswith(b"\r\n\r\n"):
            interim += s.recv(1)
        assert interim.startswith(b"HTTP/1.1 100"), interim      # the handler is reading the body
        proc.send_signal(signal.SIGTERM)
        until(lambda: call(at, "/health")[0] == 503, "/health did not say shutting down")
        assert call(at, "/health")[2] == {"status": "shutting down"}
        status, _, out = call(at, "/v1/models", key=KEY)
        assert status == 503 and out["error"]["code"] == "shutting_down"
        s.sendall(body)
        got = events(read_all(s))
        s.close()
        chunks = [json.loads(e) for e in got[:-1]]
        finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert got[-1] == "[DONE]" and finals[-1] == "length" and finals.count("length") == 1
        assert chunks[-1]["usage"]["completion_tokens"] == 20
        assert proc.wait(WAIT) == 0, proc.communicate()[1].decode()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT)


def fd_room(want: int) -> int:
    """`want` open files, raising the soft limit toward the hard one where it is lower."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        top = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))
        soft = top
    return want if soft == resource.RLIM_INFINITY else min(want, soft)


def test_a_client_opening_1000_streams_gets_429s_and_others_are_served(serving, models):
    srv = serving(max_batch=2, max_queue=4)
    wait_ready(srv)
    count = 1000 if fd_room(2 * 1000 + 200) >= 2 * 1000 + 200 else 300   # (both ends are in this process)
    body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 3, "temperature": 0, "stream": True}
    socks = []
    try:
        with models["tiny"]._lock:                  # none finishes while they arrive
            for _ in range(count):
                socks.append(raw_stream(srv.port, body, path="/v1/completions"))
            statuses = []
            for s in socks:
                line = b""
                while not line.endswith(b"\r\n"):
                    line += s.recv(1)
                statuses.append(int(line.split()[1]))
            assert statuses.count(200) == 6 and statuses.count(429) == count - 6, set(statuses)
        for s, status in zip(socks, statuses):
            if status == 200:                        # the admitted streams finish as alone
                got = events(b"HTTP/1.1 200 OK\r\n" + read_all(s))
                text = "".join(json.loads(e)["choices"][0]["text"] for e in got[:-1])
                assert got[-1] == "[DONE]" and text == greedy(models, "w1 w2", 3)
    finally:
        for s in socks:
            s.close()
    r = client(srv).completions.create(model="tiny", prompt="w3", max_tokens=2, temperature=0)
    assert r.choices[0].text == greedy(models, "w3", 2)


def test_scheduler_options_reach_only_a_scheduler_that_takes_them(models):
    from rlx_core.ir.errors import ModelError
    from rlx_core.serve.app import Served

    with pytest.raises(ModelError, match=r"scheduler options \['no_such_option'\] are not taken"):
        Served(models, scheduler_options={"no_such_option": 1})
    with pytest.raises(ModelError, match=r"\['prefill_chunk'\] are not available for 'tiny', which is served "
                                         r"tensor-parallel"):
        Served(models, groups={"tiny": object()}, scheduler_options={"prefill_chunk": 64})
    takes = [k for k in ("prefix_cache_mb", "prefill_chunk") if k in inspect.signature(Scheduler).parameters]
    if takes:                                        # (the runtime's prefix cache and chunked prefill)
        served = Served(models, max_batch=2, scheduler_options={k: 64 for k in takes})
        served.close()


def test_health_reports_a_failed_warm_up(serving, monkeypatch):
    from rlx_core.ir.errors import ModelError
    from rlx_core.serve.app import Served

    def broken(self):
        raise ModelError(f"{self.models['plain'].source}: the prefill graph failed to compile")

    monkeypatch.setattr(Served, "warm", broken)
    srv = serving(max_batch=2)

    def warmed():
        answer = call(srv, "/health")
        return answer if answer[2]["status"] != "loading" else None
    status, _, out = until(warmed, "the warm-up never ended")
    assert status == 503 and out["status"] == "failed" and "failed to compile" in out["error"]
    assert "/srv/private" not in out["error"] and "plain" in out["error"]    # no server path


def test_debug_steps_lists_the_scheduler_runs_behind_the_key(serving, models):
    """GET /debug/steps: the scheduler's runs (Scheduler.step_log) on the shared monotonic
    clock: a greedy request of n tokens is a prefill piece then n - 1 decode steps of one row,
    in order, each ended after the request began; `since` leaves out the older; the key
    guards it; a bad model or `since` is a 4xx naming it."""
    srv = serving(max_batch=2, api_key=KEY)
    wait_ready(srv)
    t0 = time.monotonic()
    r = client(srv, KEY).completions.create(model="tiny", prompt="w1 w2 w3", max_tokens=4, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4
    assert call(srv, f"/debug/steps?model=tiny&since={t0}")[0] == 401
    status, _, out = call(srv, f"/debug/steps?model=tiny&since={t0}", key=KEY)
    assert status == 200 and out["model"] == "tiny" and out["clock"] == "monotonic"
    steps = out["steps"]
    assert [(s["kind"], s["rows"]) for s in steps] == [("piece", 0)] + [("decode", 1)] * 3, steps
    assert steps[0]["piece"] >= 3 and all(s["piece"] == 0 for s in steps[1:])
    ends = [s["end"] for s in steps]
    assert t0 < ends[0] and ends == sorted(ends) and ends[-1] < time.monotonic()
    assert all(0 < s["seconds"] <= s["end"] - t0 for s in steps)
    status, _, later = call(srv, f"/debug/steps?model=tiny&since={ends[1]}", key=KEY)
    assert status == 200 and later["steps"] == steps[2:]
    for query, code, param in (("?model=nope", 404, "model"), ("?model=enc", 400, "model"),
                               ("?model=tiny&since=soon", 400, "since")):
        status, _, err = call(srv, "/debug/steps" + query, key=KEY)
        assert status == code and err["error"]["param"] == param, (query, err)
    status, _, err = call(srv, "/debug/steps", key=KEY)        # two causal models served: name one
    assert status == 400 and err["error"]["param"] == "model"
