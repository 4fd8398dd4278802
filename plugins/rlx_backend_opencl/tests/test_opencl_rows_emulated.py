"""The row programs (rows.py's softmax, reduce, argmax, topk after kernels/rows.cl, as the runner
assembles them) run on any host without an OpenCL device: compiled by gcc as C, one pthread per
work-item, a pthread barrier for barrier(), a work-group's __local arrays static (one group at
a time). PoCL cannot build kernels on some CPUs (Zen 5), so this is what checks the kernels'
logic there: against float64 numpy on fresh random rows with NaN, -inf rows and ties, rows that
do not fill the work-group's rows (`ok` false), rows shorter and longer than LX. The device
build itself is the OpenCL suite's (test_opencl.py)."""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import numpy as np
import pytest

from rlx_backend_opencl import kernels as K
from rlx_backend_opencl import rows as R
from rlx_backend_opencl.runner import _defs
from rlx_core.ir.dtype import DType
from rlx_core.ir.rowkernels import REDUCTIONS

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")

_SHIM = r"""
#include <tgmath.h>
#include <stdbool.h>
#include <limits.h>
#include <pthread.h>
#define __kernel
#define __global
#define __private
#define __local
#define inline static inline
#define CLK_LOCAL_MEM_FENCE 1
typedef unsigned char uchar; typedef unsigned short ushort; typedef unsigned int uint;
typedef _Float16 half;
static float vload_half(int i, const half* p) { return (float)p[i]; }
static void vstore_half_rte(float v, int i, half* p) { p[i] = (half)v; }
static int atomic_cmpxchg(volatile int* p, int c, int v) { return __sync_val_compare_and_swap(p, c, v); }
static pthread_barrier_t g_bar;
static __thread int t_l0, t_l1;
static int g_LX, g_LY, g_group;
static int get_local_id(int d) { return d ? t_l1 : t_l0; }
static int get_local_size(int d) { return d ? g_LY : g_LX; }
static int get_global_id(int d) { return d ? g_group * g_LY + t_l1 : t_l0; }
static void barrier(int f) { (void)f; pthread_barrier_wait(&g_bar); }
"""

_DRIVER = r"""
static void *A_x, *A_y, *A_yi; static int *A_meta; static int A_rows, A_n, A_op;
static void call_kernel(void) { CALL; }
static void* worker(void* p) { int id = (int)(long)p; t_l0 = id % g_LX; t_l1 = id / g_LX; call_kernel(); return 0; }
void run(void* x, void* y, void* yi, int* meta, int rows, int n, int op, int LX, int LY) {
  A_x = x; A_y = y; A_yi = yi; A_meta = meta; A_rows = rows; A_n = n; A_op = op; g_LX = LX; g_LY = LY;
  pthread_t th[256];
  for (g_group = 0; g_group < (rows + LY - 1) / LY; ++g_group) {
    pthread_barrier_init(&g_bar, 0, LX * LY);
    for (int i = 0; i < LX * LY; ++i) pthread_create(&th[i], 0, worker, (void*)(long)i);
    for (int i = 0; i < LX * LY; ++i) pthread_join(th[i], 0);
    pthread_barrier_destroy(&g_bar);
  }
}
"""

_CALLS = {
    "softmax": "softmax((const T_X*)A_x, 0, (T_Y*)A_y, 0, A_meta, 0, A_rows, A_n)",
    "reduce": "reduce((const T_X*)A_x, 0, (T_Y*)A_y, 0, A_meta, 0, A_rows, A_n, A_op)",
    "argmax": "argmax((const T_X*)A_x, 0, (long*)A_y, 0, A_meta, 0, A_rows, A_n)",
    "topk": "topk((const T_X*)A_x, 0, (T_X*)A_y, 0, (long*)A_yi, 0, A_meta, 0, A_rows, A_n, A_op)",
}
_NP = {DType.F32: np.float32, DType.F64: np.float64, DType.F16: np.float16, DType.I32: np.int32,
       DType.I64: np.int64, DType.U8: np.uint8}
# (rows, n, LX, LY): partial last group, n < LX, n = 1, one row per group with LX = n
SHAPES = ((5, 37, 16, 4), (3, 300, 16, 16), (7, 1, 4, 2), (2, 64, 64, 1))


def _program(kind: str, dt: DType) -> str:
    """The program text as runner.rows() assembles it for x of dtype dt."""
    ydt = DType.I64 if kind == "argmax" else dt
    acc = K.acc_type(dt) if dt.is_float else "long"
    defs = dict(T_X=K.ctype(dt), T_Y=K.ctype(ydt), ACC=acc, **{"TO_Y(v)": K.to(ydt, "v")})
    if kind == "reduce":     # as runner._op_reduce
        defs.update(ACC_LO="(-INFINITY)" if acc != "long" else "LONG_MIN",
                    ACC_HI="INFINITY" if acc != "long" else "LONG_MAX")
    if kind == "topk":       # as runner._op_topk
        defs["KEY(v)"] = f"(-({acc})(v))" if dt.is_float else f"((long)({K.ctype(dt)})(-(v)))"
    return K.prelude([dt, ydt, acc]) + _defs(**defs) + K.ROW_COMMON + R.source(kind)


def _build(kind: str, dt: DType, tmp_path):
    body = re.sub(r"__local (\w+) (\w+)\[LMAX\];", r"static \1 \2[LMAX];", _program(kind, dt))
    body = body.replace("#pragma OPENCL EXTENSION cl_khr_fp64 : enable", "")
    c, so = tmp_path / "k.c", tmp_path / "k.so"
    c.write_text(_SHIM + body + _DRIVER.replace("CALL", _CALLS[kind]))
    r = subprocess.run(["gcc", "-std=gnu11", "-O1", "-shared", "-fPIC", "-pthread", "-o", str(so), str(c)],
                       capture_output=True, text=True)
    if r.returncode and "_Float16" in r.stderr:
        pytest.skip("this gcc has no _Float16")
    assert r.returncode == 0, r.stderr[-3000:]
    fn = ctypes.CDLL(str(so)).run
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5
    return fn


def _rows(rng, dt, rows, n, extremes=False):
    if not dt.is_float:
        info = np.iinfo(_NP[dt])
        x = rng.integers(max(info.min, -9), min(info.max, 9), (rows, n)).astype(_NP[dt])
        if extremes:
            x[0, 0], x[-1, -1] = info.min, info.max   # where -x wraps
        return x
    x = (rng.standard_normal((rows, n)) * 3).astype(_NP[dt])
    if n > 3:
        x[0, 1] = x[0, 0]             # a tie
        x[1, 2] = np.nan
        x[2 % rows, :] = -np.inf
    return x


def _launch(fn, kind, x, ydt, op_code, LX, LY):
    rows, n = x.shape
    y = np.zeros((rows, n) if kind == "softmax" else (rows,), _NP[ydt])
    inner = [n, 1] if kind == "softmax" else [1, 0]        # y's row stride, its stride along the row
    meta = np.array([1, rows, n, 1] + inner, np.int32)
    fn(x.ctypes.data, y.ctypes.data, None, meta.ctypes.data, rows, n, op_code, LX, LY)
    return y


@pytest.mark.parametrize("dt", [DType.F32, DType.F64, DType.F16])
def test_softmax(tmp_path, rng, dt):
    fn = _build("softmax", dt, tmp_path)
    for rows, n, LX, LY in SHAPES:
        x = _rows(rng, dt, rows, n)
        got = _launch(fn, "softmax", x, dt, 0, LX, LY)
        x64 = x.astype(np.float64)
        with np.errstate(all="ignore"):
            m = np.max(x64, -1, keepdims=True)
            m[~np.isfinite(m)] = 0
            e = np.exp(x64 - m)
            s = e.sum(-1, keepdims=True)
            s[s == 0] = 1
        tol = 2e-3 if dt is DType.F16 else 1e-5
        np.testing.assert_allclose(got.astype(np.float64), e / s, rtol=tol, atol=tol, equal_nan=True)


@pytest.mark.parametrize("dt", [DType.F32, DType.F64, DType.F16, DType.I32, DType.I64])
def test_reduce(tmp_path, rng, dt):
    fn = _build("reduce", dt, tmp_path)
    for rows, n, LX, LY in SHAPES:
        x = _rows(rng, dt, rows, n)
        if dt.is_float:
            x = np.where(np.isfinite(x), np.clip(x, -1.5, 1.5), x).astype(x.dtype)   # prod stays finite
        for code, op in enumerate(REDUCTIONS):
            got = _launch(fn, "reduce", x, dt, code, LX, LY)
            with np.errstate(all="ignore"):
                want = getattr(np, op)(x.astype(np.float64 if dt.is_float or op == "mean" else np.int64), -1)
            if dt.is_float:         # the reference rounded to the output dtype, as the store rounds (f16 prod: inf)
                with np.errstate(over="ignore"):
                    want = want.astype(_NP[dt]).astype(np.float64)
                eps = float(np.finfo(np.float64 if dt is DType.F64 else np.float32).eps)    # of ACC
                rtol = max(2e-3 if dt is DType.F16 else 0.0, 4 * n * eps)
                atol = 4 * n * eps * 1.5                                  # a sum near 0 (|x| <= 1.5)
                np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol, atol=atol, equal_nan=True,
                                           err_msg=op)
            else:
                np.testing.assert_array_equal(got, want.astype(_NP[dt]), err_msg=op)


@pytest.mark.parametrize("dt", [DType.F32, DType.F64, DType.F16, DType.I32, DType.I64])
def test_argmax(tmp_path, rng, dt):
    fn = _build("argmax", dt, tmp_path)
    for rows, n, LX, LY in SHAPES:
        x = _rows(rng, dt, rows, n, extremes=True)
        got = _launch(fn, "argmax", x, DType.I64, 0, LX, LY)
        np.testing.assert_array_equal(got, np.argmax(x, -1))


@pytest.mark.parametrize("dt", [DType.F32, DType.F64, DType.F16, DType.I32, DType.I64, DType.U8])
def test_topk(tmp_path, rng, dt):
    """numpy's stable argsort of -x (-x wrapping on unsigned and minimum values, as numpy's)."""
    fn = _build("topk", dt, tmp_path)
    for rows, n, LX, LY in SHAPES:
        x = _rows(rng, dt, rows, n, extremes=True)
        if dt.is_float and n > 6:
            x[0, 5], x[0, 6] = -0.0, 0.0            # equal keys: the first index first
        k = min(n, 5)
        y, yi = np.zeros((rows, k), _NP[dt]), np.zeros((rows, k), np.int64)
        meta = np.array([1, rows, n, 1, k, 1, k, 1], np.int32)      # x, y, yi: rows of n, k, k
        fn(x.ctypes.data, y.ctypes.data, yi.ctypes.data, meta.ctypes.data, rows, n, k, LX, LY)
        with np.errstate(over="ignore"):
            want = np.argsort(-x, axis=-1, kind="stable")[:, :k]
        np.testing.assert_array_equal(yi, want)
        np.testing.assert_array_equal(y, np.take_along_axis(x, want, -1))
