"""The thread count of the BLAS numpy links (OpenBLAS, found through ctypes).

Why: running a batch as several data-parallel parts in Python threads (each part's GEMMs
and its single-threaded numpy passes on its own core) needs every BLAS call at one thread
meanwhile; OpenBLAS's own pool would otherwise put two threads on each core.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import threading

import numpy as np

_LIB: list = []            # [(get, set)] once looked up; [None] when not found
_LOCK = threading.Lock()


_SYMBOLS = (("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_", "scipy_cblas_sgemm64_"),
            ("scipy_openblas_get_num_threads", "scipy_openblas_set_num_threads", "scipy_cblas_sgemm"),
            ("openblas_get_num_threads64_", "openblas_set_num_threads64_", "cblas_sgemm64_"),
            ("openblas_get_num_threads", "openblas_set_num_threads", "cblas_sgemm"))


def _openblas():
    """(get_num_threads, set_num_threads, cblas_sgemm name) of the OpenBLAS numpy bundles
    and its CDLL, or None."""
    if not _LIB:
        found = None
        libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
        for path in sorted(glob.glob(os.path.join(libs, "*openblas*.so*"))):
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            for get, put, gemm in _SYMBOLS:
                if hasattr(lib, get) and hasattr(lib, put):
                    g, s = getattr(lib, get), getattr(lib, put)
                    g.restype, s.argtypes, s.restype = ctypes.c_int, [ctypes.c_int], None
                    found = (g, s, gemm, lib)
                    break
            if found:
                break
        _LIB.append(found)
    return _LIB[0]


def cblas_sgemm() -> tuple | None:
    """(address, ilp64) of that OpenBLAS's cblas_sgemm, for compiled kernels that call it
    from their own threads (ilp64: its integer arguments are 64-bit), or None."""
    lib = _openblas()
    if lib is None or not hasattr(lib[3], lib[2]):
        return None
    return ctypes.cast(getattr(lib[3], lib[2]), ctypes.c_void_p).value, lib[2].endswith("64_")


def blas_threads() -> int | None:
    """The BLAS thread count, or None when numpy's BLAS is not an OpenBLAS found here."""
    lib = _openblas()
    return int(lib[0]()) if lib else None


_DEPTH = [0, None]         # blocks open, the count to restore when the last one closes


@contextlib.contextmanager
def single_threaded_blas():
    """BLAS at one thread inside the block (process-wide: OpenBLAS has no per-thread count);
    the count from before the first open block comes back when the last one closes."""
    lib = _openblas()
    if lib is None:
        yield
        return
    with _LOCK:
        if _DEPTH[0] == 0:
            _DEPTH[1] = int(lib[0]())
            lib[1](1)
        _DEPTH[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:
                lib[1](_DEPTH[1])
