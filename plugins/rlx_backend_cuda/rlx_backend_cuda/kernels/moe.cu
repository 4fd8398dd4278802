// Routed experts (moe_experts): the (token, slot) pairs sorted by expert on the device, then
// each expert's rows dotted with the inputs of its pairs (gate+up, then down), then the
// route-weighted sum per token. The routing is read from device memory only: no host sync,
// so the steps run inside the runner's CUDA graph.
// @part sort(TI, NE)
// One block: count the pairs per expert, prefix-sum into offsets[NE + 1], place each pair's
// index into `order` (grouped by expert; the order inside a group does not matter: every pair
// has its own output row), and list the experts with any pair in `active` (-1 after them).
// An id outside [0, NE) raises error code 3 and its pair is left out.
extern "C" __global__ void __launch_bounds__(1024) rlx_moe_sort(const TI* __restrict__ ids, int P,
    int* __restrict__ offsets, int* __restrict__ order, int* __restrict__ active, int* err, int node) {
  __shared__ int cnt[NE], cur[NE];
  for (int e = threadIdx.x; e < NE; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const i64 e = (i64)ids[p];
    if (e < 0 || e >= NE) rlx_error(err, 3, node, e, NE);
    else atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  if (threadIdx.x < 32) {                 // one warp scans the counts, 32 experts at a time
    const int lane = threadIdx.x;
    int base = 0, na = 0;
    for (int e0 = 0; e0 < NE; e0 += 32) {
      const int e = e0 + lane;
      const int c = e < NE ? cnt[e] : 0;
      int s = c;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) { const int o = __shfl_up_sync(0xffffffffu, s, d); if (lane >= d) s += o; }
      if (e < NE) { offsets[e] = base + s - c; cur[e] = base + s - c; }
      const unsigned hit = __ballot_sync(0xffffffffu, c > 0);
      if (c > 0) active[na + __popc(hit & ((1u << lane) - 1u))] = e;
      na += __popc(hit);
      base += __shfl_sync(0xffffffffu, s, 31);
    }
    for (int i = na + lane; i < NE; i += 32) active[i] = -1;
    if (lane == 0) offsets[NE] = base;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const i64 e = (i64)ids[p];
    if (e >= 0 && e < NE) order[atomicAdd(&cur[e], 1)] = p;
  }
}
// @part w(ACC)
typedef ACC W;
typedef unsigned char u8;
// @part dense(T, VEC, MC)
// Dense expert rows (after w): a unit is VEC consecutive weights and x values (one vector load each).
struct alignas(VEC * sizeof(T)) rlx_tv { T v[VEC]; };
__device__ __forceinline__ int rlx_units(int K) { return K / VEC; }
__device__ __forceinline__ void rlx_unit(const u8* row, int u, const T* const* xs, int mc, W* acc) {
  const rlx_tv w = ((const rlx_tv*)row)[u];
#pragma unroll
  for (int m = 0; m < MC; ++m)
    if (m < mc) {
      const rlx_tv xv = ((const rlx_tv*)xs[m])[u];
      W s = 0;
#pragma unroll
      for (int i = 0; i < VEC; ++i) s += LD(W, w.v[i]) * LD(W, xv.v[i]);
      acc[m] += s;
    }
}
// @part packed(MC)
// Packed expert rows (after dq.cu's common, scheme and qf parts and x4): a unit is one part
// of a block, decoded as the dequant GEMV decodes it.
__device__ __forceinline__ int rlx_units(int K) { return K / BLK * PARTS; }
__device__ __forceinline__ void rlx_unit(const u8* row, int u, const T* const* xs, int mc, W* acc) {
  const int p = u % PARTS;
  const rlx_raw q = rlx_load(row + (i64)(u / PARTS) * BPB, p);
  const i64 e0 = (i64)(u / PARTS) * BLK;
#pragma unroll
  for (int k = 0; k < RUNS; ++k) {
    W d, mn = 0;
    rlx_scale(q, p, k, &d, &mn);
    const u32 qw = rlx_qword(q, p, k);
    W qf[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) qf[i] = (W)rlx_qf(qw, i);
    const i64 e = e0 + rlx_run_off(p, k);
#pragma unroll
    for (int m = 0; m < MC; ++m)
      if (m < mc) {
        W xv[4];
        rlx_x4(xs[m] + e, xv);
        const W s = qf[0] * xv[0] + qf[1] * xv[1] + qf[2] * xv[2] + qf[3] * xv[3];
        acc[m] += HAS_MIN ? d * s + mn * ((xv[0] + xv[1]) + (xv[2] + xv[3])) : d * s;
      }
  }
}
// @part gemv(T, TO, MC, DUAL, EPILOGUE)
// A warp per output row n of one expert (blockIdx.y: the y-th active expert), over that
// expert's pairs MC at a time (the row's bytes read once per MC pairs). Pair p reads x row
// p / xdiv. DUAL (gate and up, one scheme): out[p, n] = act(gate . x) * (up . x), each product
// rounded to TO as the unfused ops round; else out[p, n] = (w . x) rounded to TO, kept in W.
#if DUAL
typedef TO rlx_out;
#else
typedef W rlx_out;
#endif
extern "C" __global__ void __launch_bounds__(256) rlx_moe_gemv(const T* __restrict__ x, long long xrs, int xdiv,
    const u8* __restrict__ wa, const u8* __restrict__ wb, long long ers, long long wrs,
    const int* __restrict__ offsets, const int* __restrict__ order, const int* __restrict__ active,
    rlx_out* __restrict__ out, int N, int K) {
  const int e = active[blockIdx.y];
  const int lane = threadIdx.x & 31, n = blockIdx.x * 8 + (threadIdx.x >> 5);
  if (e < 0 || n >= N) return;
  const u8* ra = wa + (i64)e * ers + (i64)n * wrs;
  const u8* rb = wb + (i64)e * ers + (i64)n * wrs;
  const int p1 = offsets[e + 1], units = rlx_units(K);
  for (int c = offsets[e]; c < p1; c += MC) {
    const int mc = min(MC, p1 - c);
    int pr[MC];
    const T* xs[MC];
#pragma unroll
    for (int m = 0; m < MC; ++m) {
      pr[m] = order[min(c + m, p1 - 1)];
      xs[m] = x + (i64)(pr[m] / xdiv) * xrs;
    }
    W acc[MC], acc2[MC];
#pragma unroll
    for (int m = 0; m < MC; ++m) acc[m] = acc2[m] = 0;
#pragma unroll 4
    for (int u = lane; u < units; u += 32) {
      rlx_unit(ra, u, xs, mc, acc);
      if (DUAL) rlx_unit(rb, u, xs, mc, acc2);
    }
#pragma unroll
    for (int m = 0; m < MC; ++m) {
      W v = warp_sum(acc[m]);
#if DUAL
      const W up = LD(W, ST(TO, warp_sum(acc2[m])));
      EPILOGUE
      v = LD(W, ST(TO, v)) * up;
      if (lane == 0 && m < mc) out[(i64)pr[m] * N + n] = ST(TO, v);
#else
      if (lane == 0 && m < mc) out[(i64)pr[m] * N + n] = LD(W, ST(TO, v));
#endif
    }
  }
}
// @part combine(TO, TW, TI, NE)
// y[t, n] = sum_j weights[t, j] * part[t * KS + j, n] over the pairs with an expert id in range.
extern "C" __global__ void rlx_moe_combine(const W* __restrict__ part, const TW* __restrict__ wts,
    const TI* __restrict__ ids, TO* __restrict__ y, long long T, int N, int KS) {
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < T * N; i += (i64)gridDim.x * blockDim.x) {
    const i64 t = i / N, n = i - t * N;
    W v = 0;
    for (int j = 0; j < KS; ++j) {
      const i64 p = t * KS + j, e = (i64)ids[p];
      if (e >= 0 && e < NE) v += LD(W, wts[p]) * part[p * N + n];
    }
    y[i] = ST(TO, v);
  }
}
