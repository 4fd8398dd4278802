"""The kernel files (kernels/*.cl, package data): each one is used, each one the modules name
exists, and the quant programs' per-kind pieces arrive as defines. No device needed."""
from __future__ import annotations

import importlib.resources
import pathlib
import re

import pytest

from rlx_backend_opencl import kernels as K
from rlx_backend_opencl import quant as Q
from rlx_core.ir.dtype import DType
from rlx_core.ir.quant import QuantScheme

PKG = pathlib.Path(K.__file__).parent


def _named_files() -> set:
    """Kernel file names that the package's modules pass to source()."""
    names = set()
    for py in PKG.glob("*.py"):
        names |= set(re.findall(r'source\("([\w.]+\.cl)"\)', py.read_text()))
    return names


def test_every_kernel_file_is_used_and_every_named_one_ships():
    shipped = {p.name for p in (importlib.resources.files("rlx_backend_opencl") / "kernels").iterdir()
               if p.name.endswith(".cl")}
    named = _named_files()
    assert named, "no source() call found: the scan is broken"
    assert shipped - named == set(), "kernel files no module loads"
    assert named - shipped == set(), "kernel files a module names but the package lacks"


def test_source_is_read_once():
    assert K.source("norm.cl") is K.source("norm.cl")
    assert "__kernel void norm(" in K.source("norm.cl")


@pytest.mark.parametrize("kind", sorted(Q.KINDS))
def test_quant_program_has_no_python_placeholders(kind):
    scheme = QuantScheme(kind)
    src = Q.source(scheme, DType.F32, DType.F32, DType.F32)
    assert "%(" not in src and "$" not in src
    assert src.count("inline void dq_unit(") == 1
    for k in ("dq_gemv", "dq_gemm", "dq_rows"):
        assert f"void {k}(" in src
    legacy = kind in ("q4_0", "q4_1", "q5_0", "q5_1")
    assert ("#define LEGACY_HEAD " in src) == legacy


# --------------------------------------------------------------------------- row kernels (rows.py)
# Enough of OpenCL C for gcc to check the row programs' syntax and types on any host (PoCL
# cannot build on some CPUs); the device build is the OpenCL suite's.
_CL_SHIM = r"""
#include <math.h>
#include <stdbool.h>
#include <limits.h>
#define __kernel
#define __global
#define __local
#define __private
#define CLK_LOCAL_MEM_FENCE 1
typedef unsigned char uchar; typedef unsigned short ushort; typedef unsigned int uint;
typedef unsigned short half;
void barrier(int);
int get_local_id(int); int get_local_size(int); int get_global_id(int);
float vload_half(int, const half*); void vstore_half_rte(float, int, half*);
int atomic_cmpxchg(volatile int*, int, int);
"""

ROW_KINDS = ("softmax", "reduce", "argmax", "topk")


@pytest.mark.parametrize("kind", ROW_KINDS)
def test_row_kernel_renders(kind):
    from rlx_backend_opencl import rows

    src = rows.source(kind)
    assert f"__kernel void {kind}(" in src
    assert src.count("barrier(CLK_LOCAL_MEM_FENCE);") == {"softmax": 0, "reduce": 2, "argmax": 2, "topk": 3}[kind]


@pytest.mark.skipif(__import__("shutil").which("gcc") is None, reason="gcc not installed")
@pytest.mark.parametrize("kind", ROW_KINDS)
@pytest.mark.parametrize("dt", [DType.F32, DType.F16, DType.F64, DType.I32, DType.I64])
def test_row_program_is_c_that_gcc_accepts(tmp_path, kind, dt):
    import subprocess

    from rlx_backend_opencl import rows
    from rlx_backend_opencl.runner import _defs

    if kind == "softmax" and not dt.is_float:
        pytest.skip("softmax is for floats")
    acc = K.acc_type(dt)
    defs = dict(T_X=K.ctype(dt), T_Y=K.ctype(dt), ACC=acc, **{"TO_Y(v)": K.to(dt, "v")},
                ACC_LO="(-INFINITY)" if acc != "long" else "LONG_MIN", ACC_HI="INFINITY" if acc != "long" else "LONG_MAX",
                **{"KEY(v)": f"(-({acc})(v))"})
    src = K.prelude([dt, acc]).replace("#pragma OPENCL EXTENSION cl_khr_fp64 : enable", "") + _defs(**defs) \
        + K.ROW_COMMON + rows.source(kind)
    (tmp_path / "shim.h").write_text(_CL_SHIM)
    r = subprocess.run(["gcc", "-std=c11", "-fsyntax-only", "-Werror", "-Wall", "-Wno-unused-variable",
                        "-Wno-unused-function", "-Wno-tautological-compare", "-Wno-unknown-pragmas",
                        "-include", str(tmp_path / "shim.h"), "-x", "c", "-"], input=src, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
