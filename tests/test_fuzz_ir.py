"""Fuzzing the IR JSON loader with mutations of small valid graphs: every attr, field and
byte replaced by values of the wrong type or range. The property: the project's own error
(naming the file) or a graph that verifies, with bounded memory; never a foreign exception."""
from __future__ import annotations

import copy
import json
import tracemalloc

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphs import Cfg, llama
from rlx_core.ir.errors import RlxError, SerializeError
from rlx_core.ir.graph import Graph
from rlx_core.ir.lir import LirModule, plan
from rlx_core.ir.ops import MaskKind
from rlx_core.ir.serialize import graph_from_json
from rlx_core.ir.verify import verify
from rlx_core.pipeline import CompilePipeline, specialize
from rlx_core.profile import CompileProfile
from test_ir import _paths  # noqa: E402  (every path into a JSON document)

SOURCE = "fuzz.rlx.json"
PEAK = 32 << 20          # bytes one load may allocate (the documents are a few KiB)
_SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _prims(m):
    x, ids, w = m.input("x", (2, 4)), m.input("ids", (3,), "i64"), m.param("w", (4,))
    h = m.rms_norm(x, w, eps=1e-5, offset=1.0)
    h = m.layer_norm(h, eps=1e-6) + m.mean(x, (1,), keepdims=True)
    t = m.transpose(m.reshape(h, (4, 2)), (1, 0))
    n = m.narrow(m.concat([t, t], 1), 1, 1, 3)
    vals, idx = m.topk(m.cumsum(m.softmax(n, axis=-1), 1), 2)
    e = m.expand(m.reshape(m.gather(m.param("emb", (5, 2)), ids), (3, 1, 2)), (3, 2, 2))
    keep = m.compare(vals, 0.5, "gt")
    return {"y": m.where(keep, m.cast(vals, "f16"), 0.0), "i": m.argmax(idx, 1), "e": e}


def _chain(m):
    x, b = m.input("x", (2, 3)), m.input("b", (3,), "f16")
    y = m.tanh(x * 2.0 + 1.0) * m.sigmoid(x) - m.cast(b, "f32")
    return m.where(m.compare(y, 0.0, "gt"), y, m.exp(y))


def _attention(m):
    q, k, v = (m.input(nm, (1, 2, 3, 4)) for nm in "qkv")
    cos, sin, pos = m.param("cos", (3, 2)), m.param("sin", (3, 2)), m.input("pos", (1,), "i64")
    kc = m.kv_write(m.state("kc", (1, 2, 8, 4)), m.rope(k, cos, sin, style="interleaved"), pos)
    vc = m.kv_write(m.state("vc", (1, 2, 8, 4)), v, pos)
    a = m.attention(m.rope(q, cos, sin), kc, vc, pos=pos, scale=0.5,
                    mask_kind=MaskKind.SLIDING_WINDOW, window=2, softcap=3.0)
    return m.act(a, "gelu_tanh")


_DOCS: dict = {}


def _docs() -> dict:
    """name -> the JSON text of a small valid graph: primitives, attention, a fused MIR and
    its LIR, a fused elementwise region."""
    if not _DOCS:
        generic = CompilePipeline(CompileProfile.preset("fusable").evolve(fusion={"target": "generic"}))
        mir = generic.optimize(llama(Cfg(layers=1, hidden=16, heads=2, kv_heads=1, ffn=24, vocab=10)))
        ew = generic.optimize(Graph.define("chain", _chain))
        assert any(n.op == "fused_elementwise" for n in ew.nodes)
        lir = plan(specialize(mir, {"seq": 2, "batch": 1}))
        for k, g in (("prims", Graph.define("prims", _prims)), ("attn", Graph.define("attn", _attention)),
                     ("mir", mir), ("ew", ew), ("lir", lir)):
            _DOCS[k] = g.to_json()
    return _DOCS


def _load(doc) -> None:
    """The property: SerializeError naming the source (or another RlxError), or a verified
    graph; and the load stays within PEAK bytes."""
    tracemalloc.start()
    try:
        g = graph_from_json(doc, SOURCE)
    except SerializeError as e:
        assert SOURCE in str(e), e
        return
    except RlxError:
        return
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < PEAK, f"loading took {peak} bytes"
    verify(g.graph if isinstance(g, LirModule) else g)


BAD = st.one_of(
    st.sampled_from([None, True, False, 0, -1, -7, 1.5, -0.5, 2 ** 63, -2 ** 64, 10 ** 30, [], {}, "", "x",
                     "f32", "causal", "nan", [1.5], [None], [[[]]], {"a": 1}, [True, 2], ["seq", -3]]),
    st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    st.integers(-10, 10), st.floats(-1e3, 1e3), st.text(max_size=5),
    st.lists(st.one_of(st.integers(-3, 9), st.text(max_size=2), st.none()), max_size=4))


@st.composite
def mutated(draw, attrs_only: bool):
    d = json.loads(_docs()[draw(st.sampled_from(sorted(_docs())))])
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(d) if p and (not attrs_only or "attrs" in p)]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = d
        for k in path[:-1]:
            parent = parent[k]
        if draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]                       # a dropped key
        elif isinstance(parent, list) and draw(st.booleans()):
            parent.insert(path[-1], copy.deepcopy(parent[path[-1]]))
        else:
            parent[path[-1]] = draw(BAD)
    return json.dumps(d)                               # NaN/Infinity tokens included


@_SETTINGS
@given(doc=mutated(attrs_only=True))
def test_mutated_attrs_give_an_rlx_error_or_a_verified_graph(doc):
    _load(doc)


@_SETTINGS
@given(doc=mutated(attrs_only=False))
def test_mutated_documents_give_an_rlx_error_or_a_verified_graph(doc):
    _load(doc)


@_SETTINGS
@given(data=st.data())
def test_byte_garbage_gives_a_serialize_error_naming_the_file(data, tmp_path_factory):
    raw = bytearray(_docs()[data.draw(st.sampled_from(sorted(_docs())))].encode())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i:i + 1] = data.draw(st.binary(min_size=0, max_size=3))
    doc = bytes(raw[:data.draw(st.integers(0, len(raw)))] if data.draw(st.booleans()) else raw)
    _load(doc)
    path = tmp_path_factory.mktemp("ir") / SOURCE
    path.write_bytes(doc)
    from rlx_core.ir.serialize import load_json_file

    try:
        load_json_file(path)
    except SerializeError as e:
        assert SOURCE in str(e)
    except RlxError:
        pass


@_SETTINGS
@given(blob=st.binary(max_size=64))
def test_binary_blobs_give_a_serialize_error(blob):
    _load(blob)
