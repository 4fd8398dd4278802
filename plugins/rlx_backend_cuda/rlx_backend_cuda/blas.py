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


# ----------------------------------------------------------------------------- cuBLASLt
# A GEMM with its bias (and GELU-tanh / ReLU) added to the f32 accumulator before the one
# rounding to the output type (cublasLtMatmul's epilogue), instead of a second pass over the
# output. Enum values of cublasLt.h.
LT_DESC_TRANSA, LT_DESC_TRANSB, LT_DESC_EPILOGUE, LT_DESC_BIAS_POINTER, LT_DESC_BIAS_DATA_TYPE = 3, 4, 7, 8, 26
LT_PREF_MAX_WORKSPACE_BYTES = 1
LT_EPILOGUES = {"identity": 4, "relu": 6, "gelu_tanh": 36}     # BIAS, RELU_BIAS, GELU_BIAS


class _HeuristicResult(ctypes.Structure):      # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class LtLib:
    def __init__(self, path: str):
        lib = self._lib = ctypes.CDLL(path)
        vp = ctypes.c_void_p
        h = ctypes.c_void_p()
        Lib._check(lib.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
        self.handle = h
        lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.c_size_t, vp]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, ctypes.c_int, vp, ctypes.c_size_t]
        lib.cublasLtMatrixLayoutCreate.argtypes = [vp, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, ctypes.c_int, vp, ctypes.c_size_t]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int, vp, vp]
        self.ws = device.alloc(WORKSPACE, "the cuBLASLt workspace")
        self.keep: list = []                    # descriptors and algos the prepared calls point to

    def _set(self, fn, obj, attr: int, value) -> None:
        Lib._check(fn(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), "cublasLt set attribute")

    def _layout(self, dtype: int, rows: int, cols: int, ld: int):
        lay = ctypes.c_void_p()
        Lib._check(self._lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, rows, cols, ld),
                   "cublasLtMatrixLayoutCreate")
        self.keep.append(lay)
        return lay

    def prepare(self, opa, opb, m, n, k, a_ld, b_ld, dtype, bias_ptr: int, bias_dtype: int, act: str,
                d_ld: int | None = None):
        """A call D[m, n] = op(A) op(B) + bias (column-major, as cublasGemmEx's operands; D's
        leading dimension d_ld, m by default) with `act` after the bias, or None where no
        algorithm takes it: `fn(a, b, d, alpha, beta, stream)`."""
        lib = self._lib
        desc = ctypes.c_void_p()
        Lib._check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE_32F, 0), "cublasLtMatmulDescCreate")
        self.keep.append(desc)
        for attr, v in ((LT_DESC_TRANSA, ctypes.c_int32(opa)), (LT_DESC_TRANSB, ctypes.c_int32(opb)),
                        (LT_DESC_EPILOGUE, ctypes.c_int32(LT_EPILOGUES[act])),
                        (LT_DESC_BIAS_POINTER, ctypes.c_void_p(bias_ptr)),
                        (LT_DESC_BIAS_DATA_TYPE, ctypes.c_int32(bias_dtype))):
            self._set(lib.cublasLtMatmulDescSetAttribute, desc, attr, v)
        la = self._layout(dtype, *((m, k) if opa == 0 else (k, m)), a_ld)
        lb = self._layout(dtype, *((k, n) if opb == 0 else (n, k)), b_ld)
        lc = self._layout(dtype, m, n, d_ld or m)
        pref = ctypes.c_void_p()
        Lib._check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        self.keep.append(pref)
        self._set(lib.cublasLtMatmulPreferenceSetAttribute, pref, LT_PREF_MAX_WORKSPACE_BYTES,
                  ctypes.c_uint64(WORKSPACE))
        res, count = _HeuristicResult(), ctypes.c_int(0)
        st = lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, la, lb, lc, lc, pref, 1, ctypes.byref(res),
                                                ctypes.byref(count))
        if st or count.value < 1 or res.state:
            return None
        self.keep.append(res)
        algo, ws, h = ctypes.byref(res.algo), ctypes.c_void_p(self.ws.ptr), self.handle

        def call(a, bm, d, alpha, beta, stream):
            Lib._check(lib.cublasLtMatmul(h, desc, alpha, a, la, bm, lb, beta, d, lc, d, lc, algo, ws, WORKSPACE,
                                          stream), "cublasLtMatmul")
        return call


@functools.lru_cache(maxsize=1)
def lt_library():
    """cuBLASLt beside the cuBLAS CuPy loaded, or None (ROCm, or no such library)."""
    if device.info().get("hip"):
        return None
    library()
    path = device.loaded_library("libcublasLt.so")
    return LtLib(path) if path else None
