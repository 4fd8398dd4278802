"""The op parity suite: every op of the table against an independent float64 reference, for
every float dtype (and ints where they make sense), with outputs poisoned before each run, on
the backends the kit's pytest plugin picks (see rlx_core.testing). The machinery is in
rlx_core.testing.parity; a test module pulls the suite in with

    from rlx_core.testing.ops_suite import *  # noqa: F401,F403
"""
from __future__ import annotations

import math

import attrs
import numpy as np
import pytest

from rlx_core.ir.dtype import BF16, BOOL, F16, F32, F64, I32, I64, U8, DType
from rlx_core.ir.graph import HIR, MIR, Builder
from rlx_core.ir.shape import Shape
from rlx_core.ir.ops import ACTIVATIONS, BINARY_OPS, COMPARE_OPS, INT_OK_ACTIVATIONS, OPS, POOL_MODES, Level

from .parity import (FLOATS, PARITY_PROFILE, REF_ACT, TOL, Arg, arg, backend, compile_on,  # noqa: F401
                     assert_close, exact, one_op, rand, ref_attention, ref_attention_grad, ref_binary, ref_compare, ref_cumsum,
                     ref_elementwise, ref_keep, ref_kv_write, ref_layer_norm, ref_layer_norm_grad,
                     ref_mask_fill, ref_matmul, ref_reduce, ref_rms_norm, ref_rms_norm_grad, ref_rope,
                     ref_segment_pool, ref_softmax, ref_softmax_grad, ref_swiglu, ref_topk,
                     ref_varlen_attention, rlx_backend, rng, run_parity)
from .suite_base import COVERED, FLOAT_IDS, SCHEMES, covers, fdtype  # noqa: F401  (shared with its modules)


def test_backend_covers_the_op_table(backend):
    """The kit's smallest case (also checked when the backend registers): every op of the
    table runs on the backend, through its own kernel or a composite of ops it has."""
    from rlx_core.ir.composites import check_coverage
    from rlx_core.pipeline import select_backend

    check_coverage(select_backend(backend))


def test_every_op_has_a_parity_case():
    ops = {n for n, d in OPS.items() if d.level is not Level.LEAF}
    assert ops - COVERED == set(), f"ops without a parity test: {sorted(ops - COVERED)}"


# ----------------------------------------------------------------------------- matmul
@covers("matmul")
@fdtype
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("batch", ["none", "both", "bcast"])
def test_matmul(backend, rng, dt, ta, tb, batch):
    m, k, n = 3, 5, 4
    ba, bb = {"none": ((), ()), "both": ((2,), (2,)), "bcast": ((2, 1), (3,))}[batch]
    a = arg(rng, "a", ba + ((k, m) if ta else (m, k)), dt)
    b = arg(rng, "b", bb + ((n, k) if tb else (k, n)), dt)
    run_parity(backend, "matmul", [a, b], {"trans_a": ta, "trans_b": tb},
               lambda x, y: ref_matmul(x, y, ta, tb))


# ----------------------------------------------------------------------------- binary
def _binary_args(rng, op, da, db, sa=(2, 3, 4), sb=(2, 3, 4)):
    a, b = rand(rng, sa, da), rand(rng, sb, db)
    if op == "pow":
        if DType.parse(da).is_float:
            a = exact(rng.uniform(0.5, 2.0, sa), da)
        elif DType.parse(db).is_float:                     # no negative base to a float power
            a = rng.integers(1, 4, sa).astype(DType.parse(da).np)
        else:
            a = rng.integers(-3, 4, sa).astype(DType.parse(da).np)
        b = exact(rng.uniform(-2, 2, sb), db) if DType.parse(db).is_float else \
            rng.integers(0, 4, sb).astype(DType.parse(db).np)
    if op == "div":
        if DType.parse(db).is_float:
            b = exact(rng.uniform(0.5, 2.0, sb) * rng.choice([-1, 1], sb), db)
        else:
            b = (rng.integers(1, 5, sb) * rng.choice([-1, 1], sb)).astype(DType.parse(db).np)
    return [Arg("a", a, DType.parse(da)), Arg("b", b, DType.parse(db))]


@covers("binary")
@pytest.mark.parametrize("op", BINARY_OPS)
@pytest.mark.parametrize("dt", FLOATS + (I32, I64), ids=lambda d: d.value)
def test_binary(backend, rng, op, dt):
    run_parity(backend, "binary", _binary_args(rng, op, dt, dt), {"op": op},
               lambda a, b: ref_binary(op, a, b))


@pytest.mark.parametrize("op", BINARY_OPS)
@pytest.mark.parametrize("da,db", [(F16, F32), (BF16, F16), (I32, F32), (I32, I64), (BF16, F64),
                                   (U8, I32)], ids=lambda d: d.value)
def test_binary_mixed_dtypes(backend, rng, op, da, db):
    run_parity(backend, "binary", _binary_args(rng, op, da, db), {"op": op},
               lambda a, b: ref_binary(op, a, b))


@pytest.mark.parametrize("op", ["add", "mul", "div", "max"])
@pytest.mark.parametrize("sa,sb", [((2, 3, 4), (4,)), ((2, 3, 1), (1, 3, 4)), ((), (3, 4)),
                                   ((3, 1), (2, 1, 4)), ((), ())], ids=str)
def test_binary_broadcast(backend, rng, op, sa, sb):
    run_parity(backend, "binary", _binary_args(rng, op, F32, F32, sa, sb), {"op": op},
               lambda a, b: ref_binary(op, a, b))


# ----------------------------------------------------------------------------- compare / where
@covers("compare")
@pytest.mark.parametrize("op", COMPARE_OPS)
@pytest.mark.parametrize("dt", FLOATS + (I32, I64), ids=lambda d: d.value)
def test_compare(backend, rng, op, dt):
    a, b = rand(rng, (2, 3, 4), dt), rand(rng, (3, 4), dt)
    b[0] = a[0, 0]                                       # some exact ties
    run_parity(backend, "compare", [Arg("a", a, dt), Arg("b", b, dt)], {"op": op},
               lambda x, y: ref_compare(op, x, y))


@covers("where")
@pytest.mark.parametrize("dt", FLOATS + (I32, I64), ids=lambda d: d.value)
@pytest.mark.parametrize("shapes", [((2, 3, 4),) * 3, ((3, 1), (2, 3, 4), (4,))], ids=["same", "bcast"])
def test_where(backend, rng, dt, shapes):
    sc, sa, sb = shapes
    args = [Arg("c", rand(rng, sc, BOOL), BOOL), arg(rng, "a", sa, dt), arg(rng, "b", sb, dt)]
    run_parity(backend, "where", args, {}, lambda c, a, b: np.where(c, a, b))


# ----------------------------------------------------------------------------- activation
_DOMAIN = {"log": (0.1, 3.0), "sqrt": (0.1, 3.0), "rsqrt": (0.1, 3.0)}


@covers("activation")
@pytest.mark.parametrize("fn", ACTIVATIONS)
@fdtype
def test_activation(backend, rng, fn, dt):
    lo, hi = _DOMAIN.get(fn, (-3.0, 3.0))
    x = exact(rng.uniform(lo, hi, (2, 3, 8)), dt)
    if fn == "recip":
        x = exact(rng.uniform(0.5, 2.0, (2, 3, 8)) * rng.choice([-1, 1], (2, 3, 8)), dt)
    run_parity(backend, "activation", [Arg("x", x, dt)], {"fn": fn}, REF_ACT[fn])


@pytest.mark.parametrize("fn", INT_OK_ACTIVATIONS)
@pytest.mark.parametrize("dt", [I32, I64], ids=lambda d: d.value)
def test_activation_int(backend, rng, fn, dt):
    run_parity(backend, "activation", [arg(rng, "x", (3, 5), dt)], {"fn": fn}, REF_ACT[fn])


# ----------------------------------------------------------------------------- cast
_CASTS = [(F32, F16), (F32, BF16), (F16, F32), (BF16, F32), (F64, F32), (F32, F64), (F16, BF16),
          (F32, I32), (F64, I64), (I32, F32), (I64, I32), (I32, F16), (BOOL, F32), (F32, BOOL),
          (I32, BOOL), (BOOL, I32), (U8, I32)]


@covers("cast")
@pytest.mark.parametrize("src,dst", _CASTS, ids=lambda d: d.value)
def test_cast(backend, rng, src, dst):
    x = rand(rng, (3, 7), src) if not src.is_float else exact(rng.uniform(-40, 40, (3, 7)), src)
    if src.is_float:
        x[0, :3] = [0.0, -0.0, 0.5]

    def ref(v):
        if dst is BOOL:
            return v != 0
        if dst.is_int:
            return np.trunc(v).astype(dst.np)
        return exact(v, dst)

    run_parity(backend, "cast", [Arg("x", x, src)], {"dtype": dst.value}, ref)


# ----------------------------------------------------------------------------- reduce
@covers("reduce")
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
@pytest.mark.parametrize("axes,keepdims", [((-1,), False), ((0,), True), ((0, 2), False), ((-3, -1), True),
                                           ((0, 1, 2), False), ((0, 1, 2), True)], ids=str)
@fdtype
def test_reduce(backend, rng, op, axes, keepdims, dt):
    _check_reduce(backend, rng, op, axes, keepdims, dt, (2, 3, 5))


@covers("reduce")
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@pytest.mark.parametrize("axes", [(1,), (0, 1), (-1,), (0, 2)], ids=str)
@fdtype
def test_reduce_long(backend, rng, op, axes, dt):
    """Reductions long enough for a backend's other kernel shapes: a long middle axis with
    columns beside it, a long last axis, axes apart."""
    _check_reduce(backend, rng, op, axes, False, dt, (3, 70, 40))


def _check_reduce(backend, rng, op, axes, keepdims, dt, shape):
    lo, hi = (0.5, 1.5) if op == "prod" else (-2.0, 2.0)
    x = exact(rng.uniform(lo, hi, shape), dt)
    # a sum's rounding grows with the sum of |x|, not with a cancelling result
    terms = (lambda v: np.max(ref_reduce(op, np.abs(v), axes, keepdims))) if op in ("sum", "mean") else None
    run_parity(backend, "reduce", [Arg("x", x, dt)], {"op": op, "axes": axes, "keepdims": keepdims},
               lambda v: ref_reduce(op, v, axes, keepdims), magnitude=terms)


@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("axes", [(-1,), (0, 2)], ids=str)
@pytest.mark.parametrize("dt", [I32, I64], ids=lambda d: d.value)
def test_reduce_int(backend, rng, op, axes, dt):
    run_parity(backend, "reduce", [arg(rng, "x", (2, 3, 5), dt)], {"op": op, "axes": axes},
               lambda v: ref_reduce(op, v, axes))


# ----------------------------------------------------------------------------- softmax / norms
@covers("softmax")
@pytest.mark.parametrize("axis", [-1, 1, 0])
@fdtype
def test_softmax(backend, rng, axis, dt):
    x = exact(rng.uniform(-4, 4, (2, 3, 6)), dt)
    run_parity(backend, "softmax", [Arg("x", x, dt)], {"axis": axis}, lambda v: ref_softmax(v, axis))


# Row widths of the norms: 16 and 24 take a CPU backend's 8-lane float32 rows (whole pairs
# of vectors, and a lone tail vector), 13 its scalar rows.
NORM_WIDTHS = pytest.mark.parametrize("n", [16, 24, 13])


@covers("layer_norm")
@pytest.mark.parametrize("affine", ["none", "gamma", "gamma_beta"])
@NORM_WIDTHS
@fdtype
def test_layer_norm(backend, rng, affine, n, dt):
    args = [Arg("x", exact(rng.uniform(-2, 3, (2, 3, n)), dt), dt)]
    if affine != "none":
        args.append(arg(rng, "g", (n,), dt))
    if affine == "gamma_beta":
        args.append(arg(rng, "b", (n,), dt))
    run_parity(backend, "layer_norm", args, {"eps": 1e-5}, lambda x, *w: ref_layer_norm(x, *w, eps=1e-5))


@covers("rms_norm")
@pytest.mark.parametrize("weight,offset", [(False, 0.0), (True, 0.0), (True, 1.0)])
@NORM_WIDTHS
@fdtype
def test_rms_norm(backend, rng, weight, offset, n, dt):
    args = [arg(rng, "x", (2, 3, n), dt)] + ([arg(rng, "w", (n,), dt)] if weight else [])
    run_parity(backend, "rms_norm", args, {"eps": 1e-6, "offset": offset},
               lambda x, *w: ref_rms_norm(x, *w, eps=1e-6, offset=offset))


@covers("softmax_grad")
@pytest.mark.parametrize("axis", [-1, 0])
@fdtype
def test_softmax_grad(backend, rng, axis, dt):
    y = exact(ref_softmax(rng.uniform(-3, 3, (3, 4, 6)), axis), dt)
    run_parity(backend, "softmax_grad", [Arg("y", y, dt), arg(rng, "g", (3, 4, 6), dt)], {"axis": axis},
               lambda yv, gv: ref_softmax_grad(yv, gv, axis))


@covers("rms_norm_grad")
@pytest.mark.parametrize("offset", [0.0, 1.0])
@fdtype
def test_rms_norm_grad(backend, rng, offset, dt):
    args = [arg(rng, "x", (2, 3, 16), dt), arg(rng, "w", (16,), dt), arg(rng, "g", (2, 3, 16), dt)]
    run_parity(backend, "rms_norm_grad", args, {"eps": 1e-6, "offset": offset},
               lambda x, w, g: ref_rms_norm_grad(x, w, g, eps=1e-6, offset=offset))


@covers("layer_norm_grad")
@fdtype
def test_layer_norm_grad(backend, rng, dt):
    args = [Arg("x", exact(rng.uniform(-2, 3, (2, 3, 16)), dt), dt), arg(rng, "gamma", (16,), dt),
            arg(rng, "g", (2, 3, 16), dt)]
    run_parity(backend, "layer_norm_grad", args, {"eps": 1e-5},
               lambda x, gm, g: ref_layer_norm_grad(x, gm, g, eps=1e-5))


# ----------------------------------------------------------------------------- rope
def rope_tables(rng, dims, dtype=F32):
    ang = rng.uniform(0, 2 * math.pi, dims)
    return Arg("cos", exact(np.cos(ang), dtype), dtype), Arg("sin", exact(np.sin(ang), dtype), dtype)


ROPE_CASES = [  # (table rank, rotary dims R of head_dim 8)
    (2, 8), (3, 8), (2, 4), (3, 4)]


@covers("rope")
@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("rank,rot,d", [c + (8,) for c in ROPE_CASES] + [(2, 32, 32), (3, 16, 24)],
                         ids=lambda v: str(v))   # (the last two: a CPU backend's 8-lane rows, a tail)
@fdtype
def test_rope(backend, rng, style, rank, rot, d, dt):
    b, h, s = 2, 3, 4
    cos, sin = rope_tables(rng, ((s,) if rank == 2 else (b, s)) + (rot // 2,))
    run_parity(backend, "rope", [arg(rng, "x", (b, h, s, d), dt), cos, sin], {"style": style},
               lambda x, c, sn: ref_rope(x, c, sn, style))


# ----------------------------------------------------------------------------- attention
# (mask_kind, window, mask input: None | "bool" | "bias", softcap, Sq, Sk, pos)
ATTN_CASES = {
    "none": ("none", 0, None, 0.0, 4, 4, None),
    "causal": ("causal", 0, None, 0.0, 5, 5, None),
    "causal_sq_lt_sk": ("causal", 0, None, 0.0, 3, 6, None),
    "sliding": ("sliding_window", 2, None, 0.0, 6, 6, None),
    "sliding_sq_lt_sk": ("sliding_window", 3, None, 0.0, 2, 7, None),
    "custom_bool": ("custom", 0, "bool", 0.0, 4, 5, None),
    "bias": ("bias", 0, "bias", 0.0, 4, 5, None),
    "causal_and_bool": ("causal", 0, "bool", 0.0, 5, 5, None),
    "causal_and_bias": ("causal", 0, "bias", 0.0, 5, 5, None),
    "softcap": ("causal", 0, None, 3.0, 5, 5, None),
    "softcap_none": ("none", 0, None, 2.0, 3, 4, None),
    "decode_pos": ("causal", 0, None, 0.0, 1, 8, (3, 6)),
    "chunk_pos": ("causal", 0, None, 0.0, 3, 8, (0, 4)),
    "sliding_pos": ("sliding_window", 2, None, 0.0, 2, 8, (5, 2)),
    "bias_pos_softcap": ("causal", 0, "bias", 4.0, 2, 6, (1, 3)),
}


def attention_args(rng, case, dt, heads, kv_heads, d=8, bsz=2, extra=()):
    kind, window, mask, softcap, sq, sk, pos = ATTN_CASES[case]
    args = [arg(rng, "q", (bsz, heads, sq, d), dt), arg(rng, "k", (bsz, kv_heads, sk, d), dt),
            arg(rng, "v", (bsz, kv_heads, sk, d), dt)] + list(extra)
    if mask == "bool":
        m = rng.random((bsz, 1, sq, sk)) < 0.6
        m[..., np.arange(sq), np.arange(sq) % sk] = True   # no row fully masked
        args.append(Arg("mask", m, BOOL))
    elif mask == "bias":
        args.append(arg(rng, "mask", (1, heads, sq, sk), F32))
    if pos is not None:
        args.append(Arg("pos", np.array(pos, np.int32), I32))
    attrs_ = {"mask_kind": kind, "window": window, "scale": d ** -0.5, "softcap": softcap,
              "has_mask": mask is not None, "has_pos": pos is not None}
    return args, attrs_


def _attn_ref(attrs_, n_extra=0):
    def ref(q, k, v, *rest):
        rest = list(rest[n_extra:])
        mask = rest.pop(0) if attrs_["has_mask"] else None
        pos = rest.pop(0) if attrs_["has_pos"] else None
        return ref_attention(q, k, v, mask, pos, scale=attrs_["scale"], mask_kind=attrs_["mask_kind"],
                             window=attrs_["window"], softcap=attrs_["softcap"])
    return ref


@covers("attention")
@pytest.mark.parametrize("case", list(ATTN_CASES))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa2", "gqa4"])
@fdtype
def test_attention(backend, rng, case, heads, kv_heads, dt):
    args, attrs_ = attention_args(rng, case, dt, heads, kv_heads)
    run_parity(backend, "attention", args, attrs_, _attn_ref(attrs_))


@covers("attention_grad")
@pytest.mark.parametrize("case", list(ATTN_CASES))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)], ids=["mha", "gqa2"])
@fdtype
def test_attention_grad(backend, rng, case, heads, kv_heads, dt):
    """`out` is the attention of the same inputs (rounded to dt), as the VJP rule passes it."""
    args, attrs_ = attention_args(rng, case, dt, heads, kv_heads)
    host = [a.data.astype(np.float64) if a.dtype.is_float else a.data for a in args]
    out = _attn_ref(attrs_)(*host)
    args[3:3] = [Arg("out", exact(out, dt), dt), arg(rng, "g", out.shape, dt)]

    def ref(q, k, v, o, g, *rest):
        rest = list(rest)
        mask = rest.pop(0) if attrs_["has_mask"] else None
        pos = rest.pop(0) if attrs_["has_pos"] else None
        return ref_attention_grad(q, k, v, g, mask, pos, **{n: attrs_[n] for n in (
            "scale", "mask_kind", "window", "softcap")})
    run_parity(backend, "attention_grad", args, attrs_, ref)


def test_attention_sliding_window_actually_masks(rng):
    """Guard the case table: the window is smaller than the sequence, so it differs from causal."""
    keep_c = ref_keep("causal", 1, 6, 6)
    keep_w = ref_keep("sliding_window", 1, 6, 6, window=2)
    assert keep_w.sum() < keep_c.sum()


@covers("mask_fill")
@pytest.mark.parametrize("case", ["causal", "causal_sq_lt_sk", "sliding", "custom_bool", "bias",
                                  "causal_and_bool", "decode_pos", "sliding_pos"])
@fdtype
def test_mask_fill(backend, rng, case, dt):
    args, a = attention_args(rng, case, dt, 2, 2)
    kind, window, mask, softcap, sq, sk, pos = ATTN_CASES[case]
    scores = arg(rng, "scores", (2, 2, sq, sk), dt)
    attrs_ = {k: a[k] for k in ("mask_kind", "window", "has_mask", "has_pos")}

    def ref(s, *rest):
        rest = list(rest)
        m = rest.pop(0) if a["has_mask"] else None
        p = rest.pop(0) if a["has_pos"] else None
        return ref_mask_fill(s, m, p, mask_kind=kind, window=window)

    run_parity(backend, "mask_fill", [scores] + args[3:], attrs_, ref)


# ----------------------------------------------------------------------------- indexing & layout
@covers("gather")
@pytest.mark.parametrize("dt", FLOATS + (I32,), ids=lambda d: d.value)
@pytest.mark.parametrize("idt", [I32, I64], ids=lambda d: d.value)
@pytest.mark.parametrize("axis", [0, 1])
def test_gather(backend, rng, dt, idt, axis):
    table = arg(rng, "table", (10, 4) if axis == 0 else (3, 10, 4), dt)
    idx = Arg("idx", rng.integers(0, 10, (2, 3)).astype(idt.np), idt)
    run_parity(backend, "gather", [table, idx], {"axis": axis}, lambda t, i: np.take(t, i, axis=axis))


LAYOUT_DTYPES = pytest.mark.parametrize("dt", FLOATS + (I32, I64, BOOL), ids=lambda d: d.value)


@covers("reshape")
@LAYOUT_DTYPES
@pytest.mark.parametrize("shape", [(6, 4), (-1,), (2, 12), (4, -1, 3)], ids=str)
def test_reshape(backend, rng, dt, shape):
    run_parity(backend, "reshape", [arg(rng, "x", (2, 3, 4), dt)], {"shape": shape},
               lambda x: x.reshape(shape))


@covers("transpose")
@LAYOUT_DTYPES
@pytest.mark.parametrize("perm", [(2, 0, 1), (1, 0, 2), (0, 1, 2)], ids=str)
def test_transpose(backend, rng, dt, perm):
    run_parity(backend, "transpose", [arg(rng, "x", (2, 3, 4), dt)], {"perm": perm},
               lambda x: np.transpose(x, perm))


@covers("narrow")
@LAYOUT_DTYPES
@pytest.mark.parametrize("axis,start,length", [(0, 1, 1), (1, 1, 2), (-1, 0, 3), (2, 3, 1), (1, -2, 2),
                                               (-1, -3, 1)])
def test_narrow(backend, rng, dt, axis, start, length):
    def ref(x):
        idx = [slice(None)] * 3
        s0 = start % x.shape[axis]                      # a negative start counts from the end
        idx[axis] = slice(s0, s0 + length)
        return x[tuple(idx)]
    run_parity(backend, "narrow", [arg(rng, "x", (2, 3, 4), dt)],
               {"axis": axis, "start": start, "length": length}, ref)


@covers("concat")
@LAYOUT_DTYPES
@pytest.mark.parametrize("axis,n", [(0, 2), (1, 3), (-1, 2), (2, 1)])
def test_concat(backend, rng, dt, axis, n):
    shapes = []
    for i in range(n):
        s = [2, 3, 4]
        s[axis] = i + 1
        shapes.append(tuple(s))
    args = [arg(rng, f"x{i}", s, dt) for i, s in enumerate(shapes)]
    run_parity(backend, "concat", args, {"axis": axis}, lambda *xs: np.concatenate(xs, axis=axis))


@covers("expand")
@LAYOUT_DTYPES
@pytest.mark.parametrize("src,dst", [((3, 1), (2, 3, 4)), ((1, 4), (3, 4)), ((4,), (2, 3, 4))], ids=str)
def test_expand(backend, rng, dt, src, dst):
    run_parity(backend, "expand", [arg(rng, "x", src, dt)], {"shape": dst},
               lambda x: np.broadcast_to(x, dst))


@covers("cumsum")
@pytest.mark.parametrize("dt", FLOATS + (I32, I64), ids=lambda d: d.value)
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_cumsum(backend, rng, dt, axis):
    run_parity(backend, "cumsum", [arg(rng, "x", (2, 3, 5), dt)], {"axis": axis},
               lambda x: ref_cumsum(x, axis))


def _distinct(rng, dims, dt):
    """Distinct values, exact in every dtype (a shuffled ramp of quarter steps)."""
    n = int(np.prod(dims))
    v = (rng.permutation(n) - n // 2) / (4.0 if dt.is_float else 1.0)
    return v.reshape(dims).astype(dt.np)


@covers("topk")
@pytest.mark.parametrize("dt", FLOATS + (I32, I64), ids=lambda d: d.value)
@pytest.mark.parametrize("k,axis", [(1, -1), (3, -1), (2, 0), (6, 1)])
def test_topk(backend, rng, dt, k, axis):
    x = Arg("x", _distinct(rng, (3, 6, 5), dt), dt)
    run_parity(backend, "topk", [x], {"k": k, "axis": axis}, lambda v: ref_topk(v, k, axis))


@covers("argmax")
@pytest.mark.parametrize("dt", FLOATS + (I32, I64), ids=lambda d: d.value)
@pytest.mark.parametrize("axis,keepdims", [(-1, False), (0, True), (1, False)])
def test_argmax(backend, rng, dt, axis, keepdims):
    x = rng.integers(-3, 4, (3, 6, 5)).astype(dt.np)      # many ties: the first one wins
    run_parity(backend, "argmax", [Arg("x", x, dt)], {"axis": axis, "keepdims": keepdims},
               lambda v: np.argmax(v, axis=axis, keepdims=keepdims))


@covers("kv_write")
@fdtype
@pytest.mark.parametrize("pos", [(0, 0), (5, 5), (1, 4)], ids=["start", "uniform", "per_batch"])
@pytest.mark.parametrize("pdt", [I32, I64], ids=lambda d: d.value)
def test_kv_write(backend, rng, dt, pos, pdt):
    cache = Arg("cache", rand(rng, (2, 2, 8, 4), dt), dt, kind="state")
    new = arg(rng, "new", (2, 2, 3, 4), dt)
    p = Arg("pos", np.array(pos, pdt.np), pdt)
    run_parity(backend, "kv_write", [cache, new, p], {"axis": 2}, ref_kv_write)


@covers("assign")
@fdtype
def test_assign(backend, rng, dt):
    state = Arg("state", rand(rng, (3, 5, 4), dt), dt, kind="state")
    run_parity(backend, "assign", [state, arg(rng, "value", (3, 5, 4), dt)], {}, lambda s, v: v)


# ----------------------------------------------------------------------------- HIR blocks
DIRECT_AND_FUSABLE = pytest.mark.parametrize("profile", [
    PARITY_PROFILE, PARITY_PROFILE.evolve(fusion={"policy": "fusable"}),
    PARITY_PROFILE.evolve(fusion={"policy": "fusable", "skip": ()}),
], ids=["direct", "fusable_unfused", "fusable_fused"])


@covers("linear")
@fdtype
@pytest.mark.parametrize("transpose_w", [True, False])
@pytest.mark.parametrize("bias", [False, True])
@DIRECT_AND_FUSABLE
def test_linear(backend, rng, dt, transpose_w, bias, profile):
    args = [arg(rng, "x", (2, 3, 8), dt), arg(rng, "w", (6, 8) if transpose_w else (8, 6), dt)]
    if bias:
        args.append(arg(rng, "b", (6,), dt))

    def ref(x, w, b=None):
        y = x @ (w.T if transpose_w else w)
        return y if b is None else y + b

    run_parity(backend, "linear", args, {"transpose_w": transpose_w}, ref, level=HIR, profile=profile)


@covers("swiglu_mlp")
@fdtype
@DIRECT_AND_FUSABLE
def test_swiglu_mlp(backend, rng, dt, profile):
    args = [arg(rng, "x", (2, 3, 8), dt), arg(rng, "wg", (12, 8), dt), arg(rng, "wu", (12, 8), dt),
            arg(rng, "wd", (8, 12), dt)]

    def ref(x, wg, wu, wd):
        g, u = x @ wg.T, x @ wu.T
        if dt in (F16, BF16):          # the hidden activation is a tensor of dt: round it
            g, u = exact(g, dt), exact(u, dt)
            return exact(ref_swiglu(g, u), dt) @ wd.T
        return ref_swiglu(g, u) @ wd.T

    run_parity(backend, "swiglu_mlp", args, {"transpose_w": True}, ref, level=HIR, profile=profile,
               tol={F32: 1e-5, F64: 1e-10, F16: 1e-2, BF16: 3e-2}[dt])


# ----------------------------------------------------------------------------- fused ops
@covers("fused_swiglu")
@fdtype
def test_fused_swiglu(backend, rng, dt):
    run_parity(backend, "fused_swiglu", [arg(rng, "g", (2, 3, 8), dt), arg(rng, "u", (2, 3, 8), dt)],
               {}, ref_swiglu)


_MBA_ACTS = ("identity", "gelu", "gelu_tanh", "relu", "silu", "tanh", "sigmoid", "quick_gelu")


@covers("fused_matmul_bias_act")
@fdtype
@pytest.mark.parametrize("act", _MBA_ACTS)
@pytest.mark.parametrize("bias,trans_b", [(True, False), (True, True), (False, True)])
def test_fused_matmul_bias_act(backend, rng, dt, act, bias, trans_b):
    args = [arg(rng, "x", (2, 3, 8), dt), arg(rng, "w", (6, 8) if trans_b else (8, 6), dt)]
    if bias:
        args.append(arg(rng, "b", (6,), dt))

    def ref(x, w, b=None):
        y = ref_matmul(x, w, False, trans_b)
        return REF_ACT[act](y if b is None else y + b)

    run_parity(backend, "fused_matmul_bias_act", args, {"trans_b": trans_b, "act": act}, ref)


def _epilogue_ranges(act: str) -> tuple:
    """(low end of x and w, bias range) for a matmul with activation `act`: positive sums for
    log, sqrt, rsqrt and recip, and for log sums past 1.5, away from log(1) = 0, where the
    low-precision product's rounding would be all of the result."""
    if act == "log":
        return 0.3, (1.0, 1.5)
    lo = 0.05 if act in (*_DOMAIN, "recip") else -0.5
    return lo, (lo, 0.5)


@fdtype
@pytest.mark.parametrize("act", [a for a in ACTIVATIONS if a not in _MBA_ACTS])
def test_fused_matmul_bias_act_any_activation(backend, rng, dt, act):
    """Fusion puts every activation of the expression table into the matmul epilogue, so each
    backend's epilogue must take all of them. Small data: sums far from exp's f16 overflow, and
    positive for log, sqrt, rsqrt and recip."""
    lo, bias = _epilogue_ranges(act)
    args = [arg(rng, "x", (2, 3, 8), dt, lo=lo, hi=0.5), arg(rng, "w", (8, 6), dt, lo=lo, hi=0.5),
            arg(rng, "b", (6,), dt, lo=bias[0], hi=bias[1])]
    run_parity(backend, "fused_matmul_bias_act", args, {"trans_b": False, "act": act},
               lambda x, w, b: REF_ACT[act](ref_matmul(x, w, False, False) + b))


@covers("fused_residual_rms_norm")
@fdtype
@pytest.mark.parametrize("weight,offset", [(False, 0.0), (True, 0.0), (True, 1.0)])
@NORM_WIDTHS
def test_fused_residual_rms_norm(backend, rng, dt, weight, offset, n):
    args = [arg(rng, "x", (2, 3, n), dt), arg(rng, "r", (2, 3, n), dt)]
    args += [arg(rng, "w", (n,), dt)] if weight else []

    def ref(x, r, *w):
        h = x + r
        return h, ref_rms_norm(exact(h, dt), *w, eps=1e-6, offset=offset)

    run_parity(backend, "fused_residual_rms_norm", args, {"eps": 1e-6, "offset": offset}, ref)


@covers("fused_residual_ln")
@fdtype
@pytest.mark.parametrize("affine", ["none", "gamma", "gamma_beta"])
@NORM_WIDTHS
def test_fused_residual_ln(backend, rng, dt, affine, n):
    args = [arg(rng, "x", (2, 3, n), dt), arg(rng, "r", (2, 3, n), dt)]
    if affine != "none":
        args.append(arg(rng, "g", (n,), dt))
    if affine == "gamma_beta":
        args.append(arg(rng, "b", (n,), dt))

    def ref(x, r, *w):
        h = x + r
        return h, ref_layer_norm(exact(h, dt), *w, eps=1e-5)

    run_parity(backend, "fused_residual_ln", args, {"eps": 1e-5}, ref)


@covers("fused_attention_block")
@pytest.mark.parametrize("case", [c for c, v in ATTN_CASES.items() if v[4] == v[5]])  # one table: Sq == Sk
@pytest.mark.parametrize("heads,kv_heads,style", [(4, 4, "half"), (4, 2, "interleaved"), (4, 1, "half"),
                                                  (4, 1, "interleaved")], ids=str)
@fdtype
def test_fused_attention_block(backend, rng, case, heads, kv_heads, style, dt):
    kind, window, mask, softcap, sq, sk, pos = ATTN_CASES[case]
    cos, sin = rope_tables(rng, (2, sq, 4) if case == "sliding" else (sq, 4))   # 2*4 = head_dim 8
    args, attrs_ = attention_args(rng, case, dt, heads, kv_heads, extra=(cos, sin))
    attrs_["style"] = style
    inner = _attn_ref({k: v for k, v in attrs_.items() if k != "style"}, n_extra=2)

    def ref(q, k, v, c, s, *rest):
        qr, kr = ref_rope(q, c, s, style), ref_rope(k, c, s, style)
        return inner(qr, kr, v, c, s, *rest)

    # in f16 / bf16 a composite rounds the roped q and k to the dtype before the scores: one
    # rounding more than fused_attention's cases, twice their tolerance (1 in ~12 seeds needed 1.2x)
    tol = 2 * TOL[dt] if dt in (F16, BF16) else None
    run_parity(backend, "fused_attention_block", args, attrs_, ref, tol=tol)


_PROGRAMS = {
    # x*y + silu(x)
    "mul_add_silu": ((("binary", (("op", "mul"),), (0, 1)),
                      ("activation", (("fn", "silu"),), (0,)),
                      ("binary", (("op", "add"),), (2, 3))), 2),
    # where(x > y, tanh(x), y) * z
    "cmp_where": ((("compare", (("op", "gt"),), (0, 1)),
                   ("activation", (("fn", "tanh"),), (0,)),
                   ("where", (), (3, 4, 1)),
                   ("binary", (("op", "mul"),), (5, 2))), 3),
    # swiglu(x, y) - exp(z)
    "swiglu_exp": ((("fused_swiglu", (), (0, 1)),
                    ("activation", (("fn", "exp"),), (2,)),
                    ("binary", (("op", "sub"),), (3, 4))), 3),
}


@covers("fused_elementwise")
@pytest.mark.parametrize("prog", list(_PROGRAMS))
@fdtype
def test_fused_elementwise(backend, rng, prog, dt):
    program, n = _PROGRAMS[prog]
    args = [arg(rng, f"x{i}", (2, 3, 4) if i != 1 else (3, 4), dt) for i in range(n)]
    lowp = dt in (F16, BF16)

    def ref(*xs):
        # every intermediate step of the region is a value of dt: round like a chain of ops would
        slots = list(xs)
        for step in program:
            r = ref_elementwise((step,), *slots)
            slots.append(exact(r, dt) if lowp and r.dtype != np.bool_ else r)
        return slots[-1]

    run_parity(backend, "fused_elementwise", args, {"program": program, "dtype": dt.value}, ref,
               tol=2 * TOL[dt])


# ----------------------------------------------------------------------------- packed sequences
# (starts, lens, tokens): gaps between segments and empty ones (tokens 7, 8 and 19 in none),
# segments out of order covering every token, and many lengths (the NumPy kernel batches
# segments of similar length, padded: groups with masked keys).
SEGMENTS = {
    "gaps_empty": ([0, 9, 9, 12, 20], [7, 0, 3, 7, 0], 20),
    "unsorted_cover": ([10, 0, 4], [3, 4, 6], 13),
    "grouped": (list(np.cumsum([0, 40, 2, 2, 2, 2, 2, 39, 17])), [40, 2, 2, 2, 2, 2, 39, 17, 1], 107),
}
VARLEN_OPS = {"varlen_attention", "segment_pool"}


def segment_args(case, sdt=I64) -> list:
    starts, lens, _ = SEGMENTS[case]
    return [Arg("starts", np.array(starts, sdt.np), sdt), Arg("lens", np.array(lens, sdt.np), sdt)]


def varlen_args(rng, case, dt, heads, kv_heads, d=8, dv=6, sdt=I64) -> list:
    t = SEGMENTS[case][2]
    return [arg(rng, "q", (t, heads, d), dt), arg(rng, "k", (t, kv_heads, d), dt),
            arg(rng, "v", (t, kv_heads, dv), dt)] + segment_args(case, sdt)


@covers("varlen_attention")
@pytest.mark.parametrize("case", list(SEGMENTS))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)], ids=["mha", "gqa2"])
@pytest.mark.parametrize("dv", [6, 40])          # (40: a multiple of 8, numba's vector kernel)
@fdtype
def test_varlen_attention(backend, rng, case, heads, kv_heads, dv, dt):
    sdt = I32 if heads == kv_heads else I64
    args = varlen_args(rng, case, dt, heads, kv_heads, dv=dv, sdt=sdt)
    run_parity(backend, "varlen_attention", args, {"scale": 0.3},
               lambda q, k, v, st, ln: ref_varlen_attention(q, k, v, st, ln, scale=0.3))


@covers("segment_pool")
@pytest.mark.parametrize("mode", POOL_MODES)
@pytest.mark.parametrize("case", list(SEGMENTS))
@fdtype
def test_segment_pool(backend, rng, mode, case, dt):
    x = arg(rng, "x", (SEGMENTS[case][2], 5), dt)
    run_parity(backend, "segment_pool", [x] + segment_args(case), {"mode": mode},
               lambda x, st, ln: ref_segment_pool(x, st, ln, mode=mode))


# ----------------------------------------------------------------------------- custom op
@covers("custom")
def test_custom_op(backend, rng, custom_plugin):
    from rlx_core.pipeline import select_backend

    if not select_backend(backend).supports_custom("parity_scaled_add"):
        pytest.skip(f"the test's custom op has no {backend!r} kernel")
    x, y = arg(rng, "x", (2, 5), F32), arg(rng, "y", (2, 5), F32)
    run_parity(backend, "custom", [x, y], {"name": "parity_scaled_add", "params": (("alpha", 0.5),)},
               lambda a, b: a + 0.5 * b)


@pytest.fixture
def custom_plugin():
    from rlx_core.plugins import hookimpl, register_plugin, unregister_plugin

    class Plugin:
        @hookimpl
        def rlx_register_ops(self, register):
            register(_SCALED_ADD)

    register_plugin(Plugin(), name="parity-custom-op")
    try:
        yield
    finally:
        unregister_plugin("parity-custom-op")


def _scaled_add_meta(shapes, params):
    from rlx_core.ir.shape import Shape, broadcast_dims

    a, b = shapes
    return (Shape(broadcast_dims(a.dims, b.dims), a.dtype),)


def _make_scaled_add():
    from rlx_core.ir.custom import CustomOp

    return CustomOp("parity_scaled_add", _scaled_add_meta,
                    {"numpy": lambda a, b, alpha: a + np.float32(alpha) * b}, "a + alpha * b")


_SCALED_ADD = _make_scaled_add()


# ----------------------------------------------------------------------------- decompositions
# `fusable` lowering turns norms, softmax, rope and attention into primitive chains; with
# fusion skipped those chains run as they are and must match the same references.
DECOMPOSED = PARITY_PROFILE.evolve(fusion={"policy": "fusable"})


def _assert_decomposed(op, args, attrs_):
    g = one_op(op, args, attrs_, level=HIR)
    ops = {n.op for n in compile_on(g, "numpy", DECOMPOSED).mir.nodes}
    assert op not in ops, f"{op} was not decomposed by fusable lowering: {sorted(ops)}"


@pytest.mark.parametrize("case", list(ATTN_CASES))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa2", "gqa4"])
@pytest.mark.parametrize("dt", [F32, F16], ids=lambda d: d.value)
def test_attention_decomposed(backend, rng, case, heads, kv_heads, dt):
    args, attrs_ = attention_args(rng, case, dt, heads, kv_heads)
    run_parity(backend, "attention", args, attrs_, _attn_ref(attrs_), level=HIR, profile=DECOMPOSED)
    _assert_decomposed("attention", args, attrs_)


@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("rank,rot", ROPE_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("dt", [F32, BF16], ids=lambda d: d.value)
def test_rope_decomposed(backend, rng, style, rank, rot, dt):
    b, h, s, d = 2, 3, 4, 8
    cos, sin = rope_tables(rng, ((s,) if rank == 2 else (b, s)) + (rot // 2,), dt)
    args = [arg(rng, "x", (b, h, s, d), dt), cos, sin]
    run_parity(backend, "rope", args, {"style": style}, lambda x, c, sn: ref_rope(x, c, sn, style),
               level=HIR, profile=DECOMPOSED, tol=2e-2 if dt is BF16 else None)
    _assert_decomposed("rope", args, {"style": style})


@pytest.mark.parametrize("dt", [F32, F16], ids=lambda d: d.value)
def test_norms_and_softmax_decomposed(backend, rng, dt):
    x, w, b = arg(rng, "x", (2, 3, 16), dt), arg(rng, "w", (16,), dt), arg(rng, "b", (16,), dt)
    cases = [("rms_norm", [x, w], {"eps": 1e-6, "offset": 1.0},
              lambda x, w: ref_rms_norm(x, w, eps=1e-6, offset=1.0)),
             ("layer_norm", [x, w, b], {"eps": 1e-5}, lambda x, g, b: ref_layer_norm(x, g, b, 1e-5)),
             ("softmax", [x], {"axis": -1}, lambda x: ref_softmax(x, -1))]
    for op, args, attrs_, ref in cases:
        run_parity(backend, op, args, attrs_, ref, level=HIR, profile=DECOMPOSED,
                   tol=1e-2 if dt is F16 else None)
        _assert_decomposed(op, args, attrs_)


@covers("softmax")
@pytest.mark.parametrize("profile", [None, DECOMPOSED], ids=["op", "decomposed"])
@fdtype
def test_softmax_masked_rows(backend, rng, profile, dt):
    """-inf entries take no weight and a row of -inf (a padding query that may attend to no
    key) gives zeros, fused or composed: a NaN there would reach real tokens in the next layer."""
    x = exact(rng.uniform(-4, 4, (2, 3, 6)), dt)
    x[rng.random(x.shape) < 0.3] = -np.inf
    x[0, 1] = -np.inf
    run_parity(backend, "softmax", [Arg("x", x, dt)], {"axis": -1}, lambda v: ref_softmax(v, -1),
               level=HIR, profile=profile)


# ----------------------------------------------------------------------------- packed weights
def _packed_arg(rng, scheme, n, name="w"):
    """Packed bytes of fresh random [n, K] weights, K two blocks long."""
    from rlx_core.ir.quant import QuantScheme

    q = QuantScheme.parse(scheme)
    k = 2 * q.block_size
    return Arg(name, q.quantize(rng.standard_normal((n, k)).astype(np.float32)), U8), k


@covers("dequant_matmul")
@fdtype
@pytest.mark.parametrize("scheme", SCHEMES)
def test_dequant_matmul(backend, rng, dt, scheme):
    from rlx_core.ir.quant import matmul_reference

    i = SCHEMES.index(scheme)
    w, k = _packed_arg(rng, scheme, 6)
    args = [arg(rng, "x", (2, 3, k), dt), w] + ([arg(rng, "b", (6,), dt)] if i % 2 else [])
    act = ("identity", "gelu", "silu")[i % 3]

    def ref(x, raw, b=None):
        y = matmul_reference(x, raw.astype(np.uint8), scheme, (6, k))
        return REF_ACT[act](y if b is None else y + b)

    run_parity(backend, "dequant_matmul", args, {"scheme": scheme, "act": act}, ref)


@fdtype
@pytest.mark.parametrize("act", [a for a in ACTIVATIONS if a not in ("identity", "gelu", "silu")])
def test_dequant_matmul_any_activation(backend, rng, dt, act):
    """Every table activation fuses into dequant_matmul's epilogue too (fusion._ACTS). Small
    centered data (positive for log, sqrt, rsqrt and recip), q8_0 weights."""
    from rlx_core.ir.quant import QuantScheme, matmul_reference

    q = QuantScheme.parse("q8_0")
    k, (lo, bias) = 2 * q.block_size, _epilogue_ranges(act)
    w = Arg("w", q.quantize(rng.uniform(lo, 0.5, (6, k)).astype(np.float32)), U8)
    args = [arg(rng, "x", (2, 3, k), dt, lo=lo, hi=0.5), w, arg(rng, "b", (6,), dt, lo=bias[0], hi=bias[1])]
    run_parity(backend, "dequant_matmul", args, {"scheme": "q8_0", "act": act},
               lambda x, raw, b: REF_ACT[act](matmul_reference(x, raw.astype(np.uint8), "q8_0", (6, k)) + b))


@covers("dequantize")
@pytest.mark.parametrize("dt", [F32, F16, F64], ids=lambda d: d.value)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_dequantize(backend, rng, dt, scheme):
    from rlx_core.ir.quant import QuantScheme

    w, k = _packed_arg(rng, scheme, 5)
    w = Arg("w", w.data.reshape(5, 1, -1), U8)
    run_parity(backend, "dequantize", [w], {"scheme": scheme, "dtype": dt.value},
               lambda raw: QuantScheme.parse(scheme).dequantize_reference(raw.astype(np.uint8), (5, 1, k)))


@covers("quantize", "fake_quantize")
@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_and_fake_quantize(backend, rng, scheme):
    """quantize: the same bytes as the reference quantizer; fake_quantize: its values."""
    from rlx_core.ir.quant import QuantScheme

    q = QuantScheme.parse(scheme)
    x = arg(rng, "x", (3, 2 * q.block_size), F32)
    run_parity(backend, "quantize", [x], {"scheme": scheme},
               lambda v: q.quantize(v.astype(np.float32)))
    run_parity(backend, "fake_quantize", [x], {"scheme": scheme},
               lambda v: q.dequantize_reference(q.quantize(v.astype(np.float32)), v.shape))


@covers("all_reduce", "all_gather", "reduce_scatter")
@fdtype
@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter"])
def test_collectives_group_of_one(backend, rng, dt, op):
    """A group of one rank: each collective gives x back (the sharded runs, several ranks
    against the unsharded model, are tests/test_tensor_parallel.py)."""
    attrs_ = {"world": 1, "rank": 0, **({} if op == "all_reduce" else {"axis": 1})}
    run_parity(backend, op, [arg(rng, "x", (2, 3, 4), dt)], attrs_, lambda x: x)


# ----------------------------------------------------------------------------- dot_general
# (lhs dims, rhs dims, lhs_contract, rhs_contract, lhs_batch, rhs_batch)
DOT_GENERAL_CASES = {
    "matmul": ((3, 5), (5, 4), (1,), (0,), (), ()),
    "batched": ((2, 3, 5), (2, 5, 4), (2,), (1,), (0,), (0,)),
    "two_contract": ((2, 3, 4, 5), (5, 2, 4, 6), (3, 2), (0, 2), (0,), (1,)),
    "batch_last": ((5, 3, 2), (4, 2, 5), (0,), (2,), (2,), (1,)),
    "outer": ((3,), (4, 2), (), (), (), ()),
    "dot": ((6,), (6,), (0,), (0,), (), ()),
    "two_batch_no_free": ((2, 3, 4), (3, 2, 4), (2,), (2,), (0, 1), (1, 0)),
}


def ref_dot_general(x, y, lc, rc, lb, rb):
    """einsum over letters: the float64 reference, independent of the kernel's matmul form."""
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    ls = [next(letters) for _ in range(x.ndim)]
    rs = [next(letters) for _ in range(y.ndim)]
    for i, j in zip(lc + lb, rc + rb):
        rs[j] = ls[i]
    out = [ls[i] for i in lb] + [ls[i] for i in range(x.ndim) if i not in lc + lb] + \
          [rs[j] for j in range(y.ndim) if j not in rc + rb]
    return np.einsum(f"{''.join(ls)},{''.join(rs)}->{''.join(out)}", x, y)


@covers("dot_general")
@fdtype
@pytest.mark.parametrize("case", list(DOT_GENERAL_CASES))
def test_dot_general(backend, rng, dt, case):
    ld, rd, lc, rc, lb, rb = DOT_GENERAL_CASES[case]
    attrs_ = {"lhs_contract": lc, "rhs_contract": rc, "lhs_batch": lb, "rhs_batch": rb}
    run_parity(backend, "dot_general", [arg(rng, "a", ld, dt), arg(rng, "b", rd, dt)], attrs_,
               lambda x, y: ref_dot_general(x, y, lc, rc, lb, rb),
               magnitude=lambda x, y: np.max(ref_dot_general(np.abs(x), np.abs(y), lc, rc, lb, rb)))


# ----------------------------------------------------------------------------- control flow
def _body(name, dims_dtypes, fn):
    """A body graph (ir/control.py) at MIR level: inputs of (dims, dtype), fn builds outputs."""
    return Builder(name, MIR).body(name, [Shape(d, t) for d, t in dims_dtypes], fn)


@covers("if_")
@fdtype
@pytest.mark.parametrize("taken", [True, False])
def test_if(backend, rng, dt, taken):
    sig = [((2, 3), dt), ((3,), dt)]
    then_ = _body("then", sig, lambda b, x, y: (x * y, b.tanh(y)))
    else_ = _body("else", sig, lambda b, x, y: (x - y, y * y))
    args = [Arg("p", np.array(taken), BOOL), arg(rng, "x", (2, 3), dt), arg(rng, "y", (3,), dt)]
    run_parity(backend, "if_", args, {"then_": then_, "else_": else_},
               lambda p, x, y: (x * y, np.tanh(y)) if p else (x - y, y * y))


@covers("while_")
@fdtype
def test_while(backend, rng, dt):
    """Double x until its sum passes the limit (a const): a data-dependent trip count."""
    sig = [((), dt), ((4,), dt)]
    cond = _body("cond", sig, lambda b, lim, x: b.compare(b.sum(x, (0,)), lim, "lt"))
    body = _body("body", sig, lambda b, lim, x: x * 2.0)
    x = exact(rng.uniform(0.1, 1.0, (4,)), dt)
    # the limit halfway (in log) between two doublings of the sum: a sum rounded to a 16-bit
    # type cannot land on the other side of it (a drawn limit once fell within bf16's
    # rounding of a sum, and the trip count differed from the float64 reference's)
    lim = exact(np.float64(x.sum()) * 2.0 ** (int(rng.integers(1, 6)) - 0.5), dt)

    def ref(lim, x):
        while x.sum() < lim:
            x = x * 2
        return x
    run_parity(backend, "while_", [Arg("lim", lim, dt), Arg("x", x, dt)],
               {"cond": cond, "body": body, "n_consts": 1}, ref)


@covers("scan")
@fdtype
@pytest.mark.parametrize("reverse", [False, True])
def test_scan(backend, rng, dt, reverse):
    """An exponential moving average over the rows of xs with a const decay; ys the states."""
    sig = [((), dt), ((3,), dt), ((3,), dt)]
    body = _body("ema", sig, lambda b, k, h, x: (lambda h2: (h2, h2 * h2))(h * k + x))

    def ref(k, h, xs):
        ys = np.zeros_like(xs)
        for t in (range(len(xs) - 1, -1, -1) if reverse else range(len(xs))):
            h = h * k + xs[t]
            ys[t] = h * h
        return h, ys
    args = [Arg("k", exact(rng.uniform(0.2, 0.9, ()), dt), dt), arg(rng, "h", (3,), dt),
            arg(rng, "xs", (5, 3), dt)]
    run_parity(backend, "scan", args, {"body": body, "n_consts": 1, "n_carry": 1, "reverse": reverse},
               ref, tol=3e-2 if dt is BF16 else None)


# ----------------------------------------------------------------------------- dense_solve
@covers("dense_solve")
@fdtype
@pytest.mark.parametrize("a_dims,b_dims", [((4, 4), (4,)), ((2, 4, 4), (2, 4, 3)), ((2, 3, 4, 4), (2, 3, 4))],
                         ids=["vector", "matrix", "batch2_vector"])
def test_dense_solve(backend, rng, dt, a_dims, b_dims):
    """Diagonally dominant a (well conditioned); the reference is inv(a) @ b in float64."""
    a = exact(rand(rng, a_dims) + 6.0 * np.eye(a_dims[-1]), dt)

    def ref(x, y):
        inv = np.linalg.inv(x)
        return np.einsum("...ij,...j->...i", inv, y) if y.ndim < x.ndim else inv @ y
    run_parity(backend, "dense_solve", [Arg("a", a, dt), arg(rng, "b", b_dims, dt)], {}, ref)


# ----------------------------------------------------------------------------- fft
FFT_NORMS = ("backward", "ortho", "forward")


def complex_arg(rng, name, dims) -> Arg:
    data = (rng.uniform(-2, 2, dims) + 1j * rng.uniform(-2, 2, dims)).astype(np.complex64)
    return Arg(name, data, DType.C64)


def check_fft(k, got, want, dt, what):
    """c64 (or f32) output within 1e-5 of the largest |reference| (numpy.fft in float64)."""
    assert got.dtype == dt.np, f"{what}: output dtype {got.dtype}, expected {dt.np}"
    assert got.shape == want.shape, f"{what}: output shape {got.shape}, expected {want.shape}"
    scale = max(float(np.max(np.abs(want))), 1e-30) if want.size else 1.0
    np.testing.assert_allclose(got.astype(np.complex128), want, rtol=1e-5, atol=1e-5 * scale, err_msg=what)


@covers("fft", "ifft")
@pytest.mark.parametrize("op", ["fft", "ifft"])
@pytest.mark.parametrize("norm", FFT_NORMS)
@pytest.mark.parametrize("n,axis", [(8, -1), (7, -1), (5, 0)])
def test_fft(backend, rng, op, norm, n, axis):
    dims = (n, 3) if axis == 0 else (2, n)
    fn = getattr(np.fft, op)
    run_parity(backend, op, [complex_arg(rng, "x", dims)], {"axis": axis, "norm": norm},
               lambda x: fn(x.astype(np.complex128), axis=axis, norm=norm), check=check_fft)


@covers("rfft")
@fdtype
@pytest.mark.parametrize("norm", FFT_NORMS)
@pytest.mark.parametrize("n,axis", [(8, -1), (9, -1), (6, 1)])
def test_rfft(backend, rng, dt, norm, n, axis):
    dims = (2, n, 3) if axis == 1 else (2, n)
    run_parity(backend, "rfft", [arg(rng, "x", dims, dt)], {"axis": axis, "norm": norm},
               lambda x: np.fft.rfft(x, axis=axis, norm=norm), check=check_fft)


@covers("irfft")
@pytest.mark.parametrize("norm", FFT_NORMS)
@pytest.mark.parametrize("n,axis", [(8, -1), (9, -1), (6, 0)])
def test_irfft(backend, rng, norm, n, axis):
    m = n // 2 + 1
    dims = (m, 3) if axis == 0 else (2, m)
    run_parity(backend, "irfft", [complex_arg(rng, "x", dims)], {"axis": axis, "norm": norm, "n": n},
               lambda x: np.fft.irfft(x.astype(np.complex128), n=n, axis=axis, norm=norm), check=check_fft)


# ----------------------------------------------------------------------------- non-finite values
# A NaN or inf in an input or a weight must come out wherever the float64 reference has one:
# a kernel may not clamp, skip or max it away (the runtime's finiteness check reads only the
# logits). Each case spoils a few values of otherwise fresh random inputs.
def check_nonfinite(k, out, ref, dtype, what) -> None:
    """run_parity's `check` for such cases: output k is non-finite exactly where the reference
    is and close to it elsewhere. A reference without NaN or inf fails (it would test nothing)."""
    out, ref = np.asarray(out), np.asarray(ref)
    bad = ~np.isfinite(ref.astype(np.float64))
    assert bad.any(), f"{what}: the reference holds no NaN or inf; the case tests nothing"
    got = ~np.isfinite(out.astype(np.float64))
    assert np.array_equal(got, bad), (f"{what}: non-finite at {np.argwhere(got).tolist()}, the "
                                      f"reference at {np.argwhere(bad).tolist()}")
    assert_close(np.where(bad, 0, out).astype(out.dtype), np.where(bad, 0, ref), dtype, what)


def spoiled(a: Arg, spots: dict) -> Arg:
    """`a` with value v at each index of `spots` ({index: v})."""
    data = np.array(a.data)
    for at, v in spots.items():
        data[at] = v
    return attrs.evolve(a, data=data)


NAN, INF = float("nan"), float("inf")
quiet = pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
NONFINITE_F = [F32, F64]
nfdtype = pytest.mark.parametrize("dt", NONFINITE_F, ids=[d.value for d in NONFINITE_F])
# {argument index: spots}: q [B, H, Sq, D], k and v [B, KVH, Sk, D]; key 0 is one every query
# row of the cases below sees (a masked key's value takes weight 0, and 0 * NaN is NaN). An
# inf in q meets a positive k at key 0: a +inf score, whose row is NaN (inf - inf).
ATTN_SPOILS = {
    "q_nan": {0: {(0, 1, -1, 3): NAN}},
    "q_inf": {0: {(1, 2, -1, 0): INF}, 1: {(1, 1, 0, 0): 1.0}},
    "k_nan": {1: {(1, 0, 0, 3): NAN}},
    "v_inf": {2: {(0, 1, 0, 2): -INF}},
}


@quiet
@pytest.mark.parametrize("spoil", list(ATTN_SPOILS))
@pytest.mark.parametrize("case", ["causal", "decode_pos", "causal_and_bias"])
@nfdtype
def test_nonfinite_attention(backend, rng, case, spoil, dt):
    """Prefill rows (numba: sgemm tiles for f32, per-row kernels for f64) and a decode row."""
    args, attrs_ = attention_args(rng, case, dt, 4, 2)
    for i, spots in ATTN_SPOILS[spoil].items():
        args[i] = spoiled(args[i], spots)
    run_parity(backend, "attention", args, attrs_, _attn_ref(attrs_), check=check_nonfinite)


@quiet
@pytest.mark.parametrize("dv", [6, 40])
@nfdtype
def test_nonfinite_varlen_attention(backend, rng, dv, dt):
    args = varlen_args(rng, "unsorted_cover", dt, 4, 2, dv=dv)
    args[0] = spoiled(args[0], {(5, 1, 2): NAN})                 # segment 2's token 5, head 1
    args[1] = spoiled(args[1], {(11, 0, 0): INF})                # segment 0's key 11
    args[2] = spoiled(args[2], {(1, 1, 3): NAN})                 # segment 1's value 1: its rows only
    run_parity(backend, "varlen_attention", args, {"scale": 0.3},
               lambda q, k, v, st, ln: ref_varlen_attention(q, k, v, st, ln, scale=0.3),
               check=check_nonfinite)


@quiet
@nfdtype
def test_nonfinite_rows(backend, rng, dt):
    """Row-wise ops: softmax, RMSNorm and LayerNorm (a NaN input row, an inf weight), RoPE."""
    x = spoiled(arg(rng, "x", (3, 4, 16), dt), {(0, 1, 2): NAN, (2, 3, 0): INF, (1, 0, 15): -INF})
    w = spoiled(arg(rng, "w", (16,), dt), {(5,): INF})
    run_parity(backend, "softmax", [x], {"axis": -1}, lambda v: ref_softmax(v, -1), check=check_nonfinite)
    run_parity(backend, "rms_norm", [x, w], {"eps": 1e-6, "offset": 0.0},
               lambda v, g: ref_rms_norm(v, g, 1e-6), check=check_nonfinite)
    run_parity(backend, "layer_norm", [x, w], {"eps": 1e-5}, lambda v, g: ref_layer_norm(v, g, eps=1e-5),
               check=check_nonfinite)
    xr = spoiled(arg(rng, "x", (1, 2, 3, 16), dt), {(0, 1, 2, 3): NAN})
    cos, sin = rope_tables(rng, (3, 8))
    run_parity(backend, "rope", [xr, cos, sin], {"style": "half"},
               lambda v, c, s: ref_rope(v, c, s, "half"), check=check_nonfinite)


@quiet
@nfdtype
def test_nonfinite_matmul_binary_pool(backend, rng, dt):
    """matmul, max and min (NaN wins, as numpy's maximum), segment pooling."""
    a = spoiled(arg(rng, "a", (3, 5), dt), {(1, 2): NAN})
    b = spoiled(arg(rng, "b", (5, 4), dt), {(0, 3): INF})
    run_parity(backend, "matmul", [a, b], {"trans_a": False, "trans_b": False},
               lambda x, y: ref_matmul(x, y), check=check_nonfinite)
    y = spoiled(arg(rng, "b", (3, 5), dt), {(2, 4): NAN, (0, 0): -INF})
    for op in ("max", "min"):
        run_parity(backend, "binary", [a, y], {"op": op}, lambda p, q: ref_binary(op, p, q),
                   check=check_nonfinite)
    # (tokens 4 and 10: the first of two segments, what mode "cls" takes)
    x = spoiled(arg(rng, "x", (SEGMENTS["unsorted_cover"][2], 5), dt), {(4, 1): NAN, (10, 4): INF})
    for mode in POOL_MODES:
        run_parity(backend, "segment_pool", [x] + segment_args("unsorted_cover"), {"mode": mode},
                   lambda v, st, ln: ref_segment_pool(v, st, ln, mode=mode), check=check_nonfinite)


def _scale_bytes(scheme) -> tuple:
    """(offset, NaN bytes) of the first block's scale d in a row packed in `scheme`."""
    if scheme == "int8_b32":
        return 0, np.array([0x7FC00000], "<u4").view(np.uint8)     # an f32 d
    return (208 if scheme == "q6_k" else 0), np.array([0x00, 0x7E], np.uint8)     # an f16 d


@quiet
@pytest.mark.parametrize("rows", [3, 12], ids=["gemv", "blocked"])
@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s != "int4_b64"])
def test_nonfinite_dequant_matmul(backend, rng, scheme, rows):
    """A NaN scale in one block of a packed weight: that output column is NaN, every row."""
    from rlx_core.ir.quant import matmul_reference

    w, k = _packed_arg(rng, scheme, 6)
    raw = np.array(w.data)
    at, nan = _scale_bytes(scheme)
    raw[2, at:at + nan.size] = nan
    args = [arg(rng, "x", (1, rows, k), F32), Arg("w", raw, U8)]
    run_parity(backend, "dequant_matmul", args, {"scheme": scheme, "act": "identity"},
               lambda x, r: matmul_reference(x, r.astype(np.uint8), scheme, (6, k)), check=check_nonfinite)


@quiet
def test_nonfinite_fake_quantize(backend, rng):
    """An activation block holding NaN or inf rounds to a block of NaN (its scale d is NaN or
    inf, and x / d * d is NaN); the other blocks as the reference quantizer rounds them."""
    from rlx_core.ir.quant import QuantScheme

    q = QuantScheme.parse("int8_b32")
    x = spoiled(arg(rng, "x", (3, 4 * q.block_size), F32), {(0, 5): NAN, (2, 100): INF})

    def ref(v):
        blocks = v.astype(np.float32).reshape(-1, q.block_size)
        bad = ~np.isfinite(blocks).all(1)
        y = q.dequantize_reference(q.quantize(np.where(bad[:, None], 0, blocks)), blocks.shape)
        y[bad] = np.nan
        return y.reshape(v.shape)

    run_parity(backend, "fake_quantize", [x], {"scheme": "int8_b32"}, ref, check=check_nonfinite)


from .ops_suite_moe import *  # noqa: F401,F403,E402  (routed experts)
from .ops_suite_deltanet import *  # noqa: F401,F403,E402  (gated delta rule, causal conv1d)

# what `from rlx_core.testing.ops_suite import *` brings: the tests and the fixtures they use
__all__ = sorted(n for n in dir() if n.startswith("test_")) + ["backend", "custom_plugin", "rlx_backend",
                                                               "rng"]
