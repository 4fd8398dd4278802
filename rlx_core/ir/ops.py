"""The op table: every op declared once, with its inputs, typed attributes and a meta function.

A meta function takes the input shapes and the attrs and returns the output shapes, the
way JAX primitives have an abstract eval. Each attr has a schema (`A`: what it accepts and
its default) and `OpDef.check_attrs` is the one check that builder calls and IR JSON both
pass through. Backends, fusion rules and the planner key on the op name. Adding an op
means: an entry here, a numpy kernel, tests.
"""
from __future__ import annotations

import enum
import math
from typing import Any, Callable

import attrs
import numpy as np

from .dtype import BOOL, I64, DType, promote
from .errors import DTypeError, GraphError, RlxError, ShapeError
from .quant import QuantScheme
from .shape import Shape, broadcast_dims, norm_axis

REQUIRED = object()
_BAD = object()          # what an attr check returns for a value that does not fit
_MAX_DEPTH = 16          # attr values nest a few levels (a fused program); JSON may nest more


class Level(enum.Enum):
    LEAF = "leaf"      # graph inputs, params, state, constants
    PRIM = "prim"      # MIR ops: every backend implements those without a composite (composites.py)
    HIR = "hir"        # blocks that lowering turns into MIR
    FUSED = "fused"    # fused MIR ops; a backend lacking one gets its composite (legalize)


class MaskKind(str, enum.Enum):
    NONE = "none"
    CAUSAL = "causal"
    SLIDING_WINDOW = "sliding_window"
    CUSTOM = "custom"   # a boolean keep-mask input
    BIAS = "bias"       # an additive float bias input


BINARY_OPS = ("add", "sub", "mul", "div", "max", "min", "pow")
COMPARE_OPS = ("eq", "ne", "lt", "le", "gt", "ge")
from .expr import ACTIVATIONS, INT_OK_ACTIVATIONS  # noqa: E402  (the expression table's entries)
REDUCE_OPS = ("sum", "mean", "max", "min", "prod")
ROPE_STYLES = ("half", "interleaved")
POOL_MODES = ("mean", "cls", "max")


# ----------------------------------------------------------------- attr schemas
@attrs.frozen
class A:
    """An attr's schema: `check` returns the normalized value or _BAD (or raises GraphError
    with a finer message); `expect` says in errors what fits. `SPEC(default)` gives the
    same schema with a default; a bare SPEC is required."""
    expect: str
    check: Callable[[Any], Any]
    default: Any = REQUIRED

    def __call__(self, default) -> "A":
        return attrs.evolve(self, default=default)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -2 ** 63 <= v < 2 ** 63


def _int(lo=None):
    return lambda v: v if _is_int(v) and (lo is None or v >= lo) else _BAD


def _num(lo=None, strict=False):
    """A finite float (an int is taken as one), optionally > lo (strict) or >= lo."""
    def check(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return _BAD
        try:
            f = float(v)
        except OverflowError:
            return _BAD
        if not math.isfinite(f) or (lo is not None and (f <= lo if strict else f < lo)):
            return _BAD
        return f
    return check


def _tuple_of(item):
    return lambda v: v if isinstance(v, tuple) and all(item(x) for x in v) else _BAD


def _dim(lo):
    return lambda d: (_is_int(d) and d >= lo) or (isinstance(d, str) and d != "")


def _dtype(v):
    if not isinstance(v, str):
        return _BAD
    try:
        return DType.parse(v).value
    except DTypeError:
        return _BAD


def one_of(choices) -> A:
    choices = tuple(choices)
    return A(f"one of {list(choices)}", lambda v: v if isinstance(v, str) and v in choices else _BAD)


def _pairs(v) -> bool:
    """(name, value) pairs with distinct string names, the form of frozen kwargs."""
    return (isinstance(v, tuple) and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                         for p in v) and len({p[0] for p in v}) == len(v))


def _program(v):
    """Steps (op, attrs pairs, arg slots) of elementwise ops; each step's attrs go through
    its op's schema (the meta checks the slots and shapes against the inputs)."""
    if not isinstance(v, tuple) or not v:
        return _BAD
    steps = []
    for step in v:
        if not (isinstance(step, tuple) and len(step) == 3 and isinstance(step[0], str)
                and _pairs(step[1]) and isinstance(step[2], tuple) and all(_is_int(i) and i >= 0 for i in step[2])):
            return _BAD
        d = get_op(step[0])
        if not d.elementwise or d.name == "fused_elementwise":
            raise GraphError(f"fused_elementwise program step {step[0]!r} is not an elementwise op")
        steps.append((d.name, tuple(sorted(d.check_attrs(dict(step[1])).items())), step[2]))
    return tuple(steps)


FLAG = A("true or false", lambda v: v if isinstance(v, bool) else _BAD)
INT = A("an int", _int())
COUNT = A("an int >= 0", _int(0))
FLOAT = A("a finite float", _num())
EPS = A("a finite float > 0", _num(0, strict=True))
NONNEG = A("a finite float >= 0", _num(0))
DTYPE = A(f"a dtype name, one of {[d.value for d in DType]}", _dtype)
NAME = A("a non-empty string", lambda v: v if isinstance(v, str) and v else _BAD)
INTS = A("a list of ints", _tuple_of(_is_int))
AXES = A("an int or a list of ints", lambda v: v if _is_int(v) else _tuple_of(_is_int)(v))
DIMS = A("a list of dims (ints >= 0 or symbol names)", _tuple_of(_dim(0)))
TARGET_DIMS = A("a list of dims (ints >= -1 or symbol names)", _tuple_of(_dim(-1)))
PARAMS = A("a list of [name, value] pairs with distinct names",
           lambda v: tuple(sorted(v)) if _pairs(v) else _BAD)
PROGRAM = A("a non-empty list of [op, attrs, slots] steps", _program)
MASK_KIND = one_of(m.value for m in MaskKind)
STYLE = one_of(ROPE_STYLES)


def _scheme(v):
    try:
        return QuantScheme.parse(v).name if isinstance(v, str) and v else _BAD
    except GraphError:
        return _BAD


SCHEME = A(f"a quant scheme name, one of {QuantScheme.known()}", _scheme)
MAYBE_SCHEME = A("\"\" or a quant scheme name", lambda v: "" if v == "" else _scheme(v))
ACT = one_of(ACTIVATIONS)


def brief(v) -> str:
    """A value's repr cut short for an error message."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


@attrs.frozen
class OpDef:
    name: str
    inputs: tuple                 # names; a trailing "?" marks optional, "*" variadic
    attrs: dict                   # attr name -> A (its schema and default)
    meta: Callable                # (list[Shape], dict) -> tuple[Shape, ...]
    level: Level
    doc: str
    elementwise: bool = False
    view_of: int | None = None    # output is a view of this input (reshape, narrow, kv_write)
    effect: bool = False          # has a side effect: DCE keeps it
    n_outputs: int = 1

    def check_attrs(self, given: dict) -> dict:
        """Every attr checked against its schema and normalized; defaults filled in."""
        unknown = [k for k in given if k not in self.attrs]
        if unknown:
            raise GraphError(f"op {self.name!r}: unknown attr(s) {sorted(map(str, unknown))}; "
                             f"expected {sorted(self.attrs)}")
        out = {}
        for key, spec in self.attrs.items():
            if key not in given:
                if spec.default is REQUIRED:
                    raise GraphError(f"op {self.name!r}: missing required attr {key!r} "
                                     f"({spec.expect})")
                out[key] = spec.default
                continue
            where = f"op {self.name!r}: attr {key!r}"
            try:
                value = spec.check(freeze(given[key]))
            except GraphError as e:
                raise GraphError(f"{where}: {e}") from None
            if value is _BAD:
                raise GraphError(f"{where} = {brief(given[key])}: expected {spec.expect}")
            out[key] = value
        return out

    def check_arity(self, n: int) -> None:
        fixed = [i for i in self.inputs if not i.endswith(("?", "*"))]
        optional = [i for i in self.inputs if i.endswith("?")]
        variadic = any(i.endswith("*") for i in self.inputs)
        if n < len(fixed) or (not variadic and n > len(fixed) + len(optional)):
            raise GraphError(f"op {self.name!r} takes inputs {self.inputs}, got {n}")


def freeze(value: Any, depth: int = 0) -> Any:
    """Attr values are plain, hashable and JSON-able: enums become strings, lists tuples."""
    if depth > _MAX_DEPTH:
        raise GraphError(f"attr value nested more than {_MAX_DEPTH} levels deep")
    if isinstance(value, enum.Enum):
        return value.value
    if getattr(value, "_rlx_graph_attr", False):    # a body of if_/while_/scan (ir/control.py)
        return value
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v, depth + 1) for v in value)
    if isinstance(value, bool) or value is None or isinstance(value, (int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    raise GraphError(f"attr value {brief(value)} of type {type(value).__name__} is not allowed")


OPS: dict[str, OpDef] = {}


def op(name, inputs, level=Level.PRIM, **kw):
    """Decorator declaring an op whose meta function is the decorated one."""
    attrs_ = kw.pop("attrs", {})

    def wrap(meta):
        OPS[name] = OpDef(name=name, inputs=tuple(inputs), attrs=dict(attrs_), meta=meta,
                          level=level, doc=(meta.__doc__ or "").strip(), **kw)
        return meta
    return wrap


def get_op(name: str) -> OpDef:
    try:
        return OPS[name]
    except KeyError:
        raise GraphError(f"unknown op {name!r}; known ops: {', '.join(sorted(OPS))}") from None


def infer(name: str, shapes: list, attrs_: dict) -> tuple:
    """Output shapes of `name` on `shapes`, raising ShapeError/DTypeError naming the op."""
    d = get_op(name)
    try:
        return tuple(d.meta(shapes, attrs_))
    except (ShapeError, DTypeError) as e:
        raise type(e)(f"op {name!r}: {e}") from None
    except RlxError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
        # a malformed attr (a string axis, a float shape) is a graph error, not a crash
        raise GraphError(f"op {name!r}: bad attrs {attrs_!r} for inputs "
                         f"{[str(s) for s in shapes]}: {type(e).__name__}: {e}") from None


def step_dtypes(program, in_dtypes: list) -> list:
    """The dtype of every step of an elementwise program (fused_elementwise's) on inputs of
    `in_dtypes`, inferred as the unfused ops would be."""
    dts = list(in_dtypes)
    for op_name, attrs_, args in program:
        dts.append(infer(op_name, [Shape((), dts[i]) for i in args], dict(attrs_))[0].dtype)
    return dts[len(in_dtypes):]


# ----------------------------------------------------------------- helpers for metas
def _float(s: Shape, what: str) -> None:
    if not (s.dtype.is_float or s.dtype.is_complex):
        raise DTypeError(f"{what} needs a float input, got {s.dtype.value}")


def _same_dim(a, b, what) -> None:
    if a != b and not (isinstance(a, str) or isinstance(b, str)):
        raise ShapeError(f"{what}: {a} != {b}")


def _last(s: Shape, what: str):
    if s.rank == 0:
        raise ShapeError(f"{what} needs rank >= 1, got a scalar")
    return s.dims[-1]


def _check_vec(x: Shape, w: Shape | None, what: str) -> None:
    if w is not None:
        if w.rank != 1:
            raise ShapeError(f"{what} weight must be rank 1, got {w}")
        _same_dim(w.dims[0], _last(x, what), f"{what} weight vs last dim of {x}")


# ----------------------------------------------------------------- leaves
_LEAF = dict(attrs={"shape": DIMS, "dtype": DTYPE})


@op("input", [], Level.LEAF, **_LEAF)
def _m_input(s, a):
    """A named runtime input."""
    return (Shape(a["shape"], a["dtype"]),)


def _shard(v):
    """() or (source param, axis, start, length, padded length): a tensor-parallel rank's slice."""
    if v == ():
        return v
    ok = (isinstance(v, tuple) and len(v) == 5 and isinstance(v[0], str) and v[0]
          and all(_is_int(x) for x in v[1:]) and v[2] >= 0 and 0 <= v[3] <= v[4])
    return v if ok else _BAD


SHARD = A("[] or [source, axis, start, length, padded length]", _shard)


@op("param", [], Level.LEAF, attrs=dict(_LEAF["attrs"], scheme=MAYBE_SCHEME(""), shard=SHARD(())))
def _m_param(s, a):
    """A named weight, resident on the backend between runs. With a quant `scheme` it is
    bound packed: as a float it is the logical weight (HIR; passes/packed.py rewrites it),
    as u8 [rows, bytes per row] it is the packed bytes (a stack of matrices, such as routed
    experts' [E, rows, bytes per row], keeps its leading dims). With `shard` (passes/shard.py) it
    binds rows [start, start + length) of `source` along `axis`, zero-padded to `padded`
    (packed: of the bytes, whole rows or whole blocks of each row)."""
    out = Shape(a["shape"], a["dtype"])
    if a["scheme"] and not out.dtype.is_float and (out.dtype is not DType.U8 or out.rank < 2):
        raise ShapeError(f"a packed {a['scheme']} param is u8 [..., rows, bytes per row] or its float "
                         f"logical shape, got {out}")
    return (out,)


@op("state", [], Level.LEAF, **_LEAF)
def _m_state(s, a):
    """A named mutable buffer kept by the executable across runs (a KV cache)."""
    return (Shape(a["shape"], a["dtype"]),)


@op("constant", [], Level.LEAF, **_LEAF)
def _m_constant(s, a):
    """A literal array stored in the graph's constant table under the node's name."""
    return (Shape(a["shape"], a["dtype"]),)


# ----------------------------------------------------------------- primitives
def _matmul_meta(a: Shape, b: Shape, ta: bool, tb: bool) -> Shape:
    if a.rank < 2 or b.rank < 2:
        raise ShapeError(f"matmul needs rank >= 2 inputs, got {a} and {b}")
    m, k = (a.dims[-1], a.dims[-2]) if ta else (a.dims[-2], a.dims[-1])
    k2, n = (b.dims[-1], b.dims[-2]) if tb else (b.dims[-2], b.dims[-1])
    _same_dim(k, k2, f"matmul contraction dims of {a} and {b}")
    batch = broadcast_dims(a.dims[:-2], b.dims[:-2], "matmul batch")
    return Shape(batch + (m, n), promote(a.dtype, b.dtype))


@op("matmul", ["a", "b"], attrs={"trans_a": FLAG(False), "trans_b": FLAG(False)})
def _m_matmul(s, a):
    """Batched matmul with numpy broadcasting of batch dims and optional transposes."""
    return (_matmul_meta(s[0], s[1], a["trans_a"], a["trans_b"]),)


@op("binary", ["a", "b"], attrs={"op": one_of(BINARY_OPS)}, elementwise=True)
def _m_binary(s, a):
    """Elementwise add/sub/mul/div/max/min/pow with broadcasting and type promotion."""
    return (Shape(broadcast_dims(s[0].dims, s[1].dims), promote(s[0].dtype, s[1].dtype)),)


@op("compare", ["a", "b"], attrs={"op": one_of(COMPARE_OPS)}, elementwise=True)
def _m_compare(s, a):
    """Elementwise comparison giving bool."""
    return (Shape(broadcast_dims(s[0].dims, s[1].dims), BOOL),)


@op("where", ["cond", "a", "b"], elementwise=True)
def _m_where(s, a):
    """cond ? a : b with broadcasting."""
    if s[0].dtype is not BOOL:
        raise DTypeError(f"where condition must be bool, got {s[0].dtype.value}")
    dims = broadcast_dims(broadcast_dims(s[0].dims, s[1].dims), s[2].dims)
    return (Shape(dims, promote(s[1].dtype, s[2].dtype)),)


@op("activation", ["x"], attrs={"fn": ACT}, elementwise=True)
def _m_activation(s, a):
    """Unary elementwise function (gelu, silu, exp, rsqrt, ...)."""
    if a["fn"] not in INT_OK_ACTIVATIONS:
        _float(s[0], f"activation {a['fn']}")
    return (s[0],)


@op("cast", ["x"], attrs={"dtype": DTYPE}, elementwise=True)
def _m_cast(s, a):
    """Convert to another dtype."""
    return (s[0].with_dtype(DType.parse(a["dtype"])),)


def _axes(axes, rank, what):
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    out = tuple(sorted({norm_axis(x, rank, what) for x in axes}))
    return out


@op("reduce", ["x"], attrs={"op": one_of(REDUCE_OPS), "axes": AXES, "keepdims": FLAG(False)})
def _m_reduce(s, a):
    """Reduce over any axes (sum mean max min prod)."""
    axes = _axes(a["axes"], s[0].rank, "reduce")
    dims = tuple((1 if a["keepdims"] else None) if i in axes else d for i, d in enumerate(s[0].dims))
    return (Shape(tuple(d for d in dims if d is not None), s[0].dtype),)


@op("softmax", ["x"], attrs={"axis": INT(-1)})
def _m_softmax(s, a):
    """Numerically stable softmax along one axis (accumulates in f32)."""
    _float(s[0], "softmax")
    norm_axis(a["axis"], s[0].rank, "softmax")
    return (s[0],)


@op("layer_norm", ["x", "gamma?", "beta?"], attrs={"eps": EPS(1e-5)})
def _m_layer_norm(s, a):
    """LayerNorm over the last axis."""
    _float(s[0], "layer_norm")
    for w in s[1:]:
        _check_vec(s[0], w, "layer_norm")
    return (s[0],)


@op("rms_norm", ["x", "weight?"], attrs={"eps": EPS(1e-6), "offset": FLOAT(0.0)})
def _m_rms_norm(s, a):
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * (weight + offset)."""
    _float(s[0], "rms_norm")
    _check_vec(s[0], s[1] if len(s) > 1 else None, "rms_norm")
    return (s[0],)


def _rope_check(x: Shape, cos: Shape, sin: Shape) -> None:
    _float(x, "rope")
    if x.rank != 4:
        raise ShapeError(f"rope input must be [batch, heads, seq, head_dim], got {x}")
    if cos.dims != sin.dims:
        raise ShapeError(f"rope cos {cos} and sin {sin} differ")
    if cos.rank not in (2, 3):
        raise ShapeError(f"rope tables must be [seq, rot/2] or [batch, seq, rot/2], got {cos}")
    half = cos.dims[-1]
    if isinstance(half, int) and isinstance(x.dims[3], int) and 2 * half > x.dims[3]:
        raise ShapeError(f"rope tables cover {2 * half} dims but head_dim is {x.dims[3]}")
    _same_dim(cos.dims[-2], x.dims[2], f"rope table seq vs input seq ({cos} vs {x})")


@op("rope", ["x", "cos", "sin"], attrs={"style": STYLE("half")})
def _m_rope(s, a):
    """Rotary embedding on [B,H,S,D]; tables [S,R/2] or [B,S,R/2]; R <= D rotates the first R dims."""
    _rope_check(*s)
    return (s[0],)


_MASK_ATTRS = {"mask_kind": MASK_KIND("causal"), "window": COUNT(0), "has_mask": FLAG(False),
               "has_pos": FLAG(False)}
_ATTN_ATTRS = dict(_MASK_ATTRS, scale=FLOAT, softcap=NONNEG(0.0))


def _attention_meta(s: list, a: dict) -> Shape:
    q, k, v = s[:3]
    for t, nm in ((q, "q"), (k, "k"), (v, "v")):
        if t.rank != 4:
            raise ShapeError(f"attention {nm} must be [batch, heads, seq, head_dim], got {t}")
        _float(t, "attention")
    kind = MaskKind(a["mask_kind"])
    _same_dim(q.dims[3], k.dims[3], "attention q/k head_dim")
    _same_dim(k.dims[2], v.dims[2], "attention k/v seq")
    _same_dim(k.dims[1], v.dims[1], "attention k/v heads")
    _same_dim(q.dims[0], k.dims[0], "attention q/k batch")
    h, kvh = q.dims[1], k.dims[1]
    if isinstance(h, int) and isinstance(kvh, int) and (kvh == 0 or h % kvh):
        raise ShapeError(f"attention: {h} query heads is not a multiple of {kvh} kv heads (GQA)")
    if kind is MaskKind.SLIDING_WINDOW and a["window"] <= 0:
        raise ShapeError("attention: sliding_window needs window > 0")
    extra = s[3:]
    if len(extra) != int(a["has_mask"]) + int(a["has_pos"]):
        raise ShapeError(f"attention: has_mask={a['has_mask']} has_pos={a['has_pos']} but "
                         f"{len(extra)} extra inputs")
    if kind in (MaskKind.CUSTOM, MaskKind.BIAS) and not a["has_mask"]:
        raise ShapeError(f"attention: mask_kind {kind.value} needs a mask input")
    if a["has_mask"]:
        m = extra[0]
        if kind is MaskKind.BIAS and not m.dtype.is_float:
            raise DTypeError(f"attention bias must be float, got {m.dtype.value}")
        if kind is not MaskKind.BIAS and m.dtype is not BOOL and not m.dtype.is_float:
            raise DTypeError(f"attention mask must be bool (keep) or float (bias), got {m.dtype.value}")
        broadcast_dims(m.dims, (q.dims[0], h, q.dims[2], k.dims[2]), "attention mask")
    if a["has_pos"]:
        p = extra[-1]
        if not p.dtype.is_int or p.rank != 1:
            raise ShapeError(f"attention pos must be an int vector [batch], got {p}")
    return Shape(q.dims[:3] + (v.dims[3],), q.dtype)


@op("attention", ["q", "k", "v", "mask?", "pos?"], attrs=_ATTN_ATTRS)
def _m_attention(s, a):
    """softmax(q k^T * scale [softcap] [mask]) v with GQA. Query i sits at position
    pos[b] + i (has_pos) or Sk - Sq + i; causal keeps keys j <= that position."""
    return (_attention_meta(s, a),)


@op("mask_fill", ["scores", "mask?", "pos?"],
    attrs=_MASK_ATTRS)
def _m_mask_fill(s, a):
    """Apply attention's mask to scores [B,H,Sq,Sk]: masked entries become -inf (or add a bias)."""
    if s[0].rank != 4:
        raise ShapeError(f"mask_fill scores must be rank 4, got {s[0]}")
    return (s[0],)


@op("gather", ["table", "indices"], attrs={"axis": INT(0)})
def _m_gather(s, a):
    """Take rows of `table` along `axis` at integer `indices` (embedding lookup)."""
    t, i = s
    if not i.dtype.is_int:
        raise DTypeError(f"gather indices must be integer, got {i.dtype.value}")
    ax = norm_axis(a["axis"], t.rank, "gather")
    return (Shape(t.dims[:ax] + i.dims + t.dims[ax + 1:], t.dtype),)


def resolve_reshape(src: tuple, target: tuple) -> tuple:
    """Fill a -1 in `target` from `src`; symbols must be carried over by name."""
    target = tuple(target)
    if sum(1 for d in target if d == -1) > 1:
        raise ShapeError(f"reshape target {target} has more than one -1")
    if all(isinstance(d, int) for d in src):
        total = 1
        for d in src:
            total *= d
        known = 1
        for d in target:
            if isinstance(d, str):
                raise ShapeError(f"reshape to symbol {d!r} from static shape {src}")
            if d != -1:
                known *= d
        if -1 in target:
            if known == 0 or total % known:
                raise ShapeError(f"cannot reshape {src} to {target}")
            target = tuple(total // known if d == -1 else d for d in target)
        elif known != total:
            raise ShapeError(f"cannot reshape {src} ({total} elements) to {target}")
        return target
    # symbolic: the symbols must survive unchanged and the static parts must agree
    if sorted(d for d in src if isinstance(d, str)) != sorted(d for d in target if isinstance(d, str)):
        raise ShapeError(f"reshape {src} -> {target} must keep the same named dims")
    s_static = 1
    for d in src:
        if isinstance(d, int):
            s_static *= d
    t_static = 1
    for d in target:
        if isinstance(d, int) and d != -1:
            t_static *= d
    if -1 in target:
        if t_static == 0 or s_static % t_static:
            raise ShapeError(f"cannot reshape {src} to {target}")
        target = tuple(s_static // t_static if d == -1 else d for d in target)
    elif s_static != t_static:
        raise ShapeError(f"cannot reshape {src} to {target}")
    return target


@op("reshape", ["x"], attrs={"shape": TARGET_DIMS}, view_of=0)
def _m_reshape(s, a):
    """Same data, new dims (a view); one dim may be -1."""
    return (Shape(resolve_reshape(s[0].dims, a["shape"]), s[0].dtype),)


@op("transpose", ["x"], attrs={"perm": INTS})
def _m_transpose(s, a):
    """Permute axes."""
    perm = tuple(a["perm"])
    if sorted(perm) != list(range(s[0].rank)):
        raise ShapeError(f"transpose perm {perm} is not a permutation of rank {s[0].rank}")
    return (Shape(tuple(s[0].dims[p] for p in perm), s[0].dtype),)


@op("narrow", ["x"], attrs={"axis": INT, "start": INT, "length": COUNT}, view_of=0)
def _m_narrow(s, a):
    """x[..., start:start+length, ...] along one axis (a view); a negative start counts from the end."""
    x = s[0]
    ax = norm_axis(a["axis"], x.rank, "narrow")
    d = x.dims[ax]
    start = a["start"] + d if a["start"] < 0 and isinstance(d, int) else a["start"]
    if a["start"] < 0 and a["start"] + a["length"] > 0:
        raise ShapeError(f"narrow from the end: start {a['start']} + length {a['length']} passes the end")
    if (start < 0 and isinstance(d, int)) or a["length"] < 0 or (isinstance(d, int) and start + a["length"] > d):
        raise ShapeError(f"narrow [{a['start']}:{a['start'] + a['length']}] out of range for "
                         f"axis {ax} of {x}")
    return (Shape(x.dims[:ax] + (a["length"],) + x.dims[ax + 1:], x.dtype),)


@op("concat", ["xs*"], attrs={"axis": INT})
def _m_concat(s, a):
    """Join along an axis."""
    if not s:
        raise ShapeError("concat needs at least one input")
    first = s[0]
    ax = norm_axis(a["axis"], first.rank, "concat")
    total: Any = 0
    for t in s:
        if t.rank != first.rank or t.dtype != first.dtype:
            raise ShapeError(f"concat inputs differ in rank or dtype: {first} vs {t}")
        for i, (x, y) in enumerate(zip(first.dims, t.dims)):
            if i != ax:
                _same_dim(x, y, f"concat off-axis dim {i}")
        d = t.dims[ax]
        total = total + d if isinstance(total, int) and isinstance(d, int) else f"{total}+{d}"
    return (Shape(first.dims[:ax] + (total,) + first.dims[ax + 1:], first.dtype),)


@op("expand", ["x"], attrs={"shape": DIMS}, view_of=0)
def _m_expand(s, a):
    """Broadcast to a larger shape (a view)."""
    target = tuple(a["shape"])
    if broadcast_dims(s[0].dims, target, "expand") != target:
        raise ShapeError(f"cannot expand {s[0]} to {target}")
    return (Shape(target, s[0].dtype),)


@op("cumsum", ["x"], attrs={"axis": INT(-1)})
def _m_cumsum(s, a):
    """Inclusive prefix sum along an axis."""
    norm_axis(a["axis"], s[0].rank, "cumsum")
    return (s[0],)


@op("topk", ["x"], attrs={"k": COUNT, "axis": INT(-1)}, n_outputs=2)
def _m_topk(s, a):
    """The k largest values along an axis, sorted descending, and their i64 indices."""
    x = s[0]
    ax = norm_axis(a["axis"], x.rank, "topk")
    d = x.dims[ax]
    if a["k"] < 1 or (isinstance(d, int) and a["k"] > d):
        raise ShapeError(f"topk k={a['k']} out of range for axis of size {d}")
    dims = x.dims[:ax] + (a["k"],) + x.dims[ax + 1:]
    return (Shape(dims, x.dtype), Shape(dims, I64))


@op("argmax", ["x"], attrs={"axis": INT(-1), "keepdims": FLAG(False)})
def _m_argmax(s, a):
    """Index of the largest value along an axis (first on ties), i64."""
    (r,) = _m_reduce([s[0]], {"op": "max", "axes": (a["axis"],), "keepdims": a["keepdims"]})
    return (r.with_dtype(I64),)


@op("kv_write", ["cache", "new", "pos"], attrs={"axis": INT(2)}, view_of=0, effect=True)
def _m_kv_write(s, a):
    """Write `new` into the state `cache` at offset pos[b] along `axis` (in place); returns the cache."""
    c, n, p = s
    if c.rank != n.rank or c.dtype != n.dtype:
        raise ShapeError(f"kv_write new {n} does not match cache {c}")
    if not p.dtype.is_int or p.rank != 1:
        raise ShapeError(f"kv_write pos must be an int vector [batch], got {p}")
    return (c,)


@op("assign", ["state", "value"], view_of=0, effect=True)
def _m_assign(s, a):
    """Overwrite the state `state` with `value` (same shape and dtype), in place, where the
    node stands in the graph: after every node before it (an optimizer step writes the
    weights the step read); returns the state."""
    st, v = s
    if st.dims != v.dims or st.dtype != v.dtype:
        raise ShapeError(f"assign value {v} does not match the state {st}")
    return (st,)


@op("custom", ["xs*"], attrs={"name": NAME, "params": PARAMS(())})
def _m_custom(s, a):
    """An op registered by a plugin through rlx_register_ops; meta and kernels come from it."""
    from .custom import custom_op

    return tuple(custom_op(a["name"]).meta(s, dict(a["params"])))


# ----------------------------------------------------------------- collectives
# Tensor parallelism (passes/shard.py): each rank runs its own MIR; `world` and `rank` name
# the group and the rank the node was sharded for. Kernels call the communicator bound in
# the process (ir/comm.py). Not elementwise, so fusion keeps them as boundaries.
_GROUP = {"world": A("an int >= 1", _int(1)), "rank": COUNT}


def _group_check(a: dict, name: str) -> None:
    if a["rank"] >= a["world"]:
        raise GraphError(f"{name}: rank {a['rank']} is outside a group of {a['world']}")


def _scaled_axis(x: Shape, a: dict, name: str, grow: bool) -> Shape:
    _group_check(a, name)
    ax = norm_axis(a["axis"], x.rank, name)
    d, w = x.dims[ax], a["world"]
    if isinstance(d, str):
        raise ShapeError(f"{name} needs a static dim on axis {ax}, got {x}")
    if not grow and d % w:
        raise ShapeError(f"{name}: axis {ax} of {x} does not split over {w} ranks")
    return Shape(x.dims[:ax] + ((d * w) if grow else (d // w),) + x.dims[ax + 1:], x.dtype)


@op("all_reduce", ["x"], attrs=dict(_GROUP))
def _m_all_reduce(s, a):
    """Sum of x over the group's ranks, on every rank (after a row-parallel matmul)."""
    _group_check(a, "all_reduce")
    return (s[0],)


@op("all_gather", ["x"], attrs=dict(_GROUP, axis=INT(-1)))
def _m_all_gather(s, a):
    """The ranks' x joined along `axis` in rank order (after a column-parallel matmul)."""
    return (_scaled_axis(s[0], a, "all_gather", True),)


@op("reduce_scatter", ["x"], attrs=dict(_GROUP, axis=INT(-1)))
def _m_reduce_scatter(s, a):
    """The sum over ranks, of which each rank keeps its 1/world chunk along `axis`."""
    return (_scaled_axis(s[0], a, "reduce_scatter", False),)


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


# ----------------------------------------------------------------- HIR blocks
@op("linear", ["x", "weight", "bias?"], Level.HIR, attrs={"transpose_w": FLAG(True)})
def _m_linear(s, a):
    """x @ W^T (+ b) for HF-layout weights [out, in]; transpose_w=False takes [in, out]."""
    y = _matmul_meta(s[0], s[1], False, a["transpose_w"])
    if len(s) > 2:
        _check_vec(y, s[2], "linear bias")
    return (y,)


@op("swiglu_mlp", ["x", "w_gate", "w_up", "w_down"], Level.HIR, attrs={"transpose_w": FLAG(True)})
def _m_swiglu_mlp(s, a):
    """down(silu(gate(x)) * up(x)) with HF-layout weights."""
    g = _matmul_meta(s[0], s[1], False, a["transpose_w"])
    u = _matmul_meta(s[0], s[2], False, a["transpose_w"])
    if g.dims != u.dims:
        raise ShapeError(f"swiglu gate {g} and up {u} differ")
    return (_matmul_meta(g, s[3], False, a["transpose_w"]),)


# ----------------------------------------------------------------- fused MIR ops
@op("fused_swiglu", ["gate", "up"], Level.FUSED, elementwise=True)
def _m_fused_swiglu(s, a):
    """silu(gate) * up."""
    if s[0].dims != s[1].dims:
        raise ShapeError(f"fused_swiglu gate {s[0]} and up {s[1]} differ")
    return (s[0].with_dtype(promote(s[0].dtype, s[1].dtype)),)


@op("fused_matmul_bias_act", ["x", "w", "bias?"], Level.FUSED,
    attrs={"trans_b": FLAG(False), "act": ACT("identity")})
def _m_fused_mba(s, a):
    """act(x @ w + bias), the matmul epilogue."""
    y = _matmul_meta(s[0], s[1], False, a["trans_b"])
    if len(s) > 2:
        _check_vec(y, s[2], "fused_matmul_bias_act bias")
    return (y,)


# ----------------------------------------------------------------- packed weights
def _packed_k(w: Shape, scheme: str, what: str) -> int:
    """K of packed bytes w: u8 [..., bytes per row]."""
    q = QuantScheme.parse(scheme)
    if w.dtype is not DType.U8 or w.rank < 1:
        raise DTypeError(f"{what}: packed {q.name} input must be u8 [..., bytes per row], got {w}")
    per_row = w.dims[-1]
    if isinstance(per_row, int) and per_row % q.bytes_per_block:
        raise ShapeError(f"{what}: {per_row} bytes per row is not a whole number of {q.name} blocks "
                         f"({q.bytes_per_block} bytes each)")
    return per_row // q.bytes_per_block * q.block_size if isinstance(per_row, int) else per_row


@op("dequantize", ["x"], attrs={"scheme": SCHEME, "dtype": DTYPE("f32")})
def _m_dequantize(s, a):
    """Packed bytes u8 [..., bytes per row] -> floats [..., K]."""
    dt = DType.parse(a["dtype"])
    if not dt.is_float:
        raise DTypeError(f"dequantize dtype must be a float type, got {dt.value}")
    return (Shape(s[0].dims[:-1] + (_packed_k(s[0], a["scheme"], "dequantize"),), dt),)


@op("quantize", ["x"], attrs={"scheme": SCHEME})
def _m_quantize(s, a):
    """Floats [..., K] -> packed bytes u8 [..., bytes per row] (K a multiple of the block)."""
    _float(s[0], "quantize")
    q, k = QuantScheme.parse(a["scheme"]), _last(s[0], "quantize")
    if isinstance(k, int) and k % q.block_size:
        raise ShapeError(f"quantize: last dim {k} is not a multiple of the {q.name} block size {q.block_size}")
    per_row = k // q.block_size * q.bytes_per_block if isinstance(k, int) else k
    return (Shape(s[0].dims[:-1] + (per_row,), DType.U8),)


@op("fake_quantize", ["x"], Level.FUSED, attrs={"scheme": SCHEME})
def _m_fake_quantize(s, a):
    """dequantize(quantize(x)): the values x takes once stored in the scheme (quantization-
    aware experiments)."""
    _m_quantize(s, a)
    return (s[0],)


@op("dequant_matmul", ["x", "w", "bias?"], Level.FUSED, attrs={"scheme": SCHEME, "act": ACT("identity")})
def _m_dequant_matmul(s, a):
    """act(x @ dequantize(w)^T + bias) with w the packed bytes of an [N, K] weight: each
    weight byte is read once and decoded where it is used."""
    x, w = s[:2]
    _float(x, "dequant_matmul")
    if w.rank != 2:
        raise ShapeError(f"dequant_matmul weight must be packed [N, bytes per row], got {w}")
    _same_dim(_last(x, "dequant_matmul"), _packed_k(w, a["scheme"], "dequant_matmul"),
              f"dequant_matmul K of {x} vs packed {a['scheme']} weight {w}")
    y = Shape(x.dims[:-1] + (w.dims[0],), x.dtype)
    if len(s) > 2:
        _check_vec(y, s[2], "dequant_matmul bias")
    return (y,)


def _residual_meta(s):
    x, r = s[:2]
    if x.dims != r.dims and broadcast_dims(x.dims, r.dims) != x.dims:
        raise ShapeError(f"residual {r} does not match {x}")
    h = Shape(broadcast_dims(x.dims, r.dims), promote(x.dtype, r.dtype))
    return h


@op("fused_residual_rms_norm", ["x", "residual", "weight?"], Level.FUSED,
    attrs={"eps": EPS(1e-6), "offset": FLOAT(0.0)}, n_outputs=2)
def _m_fused_rrms(s, a):
    """h = x + residual; returns (h, rms_norm(h))."""
    h = _residual_meta(s)
    _check_vec(h, s[2] if len(s) > 2 else None, "rms_norm")
    return (h, h)


@op("fused_residual_ln", ["x", "residual", "gamma?", "beta?"], Level.FUSED,
    attrs={"eps": EPS(1e-5)}, n_outputs=2)
def _m_fused_rln(s, a):
    """h = x + residual; returns (h, layer_norm(h))."""
    h = _residual_meta(s)
    for w in s[2:]:
        _check_vec(h, w, "layer_norm")
    return (h, h)


# the backward of the norms and softmax as fusion targets: value_and_grad keeps these ops in
# the forward graph and their VJP rules emit these; a backend without a kernel gets them
# legalized to the closed-form primitives (composites.py)
def _grad_of(x: Shape, g: Shape, what: str) -> None:
    _float(x, what)
    if x.dims != g.dims:
        raise ShapeError(f"{what}: cotangent {g} does not match {x}")


@op("softmax_grad", ["y", "g"], Level.FUSED, attrs={"axis": INT(-1)})
def _m_softmax_grad(s, a):
    """dx = y * (g - sum(g * y, axis)) for y = softmax(x, axis) and cotangent g."""
    _grad_of(s[0], s[1], "softmax_grad")
    norm_axis(a["axis"], s[0].rank, "softmax_grad")
    return (s[0],)


@op("rms_norm_grad", ["x", "weight", "g"], Level.FUSED, attrs={"eps": EPS(1e-6), "offset": FLOAT(0.0)},
    n_outputs=2)
def _m_rms_norm_grad(s, a):
    """(dx, dweight) of y = rms_norm(x, weight) for cotangent g; dweight sums every row."""
    _grad_of(s[0], s[2], "rms_norm_grad")
    _check_vec(s[0], s[1], "rms_norm_grad")
    return (s[0], s[1])


@op("layer_norm_grad", ["x", "gamma", "g"], Level.FUSED, attrs={"eps": EPS(1e-5)}, n_outputs=3)
def _m_layer_norm_grad(s, a):
    """(dx, dgamma, dbeta) of y = layer_norm(x, gamma, beta) for cotangent g; dgamma and
    dbeta sum every row."""
    _grad_of(s[0], s[2], "layer_norm_grad")
    _check_vec(s[0], s[1], "layer_norm_grad")
    return (s[0], s[1], s[1])


@op("attention_grad", ["q", "k", "v", "out", "g", "mask?", "pos?"], Level.FUSED, attrs=_ATTN_ATTRS,
    n_outputs=3)
def _m_attention_grad(s, a):
    """(dq, dk, dv) of out = attention(q, k, v, ...) for cotangent g (same attrs as attention).
    A kernel recomputes the probabilities from q and k instead of keeping [B,H,Sq,Sk] from
    the forward; `out` is there for a flash-style kernel, whose row sums sum(g * out) replace
    sum(P dP) (the NumPy kernel and the legalized form use P itself, not the rounded out).
    GQA: dk, dv sum their query heads."""
    o = _attention_meta(s[:3] + s[5:], a)
    for t, nm in ((s[3], "out"), (s[4], "g")):
        if t.dims != o.dims:
            raise ShapeError(f"attention_grad {nm} {t} does not match the attention output {o}")
    return (s[0], s[1], s[2])


@op("fused_attention_block", ["q", "k", "v", "cos", "sin", "mask?", "pos?"], Level.FUSED,
    attrs=dict(_ATTN_ATTRS, style=STYLE("half")))
def _m_fused_attn_block(s, a):
    """attention(rope(q), rope(k), v): RoPE applied inside the attention kernel."""
    _rope_check(s[0], s[3], s[4])
    _rope_check(s[1], s[3], s[4])
    return (_attention_meta(s[:3] + s[5:], a),)


def _segments_meta(starts: Shape, lens: Shape, what: str) -> None:
    for t, nm in ((starts, "starts"), (lens, "lens")):
        if t.rank != 1 or not t.dtype.is_int:
            raise ShapeError(f"{what} {nm} must be an int vector [segments], got {t}")
    _same_dim(starts.dims[0], lens.dims[0], f"{what} starts vs lens")


@op("varlen_attention", ["q", "k", "v", "starts", "lens"], Level.FUSED, attrs={"scale": FLOAT})
def _m_varlen_attention(s, a):
    """Bidirectional attention within each segment of packed tokens (texts of a batch end to
    end, no padding): q [T, H, D], k [T, KVH, D], v [T, KVH, Dv] (GQA: H a multiple of KVH);
    segment i is tokens [starts[i], starts[i] + lens[i]) (disjoint, in range; empty ones
    allowed). A token in no segment gets zeros. -> [T, H, Dv]."""
    q, k, v = s[:3]
    for t, nm in ((q, "q"), (k, "k"), (v, "v")):
        if t.rank != 3:
            raise ShapeError(f"varlen_attention {nm} must be [tokens, heads, head_dim], got {t}")
        _float(t, "varlen_attention")
    for i, what in ((0, "tokens"), (1, "heads")):
        _same_dim(k.dims[i], v.dims[i], f"varlen_attention k/v {what}")
    _same_dim(q.dims[0], k.dims[0], "varlen_attention q/k tokens")
    _same_dim(q.dims[2], k.dims[2], "varlen_attention q/k head_dim")
    h, kvh = q.dims[1], k.dims[1]
    if isinstance(h, int) and isinstance(kvh, int) and (kvh == 0 or h % kvh):
        raise ShapeError(f"varlen_attention: {h} query heads is not a multiple of {kvh} kv heads (GQA)")
    _segments_meta(s[3], s[4], "varlen_attention")
    return (Shape(q.dims[:2] + (v.dims[2],), q.dtype),)


@op("segment_pool", ["x", "starts", "lens"], Level.FUSED, attrs={"mode": one_of(POOL_MODES)})
def _m_segment_pool(s, a):
    """Pool each segment of packed tokens x [T, D] -> [segments, D]: the mean, the first
    token (cls) or the max over tokens [starts[i], starts[i] + lens[i]); an empty segment
    gives zeros."""
    x = s[0]
    if x.rank != 2:
        raise ShapeError(f"segment_pool x must be [tokens, features], got {x}")
    _float(x, "segment_pool")
    _segments_meta(s[1], s[2], "segment_pool")
    return (Shape((s[1].dims[0], x.dims[1]), x.dtype),)


@op("fused_elementwise", ["xs*"], Level.FUSED, attrs={"program": PROGRAM, "dtype": DTYPE},
    elementwise=True)
def _m_fused_elementwise(s, a):
    """A region of elementwise ops run as one kernel. `program` is a tuple of steps
    (op, attrs-items, arg slots); slot i < n_inputs names an input, later slots earlier steps."""
    dims: tuple = ()
    for t in s:
        dims = broadcast_dims(dims, t.dims, "fused_elementwise")
    n = len(s)
    for j, (name, _, args) in enumerate(a["program"]):
        if any(i >= n + j for i in args):
            raise GraphError(f"fused_elementwise step {j} ({name}) reads slots {args}; only "
                             f"{n + j} exist there")
        get_op(name).check_arity(len(args))
    return (Shape(dims, a["dtype"]),)


HIR_ONLY = {n for n, d in OPS.items() if d.level is Level.HIR}
FUSED = {n for n, d in OPS.items() if d.level is Level.FUSED}
LEAVES = {n for n, d in OPS.items() if d.level is Level.LEAF}
