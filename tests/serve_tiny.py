"""What the server tests share: tiny models to serve (numpy backend, no weights to
download), a uvicorn server on a free loopback port in a thread, a raw HTTP/1.1 exchange
over a socket (what no client library sends: a lying Content-Length, a body cut short), and
a direct ASGI call of the app (no HTTP client needed)."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
SECRET = "/srv/private/models"          # the served models' sources: never shown to a client


def tiny_models() -> dict:
    """{"tiny": a LLaMA with a chat template, "plain": one without (its tokenizer named by a
    server path, as a GGUF's is), "enc": a BERT encoder}; 256 positions, numpy."""
    from tiny_models import BERT, LLAMA, bert_tensors, llama_tensors, word_tokenizer

    from rlx_core.runtime.encoder import Encoder
    from rlx_core.runtime.model import CausalLM

    cfg = dict(LLAMA, max_position_embeddings=256)
    models = {}
    for name, template in (("tiny", CHAT_TEMPLATE), ("plain", None)):
        tok = word_tokenizer(False)
        tok.chat_template, tok.name = template, f"{SECRET}/{name}.gguf"
        m = CausalLM.from_tensors(cfg, llama_tensors(cfg, np.random.default_rng(5)), tokenizer=tok,
                                  backend="numpy")
        m.source = f"{SECRET}/{name}.gguf"
        models[name] = m
    models["enc"] = Encoder.from_tensors(BERT, bert_tensors(BERT, np.random.default_rng(6)),
                                         tokenizer=word_tokenizer(True), backend="numpy")
    return models


class Server:
    """`app` under uvicorn on 127.0.0.1 (a free port) in a thread until stop()."""

    def __init__(self, app):
        import uvicorn

        self.app, self.sock = app, socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.srv.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.srv.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.srv.started, "the server did not start"

    def stop(self) -> None:
        self.srv.should_exit = True
        self.thread.join(30)
        self.sock.close()
        assert not self.thread.is_alive(), "the server did not stop"


def http_head(path: str, length: int | None, method: str = "POST", extra: str = "") -> bytes:
    cl = f"Content-Length: {length}\r\n" if length is not None else ""
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{cl}{extra}"
            f"Connection: close\r\n\r\n").encode()


def read_response(sock: socket.socket, timeout: float) -> tuple:
    """(status, JSON body or None) of the response on `sock`, read until the server closes."""
    sock.settimeout(timeout)
    data = b""
    while True:
        part = sock.recv(65536)
        if not part:
            break
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


def exchange(port: int, raw: bytes, timeout: float = 30) -> tuple:
    """Send `raw` (a whole request, maybe lying about its length) and read the answer,
    leaving the connection open for writing (so a short body is not an end of stream)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(raw)
        return read_response(s, timeout)


def asgi_call(app, method: str, path: str, body: bytes, headers: list | None = None,
              chunks: int = 1) -> tuple:
    """(status, headers, body bytes) of one request to the ASGI `app` called directly: the
    body in `chunks` pieces; after it, receive() waits until the response is sent, then
    says the client disconnected (as uvicorn does). `headers` (name, value) as given, else
    the body's Content-Length."""
    size = -(-len(body) // chunks) if body else 0
    parts = [body[i:i + size] for i in range(0, len(body), size)] if body else [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
                for i, p in enumerate(parts)]
    if headers is None:
        headers = [("content-length", str(len(body)))]
    hdrs = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": hdrs, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    out: dict = {"status": None, "headers": [], "body": b""}

    async def run():
        done = asyncio.Event()

        async def receive():
            if messages:
                return messages.pop(0)
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(msg):
            if msg["type"] == "http.response.start":
                out["status"], out["headers"] = msg["status"], msg.get("headers", [])
            elif msg["type"] == "http.response.body":
                out["body"] += msg.get("body", b"")
                if not msg.get("more_body"):
                    done.set()
        await asyncio.wait_for(app(scope, receive, send), 120)

    asyncio.run(run())
    return out["status"], out["headers"], out["body"]


def request_json(url: str, body=None, method: str = "POST", timeout: float = 120) -> tuple:
    """(status, parsed JSON) of one request to `url` (a JSON body, or bytes as they are);
    an HTTP error status is returned, not raised."""
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data if method == "POST" else None, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
