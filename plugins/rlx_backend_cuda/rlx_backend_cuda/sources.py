"""CUDA C++ sources of the backend's kernels, as templates.

Every kernel is plain CUDA C++ compiled by NVRTC through `cupy.RawModule` (once per
specialization, cached). `$NAME` placeholders are filled by `render()` with C types
(`$T`, `$TO`, ...), the accumulation type `$ACC` (float, or double for f64 data) and
compile-time constants. bf16 data lives in 16-bit buffers and is read and written as
`__nv_bfloat16`; f16 as `__half`; both compute in f32.

HIP: the prelude maps the CUDA spellings to HIP's (`hip_fp16.h`, `hip_bf16.h`, lane
shuffles without masks). Warp-level code uses logical 32-lane groups and xor masks < 32,
so it also holds on 64-wide wavefronts. The tensor-core attention kernel uses inline PTX
(`mma.sync`) and is compiled only for CUDA (the runner never picks it on ROCm).
"""
from __future__ import annotations

import re
import string

PRELUDE = r"""
#if defined(__HIPCC_RTC__) || defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_fp16.h>
#include <hip/hip_bf16.h>
typedef __hip_bfloat16 __nv_bfloat16;
#define RLX_HIP 1
#define SHFL_XOR(v, m) __shfl_xor((v), (m))
#define LDCG(p) (*(volatile const decltype(+*(p))*)(p))
#define __syncwarp() __builtin_amdgcn_wave_barrier()
#else
#define LDCG(p) __ldcg(p)
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#define SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#endif
typedef long long i64;
typedef unsigned int u32;
// A kernel launched as a programmatic dependent (device.Kernel) waits here for the kernel
// before it, then lets the kernel after it start its blocks; a no-op launched otherwise.
#if !defined(RLX_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define RLX_GRID_WAIT() asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define RLX_GRID_WAIT()
#endif
#define RLX_INF __int_as_float(0x7f800000)
// V consecutive values moved as one aligned vector (16-byte loads and stores where V * size
// allows): the vectorized elementwise kernels
template <typename T, int V> struct __align__(sizeof(T) * V) rlx_vec { T v[V]; };
// complex64 as numpy lays it out (real, imaginary floats); + - * / as numpy computes them
// (division by Smith's method), a cast to a real type keeps the real part
struct __align__(8) rlx_c64 {
  float re, im;
  __device__ __forceinline__ rlx_c64() {}
  __device__ __forceinline__ rlx_c64(float r, float i = 0.f) : re(r), im(i) {}
  __device__ __forceinline__ explicit operator float() const { return re; }
  __device__ __forceinline__ explicit operator double() const { return re; }
};
__device__ __forceinline__ rlx_c64 operator-(rlx_c64 a) { return rlx_c64(-a.re, -a.im); }
__device__ __forceinline__ rlx_c64 operator+(rlx_c64 a, rlx_c64 b) { return rlx_c64(a.re + b.re, a.im + b.im); }
__device__ __forceinline__ rlx_c64 operator-(rlx_c64 a, rlx_c64 b) { return rlx_c64(a.re - b.re, a.im - b.im); }
__device__ __forceinline__ rlx_c64 operator*(rlx_c64 a, rlx_c64 b) {
  return rlx_c64(a.re * b.re - a.im * b.im, a.re * b.im + a.im * b.re);
}
__device__ __forceinline__ rlx_c64 operator/(rlx_c64 a, rlx_c64 b) {
  if (fabsf(b.re) >= fabsf(b.im)) {
    const float r = b.im / b.re, d = b.re + b.im * r;
    return rlx_c64((a.re + a.im * r) / d, (a.im - a.re * r) / d);
  }
  const float r = b.re / b.im, d = b.im + b.re * r;
  return rlx_c64((a.re * r + a.im) / d, (a.im * r - a.re) / d);
}

// load any storage type as float / double
__device__ __forceinline__ float tof(float v) { return v; }
__device__ __forceinline__ float tof(double v) { return (float)v; }
__device__ __forceinline__ float tof(__half v) { return __half2float(v); }
__device__ __forceinline__ float tof(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float tof(bool v) { return v ? 1.0f : 0.0f; }
__device__ __forceinline__ float tof(signed char v) { return (float)v; }
__device__ __forceinline__ float tof(unsigned char v) { return (float)v; }
__device__ __forceinline__ float tof(short v) { return (float)v; }
__device__ __forceinline__ float tof(int v) { return (float)v; }
__device__ __forceinline__ float tof(unsigned int v) { return (float)v; }
__device__ __forceinline__ float tof(long long v) { return (float)v; }
__device__ __forceinline__ double tod(double v) { return v; }
__device__ __forceinline__ double tod(float v) { return (double)v; }
__device__ __forceinline__ double tod(__half v) { return (double)__half2float(v); }
__device__ __forceinline__ double tod(__nv_bfloat16 v) { return (double)__bfloat162float(v); }
__device__ __forceinline__ double tod(bool v) { return v ? 1.0 : 0.0; }
__device__ __forceinline__ double tod(signed char v) { return (double)v; }
__device__ __forceinline__ double tod(unsigned char v) { return (double)v; }
__device__ __forceinline__ double tod(short v) { return (double)v; }
__device__ __forceinline__ double tod(int v) { return (double)v; }
__device__ __forceinline__ double tod(unsigned int v) { return (double)v; }
__device__ __forceinline__ double tod(long long v) { return (double)v; }
template <typename A> struct Ld;
template <> struct Ld<float> { template <typename T> __device__ static float f(T v) { return tof(v); } };
template <> struct Ld<double> { template <typename T> __device__ static double f(T v) { return tod(v); } };
#define LD(ACCT, v) Ld<ACCT>::f(v)

// store float / double / int as any storage type (round to nearest even)
template <typename T> struct St {
  __device__ static T f(float v) { return (T)v; }
  __device__ static T f(double v) { return (T)v; }
};
template <> struct St<__half> {
  __device__ static __half f(float v) { return __float2half_rn(v); }
  __device__ static __half f(double v) { return __double2half(v); }
};
template <> struct St<__nv_bfloat16> {
  __device__ static __nv_bfloat16 f(float v) { return __float2bfloat16_rn(v); }
  __device__ static __nv_bfloat16 f(double v) { return __double2bfloat16(v); }
};
template <> struct St<bool> {
  __device__ static bool f(float v) { return v != 0.0f; }
  __device__ static bool f(double v) { return v != 0.0; }
};
#define ST(T, v) St<T>::f(v)

// round a value through a 16-bit type (intermediates of fused elementwise programs)
__device__ __forceinline__ float rbf(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
__device__ __forceinline__ float rbf(double v) { return __bfloat162float(__double2bfloat16(v)); }
__device__ __forceinline__ float rhf(float v) { return __half2float(__float2half_rn(v)); }
__device__ __forceinline__ float rhf(double v) { return __half2float(__double2half(v)); }

__device__ __forceinline__ float rlx_max(float a, float b) { return (a != a) ? a : ((b != b) ? b : (a > b ? a : b)); }
__device__ __forceinline__ double rlx_max(double a, double b) { return (a != a) ? a : ((b != b) ? b : (a > b ? a : b)); }
__device__ __forceinline__ float rlx_min(float a, float b) { return (a != a) ? a : ((b != b) ? b : (a < b ? a : b)); }
__device__ __forceinline__ double rlx_min(double a, double b) { return (a != a) ? a : ((b != b) ? b : (a < b ? a : b)); }
template <typename I> __device__ __forceinline__ I rlx_maxi(I a, I b) { return a > b ? a : b; }
template <typename I> __device__ __forceinline__ I rlx_mini(I a, I b) { return a < b ? a : b; }
template <typename I> __device__ __forceinline__ I rlx_floordiv(I a, I b) {
  if (b == 0) return (I)0;
  I q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) q -= 1;
  return q;
}
template <typename I> __device__ __forceinline__ I rlx_ipow(I a, I b) {
  if (b < 0) return (I)0;
  I r = 1;
  while (b) { if (b & 1) r *= a; a *= a; b >>= 1; }
  return r;
}
__device__ __forceinline__ float rlx_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ double rlx_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

// error flag: first error wins; [code, node, value, limit]
__device__ __forceinline__ void rlx_error(int* err, int code, int node, long long value, long long limit) {
  if (atomicCAS(err, 0, code) == 0) { err[1] = node; err[2] = (int)value; err[3] = (int)limit; }
}

// split work: whether this block is the last of n to arrive at counter *c (and then resets
// it for the next launch); one thread calls it after the block's partial results are stored
__device__ __forceinline__ bool rlx_last_arrival(int* c, int n) {
  __threadfence();
  const bool last = atomicAdd(c, 1) == n - 1;
  if (last) *c = 0;
  return last;
}

template <typename A> __device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += SHFL_XOR(v, m);
  return v;
}
template <typename A> __device__ __forceinline__ A warp_max(A v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) { A o = SHFL_XOR(v, m); v = (o > v || o != o) ? o : v; }  // NaN wins
  return v;
}
// block-wide sum / max (blockDim.x a multiple of 32, <= 1024); all threads get the result
template <typename A> __device__ A block_sum(A v) {
  __shared__ A sh[32];
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) sh[w] = v;
  __syncthreads();
  A t = lane < nw ? sh[lane] : (A)0;
  return warp_sum(t);
}
template <typename A> __device__ A block_max(A v, A lowest) {
  __shared__ A shm[32];
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shm[w] = v;
  __syncthreads();
  A t = lane < nw ? shm[lane] : lowest;
  return warp_max(t);
}
"""


def render(template: str, **subs) -> str:
    """Fill `$NAME` placeholders; a missing one is a KeyError naming it."""
    return PRELUDE + string.Template(template).substitute(**{k: str(v) for k, v in subs.items()})


def own_arch(source: str) -> str | None:
    """The target a kernel needs beyond the device's own: sm_90a for Hopper's wgmma (which the
    plain sm_90 target rejects), else None."""
    return "sm_90a" if "wgmma." in source else None


def with_grid_wait(source: str, name: str) -> str:
    """`source` with kernel `name` starting at RLX_GRID_WAIT() (see device.Kernel; on the line of its
    brace, so compile errors keep their line numbers), unless the kernel places it itself
    (after loads of what no earlier kernel writes) or the source lacks the prelude."""
    head = re.search(r'extern "C" __global__ void[^{;]*\b' + re.escape(name) + r"\s*\([^{;]*\)\s*\{", source)
    if head is None or "RLX_GRID_WAIT" in source[head.end():] or "#define RLX_GRID_WAIT" not in source:
        return source
    return source[:head.end()] + " RLX_GRID_WAIT();" + source[head.end():]


# --------------------------------------------------------------------------- rows
# Row kernels work on contiguous rows: input rows of length n with row stride `rs`
# (elements, last axis unit-stride), outputs contiguous [rows, n]. One block per row.

# Norm rows of 16-bit data in vectors of VEC values (4 to 16 bytes), NV vectors a thread,
# held in registers: vals[k * VEC + j] is the row's value (tid + k * nt) * VEC + j, 0 past the
# row's end; with a residual row r, h = x + r is stored on the way (the fused variants).
NORM_VEC = r"""
template <int NV, int VEC, bool HAS_R, typename ACC, typename TX, typename TR, typename TH>
__device__ __forceinline__ void rlx_norm_row_vec(ACC* vals, const TX* xr, const TR* rr, TH* hr, int n, int tid,
                                                 int nt) {
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int e0 = (tid + k * nt) * VEC;
    if (e0 >= n) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) vals[k * VEC + j] = (ACC)0;
      continue;
    }
    const rlx_vec<TX, VEC> xv = *(const rlx_vec<TX, VEC>*)(xr + e0);
    if (HAS_R) {
      const rlx_vec<TR, VEC> rv = *(const rlx_vec<TR, VEC>*)(rr + e0);
      rlx_vec<TH, VEC> hv;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        vals[k * VEC + j] = LD(ACC, xv.v[j]) + LD(ACC, rv.v[j]);
        hv.v[j] = ST(TH, vals[k * VEC + j]);
      }
      *(rlx_vec<TH, VEC>*)(hr + e0) = hv;
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) vals[k * VEC + j] = LD(ACC, xv.v[j]);
    }
  }
}
// this thread's share of a row's sum (SQ: of squares) from the values rlx_norm_row_vec loaded
template <int NV, int VEC, bool SQ, typename ACC>
__device__ __forceinline__ ACC rlx_norm_row_sum(const ACC* vals, int n, int tid, int nt) {
  ACC s = 0;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    if ((tid + k * nt) * VEC >= n) continue;
#pragma unroll
    for (int j = 0; j < VEC; ++j) s += SQ ? vals[k * VEC + j] * vals[k * VEC + j] : vals[k * VEC + j];
  }
  return s;
}
"""

# VPT > 0: a row fits in VPT values per thread, kept in registers between the sum of squares
# and the scaling (one pass over memory: a decode step's norms are latency-bound); 0: two passes.
RMS_NORM = NORM_VEC + r"""
extern "C" __global__ void rlx_rms_norm(const $TX* __restrict__ x, long long xrs,
    const $TR* __restrict__ r, long long rrs, const $TW* __restrict__ w,
    $TH* __restrict__ h, $TO* __restrict__ y, int n, double eps_d, double off_d, long long rows) {
  // HAS_R: y = rms_norm(x + r) and h = x + r (fused_residual_rms_norm); else y = rms_norm(x).
  // WARP: $LANES lanes of a warp per row (short rows: FLUX's q/k norms over 128 values, 110k
  // rows, 16 lanes of one 16-byte load each), else a block
  typedef $ACC ACC;
#if $WARP
  const i64 grp = (i64)blockIdx.x * (blockDim.x / $LANES) + threadIdx.x / $LANES;
  if ($LANES == 32 && grp >= rows) return;
  const i64 row = grp < rows ? grp : rows - 1;    // (a group past the end redoes the last row: same bytes)
  const int tid = threadIdx.x % $LANES, nt = $LANES;
#else
  const i64 row = blockIdx.x;
  const int tid = threadIdx.x, nt = blockDim.x;
#endif
  const $TX* xr = x + row * xrs;
  $TO* yr = y + row * (i64)n;
#if $HAS_R
  const $TR* rr = r + row * rrs;
  $TH* hr = h + row * (i64)n;
#define RLX_VAL(i) (LD(ACC, xr[i]) + LD(ACC, rr[i]))
#else
#define RLX_VAL(i) LD(ACC, xr[i])
#endif
#if $VEC > 1
  // rows in vectors (rlx_norm_row_vec; FLUX's q/k norms over 128 values: a lane's 4 values
  // in one load, not 4)
  constexpr int NV = $VPT / $VEC;
  ACC vals[$VPT];
#if $HAS_R
  rlx_norm_row_vec<NV, $VEC, true, ACC>(vals, xr, rr, hr, n, tid, nt);
#else
  rlx_norm_row_vec<NV, $VEC, false, ACC>(vals, xr, xr, yr, n, tid, nt);
#endif
  ACC ss = rlx_norm_row_sum<NV, $VEC, true>(vals, n, tid, nt);
#if $WARP
#pragma unroll
  for (int m = $LANES / 2; m > 0; m >>= 1) ss += SHFL_XOR(ss, m);
#else
  ss = block_sum(ss);
#endif
  const ACC den = sqrt(ss / (ACC)n + (ACC)eps_d);
  const ACC off = (ACC)off_d;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int e0 = (tid + k * nt) * $VEC;
    if (e0 >= n) continue;
    rlx_vec<$TO, $VEC> yv;
#pragma unroll
    for (int j = 0; j < $VEC; ++j) {
      ACC v = vals[k * $VEC + j] / den;
#if $HAS_W
      v = v * (LD(ACC, w[e0 + j]) + off);
#endif
      yv.v[j] = ST($TO, v);
    }
    *(rlx_vec<$TO, $VEC>*)(yr + e0) = yv;
  }
#else
  ACC ss = 0;
#if $VPT
  ACC vals[$VPT];
#pragma unroll
  for (int k = 0; k < $VPT; ++k) {
    const int i = tid + k * nt;
    vals[k] = i < n ? RLX_VAL(i) : (ACC)0;
  }
#endif
#if $VPT
#pragma unroll
  for (int k = 0; k < $VPT; ++k) {
    const int i = tid + k * nt;
    const ACC v = vals[k];
#else
  for (int i = tid; i < n; i += nt) {
    const ACC v = RLX_VAL(i);
#endif
#if $HAS_R
    if (i < n) hr[i] = ST($TH, v);
#endif
    ss += v * v;
  }
#if $WARP
#pragma unroll
  for (int m = $LANES / 2; m > 0; m >>= 1) ss += SHFL_XOR(ss, m);
#else
  ss = block_sum(ss);
#endif
  const ACC den = sqrt(ss / (ACC)n + (ACC)eps_d);
  const ACC off = (ACC)off_d;
#if $VPT
#pragma unroll
  for (int k = 0; k < $VPT; ++k) {
    const int i = tid + k * nt;
    if (i >= n) break;
    ACC v = vals[k] / den;
#else
  for (int i = tid; i < n; i += nt) {
    ACC v = RLX_VAL(i) / den;
#endif
#if $HAS_W
    v = v * (LD(ACC, w[i]) + off);
#endif
    yr[i] = ST($TO, v);
  }
#endif
#undef RLX_VAL
}
"""

LAYER_NORM = NORM_VEC + r"""
extern "C" __global__ void rlx_layer_norm(const $TX* __restrict__ x, long long xrs,
    const $TR* __restrict__ r, long long rrs, const $TG* __restrict__ g, const $TB* __restrict__ b,
    $TH* __restrict__ h, $TO* __restrict__ y, int n, double eps_d) {
  // HAS_R: y = layer_norm(x + r) and h = x + r (fused_residual_ln); else y = layer_norm(x).
  // VPT: the row is read once into registers (VPT values a thread), else once per pass
  typedef $ACC ACC;
  const i64 row = blockIdx.x;
  const int tid = threadIdx.x, nt = blockDim.x;
  const $TX* xr = x + row * xrs;
  $TO* yr = y + row * (i64)n;
#if $HAS_R
  const $TR* rr = r + row * rrs;
  $TH* hr = h + row * (i64)n;
#define RLX_VAL(i) (LD(ACC, xr[i]) + LD(ACC, rr[i]))
#else
#define RLX_VAL(i) LD(ACC, xr[i])
#endif
#if $VEC > 1
  // rows in vectors (rlx_norm_row_vec; FLUX's residual + LayerNorm over 3072 values moved 2
  // bytes a load before)
  constexpr int NV = $VPT / $VEC;
  ACC vals[$VPT];
#if $HAS_R
  rlx_norm_row_vec<NV, $VEC, true, ACC>(vals, xr, rr, hr, n, tid, nt);
#else
  rlx_norm_row_vec<NV, $VEC, false, ACC>(vals, xr, xr, yr, n, tid, nt);
#endif
  ACC s = rlx_norm_row_sum<NV, $VEC, false>(vals, n, tid, nt);
  const ACC mean = block_sum(s) / (ACC)n;
  ACC q = 0;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    if ((tid + k * nt) * $VEC >= n) continue;
#pragma unroll
    for (int j = 0; j < $VEC; ++j) { const ACC d = vals[k * $VEC + j] - mean; q += d * d; }
  }
  const ACC den = sqrt(block_sum(q) / (ACC)n + (ACC)eps_d);
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int e0 = (tid + k * nt) * $VEC;
    if (e0 >= n) continue;
    rlx_vec<$TO, $VEC> yv;
#pragma unroll
    for (int j = 0; j < $VEC; ++j) {
      ACC v = (vals[k * $VEC + j] - mean) / den;
#if $HAS_G
      v = v * LD(ACC, g[e0 + j]);
#endif
#if $HAS_B
      v = v + LD(ACC, b[e0 + j]);
#endif
      yv.v[j] = ST($TO, v);
    }
    *(rlx_vec<$TO, $VEC>*)(yr + e0) = yv;
  }
#else
#if $VPT
  ACC vals[$VPT];
#define RLX_EACH for (int k = 0, i = tid; k < $VPT && i < n; ++k, i += nt)
#define RLX_GET(i) vals[k]
#pragma unroll
  for (int k = 0; k < $VPT; ++k) {
    const int i = tid + k * nt;
    vals[k] = i < n ? RLX_VAL(i) : (ACC)0;
  }
#else
#define RLX_EACH for (int i = tid; i < n; i += nt)
#define RLX_GET(i) RLX_VAL(i)
#endif
  ACC s = 0;
#pragma unroll
  RLX_EACH {
    const ACC v = RLX_GET(i);
#if $HAS_R
    hr[i] = ST($TH, v);
#endif
    s += v;
  }
  const ACC mean = block_sum(s) / (ACC)n;
  ACC q = 0;
#pragma unroll
  RLX_EACH { const ACC d = RLX_GET(i) - mean; q += d * d; }
  const ACC den = sqrt(block_sum(q) / (ACC)n + (ACC)eps_d);
#pragma unroll
  RLX_EACH {
    ACC v = (RLX_GET(i) - mean) / den;
#if $HAS_G
    v = v * LD(ACC, g[i]);
#endif
#if $HAS_B
    v = v + LD(ACC, b[i]);
#endif
    yr[i] = ST($TO, v);
  }
#undef RLX_EACH
#undef RLX_GET
#endif
#undef RLX_VAL
}
"""

SOFTMAX = r"""
extern "C" __global__ void rlx_softmax(const $TX* __restrict__ x, long long rs, $TO* __restrict__ y, int n) {
  typedef $ACC ACC;
  const i64 row = blockIdx.x;
  const $TX* xr = x + row * rs;
  $TO* yr = y + row * (i64)n;
  ACC m = -(ACC)RLX_INF;
  for (int i = threadIdx.x; i < n; i += blockDim.x) { ACC v = LD(ACC, xr[i]); m = rlx_max(m, v); }
  m = block_max(m, -(ACC)RLX_INF);
  if (!(m > -(ACC)RLX_INF && m < (ACC)RLX_INF)) m = 0;
  ACC s = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += exp(LD(ACC, xr[i]) - m);
  s = block_sum(s);
  if (s == 0) s = 1;
  for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = ST($TO, exp(LD(ACC, xr[i]) - m) / s);
}
"""

# The backward of a softmax row: dx = y * (g - sum(g * y)); y, g, dx contiguous [rows, n].
SOFTMAX_GRAD = r"""
extern "C" __global__ void rlx_softmax_grad(const $TY* __restrict__ y, const $TG* __restrict__ g,
                                            $TO* __restrict__ dx, int n) {
  typedef $ACC ACC;
  const i64 row = blockIdx.x;
  const $TY* yr = y + row * (i64)n;
  const $TG* gr = g + row * (i64)n;
  $TO* o = dx + row * (i64)n;
  ACC s = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += LD(ACC, yr[i]) * LD(ACC, gr[i]);
  s = block_sum(s);
  for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = ST($TO, LD(ACC, yr[i]) * (LD(ACC, gr[i]) - s));
}
"""

# The backward of an rms_norm (CENTER 0) or layer_norm (CENTER 1) row, n = (x - mean?) * inv
# scaled by w (+ offset): dx = inv * (dn - mean(dn)? - n * mean(dn * n)) with dn = g * (w +
# offset); pw[row] = g * n, which a column sum over the rows turns into the weight's gradient.
NORM_GRAD = r"""
extern "C" __global__ void rlx_norm_grad(const $TX* __restrict__ x, const $TW* __restrict__ w,
    const $TG* __restrict__ g, $TO* __restrict__ dx, $ACC* __restrict__ pw, int n, double eps_d, double off_d) {
  typedef $ACC ACC;
  const i64 row = blockIdx.x;
  const $TX* xr = x + row * (i64)n;
  const $TG* gr = g + row * (i64)n;
  $TO* o = dx + row * (i64)n;
  ACC* p = pw + row * (i64)n;
  const ACC off = (ACC)off_d;
  ACC mu = 0;
#if $CENTER
  ACC s = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += LD(ACC, xr[i]);
  mu = block_sum(s) / (ACC)n;
#endif
  ACC q = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) { const ACC d = LD(ACC, xr[i]) - mu; q += d * d; }
  const ACC inv = (ACC)1 / sqrt(block_sum(q) / (ACC)n + (ACC)eps_d);
  ACC a = 0, c = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const ACC dn = LD(ACC, gr[i]) * (LD(ACC, w[i]) + off);
    a += dn;
    c += dn * (LD(ACC, xr[i]) - mu) * inv;
  }
  c = block_sum(c) / (ACC)n;
#if $CENTER
  a = block_sum(a) / (ACC)n;
#else
  a = 0;
#endif
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const ACC gv = LD(ACC, gr[i]);
    const ACC nv = (LD(ACC, xr[i]) - mu) * inv;
    o[i] = ST($TO, inv * (gv * (LD(ACC, w[i]) + off) - a - nv * c));
    p[i] = gv * nv;
  }
}
"""

# A row per blockIdx.x. Few long rows (decode's sums over a 128k-entry vocabulary row: one
# block took 28 us) are cut into gridDim.y chunks: a block per chunk writes its partial, and
# the last block of the row to finish (`counters` start at 0 and it resets its own) combines
# the partials in chunk order, lanes first, then a fixed shuffle tree: the same result on
# every run. With one chunk (chunk = n) part and counters are not used.
REDUCE = r"""
#define RLX_LOAD(v) ($LOAD)
#define RLX_COMB(a, b) ($COMB)
extern "C" __global__ void rlx_reduce(const $TX* __restrict__ x, long long rs, $TO* __restrict__ y, int n,
                                      int chunk, $ACC* __restrict__ part, int* __restrict__ counters) {
  typedef $ACC ACC;
  const i64 row = blockIdx.x;
  const int ns = gridDim.y, beg = blockIdx.y * chunk, end = min(n, beg + chunk);
  const $TX* xr = x + row * rs;
  __shared__ ACC sh[1024];
  __shared__ int last;
  ACC a = $IDENT;
#pragma unroll 4
  for (int i = beg + threadIdx.x; i < end; i += blockDim.x) { ACC v = RLX_LOAD(xr[i]); a = RLX_COMB(a, v); }
  sh[threadIdx.x] = a;
  __syncthreads();
  for (int st = blockDim.x / 2; st > 0; st >>= 1) {
    if (threadIdx.x < st) sh[threadIdx.x] = RLX_COMB(sh[threadIdx.x], sh[threadIdx.x + st]);
    __syncthreads();
  }
  if (ns == 1) {
    if (threadIdx.x == 0) { ACC r = sh[0]; y[row] = $FINAL; }
    return;
  }
  if (threadIdx.x == 0) {
    part[row * ns + blockIdx.y] = sh[0];
    last = rlx_last_arrival(counters + row, ns);
  }
  __syncthreads();
  if (!last || threadIdx.x >= 32) return;
  __threadfence();
  a = $IDENT;
  for (int k = threadIdx.x; k < ns; k += 32) a = RLX_COMB(a, LDCG(part + row * ns + k));
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) { ACC o = SHFL_XOR(a, m); a = threadIdx.x & m ? RLX_COMB(o, a) : RLX_COMB(a, o); }
  if (threadIdx.x == 0) { ACC r = a; y[row] = $FINAL; }
}
"""

# y[o, i] = COMB over r of x[o, r, i], x contiguous as [O, n, I] with I > 1 or n small: one
# thread per output, threadIdx.x along i so a warp's loads are coalesced; with blockDim.y > 1
# (then blockDim.x == 32) the threads of a column split r and meet in shared memory.
REDUCE_COLS = r"""
#define RLX_LOAD(v) ($LOAD)
#define RLX_COMB(a, b) ($COMB)
extern "C" __global__ void rlx_reduce_cols(const $TX* __restrict__ x, $TO* __restrict__ y, long long O, int n,
                                           long long I) {
  typedef $ACC ACC;
  __shared__ ACC sh[32 * 33];
  const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const bool live = j < O * I;
  ACC a = $IDENT;
  if (live) {
    const long long o = j / I;
    const $TX* xc = x + o * (long long)n * I + (j - o * I);
#pragma unroll 4
    for (int k = threadIdx.y; k < n; k += blockDim.y) { ACC v = RLX_LOAD(xc[(long long)k * I]); a = RLX_COMB(a, v); }
  }
  if (blockDim.y > 1) {
    sh[threadIdx.y * 33 + threadIdx.x] = a;
    __syncthreads();
    for (int st = blockDim.y / 2; st > 0; st >>= 1) {
      if (threadIdx.y < st)
        sh[threadIdx.y * 33 + threadIdx.x] = RLX_COMB(sh[threadIdx.y * 33 + threadIdx.x],
                                                      sh[(threadIdx.y + st) * 33 + threadIdx.x]);
      __syncthreads();
    }
    a = sh[threadIdx.x];
  }
  if (threadIdx.y == 0 && live) { ACC r = a; y[j] = $FINAL; }
}
"""

# argmax (NaN is the largest, first index wins ties). Rows of gridDim.y > 1 chunks: a block
# per chunk, the last to finish takes the best of the chunks' picks (as in REDUCE).
ARGMAX = r"""
#define RLX_LOAD(v) ($LOAD)
typedef $ACC ACC;
// whether candidate (v, i) beats the current pick (b, j); i < 0 / j < 0: none
__device__ __forceinline__ bool rlx_beats(ACC v, int i, ACC b, int j) {
  if (i < 0) return false;
  if (j < 0) return true;
  const bool vn = v != v, bn = b != b;
  if (vn != bn) return vn;
  if (!vn && v != b) return v > b;
  return i < j;
}
extern "C" __global__ void rlx_argmax(const $TX* __restrict__ x, long long rs, long long* __restrict__ y, int n,
                                      int chunk, ACC* __restrict__ pv, int* __restrict__ pi, int* __restrict__ counters) {
  const i64 row = blockIdx.x;
  const int ns = gridDim.y, beg = blockIdx.y * chunk, end = min(n, beg + chunk);
  const $TX* xr = x + row * rs;
  __shared__ ACC sv[1024];
  __shared__ int si[1024];
  __shared__ int last;
  ACC bv = 0; int bi = -1;
#pragma unroll 4
  for (int i = beg + threadIdx.x; i < end; i += blockDim.x) {
    ACC v = RLX_LOAD(xr[i]);
    if (rlx_beats(v, i, bv, bi)) { bv = v; bi = i; }
  }
  sv[threadIdx.x] = bv; si[threadIdx.x] = bi;
  __syncthreads();
  for (int st = blockDim.x / 2; st > 0; st >>= 1) {
    if (threadIdx.x < st && rlx_beats(sv[threadIdx.x + st], si[threadIdx.x + st], sv[threadIdx.x], si[threadIdx.x])) {
      sv[threadIdx.x] = sv[threadIdx.x + st]; si[threadIdx.x] = si[threadIdx.x + st];
    }
    __syncthreads();
  }
  if (ns == 1) {
    if (threadIdx.x == 0) y[row] = si[0] < 0 ? 0 : si[0];
    return;
  }
  if (threadIdx.x == 0) {
    pv[row * ns + blockIdx.y] = sv[0]; pi[row * ns + blockIdx.y] = si[0];
    last = rlx_last_arrival(counters + row, ns);
  }
  __syncthreads();
  if (!last || threadIdx.x >= 32) return;
  __threadfence();
  bv = 0; bi = -1;
  for (int k = threadIdx.x; k < ns; k += 32) {
    const ACC v = LDCG(pv + row * ns + k); const int i = LDCG(pi + row * ns + k);
    if (rlx_beats(v, i, bv, bi)) { bv = v; bi = i; }
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    const ACC v = SHFL_XOR(bv, m); const int i = SHFL_XOR(bi, m);
    if (rlx_beats(v, i, bv, bi)) { bv = v; bi = i; }
  }
  if (threadIdx.x == 0) y[row] = bi < 0 ? 0 : bi;
}
"""

# topk: k passes of a block-wide selection in the order (value desc, NaN last, index asc),
# each pass taking the best element strictly after the previous pick.
TOPK = r"""
#define RLX_LOAD(v) ($LOAD)
__device__ __forceinline__ bool rlx_better($ACC v1, long long i1, $ACC v2, long long i2) {
  bool n1 = v1 != v1, n2 = v2 != v2;
  if (n1 != n2) return !n1;
  if (!n1 && v1 != v2) return v1 > v2;
  return i1 < i2;
}
extern "C" __global__ void rlx_topk(const $TX* __restrict__ x, long long rs, $TX* __restrict__ vals,
    long long* __restrict__ idx, int n, int k) {
  typedef $ACC ACC;
  const i64 row = blockIdx.x;
  const $TX* xr = x + row * rs;
  __shared__ ACC sv[1024];
  __shared__ long long si[1024];
  ACC pv = 0; long long pi = -1;
  for (int t = 0; t < k; ++t) {
    ACC bv = 0; long long bi = -1;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      ACC v = RLX_LOAD(xr[i]);
      if (pi >= 0 && !rlx_better(pv, pi, v, i)) continue;
      if (bi < 0 || rlx_better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    sv[threadIdx.x] = bv; si[threadIdx.x] = bi;
    __syncthreads();
    for (int st = blockDim.x / 2; st > 0; st >>= 1) {
      if (threadIdx.x < st) {
        ACC v = sv[threadIdx.x + st]; long long i = si[threadIdx.x + st];
        if (i >= 0 && (si[threadIdx.x] < 0 || rlx_better(v, i, sv[threadIdx.x], si[threadIdx.x]))) {
          sv[threadIdx.x] = v; si[threadIdx.x] = i;
        }
      }
      __syncthreads();
    }
    pv = sv[0]; pi = si[0];
    if (threadIdx.x == 0) { vals[row * k + t] = xr[pi]; idx[row * k + t] = pi; }
    __syncthreads();
  }
}
"""

CUMSUM = r"""
#define RLX_LOAD(v) ($LOAD)
#define RLX_STORE(v) ($STORE)
extern "C" __global__ void rlx_cumsum(const $TX* __restrict__ x, long long rs, $TO* __restrict__ y, int n) {
  typedef $ACC ACC;
  const i64 row = blockIdx.x;
  const $TX* xr = x + row * rs;
  $TO* yr = y + row * (i64)n;
  __shared__ ACC part[1024];
  const int per = (n + blockDim.x - 1) / blockDim.x;
  const int b0 = threadIdx.x * per;
  const int b1 = min(n, b0 + per);
  ACC s = 0;
  for (int i = b0; i < b1; ++i) s += RLX_LOAD(xr[i]);
  part[threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    ACC run = 0;
    for (int t = 0; t < (int)blockDim.x; ++t) { ACC v = part[t]; part[t] = run; run += v; }
  }
  __syncthreads();
  ACC run = part[threadIdx.x];
  for (int i = b0; i < b1; ++i) { run += RLX_LOAD(xr[i]); yr[i] = RLX_STORE(run); }
}
"""

# --------------------------------------------------------------------------- indexing ops
GATHER = r"""
typedef $TT rlx_tt;     // a one-word name: `unsigned char()` is no valid expression
extern "C" __global__ void rlx_gather(const $TT* __restrict__ table, const $TI* __restrict__ ind,
    $TT* __restrict__ out, long long outer, long long nax, long long ni, long long inner,
    int* err, int node) {
  const i64 total = outer * ni * inner;
  for (i64 o = blockIdx.x * (i64)blockDim.x + threadIdx.x; o < total; o += (i64)gridDim.x * blockDim.x) {
    i64 in_i = o % inner; i64 t = o / inner; i64 ii = t % ni; i64 ou = t / ni;
    i64 ix = (i64)ind[ii];
    if (ix < -nax || ix >= nax) { rlx_error(err, 1, node, ix, nax); out[o] = rlx_tt(); continue; }
    if (ix < 0) ix += nax;
    out[o] = table[(ou * nax + ix) * inner + in_i];
  }
}
"""

# kv_write: cache (contiguous) gets `new` (strided, rank R) at pos[b] along `axis`
KV_WRITE = r"""
extern "C" __global__ void rlx_kv_write($T* cache, const $T* __restrict__ nw, const $TP* __restrict__ pos,
    long long total, $DIMS_ARGS, $NSTR_ARGS, $CSTR_ARGS, long long nax, long long snew,
    int* err, int node) {
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
    i64 r = i, src = 0, dst = 0, b = 0;
$DECOMP
    i64 p = (i64)pos[b];
    if (p < 0 || p + snew > nax) { rlx_error(err, 2, node, p, nax); continue; }
    cache[dst + p * cs$AXIS] = nw[src];
  }
}
"""

# RoPE for up to three jobs in one launch (decode's q, k and v of a layer): job j maps
# x_j [B, H_j, S, D] (any strides) to o_j (any strides), rotated (rope_j) or copied as is;
# at_j: o_j is a KV cache and row s goes to position pos[b] + s (the kv_write the job does).
ROPE = r"""
#define RLX_JOB(j) const $TX* __restrict__ x##j, long long xa##j, long long xb##j, long long xc##j, \
    long long xd##j, $TO* o##j, long long oa##j, long long ob##j, long long oc##j, long long od##j, \
    int H##j, int rope##j, int at##j
#define RLX_PICK(j) { x = x##j; xs0 = xa##j; xs1 = xb##j; xs2 = xc##j; xs3 = xd##j; o = o##j; os0 = oa##j; \
    os1 = ob##j; os2 = oc##j; os3 = od##j; rope = rope##j; at = at##j; }
extern "C" __global__ void rlx_rope(const $TC* __restrict__ cs, const $TC* __restrict__ sn, int B, int S,
    int D, int half, int per_batch, const $TP* __restrict__ pos, long long nax, int* err, int node,
    RLX_JOB(0), RLX_JOB(1), RLX_JOB(2)) {
  // rows (head, batch, position) go to the block's threadIdx.y; the W pairs of a row to its
  // x threads: the row's index divisions are done once, not once per element
  typedef $ACC ACC;
  const int W = half + (D - 2 * half);
  const i64 per_head = (i64)B * S;
  const i64 total = per_head * (H0 + H1 + H2);
  for (i64 row = blockIdx.x * (i64)blockDim.y + threadIdx.y; row < total; row += (i64)gridDim.x * blockDim.y) {
    i64 h = row / per_head;
    const $TX* x; $TO* o; long long xs0, xs1, xs2, xs3, os0, os1, os2, os3; int rope, at;
    if (h < H0) RLX_PICK(0)
    else if (h < H0 + H1) { RLX_PICK(1) h -= H0; }
    else { RLX_PICK(2) h -= H0 + H1; }
    const i64 rem = row % per_head;
    const int s = (int)(rem % S), b = (int)(rem / S);
    const i64 xb = b * xs0 + h * xs1 + s * xs2;
    i64 p = 0;
    if (at) {
      p = (i64)pos[b];
      if (p < 0 || p + S > nax) { if (threadIdx.x == 0) rlx_error(err, 2, node, p, nax); continue; }
    }
    $TO* orow = o + b * os0 + h * os1 + (s + p) * os2;
    for (int t = threadIdx.x; t < W; t += blockDim.x) {
      if (t < half) {
#if $INTERLEAVED
        const int d1 = 2 * t, d2 = 2 * t + 1;
#else
        const int d1 = t, d2 = t + half;
#endif
        const ACC x1 = LD(ACC, x[xb + d1 * xs3]), x2 = LD(ACC, x[xb + d2 * xs3]);
        if (rope) {
          const i64 ci = (per_batch ? (i64)b * S * half : 0) + (i64)s * half + t;
          const ACC cc = LD(ACC, cs[ci]), ss = LD(ACC, sn[ci]);
          orow[d1 * os3] = ST($TO, x1 * cc - x2 * ss);
          orow[d2 * os3] = ST($TO, x2 * cc + x1 * ss);
        } else {
          orow[d1 * os3] = ST($TO, x1);
          orow[d2 * os3] = ST($TO, x2);
        }
      } else {
        const int d = 2 * half + (t - half);
        orow[d * os3] = ST($TO, LD(ACC, x[xb + d * xs3]));
      }
    }
  }
}
"""

# RoPE over 16-bit rows of unit element stride and 16-byte aligned starts, every pair rotated:
# a thread reads and writes 8 elements as one 16-byte vector (interleaved: 4 pairs; half
# style: 8 elements and their 8 partners half a row on). The launch shape and jobs of ROPE.
ROPE_VEC = r"""
#define RLX_JOB(j) const $TX* __restrict__ x##j, long long xa##j, long long xb##j, long long xc##j, \
    $TO* o##j, long long oa##j, long long ob##j, long long oc##j, int H##j
#define RLX_PICK(j) { x = x##j; xs0 = xa##j; xs1 = xb##j; xs2 = xc##j; o = o##j; os0 = oa##j; \
    os1 = ob##j; os2 = oc##j; }
extern "C" __global__ void rlx_rope_vec(const $TC* __restrict__ cs, const $TC* __restrict__ sn, int B, int S,
    int D, int half, int per_batch, RLX_JOB(0), RLX_JOB(1), RLX_JOB(2)) {
  typedef $ACC ACC;
  typedef rlx_vec<$TX, 8> VX;
  typedef rlx_vec<$TO, 8> VO;
  const int per_row = ($INTERLEAVED ? D : half) / 8;
  const i64 per_head = (i64)B * S;
  const i64 total = per_head * (H0 + H1 + H2) * per_row;
  for (i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
    const int c = (int)(idx % per_row) * 8;
    const i64 row = idx / per_row;
    i64 h = row / per_head;
    const $TX* x; $TO* o; long long xs0, xs1, xs2, os0, os1, os2;
    if (h < H0) RLX_PICK(0)
    else if (h < H0 + H1) { RLX_PICK(1) h -= H0; }
    else { RLX_PICK(2) h -= H0 + H1; }
    const i64 rem = row % per_head;
    const int s = (int)(rem % S), b = (int)(rem / S);
    const $TX* xr = x + b * xs0 + h * xs1 + s * xs2;
    $TO* orow = o + b * os0 + h * os1 + s * os2;
    const i64 cb = (per_batch ? (i64)b * S * half : 0) + (i64)s * half;
#if $INTERLEAVED
    const VX xv = *(const VX*)(xr + c);
    VO ov;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const ACC x1 = LD(ACC, xv.v[2 * e]), x2 = LD(ACC, xv.v[2 * e + 1]);
      const ACC cc = LD(ACC, cs[cb + c / 2 + e]), ss = LD(ACC, sn[cb + c / 2 + e]);
      ov.v[2 * e] = ST($TO, x1 * cc - x2 * ss);
      ov.v[2 * e + 1] = ST($TO, x2 * cc + x1 * ss);
    }
    *(VO*)(orow + c) = ov;
#else
    const VX a = *(const VX*)(xr + c), z = *(const VX*)(xr + c + half);
    VO oa, oz;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const ACC x1 = LD(ACC, a.v[e]), x2 = LD(ACC, z.v[e]);
      const ACC cc = LD(ACC, cs[cb + c + e]), ss = LD(ACC, sn[cb + c + e]);
      oa.v[e] = ST($TO, x1 * cc - x2 * ss);
      oz.v[e] = ST($TO, x2 * cc + x1 * ss);
    }
    *(VO*)(orow + c) = oa;
    *(VO*)(orow + c + half) = oz;
#endif
  }
}
"""

# --------------------------------------------------------------------------- attention
# Masking shared by the attention kernels and mask_fill. MASKKIND: 0 none, 1 causal,
# 2 sliding window. MASKMODE: 0 none, 1 bool keep-mask, 2 additive bias.
ATTN_MASK = r"""
#define RLX_KEEP(qpos, j, keep) do { \
  if ($MASKKIND >= 1) keep = keep && ((j) <= (qpos)); \
  if ($MASKKIND == 2) keep = keep && ((j) > (qpos) - window); } while (0)
"""

MASK_FILL = ATTN_MASK + r"""
extern "C" __global__ void rlx_mask_fill(const $TS* __restrict__ sc, long long s0, long long s1,
    long long s2, long long s3, const $TM* __restrict__ mask, long long m0, long long m1, long long m2,
    long long m3, const $TP* __restrict__ pos, $TO* __restrict__ out, int B, int H, int Sq, int Sk,
    int window) {
  typedef $ACC ACC;
  const i64 total = (i64)B * H * Sq * Sk;
  for (i64 o = blockIdx.x * (i64)blockDim.x + threadIdx.x; o < total; o += (i64)gridDim.x * blockDim.x) {
    int j = (int)(o % Sk); i64 t = o / Sk; int i = (int)(t % Sq); t /= Sq; int h = (int)(t % H); int b = (int)(t / H);
    ACC v = LD(ACC, sc[b * s0 + h * s1 + i * s2 + j * s3]);
    bool keep = true;
#if $HAS_POS
    const i64 qpos = (i64)pos[b] + i;
#else
    const i64 qpos = (i64)(Sk - Sq) + i;
#endif
    RLX_KEEP(qpos, (i64)j, keep);
#if $MASKMODE == 1
    keep = keep && (mask[b * m0 + h * m1 + i * m2 + j * m3] != 0);
#elif $MASKMODE == 2
    v = v + LD(ACC, mask[b * m0 + h * m1 + i * m2 + j * m3]);
#endif
    out[o] = ST($TO, keep ? v : -(ACC)RLX_INF);
  }
}
"""

# Split-K attention on CUDA cores (any float type; decode and the f32/f64 path).
# grid (B*KVH, ceil(Sq*G/ROWS), nsplit), NT threads. A block's rows are (query i, head g of
# this kv head) pairs, so K/V are read once for all G heads (GQA-native). The block's keys
# (the range the mask can keep, cut into nsplit chunks at run time, so splits follow the
# position) go in tiles of TK: groups of TPK lanes each load a key row with VK-element
# vector loads (16 bytes where the base and strides allow), NVK per lane, UK keys per lane,
# K and V of the whole tile issued before any math; the group's dot products are summed by
# lane shuffles; the tile's scores go to shared memory, where one warp per row takes their
# max and exponentials (online softmax across tiles); then groups of TPV lanes accumulate
# P.V for their keys in registers. At the end the key groups' sums meet in shared memory:
# with one split they are the output; else each split writes unnormalized partials (acc,
# max, sum) and the last block of each (b, kv head, row block) to finish merges them in the
# same launch (one launch, not a second combine kernel; `counters` start at 0 and that block
# resets its own).
ATTN_VEC = r"""
template <typename T, int N> struct alignas(sizeof(T) * N) RlxVec { T v[N]; };
template <int N, typename T> __device__ __forceinline__ RlxVec<T, N> rlx_vload(const T* p, bool ok) {
  RlxVec<T, N> r;
  if (ok) {
    r = *reinterpret_cast<const RlxVec<T, N>*>(p);
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) r.v[e] = ST(T, 0.0f);
  }
  return r;
}
"""

ATTN_SPLIT = ATTN_MASK + ATTN_VEC + r"""
#define NT $NT
#define NW ($NT / 32)
extern "C" __global__ void __launch_bounds__($NT) rlx_attn_split(
    const $TQ* __restrict__ q, long long qsb, long long qsh, long long qss,
    const $TK* __restrict__ k, long long ksb, long long ksh, long long kss,
    const $TV* __restrict__ v, long long vsb, long long vsh, long long vss,
    const $TM* __restrict__ mask, long long m0, long long m1, long long m2, long long m3,
    const $TP* __restrict__ pos, $ACC* __restrict__ part_o, $ACC* __restrict__ part_ml,
    int B, int H, int KVH, int Sq, int Sk, int minchunk, double scale_d, double cap_d, int window,
    int* __restrict__ counters, $TO* __restrict__ out, long long osb, long long osh, long long oss) {
  typedef $ACC ACC;
  constexpr int ROWS = $ROWS, DK = $DK, DV = $DV, TK = $TILE, LDT = $TILE + 1;
  constexpr int VK = $VK, TPK = $TPK, NVK = $NVK, KPB = NT / TPK, UK = TK / KPB;
  constexpr int VV = $VV, TPV = $TPV, NVV = $NVV, KPBV = NT / TPV, UV = TK / KPBV;
  constexpr int WR = (ROWS + TPK - 1) / TPK;      // score rows each lane of a key group writes
  constexpr int SH = 2 * ROWS * LDT > NW * ROWS * DV ? 2 * ROWS * LDT : NW * ROWS * DV;
  // two tiles of scores / probabilities [2][ROWS][LDT], later the warps' sums [NW][ROWS][DV]
  __shared__ ACC sh[SH];
  __shared__ ACC s_m[ROWS], s_l[ROWS], s_a[ROWS];
  const int G = H / KVH;
  const int b = blockIdx.x / KVH, kvh = blockIdx.x % KVH;
  const int r0 = blockIdx.y * ROWS;
  const int split = blockIdx.z, nsplit = gridDim.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gk = tid / TPK, lk = tid % TPK, gv = tid / TPV, lv = tid % TPV;
  const ACC scale = (ACC)scale_d, cap = (ACC)cap_d;
  ACC qr[ROWS][NVK * VK];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int rr = r0 + r, ok = rr < Sq * G;
    const i64 qo = b * qsb + (kvh * G + (ok ? rr % G : 0)) * qsh + (ok ? rr / G : 0) * qss;
#pragma unroll
    for (int n = 0; n < NVK; ++n)
#pragma unroll
      for (int e = 0; e < VK; ++e) {
        const int d = (lk + TPK * n) * VK + e;
        qr[r][n * VK + e] = (ok && d < DK) ? LD(ACC, q[qo + d]) : (ACC)0;
      }
  }
#if $HAS_POS
  const i64 p0 = (i64)pos[b];
#else
  const i64 p0 = (i64)(Sk - Sq);
#endif
  // the rows this lane finishes scores for (r = lk + TPK * w): position, mask row, validity
  i64 mq[WR], mo[WR]; bool mine[WR];
#pragma unroll
  for (int w = 0; w < WR; ++w) {
    const int r = lk + TPK * w, rr = r0 + r;
    mine[w] = r < ROWS && rr < Sq * G;
    const int i = mine[w] ? rr / G : 0, h = kvh * G + (mine[w] ? rr % G : 0);
    mq[w] = p0 + i;
    mo[w] = b * m0 + h * m1 + i * m2;
  }
  // keys the mask may keep for some row of the block, this split's share of them
  const int rows_here = min(ROWS, Sq * G - r0);
  const i64 qmin = p0 + r0 / G, qmax = p0 + (r0 + rows_here - 1) / G;
  i64 kbeg = 0, kend = Sk;
  if ($MASKKIND >= 1) kend = max((i64)0, min((i64)Sk, qmax + 1));
  if ($MASKKIND == 2) kbeg = min(kend, max((i64)0, qmin - window + 1));
  i64 chunk = (kend - kbeg + nsplit - 1) / nsplit;
  chunk = max((i64)minchunk, (chunk + KPB - 1) / KPB * KPB);
  const i64 cs = min(kend, kbeg + split * chunk), ce = min(kend, cs + chunk);
  if (tid < ROWS) { s_m[tid] = -(ACC)RLX_INF; s_l[tid] = 0; }
  ACC acc[ROWS][NVV * VV];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int x = 0; x < NVV * VV; ++x) acc[r][x] = 0;
  const $TK* kb = k + b * ksb + kvh * ksh;
  const $TV* vb = v + b * vsb + kvh * vsh;
  int buf = 0;
  for (i64 t0 = cs; t0 < ce; t0 += TK, buf ^= 1) {
    ACC* sp = sh + buf * ROWS * LDT;
    // every load of the tile first: K, V and the mask entries this lane needs
    RlxVec<$TK, VK> kr[UK][NVK];
    RlxVec<$TV, VV> vr[UV][NVV];
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      const i64 j = t0 + gk + u * KPB;
#pragma unroll
      for (int n = 0; n < NVK; ++n) {
        const int c = (lk + TPK * n) * VK;
        kr[u][n] = rlx_vload<VK>(kb + j * kss + c, j < ce && c < DK);
      }
    }
#pragma unroll
    for (int u = 0; u < UV; ++u) {
      const i64 j = t0 + gv + u * KPBV;
#pragma unroll
      for (int n = 0; n < NVV; ++n) {
        const int c = (lv + TPV * n) * VV;
        vr[u][n] = rlx_vload<VV>(vb + j * vss + c, j < ce && c < DV);
      }
    }
#if $MASKMODE == 1
    bool mk[UK][WR];
#elif $MASKMODE == 2
    ACC mk[UK][WR];
#endif
#if $MASKMODE
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      const i64 j = t0 + gk + u * KPB;
#pragma unroll
      for (int w = 0; w < WR; ++w) {
#if $MASKMODE == 1
        mk[u][w] = mine[w] && j < ce && mask[mo[w] + j * m3] != 0;
#else
        mk[u][w] = (mine[w] && j < ce) ? LD(ACC, mask[mo[w] + j * m3]) : (ACC)0;
#endif
      }
    }
#endif
    // scores: each lane's part of the dot products, summed over its group of TPK lanes
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      const i64 j = t0 + gk + u * KPB;
      ACC s[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        ACC t = 0;
#pragma unroll
        for (int n = 0; n < NVK; ++n)
#pragma unroll
          for (int e = 0; e < VK; ++e) t += qr[r][n * VK + e] * LD(ACC, kr[u][n].v[e]);
        s[r] = t;
      }
#pragma unroll
      for (int m = TPK / 2; m > 0; m >>= 1)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) s[r] += SHFL_XOR(s[r], m);
#pragma unroll
      for (int w = 0; w < WR; ++w) {
        const int r = lk + TPK * w;
        if (r >= ROWS) continue;
        ACC x = 0;
#pragma unroll
        for (int t = 0; t < ROWS; ++t) x = t == r ? s[t] : x;
        x = x * scale;
        if (cap_d != 0.0) x = tanh(x / cap) * cap;
        bool keep = mine[w] && j < ce;
        RLX_KEEP(mq[w], j, keep);
#if $MASKMODE == 1
        keep = keep && mk[u][w];
#elif $MASKMODE == 2
        x = x + mk[u][w];
#endif
        sp[r * LDT + gk + u * KPB] = keep ? x : -(ACC)RLX_INF;
      }
    }
    __syncthreads();
    // online softmax over the tile: one warp per row
    for (int r = warp; r < ROWS; r += NW) {
      ACC* pr = sp + r * LDT;
      ACC mx = -(ACC)RLX_INF;
      for (int c = lane; c < TK; c += 32) mx = rlx_max(mx, pr[c]);   // a NaN score stays
      mx = warp_max(mx);
      const ACC mold = s_m[r], mn = rlx_max(mx, mold);
      const bool live = mn != -(ACC)RLX_INF;    // (NaN is live: its row comes out NaN)
      ACC sum = 0;
      for (int c = lane; c < TK; c += 32) {
        const ACC p = live ? exp(pr[c] - mn) : (ACC)0;
        pr[c] = p;
        sum += p;
      }
      sum = warp_sum(sum);
      __syncwarp();
      if (lane == 0) {
        const ACC a = live ? exp(mold - mn) : (ACC)1;
        s_a[r] = a; s_l[r] = s_l[r] * a + sum; s_m[r] = mn;
      }
    }
    __syncthreads();
    // P.V for this lane's keys and head dims (the next tile's scores go to the other buffer)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const ACC a = s_a[r];
#pragma unroll
      for (int x = 0; x < NVV * VV; ++x) acc[r][x] *= a;
    }
#pragma unroll
    for (int u = 0; u < UV; ++u) {
      const int c = gv + u * KPBV;
      ACC p[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) p[r] = sp[r * LDT + c];
#pragma unroll
      for (int n = 0; n < NVV; ++n)
#pragma unroll
        for (int e = 0; e < VV; ++e) {
          const ACC x = LD(ACC, vr[u][n].v[e]);
#pragma unroll
          for (int r = 0; r < ROWS; ++r) acc[r][n * VV + e] += p[r] == (ACC)0 ? (ACC)0 : p[r] * x;
        }
    }
  }
  // sum the key groups: within each warp by shuffles, then the warps through shared memory
#pragma unroll
  for (int m = TPV; m < 32; m <<= 1)
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int x = 0; x < NVV * VV; ++x) acc[r][x] += SHFL_XOR(acc[r][x], m);
  __syncthreads();
  if (lane < TPV) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int n = 0; n < NVV; ++n)
#pragma unroll
        for (int e = 0; e < VV; ++e) {
          const int d = (lv + TPV * n) * VV + e;
          if (d < DV) sh[(warp * ROWS + r) * DV + d] = acc[r][n * VV + e];
        }
  }
  __syncthreads();
  for (int t = tid; t < ROWS * DV; t += NT) {
    const int r = t / DV, d = t % DV;
    const int rr = r0 + r;
    if (rr >= Sq * G) continue;
    ACC O = 0;
#pragma unroll
    for (int w = 0; w < NW; ++w) O += sh[(w * ROWS + r) * DV + d];
    const int i = rr / G, h = kvh * G + rr % G;
    const ACC L = s_l[r];
    if (nsplit == 1) {
      out[b * osb + h * osh + i * oss + d] = ST($TO, L == 0 ? (ACC)0 : O / L);
      continue;
    }
    const i64 orow = (((i64)split * B + b) * H + h) * Sq + i;
    part_o[orow * DV + d] = O;
    if (d == 0) { part_ml[orow * 2] = s_m[r]; part_ml[orow * 2 + 1] = L; }
  }
  if (nsplit == 1) return;
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = rlx_last_arrival(counters + blockIdx.x * gridDim.y + blockIdx.y, nsplit);
  __syncthreads();
  if (!last) return;
  __threadfence();
  // merge the splits (at most 64): one warp per row; lanes take the splits' (max, sum) and
  // weights in one round, then each lane sums its head dims over the splits with the loads
  // independent of each other (a few L2 round trips, not one per split)
  __shared__ ACC wsplit[NW][64];
  constexpr int EV = (DV + 31) / 32;
  const i64 rows = (i64)B * H * Sq;
  for (int r = warp; r < ROWS; r += NW) {
    const int rr = r0 + r;
    if (rr >= Sq * G) continue;
    const int h = kvh * G + rr % G, i = rr / G;
    const i64 row = ((i64)b * H + h) * Sq + i;
    const ACC* ml = part_ml + row * 2;
    ACC mv[2], lv2[2], M = -(ACC)RLX_INF;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int sp = lane + 32 * t;
      mv[t] = sp < nsplit ? LDCG(ml + sp * rows * 2) : -(ACC)RLX_INF;
      lv2[t] = sp < nsplit ? LDCG(ml + sp * rows * 2 + 1) : (ACC)0;
      M = rlx_max(M, mv[t]);
    }
    M = warp_max(M);
    ACC L = 0;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const ACC f = (M != -(ACC)RLX_INF && mv[t] != -(ACC)RLX_INF) ? exp(mv[t] - M) : (ACC)0;
      wsplit[warp][lane + 32 * t] = f;
      L += lv2[t] * f;
    }
    L = warp_sum(L);
    __syncwarp();
    ACC O[EV];
#pragma unroll
    for (int e = 0; e < EV; ++e) O[e] = 0;
#pragma unroll 16
    for (int sp = 0; sp < nsplit; ++sp) {
      const ACC f = wsplit[warp][sp];
#pragma unroll
      for (int e = 0; e < EV; ++e) {
        const int d = lane + 32 * e;
        if (d < DV && f != (ACC)0) O[e] += LDCG(part_o + (sp * rows + row) * DV + d) * f;
      }
    }
#pragma unroll
    for (int e = 0; e < EV; ++e) {
      const int d = lane + 32 * e;
      if (d < DV) out[b * osb + h * osh + i * oss + d] = ST($TO, L == 0 ? (ACC)0 : O[e] / L);
    }
    __syncwarp();
  }
}
"""

# What both tensor-core attention kernels use: 2^x in one MUFU instruction (exp2f adds a
# denormal fix-up around it; a probability under 2^-126 is 0 to the bf16/f16 P.V product
# anyway) and the cp.async group commit.
ATTN_TC_COMMON = r"""
__device__ __forceinline__ float rlx_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#define RLX_CP_COMMIT() asm volatile("cp.async.commit_group;\n" ::: "memory")
"""

# Flash-style prefill on tensor cores (f16/bf16, head_dim D % 16 == 0, D <= 128):
# FlashAttention-2 register layout with mma.sync.m16n8k16 (f32 accumulate). Block = 4
# warps x MT m-tiles of 16 query rows of one head (warp w takes rows mt * 64 + w * 16..);
# Q and 64-key tiles of K and V staged in shared memory (dynamic: attn_tc_smem bytes);
# S = Q K^T and the online softmax stay in registers; P is re-packed to A fragments. Q's A
# and K's and V's B fragments come from shared memory by ldmatrix (V's transposed), each K
# and V fragment feeding the MT m-tiles. With MT = 2 a block reads each K/V tile for 128
# query rows. V read one 16-bit element at a time took 2.40 against 1.91 ms (FLUX's
# 4608-token, 24-head attention, H100).
ATTN_TC = ATTN_MASK + ATTN_TC_COMMON + r"""
#define MT $MT
#define BM (64 * MT)
#define BN 64
#define LDS ($D + 8)
#define RLX_LOG2E 1.4426950408889634f
__device__ __forceinline__ void rlx_mma(float* c, const u32* a, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.$MMAT.$MMAT.f32 "
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void rlx_ldm_x4(u32* r, const unsigned short* p) {
  // four 8x8 b16 matrices from shared memory: lanes 8i..8i+7 give matrix i's rows
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void rlx_ldm_x4_trans(u32* r, const unsigned short* p) {
  // the same, each matrix transposed
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ u32 rlx_pack(float lo, float hi) {
  $T l = ST($T, lo), h = ST($T, hi);
  return (u32)(*(unsigned short*)&l) | ((u32)(*(unsigned short*)&h) << 16);
}
__device__ __forceinline__ void rlx_load_tile(unsigned short* dst, const $T* src, long long rstride,
    i64 row0, i64 nrows, int tid, int nr = BN) {
  // rows row0..row0+nr-1 of a [rows, D] strided matrix into dst[nr][LDS]; rows past nrows are 0
#if $VEC
  for (int idx = tid; idx < nr * ($D / 8); idx += 128) {
    const int r = idx / ($D / 8), c = (idx % ($D / 8)) * 8;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (row0 + r < nrows) val = *(const uint4*)(src + (row0 + r) * rstride + c);
    *(uint4*)(dst + r * LDS + c) = val;
  }
#else
  for (int idx = tid; idx < nr * $D; idx += 128) {
    const int r = idx / $D, c = idx % $D;
    unsigned short val = 0;
    if (row0 + r < nrows) val = *(const unsigned short*)(src + (row0 + r) * rstride + c);
    dst[r * LDS + c] = val;
  }
#endif
}
__device__ __forceinline__ void rlx_load_tile_async(unsigned short* dst, const $T* src, long long rstride,
    i64 row0, i64 nrows, int tid) {
  // rlx_load_tile by cp.async (16 bytes a copy, rows past nrows zero-filled): the copies run
  // while the warps compute; the caller commits the group and waits for it. A thread copies
  // the same 16-byte column of every RSTEP-th row: its addresses advance by one add a copy
#if $VEC
  constexpr int CPR = $D / 8, RSTEP = 128 / CPR;
  if (tid >= RSTEP * CPR) return;
  const int r0 = tid / CPR, c = (tid % CPR) * 8;
  const int lim = (int)min((i64)BN, nrows - row0);
  const $T* p = src + (row0 + r0) * rstride + c;
  const i64 step = (i64)RSTEP * rstride;
  unsigned s = (unsigned)__cvta_generic_to_shared(dst + r0 * LDS + c);
#pragma unroll
  for (int i = 0; i < (BN + RSTEP - 1) / RSTEP; ++i, p += step, s += RSTEP * LDS * 2) {
    const int r = r0 + i * RSTEP;
    if (BN % RSTEP != 0 && r >= BN) break;
    const bool ok = r < lim;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(s), "l"(ok ? p : src), "r"(ok ? 16 : 0));
  }
#else
  rlx_load_tile(dst, src, rstride, row0, nrows, tid);
#endif
}
#define RLX_CP_WAIT1() asm volatile("cp.async.wait_group 1;\n" ::: "memory")
extern "C" __global__ void __launch_bounds__(128) rlx_attn_tc(
    const $T* __restrict__ q, long long qsb, long long qsh, long long qss,
    const $T* __restrict__ k, long long ksb, long long ksh, long long kss,
    const $T* __restrict__ v, long long vsb, long long vsh, long long vss,
    const $TM* __restrict__ mask, long long m0, long long m1, long long m2, long long m3,
    const $TP* __restrict__ pos, $T* __restrict__ out, long long osb, long long osh, long long oss,
    int B, int H, int KVH, int Sq, int Sk, double scale_d, double cap_d, int window) {
  extern __shared__ __align__(16) unsigned short rlx_smem[];
  unsigned short* Ks = rlx_smem;                  // [BN][LDS]
  unsigned short* Vs = rlx_smem + BN * LDS;       // [BN][LDS]
  unsigned short* Qs = rlx_smem + 2 * BN * LDS;   // [BM][LDS]
  const int qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int G = H / KVH, kvh = h / G;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tg = lane & 3;
  const float scale = (float)scale_d, cap = (float)cap_d, scale2 = scale * RLX_LOG2E;
  const i64 q0 = (i64)qt * BM;
#if $HAS_POS
  const i64 p0 = (i64)pos[b];
#else
  const i64 p0 = (i64)(Sk - Sq);
#endif
  rlx_load_tile(Qs, q + b * qsb + h * qsh, qss, q0, Sq, tid, BM);
  float o[MT][$D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int dt = 0; dt < $D / 8; ++dt) { o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.f; }
  float mrow[MT][2], lrow[MT][2];
  i64 qi[MT][2], qp[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mrow[mt][r] = -RLX_INF;
      lrow[mt][r] = 0.f;
      qi[mt][r] = q0 + mt * 64 + warp * 16 + g + 8 * r;
      qp[mt][r] = p0 + qi[mt][r];
    }
  const i64 qlast = min(q0 + BM, (i64)Sq) - 1;
  i64 kend = Sk, kbeg = 0;
  if ($MASKKIND >= 1) kend = min((i64)Sk, p0 + qlast + 1);
  if ($MASKKIND == 2) kbeg = max((i64)0, p0 + q0 - window + 1);
  const $T* kb = k + b * ksb + kvh * ksh;
  const $T* vb = v + b * vsb + kvh * vsh;
  // Q's A fragments: lanes 0-15 address rows 0-15 of the m-tile at column 0, lanes 16-31 at 8
  const unsigned short* qrow = Qs + (warp * 16 + (lane & 15)) * LDS + (lane >> 4) * 8;
  // pipeline: V's tile loads while S = Q K^T and the softmax run, the next K tile while P V runs
  if (kbeg < kend) rlx_load_tile_async(Ks, kb, kss, kbeg, Sk, tid);
  RLX_CP_COMMIT();
  for (i64 kt = kbeg; kt < kend; kt += BN) {
    rlx_load_tile_async(Vs, vb, vss, kt, Sk, tid);
    RLX_CP_COMMIT();
    RLX_CP_WAIT1();                                 // this K tile has landed (and Q, first time)
    __syncthreads();
    float s[MT][BN / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < $D / 16; ks += 2) {
      u32 qa[MT][2][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        rlx_ldm_x4(qa[mt][0], qrow + mt * 64 * LDS + ks * 16);
        rlx_ldm_x4(qa[mt][1], qrow + mt * 64 * LDS + ks * 16 + 16);
      }
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
        // K's B fragments for two k-steps at once: keys nt*8.. +7, head dims ks*16.. +31
        u32 kf[4];
        rlx_ldm_x4(kf, Ks + (nt * 8 + (lane & 7)) * LDS + (lane >> 3) * 8 + ks * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          rlx_mma(s[mt][nt], qa[mt][0], kf[0], kf[1]);
          rlx_mma(s[mt][nt], qa[mt][1], kf[2], kf[3]);
        }
      }
    }
    // scores in log2 units (exp2 below). A tile every query row sees whole (no mask input,
    // no softcap, in range, below the causal diagonal) keeps raw scores: the scale is folded
    // into the exponent's multiply-add (sm), and the row max of raw scores, scaled, is the max
    const bool whole = $MASKMODE == 0 && cap_d == 0.0 && scale_d > 0.0 && kt + BN <= Sk && q0 + BM <= Sq &&
                       ($MASKKIND == 0 || ($MASKKIND == 1 && kt + BN - 1 <= p0 + q0));
    const float sm = whole ? scale2 : 1.f;
    float mx[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      mx[mt][0] = mx[mt][1] = -RLX_INF;
      if (whole) {
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) mx[mt][e >> 1] = fmaxf(mx[mt][e >> 1], s[mt][nt][e]);
        }
        mx[mt][0] *= sm;
        mx[mt][1] *= sm;
      } else {
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int rsel = e >> 1;
            const i64 j = kt + nt * 8 + tg * 2 + (e & 1);
            float x = s[mt][nt][e] * scale;
            if (cap_d != 0.0) x = tanhf(x / cap) * cap;
            bool keep = (j < Sk) && (qi[mt][rsel] < Sq);
            RLX_KEEP(qp[mt][rsel], j, keep);
#if $MASKMODE == 1
            if (keep) keep = mask[b * m0 + h * m1 + qi[mt][rsel] * m2 + j * m3] != 0;
#elif $MASKMODE == 2
            if (keep) x = x + tof(mask[b * m0 + h * m1 + qi[mt][rsel] * m2 + j * m3]);
#endif
            x = keep ? x * RLX_LOG2E : -RLX_INF;
            s[mt][nt][e] = x;
            mx[mt][rsel] = x > mx[mt][rsel] ? x : mx[mt][rsel];
          }
        }
      }
    }
    // The running max moves only when a row's max grows past it by 2^8 (any row of the
    // warp: the branch is uniform): until then P = 2^(s - max) stays under 256 and O and l
    // need no rescale; the quotient O / l is the same for any max
    bool grow = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[mt][r] = fmaxf(mx[mt][r], SHFL_XOR(mx[mt][r], 1));
        mx[mt][r] = fmaxf(mx[mt][r], SHFL_XOR(mx[mt][r], 2));
        grow |= mx[mt][r] > mrow[mt][r] + 8.f;
      }
    if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float mn = fmaxf(mrow[mt][r], mx[mt][r]);
          alpha[r] = rlx_exp2(mrow[mt][r] - ((mn > -RLX_INF) ? mn : 0.f));
          mrow[mt][r] = mn;
          lrow[mt][r] *= alpha[r];
        }
#pragma unroll
        for (int dt = 0; dt < $D / 8; ++dt) {
          o[mt][dt][0] *= alpha[0]; o[mt][dt][1] *= alpha[0]; o[mt][dt][2] *= alpha[1]; o[mt][dt][3] *= alpha[1];
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float mu0 = mrow[mt][0] > -RLX_INF ? mrow[mt][0] : 0.f;
      const float mu1 = mrow[mt][1] > -RLX_INF ? mrow[mt][1] : 0.f;
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float p = rlx_exp2(fmaf(s[mt][nt][e], sm, -(e < 2 ? mu0 : mu1)));
          s[mt][nt][e] = p;
          lrow[mt][e >> 1] += p;
        }
      }
    }
    __syncthreads();                                // every warp is done with this K tile
    if (kt + BN < kend) rlx_load_tile_async(Ks, kb, kss, kt + BN, Sk, tid);
    RLX_CP_COMMIT();
    RLX_CP_WAIT1();                                 // this V tile has landed
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      u32 a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = rlx_pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = rlx_pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = rlx_pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = rlx_pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
      // V's B fragments for two column tiles at once: keys kk*16.. +15, columns dt*8.. +15
      const unsigned short* vrow = Vs + (kk * 16 + (lane & 7) + (lane & 8)) * LDS + (lane >> 4) * 8;
#pragma unroll
      for (int dt = 0; dt < $D / 8; dt += 2) {
        u32 vf[4];
        rlx_ldm_x4_trans(vf, vrow + dt * 8);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          rlx_mma(o[mt][dt], a[mt], vf[0], vf[1]);
          rlx_mma(o[mt][dt + 1], a[mt], vf[2], vf[3]);
        }
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = lrow[mt][r];
      l += SHFL_XOR(l, 1);
      l += SHFL_XOR(l, 2);
      if (qi[mt][r] >= Sq) continue;
      const float inv = l == 0.f ? 0.f : 1.f / l;
      $T* orow = out + b * osb + h * osh + qi[mt][r] * oss;
#pragma unroll
      for (int dt = 0; dt < $D / 8; ++dt) {
        const int c = dt * 8 + tg * 2;
        orow[c] = ST($T, o[mt][dt][2 * r] * inv);
        orow[c + 1] = ST($T, o[mt][dt][2 * r + 1] * inv);
      }
    }
}
"""


def attn_tc_smem(D: int, MT: int) -> int:
    """Dynamic shared memory of ATTN_TC: the K and V tiles and the Q rows (16-bit, padded rows)."""
    return (2 * 64 + 64 * MT) * (D + 8) * 2


# Hopper (sm_90a) prefill attention on wgmma (f16/bf16, head_dim 64 or 128, 16-byte rows).
# Block = 2 warpgroups x 64 query rows of one head. Shared memory: Q, and two slots of a K and
# a V tile of 128 keys each, as the 128-byte-swizzled layout wgmma reads (each 64-column half
# of a row is 128 bytes, its 16-byte chunk c at c ^ (row % 8)). Q comes by every thread's
# cp.async; K and V by the copy engine (TMA, tensor maps made by device.tensor_map), which
# one thread issues into a slot once both warpgroups have released it (mbarriers: no
# block-wide barrier a tile, so the warpgroups drift apart and overlap). S = Q K^T with A and
# B from shared memory (K-major); the online softmax on S's registers (the FA2 layout: a
# thread holds 2 rows x 2 columns of every 8); P re-packed as A registers; O += P V with V as
# an MN-major B (LBO: the next 64 columns, SBO: the next 8 keys). S of tile t + 1 runs on the
# tensor cores while the exponentials of tile t run. FLUX's attention (4608 tokens, 24 x 128,
# bf16, H200): 0.473 ms, 552 TFLOP/s (rlx_attn_tc: 0.885 ms; the same kernel with every
# thread's cp.async and a block barrier a tile 0.545; lock-step tiles without the overlap
# 0.602; with per-chunk address math in the copies 0.835).
ATTN_WG = ATTN_MASK + ATTN_TC_COMMON + r"""
#define D $D
#define BM 128
#define BN 128
#define RLX_LOG2E 1.4426950408889634f
__device__ __forceinline__ unsigned long long rlx_desc(unsigned a, unsigned lbo, unsigned sbo) {
  // a wgmma shared-memory matrix descriptor, 128-byte swizzle
  return (unsigned long long)((a & 0x3FFFF) >> 4) | ((unsigned long long)((lbo & 0x3FFFF) >> 4) << 16) |
         ((unsigned long long)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void rlx_wg_qk(float* d, unsigned long long a, unsigned long long b, int acc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.$MMAT.$MMAT {@S_REGS@}, %64, %65, p, 1, 1, 0, 0;\n}\n"
               : @S_OUTS@ : "l"(a), "l"(b), "r"(acc));
}
__device__ __forceinline__ void rlx_wg_pv(float* d, const u32* a, unsigned long long b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %@ONE@, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n@D@k16.f32.$MMAT.$MMAT {@O_REGS@}, "
               "{%@A0@, %@A1@, %@A2@, %@A3@}, %@B@, p, 1, 1, 1;\n}\n"
               : @O_OUTS@ : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
#define RLX_WG_FENCE() asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory")
#define RLX_WG_COMMIT() asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory")
#define RLX_WG_WAIT0() asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory")
__device__ __forceinline__ u32 rlx_pack(float lo, float hi) {
  // two floats rounded to one register of 16-bit values (one cvt instruction)
#if $BF16
  __nv_bfloat162 t = __floats2bfloat162_rn(lo, hi);
#else
  __half2 t = __floats2half2_rn(lo, hi);
#endif
  return *(u32*)&t;
}
struct rlx_wg_loader {
  // a thread's share of copying 128 rows x D columns into D / 64 swizzled [128][128 B]
  // halves: 16-byte column cc of rows r0, r0 + 256 / (D / 8), ... (the same swizzled slot in
  // each: the row step is a multiple of 8)
  static constexpr int CPR = D / 8, RSTEP = 256 / CPR, N = 128 / RSTEP;
  int r0;
  unsigned dst;
  long long col;
  __device__ __forceinline__ rlx_wg_loader(int tid) {
    r0 = tid / CPR;
    const int cc = tid % CPR;
    dst = (cc >> 3) * 128 * 128 + r0 * 128 + (((cc & 7) ^ (r0 & 7)) << 4);
    col = cc * 8;
  }
  __device__ __forceinline__ void operator()(unsigned base, const $T* src, long long rstride, i64 row0,
                                             i64 nrows) const {
    const $T* p = src + (row0 + r0) * rstride + col;
    const long long step = (long long)RSTEP * rstride;
    if (row0 + 128 <= nrows) {
#pragma unroll
      for (int i = 0; i < N; ++i, p += step)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(base + dst + i * RSTEP * 128), "l"(p));
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i, p += step) {
        const bool ok = row0 + r0 + i * RSTEP < nrows;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                     :: "r"(base + dst + i * RSTEP * 128), "l"(ok ? p : src), "r"(ok ? 16 : 0));
      }
    }
  }
};
template <int N> __device__ __forceinline__ void rlx_wg_settle(float* d) {
  // the compiler may not move reads of registers an async wgmma writes above its wait
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
// mbarriers (shared-memory addresses): a tile's K or V has landed (the copy engine's byte
// count completes the phase), or both warpgroups are done reading a slot (256 arrivals)
__device__ __forceinline__ void rlx_bar_init(unsigned bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void rlx_bar_wait(unsigned bar, int parity) {
  unsigned ok = 0;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
  } while (!ok);
}
__device__ __forceinline__ void rlx_bar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
struct rlx_wg_attn {
  // one block's state. The pipeline: S = Q K^T of tile t + 1 runs on the tensor cores while
  // the exponentials of tile t run, then P V of tile t. Thread 0 also issues the copy
  // engine's (TMA) loads: K of tile t + 2 and V of tile t + 1 at the start of tile t, each
  // into the slot both warpgroups have released
  const void *tk, *tv;                 // tensor maps of K and V (global memory)
  const $TM* mask;
  long long m0, m1, m2, m3;
  i64 q0, p0, kbeg, Sq, Sk;
  int b, h, kvh, tg, window, n, tid;
  float scale, cap, scale2;
  double cap_d, scale_d;
  unsigned KV0, bars;
  unsigned long long qdesc;
  float o[D / 8][4];
  float mrow[2], lrow[2];
  i64 qi[2], qp[2];

  __device__ __forceinline__ unsigned kslot(int t) const { return KV0 + (t & 1) * 2 * BN * D * 2; }
  __device__ __forceinline__ unsigned vslot(int t) const { return kslot(t) + BN * D * 2; }
  // barriers: kfull, vfull, kempty, vempty, two slots each
  __device__ __forceinline__ unsigned bar(int which, int t) const { return bars + (which * 2 + (t & 1)) * 8; }
  __device__ __forceinline__ void fetch(const void* map, unsigned dst, unsigned full, int t) const {
    // tile t's rows (kbeg + t * BN ..; rows past Sk are zeros) as D / 64 boxes of [128][64]
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(full), "r"(BN * D * 2) : "memory");
    const int row = (int)(kbeg + (i64)t * BN);
#pragma unroll
    for (int c = 0; c < D / 64; ++c)
      asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                   "[%0], [%1, {%2, %3, %4, %5}], [%6];\n"
                   :: "r"(dst + c * BN * 128), "l"(map), "r"(c * 64), "r"(row), "r"(kvh), "r"(b), "r"(full)
                   : "memory");
  }
  __device__ __forceinline__ void qk(float (&s)[BN / 8][4], int t) const {
    rlx_bar_wait(bar(0, t), (t >> 1) & 1);
    const unsigned long long kd = rlx_desc(kslot(t), 16, 1024);
    RLX_WG_FENCE();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)      // a step along K adds to the descriptor's address (16-byte units)
      rlx_wg_qk(&s[0][0], qdesc + (((ks >> 2) * BM * 128 + (ks & 3) * 32) >> 4),
                kd + (((ks >> 2) * BN * 128 + (ks & 3) * 32) >> 4), ks);
    RLX_WG_COMMIT();
  }
  __device__ __forceinline__ void tile(int t, float (&sc)[BN / 8][4], float (&sn)[BN / 8][4]) {
    if (tid == 0) {
      if (t + 2 < n) {                             // K of tile t + 2 where tile t's was
        rlx_bar_wait(bar(2, t), (t >> 1) & 1);
        fetch(tk, kslot(t), bar(0, t), t + 2);
      }
      if (t + 1 < n) {                             // V of tile t + 1 where tile t - 1's was
        if (t >= 1) rlx_bar_wait(bar(3, t + 1), ((t - 1) >> 1) & 1);
        fetch(tv, vslot(t + 1), bar(1, t + 1), t + 1);
      }
    }
    __syncwarp();
    const i64 kt = kbeg + (i64)t * BN;
    // $WHOLE: every tile is whole (no mask or softcap, Sq and Sk multiples of the tiles)
    const bool whole = $WHOLE || ($MASKMODE == 0 && cap_d == 0.0 && scale_d > 0.0 && kt + BN <= Sk &&
                       q0 + BM <= Sq && ($MASKKIND == 0 || ($MASKKIND == 1 && kt + BN - 1 <= p0 + q0)));
    const float sm = whole ? scale2 : 1.f;
    float mx[2] = {-RLX_INF, -RLX_INF};
    if (whole) {
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], sc[nt][e]);
      mx[0] *= sm;
      mx[1] *= sm;
    } else {
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int rsel = e >> 1;
          const i64 j = kt + nt * 8 + tg * 2 + (e & 1);
          float x = sc[nt][e] * scale;
          if (cap_d != 0.0) x = tanhf(x / cap) * cap;
          bool keep = (j < Sk) && (qi[rsel] < Sq);
          RLX_KEEP(qp[rsel], j, keep);
#if $MASKMODE == 1
          if (keep) keep = mask[b * m0 + h * m1 + qi[rsel] * m2 + j * m3] != 0;
#elif $MASKMODE == 2
          if (keep) x = x + tof(mask[b * m0 + h * m1 + qi[rsel] * m2 + j * m3]);
#endif
          x = keep ? x * RLX_LOG2E : -RLX_INF;
          sc[nt][e] = x;
          mx[rsel] = fmaxf(mx[rsel], x);
        }
    }
    // as rlx_attn_tc: the running max moves only when a row's max grows past it by 2^8
    bool grow = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], SHFL_XOR(mx[r], 1));
      mx[r] = fmaxf(mx[r], SHFL_XOR(mx[r], 2));
      grow |= mx[r] > mrow[r] + 8.f;
    }
    if (__any_sync(0xffffffffu, grow)) {
      float alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float mn = fmaxf(mrow[r], mx[r]);
        alpha[r] = rlx_exp2(mrow[r] - ((mn > -RLX_INF) ? mn : 0.f));
        mrow[r] = mn;
        lrow[r] *= alpha[r];
      }
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        o[dt][0] *= alpha[0]; o[dt][1] *= alpha[0]; o[dt][2] *= alpha[1]; o[dt][3] *= alpha[1];
      }
    }
    // the next tile's S runs on the tensor cores from here (no other instruction may write
    // an accumulator of a wgmma in flight: O was rescaled above)
    rlx_wg_settle<D / 2>(&o[0][0]);
    if (t + 1 < n) qk(sn, t + 1);
    const float mu0 = mrow[0] > -RLX_INF ? mrow[0] : 0.f;
    const float mu1 = mrow[1] > -RLX_INF ? mrow[1] : 0.f;
    u32 pa[BN / 16][4];
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
      float p[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        p[e] = rlx_exp2(fmaf(sc[nt][e], sm, -(e < 2 ? mu0 : mu1)));
        lrow[e >> 1] += p[e];
      }
      pa[nt >> 1][(nt & 1) * 2] = rlx_pack(p[0], p[1]);
      pa[nt >> 1][(nt & 1) * 2 + 1] = rlx_pack(p[2], p[3]);
    }
    rlx_bar_wait(bar(1, t), (t >> 1) & 1);
    const unsigned long long vd = rlx_desc(vslot(t), @V_LBO@, @V_SBO@);
    RLX_WG_FENCE();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) rlx_wg_pv(&o[0][0], pa[kk], vd + ((kk * 16 * 128) >> 4));
    RLX_WG_COMMIT();
    RLX_WG_WAIT0();                                  // this P V and the next tile's S
    rlx_wg_settle<D / 2>(&o[0][0]);
    rlx_wg_settle<BN / 2>(&sn[0][0]);
    if (t + 1 < n) rlx_bar_arrive(bar(2, t + 1));    // K of tile t + 1 and V of tile t are read
    rlx_bar_arrive(bar(3, t));
  }
};
extern "C" __global__ void __launch_bounds__(256, 1) rlx_attn_wg(
    const $T* __restrict__ q, long long qsb, long long qsh, long long qss,
    const void* tk, const void* tv,
    const $TM* __restrict__ mask, long long m0, long long m1, long long m2, long long m3,
    const $TP* __restrict__ pos, $T* __restrict__ out, long long osb, long long osh, long long oss,
    int B, int H, int KVH, int Sq, int Sk, double scale_d, double cap_d, int window) {
  extern __shared__ __align__(1024) unsigned char rlx_smem[];
  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2;
  const int h = blockIdx.y, b = blockIdx.z;
  rlx_wg_attn a;
  const unsigned Qs = ((unsigned)__cvta_generic_to_shared(rlx_smem) + 1023) & ~1023u;   // 1024-byte swizzle atoms
  a.KV0 = Qs + BM * D * 2;             // then two slots, each K and V of a tile
  a.bars = a.KV0 + 4 * BN * D * 2;     // then the 8 mbarriers
  a.qdesc = rlx_desc(Qs + wg * 64 * 128, 16, 1024);
  a.tk = tk; a.tv = tv;
  a.mask = mask; a.m0 = m0; a.m1 = m1; a.m2 = m2; a.m3 = m3;
  a.b = b; a.h = h; a.kvh = h / (H / KVH); a.tg = lane & 3; a.window = window; a.tid = tid;
  a.Sq = Sq; a.Sk = Sk;
  a.scale = (float)scale_d; a.cap = (float)cap_d; a.scale2 = a.scale * RLX_LOG2E;
  a.scale_d = scale_d; a.cap_d = cap_d;
  a.q0 = (i64)blockIdx.x * BM;
#if $HAS_POS
  a.p0 = (i64)pos[b];
#else
  a.p0 = (i64)(Sk - Sq);
#endif
  const i64 qlast = min(a.q0 + BM, (i64)Sq) - 1;
  i64 kend = Sk, kbeg = 0;
  if ($MASKKIND >= 1) kend = min((i64)Sk, a.p0 + qlast + 1);
  if ($MASKKIND == 2) kbeg = max((i64)0, a.p0 + a.q0 - window + 1);
  a.kbeg = kbeg;
  a.n = kbeg < kend ? (int)((kend - kbeg + BN - 1) / BN) : 0;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) a.o[dt][0] = a.o[dt][1] = a.o[dt][2] = a.o[dt][3] = 0.f;
  rlx_wg_settle<D / 2>(&a.o[0][0]);   // zeroed before any wgmma is in flight
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    a.mrow[r] = -RLX_INF;
    a.lrow[r] = 0.f;
    a.qi[r] = a.q0 + wg * 64 + warp * 16 + g + 8 * r;
    a.qp[r] = a.p0 + a.qi[r];
  }
  // prologue: the barriers; Q by every thread's copies; K of tiles 0 and 1 and V of tile 0
  // by the copy engine; S of tile 0
  if (tid == 0) {
    for (int i = 0; i < 8; ++i) rlx_bar_init(a.bars + i * 8, i < 4 ? 1 : 256);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (tid == 0 && a.n > 0) {
    a.fetch(tk, a.kslot(0), a.bar(0, 0), 0);
    if (a.n > 1) a.fetch(tk, a.kslot(1), a.bar(0, 1), 1);
    a.fetch(tv, a.vslot(0), a.bar(1, 0), 0);
  }
  const rlx_wg_loader load(tid);
  load(Qs, q + b * qsb + h * qsh, qss, a.q0, Sq);
  RLX_CP_COMMIT();
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  float sa[BN / 8][4], sb[BN / 8][4];
  if (a.n > 0) {
    a.qk(sa, 0);
    RLX_WG_WAIT0();
    rlx_wg_settle<BN / 2>(&sa[0][0]);
    rlx_bar_arrive(a.bar(2, 0));
  }
  for (int t = 0; t < a.n; t += 2) {
    a.tile(t, sa, sb);
    if (t + 1 < a.n) a.tile(t + 1, sb, sa);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = a.lrow[r];
    l += SHFL_XOR(l, 1);
    l += SHFL_XOR(l, 2);
    if (a.qi[r] >= Sq) continue;
    const float inv = l == 0.f ? 0.f : 1.f / l;
    $T* orow = out + b * osb + h * osh + a.qi[r] * oss;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *(u32*)(orow + dt * 8 + a.tg * 2) = rlx_pack(a.o[dt][2 * r] * inv, a.o[dt][2 * r + 1] * inv);
  }
}
"""


def attn_wg_source(D: int, **subs) -> str:
    """ATTN_WG for head_dim D (64 or 128), its wgmma operand lists written out."""
    def regs(n):
        return ", ".join(f"%{i}" for i in range(n))

    def outs(n):
        return ", ".join(f'"+f"(d[{i}])' for i in range(n))
    h = D // 2                                    # O's accumulator registers; then P's four, V's descriptor
    src = (ATTN_WG.replace("@S_REGS@", regs(64)).replace("@S_OUTS@", outs(64))
           .replace("@O_REGS@", regs(h)).replace("@O_OUTS@", outs(h)).replace("@D@", str(D))
           .replace("@A0@", str(h)).replace("@A1@", str(h + 1)).replace("@A2@", str(h + 2))
           .replace("@A3@", str(h + 3)).replace("@B@", str(h + 4)).replace("@ONE@", str(h + 5))
           .replace("@V_LBO@", str(BN_WG * 128)).replace("@V_SBO@", "1024"))
    return render(src, D=D, BF16=int(subs.get("MMAT") == "bf16"), **subs)


BN_WG = 128         # keys a tile (ATTN_WG's BN)


def attn_wg_smem(D: int) -> int:
    """Dynamic shared memory of ATTN_WG: Q, two slots of K and V, 1024 bytes of alignment, the mbarriers."""
    return (128 + 4 * BN_WG) * D * 2 + 1024 + 64


# --------------------------------------------------------------------------- matmul helpers
# Decode GEMV: y[M, N] = x[M, K] @ W[N, K]^T for small M, 16-bit data: $KS warps per $R
# rows of W, 16-byte loads, $U of them in flight per row and lane (the weight bytes bound
# a decode step, so the loads are issued before any arithmetic). Few rows: more warps per
# row, so more loads are in flight and each warp waits for fewer of them in turn. SWIGLU: W is [2N, K]
# (gate rows, then up rows); the warp computes gate row n and up row n + N and writes
# silu(gate) * up, each rounded to $TO first as the unfused matmul would.
GEMV = r"""
extern "C" __global__ void __launch_bounds__(256) rlx_gemv(const $T* __restrict__ x, long long xrs,
    const $T* __restrict__ w, $TO* __restrict__ y, int M, int N, int K) {
  constexpr int KS = $KS;           // warps per row (each a KS-th of the row's 512-byte chunks)
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, part = wib % KS;
  const int n = blockIdx.x * (8 / KS) + wib / KS;
#if $SWIGLU
  const bool live = n < N;
#else
  const bool live = n * $R < N;
#endif
  if (KS == 1 && !live) return;     // (with KS > 1 the row's warps meet at a barrier below)
  const uint4* wr[$R];
#pragma unroll
  for (int r = 0; r < $R; ++r) {
#if $SWIGLU
    const int row = min(n, N - 1) + r * N;
#else
    const int row = min(n * $R + r, N - 1);
#endif
    wr[r] = (const uint4*)(w + (i64)row * K);
  }
  const int KV = K / 8;
  uint4 wv[$U][$R];
#define RLX_LOAD_W(c0) \
  _Pragma("unroll") for (int u = 0; u < $U; ++u) \
  _Pragma("unroll") for (int r = 0; r < $R; ++r) \
    wv[u][r] = (c0) + 32 * KS * u < KV ? __ldg(wr[r] + (c0) + 32 * KS * u) : make_uint4(0u, 0u, 0u, 0u);
  // the weights depend on no earlier kernel: the first iteration's loads are issued before
  // the wait for the kernel that writes x (device.Kernel). The 1B-shape decode graph on the
  // H100: 1.157 ms; with an L2 prefetch of each row's first 4 KB there instead, 1.358 ms.
  const int first = part * 32 + lane;
  RLX_LOAD_W(first)
  RLX_GRID_WAIT();
  float acc[$R][$MMAX];
#pragma unroll
  for (int r = 0; r < $R; ++r)
#pragma unroll
    for (int m = 0; m < $MMAX; ++m) acc[r][m] = 0.f;
  for (int c0 = first; c0 < KV; c0 += 32 * $U * KS) {
    if (c0 != first) {
      RLX_LOAD_W(c0)
    }
#pragma unroll
    for (int u = 0; u < $U; ++u) {
      const int c = c0 + 32 * KS * u;
      if (c >= KV) break;
#pragma unroll
      for (int m = 0; m < $MMAX; ++m) {
        if (m < M) {
          const uint4 xv = *(const uint4*)(x + m * xrs + c * 8);
          const $T* xp = (const $T*)&xv;
          float xf[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) xf[e] = tof(xp[e]);
#pragma unroll
          for (int r = 0; r < $R; ++r) {
            const $T* wp = (const $T*)&wv[u][r];
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[r][m] += tof(wp[e]) * xf[e];
          }
        }
      }
    }
  }
  float s[$MMAX][$R];
#pragma unroll
  for (int m = 0; m < $MMAX; ++m)
#pragma unroll
    for (int r = 0; r < $R; ++r) s[m][r] = m < M ? warp_sum(acc[r][m]) : 0.f;
  if (KS > 1) {                     // the row's warps add their parts in a fixed order
    __shared__ float red[8][$MMAX][$R];
    if (lane == 0)
#pragma unroll
      for (int m = 0; m < $MMAX; ++m)
#pragma unroll
        for (int r = 0; r < $R; ++r) red[wib][m][r] = s[m][r];
    __syncthreads();
    if (part != 0 || !live) return;
#pragma unroll
    for (int m = 0; m < $MMAX; ++m)
#pragma unroll
      for (int r = 0; r < $R; ++r) {
        float t = red[wib][m][r];
#pragma unroll
        for (int p = 1; p < KS; ++p) t += red[wib + p][m][r];
        s[m][r] = t;
      }
  }
  if (lane != 0) return;
#pragma unroll
  for (int m = 0; m < $MMAX; ++m) {
    if (m >= M) continue;
#if $SWIGLU
    const float g = tof(ST($TO, s[m][0])), u = tof(ST($TO, s[m][1]));
    y[(i64)m * N + n] = ST($TO, g * rlx_sigmoid(g) * u);
#else
#pragma unroll
    for (int r = 0; r < $R; ++r)
      if (n * $R + r < N) y[(i64)m * N + n * $R + r] = ST($TO, s[m][r]);
#endif
  }
}
"""

# Fallback matmul for integer / bool data (cuBLAS covers the float types).
MATMUL_NAIVE = r"""
#define RLX_MAC(s, a, b) ($MAC)
extern "C" __global__ void rlx_matmul_naive(const $TA* __restrict__ a, const $TB* __restrict__ b,
    $TO* __restrict__ c, long long batch, int M, int N, int K,
    long long sab, long long sam, long long sak, long long sbb, long long sbk, long long sbn) {
  const i64 total = batch * M * N;
  for (i64 o = blockIdx.x * (i64)blockDim.x + threadIdx.x; o < total; o += (i64)gridDim.x * blockDim.x) {
    const int n = (int)(o % N); const i64 t = o / N; const int m = (int)(t % M); const i64 bi = t / M;
    $ACC s = 0;
    for (int kk = 0; kk < K; ++kk)
      s = RLX_MAC(s, ($ACC)a[bi * sab + m * sam + kk * sak], ($ACC)b[bi * sbb + kk * sbk + n * sbn]);
    c[o] = ($TO)s;
  }
}
"""


# --------------------------------------------------------------------------- packed weights
# Packed (GGUF / RLX int block) weights, layouts in rlx_core/ir/quant.py. A row is K / BLK
# blocks of BPB bytes; each block is cut into PARTS parts, the unit one lane decodes: a part's
# bytes are loaded into registers (`rlx_raw`, `rlx_load`), then taken RUNS times as 4
# consecutive weights at element offset `rlx_run_off(p, k)` of the block, as a word of 4
# bytes b (`rlx_qword`) and a scale d and offset m (`rlx_scale`): weight = d * (b - BIAS) + m
# (m only where HAS_MIN). One snippet per format (DQ_SCHEMES) serves every kernel below.
# A byte becomes an exact float in two full-rate instructions (a byte permute into the
# mantissa of 2^23, a subtraction; no int-to-float conversion), and the GEMV factors d and m
# out of each 4-run's dot product, so a weight costs about three instructions. W = $ACC (f32,
# f64 for f64 data). $A: the alignment (2..16 bytes) of the row base and row length, so loads
# are as wide as the offsets allow: `rlx_ldw<AL, N>` loads N 32-bit words at a byte offset
# aligned to AL within the row (2-aligned offsets in 4-aligned rows: aligned words + funnel
# shifts).
DQ_COMMON = r"""
typedef $ACC W;
typedef unsigned char u8;
typedef unsigned short u16;
__device__ __forceinline__ W rlx_h2w(u32 h) { return (W)__half2float(__ushort_as_half((u16)(h & 0xffffu))); }
__device__ __forceinline__ int rlx_byte(u32 v, int i) { return (int)((v >> (8 * i)) & 255u); }
// bits 0..3 of h at bits 0, 8, 16, 24
__device__ __forceinline__ u32 rlx_spread4(u32 h) { return ((h & 15u) * 0x00204081u) & 0x01010101u; }
template <int AL, int N> __device__ __forceinline__ void rlx_ldw(const u8* p, u32* w) {
  constexpr int al = AL < $A ? AL : $A;
  if constexpr (al >= 16 && N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const uint4 v = __ldg((const uint4*)p + i);
      w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
    }
  } else if constexpr (al >= 8 && N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) { const uint2 v = __ldg((const uint2*)p + i); w[2 * i] = v.x; w[2 * i + 1] = v.y; }
  } else if constexpr (al >= 4) {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = __ldg((const u32*)p + i);
  } else if constexpr ($A >= 4) {
    // a 2-aligned offset in a 4-aligned row: the aligned words around it, shifted; the extra
    // word lies inside the row (the row ends 4-aligned, the bytes asked for 2 bytes before)
    const u32* q = (const u32*)((size_t)p & ~(size_t)3);
    const int sh = (int)((size_t)p & 2) * 8;
    u32 lo = __ldg(q);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const u32 hi = (i + 1 < N || sh) ? __ldg(q + i + 1) : 0u;
      w[i] = __funnelshift_r(lo, hi, sh);
      lo = hi;
    }
  } else {
    const u16* q = (const u16*)p;
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = (u32)__ldg(q + 2 * i) | ((u32)__ldg(q + 2 * i + 1) << 16);
  }
}
"""

# after a snippet: byte i of a q-word as the exact float (b - BIAS)
DQ_QF = r"""
__device__ __forceinline__ float rlx_qf(u32 qw, int i) {
  return __int_as_float(__byte_perm(qw, 0x4B00u, 0x5440u | (u32)i)) - (8388608.0f + (float)BIAS);
}
"""

# Legacy GGUF formats: a part is 8 bytes of nibbles (16 weights: 4-runs at 8p, 8p+4 from the
# low nibbles, 16 further on from the high ones) or 16 int8 bytes (q8_0).
_DQ_NIB = r"""
#define BLK 32
#define PARTS 2
#define RUNS 4
__device__ __forceinline__ int rlx_run_off(int p, int k) { return 8 * p + 4 * (k & 1) + 16 * (k >> 1); }
__device__ __forceinline__ u32 rlx_nibs(const u32* q, int k) { return (q[k & 1] >> (4 * (k >> 1))) & 0x0F0F0F0Fu; }
"""

DQ_SCHEMES = {
    "q4_0": _DQ_NIB + r"""
#define BPB 18
#define BIAS 8
#define HAS_MIN 0
struct rlx_raw { u32 q[2]; u32 d; };
__device__ __forceinline__ rlx_raw rlx_load(const u8* b, int p) {
  rlx_raw r; r.d = __ldg((const u16*)b); rlx_ldw<2, 2>(b + 2 + 8 * p, r.q); return r;
}
__device__ __forceinline__ u32 rlx_qword(const rlx_raw& r, int p, int k) { return rlx_nibs(r.q, k); }
__device__ __forceinline__ void rlx_scale(const rlx_raw& r, int p, int k, W* d, W* m) { *d = rlx_h2w(r.d); }
""",
    "q4_1": _DQ_NIB + r"""
#define BPB 20
#define BIAS 0
#define HAS_MIN 1
struct rlx_raw { u32 q[2]; u32 dm; };
__device__ __forceinline__ rlx_raw rlx_load(const u8* b, int p) {
  rlx_raw r; rlx_ldw<4, 1>(b, &r.dm); rlx_ldw<4, 2>(b + 4 + 8 * p, r.q); return r;
}
__device__ __forceinline__ u32 rlx_qword(const rlx_raw& r, int p, int k) { return rlx_nibs(r.q, k); }
__device__ __forceinline__ void rlx_scale(const rlx_raw& r, int p, int k, W* d, W* m) {
  *d = rlx_h2w(r.dm); *m = rlx_h2w(r.dm >> 16);
}
""",
    "q5_0": _DQ_NIB + r"""
#define BPB 22
#define BIAS 16
#define HAS_MIN 0
struct rlx_raw { u32 q[2]; u32 qh; u32 d; };
__device__ __forceinline__ rlx_raw rlx_load(const u8* b, int p) {
  rlx_raw r; r.d = __ldg((const u16*)b); rlx_ldw<2, 1>(b + 2, &r.qh); rlx_ldw<2, 2>(b + 6 + 8 * p, r.q); return r;
}
__device__ __forceinline__ u32 rlx_qword(const rlx_raw& r, int p, int k) {
  return rlx_nibs(r.q, k) | (rlx_spread4(r.qh >> rlx_run_off(p, k)) << 4);
}
__device__ __forceinline__ void rlx_scale(const rlx_raw& r, int p, int k, W* d, W* m) { *d = rlx_h2w(r.d); }
""",
    "q5_1": _DQ_NIB + r"""
#define BPB 24
#define BIAS 0
#define HAS_MIN 1
struct rlx_raw { u32 q[2]; u32 qh; u32 dm; };
__device__ __forceinline__ rlx_raw rlx_load(const u8* b, int p) {
  rlx_raw r; rlx_ldw<4, 1>(b, &r.dm); rlx_ldw<4, 1>(b + 4, &r.qh); rlx_ldw<8, 2>(b + 8 + 8 * p, r.q); return r;
}
__device__ __forceinline__ u32 rlx_qword(const rlx_raw& r, int p, int k) {
  return rlx_nibs(r.q, k) | (rlx_spread4(r.qh >> rlx_run_off(p, k)) << 4);
}
__device__ __forceinline__ void rlx_scale(const rlx_raw& r, int p, int k, W* d, W* m) {
  *d = rlx_h2w(r.dm); *m = rlx_h2w(r.dm >> 16);
}
""",
    "q8_0": r"""
#define BLK 32
#define BPB 34
#define PARTS 2
#define RUNS 4
#define BIAS 128
#define HAS_MIN 0
struct rlx_raw { u32 q[4]; u32 d; };
__device__ __forceinline__ int rlx_run_off(int p, int k) { return 16 * p + 4 * k; }
__device__ __forceinline__ rlx_raw rlx_load(const u8* b, int p) {
  rlx_raw r; r.d = __ldg((const u16*)b); rlx_ldw<2, 4>(b + 2 + 16 * p, r.q); return r;
}
__device__ __forceinline__ u32 rlx_qword(const rlx_raw& r, int p, int k) { return r.q[k] ^ 0x80808080u; }
__device__ __forceinline__ void rlx_scale(const rlx_raw& r, int p, int k, W* d, W* m) { *d = rlx_h2w(r.d); }
""",
    # RLX int blocks of $IB weights: f32 scale, then int8 values / q4_0-style nibbles
    "int8": r"""
#define BLK $IB
#define BPB (4 + $IB)
#define PARTS ($IB / 8)
#define RUNS 2
#define BIAS 128
#define HAS_MIN 0
struct rlx_raw { u32 q[2]; u32 d; };
__device__ __forceinline__ int rlx_run_off(int p, int k) { return 8 * p + 4 * k; }
__device__ __forceinline__ rlx_raw rlx_load(const u8* b, int p) {
  rlx_raw r; rlx_ldw<4, 1>(b, &r.d); rlx_ldw<4, 2>(b + 4 + 8 * p, r.q); return r;
}
__device__ __forceinline__ u32 rlx_qword(const rlx_raw& r, int p, int k) { return r.q[k] ^ 0x80808080u; }
__device__ __forceinline__ void rlx_scale(const rlx_raw& r, int p, int k, W* d, W* m) { *d = (W)__uint_as_float(r.d); }
""",
    "int4": r"""
#define BLK $IB
#define BPB (4 + $IB / 2)
#define PARTS ($IB / 8)
#define RUNS 2
#define BIAS 8
#define HAS_MIN 0
struct rlx_raw { u32 q; u32 d; };
__device__ __forceinline__ int rlx_run_off(int p, int k) { return 4 * p + k * ($IB / 2); }
__device__ __forceinline__ rlx_raw rlx_load(const u8* b, int p) {
  rlx_raw r; rlx_ldw<4, 1>(b, &r.d); rlx_ldw<4, 1>(b + 4 + 4 * p, &r.q); return r;
}
__device__ __forceinline__ u32 rlx_qword(const rlx_raw& r, int p, int k) { return (r.q >> (4 * k)) & 0x0F0F0F0Fu; }
__device__ __forceinline__ void rlx_scale(const rlx_raw& r, int p, int k, W* d, W* m) { *d = (W)__uint_as_float(r.d); }
""",
}

# K-quants, super-blocks of 256. Q4_K/Q5_K: part p = half (p & 1) of 64-element chunk p >> 1:
# 16 nibble bytes whose low nibbles are 16 weights of sub-block 2c, high ones of 2c + 1 (runs
# 0-3 and 4-7); the 16-byte header (d, dmin, six-bit scales) comes along.
_DQ_K45 = r"""
#define BLK 256
#define PARTS 8
#define RUNS 8
#define BIAS 0
#define HAS_MIN 1
__device__ __forceinline__ int rlx_run_off(int p, int k) { return 64 * (p >> 1) + 16 * (p & 1) + 4 * (k & 3) + 32 * (k >> 2); }
// the part's two sub-blocks 2c, 2c+1 (c = p >> 1): llama.cpp get_scale_min_k4 over the 12
// scale bytes (header words 1..3), four sub-blocks at a time, decoded once per part:
// weight = (d * sc) * q - dmin * mn
__device__ __forceinline__ void rlx_k_scales(rlx_raw& r, const u32* hd, int p) {
  const int c = p >> 1, sh = 16 * (c & 1);            // byte 2c & 3 of the words
  const u32 sc = c < 2 ? hd[1] & 0x3F3F3F3Fu : (hd[3] & 0x0F0F0F0Fu) | ((hd[1] >> 2) & 0x30303030u);
  const u32 mn = c < 2 ? hd[2] & 0x3F3F3F3Fu : ((hd[3] >> 4) & 0x0F0F0F0Fu) | ((hd[2] >> 2) & 0x30303030u);
  const W d = rlx_h2w(hd[0]), dmin = rlx_h2w(hd[0] >> 16);
  r.d[0] = d * (W)((sc >> sh) & 255u); r.d[1] = d * (W)((sc >> (sh + 8)) & 255u);
  r.m[0] = -(dmin * (W)((mn >> sh) & 255u)); r.m[1] = -(dmin * (W)((mn >> (sh + 8)) & 255u));
}
__device__ __forceinline__ void rlx_scale(const rlx_raw& r, int p, int k, W* d, W* m) {
  *d = r.d[k >> 2]; *m = r.m[k >> 2];
}
"""

DQ_SCHEMES["q4_k"] = r"""
#define BPB 144
struct rlx_raw { u32 q[4]; W d[2]; W m[2]; };
""" + _DQ_K45 + r"""
__device__ __forceinline__ rlx_raw rlx_load(const u8* b, int p) {
  rlx_raw r; u32 hd[4]; rlx_ldw<16, 4>(b, hd); rlx_ldw<16, 4>(b + 16 + 16 * p, r.q); rlx_k_scales(r, hd, p); return r;
}
__device__ __forceinline__ u32 rlx_qword(const rlx_raw& r, int p, int k) {
  return (r.q[k & 3] >> (4 * (k >> 2))) & 0x0F0F0F0Fu;
}
"""

DQ_SCHEMES["q5_k"] = r"""
#define BPB 176
struct rlx_raw { u32 qh[4]; u32 q[4]; W d[2]; W m[2]; };
""" + _DQ_K45 + r"""
__device__ __forceinline__ rlx_raw rlx_load(const u8* b, int p) {
  rlx_raw r; u32 hd[4]; rlx_ldw<16, 4>(b, hd); rlx_ldw<16, 4>(b + 16 + 16 * (p & 1), r.qh);
  rlx_ldw<16, 4>(b + 48 + 16 * p, r.q); rlx_k_scales(r, hd, p); return r;
}
__device__ __forceinline__ u32 rlx_qword(const rlx_raw& r, int p, int k) {
  const int j = 2 * (p >> 1) + (k >> 2);        // sub-block: bit j of each qh byte
  return ((r.q[k & 3] >> (4 * (k >> 2))) & 0x0F0F0F0Fu) | (((r.qh[k & 3] >> j) & 0x01010101u) << 4);
}
"""

# Q6_K: part p = 8 lanes l in [8j, 8j + 8) (j = p & 3) of half n = p >> 2; quarter t of the
# half takes low (t < 2) or high nibbles of ql[64n + l] (t even) / ql[64n + 32 + l] (t odd)
# and bits 2t, 2t+1 of qh[32n + l]; runs k = 2t + (4-run within the 8 lanes).
DQ_SCHEMES["q6_k"] = r"""
#define BLK 256
#define BPB 210
#define PARTS 8
#define RUNS 8
#define BIAS 32
#define HAS_MIN 0
struct rlx_raw { u32 a[2]; u32 b[2]; u32 h[2]; W d[4]; };
__device__ __forceinline__ int rlx_run_off(int p, int k) { return 128 * (p >> 2) + 32 * (k >> 1) + 8 * (p & 3) + 4 * (k & 1); }
__device__ __forceinline__ rlx_raw rlx_load(const u8* b, int p) {
  const int n = p >> 2, j = p & 3;
  rlx_raw r;
  rlx_ldw<2, 2>(b + 64 * n + 8 * j, r.a); rlx_ldw<2, 2>(b + 64 * n + 32 + 8 * j, r.b);
  u32 s[2];
  rlx_ldw<2, 2>(b + 128 + 32 * n + 8 * j, r.h); rlx_ldw<2, 2>(b + 192 + 8 * n, s);
  const W d = rlx_h2w(__ldg((const u16*)(b + 208)));
  const u32 sw = (j >> 1) ? __funnelshift_r(s[0], s[1], 8) : s[0];   // scales j>>1 + 2t, t = 0..3
#pragma unroll
  for (int t = 0; t < 4; ++t) r.d[t] = d * (W)(signed char)rlx_byte(t < 2 ? sw : (j >> 1) ? s[1] >> 8 : s[1], 2 * (t & 1));
  return r;
}
__device__ __forceinline__ u32 rlx_qword(const rlx_raw& r, int p, int k) {
  const int t = k >> 1, half = k & 1;
  const u32 lo = (t & 1) ? r.b[half] : r.a[half];
  return ((lo >> (4 * (t >> 1))) & 0x0F0F0F0Fu) | (((r.h[half] >> (2 * t)) & 0x03030303u) << 4);
}
__device__ __forceinline__ void rlx_scale(const rlx_raw& r, int p, int k, W* d, W* m) { *d = r.d[k >> 1]; }
"""

# 4 consecutive x values as W (one vector load where $XV says x rows and offsets allow it)
DQ_X4 = r"""
struct alignas(4 * sizeof($T)) rlx_x4t { $T v[4]; };
__device__ __forceinline__ void rlx_x4(const $T* p, W* o) {
#if $XV
  const rlx_x4t t = *(const rlx_x4t*)p;
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = LD(W, t.v[i]);
#else
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = LD(W, p[i]);
#endif
}
"""

# Decode: y[M, N] = act(x[M, K] @ dequant(w)^T + bias) for M <= $MMAX <= 8. A block is 8
# warps: $KW of them split a row's parts, 8 / $KW take $R rows each, so x is read once per
# $R rows. Each lane loads its next $U parts of every row first (the packed bytes bound a
# decode step), then decodes them in registers. Partial sums meet in shared memory; the
# epilogue rounds like the unfused ops (to $TO, + bias, round, activation). SWIGLU: w is
# [2N, K] (gate rows, then up rows); a warp's first $R/2 rows are gate rows, the others the
# up rows of the same outputs, and y[M, N] = silu(gate) * up, each rounded to $TO first.
DQ_GEMV = DQ_X4 + r"""
extern "C" __global__ void __launch_bounds__(256) rlx_dq_gemv(const $T* __restrict__ x, long long xrs,
    const u8* __restrict__ w, long long wrs, const $TB* __restrict__ bias, $TO* __restrict__ y,
    int M, int N, int nb) {
  constexpr int RW = 8 / $KW, OUTR = $SWIGLU ? $R / 2 : $R;     // outputs per warp
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kw = warp % $KW, rw = warp / $KW;
  const int n0 = (blockIdx.x * RW + rw) * OUTR;
  const u8* wr[$R];
#pragma unroll
  for (int r = 0; r < $R; ++r) wr[r] = w + (i64)(min(n0 + r % OUTR, N - 1) + (r / OUTR) * N) * wrs;
  const int units = nb * PARTS, first = kw * 32 + lane;
  rlx_raw q[$U][$R];
#define RLX_LOAD_Q(u0) \
  _Pragma("unroll") for (int u = 0; u < $U; ++u) { \
    const int uu = (u0) + 32 * $KW * u; \
    if (uu < units) \
      _Pragma("unroll") for (int r = 0; r < $R; ++r) q[u][r] = rlx_load(wr[r] + (i64)(uu / PARTS) * BPB, uu % PARTS); \
  }
  // the packed rows depend on no earlier kernel: the first iteration's loads are issued
  // before the wait (as in GEMV). q4_k 1B-shape decode on the H100: 0.940 -> 0.896 ms/token;
  // an L2 prefetch of each row's first 4 KB beside them made no difference (0.903)
  RLX_LOAD_Q(first)
  RLX_GRID_WAIT();
  W acc[$R][$MMAX];
#pragma unroll
  for (int r = 0; r < $R; ++r)
#pragma unroll
    for (int m = 0; m < $MMAX; ++m) acc[r][m] = 0;
  for (int u0 = first; u0 < units; u0 += 32 * $KW * $U) {
    if (u0 != first) {
      RLX_LOAD_Q(u0)
    }
#pragma unroll
    for (int u = 0; u < $U; ++u) {
      const int uu = u0 + 32 * $KW * u;
      if (uu >= units) break;
      const int p = uu % PARTS;
      const i64 e0 = (i64)(uu / PARTS) * BLK;
#pragma unroll
      for (int k = 0; k < RUNS; ++k) {
        const i64 e = e0 + rlx_run_off(p, k);
        W xv[$MMAX][4], xs[$MMAX];
#pragma unroll
        for (int m = 0; m < $MMAX; ++m)
          if (m < M) {
            rlx_x4(x + m * xrs + e, xv[m]);
            xs[m] = HAS_MIN ? (xv[m][0] + xv[m][1]) + (xv[m][2] + xv[m][3]) : (W)0;
          }
#pragma unroll
        for (int r = 0; r < $R; ++r) {
          W d, mn = 0;
          rlx_scale(q[u][r], p, k, &d, &mn);
          const u32 qw = rlx_qword(q[u][r], p, k);
          W qf[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) qf[i] = (W)rlx_qf(qw, i);
#pragma unroll
          for (int m = 0; m < $MMAX; ++m)
            if (m < M) {
              const W s = qf[0] * xv[m][0] + qf[1] * xv[m][1] + qf[2] * xv[m][2] + qf[3] * xv[m][3];
              acc[r][m] += HAS_MIN ? d * s + mn * xs[m] : d * s;
            }
        }
      }
    }
  }
  __shared__ W red[8][$R][$MMAX];
#pragma unroll
  for (int r = 0; r < $R; ++r)
#pragma unroll
    for (int m = 0; m < $MMAX; ++m) {
      const W s = warp_sum(acc[r][m]);
      if (lane == 0) red[warp][r][m] = s;
    }
  __syncthreads();
  for (int t = threadIdx.x; t < RW * OUTR * $MMAX; t += blockDim.x) {
    const int g = t / (OUTR * $MMAX), r = (t / $MMAX) % OUTR, m = t % $MMAX;
    const int n = (blockIdx.x * RW + g) * OUTR + r;
    if (m >= M || n >= N) continue;
    W v = 0;
#pragma unroll
    for (int j = 0; j < $KW; ++j) v += red[g * $KW + j][r][m];
#if $SWIGLU
    W u = 0;
#pragma unroll
    for (int j = 0; j < $KW; ++j) u += red[g * $KW + j][r + OUTR][m];
    v = LD(W, ST($TO, v));
    v = v * rlx_sigmoid(v) * LD(W, ST($TO, u));
#else
    $EPILOGUE
#endif
    y[(i64)m * N + n] = ST($TO, v);
  }
}
"""

# Dequantize rows into a contiguous y [rows, K]. STAGE: a tile of $BPT blocks (one run of
# elements of y) is decoded into shared memory, a part per thread, then written with 16-byte
# stores ($YV) so the writes coalesce (a part's own runs are scattered over its block); blocks
# too large for a tile are decoded straight into y.
DQ_DEQUANT = r"""
extern "C" __global__ void __launch_bounds__($THREADS) rlx_dequant(const u8* __restrict__ w, long long wrs,
    $TO* __restrict__ y, long long rows, int nb) {
  const i64 blocks = rows * nb;
#if $STAGE
  __shared__ __align__(16) $TO tile[$BPT * BLK];
  for (i64 g0 = (i64)blockIdx.x * $BPT; g0 < blocks; g0 += (i64)gridDim.x * $BPT) {
    const int nbl = (int)min((i64)$BPT, blocks - g0);
    for (int t = threadIdx.x; t < nbl * PARTS; t += blockDim.x) {
      const int lb = t / PARTS, p = t % PARTS;
      const i64 g = g0 + lb, row = g / nb;
      const rlx_raw q = rlx_load(w + row * wrs + (g - row * nb) * BPB, p);
      $TO* yr = tile + lb * BLK;
#else
  for (i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x; t < blocks * PARTS; t += (i64)gridDim.x * blockDim.x) {
    {
      const i64 g = t / PARTS, row = g / nb;
      const int p = (int)(t % PARTS);
      const rlx_raw q = rlx_load(w + row * wrs + (g - row * nb) * BPB, p);
      $TO* yr = y + g * BLK;
#endif
#pragma unroll
      for (int k = 0; k < RUNS; ++k) {
        W d, mn = 0;
        rlx_scale(q, p, k, &d, &mn);
        const u32 qw = rlx_qword(q, p, k);
        const int o = rlx_run_off(p, k);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const W qf = (W)rlx_qf(qw, i);
          yr[o + i] = ST($TO, HAS_MIN ? qf * d + mn : qf * d);
        }
      }
    }
#if $STAGE
    __syncthreads();
    $TO* dst = y + g0 * BLK;
    const int n = nbl * BLK;
#if $YV
    for (int i = threadIdx.x; i < n * (int)sizeof($TO) / 16; i += blockDim.x) ((uint4*)dst)[i] = ((const uint4*)tile)[i];
#else
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = tile[i];
#endif
    __syncthreads();
#endif
  }
}
"""


def dq_source(kernel: str, kind: str, block: int, **subs) -> str:
    """A packed-weight kernel (DQ_GEMV / DQ_DEQUANT) for scheme `kind` (block: the int
    schemes' block size)."""
    return render(DQ_COMMON + DQ_SCHEMES[kind] + DQ_QF + kernel, IB=block, **subs)


def dq_dequant_shape(kind: str, block: int, itemsize: int) -> dict:
    """STAGE, BPT (blocks per tile), THREADS of DQ_DEQUANT: tiles of 4096 weights (one block
    where blocks are larger) staged in shared memory up to 32 KiB, else no staging."""
    bpt = max(1, 4096 // block)
    stage = int(bpt * block * itemsize <= 32768)
    return {"STAGE": stage, "BPT": bpt, "THREADS": min(bpt * dq_parts(kind, block), 512) if stage else 256}


def dq_parts(kind: str, block: int) -> int:
    """Parts per block of a scheme's snippet (its PARTS)."""
    return block // 8 if kind in ("int8", "int4") else {"q4_k": 8, "q5_k": 8, "q6_k": 8}.get(kind, 2)


# Decode attention over a short KV cache (one query row per head): one block per (batch, kv
# head), no split over blocks and so no merge. Its G heads' q rows go to shared memory; each
# thread scores whole keys (all its K rows loaded first, VK-element loads along the row: a
# warp reads 32 consecutive rows); one warp per head turns its row of scores into
# probabilities; then each warp sums P.V over every NW-th key, a lane per D/32 head dims (its
# first value rows were loaded with the keys, later ones 8 at a time), and the warps' sums
# meet in shared memory.
# The split kernel's 96 small blocks and cross-block merge made a Llama-3.2-1B decode layer's
# attention latency-bound (11.6 us on an H100 for 1.2 MB of K/V at batch 1).
ATTN_SHORT = ATTN_MASK + ATTN_VEC + r"""
#define NT $NT
#define NW ($NT / 32)
extern "C" __global__ void __launch_bounds__($NT) rlx_attn_short(
    const $TQ* __restrict__ q, long long qsb, long long qsh,
    const $TK* __restrict__ k, long long ksb, long long ksh, long long kss,
    const $TV* __restrict__ v, long long vsb, long long vsh, long long vss,
    const $TM* __restrict__ mask, long long m0, long long m1, long long m3,
    const $TP* __restrict__ pos, int H, int KVH, int Sk, double scale_d, double cap_d, int window,
    $TO* __restrict__ out, long long osb, long long osh) {
  typedef float ACC;
  constexpr int G = $G, D = $D, SK = $SK, VK = $VK, VD = D / 32;
  constexpr int SH = G * SK > NW * G * D ? G * SK : NW * G * D;
  __shared__ ACC sq[G * D];
  __shared__ ACC sh[SH];          // scores, then probabilities, then the warps' P.V sums
  __shared__ ACC s_l[G];
  const int b = blockIdx.x / KVH, kvh = blockIdx.x % KVH;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const ACC scale = (ACC)scale_d, cap = (ACC)cap_d;
  for (int t = tid; t < G * D; t += NT)
    sq[t] = LD(ACC, q[b * qsb + (kvh * G + t / D) * qsh + t % D]);
#if $HAS_POS
  const i64 p0 = (i64)pos[b];
#else
  const i64 p0 = (i64)(Sk - 1);
#endif
  i64 kbeg = 0, kend = Sk;
  if ($MASKKIND >= 1) kend = max((i64)0, min((i64)Sk, p0 + 1));
  if ($MASKKIND == 2) kbeg = min(kend, max((i64)0, p0 - window + 1));
  __syncthreads();
  // every thread's key rows (SK <= U1 * NT keys) and its warp's first UP value rows are
  // loaded before any score is computed: one round trip to memory for most of the work
  constexpr int U1 = (SK + NT - 1) / NT, NV = D / VK, UV = 8;
  constexpr int UP = (SK + NW - 1) / NW < 2 * UV ? (SK + NW - 1) / NW : 2 * UV;
  const $TK* kb = k + b * ksb + kvh * ksh;
  const $TV* vb = v + b * vsb + kvh * vsh + lane * VD;
  RlxVec<$TK, VK> kr[U1][NV];
#pragma unroll
  for (int u = 0; u < U1; ++u) {
    const i64 j = kbeg + tid + u * NT;
#pragma unroll
    for (int n = 0; n < NV; ++n) kr[u][n] = rlx_vload<VK>(kb + j * kss + n * VK, j < kend);
  }
  RlxVec<$TV, VD> vp[UP];
#pragma unroll
  for (int u = 0; u < UP; ++u) vp[u] = rlx_vload<VD>(vb + (kbeg + warp + u * NW) * vss, kbeg + warp + u * NW < kend);
#pragma unroll
  for (int u = 0; u < U1; ++u) {
    const i64 j = kbeg + tid + u * NT;
    if (j >= kend) continue;
    ACC s[G];
#pragma unroll
    for (int g = 0; g < G; ++g) s[g] = 0;
#pragma unroll
    for (int n = 0; n < NV; ++n)
#pragma unroll
      for (int e = 0; e < VK; ++e) {
        const ACC x = LD(ACC, kr[u][n].v[e]);
#pragma unroll
        for (int g = 0; g < G; ++g) s[g] += sq[g * D + n * VK + e] * x;
      }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      ACC x = s[g] * scale;
      if (cap_d != 0.0) x = tanh(x / cap) * cap;
      bool keep = true;
#if $MASKMODE == 1
      keep = mask[b * m0 + (kvh * G + g) * m1 + j * m3] != 0;
#elif $MASKMODE == 2
      x = x + LD(ACC, mask[b * m0 + (kvh * G + g) * m1 + j * m3]);
#endif
      sh[g * SK + j] = keep ? x : -(ACC)RLX_INF;
    }
  }
  __syncthreads();
  for (int g = warp; g < G; g += NW) {
    ACC* row = sh + g * SK;
    ACC mx = -(ACC)RLX_INF;
    for (i64 j = kbeg + lane; j < kend; j += 32) mx = row[j] > mx ? row[j] : mx;
    mx = warp_max(mx);
    const bool live = mx > -(ACC)RLX_INF;
    ACC sum = 0;
    for (i64 j = kbeg + lane; j < kend; j += 32) {
      const ACC p = live ? exp(row[j] - mx) : (ACC)0;
      row[j] = p;
      sum += p;
    }
    sum = warp_sum(sum);
    if (lane == 0) s_l[g] = sum;
  }
  __syncthreads();
  ACC acc[G][VD];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < VD; ++e) acc[g][e] = 0;
  // P.V: warp w takes keys w, w + NW, ...: the UP it holds, then UV rows at a time
#pragma unroll
  for (int u = 0; u < UP; ++u) {
    const i64 j = kbeg + warp + u * NW;
    if (j >= kend) break;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const ACC p = sh[g * SK + j];
#pragma unroll
      for (int e = 0; e < VD; ++e) acc[g][e] += p * LD(ACC, vp[u].v[e]);
    }
  }
  for (i64 j0 = kbeg + warp + UP * NW; j0 < kend; j0 += NW * UV) {
    RlxVec<$TV, VD> vv[UV];
#pragma unroll
    for (int u = 0; u < UV; ++u) vv[u] = rlx_vload<VD>(vb + (j0 + u * NW) * vss, j0 + u * NW < kend);
#pragma unroll
    for (int u = 0; u < UV; ++u) {
      const i64 j = j0 + u * NW;
      if (j >= kend) break;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const ACC p = sh[g * SK + j];
#pragma unroll
        for (int e = 0; e < VD; ++e) acc[g][e] += p * LD(ACC, vv[u].v[e]);
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < VD; ++e) sh[(warp * G + g) * D + lane * VD + e] = acc[g][e];
  __syncthreads();
  for (int t = tid; t < G * D; t += NT) {
    const int g = t / D, d = t % D;
    ACC o = 0;
#pragma unroll
    for (int w = 0; w < NW; ++w) o += sh[(w * G + g) * D + d];
    const ACC l = s_l[g];
    out[b * osb + (kvh * G + g) * osh + d] = ST($TO, l == 0 ? (ACC)0 : o / l);
  }
}
"""


# ----------------------------------------------------------------------------- launch shapes
ATTN_THREADS = 128       # threads of a split-K decode attention block (ops.py may override)
ATTN_LOADS = 2           # vector loads per lane for K and for V in one key tile


ATTN_SHORT_THREADS = 512
ATTN_SHORT_KEYS = 512           # cache positions up to which the short kernel is used (one key a thread)
ATTN_SHORT_SMEM = 44 * 1024     # bytes of shared memory it may take


def attn_short_shape(g: int, d: int, sk: int, vk: int) -> dict | None:
    """ATTN_SHORT's compile-time shape for G query heads per kv head, head dim d (both K and
    V), a KV cache of sk positions and vk-element K loads; None where it does not apply
    (d not a multiple of 32 or over 256, G over 8, sk over ATTN_SHORT_KEYS, shared memory
    over ATTN_SHORT_SMEM)."""
    nt = ATTN_SHORT_THREADS
    if (d % 32 or d > 256 or g > 8 or d % vk or sk > ATTN_SHORT_KEYS
            or 4 * max(g * sk, nt // 32 * g * d) + 4 * g * d > ATTN_SHORT_SMEM):
        return None
    return dict(NT=nt, G=g, D=d, SK=sk, VK=vk)


def attn_split_shape(dk: int, dv: int, vk: int, vv: int, rows: int, accsz: int, threads: int = ATTN_THREADS,
                     loads: int = ATTN_LOADS) -> dict | None:
    """The split-K attention's compile-time shape (sources.ATTN_SPLIT) for head dims dk/dv
    read vk/vv elements per load, `rows` (query, head) rows per kv head, accumulating in
    accsz-byte floats, blocks of `threads` with `loads` vector loads per lane and tile; None when
    the head dims are too large. (Here, not in ops.py, so the kernel catalog can build the same
    shapes without importing the op builders.)"""
    if dk > 512 or dv > 512:
        return None

    def lanes(d, w):          # lanes per key row (a power of two <= 32), loads per lane
        vecs = -(-d // w)
        n = 1
        while n < min(vecs, 32):
            n *= 2
        return n, -(-vecs // n)
    nt = threads
    tpk, nvk = lanes(dk, vk)
    tpv, nvv = lanes(dv, vv)
    # keys per tile: `loads` vector loads per lane for K and for V, each lane group one key
    tile = max(nt // tpk, nt // tpv)
    while tile * 2 * max(tpk * nvk, tpv * nvv) <= nt * loads:
        tile *= 2
    r = 1
    while r < min(rows, 8):
        r *= 2

    def smem(r):              # bytes: two tiles of scores or the warps' sums, row stats, merge weights
        return (max(2 * r * (tile + 1), nt // 32 * r * dv) + 3 * r + nt // 32 * 64) * accsz
    while r > 1 and (smem(r) > 44 * 1024 or r * max(nvk * vk, nvv * vv) > 64):
        r //= 2
    if smem(r) > 48 * 1024:
        return None
    return dict(ROWS=r, NT=nt, TILE=tile, VK=vk, TPK=tpk, NVK=nvk, VV=vv, TPV=tpv, NVV=nvv)
