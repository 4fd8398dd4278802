"""Property-based fuzzing of `rlx serve` (issue 41, section 3): hypothesis makes request
bodies (OpenAI's fields with hostile values, unknown keys, broken and deeply nested JSON,
invalid UTF-8, lone surrogates) and headers (lying Content-Lengths, odd content types,
bodies in pieces) for every route, called on the ASGI app directly with tiny numpy models.
Every answer is a well-formed 2xx or 4xx (OpenAI's error JSON), never a 500 or an
exception, and a normal greedy request answers the same before and after. Bounded: a fixed
number of examples, each request's decode bounded by the tiny model's context."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")
pytest.importorskip("rlx_blocks_llama")
pytest.importorskip("rlx_blocks_bert")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from serve_tiny import asgi_call, tiny_models  # noqa: E402


LIMIT_MB = 0.05
_SETTINGS = settings(max_examples=100, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.function_scoped_fixture])
NORMAL = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 6, "temperature": 0}

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
           | st.text(max_size=12) | st.sampled_from(["w1 w2", "", "\ud800", "tiny", "[[[", "w3"]))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c,
                                                                                     max_size=3),
                      max_leaves=10)
def mostly(good, bad):
    """`good` three times in four."""
    return st.one_of(good, good, good, bad)


clean = st.lists(st.sampled_from(["w1", "w2", "w7", "w30", "w9"]), min_size=1, max_size=8).map(" ".join)
words = mostly(clean, st.lists(st.sampled_from(["w1", "zz", "é", "[", "<", "\x00", "\ud800", ""]),
                               max_size=8).map(" ".join))
messages = mostly(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                  "content": clean}), min_size=1, max_size=3),
                  st.lists(st.fixed_dictionaries(
                      {"role": st.sampled_from(["user", "developer", "tool", 3]),
                       "content": words | values | st.lists(st.fixed_dictionaries(
                           {"type": st.sampled_from(["text", "image"]), "text": words}), max_size=2)}),
                      max_size=3) | values)
FIELDS = {
    "prompt": mostly(words, st.lists(st.integers(-3, 70), max_size=6) | st.lists(words, max_size=3) | values),
    "messages": messages,
    "input": mostly(words | st.lists(clean, min_size=1, max_size=3),
                    st.lists(st.integers(-3, 70), max_size=5) | st.lists(words, max_size=3) | values),
    "max_tokens": mostly(st.integers(1, 24), st.integers(-2, 300) | values),
    "max_completion_tokens": st.integers(-1, 20),
    "temperature": mostly(st.floats(0, 2), st.floats() | values),
    "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-2, 80),
    "seed": mostly(st.integers(0, 2**63), st.integers(-2**64, 2**65) | values),
    "stop": mostly(clean, st.lists(words, max_size=5) | values), "n": st.integers(0, 3),
    "stream": st.booleans() | values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "encoding_format": st.sampled_from(["float", "base64", "hex"]), "dimensions": st.integers(0, 9),
    "user": st.text(max_size=5), "logprobs": st.booleans(), "echo": st.booleans(),
    "top_logprobs": st.integers(-1, 22), "logit_bias": st.dictionaries(st.sampled_from(["5", "49", "50", "x"]),
                                                                      st.integers(-120, 120), max_size=2),
    "guided_regex": st.sampled_from(["w[0-9]+", "(", "", "w1|w2"]),
    "guided_choice": st.lists(st.sampled_from(["w1", "w2 w3", ""]), max_size=3),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "xml"},
                                        {"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}}]),
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function"}]),
    **{k: values for k in ("frobnicate", "tools", "min_p", "guided_json", "structured_outputs")},
}
ROUTES = {"/v1/completions": ("tiny", "prompt"), "/v1/chat/completions": ("tiny", "messages"),
          "/v1/embeddings": ("enc", "input")}


def encode(body: dict) -> bytes:
    return json.dumps(body).encode("utf-8", "surrogatepass")   # (json.dumps escapes lone surrogates)


@st.composite
def requests(draw, hostile: bool):
    """(method, path, body bytes, Content-Length kind, content type, pieces): a route's own
    model and main field, fuzzed values and extra fields, sent right; `hostile`: anything,
    anyhow (wrong routes and models, cut or deep or binary or oversize bodies, lying lengths)."""
    pick = (lambda good, bad: draw(good | bad)) if hostile else (lambda good, bad: draw(good))
    method, path = pick(st.sampled_from([("POST", p) for p in ROUTES]), st.sampled_from([
        ("GET", "/v1/models"), ("GET", "/v1/completions"), ("POST", "/v1/nowhere"), ("PUT", "/v1/models")]))
    model, main = ROUTES.get(path, ("tiny", "prompt"))
    body = {"model": pick(st.just(model), st.sampled_from(["tiny", "plain", "enc", "nope"]) | values),
            main: draw(FIELDS[main])}
    for k in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=2, unique=True)):
        body[k] = draw(FIELDS[k])
    raw = {"json": lambda: encode(body),
           "cut": lambda: encode(body)[:draw(st.integers(0, len(encode(body))))],
           "deep": lambda: draw(st.sampled_from([b"[", b'{"a":', b'{"model": "tiny", "prompt": ['])) * draw(
               st.sampled_from([1, 64, 65, 1000, 5000, 100000])),
           "binary": lambda: draw(st.binary(max_size=64)), "big": lambda: b"x" * int(LIMIT_MB * 2**20 + 1),
           "surrogate": lambda: b'{"model": "tiny", "prompt": "\\ud83d w1"}'}[
        pick(st.just("json"), st.sampled_from(["cut", "deep", "binary", "big", "surrogate"]))]()
    length = pick(st.just("exact"), st.sampled_from(["short", "long", "missing", "garbage", "huge"]))
    ctype = pick(st.just("application/json"), st.sampled_from(["text/plain", "", "application/json; x=1"]))
    return method, path, raw, length, ctype, draw(st.integers(1, 3))


def length_header(kind: str, n: int):
    return {"exact": str(n), "short": str(max(n - 1, 0)), "long": str(n + 7), "garbage": "12abc",
            "huge": str(10**15), "missing": None}[kind]


@pytest.fixture(scope="module")
def app():
    from rlx_core.serve import create_app

    a = create_app(tiny_models(), max_batch=4, max_body_mb=LIMIT_MB, body_idle_s=5)
    yield a
    a.state.served.close()


REFUSED = {"frobnicate"}          # a field no route takes: never a 2xx


def check_answer(status: int, headers: list, body: bytes, sent: bytes = b"") -> None:
    """A 2xx or 4xx; JSON (an event stream of JSON chunks when streamed); 4xx: OpenAI's error;
    a body (`sent`) with a field no route takes is not answered 2xx."""
    assert 200 <= status < 300 or 400 <= status < 500, (status, body[:300])
    if status < 300 and sent:
        try:
            keys = set(json.loads(sent))
        except (ValueError, TypeError):
            keys = set()
        assert not keys & REFUSED, (sent[:300], body[:300])
    kind = dict(headers).get(b"content-type", b"")
    if kind.startswith(b"text/event-stream"):
        events = [ln[6:] for ln in body.decode().split("\n\n") if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", body[-300:]
        for e in events[:-1]:
            assert "error" not in json.loads(e), e
        return
    out = json.loads(body)
    if status >= 400:
        assert set(out["error"]) == {"message", "type", "param", "code"}, out
        assert "/srv/private" not in out["error"]["message"]


def greedy(app) -> str:
    status, headers, body = asgi_call(app, "POST", "/v1/completions", json.dumps(NORMAL).encode())
    assert status == 200, body
    return json.loads(body)["choices"][0]["text"]


def send(app, req) -> None:
    method, path, raw, length, ctype, chunks = req
    headers = [("content-type", ctype)] if ctype else []
    cl = length_header(length, len(raw))
    headers.append(("content-length", cl) if cl is not None else ("transfer-encoding", "chunked"))
    raw = raw if method != "GET" else b""
    check_answer(*asgi_call(app, method, path, raw, headers, chunks), sent=raw)


@pytest.mark.parametrize("hostile", [False, True], ids=["fuzzed-values", "hostile"])
def test_fuzzed_requests_get_2xx_or_4xx_and_the_server_keeps_serving(app, hostile):
    before = greedy(app)

    @_SETTINGS
    @given(requests(hostile))
    def one(req):
        send(app, req)

    one()
    assert greedy(app) == before
    assert all(s.pending == 0 for s in app.state.served.schedulers.values())
