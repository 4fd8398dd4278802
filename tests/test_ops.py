"""Op parity: the conformance kit's suite (rlx_core.testing.ops_suite: every op of the table
against an independent float64 reference, every float dtype, poisoned outputs) on each of the
project's backends, or the one of them `--rlx-backend` names; then checks of the table and the
NumPy kernels that are not about a backend."""
from __future__ import annotations

import math

import numpy as np
import pytest

from rlx_core.ir.dtype import BF16, F32, I64
from rlx_core.ir.ops import POOL_MODES
from rlx_core.testing.ops_suite import *  # noqa: F401,F403  (the suite, on every backend)
from rlx_core.testing.ops_suite import SEGMENTS, VARLEN_OPS, segment_args, varlen_args
from rlx_core.testing.parity import (Arg, arg, compile_on, numpy_without, one_op, ref_segment_pool,
                                     ref_varlen_attention, run_parity)

# the project's backends; an example's or a third party's backend runs the suite in its own tests
# (examples/rlx_backend_minimal/tests/test_minimal_ops.py), not a second time here
RLX_BACKENDS = ("numpy", "numba", "cuda", "opencl")


# ----------------------------------------------------------------------------- packed sequences
@pytest.mark.parametrize("case", list(SEGMENTS))
@pytest.mark.parametrize("dt", [F32, BF16], ids=lambda d: d.value)
def test_varlen_ops_legalized(rng, case, dt):
    """For a backend without their kernels the pipeline legalizes both ops into table
    primitives (attention with a block-diagonal keep-mask; membership matmuls, a masked
    max, a gather) that compute the same."""
    tol = 2e-2 if dt is BF16 else None
    with numpy_without(VARLEN_OPS, "no-varlen") as name:
        args = varlen_args(rng, case, dt, 4, 2)
        run_parity(name, "varlen_attention", args, {"scale": 0.3},
                   lambda q, k, v, st, ln: ref_varlen_attention(q, k, v, st, ln, scale=0.3), tol=tol)
        for mode in POOL_MODES:
            x = arg(rng, "x", (SEGMENTS[case][2], 5), dt)
            run_parity(name, "segment_pool", [x] + segment_args(case), {"mode": mode},
                       lambda x, st, ln: ref_segment_pool(x, st, ln, mode=mode), tol=tol)
        ops = {n.op for n in compile_on(one_op("varlen_attention", args, {"scale": 0.3}), name).mir.nodes}
    assert not ops & VARLEN_OPS and "attention" in ops, sorted(ops)


def _cpu_kernel_backends() -> list:
    from rlx_core.pipeline import available_backends

    ok = {b.name for b, avail, _ in available_backends() if avail}
    return [pytest.param(b, marks=pytest.mark.skipif(b not in ok, reason=f"backend {b!r} is not available"))
            for b in ("numpy", "numba")]


@pytest.mark.parametrize("backend_name", _cpu_kernel_backends())
@pytest.mark.parametrize("starts,lens,match", [
    ([0, 5], [6, 4], "segments 0 and 1 overlap"),
    ([0, 8], [4, 3], r"segment 1 \(start 8, length 3\) is not within the 10 tokens"),
    ([0, -1], [4, 0], r"segment 1 \(start -1, length 0\)"),
    ([0, 4], [4, -2], "segment 1"),
])
def test_bad_segments_are_model_errors(rng, backend_name, starts, lens, match):
    """The kernels check segments at run time (in range, disjoint) and name the op."""
    from rlx_core.ir.errors import ModelError

    seg = [Arg("starts", np.array(starts, np.int64), I64), Arg("lens", np.array(lens, np.int64), I64)]
    for op, args, a in (("varlen_attention", [arg(rng, "q", (10, 2, 4)), arg(rng, "k", (10, 2, 4)),
                                              arg(rng, "v", (10, 2, 4))], {"scale": 0.5}),
                        ("segment_pool", [arg(rng, "x", (10, 3))], {"mode": "mean"})):
        exe = compile_on(one_op(op, args + seg, a), backend_name)
        with pytest.raises(ModelError, match=f"{op}: {match}"):
            exe.run({x.name: x.data.astype(np.float32) if x.dtype is F32 else x.data for x in args + seg})


@pytest.mark.parametrize("op,shapes,attrs_,match", [
    ("varlen_attention", [(5, 4, 8), (5, 3, 8), (5, 3, 8), (2,), (2,)], {"scale": 1.0},
     "not a multiple of 3"),
    ("varlen_attention", [(1, 5, 4, 8)] * 3 + [(2,), (2,)], {"scale": 1.0}, r"\[tokens, heads, head_dim\]"),
    ("varlen_attention", [(5, 4, 8), (6, 4, 8), (6, 4, 8), (2,), (2,)], {"scale": 1.0}, "q/k tokens"),
    ("varlen_attention", [(5, 4, 8), (5, 4, 8), (5, 4, 8), (2,), (3,)], {"scale": 1.0}, "starts vs lens"),
    ("segment_pool", [(5, 4), (2, 1), (2,)], {"mode": "max"}, r"starts must be an int vector"),
    ("segment_pool", [(1, 5, 4), (2,), (2,)], {"mode": "cls"}, r"\[tokens, features\]"),
])
def test_varlen_metas_reject_bad_shapes(op, shapes, attrs_, match):
    from rlx_core.ir.errors import ShapeError
    from rlx_core.ir.graph import Builder

    m = Builder("bad", "mir")
    ins = [m.input(f"x{i}", s, I64 if len(s) == 1 and i >= len(shapes) - 2 else F32)
           for i, s in enumerate(shapes)]
    with pytest.raises(ShapeError, match=match):
        m.add(op, tuple(ins), **attrs_)


def test_segment_pool_mode_is_checked():
    from rlx_core.ir.errors import GraphError
    from rlx_core.ir.ops import get_op

    with pytest.raises(GraphError, match=r"attr 'mode' = 'sum': expected one of \['mean', 'cls', 'max'\]"):
        get_op("segment_pool").check_attrs({"mode": "sum"})


# ----------------------------------------------------------------------------- NumPy kernels
def test_numpy_gelu_table_is_the_erf_gelu(rng):
    """The NumPy backend's f32 GELU (a Phi table, in place, in chunks) against float64 erf."""
    from rlx_core.ir.numpy_kernels import gelu_f32_inplace

    def gelu64(x):
        return np.array([0.5 * v * math.erfc(-v / math.sqrt(2.0)) for v in np.asarray(x, np.float64).ravel()]
                        ).reshape(np.shape(x))

    x = np.concatenate([np.linspace(-12, 12, 200001), 3 * rng.standard_normal(50000),
                        [0.0, -0.0, 1e-30, -1e-30, 8.0, -8.0, 7.999, -7.999, 100.0, -100.0]]
                       ).astype(np.float32)
    err = np.abs(gelu_f32_inplace(x.copy()) - gelu64(x))
    assert (err <= 2e-7 * np.maximum(np.abs(x), 1.0)).all(), err.max()
    y = rng.standard_normal((3, 5, 7)).astype(np.float32)        # shape kept, in place
    z = y.copy()
    assert gelu_f32_inplace(z) is z and np.abs(z - gelu64(y)).max() < 1e-6
    y = rng.standard_normal((300, 700)).astype(np.float32)        # several chunks, with a bias
    b = rng.standard_normal(700).astype(np.float32)
    np.testing.assert_allclose(gelu_f32_inplace(y.copy(), b), gelu64(y + b), atol=1e-6)
    assert np.isnan(gelu_f32_inplace(np.array([np.nan, 1.0], np.float32))[0])


def test_attention_groups_pad_little_and_bound_memory():
    from rlx_core.ir.numpy_kernels import attention_groups

    lens = np.array([3, 300, 4, 5, 299, 3, 3], np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    groups = attention_groups(starts, lens, heads=12, budget=2 * 12 * 300 * 300)
    seen = sorted(int(i) for idx, valid in groups for i in (idx[valid] if valid is not None else idx.ravel()))
    assert seen == list(range(int(lens.sum())))                     # every token once
    for idx, valid in groups:
        g, top = idx.shape
        real = (valid.sum(1) if valid is not None else np.full(g, top)) ** 2
        padded = g * top * top
        assert padded * 4 <= 5 * real.sum() or (padded - real.sum()) * 12 <= 1 << 16
        assert padded * 12 <= 2 * 12 * 300 * 300
    assert [idx.shape for idx, _ in groups] == [(2, 300), (5, 5)]  # short texts in one group
