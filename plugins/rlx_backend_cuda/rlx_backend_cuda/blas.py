"""cuBLAS called directly (ctypes on the libcublas CuPy loaded), so GEMMs can be captured
into CUDA graphs: CuPy's own wrappers refuse any cuBLAS call while a stream captures.
Each call sets the stream and a backend-owned workspace (cublasSetStream resets it), as
cuBLAS asks of graph capture."""
from __future__ import annotations

import ctypes
import functools

from rlx_core.ir.errors import BackendError

from . import device

COMPUTE_32F, COMPUTE_64F = 68, 70
GEMM_DEFAULT = -1
WORKSPACE = 32 << 20


def _find_lib() -> str:
    device.cupy().cuda.device.get_cublas_handle()          # makes CuPy load libcublas
    return device.required_library("cuBLAS", "libcublas.so", "libhipblas.so")


class Lib:
    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        vp, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        self._set_stream = lib.cublasSetStream_v2
        self._set_stream.argtypes = [vp, vp]
        self._set_ws = lib.cublasSetWorkspace_v2
        self._set_ws.argtypes = [vp, vp, ctypes.c_size_t]
        self._gemm = lib.cublasGemmEx
        self._gemm.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
        self._gemm_s = lib.cublasGemmStridedBatchedEx
        self._gemm_s.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, ll, vp, i, i, ll, vp, vp, i, i, ll, i, i, i]
        self.ws = device.alloc(WORKSPACE, "the cuBLAS workspace")
        # the backend's own handle: CuPy's is per thread and dies with its thread, while a
        # runner built in one thread may run in another (calls are serialized per backend)
        h = ctypes.c_void_p()
        self._check(lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
        self.handle = int(h.value)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status:
            raise BackendError(f"cuda backend: {what} failed with cuBLAS status {status}")

    def prepare(self, handle: int, stream: int) -> None:
        self._check(self._set_stream(handle, stream), "cublasSetStream")
        self._check(self._set_ws(handle, self.ws.ptr, WORKSPACE), "cublasSetWorkspace")

    def gemm(self, h, ta, tb, m, n, k, alpha, a, at, lda, b, bt, ldb, beta, c, ct, ldc, compute):
        self._check(self._gemm(h, ta, tb, m, n, k, alpha, a, at, lda, b, bt, ldb, beta, c, ct, ldc,
                               compute, GEMM_DEFAULT), "cublasGemmEx")

    def gemm_strided(self, h, ta, tb, m, n, k, alpha, a, at, lda, sa, b, bt, ldb, sb, beta, c, ct, ldc, sc,
                     count, compute):
        self._check(self._gemm_s(h, ta, tb, m, n, k, alpha, a, at, lda, sa, b, bt, ldb, sb, beta, c, ct, ldc,
                                 sc, count, compute, GEMM_DEFAULT), "cublasGemmStridedBatchedEx")


class CupyLib:
    """ROCm (hipBLAS through CuPy's wrappers; graphs are off there, so no capture issue)."""

    @property
    def handle(self) -> int:
        return int(device.cupy().cuda.device.get_cublas_handle())

    def prepare(self, handle: int, stream: int) -> None:
        pass

    def gemm(self, *a):
        from cupy_backends.cuda.libs import cublas

        cublas.gemmEx(*a, GEMM_DEFAULT)

    def gemm_strided(self, *a):
        from cupy_backends.cuda.libs import cublas

        cublas.gemmStridedBatchedEx(*a, GEMM_DEFAULT)


@functools.lru_cache(maxsize=1)
def library():
    if device.info().get("hip"):
        return CupyLib()
    return Lib(_find_lib())

