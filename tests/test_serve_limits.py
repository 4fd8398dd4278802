"""`rlx serve` against hostile requests (issue 41, 2.7), on tiny numpy models under a real
uvicorn on a loopback port: a body over the limit is a 413 before it is read, a body short
of its Content-Length a 400 (not a hang), deep JSON a 400 (not a RecursionError 500), CPU
work stays off the event loop, a client that leaves stops its decoding, bad fields are 400s
naming them, no server path reaches a client, and `top_k` and `seed` reach the sampler.
Every wait is bounded; none asserts a speed."""
from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

import pytest

for mod in ("starlette", "uvicorn"):
    pytest.importorskip(mod)
pytest.importorskip("rlx_blocks_llama")
pytest.importorskip("rlx_blocks_bert")

from serve_tiny import SECRET, Server, exchange, http_head, request_json, tiny_models  # noqa: E402

WAIT = 60                       # seconds any one exchange may take
LIMIT_MB = 0.25                 # the body limit of the app under test
IDLE_S = 1.0                    # how long a body may stop arriving


@pytest.fixture(scope="module")
def models():
    return tiny_models()


@pytest.fixture(scope="module")
def server(models):
    from rlx_core.serve import create_app

    srv = Server(create_app(models, max_batch=4, max_body_mb=LIMIT_MB, body_idle_s=IDLE_S))
    yield srv
    srv.stop()


def post(srv, path: str, body, timeout: float = WAIT) -> tuple:
    return request_json(f"http://127.0.0.1:{srv.port}/v1{path}", body, timeout=timeout)

def error_of(out: dict) -> dict:
    err = out["error"]
    assert set(err) == {"message", "type", "param", "code"}, out
    return err


def greedy(srv, prompt: str = "w1 w2 w3", n: int = 6) -> str:
    code, out = post(srv, "/completions", {"model": "tiny", "prompt": prompt, "max_tokens": n,
                                           "temperature": 0})
    assert code == 200, out
    return out["choices"][0]["text"]


def test_body_over_the_limit_is_413_before_it_is_read(server):
    limit = int(LIMIT_MB * 2**20)
    # a declared length over the limit: answered at once, without sending a byte of body
    status, out = exchange(server.port, http_head("/v1/completions", 10**12))
    assert status == 413 and str(limit) in error_of(out)["message"]
    # no Content-Length (chunked): stopped as the bytes pass the limit
    chunk = b"x" * 65536
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(8)) + b"0\r\n\r\n"
    status, out = exchange(server.port, http_head("/v1/completions", None,
                                                  extra="Transfer-Encoding: chunked\r\n") + body)
    assert status == 413 and error_of(out)["code"] == "request_too_large"
    assert greedy(server) == greedy(server)              # and it still serves


def test_body_short_of_its_content_length_is_400_not_a_hang(server):
    body = b'{"model": "tiny", "prompt": "w1"}'
    status, out = exchange(server.port, http_head("/v1/completions", len(body) + 100) + body)
    assert status == 400 and "Content-Length" in error_of(out)["message"], out
    # a huge declared length with a tiny body: 413 at once
    status, out = exchange(server.port, http_head("/v1/completions", 2**62) + body)
    assert status == 413
    status, out = exchange(server.port, http_head("/v1/completions", len(body) - 3) + body)
    assert status == 400 and "not valid JSON" in error_of(out)["message"]    # the first len - 3 bytes


def test_deep_json_is_a_400_naming_the_depth(server):
    code, out = post(server, "/completions", b"[" * 100000)
    assert code == 400 and "64" in error_of(out)["message"] and "deep" in error_of(out)["message"]
    code, out = post(server, "/completions", b'{"model": "tiny", "prompt": "' + b"[" * 5000 + b'"}')
    assert code == 200, out                              # brackets in a string are text


def test_models_answer_while_a_prompt_is_tokenized(server, models):
    m = models["tiny"]
    entered, release = threading.Event(), threading.Event()
    answered: list = []
    real = m.encode_prompt

    def slow_encode(*a, **k):            # a tokenization that lasts until the test says
        entered.set()
        release.wait(WAIT)
        answered.append(("tokenizer released", time.monotonic()))
        return real(*a, **k)

    m.encode_prompt = slow_encode
    try:
        th = threading.Thread(target=lambda: answered.append(("completion", greedy(server))))
        th.start()
        assert entered.wait(WAIT)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/models", timeout=WAIT) as r:
            ids = [d["id"] for d in json.loads(r.read())["data"]]
        answered.append(("models", time.monotonic()))
        release.set()
        th.join(WAIT)
    finally:
        m.encode_prompt = real
        release.set()
    assert sorted(ids) == ["enc", "plain", "tiny"]
    assert [a[0] for a in answered][:1] == ["models"], answered   # before the tokenizer let go


@pytest.mark.parametrize("path, field", [("/completions", "prompt"), ("/chat/completions", "messages")])
def test_a_huge_prompt_is_refused_without_tokenizing_it_whole(server, models, path, field):
    """A tokenizer holds the GIL (a thread pool does not help): a prompt far over the context
    is refused after tokenizing prefixes about twice the context, not its 200 KB."""
    m = models["tiny"]
    text = "w1 w2 w3 " * 22000
    seen: list = []
    real = m.encode_prompt

    def spy(t, *a, **k):
        seen.append(len(t))
        return real(t, *a, **k)

    m.encode_prompt = spy
    try:
        body = {"prompt": text} if field == "prompt" else {"messages": [{"role": "user", "content": text}]}
        code, out = post(server, path, dict(body, model="tiny", max_tokens=1))
    finally:
        m.encode_prompt = real
    assert code == 400 and error_of(out)["param"] == field and "context" in error_of(out)["message"], out
    assert seen and max(seen) <= 16 * m.max_positions < len(text), seen


def test_a_client_that_leaves_cancels_its_request(server, models):
    m = models["tiny"]
    sched = server.app.state.served.schedulers["tiny"]
    got: list = []
    real_submit = sched.submit

    def submit(*a, **k):
        r = real_submit(*a, **k)
        got.append(r)
        return r

    sched.submit = submit
    body = json.dumps({"model": "tiny", "prompt": "w1 w2", "max_tokens": 200, "temperature": 1.0,
                       "seed": 1}).encode()
    try:
        with m._lock:                    # nothing decodes until the client has gone
            s = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)
            s.sendall(http_head("/v1/completions", len(body)) + body)
            deadline = time.monotonic() + WAIT
            while not got and time.monotonic() < deadline:
                time.sleep(0.01)
            assert got, "the request was not submitted"
            s.close()
            while not got[0].cancelled and time.monotonic() < deadline:
                time.sleep(0.01)
        assert got[0].cancelled, "the server kept the request of a client that left"
        got[0].result(WAIT)
    finally:
        sched.submit = real_submit
    assert got[0].finish_reason == "cancelled" and got[0].n_new < 200
    assert greedy(server) == greedy(server)


@pytest.mark.parametrize("body, param, words", [
    ({"model": "enc", "input": ""}, "input", "non-empty"),
    ({"model": "enc", "input": ["w1", ""]}, "input", "input[1]"),
    ({"model": "enc", "input": ["", "w1"]}, "input", "input[0]"),
])
def test_embeddings_refuse_empty_inputs(server, body, param, words):
    code, out = post(server, "/embeddings", body)
    assert code == 400 and error_of(out)["param"] == param and words in error_of(out)["message"], out


def test_no_server_path_reaches_a_client(server):
    # a lone surrogate: a 400 naming the field
    code, out = post(server, "/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", '
                                                  b'"content": "w1 \\ud800"}]}')
    err = error_of(out)
    assert code == 400 and err["param"] == "messages" and "messages[0].content" in err["message"]
    assert "surrogate" in err["message"] and SECRET not in json.dumps(out)
    # a model error naming its file (a GGUF tokenizer is named by its path): the public name
    code, out = post(server, "/chat/completions", {"model": "plain", "messages": [
        {"role": "user", "content": "w1"}]})
    assert code == 400 and "chat template" in error_of(out)["message"], out
    assert SECRET not in json.dumps(out) and "plain" in error_of(out)["message"]


def test_served_public_hides_paths(models):
    from rlx_core.serve.app import Served

    served = Served(models)
    try:
        msg = served.public(f"{SECRET}/tiny.gguf: bad; also /home/u/x/tokenizer.json and GET v1 x")
        assert msg == "tiny: bad; also <path> and GET v1 x"
    finally:
        served.close()


@pytest.mark.parametrize("extra, param", [
    ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"), ({"seed": 1.5}, "seed"),
    ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"typical_p": 0}, "typical_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"grammar": " "}, "grammar"),
    ({"guided_json": 3}, "guided_json"), ({"frobnicate": 1}, "frobnicate"),
])
def test_fields_it_cannot_honour_are_400s_naming_them(server, extra, param):
    for path, body in (("/completions", {"model": "tiny", "prompt": "w1", "max_tokens": 2}),
                       ("/chat/completions", {"model": "tiny", "max_tokens": 2,
                                              "messages": [{"role": "user", "content": "w1"}]})):
        code, out = post(server, path, dict(body, **extra))
        assert code == 400 and error_of(out)["param"] == param and param in error_of(out)["message"], out


def test_embeddings_refuse_unknown_keys(server):
    code, out = post(server, "/embeddings", {"model": "enc", "input": "w1", "prompt": "w1"})
    assert code == 400 and error_of(out)["param"] == "prompt"


def test_top_k_and_seed_sample_as_generate_does(server, models):
    """Sampled completions equal Model.generate's with the same top_k, temperature and seed
    (so seed -1 can no longer pass as seed 1, and top_k is honoured, not dropped)."""
    m = models["tiny"]
    prompt = [5, 9, 11, 20]
    outs = {}
    for top_k in (None, 1, 3):
        for seed in (0, 1):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 1.5, "seed": seed,
                    **({} if top_k is None else {"top_k": top_k})}
            code, out = post(server, "/completions", body)
            assert code == 200, out
            want = m.generate(prompt, max_new_tokens=12, do_sample=True, temperature=1.5, top_k=top_k,
                              seed=seed)[len(prompt):]
            want = [t for t in want if t not in m.eos_ids]
            assert out["choices"][0]["text"] == m.tokenizer.decode(want), (top_k, seed)
            outs[top_k, seed] = out["choices"][0]["text"]
    assert outs[1, 0] == outs[1, 1]                      # top-1: the seed no longer matters
    assert len({outs[None, 0], outs[None, 1], outs[3, 0], outs[3, 1]}) > 1


def test_an_idle_scheduler_gives_its_kv_cache_back(server, monkeypatch):
    """After a long request (a KV cache of its context) the scheduler, once idle
    idle_release_s, drops the cache; the next request rebuilds it and answers the same."""
    sched = server.app.state.served.schedulers["tiny"]
    monkeypatch.setattr(sched, "idle_release_s", 0.2)
    before = greedy(server)
    code, out = post(server, "/completions", {"model": "tiny", "prompt": "w1", "max_tokens": 200,
                                              "temperature": 1.0, "seed": 3})
    assert code == 200, out
    deadline = time.monotonic() + WAIT
    while sched.cache is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sched.cache is sched._decode is sched._prefill is None, "the idle scheduler kept its KV caches"
    assert greedy(server) == before and sched.cache is not None


@pytest.mark.parametrize("limits, name", [
    ({"max_body_mb": 0}, "max_body_mb"), ({"max_body_mb": "8"}, "max_body_mb"),
    ({"body_idle_s": -1.0}, "body_idle_s")])
def test_bad_limits_are_named(models, limits, name):
    from rlx_core.ir.errors import ModelError
    from rlx_core.serve import create_app

    with pytest.raises(ModelError, match=name):
        create_app(models, **limits)
