"""The backend's CUDA C++ kernels run on the CPU, for tests on machines without a GPU.

`compile_kernel(source, name)` builds a kernel source (sources.render's text: the prelude,
defines, parts) with the host C++ compiler against a small emulation of what the kernels use
from CUDA: 16-bit float types, vector types, warp shuffles, block barriers, atomics, dp4a,
the bit intrinsics and thread block clusters. `launch(grid, block, args, shared_mem)` runs the
clusters (of an `RLX_CLUSTER` kernel, the prelude's `__cluster_dims__`; else single blocks)
one after another, each as one OS thread per CUDA thread of its blocks (a barrier for
__syncthreads, one per warp for the shuffles, one for the cluster, so a warp whose lanes do not
all reach a shuffle hangs, as on the GPU it would be undefined; a barrier waiting a minute aborts the process, so
such a test fails rather than hangs). Each block has its own static shared arrays, which its
cluster's blocks push into (`rlx_push`, its mbarriers emulated). Inline PTX (tensor cores,
griddepcontrol) is not emulated: a kernel holding it outside `#ifdef __CUDA_ARCH__` fails to
compile here; tc.cu's mma.sync, ldmatrix and cp.async have `rlx_emu_*` forms for its `#else`.
Slow, for small shapes: a check of the kernel's arithmetic and indexing, not of its speed or
memory ordering."""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

SHIM = r"""
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>
#define __device__
#define __global__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) alignas(n)
using std::min; using std::max; using std::isfinite; using std::isnan; using std::isinf;
struct dim3 { unsigned x = 1, y = 1, z = 1; };
static thread_local dim3 threadIdx, blockIdx;
static thread_local unsigned rlx_emu_rank;       // the block's rank in its cluster
static dim3 blockDim, gridDim;
static unsigned char* rlx_emu_dyn;
struct uint4 { unsigned x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) int2 { int x, y; };
struct alignas(8) uint2 { unsigned x, y; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
template <class A, class B> inline A rlx_bits(B v) { A a; std::memcpy(&a, &v, sizeof(A)); return a; }
inline float __int_as_float(int v) { return rlx_bits<float>(v); }
inline float __uint_as_float(unsigned v) { return rlx_bits<float>(v); }
inline int __float_as_int(float v) { return rlx_bits<int>(v); }
inline unsigned __float_as_uint(float v) { return rlx_bits<unsigned>(v); }
// 16-bit floats: storage and round-to-nearest-even conversions
inline float rlx_h2f(uint16_t h) {
  const unsigned s = (h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
  if (e == 31) return rlx_bits<float>(s | 0x7f800000u | (m << 13));
  if (e == 0) { const float v = std::ldexp((float)m, -24); return s ? -v : v; }
  return rlx_bits<float>(s | ((e + 112) << 23) | (m << 13));
}
inline uint16_t rlx_f2h(float f) {
  const unsigned u = rlx_bits<unsigned>(f), s = (u >> 16) & 0x8000u;
  const float a = std::fabs(f);
  if (std::isnan(f)) return (uint16_t)(s | 0x7e00u);
  if (a >= 65520.f) return (uint16_t)(s | 0x7c00u);
  if (a < 6.103515625e-05f) return (uint16_t)(s | (unsigned)std::nearbyint(a * 16777216.f));  // subnormal
  unsigned e = ((rlx_bits<unsigned>(a) >> 23) & 255) - 112, m = rlx_bits<unsigned>(a) & 0x7fffffu;
  unsigned r = (e << 10) | (m >> 13), rest = m & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (r & 1))) ++r;
  return (uint16_t)(s | r);
}
inline uint16_t rlx_f2bf(float f) {
  const unsigned u = rlx_bits<unsigned>(f);
  if (std::isnan(f)) return (uint16_t)((u >> 16) | 0x40u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}
struct __half {
  uint16_t b;
  __half() = default;
  explicit __half(float f) : b(rlx_f2h(f)) {}
  operator float() const { return rlx_h2f(b); }
};
struct __nv_bfloat16 {
  uint16_t b;
  __nv_bfloat16() = default;
  explicit __nv_bfloat16(float f) : b(rlx_f2bf(f)) {}
  operator float() const { return rlx_bits<float>((unsigned)b << 16); }
};
inline float __half2float(__half h) { return rlx_h2f(h.b); }
inline __half __float2half_rn(float f) { __half h; h.b = rlx_f2h(f); return h; }
inline __half __double2half(double d) { return __float2half_rn((float)d); }
inline __half __ushort_as_half(unsigned short v) { __half h; h.b = v; return h; }
inline float __bfloat162float(__nv_bfloat16 h) { return (float)h; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { __nv_bfloat16 h; h.b = rlx_f2bf(f); return h; }
inline __nv_bfloat16 __double2bfloat16(double d) { return __float2bfloat16_rn((float)d); }
// bit intrinsics
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = ((uint64_t)y << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 255) << (8 * i);
  return r;
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned sh) {
  return (unsigned)(((((uint64_t)hi) << 32) | lo) >> (sh & 31));
}
inline int __dp4a(int a, int b, int c) {
  for (int i = 0; i < 4; ++i) c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
  return c;
}
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
inline double rsqrt(double v) { return 1.0 / std::sqrt(v); }
inline float rsqrt(float v) { return rsqrtf(v); }
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
// threads: a barrier for the block, one a warp for the shuffles. A wait of a minute aborts the
// process (threads that never meet: a test fails rather than hangs)
struct rlx_emu_bar {
  std::mutex mu;
  std::condition_variable cv;
  unsigned n, waiting = 0;
  unsigned long long phase = 0;
  explicit rlx_emu_bar(unsigned count) : n(count) {}
  void release() { waiting = 0; ++phase; cv.notify_all(); }
  // arrive, and the phase to wait out (wait)
  unsigned long long arrive() {
    std::lock_guard<std::mutex> l(mu);
    const unsigned long long ph = phase;
    if (++waiting == n) release();
    return ph;
  }
  void wait(unsigned long long ph) {
    std::unique_lock<std::mutex> l(mu);
    if (!cv.wait_for(l, std::chrono::seconds(60), [&] { return phase != ph; })) {
      std::fprintf(stderr, "cuda_emu: threads of a block or lanes of a warp never met at a barrier\n");
      std::abort();
    }
  }
  void arrive_and_wait() { wait(arrive()); }
  void arrive_and_drop() {
    std::lock_guard<std::mutex> l(mu);
    if (--n && waiting == n) release();
  }
};
// a block: its barrier, its warps' barriers and shuffle slots, its shared arrays (id, bytes)
struct rlx_emu_arr { int id; unsigned char* base; size_t size; };
struct rlx_emu_blk {
  std::unique_ptr<rlx_emu_bar> bar;
  std::vector<std::unique_ptr<rlx_emu_bar>> warps;
  uint64_t slot[32][32];
  uint32_t wx[32][32][6];                  // a warp's lanes' tensor-core operands (rlx_emu_mma16816)
  const void* wp[32][32];                  // and addresses (rlx_emu_ldmatrix_x4)
  std::mutex mu;
  std::vector<rlx_emu_arr> arrs;
  rlx_emu_blk(unsigned n) : bar(new rlx_emu_bar(n)) {
    for (unsigned w = 0; w < (n + 31) / 32; ++w)
      warps.emplace_back(new rlx_emu_bar(std::min(32u, n - 32 * w)));
  }
  ~rlx_emu_blk() { for (auto& a : arrs) std::free(a.base); }
  rlx_emu_arr* find(int id) {
    for (auto& a : arrs) if (a.id == id) return &a;
    return nullptr;
  }
};
static thread_local rlx_emu_blk* rlx_emu_me;                 // this thread's block
static thread_local std::vector<std::unique_ptr<rlx_emu_blk>>* rlx_emu_cluster;
static thread_local rlx_emu_bar* rlx_emu_cbar;
static std::mutex rlx_emu_atomic;
// a `__shared__ A name;` of the kernel source (_host_text): this block's instance, zeroed
template <class A> inline A& rlx_emu_shared(int id) {
  rlx_emu_blk& k = *rlx_emu_me;
  std::lock_guard<std::mutex> g(k.mu);
  rlx_emu_arr* a = k.find(id);
  if (!a) {
    const size_t size = (sizeof(A) + 127) / 128 * 128;
    k.arrs.push_back({id, (unsigned char*)std::aligned_alloc(128, size), sizeof(A)});
    a = &k.arrs.back();
    std::memset(a->base, 0, size);
  }
  return *reinterpret_cast<A*>(a->base);
}
inline void __syncthreads() { rlx_emu_me->bar->arrive_and_wait(); }
// a thread's index in its block (warps are 32 of these, as on the GPU: blocks of x, y, z threads)
inline unsigned rlx_emu_tid() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }
inline void __syncwarp(unsigned = 0xffffffffu) { rlx_emu_me->warps[rlx_emu_tid() >> 5]->arrive_and_wait(); }
inline void __threadfence() {}
// a lane's value from lane `src(lane)` of its warp (the lane's own where that is out of range)
template <class T, class F> inline T rlx_emu_shfl(T v, F src) {
  const int lane = rlx_emu_tid() & 31, w = rlx_emu_tid() >> 5, n = (int)rlx_emu_me->warps[w]->n;
  std::memcpy(&rlx_emu_me->slot[w][lane], &v, sizeof(T));
  rlx_emu_me->warps[w]->arrive_and_wait();
  const int from = src(lane);
  T o;
  std::memcpy(&o, &rlx_emu_me->slot[w][from >= 0 && from < n ? from : lane], sizeof(T));
  rlx_emu_me->warps[w]->arrive_and_wait();
  return o;
}
template <class T> inline T __shfl_xor_sync(unsigned, T v, int m) {
  return rlx_emu_shfl(v, [&](int l) { return l ^ m; });
}
template <class T> inline T __shfl_up_sync(unsigned, T v, unsigned d) {
  return rlx_emu_shfl(v, [&](int l) { return l - (int)d; });
}
template <class T> inline T __shfl_down_sync(unsigned, T v, unsigned d) {
  return rlx_emu_shfl(v, [&](int l) { return l + (int)d; });
}
template <class T> inline T __shfl_sync(unsigned, T v, int s) {
  return rlx_emu_shfl(v, [&](int) { return s & 31; });
}
// the warp's vote: its lanes' predicates as bits (every lane of the warp takes part)
inline unsigned __ballot_sync(unsigned, int p) {
  const int lane = rlx_emu_tid() & 31, w = rlx_emu_tid() >> 5;
  rlx_emu_me->slot[w][lane] = p != 0;
  rlx_emu_me->warps[w]->arrive_and_wait();
  unsigned bits = 0;
  for (unsigned l = 0; l < rlx_emu_me->warps[w]->n; ++l) bits |= (unsigned)rlx_emu_me->slot[w][l] << l;
  rlx_emu_me->warps[w]->arrive_and_wait();
  return bits;
}
inline int __any_sync(unsigned m, int p) { return __ballot_sync(m, p) != 0; }
inline int __all_sync(unsigned m, int p) { return __ballot_sync(m, !p) == 0; }
// clusters (what the prelude's cluster helpers take from sm_90's PTX on the GPU)
inline unsigned rlx_cluster_rank() { return rlx_emu_rank; }
static thread_local unsigned long long rlx_emu_cphase;  // the cluster barrier's phase this thread arrived at
inline void rlx_cluster_arrive() { rlx_emu_cphase = rlx_emu_cbar->arrive(); }
inline void rlx_cluster_wait() { rlx_emu_cbar->wait(rlx_emu_cphase); }
// where p (an address in one of this block's shared arrays) lies in block `rank`'s same array
template <class T> inline T* rlx_emu_at(T* p, unsigned rank) {
  const unsigned char* c = (const unsigned char*)p;
  int id = -1;
  size_t off = 0;
  {
    std::lock_guard<std::mutex> g(rlx_emu_me->mu);
    for (auto& a : rlx_emu_me->arrs)
      if (c >= a.base && c < a.base + a.size) { id = a.id; off = c - a.base; }
  }
  rlx_emu_blk& o = *(*rlx_emu_cluster).at(rank);
  std::lock_guard<std::mutex> g(o.mu);
  rlx_emu_arr* a = id < 0 ? nullptr : o.find(id);
  if (!a) { std::fprintf(stderr, "cuda_emu: a cluster access to no shared array\n"); std::abort(); }
  return (T*)(a->base + off);
}
// mbarriers of pushes (the prelude's rlx_push*), their state in their 8 bytes, under one lock
struct rlx_emu_mbar { int32_t tx; uint8_t pending, phase; };
static std::mutex rlx_emu_mb_mu;
static std::condition_variable rlx_emu_mb_cv;
inline void rlx_emu_mb_done(rlx_emu_mbar* m) {
  if (m->pending == 0 && m->tx == 0) { m->pending = 1; m->phase ^= 1; rlx_emu_mb_cv.notify_all(); }
}
inline void rlx_push_start(unsigned long long* bars, int n) {
  static_assert(sizeof(rlx_emu_mbar) <= sizeof(unsigned long long), "an mbarrier's 8 bytes");
  if (rlx_emu_tid() == 0) {
    std::lock_guard<std::mutex> g(rlx_emu_mb_mu);
    for (int i = 0; i < n; ++i) *(rlx_emu_mbar*)(bars + i) = {0, 1, 0};
  }
  rlx_cluster_arrive();
  rlx_cluster_wait();
}
inline void rlx_push_expect(unsigned long long* bar, unsigned bytes) {
  std::lock_guard<std::mutex> g(rlx_emu_mb_mu);
  rlx_emu_mbar* m = (rlx_emu_mbar*)bar;
  if (m->pending != 1) { std::fprintf(stderr, "cuda_emu: a second arrival in one mbarrier phase\n"); std::abort(); }
  m->tx += (int32_t)bytes;
  m->pending = 0;
  rlx_emu_mb_done(m);
}
inline void rlx_emu_push(float* p, unsigned rank, const float* v, int n, unsigned long long* bar) {
  float* q = rlx_emu_at(p, rank);
  rlx_emu_mbar* m = (rlx_emu_mbar*)rlx_emu_at(bar, rank);
  std::lock_guard<std::mutex> g(rlx_emu_mb_mu);
  std::memcpy(q, v, n * sizeof(float));
  m->tx -= n * (int32_t)sizeof(float);
  rlx_emu_mb_done(m);
}
inline void rlx_push(float* p, unsigned rank, float v, unsigned long long* bar) { rlx_emu_push(p, rank, &v, 1, bar); }
inline void rlx_push2(float* p, unsigned rank, float v0, float v1, unsigned long long* bar) {
  const float v[2] = {v0, v1};
  rlx_emu_push(p, rank, v, 2, bar);
}
inline void rlx_push_wait(unsigned long long* bar, unsigned parity) {
  std::unique_lock<std::mutex> l(rlx_emu_mb_mu);
  rlx_emu_mbar* m = (rlx_emu_mbar*)bar;
  if (!rlx_emu_mb_cv.wait_for(l, std::chrono::seconds(60), [&] { return m->phase != parity; })) {
    std::fprintf(stderr, "cuda_emu: an mbarrier phase never completed\n");
    std::abort();
  }
}
// tc.cu's PTX: mma.sync m16n8k16 (row.col, bf16 or f16 operands, f32 accumulators) and
// ldmatrix x4, as the warp collectives they are (each lane puts its operands in the warp's
// slots, the warp meets, each lane builds its own fragment from every lane's, the warp meets
// again before the slots are reused; fragment layouts as PTX's ISA gives them); cp.async lands
// at once (a legal order: the kernel waits before it reads)
inline float rlx_emu_b16(uint32_t w, int half, bool bf16) {
  const uint16_t h = (uint16_t)(w >> (16 * half));
  return bf16 ? rlx_bits<float>((unsigned)h << 16) : rlx_h2f(h);
}
inline void rlx_emu_mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1, bool bf16) {
  rlx_emu_blk& me = *rlx_emu_me;
  const unsigned lane = rlx_emu_tid() & 31, w = rlx_emu_tid() >> 5;
  uint32_t* mine = me.wx[w][lane];
  for (int i = 0; i < 4; ++i) mine[i] = a[i];
  mine[4] = b0;
  mine[5] = b1;
  me.warps[w]->arrive_and_wait();
  // A[r][k]: lane (r % 8) * 4 + (k % 8) / 2, register (r >= 8) + 2 (k >= 8); B[k][n]: lane
  // n * 4 + (k % 8) / 2, register b0 / b1 by k >= 8; the low half the even k
  float d[4];
  for (int i = 0; i < 4; ++i) {
    const int r = (int)lane / 4 + 8 * (i >> 1), n = (int)(lane % 4) * 2 + (i & 1);
    float acc = c[i];
    for (int k = 0; k < 16; ++k)
      acc += rlx_emu_b16(me.wx[w][(r % 8) * 4 + (k % 8) / 2][(r >= 8) + 2 * (k >= 8)], k & 1, bf16) *
             rlx_emu_b16(me.wx[w][n * 4 + (k % 8) / 2][4 + (k >= 8)], k & 1, bf16);
    d[i] = acc;
  }
  me.warps[w]->arrive_and_wait();
  for (int i = 0; i < 4; ++i) c[i] = d[i];
}
// four 8x8 matrices of 16-bit values, lanes 8i..8i+7 giving matrix i's row addresses: lane t
// gets row t / 4, columns 2 (t % 4) and + 1 (trans: column t / 4 of those rows)
inline void rlx_emu_ldmatrix_x4(uint32_t* r, const unsigned short* p, bool trans) {
  rlx_emu_blk& me = *rlx_emu_me;
  const unsigned lane = rlx_emu_tid() & 31, w = rlx_emu_tid() >> 5;
  me.wp[w][lane] = p;
  me.warps[w]->arrive_and_wait();
  uint32_t got[4];
  for (int i = 0; i < 4; ++i) {
    auto at = [&](unsigned row, unsigned col) { return ((const unsigned short*)me.wp[w][8 * i + row])[col]; };
    const unsigned c = 2 * (lane % 4);
    const uint32_t lo = trans ? at(c, lane / 4) : at(lane / 4, c);
    const uint32_t hi = trans ? at(c + 1, lane / 4) : at(lane / 4, c + 1);
    got[i] = lo | (hi << 16);
  }
  me.warps[w]->arrive_and_wait();
  for (int i = 0; i < 4; ++i) r[i] = got[i];
}
inline void rlx_emu_cp16(void* dst, const void* src, int bytes) {
  std::memset(dst, 0, 16);
  std::memcpy(dst, src, (size_t)bytes);
}
template <class T> inline T atomicAdd(T* p, T v) {
  std::lock_guard<std::mutex> g(rlx_emu_atomic);
  T o = *p; *p = o + v; return o;
}
inline int atomicCAS(int* p, int c, int v) {
  std::lock_guard<std::mutex> g(rlx_emu_atomic);
  int o = *p; if (o == c) *p = v; return o;
}
// the clusters of `cl` blocks one after another, all threads of a cluster's blocks at once
template <class F> void rlx_emu_run(dim3 grid, dim3 block, dim3 cl, F body) {
  blockDim = block; gridDim = grid;
  const unsigned n = block.x * block.y * block.z, per = cl.x * cl.y * cl.z;
  for (unsigned cz = 0; cz < grid.z; cz += cl.z)
    for (unsigned cy = 0; cy < grid.y; cy += cl.y)
      for (unsigned cx = 0; cx < grid.x; cx += cl.x) {
        std::vector<std::unique_ptr<rlx_emu_blk>> blks;
        for (unsigned r = 0; r < per; ++r) blks.emplace_back(new rlx_emu_blk(n));
        rlx_emu_bar cbar(n * per);
        std::vector<std::thread> ts;
        for (unsigned r = 0; r < per; ++r)
          for (unsigned t = 0; t < n; ++t)
            ts.emplace_back([&, t, r] {
              threadIdx = {t % block.x, t / block.x % block.y, t / (block.x * block.y)};
              blockIdx = {cx + r % cl.x, cy + r / cl.x % cl.y, cz + r / (cl.x * cl.y)};
              rlx_emu_rank = r;
              rlx_emu_me = blks[r].get();
              rlx_emu_cluster = &blks;
              rlx_emu_cbar = &cbar;
              body();
              rlx_emu_me->warps[t >> 5]->arrive_and_drop();   // (a thread that returned early leaves them)
              rlx_emu_me->bar->arrive_and_drop();
              cbar.arrive_and_drop();
            });
        for (auto& t : ts) t.join();
      }
}
"""

_SCALARS = {"int": ctypes.c_int, "long long": ctypes.c_longlong, "float": ctypes.c_float,
            "double": ctypes.c_double, "unsigned int": ctypes.c_uint}
_SIG = re.compile(r'extern "C" __global__ void ((?:(?:__\w+__|RLX_CLUSTER)\([^)]*\) )*)(\w+)\((.*?)\)\s*\{',
                  re.S)
_SHARED = re.compile(r"(?<!extern )__shared__ (?:__align__\(\d+\) )?([\w ]+?) (\w+(?:\[[^\]]+\])*"
                     r"(?:, \w+(?:\[[^\]]+\])*)*);")
_DECL = re.compile(r"(\w+)((?:\[[^\]]+\])*)")


def why_not() -> str:
    """'' where kernels can run here, else why not (no host C++20 compiler)."""
    return "" if shutil.which("g++") else "no g++ on this machine to build the emulated kernels"


# the mark of a test running kernels here: skipped with the reason where they cannot
emulated = pytest.mark.skipif(bool(why_not()), reason=why_not() or "-")


def _host_text(source: str) -> str:
    """The kernel source as host C++: CUDA's headers left out (the shim stands for them), each
    dynamic shared array pointed at the launch's buffer, each static one a reference to its
    block's instance (rlx_emu_shared: one id a declaration)."""
    source = re.sub(r"#include <cuda_(fp16|bf16)\.h>", "", source)
    source = re.sub(r"extern __shared__ (?:__align__\(\d+\) )?([\w ]+?) (\w+)\[\];",
                    r"\1* \2 = (\1*)rlx_emu_dyn;", source)
    ids = iter(range(1 << 30))

    def per_block(m):
        return " ".join(f"auto& {name} = rlx_emu_shared<{m.group(1)}{dims}>({next(ids)});"
                        for name, dims in _DECL.findall(m.group(2)))
    return _SHARED.sub(per_block, source)


_FN_MACRO = re.compile(r"^#define (\w+)\((\w+)\) ((?:[^\n]*\\\n)*[^\n]*)", re.M)


def _expanded(params: str, text: str) -> str:
    """A parameter list with the source's one-argument function-like macros expanded (rlx_rope's
    jobs: RLX_JOB(0), RLX_JOB(1), ..), their ## pastes done."""
    macros = {m.group(1): (m.group(2), m.group(3).replace("\\\n", " ")) for m in _FN_MACRO.finditer(text)}

    def expand(m):
        arg, body = macros[m.group(1)]
        body = re.sub(rf"\s*##\s*{arg}\b", m.group(2), body)
        return re.sub(rf"\b{arg}\b", m.group(2), body)
    if not macros:
        return params
    return re.sub(rf"\b({'|'.join(map(re.escape, macros))})\((\w+)\)", expand, params)


def _params(sig: str, text: str) -> list:
    """The C types of a parameter list, scalar type names resolved through the source's typedefs
    and defines (i64, W = ACC, ...)."""
    names = {name: t for t, name in re.findall(r"^typedef ([\w ]+?) (\w+);", text, re.M)}
    names.update(re.findall(r"^#define (\w+) (float|double|int|long long|unsigned int)$", text, re.M))
    out = []
    for p in (q.strip() for q in sig.split(",")):
        t = re.sub(r"\s*\b\w+$", "", p).replace("__restrict__", "").strip()
        while not t.endswith("*") and t in names and names[t] != t:
            t = names[t]
        out.append(t)
    return out


class Kernel:
    """A compiled kernel: call as launch(grid, block, args, shared_mem) with NumPy arrays for
    pointers (passed by address, whatever their dtype: bf16 arrays as they are) and NumPy
    scalars (or None for a null pointer) for the rest."""

    def __init__(self, lib, types: list):
        self.fn, self.types = lib.rlx_emu_launch, types

    def launch(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        if len(args) != len(self.types):
            raise ValueError(f"{len(self.types)} arguments expected, got {len(args)}")
        keep, ptrs = [], []
        for t, a in zip(self.types, args):
            if t.endswith("*"):
                c = ctypes.c_void_p(None if a is None else a.ctypes.data)
            else:
                c = _SCALARS[t](a.item() if hasattr(a, "item") else a)
            keep.append(c)
            ptrs.append(ctypes.addressof(c))
        smem = np.zeros(max(shared_mem, 16), np.uint8)
        g, b = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
        self.fn(*(ctypes.c_uint(v) for v in g + b), ctypes.c_void_p(smem.ctypes.data),
                (ctypes.c_void_p * len(ptrs))(*ptrs))


def aligned(a: np.ndarray) -> np.ndarray:
    """a's copy at a 64-byte aligned address (the kernels' vector loads assume it)."""
    raw = np.empty(a.nbytes + 64, np.uint8)
    off = (-raw.ctypes.data) % 64
    out = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def compile_kernel(source: str, name: str, cache: str | None = None) -> Kernel:
    """Kernel `name` of `source` built as a host shared library (cached by the text's hash)."""
    text = _host_text(source)
    sig = next((m for m in _SIG.finditer(text) if m.group(2) == name), None)
    if sig is None:
        raise ValueError(f"no kernel {name!r} in the source")
    types = _params(_expanded(sig.group(3), text), text)
    call = ", ".join(f"*({t}*)a[{i}]" for i, t in enumerate(types))
    cl = re.search(r"RLX_CLUSTER\(([^)]*)\)", sig.group(1))
    launcher = (f'\nextern "C" void rlx_emu_launch(unsigned gx, unsigned gy, unsigned gz, unsigned bx, '
                f'unsigned by, unsigned bz, unsigned char* smem, void** a) {{\n  rlx_emu_dyn = smem;\n'
                f'  rlx_emu_run({{gx, gy, gz}}, {{bx, by, bz}}, {{{cl.group(1) if cl else "1, 1, 1"}}}, '
                f'[&] {{ {name}({call}); }});\n}}\n')
    full = SHIM + text + launcher
    cache = cache or os.path.join(tempfile.gettempdir(), "rlx_cuda_emu")
    os.makedirs(cache, exist_ok=True)
    so = os.path.join(cache, hashlib.sha1(full.encode()).hexdigest()[:20] + ".so")
    if not os.path.exists(so):
        src = so[:-3] + ".cpp"
        with open(src, "w") as f:
            f.write(full)
        cmd = ["g++", "-std=c++20", "-O0", "-shared", "-fPIC", "-w", "-o", so + ".tmp", src, "-lpthread"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"building kernel {name!r} on the host failed:\n{r.stderr[-3000:]}")
        os.replace(so + ".tmp", so)
    return Kernel(ctypes.CDLL(so), types)
