"""Nodes, graphs and the builder (the `Emit` handle) shared by every IR level.

A graph is an SSA list of frozen nodes. A value is (node id, output index). Rewrites build
new graphs; nothing mutates a node in place.
"""
from __future__ import annotations

import base64
import hashlib
import json
from typing import Any, Callable, Mapping, Sequence, Union

import attrs
import numpy as np
import numpy.typing as npt

from .dtype import F32, DType, DTypeLike
from .errors import GraphError
from .ops import MaskKind, get_op, infer
from .shape import Dim, Shape

HIR, MIR, LIR = "hir", "mir", "lir"
FORMAT, VERSION = "rlx-ir", 1         # of the JSON form (serialize.py reads it back)


def _shape_json(s: Shape) -> list:
    return [list(s.dims), s.dtype.value]


def _attr_json(v: Any) -> Any:
    if isinstance(v, Graph):                 # a control-flow body (ir/control.py)
        return {"graph": graph_dict(v)}
    return [_attr_json(x) for x in v] if isinstance(v, tuple) else v


def _constant_json(a: np.ndarray, data: bool) -> dict:
    raw = np.ascontiguousarray(a).tobytes()
    c = {"dtype": DType.parse(a.dtype).value, "shape": list(a.shape)}
    if data:
        c["data"] = base64.b64encode(raw).decode()
    else:
        c["sha256"] = hashlib.sha256(raw).hexdigest()
    return c


def graph_dict(g: Graph, data: bool = True) -> dict:
    """The JSON form of a graph (serialize.py reads it back); with `data` False each constant's
    bytes are given by their sha256 (a digest of the graph: `Graph.key_text`)."""
    return {
        "format": FORMAT, "version": VERSION, "name": g.name, "level": g.level,
        "nodes": [{"op": n.op, "name": n.name, "inputs": [list(r) for r in n.inputs],
                   "attrs": {k: _attr_json(v) for k, v in n.attrs},
                   "outs": [_shape_json(s) for s in n.outs]} for n in g.nodes],
        "outputs": [[name, list(r)] for name, r in g.outputs],
        "constants": {k: _constant_json(a, data) for k, a in sorted(g.constants.items())},
    }


Ref = tuple  # (node id, output index)
Axes = Union[int, Sequence[int]]
AxisPairs = tuple[Sequence[int], Sequence[int]]   # (lhs axes, rhs axes) of dot_general


@attrs.frozen
class Node:
    op: str
    inputs: tuple          # of Ref
    attrs: tuple           # sorted (key, value) pairs
    outs: tuple            # of Shape
    name: str = ""         # binding name of input/param/state/constant nodes

    @property
    def a(self) -> dict:
        return dict(self.attrs)

    @property
    def shape(self) -> Shape:
        return self.outs[0]


@attrs.frozen(eq=False)
class Graph:
    """A graph at one level (HIR or MIR). LIR wraps an MIR graph with a buffer plan."""
    name: str
    level: str
    nodes: tuple
    outputs: tuple                       # of (name, Ref)
    constants: Mapping = attrs.field(factory=dict)
    _rlx_graph_attr = True                # may be an attr value: a control-flow body

    def _leaves(self, kind: str) -> dict:
        return {n.name: i for i, n in enumerate(self.nodes) if n.op == kind}

    @property
    def inputs(self) -> dict:
        return self._leaves("input")

    @property
    def params(self) -> dict:
        return self._leaves("param")

    @property
    def states(self) -> dict:
        return self._leaves("state")

    def shape_of(self, ref: Ref) -> Shape:
        return self.nodes[ref[0]].outs[ref[1]]

    def consumers(self) -> dict:
        """ref -> list of consumer node ids (graph outputs count as consumer -1)."""
        out: dict = {}
        for i, n in enumerate(self.nodes):
            for r in n.inputs:
                out.setdefault(tuple(r), []).append(i)
        for _, r in self.outputs:
            out.setdefault(tuple(r), []).append(-1)
        return out

    def symbols(self) -> set:
        return {d for n in self.nodes for s in n.outs for d in s.dims if isinstance(d, str)}

    def text(self) -> str:
        from .printer import graph_text

        return graph_text(self)

    __str__ = text

    def _repr_svg_(self) -> str | None:
        """Jupyter shows the graph drawn (ir/dot.py); without Graphviz's `dot` program this
        returns None and Jupyter falls back to the text repr."""
        from .dot import graph_dot, svg_or_none

        return svg_or_none(graph_dot(self))

    def to_dict(self) -> dict:
        return graph_dict(self)

    def to_json(self) -> str:
        return json.dumps(graph_dict(self), sort_keys=True, separators=(",", ":"))

    def key_text(self) -> str:
        """Text naming the graph exactly, as `to_json` but with each constant's bytes given by
        their sha256: a cache key without base64-encoding megabytes of tables (RoPE's)."""
        return json.dumps(graph_dict(self, data=False), sort_keys=True, separators=(",", ":"))

    def stable_hash(self) -> str:
        h = hashlib.sha256(self.to_json().encode())
        return h.hexdigest()[:16]

    def with_level(self, level: str) -> "Graph":
        return attrs.evolve(self, level=level)

    @staticmethod
    def define(name: str, fn: Callable[["Builder"], "Outputs | None"]) -> "Graph":
        """Build an HIR graph: `fn(m)` declares inputs/params with `m` and returns the outputs
        (a value, a tuple of values, or a dict name -> value)."""
        m = Builder(name, HIR)
        result = fn(m)
        if result is not None:
            m.outputs_from(result)
        return m.build()


@attrs.frozen(eq=False)
class Value:
    """A handle on one output of a node while building; supports + - * / @ and indexing."""
    b: "Builder"
    ref: tuple
    shape: Shape

    @property
    def dtype(self) -> DType:
        return self.shape.dtype

    @property
    def dims(self) -> tuple:
        return self.shape.dims

    def _bin(self, other: Operand, op: str, rev: bool = False) -> Value:
        other = self.b.lift(other, self.dtype)
        return self.b.binary(other, self, op) if rev else self.b.binary(self, other, op)

    def __add__(self, o: Operand) -> Value: return self._bin(o, "add")
    def __radd__(self, o: Operand) -> Value: return self._bin(o, "add", True)
    def __sub__(self, o: Operand) -> Value: return self._bin(o, "sub")
    def __rsub__(self, o: Operand) -> Value: return self._bin(o, "sub", True)
    def __mul__(self, o: Operand) -> Value: return self._bin(o, "mul")
    def __rmul__(self, o: Operand) -> Value: return self._bin(o, "mul", True)
    def __truediv__(self, o: Operand) -> Value: return self._bin(o, "div")
    def __rtruediv__(self, o: Operand) -> Value: return self._bin(o, "div", True)
    def __pow__(self, o: Operand) -> Value: return self._bin(o, "pow")
    def __neg__(self) -> Value: return self.b.act(self, "neg")
    def __matmul__(self, o: Value) -> Value: return self.b.matmul(self, o)


# a value or a Python scalar (lifted to a constant of the other operand's dtype)
Operand = Union[Value, float]
# what a graph-building function returns: its outputs ("out", "out0".., or by name)
Outputs = Union[Value, Sequence[Value], Mapping[str, Value]]
# a control-flow body: fn(m, *inputs) -> outputs, or a Graph already built
Body = Union[Callable[..., Any], Graph]


class Builder:
    """Emits nodes into a graph. The HIR builder of `Graph.define`, the MIR builder used by
    lowering and rewrites, and the `Emit` handle of `.custom()` are all this class."""

    def __init__(self, name: str = "graph", level: str = HIR):
        self.name = name
        self.level = level
        self.nodes: list = []
        self.constants: dict = {}
        self.outputs: list = []
        self._leaf_names: dict = {}
        self._memo: dict = {}

    # -- core
    def add(self, op: str, inputs: Sequence[Value] = (), /, _leaf_name: str = "", **attrs_: Any) -> Any:
        """Emit op `op` on `inputs` with attrs; returns its value (a tuple if several)."""
        d = get_op(op)
        d.check_arity(len(inputs))
        refs, shapes = [], []
        for i, v in enumerate(inputs):
            if not isinstance(v, Value) or v.b is not self:
                raise GraphError(f"op {op!r} input {i}: expected a value of this graph, got {v!r}")
            refs.append(v.ref)
            shapes.append(v.shape)
        a = d.check_attrs(attrs_)
        outs = infer(op, shapes, a)
        node = Node(op, tuple(refs), tuple(sorted(a.items())), outs, _leaf_name)
        return self.emit_node(node)

    def emit_node(self, node: Node) -> Any:
        self.nodes.append(node)
        nid = len(self.nodes) - 1
        vals = tuple(Value(self, (nid, i), s) for i, s in enumerate(node.outs))
        return vals[0] if len(vals) == 1 else vals

    def value(self, ref: Ref) -> Value:
        return Value(self, tuple(ref), self.nodes[ref[0]].outs[ref[1]])

    def _leaf(self, kind: str, name: str, shape: Sequence[Dim], dtype: DTypeLike, **attrs_: Any) -> Value:
        if not isinstance(name, str) or not name:
            raise GraphError(f"{kind} needs a non-empty name, got {name!r}")
        if name in self._leaf_names:
            raise GraphError(f"{kind} name {name!r} is already used by a {self._leaf_names[name]}")
        self._leaf_names[name] = kind
        s = Shape(tuple(shape), dtype)
        return self.add(kind, (), _leaf_name=name, shape=s.dims, dtype=s.dtype.value, **attrs_)

    def _leaf_add(self, kind: str, name: str, dims: Sequence[Dim], dtype: DTypeLike) -> Value:
        """Emit a leaf without the duplicate-name check (rewrites re-emit existing leaves)."""
        s = Shape(tuple(dims), dtype)
        return self.add(kind, (), _leaf_name=name, shape=s.dims, dtype=s.dtype.value)

    def input(self, name: str, shape: Sequence[Dim], dtype: DTypeLike = F32) -> Value:
        return self._leaf("input", name, shape, dtype)

    def param(self, name: str, shape: Sequence[Dim], dtype: DTypeLike = F32, scheme: str = "") -> Value:
        """A weight; with a quant `scheme` it is bound packed (passes/packed.py) while the
        graph sees its logical float shape."""
        return self._leaf("param", name, shape, dtype, **({"scheme": scheme} if scheme else {}))

    def state(self, name: str, shape: Sequence[Dim], dtype: DTypeLike = F32) -> Value:
        return self._leaf("state", name, shape, dtype)

    def constant(self, value: npt.ArrayLike, dtype: DTypeLike | None = None,
                 name: str | None = None) -> Value:
        arr = np.asarray(value, dtype=None if dtype is None else DType.parse(dtype).np)
        if dtype is None and arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        dt = DType.parse(arr.dtype)
        key = (dt, arr.shape, arr.tobytes()) if arr.size <= 64 else None
        if key is not None and key in self._memo and name is None:
            return self._memo[key]
        name = name or f"c{len(self.constants)}"
        while name in self.constants:
            name += "_"
        self.constants[name] = np.array(arr, order="C")   # (ascontiguousarray makes 0-d 1-d)
        v = self.add("constant", (), _leaf_name=name, shape=arr.shape, dtype=dt.value)
        if key is not None:
            self._memo[key] = v
        return v

    def lift(self, x: Operand, dtype: DType) -> Value:
        """A Python scalar becomes a scalar constant of `dtype`; values pass through."""
        if isinstance(x, Value):
            return x
        return self.constant(np.asarray(x, dtype=dtype.np), dtype)   # (f64 stays f64)

    def output(self, name: str, value: Value) -> None:
        if any(n == name for n, _ in self.outputs):
            raise GraphError(f"output {name!r} is set twice")
        if not isinstance(value, Value) or value.b is not self:
            raise GraphError(f"output {name!r} must be a value of this graph, got {value!r}")
        self.outputs.append((name, value.ref))

    def outputs_from(self, result: Outputs) -> None:
        if isinstance(result, Value):
            self.output("out", result)
        elif isinstance(result, dict):
            for k, v in result.items():
                self.output(k, v)
        elif isinstance(result, (tuple, list)):
            for i, v in enumerate(result):
                self.output(f"out{i}", v)
        else:
            raise GraphError(f"graph {self.name!r} returned {type(result).__name__}; "
                             "expected a value, a tuple of values or a dict of them")

    def build(self) -> Graph:
        if not self.outputs:
            raise GraphError(f"graph {self.name!r} has no outputs")
        return Graph(self.name, self.level, tuple(self.nodes), tuple(self.outputs),
                     dict(self.constants))

    # -- primitives
    def matmul(self, a: Value, b: Value, trans_a: bool = False, trans_b: bool = False) -> Value:
        return self.add("matmul", (a, b), trans_a=trans_a, trans_b=trans_b)

    def binary(self, a: Operand, b: Operand, op: str) -> Value:
        a = self.lift(a, b.dtype if isinstance(b, Value) else F32)
        b = self.lift(b, a.dtype)
        return self.add("binary", (a, b), op=op)

    def add_(self, a: Operand, b: Operand) -> Value: return self.binary(a, b, "add")
    def sub(self, a: Operand, b: Operand) -> Value: return self.binary(a, b, "sub")
    def mul(self, a: Operand, b: Operand) -> Value: return self.binary(a, b, "mul")
    def div(self, a: Operand, b: Operand) -> Value: return self.binary(a, b, "div")
    def maximum(self, a: Operand, b: Operand) -> Value: return self.binary(a, b, "max")
    def minimum(self, a: Operand, b: Operand) -> Value: return self.binary(a, b, "min")
    def pow(self, a: Operand, b: Operand) -> Value: return self.binary(a, b, "pow")

    def compare(self, a: Operand, b: Operand, op: str) -> Value:
        a = self.lift(a, b.dtype if isinstance(b, Value) else F32)
        return self.add("compare", (a, self.lift(b, a.dtype)), op=op)

    def where(self, cond: Value, a: Operand, b: Operand) -> Value:
        ref = a if isinstance(a, Value) else b
        if not isinstance(ref, Value):
            raise GraphError(f"where: a or b must be a value of this graph, got {a!r} and {b!r}")
        return self.add("where", (cond, self.lift(a, ref.dtype), self.lift(b, ref.dtype)))

    def act(self, x: Value, fn: str) -> Value:
        return self.add("activation", (x,), fn=fn)

    def silu(self, x: Value) -> Value: return self.act(x, "silu")
    def gelu(self, x: Value) -> Value: return self.act(x, "gelu")
    def gelu_tanh(self, x: Value) -> Value: return self.act(x, "gelu_tanh")
    def relu(self, x: Value) -> Value: return self.act(x, "relu")
    def tanh(self, x: Value) -> Value: return self.act(x, "tanh")
    def exp(self, x: Value) -> Value: return self.act(x, "exp")
    def rsqrt(self, x: Value) -> Value: return self.act(x, "rsqrt")
    def sigmoid(self, x: Value) -> Value: return self.act(x, "sigmoid")

    def cast(self, x: Value, dtype: DTypeLike) -> Value:
        dt = DType.parse(dtype)
        return x if x.dtype is dt else self.add("cast", (x,), dtype=dt.value)

    def reduce(self, x: Value, op: str, axes: Axes, keepdims: bool = False) -> Value:
        return self.add("reduce", (x,), op=op, axes=axes, keepdims=keepdims)

    def sum(self, x: Value, axes: Axes, keepdims: bool = False) -> Value:
        return self.reduce(x, "sum", axes, keepdims)

    def mean(self, x: Value, axes: Axes, keepdims: bool = False) -> Value:
        return self.reduce(x, "mean", axes, keepdims)

    def max(self, x: Value, axes: Axes, keepdims: bool = False) -> Value:
        return self.reduce(x, "max", axes, keepdims)

    def softmax(self, x: Value, axis: int = -1) -> Value:
        return self.add("softmax", (x,), axis=axis)

    def layer_norm(self, x: Value, gamma: Value | None = None, beta: Value | None = None,
                   eps: float = 1e-5) -> Value:
        ins = (x,) + tuple(v for v in (gamma, beta) if v is not None)
        if beta is not None and gamma is None:
            raise GraphError("layer_norm: beta without gamma")
        return self.add("layer_norm", ins, eps=eps)

    def rms_norm(self, x: Value, weight: Value | None = None, eps: float = 1e-6,
                 offset: float = 0.0) -> Value:
        return self.add("rms_norm", (x,) if weight is None else (x, weight), eps=eps, offset=offset)

    def rope(self, x: Value, cos: Value, sin: Value, style: str = "half") -> Value:
        return self.add("rope", (x, cos, sin), style=style)

    def attention(self, q: Value, k: Value, v: Value, mask: Value | None = None, pos: Value | None = None, *,
                  scale: float | None = None, mask_kind: MaskKind | str = MaskKind.CAUSAL, window: int = 0,
                  softcap: float = 0.0) -> Value:
        scale = float(q.dims[-1]) ** -0.5 if scale is None else float(scale)
        ins = (q, k, v) + tuple(x for x in (mask, pos) if x is not None)
        return self.add("attention", ins, scale=scale, mask_kind=mask_kind, window=window,
                        softcap=float(softcap), has_mask=mask is not None, has_pos=pos is not None)

    def gather(self, table: Value, indices: Value, axis: int = 0) -> Value:
        return self.add("gather", (table, indices), axis=axis)

    def reshape(self, x: Value, shape: Sequence[Dim]) -> Value:
        return x if tuple(shape) == x.dims else self.add("reshape", (x,), shape=tuple(shape))

    def transpose(self, x: Value, perm: Sequence[int]) -> Value:
        return self.add("transpose", (x,), perm=tuple(perm))

    def narrow(self, x: Value, axis: int, start: int, length: int) -> Value:
        return self.add("narrow", (x,), axis=axis, start=start, length=length)

    def concat(self, xs: Sequence[Value], axis: int) -> Value:
        return self.add("concat", tuple(xs), axis=axis)

    def expand(self, x: Value, shape: Sequence[Dim]) -> Value:
        return x if tuple(shape) == x.dims else self.add("expand", (x,), shape=tuple(shape))

    def cumsum(self, x: Value, axis: int = -1) -> Value:
        return self.add("cumsum", (x,), axis=axis)

    def topk(self, x: Value, k: int, axis: int = -1) -> tuple[Value, Value]:
        """(values, indices) of the k largest along `axis`."""
        return self.add("topk", (x,), k=k, axis=axis)

    def argmax(self, x: Value, axis: int = -1, keepdims: bool = False) -> Value:
        return self.add("argmax", (x,), axis=axis, keepdims=keepdims)

    def kv_write(self, cache: Value, new: Value, pos: Value, axis: int = 2) -> Value:
        return self.add("kv_write", (cache, new, pos), axis=axis)

    def assign(self, state: Value, value: Value) -> Value:
        return self.add("assign", (state, value))

    def custom(self, name: str, *xs: Value, **params: Any) -> Any:
        """A registered custom op (ir/custom.py); its value, or a tuple if it has several outputs."""
        out = self.add("custom", xs, name=name, params=tuple(sorted(params.items())))
        return out

    def dot_general(self, lhs: Value, rhs: Value, contract: AxisPairs = ((), ()),
                    batch: AxisPairs = ((), ())) -> Value:
        """jax.lax.dot_general: contract=(lhs axes, rhs axes), batch=(lhs axes, rhs axes);
        out = batch dims + lhs free dims + rhs free dims (ir/contract.py)."""
        return self.add("dot_general", (lhs, rhs), lhs_contract=tuple(contract[0]),
                        rhs_contract=tuple(contract[1]), lhs_batch=tuple(batch[0]),
                        rhs_batch=tuple(batch[1]))

    # -- FFT over one axis (ir/fft.py); norm: backward / ortho / forward
    def dense_solve(self, a: Value, b: Value) -> Value:
        """x with a @ x = b (ir/linalg.py): a [..., n, n], b [..., n, k] or [..., n]."""
        return self.add("dense_solve", (a, b))

    def fft(self, x: Value, axis: int = -1, norm: str = "backward") -> Value:
        return self.add("fft", (x,), axis=axis, norm=norm)

    def ifft(self, x: Value, axis: int = -1, norm: str = "backward") -> Value:
        return self.add("ifft", (x,), axis=axis, norm=norm)

    def rfft(self, x: Value, axis: int = -1, norm: str = "backward") -> Value:
        return self.add("rfft", (x,), axis=axis, norm=norm)

    def irfft(self, x: Value, n: int = 0, axis: int = -1, norm: str = "backward") -> Value:
        return self.add("irfft", (x,), axis=axis, norm=norm, n=n)

    # -- control flow (ir/control.py): bodies are graphs held as attrs
    def body(self, name: str, shapes: Sequence[Shape | Value], fn: Body) -> Graph:
        """A body graph at this builder's level: inputs `a0..` of `shapes` (Shapes or
        values), `fn(m, *inputs)` returns its outputs (a value or a tuple). A Graph passes."""
        if isinstance(fn, Graph):
            return fn
        m = Builder(name, self.level)
        ins = [m.input(f"a{k}", s.dims, s.dtype) for k, s in
               enumerate(v.shape if isinstance(v, Value) else v for v in shapes)]
        res = fn(m, *ins)
        m.outputs_from(tuple(res) if isinstance(res, list) else res)
        return m.build()

    def if_(self, pred: Value, operands: Sequence[Value], then_: Body, else_: Body) -> Any:
        """then_(m, *operands) if pred (a bool scalar) else else_(m, *operands)."""
        operands = tuple(operands)
        return self.add("if_", (pred,) + operands, then_=self.body("then", operands, then_),
                        else_=self.body("else", operands, else_))

    def while_(self, init: Sequence[Value], cond: Body, body: Body,
               consts: Sequence[Value] = ()) -> tuple[Value, ...]:
        """Carries `init` through body(m, *consts, *carries) -> carries while
        cond(m, *consts, *carries) is true; returns the final carries (a tuple)."""
        ops = tuple(consts) + tuple(init)
        out = self.add("while_", ops, cond=self.body("cond", ops, cond),
                       body=self.body("body", ops, body), n_consts=len(consts))
        return out if isinstance(out, tuple) else (out,)

    def scan(self, body: Body, init: Sequence[Value] = (), xs: Sequence[Value] = (),
             consts: Sequence[Value] = (), length: int = 0,
             reverse: bool = False) -> tuple[tuple[Value, ...], tuple[Value, ...]]:
        """body(m, *consts, *carries, *x_t) -> (*carries, *y_t) over axis 0 of `xs`;
        returns (final carries, stacked ys), both tuples."""
        init, xs, consts = tuple(init), tuple(xs), tuple(consts)
        given = [v.shape for v in consts + init] + [Shape(x.dims[1:], x.dtype) for x in xs]
        out = self.add("scan", consts + init + xs, body=self.body("scan_body", given, body),
                       n_consts=len(consts), n_carry=len(init), length=length, reverse=reverse)
        out = out if isinstance(out, tuple) else (out,)
        return out[:len(init)], out[len(init):]

    # -- HIR blocks
    def linear(self, x: Value, weight: Value, bias: Value | None = None, transpose_w: bool = True) -> Value:
        ins = (x, weight) if bias is None else (x, weight, bias)
        return self.add("linear", ins, transpose_w=transpose_w)

    def swiglu(self, x: Value, w_gate: Value, w_up: Value, w_down: Value, transpose_w: bool = True) -> Value:
        return self.add("swiglu_mlp", (x, w_gate, w_up, w_down), transpose_w=transpose_w)


Emit = Builder

__all__ = ["Graph", "Node", "Value", "Builder", "Emit", "HIR", "MIR", "LIR"]
