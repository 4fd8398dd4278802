"""The IR: dtype promotion, shapes with symbols, builder errors, verify, text and JSON of
every level, and robustness of the JSON loader and the builder against garbage."""
from __future__ import annotations

import copy
import itertools
import json
import re

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlx_core
from graphs import Cfg, llama, random_params
from rlx_core.ir.dtype import BF16, BOOL, C64, F16, F32, F64, I32, DType, promote
from rlx_core.ir.errors import DTypeError, GraphError, RlxError, SerializeError, ShapeError
from rlx_core.ir.graph import Builder, Graph, Node
from rlx_core.ir.lir import LirModule, plan
from rlx_core.ir.ops import OPS, MaskKind
from rlx_core.ir.serialize import graph_from_json, load_json_file
from rlx_core.ir.shape import Shape, broadcast_dims
from rlx_core.ir.verify import verify
from rlx_core.pipeline import CompilePipeline, specialize
from rlx_core.profile import CompileProfile

ALL = list(DType)
INTS = [d for d in ALL if d.is_int]
FLOAT_RANK = {F16: 0, BF16: 0, F32: 1, F64: 2}


# ----------------------------------------------------------------------------- dtypes
def test_promotion_is_commutative_idempotent_and_associative():
    for a in ALL:
        assert promote(a, a) is a
        for b in ALL:
            assert promote(a, b) is promote(b, a), (a, b)
            for c in ALL:
                assert promote(promote(a, b), c) is promote(a, promote(b, c)), (a, b, c)


def test_promotion_kinds():
    for a in ALL:
        assert promote(BOOL, a) is a                                 # bool is the identity
        assert promote(C64, a) is C64                                # complex dominates
    for i in INTS:
        for f in (F16, BF16, F32, F64):
            assert promote(i, f) is f                                # a float keeps its type
    assert promote(F16, BF16) is F32                                 # neither holds the other
    for a, b in itertools.product((F16, BF16, F32, F64), repeat=2):
        r = promote(a, b)
        assert FLOAT_RANK[r] >= max(FLOAT_RANK[a], FLOAT_RANK[b])


@pytest.mark.parametrize("a,b", list(itertools.combinations_with_replacement(INTS, 2)),
                         ids=lambda d: d.value)
def test_int_promotion_holds_both_ranges(a, b):
    r = promote(a, b)
    assert r.is_int
    for t in (a, b):
        info, rinfo = np.iinfo(t.np), np.iinfo(r.np)
        assert rinfo.min <= info.min and info.max <= rinfo.max, f"{a}+{b} -> {r} cannot hold {t}"


def test_dtype_parse():
    assert DType.parse("bfloat16") is BF16 and DType.parse(np.float16) is F16
    assert DType.parse(np.dtype("int32")) is I32 and DType.parse(F64) is F64
    for bad in ("f8", "int128", 3.5, [1], {"a": 1}, None, "i4,i4", ""):
        with pytest.raises(DTypeError):
            DType.parse(bad)


# ----------------------------------------------------------------------------- shapes
def test_shape_with_symbols():
    s = Shape(("batch", "seq", 8), "f16")
    assert not s.is_static and s.symbols == {"batch", "seq"} and s.rank == 3
    assert str(s) == "f16[batch,seq,8]"
    with pytest.raises(ShapeError, match="unbound"):
        s.numel()
    b = s.bind({"batch": 2, "seq": 5})
    assert b.is_static and b.dims == (2, 5, 8) and b.nbytes() == 2 * 5 * 8 * 2
    assert s.bind({"seq": 3}).dims == ("batch", 3, 8)
    assert broadcast_dims(("seq", 1, 4), (3, 4)) == ("seq", 3, 4)
    assert broadcast_dims(("seq", 4), ("seq", 4)) == ("seq", 4)
    with pytest.raises(ShapeError):
        broadcast_dims(("seq", 3), ("seq", 4))
    for bad in ((-1,), (1.5,), (True,), (None,)):
        with pytest.raises(ShapeError):
            Shape(bad, F32)


# ----------------------------------------------------------------------------- builder errors
@pytest.mark.parametrize("build,err,op", [
    (lambda m: m.matmul(m.input("a", (2, 3)), m.input("b", (4, 5))), ShapeError, "matmul"),
    (lambda m: m.input("a", (2, 3)) + m.input("b", (4,)), ShapeError, "binary"),
    (lambda m: m.where(m.input("c", (2,)), m.input("a", (2,)), m.input("b", (2,))), DTypeError, "where"),
    (lambda m: m.gelu(m.input("a", (2,), "i32")), DTypeError, "activation"),
    (lambda m: m.rms_norm(m.input("a", (2, 8)), m.param("w", (4,))), ShapeError, "rms_norm"),
    (lambda m: m.reshape(m.input("a", (2, 3)), (4, 2)), ShapeError, "reshape"),
    (lambda m: m.transpose(m.input("a", (2, 3)), (0, 0)), ShapeError, "transpose"),
    (lambda m: m.narrow(m.input("a", (2, 3)), 1, 2, 2), ShapeError, "narrow"),
    (lambda m: m.concat([m.input("a", (2, 3)), m.input("b", (3, 3))], 1), ShapeError, "concat"),
    (lambda m: m.gather(m.input("t", (5, 2)), m.input("i", (3,))), DTypeError, "gather"),
    (lambda m: m.attention(m.input("q", (1, 3, 4, 8)), m.input("k", (1, 2, 4, 8)),
                           m.input("v", (1, 2, 4, 8))), ShapeError, "attention"),
    (lambda m: m.attention(m.input("q", (1, 2, 4, 8)), m.input("k", (1, 2, 4, 8)),
                           m.input("v", (1, 2, 4, 8)), mask_kind="sliding_window"), ShapeError, "attention"),
    (lambda m: m.rope(m.input("x", (1, 2, 4, 8)), m.input("c", (4, 8)), m.input("s", (4, 8))),
     ShapeError, "rope"),
    (lambda m: m.topk(m.input("x", (2, 3)), 4), ShapeError, "topk"),
    (lambda m: m.reduce(m.input("x", (2, 3)), "sum", (5,)), ShapeError, "reduce"),
    (lambda m: m.linear(m.input("x", (2, 3)), m.param("w", (4, 5))), ShapeError, "linear"),
])
def test_builder_errors_name_the_op(build, err, op):
    with pytest.raises(err, match=f"op '{op}'"):
        build(Builder("bad"))


def test_builder_graph_errors():
    m = Builder("g")
    x = m.input("x", (2,))
    with pytest.raises(GraphError, match="already used"):
        m.param("x", (2,))
    with pytest.raises(GraphError, match="unknown op 'nope'"):
        m.add("nope", (x,))
    with pytest.raises(GraphError, match="unknown attr"):
        m.add("activation", (x,), fn="tanh", bogus=1)
    with pytest.raises(GraphError, match="missing required attr 'fn'"):
        m.add("activation", (x,))
    with pytest.raises(GraphError, match="takes inputs"):
        m.add("binary", (x,), op="add")
    with pytest.raises(GraphError, match="of this graph"):
        Builder("other").act(x, "tanh")
    with pytest.raises(GraphError, match="no outputs"):
        m.build()


# ----------------------------------------------------------------------------- attr schemas
def _x(m):
    return m.input("x", (2, 4))


def _qkv(m):
    return tuple(m.input(n, (1, 2, 3, 4)) for n in "qkv")


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("op,attr,call,values,expect", [
    ("rms_norm", "eps", lambda m, v: m.rms_norm(_x(m), eps=v),
     ["abc", None, [1e-6], NAN, INF, -1e-6, 0.0, True, 10 ** 400], "a finite float > 0"),
    ("layer_norm", "eps", lambda m, v: m.layer_norm(_x(m), eps=v), [NAN, -INF, "1e-5"], "a finite float > 0"),
    ("rms_norm", "offset", lambda m, v: m.rms_norm(_x(m), offset=v), [NAN, INF, "1", False], "a finite float"),
    ("softmax", "axis", lambda m, v: m.softmax(_x(m), axis=v), [1.5, True, None, "1", [1]], "an int"),
    ("attention", "window", lambda m, v: m.attention(*_qkv(m), window=v), [-1, 1.5, True], "an int >= 0"),
    ("attention", "scale", lambda m, v: m.add("attention", _qkv(m), scale=v), [NAN, INF, "0.5", None],
     "a finite float"),
    ("attention", "softcap", lambda m, v: m.add("attention", _qkv(m), scale=1.0, softcap=v), [-1.0, NAN],
     "a finite float >= 0"),
    ("attention", "mask_kind", lambda m, v: m.attention(*_qkv(m), mask_kind=v), ["sideways", 1, None],
     "one of .*'causal'"),
    ("attention", "has_mask", lambda m, v: m.add("attention", _qkv(m), scale=1.0, has_mask=v), [0, 1, "no"],
     "true or false"),
    ("matmul", "trans_b", lambda m, v: (lambda x: m.matmul(x, x, trans_b=v))(_x(m)), [1, None], "true or false"),
    ("narrow", "length", lambda m, v: m.narrow(_x(m), 1, 0, v), [-1, 1.0, True], "an int >= 0"),
    ("reshape", "shape", lambda m, v: m.add("reshape", (_x(m),), shape=v), [(2.0, 4), (8, -2), (True, 8), 8],
     "ints >= -1 or symbol names"),
    ("transpose", "perm", lambda m, v: m.add("transpose", (_x(m),), perm=v), ["ab", (0.0, 1), 1], "a list of ints"),
    ("reduce", "axes", lambda m, v: m.reduce(_x(m), "sum", v), [1.0, (True,), None], "an int or a list of ints"),
    ("cast", "dtype", lambda m, v: m.add("cast", (_x(m),), dtype=v), ["f8", 3, None], "a dtype name"),
    ("binary", "op", lambda m, v: (lambda x: m.add("binary", (x, x), op=v))(_x(m)), ["plus", 1], "one of"),
    ("input", "shape", lambda m, v: m.add("input", (), _leaf_name="y", shape=v, dtype="f32"),
     [(-1,), (2.0,), ("",), (2 ** 63,)], "ints >= 0 or symbol names"),
])
def test_attrs_are_checked_against_the_op_schema(op, attr, call, values, expect):
    for v in values:
        with pytest.raises(GraphError, match=rf"op '{op}': attr '{attr}' = .*: expected .*{expect}"):
            call(Builder("bad"), v)


def test_attr_values_are_normalized():
    m = Builder("norm")
    x = m.input("x", (2, 4))
    y = m.rms_norm(x, eps=np.float32(1e-3), offset=1)
    assert m.nodes[y.ref[0]].a == {"eps": pytest.approx(1e-3), "offset": 1.0}
    assert type(m.nodes[y.ref[0]].a["eps"]) is float and type(m.nodes[y.ref[0]].a["offset"]) is float
    c = m.add("cast", (x,), dtype="float16")
    assert m.nodes[c.ref[0]].a == {"dtype": "f16"}
    t = m.transpose(x, np.array([1, 0]))
    assert m.nodes[t.ref[0]].a == {"perm": (1, 0)}
    q, k, v = _qkv(m)
    a = m.attention(q, k, v, mask_kind=MaskKind.NONE, window=np.int64(0))
    assert m.nodes[a.ref[0]].a["mask_kind"] == "none" and type(m.nodes[a.ref[0]].a["window"]) is int


def test_fused_elementwise_program_is_checked():
    def fe(program):
        m = Builder("fe", "mir")
        x = m.input("x", (3,))
        return m.add("fused_elementwise", (x, x), program=program, dtype="f32")

    fe((("binary", (("op", "add"),), (0, 1)), ("activation", (("fn", "exp"),), (2,))))
    for program, pattern in [
        ((("matmul", (), (0, 1)),), "'matmul' is not an elementwise op"),
        ((("nope", (), (0,)),), "unknown op 'nope'"),
        ((("activation", (("fn", "sideways"),), (0,)),), "op 'activation': attr 'fn'"),
        ((("activation", (), (0,)),), "missing required attr 'fn'"),
        ((("activation", (("fn", "exp"),), (2,)),), r"step 0 \(activation\) reads slots \(2,\)"),
        ((("binary", (("op", "add"),), (0,)),), "takes inputs"),
        ((("binary", (("op", "add"),), (0, -1)),), "expected a non-empty list of"),
        ((), "expected a non-empty list of"),
    ]:
        with pytest.raises(GraphError, match=pattern):
            fe(program)


def _doc_with(op):
    d = json.loads(Graph.define("one", lambda m: {
        "y": m.softmax(m.rms_norm(m.input("x", (2, 4)), eps=1e-5), axis=-1)}).to_json())
    return d, next(i for i, n in enumerate(d["nodes"]) if n["op"] == op)


@pytest.mark.parametrize("op,attr,value", [
    ("rms_norm", "eps", "1e-5"), ("rms_norm", "eps", None), ("rms_norm", "eps", [1e-5]),
    ("rms_norm", "eps", NAN), ("rms_norm", "eps", INF), ("rms_norm", "eps", -1e-5),
    ("softmax", "axis", 1.5), ("softmax", "axis", True), ("input", "dtype", "f8"),
])
def test_json_attrs_go_through_the_op_schema(op, attr, value):
    d, i = _doc_with(op)
    d["nodes"][i]["attrs"][attr] = value
    with pytest.raises(SerializeError, match=rf"m\.json: nodes\[{i}\]\.attrs: op '{op}': attr '{attr}'"):
        graph_from_json(json.dumps(d), "m.json")


def test_json_dropped_attrs():
    d, i = _doc_with("input")
    del d["nodes"][i]["attrs"]["shape"]
    with pytest.raises(SerializeError, match=rf"nodes\[{i}\]\.attrs: op 'input': missing required attr 'shape'"):
        graph_from_json(json.dumps(d), "m.json")
    d, i = _doc_with("rms_norm")                        # an optional attr gets the table's default
    del d["nodes"][i]["attrs"]["offset"]
    assert graph_from_json(json.dumps(d)).nodes[i].a == {"eps": 1e-5, "offset": 0.0}



@pytest.mark.parametrize("value", [1, 1.0, 0, "true", None])
def test_a_repeated_node_is_checked_on_its_own(value):
    """Loading and verify remember the answer for a node equal to one already checked (a model's
    layers repeat); a copy whose attr differs only in type (True vs 1 / 1.0) must still fail."""
    def doc():
        return json.loads(Graph.define("two", lambda m: {
            "a": m.softmax(m.input("x", (2, 4)), axis=-1),
            "b": m.reduce(m.input("z", (2, 4)), "sum", axes=(1,), keepdims=True)}).to_json())
    d = doc()
    i = next(i for i, n in enumerate(d["nodes"]) if n["op"] == "reduce")
    d["nodes"].insert(i + 1, copy.deepcopy(d["nodes"][i]))  # a second, identical reduce
    d["nodes"][i + 1]["inputs"] = d["nodes"][i]["inputs"]
    for o in d["outputs"]:                                  # (later refs shift by one)
        o[1][0] += o[1][0] > i
    graph_from_json(json.dumps(d))                          # two valid copies load
    d["nodes"][i + 1]["attrs"]["keepdims"] = value
    with pytest.raises(SerializeError, match=rf"nodes\[{i + 1}\]\.attrs: op 'reduce': attr 'keepdims'"):
        graph_from_json(json.dumps(d), "m.json")
    g = graph_from_json(json.dumps(doc()))                 # verify on a graph built in memory
    j = next(i for i, n in enumerate(g.nodes) if n.op == "reduce")
    bad = attrs.evolve(g.nodes[j], attrs=tuple((k, value if k == "keepdims" else v) for k, v in g.nodes[j].attrs))
    g2 = attrs.evolve(g, nodes=g.nodes[:j + 1] + (bad,) + g.nodes[j + 1:],
                      outputs=tuple((n, (r[0] + (r[0] > j), r[1])) for n, r in g.outputs))
    with pytest.raises(GraphError, match=rf"node %{j + 1} \(reduce\).*keepdims"):
        verify(g2)

@pytest.mark.parametrize("mutate,place", [
    (lambda d: d["nodes"].__setitem__(1, 5), r"nodes\[1\]: expected an object"),
    (lambda d: d["nodes"][1].__setitem__("outs", {}), r"nodes\[1\]\.outs: expected a list"),
    (lambda d: d["nodes"][1].__setitem__("outs", [[[2, "4"], 7]]), r"nodes\[1\]\.outs\[0\]: expected \[dims, dtype\]"),
    (lambda d: d["nodes"][1].__setitem__("outs", [[[2, -4], "f32"]]), r"nodes\[1\]\.outs\[0\]: a dim must be >= 0"),
    (lambda d: d["nodes"][1].__setitem__("inputs", [[0, True]]), r"nodes\[1\]\.inputs: a value reference"),
    (lambda d: d["nodes"][1].__setitem__("name", 3), r"nodes\[1\]\.name: expected a string"),
    (lambda d: d["nodes"][1].__setitem__("attrs", []), r"nodes\[1\]\.attrs: expected an object"),
    (lambda d: d["outputs"].__setitem__(0, "y"), r"outputs\[0\] must be \[name, ref\]"),
    (lambda d: d.__setitem__("version", True), "unsupported version"),
    (lambda d: d.__setitem__("constants", {"c": {"dtype": "f32", "shape": [2.5], "data": ""}}),
     r"constants\['c'\]\.shape: expected a list of ints >= 0"),
    (lambda d: d.__setitem__("constants", {"c": {"dtype": "f32", "shape": [3], "data": "AAAA"}}),
     r"constants\['c'\]\.data: 3 bytes; shape \[3\] of f32 needs 12"),
    (lambda d: d.__setitem__("constants", {"c": {"dtype": "f32", "shape": [0, 2 ** 62, 2 ** 62], "data": ""}}),
     r"constants\['c'\]\.shape"),
    (lambda d: d.__setitem__("constants", {"c": {"dtype": "f32", "shape": [1], "data": "!!"}}),
     r"constants\['c'\]\.data: not base64"),
])
def test_json_wrong_types_name_the_file_and_place(mutate, place):
    d, _ = _doc_with("input")
    mutate(d)
    with pytest.raises(SerializeError, match=r"m\.json: " + place):
        graph_from_json(json.dumps(d), "m.json")


def test_binary_and_non_utf8_ir_files(tmp_path):
    f = tmp_path / "garbage.rlx.json"
    for data in (bytes(range(256)), b"\xff\xfe{}", "{\"format\": \"rlx-ir\"}".encode("utf-16")):
        f.write_bytes(data)
        with pytest.raises(SerializeError, match=r"garbage\.rlx\.json: not UTF-8"):
            load_json_file(f)
    f.write_bytes(b"[" * 100_000)
    with pytest.raises(SerializeError, match=r"garbage\.rlx\.json: not valid JSON"):
        load_json_file(f)
    f.write_bytes(b"1" * 5000)                          # past Python's int-literal digit limit
    with pytest.raises(SerializeError, match=r"garbage\.rlx\.json: not valid JSON"):
        load_json_file(f)
    for obj in (None, 5, ["x"]):
        with pytest.raises(SerializeError, match="m.json"):
            graph_from_json(obj, "m.json")
    with pytest.raises(SerializeError, match=r"missing\.json: cannot read"):
        load_json_file(tmp_path / "missing.json")


# ----------------------------------------------------------------------------- verify
def _small() -> Graph:
    m = Builder("small", "mir")
    x = m.input("x", (2, 3))
    y = m.act(x, "tanh")
    m.output("y", y + x)
    return m.build()


def test_verify_accepts_a_good_graph():
    verify(_small())


def test_verify_catches_a_cycle():
    g = _small()
    nodes = list(g.nodes)
    nodes[1] = Node("activation", ((2, 0),), nodes[1].attrs, nodes[1].outs)    # reads a later node
    with pytest.raises(GraphError, match="later node"):
        verify(Graph("cyc", "mir", tuple(nodes), g.outputs))


def test_verify_catches_a_missing_input():
    g = _small()
    nodes = list(g.nodes)
    nodes[2] = Node("binary", ((1, 0), (-1, 0)), nodes[2].attrs, nodes[2].outs)
    with pytest.raises(GraphError, match="missing node"):
        verify(Graph("miss", "mir", tuple(nodes), g.outputs))
    nodes[2] = Node("binary", ((1, 0), (0, 3)), nodes[2].attrs, nodes[2].outs)
    with pytest.raises(GraphError, match="no such output"):
        verify(Graph("miss", "mir", tuple(nodes), g.outputs))
    nodes[2] = Node("binary", ((1, 0), (17, 0)), nodes[2].attrs, nodes[2].outs)
    with pytest.raises(GraphError, match="%17 refers to a missing node"):
        verify(Graph("miss", "mir", tuple(nodes), g.outputs))


def test_verify_catches_a_shape_disagreeing_with_meta():
    g = _small()
    nodes = list(g.nodes)
    nodes[1] = Node("activation", ((0, 0),), nodes[1].attrs, (Shape((3, 2), F32),))
    with pytest.raises(GraphError, match="disagree with the op's meta"):
        verify(Graph("shape", "mir", tuple(nodes), g.outputs))
    nodes[1] = Node("activation", ((0, 0),), nodes[1].attrs, (Shape((2, 3), F16),))
    with pytest.raises(GraphError, match="disagree"):
        verify(Graph("dtype", "mir", tuple(nodes), g.outputs))


def test_verify_catches_missing_outputs_and_other_breakage():
    g = _small()
    with pytest.raises(GraphError, match="no outputs"):
        verify(Graph("noout", "mir", g.nodes, ()))
    with pytest.raises(GraphError, match="missing value"):
        verify(Graph("badout", "mir", g.nodes, (("y", (9, 0)),)))
    with pytest.raises(GraphError, match="set twice"):
        verify(Graph("twice", "mir", g.nodes, (("y", (2, 0)), ("y", (1, 0)))))
    with pytest.raises(GraphError, match="unknown op"):
        verify(Graph("op", "mir", g.nodes + (Node("frobnicate", (), (), ()),), g.outputs))
    with pytest.raises(GraphError, match="HIR block op"):
        m = Builder("hir", "mir")
        m.output("y", m.linear(m.input("x", (2, 3)), m.param("w", (4, 3))))
        verify(m.build())
    with pytest.raises(GraphError, match="no value in the constant table"):
        m = Builder("c", "mir")
        m.output("y", m.act(m.constant(np.ones(3, np.float32)), "exp"))
        g2 = m.build()
        verify(Graph("c", "mir", g2.nodes, g2.outputs, {}))


# ----------------------------------------------------------------------------- text and JSON
@pytest.fixture(scope="module")
def levels():
    """The same model at HIR, MIR and LIR."""
    g = llama(Cfg(layers=1))
    rng = np.random.default_rng(0)
    exe = rlx_core.compile(g, profile="fusable", params=random_params(g, rng))
    unfused = CompilePipeline(CompileProfile.preset("fusable").evolve(
        fusion={"skip": True, "assert_clean": False})).optimize(g)
    return {"hir": g, "mir": exe.mir, "mir_unfused": unfused, "lir": exe.lir(seq=5),
            "lir_unfused": plan(specialize(unfused, {"seq": 3}))}


_LINE = re.compile(r"^  (%\d+(?::\d+)?(?:,%\d+:\d+)*) = (\w+)[ (\"].* : (.*)$")


@pytest.mark.parametrize("level", ["hir", "mir", "mir_unfused", "lir", "lir_unfused"])
def test_text_has_one_line_per_node(levels, level):
    obj = levels[level]
    g = obj.graph if isinstance(obj, LirModule) else obj
    text = obj.text()
    lines = [ln for ln in text.splitlines() if _LINE.match(ln)]
    assert len(lines) == len(g.nodes), text
    for i, (ln, n) in enumerate(zip(lines, g.nodes)):
        mt = _LINE.match(ln)
        assert mt.group(1).split(":")[0].split(",")[0] == f"%{i}" and mt.group(2) == n.op
        for s in n.outs:
            assert str(s.bind({})) in ln or str(s) in ln, ln           # dtype[dims] of every output
    assert f"({level.split('_')[0]})" in text
    if level.startswith("lir"):
        assert "arena" in text and "manifest:" in text


@pytest.mark.parametrize("level", ["hir", "mir", "mir_unfused", "lir", "lir_unfused"])
def test_json_round_trip(levels, level):
    obj = levels[level]
    text = obj.to_json()
    back = graph_from_json(text)
    assert type(back) is type(obj)
    assert back.to_json() == text
    if isinstance(obj, LirModule):
        assert back.slots == obj.slots and back.arena_bytes == obj.arena_bytes
        assert back.manifest == obj.manifest
    else:
        assert back.stable_hash() == obj.stable_hash() and back.text() == obj.text()


def test_json_round_trip_keeps_constants_exactly():
    m = Builder("consts", "mir")
    x = m.input("x", (3,), "bf16")
    y = x * m.constant(np.array([1.5, -2.25, 3.0]), "bf16")
    m.output("y", m.act(y, "tanh") * 0.5)
    m.output("i", m.cast(m.constant(np.arange(4, dtype=np.int64)), "f32"))
    g = m.build()
    back = graph_from_json(g.to_json())
    for k, v in g.constants.items():
        assert back.constants[k].dtype == v.dtype and back.constants[k].shape == v.shape
        np.testing.assert_array_equal(back.constants[k], v)


@pytest.mark.parametrize("level", ["hir", "mir", "lir"])
def test_truncated_json_is_a_serialize_error(levels, level):
    text = levels[level].to_json()
    for cut in (0, 1, len(text) // 3, len(text) // 2, len(text) - 1):
        with pytest.raises(SerializeError):
            graph_from_json(text[:cut])


def test_json_errors_name_the_problem(levels):
    d = json.loads(levels["mir"].to_json())
    for mutate, msg in [
        (lambda d: d.update(version=99), "version"),
        (lambda d: d.update(format="onnx"), "format"),
        (lambda d: d.pop("nodes"), "nodes"),
        (lambda d: d["nodes"][5].update(op="nope"), "unknown op"),
        (lambda d: d["outputs"].append(["z", [999, 0]]), "missing value"),
    ]:
        dd = copy.deepcopy(d)
        mutate(dd)
        with pytest.raises(SerializeError, match=msg):
            graph_from_json(json.dumps(dd))
    dl = json.loads(levels["lir"].to_json())
    dl["plan"][3][1]["offset"] += 64
    with pytest.raises(SerializeError, match="plan"):
        graph_from_json(json.dumps(dl))


# ----------------------------------------------------------------------------- robustness
_SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.filter_too_much])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False) |
    st.text(max_size=12) | st.sampled_from(["rlx-ir", "hir", "mir", "lir", "f32", "i64", "input"]),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(
        st.sampled_from(["format", "version", "name", "level", "nodes", "outputs", "constants", "op",
                         "inputs", "attrs", "outs", "plan", "dtype", "shape", "data"]) | st.text(max_size=6),
        kids, max_size=6),
    max_leaves=30)


def _only_rlx_errors(text):
    try:
        graph_from_json(text)
    except RlxError:
        pass


@_SETTINGS
@given(value=json_values)
def test_json_garbage_gives_only_rlx_errors(value):
    _only_rlx_errors(json.dumps(value))


@_SETTINGS
@given(text=st.text(max_size=80))
def test_text_garbage_gives_only_rlx_errors(text):
    _only_rlx_errors(text)


_VALID = {}


def _valid_dicts():
    if not _VALID:
        g = llama(Cfg(layers=1, hidden=16, heads=2, kv_heads=1, ffn=24, vocab=10))
        exe = rlx_core.compile(g, profile="fusable")
        m = Builder("c", "mir")
        m.output("y", m.act(m.input("x", (2,)), "exp") * m.constant(np.array([1.0, 2.0], np.float32)))
        for key, obj in (("hir", g), ("mir", exe.mir), ("lir", exe.lir(seq=2)), ("const", m.build())):
            _VALID[key] = json.loads(obj.to_json())
    return _VALID


def _paths(d, prefix=()):
    yield prefix
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from _paths(v, prefix + (i,))


@st.composite
def mutated_ir(draw):
    base = copy.deepcopy(_valid_dicts()[draw(st.sampled_from(["hir", "mir", "lir", "const"]))])
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(base) if p]
        path = draw(st.sampled_from(paths))
        parent = base
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        action = draw(st.sampled_from(["replace", "delete", "int", "dup"]))
        if action == "replace":
            parent[key] = draw(json_values)
        elif action == "delete":
            del parent[key]
        elif action == "int":
            v = parent[key]
            parent[key] = (v + draw(st.integers(-3, 3))) if isinstance(v, int) and not isinstance(v, bool) \
                else draw(st.integers(-2, 40))
        elif isinstance(parent, list):
            parent.insert(key, copy.deepcopy(parent[key]))
    return base


@_SETTINGS
@given(d=mutated_ir())
def test_mutated_ir_json_gives_only_rlx_errors(d):
    _only_rlx_errors(json.dumps(d))


_OP_NAMES = sorted(OPS) + ["nope", "", "INPUT"]
attr_values = st.one_of(st.none(), st.booleans(), st.integers(-5, 40), st.floats(-3, 3),
                        st.sampled_from(["f32", "i64", "bf16", "causal", "half", "add", "tanh", "sum",
                                         "sliding_window", "bias", "zz"]),
                        st.lists(st.integers(-3, 6), max_size=4), st.text(max_size=4),
                        st.lists(st.text(max_size=3), max_size=2), st.dictionaries(st.text(max_size=2),
                                                                                   st.integers(), max_size=2))
dims = st.lists(st.one_of(st.integers(0, 5), st.sampled_from(["seq", "b"])), max_size=5)


@_SETTINGS
@given(op=st.sampled_from(_OP_NAMES), shapes=st.lists(st.tuples(dims, st.sampled_from(
    ["f32", "f16", "i32", "i64", "bool", "bf16"])), max_size=5),
    attrs=st.dictionaries(st.sampled_from(["op", "fn", "axis", "axes", "keepdims", "shape", "perm", "start",
                                           "length", "k", "dtype", "scale", "mask_kind", "window",
                                           "softcap", "has_mask", "has_pos", "style", "eps", "offset",
                                           "trans_a", "trans_b", "transpose_w", "program", "name",
                                           "params", "act", "bogus"]), attr_values, max_size=6))
def test_builder_garbage_gives_only_rlx_errors(op, shapes, attrs):
    m = Builder("fuzz", "hir")
    try:
        ins = tuple(m.input(f"x{i}", d, t) for i, (d, t) in enumerate(shapes))
        out = m.add(op, ins, **attrs)
    except RlxError:
        return
    outs = out if isinstance(out, tuple) else (out,)
    for k, v in enumerate(outs):
        m.output(f"o{k}", v)
    g = m.build()
    try:
        verify(g)
        graph_from_json(g.to_json())           # whatever builds must round-trip
    except RlxError as e:
        raise AssertionError(f"built but does not verify/round-trip: {e}") from None
