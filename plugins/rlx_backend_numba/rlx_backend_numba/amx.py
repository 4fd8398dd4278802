"""Intel AMX tiles for numba kernels: bf16 matrix products with f32 sums.

Why: a prefill matmul over packed weights is bound by f32 BLAS (Gemma 3's 128-token prefill:
about 150 of its 200 ms in sgemm at ~85 GFLOP/s a core). A CPU with AMX (Sapphire Rapids and
later) multiplies 16x32 bf16 tiles in one instruction, an order of magnitude more products a
cycle. Two uses in the numba backend:
- f32 accuracy (the default): an f32 is exactly the sum of three bf16 parts (8 + 8 + 8
  significand bits), so x @ W^T is six tile products of parts (the other three fall below
  f32 rounding), every product exact and every sum f32 (quant_kernels' rows_f32);
- `[backend] matmul = "bf16"`: x and the decoded weight rows rounded to bf16, one product
  (logits move by about 1% of their range, as in a bf16 model).
Without AMX both keep f32 BLAS.

The intrinsics name tile registers by constants (tile numbers must be literal ints at the call
site) and take an array, an element offset and a row stride in bytes. Linux grants the tile
state to a process on request (arch_prctl); `available()` asks once. Kernels that use tiles
must only be compiled where `available()` is true: LLVM cannot emit them for another CPU.
"""
from __future__ import annotations

import ctypes
import functools
import math
import platform
import sys

import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .simd import call_intrinsic, element_ptr, load_f32, store_bf16_part, transpose8

_I8 = ir.IntType(8)
_VOID = ir.VoidType()
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18
_OPT = dict(cache=True, error_model="numpy")


def available() -> bool:
    """This process may run AMX-BF16 tiles (`missing`)."""
    return not missing()


@functools.lru_cache(maxsize=None)
def missing() -> str:
    """Why this process may not run AMX-BF16 tiles; '' where it may: an x86-64 Linux host whose
    CPU has them, numba compiling for that CPU, and the kernel granting the tile state."""
    import numba

    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return f"not an x86-64 Linux host ({sys.platform}, {platform.machine()})"
    features = llvm_binding.get_host_cpu_features().flatten().split(",")
    if not {"+amx-tile", "+amx-bf16"} <= set(features):
        return "this CPU has no AMX-BF16"
    if numba.config.CPU_NAME or numba.config.CPU_FEATURES:
        return "NUMBA_CPU_NAME / NUMBA_CPU_FEATURES make numba compile for another CPU"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        granted = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError) as e:
        return f"cannot ask the kernel for the tile state ({type(e).__name__}: {e})"
    return "" if granted else "the kernel refused the tile state (arch_prctl XCOMP_PERM)"


def tile_config() -> np.ndarray:
    """The 64-byte tile configuration of the kernels here: palette 1, tiles 0-7 each 16 rows
    of 64 bytes (C: 16x16 f32; A: 16x32 bf16; B: 16 pairs x 16 columns of bf16)."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    cfg[16:32].view(np.uint16)[:] = 64
    cfg[48:56] = 16
    return cfg


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte (cache-line) boundary. Tile rows
    are 64 bytes: a row that straddles two lines makes tileloadd about three times slower
    (measured: 44 against 15.5 cycles a product when every operand is loaded), and NumPy
    aligns only to 16 bytes."""
    dt = np.dtype(dtype)
    n = math.prod(shape) if isinstance(shape, tuple) else int(shape)
    raw = np.empty(n * dt.itemsize + 64, np.uint8)
    start = -raw.__array_interface__["data"][0] % 64          # (ndarray.ctypes costs ~3 us)
    return raw[start:start + n * dt.itemsize].view(dt).reshape(shape)


def _literal(t) -> ir.Constant:
    return ir.Constant(_I8, t.literal_value)


def _literals(*ts) -> bool:
    return all(isinstance(t, types.IntegerLiteral) for t in ts)


@intrinsic
def load_config(typingctx, cfg):
    """ldtilecfg from a uint8[64] array (once per thread before its tiles are used)."""
    def codegen(context, builder, sig, args):
        call_intrinsic(builder, "llvm.x86.ldtilecfg", _VOID,
                       element_ptr(context, builder, sig.args[0], args[0], ir.Constant(_I8, 0), types.int8, _I8))
        return context.get_dummy_value()
    return types.none(cfg), codegen


@intrinsic
def release(typingctx):
    """tilerelease: the thread's tile state back to its initial (unused) form."""
    def codegen(context, builder, sig, args):
        call_intrinsic(builder, "llvm.x86.tilerelease", _VOID)
        return context.get_dummy_value()
    return types.none(), codegen


@intrinsic
def zero(typingctx, t):
    """Tile t = 0."""
    if not _literals(t):
        return None

    def codegen(context, builder, sig, args):
        call_intrinsic(builder, "llvm.x86.tilezero", _VOID, _literal(sig.args[0]))
        return context.get_dummy_value()
    return types.none(t), codegen


def _move(name: str):
    @intrinsic
    def impl(typingctx, t, a, i, stride):
        if not _literals(t):
            return None

        def codegen(context, builder, sig, args):
            p = element_ptr(context, builder, sig.args[1], args[1], args[2], sig.args[2], _I8)
            call_intrinsic(builder, name, _VOID, _literal(sig.args[0]), p,
                           context.cast(builder, args[3], sig.args[3], types.int64))
            return context.get_dummy_value()
        return types.none(t, a, i, stride), codegen
    return impl


load = _move("llvm.x86.tileloadd64")        # tile t <- rows at a[i], `stride` bytes apart
store = _move("llvm.x86.tilestored64")      # rows at a[i], `stride` bytes apart <- tile t


@intrinsic
def dot_bf16(typingctx, c, a, b):
    """Tile c += tile a (16 x 32 bf16) @ tile b (16 pairs x 16 columns of bf16), f32 sums."""
    if not _literals(c, a, b):
        return None

    def codegen(context, builder, sig, args):
        call_intrinsic(builder, "llvm.x86.tdpbf16ps", _VOID, *[_literal(t) for t in sig.args])
        return context.get_dummy_value()
    return types.none(c, a, b), codegen


@njit(parallel=True, **_OPT)
def parts_of_rows(x, xt):
    """x (f32 [M, K], C-contiguous) as P bf16 parts (simd.store_bf16_part: P = 3, exactly x;
    P = 1, x rounded to bf16) in B tiles of dot_bf16: xt [Mp/32, K/32, P, 2, 16, 16] (float32
    words, only moved: two bf16 each), the tiles of 32 rows of x, then of one k-step, side by
    side; word [b, s, i, t, r, c] holds part i of x[32b + 16t + c, 32s + 2r] (low half) and of
    x[32b + 16t + c, 32s + 2r + 1]. Rows past M are 0."""
    m_, k = x.shape
    np_ = xt.shape[2]
    for b in prange(xt.shape[0]):
        h = np.empty((np_, 32, k), np.uint16)
        h[:, max(0, m_ - 32 * b):] = 0
        for mm in range(min(32, m_ - 32 * b)):
            xr = x[32 * b + mm]
            for j in range(0, k, 8):
                v = load_f32(xr, j)
                for i in range(np_):
                    v = store_bf16_part(h[i, mm], j, v)
        pairs = h.reshape(-1).view(np.float32)         # [P, 32, K/2] words: (2r, 2r + 1) in one
        tiles = xt[b].reshape(-1)
        for s in range(k // 32):
            for i in range(np_):
                for t in range(2):                     # the tile is a 16 x 16 block of words, transposed
                    src, dst = (32 * i + 16 * t) * (k // 2) + 16 * s, 512 * (np_ * s + i) + 256 * t
                    for r in range(0, 16, 8):
                        for c in range(0, 16, 8):
                            transpose8(pairs, src + (k // 2) * c + r, k // 2, tiles, dst + 16 * r + c, 16)


__all__ = ["aligned_empty", "available", "dot_bf16", "load", "load_config", "parts_of_rows", "release",
           "store", "tile_config", "zero"]
