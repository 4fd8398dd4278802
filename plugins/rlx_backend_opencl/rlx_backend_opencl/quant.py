"""Packed-weight kernels: dequant GEMV (decode), dequant GEMM (prefill) and dequantize, one
OpenCL C template over every `QuantScheme` kind, specialised by a per-kind decode snippet.

A snippet defines `dq_unit(b, u, w)`: the U consecutive elements of unit u of the block at
byte pointer `b` (block layouts: rlx_core/ir/quant.py), decoded in DT (float; double for
f64) with the same operation order as the numpy decoder. A unit is 32 elements (one K-quant
sub-block), or gcd(block, 32) for RLX's int blocks. Every kernel reads weights one unit at a
time, so each weight byte is read once and dequantized straight into local memory, where the
GEMV walks it with x read coalesced and the GEMM multiplies it as a tile.

One program per (scheme, dtypes) holds all three kernels; bias and activation are runtime
arguments, so a model compiles a handful of programs (PoCL spends about a second on each).
"""
from __future__ import annotations

import math

from rlx_core.ir.ops import ACTIVATIONS
from rlx_core.ir.quant import QuantScheme

from . import kernels as K

GEMV_ROWS = 8          # rows of x per GEMV work-group; larger M uses the tiled GEMM

_BYTES = r"""
inline float f16_at(__global const uchar* p) { return vload_half(0, (__global const half*)p); }
inline uint u32_at(__global const uchar* p) {
  return (uint)p[0] | ((uint)p[1] << 8) | ((uint)p[2] << 16) | ((uint)p[3] << 24);
}
inline float f32_at(__global const uchar* p) { return as_float(u32_at(p)); }
"""

_K_SCALES = r"""
inline void k_scale_min(__global const uchar* s, int j, int* sc, int* mn) {
  if (j < 4) { *sc = s[j] & 63; *mn = s[j + 4] & 63; }
  else { *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4); *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}
"""

_LEGACY = r"""
inline void dq_unit(__global const uchar* b, int u, DT* w) {
  DT d = (DT)f16_at(b);
  %(head)s
  #pragma unroll
  for (int l = 0; l < 16; ++l) {
    uint v = qs[l];
    w[l] = %(lo)s;
    w[l + 16] = %(hi)s;
  }
}
"""

# (head, element from the low nibble, element from the high nibble)
_LEGACY_KINDS = {
    "q4_0": ("__global const uchar* qs = b + 2;",
             "(DT)((int)(v & 15) - 8) * d", "(DT)((int)(v >> 4) - 8) * d"),
    "q4_1": ("DT m = (DT)f16_at(b + 2); __global const uchar* qs = b + 4;",
             "(DT)(v & 15) * d + m", "(DT)(v >> 4) * d + m"),
    "q5_0": ("uint qh = u32_at(b + 2); __global const uchar* qs = b + 6;",
             "(DT)((int)((v & 15) | (((qh >> l) & 1) << 4)) - 16) * d",
             "(DT)((int)((v >> 4) | (((qh >> (l + 16)) & 1) << 4)) - 16) * d"),
    "q5_1": ("DT m = (DT)f16_at(b + 2); uint qh = u32_at(b + 4); __global const uchar* qs = b + 8;",
             "(DT)((v & 15) | (((qh >> l) & 1) << 4)) * d + m",
             "(DT)((v >> 4) | (((qh >> (l + 16)) & 1) << 4)) * d + m"),
}

_SNIPPETS = {
    "q8_0": r"""
inline void dq_unit(__global const uchar* b, int u, DT* w) {
  DT d = (DT)f16_at(b);
  __global const char* q = (__global const char*)(b + 2);
  #pragma unroll
  for (int l = 0; l < 32; ++l) w[l] = (DT)q[l] * d;
}
""",
    "q4_k": _K_SCALES + r"""
inline void dq_unit(__global const uchar* b, int u, DT* w) {
  int sc, mn;
  k_scale_min(b + 4, u, &sc, &mn);
  DT ds = (DT)f16_at(b) * (DT)sc, dm = (DT)f16_at(b + 2) * (DT)mn;
  __global const uchar* q = b + 16 + 32 * (u >> 1);
  int sh = 4 * (u & 1);
  #pragma unroll
  for (int l = 0; l < 32; ++l) w[l] = ds * (DT)((q[l] >> sh) & 15) - dm;
}
""",
    "q5_k": _K_SCALES + r"""
inline void dq_unit(__global const uchar* b, int u, DT* w) {
  int sc, mn;
  k_scale_min(b + 4, u, &sc, &mn);
  DT ds = (DT)f16_at(b) * (DT)sc, dm = (DT)f16_at(b + 2) * (DT)mn;
  __global const uchar* qh = b + 16;
  __global const uchar* q = b + 48 + 32 * (u >> 1);
  int sh = 4 * (u & 1);
  #pragma unroll
  for (int l = 0; l < 32; ++l) w[l] = ds * (DT)(((q[l] >> sh) & 15) | (((qh[l] >> u) & 1) << 4)) - dm;
}
""",
    "q6_k": r"""
inline void dq_unit(__global const uchar* b, int u, DT* w) {
  int n = u >> 2, k = u & 3;
  __global const uchar* ql = b + 64 * n + 32 * (k & 1);
  __global const uchar* qh = b + 128 + 32 * n;
  __global const char* sc = (__global const char*)(b + 192) + 8 * n + 2 * k;
  int sl = 4 * (k >> 1), sh = 2 * k;
  DT d = (DT)f16_at(b + 208);
  DT d0 = d * (DT)sc[0], d1 = d * (DT)sc[1];
  #pragma unroll
  for (int l = 0; l < 32; ++l)
    w[l] = (l < 16 ? d0 : d1) * (DT)((int)(((ql[l] >> sl) & 15) | (((qh[l] >> sh) & 3) << 4)) - 32);
}
""",
    "int8": r"""
inline void dq_unit(__global const uchar* b, int u, DT* w) {
  DT d = (DT)f32_at(b);
  __global const char* q = (__global const char*)(b + 4) + u * U;
  #pragma unroll
  for (int l = 0; l < U; ++l) w[l] = (DT)q[l] * d;
}
""",
    "int4": r"""
inline void dq_unit(__global const uchar* b, int u, DT* w) {
  DT d = (DT)f32_at(b);
  #pragma unroll
  for (int l = 0; l < U; ++l) {
    int e = u * U + l;
    uint v = b[4 + e % (QK / 2)];
    w[l] = (DT)((int)(e < QK / 2 ? (v & 15) : (v >> 4)) - 8) * d;
  }
}
""",
}
_SNIPPETS.update({k: _LEGACY % {"head": h, "lo": lo, "hi": hi} for k, (h, lo, hi) in _LEGACY_KINDS.items()})

KINDS = frozenset(_SNIPPETS)        # QuantScheme kinds with a kernel here

# x: [M, K] contiguous; w: N rows of RB bytes; y: [M, N] contiguous. The epilogue rounds to
# T_Y, adds the bias (rounded again) and applies activation `act` (index into ACTIVATIONS),
# as fused_matmul_bias_act does.
_TEMPLATE = r"""
#define UPB (QK / U)
inline DT epi(DT v, int n, __global const T_BIAS* bias, int bias_off, int bias_st, int has_bias, int act) {
  v = (DT)TO_Y(v);
  if (has_bias) v = (DT)TO_Y(v + (DT)LOAD(T_BIAS, bias, bias_off + n * bias_st));
  return act_fn(act, v);
}
#define DQ_ARGS __global const T_X* x, int x_off, __global const uchar* w, int w_off, __global T_Y* y, int y_off, \
  __global const T_BIAS* bias, int bias_off, int bias_st, int M, int N, int K, int has_bias, int act

// One work-group per output column n: each work-item decodes one unit of 64 consecutive ones
// into local memory, then all of them walk those 64*U elements with x read coalesced.
__kernel __attribute__((reqd_work_group_size(64, 1, 1)))
void dq_gemv(DQ_ARGS) {
  __local DT Ws[64][U + 1];
  __local DT sh[MR][64];
  int lid = get_local_id(0), n = get_group_id(0), m0 = get_group_id(1) * MR;
  int mr = min(MR, M - m0), nu = K / U;
  __global const uchar* wr = w + w_off + n * ((K / QK) * BPB);
  int xo = x_off + m0 * K;
  DT acc[MR];
#pragma unroll
  for (int r = 0; r < MR; ++r) acc[r] = 0;
  for (int c0 = 0; c0 < nu; c0 += 64) {
    int t = c0 + lid;
    DT wv[U];
    if (t < nu) dq_unit(wr + (t / UPB) * BPB, t % UPB, wv);
    #pragma unroll
    for (int l = 0; l < U; ++l) Ws[lid][l] = t < nu ? wv[l] : (DT)0;
    barrier(CLK_LOCAL_MEM_FENCE);
    int kb = c0 * U, ke = min(K - kb, 64 * U);
    for (int e = lid; e < ke; e += 64) {
      DT wk = Ws[e / U][e % U];
#pragma unroll
      for (int r = 0; r < MR; ++r) if (r < mr) acc[r] += wk * (DT)LOAD(T_X, x, xo + r * K + kb + e);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
#pragma unroll
  for (int r = 0; r < MR; ++r) sh[r][lid] = acc[r];
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int h = 32; h > 0; h >>= 1) {
    if (lid < h) for (int r = 0; r < mr; ++r) sh[r][lid] += sh[r][lid + h];
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (lid < mr) STORE(T_Y, y, y_off + (m0 + lid) * N + n, TO_Y(epi(sh[lid][0], n, bias, bias_off, bias_st, has_bias, act)));
}

// 64x64 output tile per 16x16 work-group (4x4 per work-item); each K step is one unit: 64
// work-items decode the tile's 64 weight rows into local memory, all multiply.
__kernel __attribute__((reqd_work_group_size(16, 16, 1)))
void dq_gemm(DQ_ARGS) {
  __local DT Xs[U][65];
  __local DT Ws[U][65];
  int tx = get_local_id(0), ty = get_local_id(1), tid = ty * 16 + tx;
  int m0 = get_group_id(1) * 64, n0 = get_group_id(0) * 64, nu = K / U, rb = (K / QK) * BPB;
  DT acc[4][4];
  for (int i = 0; i < 4; ++i) for (int j = 0; j < 4; ++j) acc[i][j] = 0;
  for (int t = 0; t < nu; ++t) {
    for (int i = tid; i < 64 * U; i += 256) {
      int mm = i / U, kk = i % U, gm = m0 + mm;
      Xs[kk][mm] = gm < M ? (DT)LOAD(T_X, x, x_off + gm * K + t * U + kk) : (DT)0;
    }
    if (tid < 64) {
      DT wv[U];
      int gn = n0 + tid;
      if (gn < N) dq_unit(w + w_off + gn * rb + (t / UPB) * BPB, t % UPB, wv);
      else for (int l = 0; l < U; ++l) wv[l] = 0;
      #pragma unroll
      for (int l = 0; l < U; ++l) Ws[l][tid] = wv[l];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int kk = 0; kk < U; ++kk) {
      DT a[4], bb[4];
      for (int r = 0; r < 4; ++r) { a[r] = Xs[kk][ty + 16 * r]; bb[r] = Ws[kk][tx + 16 * r]; }
      for (int r = 0; r < 4; ++r) for (int c = 0; c < 4; ++c) acc[r][c] += a[r] * bb[c];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  for (int r = 0; r < 4; ++r) for (int c = 0; c < 4; ++c) {
    int gm = m0 + ty + 16 * r, gn = n0 + tx + 16 * c;
    if (gm < M && gn < N) STORE(T_Y, y, y_off + gm * N + gn, TO_Y(epi(acc[r][c], gn, bias, bias_off, bias_st, has_bias, act)));
  }
}

// rows x RB bytes -> rows x K values, one work-item per unit
__kernel void dq_rows(__global const uchar* w, int w_off, __global T_Y* y, int y_off, int units, int K) {
  int g = get_global_id(0);
  if (g >= units) return;
  int nu = K / U, row = g / nu, t = g % nu;
  DT wv[U];
  dq_unit(w + w_off + row * ((K / QK) * BPB) + (t / UPB) * BPB, t % UPB, wv);
  #pragma unroll
  for (int l = 0; l < U; ++l) STORE(T_Y, y, y_off + row * K + t * U + l, TO_Y(wv[l]));
}
"""


def unit(scheme: QuantScheme) -> int:
    return math.gcd(scheme.block_size, 32)


def _act_fn(dt: str) -> str:
    cases = " ".join(f"case {i}: return {K.act_expr(a, 'v', dt)};" for i, a in enumerate(ACTIVATIONS))
    return f"inline {dt} act_fn(int a, {dt} v) {{ switch (a) {{ {cases} }} return v; }}\n"


def source(scheme: QuantScheme, x_dt, y_dt, bias_dt) -> str:
    """The program (dq_gemv, dq_gemm, dq_rows) for one scheme and dtype signature."""
    dt = K.acc_type(x_dt, y_dt)
    defs = dict(QK=scheme.block_size, BPB=scheme.bytes_per_block, U=unit(scheme), MR=GEMV_ROWS, DT=dt,
                T_X=K.ctype(x_dt), T_Y=K.ctype(y_dt), T_BIAS=K.ctype(bias_dt))
    head = K.prelude([x_dt, y_dt, bias_dt, dt]) + "".join(f"#define {k} {v}\n" for k, v in defs.items())
    head += f"#define TO_Y(v) {K.to(y_dt, 'v')}\n"
    return head + _BYTES + _act_fn(dt) + _SNIPPETS[scheme.kind] + _TEMPLATE


__all__ = ["GEMV_ROWS", "KINDS", "source", "unit"]
