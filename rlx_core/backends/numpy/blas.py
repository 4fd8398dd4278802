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


def _openblas():
    """(get_num_threads, set_num_threads) of the OpenBLAS numpy bundles, or None."""
    if not _LIB:
        found = None
        libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
        for path in sorted(glob.glob(os.path.join(libs, "*openblas*.so*"))):
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            for get, put in (("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
                             ("scipy_openblas_get_num_threads", "scipy_openblas_set_num_threads"),
                             ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
                             ("openblas_get_num_threads", "openblas_set_num_threads")):
                if hasattr(lib, get) and hasattr(lib, put):
                    g, s = getattr(lib, get), getattr(lib, put)
                    g.restype, s.argtypes, s.restype = ctypes.c_int, [ctypes.c_int], None
                    found = (g, s)
                    break
            if found:
                break
        _LIB.append(found)
    return _LIB[0]


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
