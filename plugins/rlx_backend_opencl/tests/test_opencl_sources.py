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
    assert K.source("softmax.cl") is K.source("softmax.cl")
    assert "__kernel void softmax(" in K.source("softmax.cl")


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
