"""The row kernels rendered from core's description (rows.py): every kind and dtype renders,
the catalog lists them, and (where nvcc is installed) a few compile. No GPU needed."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from rlx_backend_cuda import kernels_catalog, rows, sources
from rlx_core.ir.dtype import BF16, BOOL, F16, F32, F64, I32, I64
from rlx_core.ir.errors import BackendError
from rlx_core.ir.rowkernels import REDUCTIONS

FLOATS = (F32, BF16, F16, F64)


@pytest.mark.parametrize("dt", FLOATS + (I32, I64, BOOL))
def test_every_row_kernel_renders(dt):
    srcs = {f"rlx_reduce {op}": rows.source("reduce", dt, dt, op) for op in REDUCTIONS}
    srcs["rlx_argmax"] = rows.source("argmax", dt, I64)
    srcs["rlx_topk"] = rows.source("topk", dt, dt)
    if dt.is_float:
        srcs["rlx_softmax"] = rows.source("softmax", dt, dt)
    for what, src in srcs.items():
        kname = what.split()[0]
        assert f'extern "C" __global__ void {kname}(' in src, what
        assert "$" not in src.split("RLX_GRID_WAIT")[-1], what          # every placeholder filled
        assert sources.with_grid_wait(src, kname).count("RLX_GRID_WAIT();") == 1, what


def test_the_catalog_lists_every_row_kernel():
    names = {name for name, _, _ in kernels_catalog.catalog()}
    for dt in FLOATS:
        assert f"softmax {dt.value}" in names
    for dt in FLOATS + (I32, I64, BOOL):
        assert {f"argmax {dt.value}", f"topk {dt.value}"} <= names
        for op in REDUCTIONS:
            assert {f"reduce {op} {dt.value}", f"reduce_cols {op} {dt.value}"} <= names


def test_reduce_macros_are_the_reduction_in_this_dialect():
    m = rows.reduce_macros("mean", I32, F64)
    assert m["ACC"] == "double" and m["FINAL"] == "ST(double, (r / (ACC)n))"
    m = rows.reduce_macros("max", I32, I32)
    assert m["ACC"] == "long long" and m["COMB"] == "(rlx_maxi<ACC>((a), (b)))"
    assert m["IDENT"] == "((ACC)(-9223372036854775807LL - 1))" and m["FINAL"] == "(int)(r)"
    m = rows.reduce_macros("min", BF16, BF16)
    assert m["COMB"] == "(rlx_min((a), (b)))" and m["IDENT"] == "((ACC)RLX_INF)"


def test_unknown_row_kernel_is_a_backend_error():
    with pytest.raises(BackendError, match="no kind 'cumsum'"):
        rows.source("cumsum", F32, F32)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("kind, dt, op", [("softmax", BF16, None), ("reduce", F32, "mean"), ("reduce", I64, "min"),
                                          ("argmax", F16, None), ("topk", I32, None)])
def test_row_kernels_compile(tmp_path, kind, dt, op):
    src = rows.source(kind, dt, I64 if kind == "argmax" else dt, op)
    p = os.path.join(tmp_path, "k.cu")
    with open(p, "w") as f:
        f.write(sources.with_grid_wait(src, f"rlx_{kind}"))
    r = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-cubin", "-o", p + ".cubin", p],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
