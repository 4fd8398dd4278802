// What every kernel source starts with (sources.render puts it first): the CUDA / HIP
// spellings, loads and stores of every storage type, NaN-propagating max / min, warp and
// block reductions, the error flag. bf16 data lives in 16-bit buffers and is read and written
// as __nv_bfloat16, f16 as __half; both compute in f32.
//
// HIP: the CUDA spellings map to HIP's (hip_fp16.h, hip_bf16.h, lane shuffles without
// masks). Warp-level code uses logical 32-lane groups and xor masks < 32, so it also holds on
// 64-wide wavefronts. The tensor-core attention kernels use inline PTX and are compiled only
// for CUDA (the runner never picks them on ROCm).
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
// Thread block clusters (sm_90): RLX_CLUSTER(x, y, z) before a kernel's name makes clusters of
// x * y * z blocks (nothing elsewhere: the runner picks such a kernel only where clusters exist,
// or launches it at size 1); a block's rank in its cluster, the cluster's barrier (relaxed,
// split) and floats pushed into another block's shared memory. (A host build, tests/cuda_emu.py,
// brings its own and reads the kernel's cluster shape from RLX_CLUSTER itself.)
#if !defined(RLX_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define RLX_CLUSTER(x, y, z) __cluster_dims__(x, y, z)
__device__ __forceinline__ unsigned rlx_cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// A cluster barrier ordering no memory, split (its relaxed arrive): the reads a block made before
// rlx_cluster_arrive, their values used, are done before any block passes rlx_cluster_wait, so
// another block may then overwrite what was read (a block's shared memory, or bytes in place)
__device__ __forceinline__ void rlx_cluster_arrive() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void rlx_cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }
// Floats the cluster's blocks push into each other's shared memory (st.async), each push counted
// by the receiver's mbarrier at the same offset: rlx_push_start (every thread) sets a block's
// barriers before any block pushes; a phase completes when its one arrival (rlx_push_expect,
// the bytes it awaits) and those bytes are in. No GPU-wide fence: a release cluster barrier
// compiles to MEMBAR.ALL.GPU, where ncu found gated_delta_net's warps stalled (H100)
__device__ __forceinline__ unsigned rlx_shared_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ unsigned rlx_mapa(const void* p, unsigned rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(rlx_shared_addr(p)), "r"(rank));
  return r;
}
__device__ __forceinline__ void rlx_push_start(unsigned long long* bars, int n) {
  if (threadIdx.x + threadIdx.y + threadIdx.z == 0)
    for (int i = 0; i < n; ++i)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n\tfence.mbarrier_init.release.cluster;"
                   :: "r"(rlx_shared_addr(bars + i)) : "memory");
  rlx_cluster_arrive();
  rlx_cluster_wait();
}
__device__ __forceinline__ void rlx_push_expect(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(rlx_shared_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void rlx_push(float* p, unsigned rank, float v, unsigned long long* bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];"
               :: "r"(rlx_mapa(p, rank)), "f"(v), "r"(rlx_mapa(bar, rank)) : "memory");
}
__device__ __forceinline__ void rlx_push2(float* p, unsigned rank, float v0, float v1, unsigned long long* bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];"
               :: "r"(rlx_mapa(p, rank)), "f"(v0), "f"(v1), "r"(rlx_mapa(bar, rank)) : "memory");
}
__device__ __forceinline__ void rlx_push_wait(unsigned long long* bar, unsigned parity) {
  asm volatile("{\n\t.reg .pred done;\n\tWAIT:\n\t"
               "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n\t"
               "@!done bra WAIT;\n\t}" :: "r"(rlx_shared_addr(bar)), "r"(parity) : "memory");
}
#else
#define RLX_CLUSTER(x, y, z)
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
// The NORM decode GEMVs (gemv.cu, dq.cu; ops.GemvSums): this lane's part of each x row's sum of
// squares (nsq: 32 parts a row), loaded once the grid wait returned, and the zeroing of the sums
// the NORM GEMV before this one read (zero, zn floats) by one warp (`zeroes`); rlx_norm_den: a
// row's norm from those parts, over its K values.
template <int MM> __device__ __forceinline__ void rlx_norm_sums(float (&sq)[MM], const float* nsq, int M, int lane,
                                                               bool zeroes, float* zero, int zn) {
#pragma unroll
  for (int m = 0; m < MM; ++m) sq[m] = m < M ? LDCG(nsq + m * 32 + lane) : 0.f;
  if (zeroes)
    for (int j = lane; j < zn; j += 32) zero[j] = 0.f;
}
__device__ __forceinline__ float rlx_norm_den(float sq, int K, float eps) {
  return sqrtf(warp_sum(sq) / (float)K + eps);
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
// a macro's value as a string literal (operand types in inline PTX), or pasted onto a name
#define RLX_STR_(x) #x
#define RLX_STR(x) RLX_STR_(x)
#define RLX_CAT_(a, b) a##b
#define RLX_CAT(a, b) RLX_CAT_(a, b)
