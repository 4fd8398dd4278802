// Routed experts (moe_experts): the (token, slot) pairs sorted by expert on the device, then
// each expert's rows dotted with the inputs of its pairs (gate+up, then down), then the
// route-weighted sum per token. The routing is read from device memory only: no host sync,
// so the steps run inside the runner's CUDA graph.
// @part sort(TI, NE, BM)
// One block: count the pairs per expert, prefix-sum into offsets[NE + 1], place each pair's
// index into `order` (grouped by expert; the order inside a group does not matter: every pair
// has its own output row), and list the experts with any pair in `active` (-1 after them).
// BM > 0 (the grouped GEMM's rows a tile): also the tile list, tiles[2i] the expert of tile i
// and tiles[2i + 1] its first position in `order`, BM pairs a tile, each expert's last tile
// partial; expert -1 in the rest of the ntiles slots (the GEMM's grid is ntiles tiles, a bound
// known on the host: P / BM + min(NE, P)). An id outside [0, NE) raises error code 3 and its
// pair is left out.
extern "C" __global__ void __launch_bounds__(1024) rlx_moe_sort(const TI* __restrict__ ids, int P,
    int* __restrict__ offsets, int* __restrict__ order, int* __restrict__ active, int* __restrict__ tiles,
    int ntiles, int* err, int node) {
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
    int base = 0, na = 0, tbase = 0;
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
#if BM
      const int tc = (c + BM - 1) / BM;
      int ts = tc;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) { const int o = __shfl_up_sync(0xffffffffu, ts, d); if (lane >= d) ts += o; }
      for (int j = 0; j < tc; ++j) {
        tiles[2 * (tbase + ts - tc + j)] = e;
        tiles[2 * (tbase + ts - tc + j) + 1] = base + s - c + j * BM;
      }
      tbase += __shfl_sync(0xffffffffu, ts, 31);
#endif
      base += __shfl_sync(0xffffffffu, s, 31);
    }
    for (int i = na + lane; i < NE; i += 32) active[i] = -1;
#if BM
    for (int i = tbase + lane; i < ntiles; i += 32) tiles[2 * i] = -1;
#endif
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
typedef rlx_tv rlx_wunit;
__device__ __forceinline__ int rlx_units(int K) { return K / VEC; }
__device__ __forceinline__ rlx_wunit rlx_wload(const u8* row, int u) { return ((const rlx_tv*)row)[u]; }
__device__ __forceinline__ W rlx_vdot(const rlx_tv& w, const rlx_tv& xv) {
  W s = 0;
#pragma unroll
  for (int i = 0; i < VEC; ++i) s += LD(W, w.v[i]) * LD(W, xv.v[i]);
  return s;
}
// unit u of one row against the x rows xs[0..mc) (acc: one a pair)
__device__ __forceinline__ void rlx_unit(const u8* row, int u, const T* const* xs, int mc, W* acc) {
  const rlx_tv w = rlx_wload(row, u);
#pragma unroll
  for (int m = 0; m < MC; ++m)
    if (m < mc) acc[m] += rlx_vdot(w, ((const rlx_tv*)xs[m])[u]);
}
// unit u of NR rows (loaded: w) against one x row (acc: one a row)
template <int NR> __device__ __forceinline__ void rlx_wdot(const rlx_wunit* w, int u, const T* x, W* acc) {
  const rlx_tv xv = ((const rlx_tv*)x)[u];
#pragma unroll
  for (int r = 0; r < NR; ++r) acc[r] += rlx_vdot(w[r], xv);
}
// @part packed(MC)
// Packed expert rows (after dq.cu's common, scheme and qf parts and x4): a unit is one part
// of a block, decoded as the dequant GEMV decodes it.
typedef rlx_raw rlx_wunit;
__device__ __forceinline__ int rlx_units(int K) { return K / BLK * PARTS; }
__device__ __forceinline__ rlx_wunit rlx_wload(const u8* row, int u) { return rlx_load(row + (i64)(u / PARTS) * BPB, u % PARTS); }
// unit u of one row against the x rows xs[0..mc) (acc: one a pair)
__device__ __forceinline__ void rlx_unit(const u8* row, int u, const T* const* xs, int mc, W* acc) {
  const int p = u % PARTS;
  const rlx_raw q = rlx_wload(row, u);
  const i64 e0 = (i64)(u / PARTS) * BLK;
#pragma unroll
  for (int k = 0; k < RUNS; ++k) {
    const rlx_drun run = rlx_decode_run(q, p, k);       // (once for all the pairs)
#pragma unroll
    for (int m = 0; m < MC; ++m)
      if (m < mc) {
        W xv[4];
        rlx_x4(xs[m] + e0 + rlx_run_off(p, k), xv);
        acc[m] += rlx_run_dot(run, xv, HAS_MIN ? rlx_sum4(xv) : (W)0);
      }
  }
}
// unit u of NR rows (loaded: w) against one x row, each x run loaded once (acc: one a row)
template <int NR> __device__ __forceinline__ void rlx_wdot(const rlx_wunit* w, int u, const T* x, W* acc) {
  const int p = u % PARTS;
  const i64 e0 = (i64)(u / PARTS) * BLK;
#pragma unroll
  for (int k = 0; k < RUNS; ++k) {
    W xv[4];
    rlx_x4(x + e0 + rlx_run_off(p, k), xv);
    const W xs = HAS_MIN ? rlx_sum4(xv) : (W)0;
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] += rlx_run_dot(rlx_decode_run(w[r], p, k), xv, xs);
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
// @part gemv1(T, TO, TW, TI, NE, KS, R, DUAL, EPILOGUE)
// Decode at one token (T = 1): its KS pairs in the routing's own order (pair p: expert
// ids[p], x row 0), no sort. A warp takes R output rows of one pair, each weight row read once:
// a lane loads its unit of every row first (the weight bytes bound the step), then takes each
// x run once for all the rows.
// DUAL (gate and up, one scheme): block (8R rows, pair blockIdx.y): out[p, n] = act(gate . x)
// * (up . x) in TO, as rlx_moe_gemv writes it; an id out of range raises error code 3.
// Else (down, the combine fused): block = R rows, warp w the pairs w, w + 8, ..., x row p of
// h: y[n] = sum_j wts[j] * (down . h[j] rounded to T), j in order and ids out of range left
// out, as rlx_moe_gemv then rlx_moe_combine compute it.
// warp sums of R rows n0.. of expert e's stack wa (and wb: DUAL) dotted with x row xr
__device__ __forceinline__ void rlx_rows1(const u8* wa, const u8* wb, i64 e, long long ers, long long wrs, int n0,
                                          int N, const T* xr, int K, W* acc, W* acc2) {
  constexpr int NR = DUAL ? 2 * R : R;   // rows a lane reads: R of wa, then R of wb
  const u8* rows[NR];
  W a[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    rows[r] = (r < R ? wa : wb) + e * ers + (i64)min(n0 + r % R, N - 1) * wrs;
    a[r] = 0;
  }
  const int units = rlx_units(K);
  for (int u = threadIdx.x & 31; u < units; u += 32) {
    rlx_wunit w[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) w[r] = rlx_wload(rows[r], u);
    rlx_wdot<NR>(w, u, xr, a);
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    acc[r] = warp_sum(a[r]);
    if (DUAL) acc2[r] = warp_sum(a[R + r]);
  }
}
extern "C" __global__ void __launch_bounds__(256) rlx_moe_gemv1(const T* __restrict__ x, long long xrs,
    const u8* __restrict__ wa, const u8* __restrict__ wb, long long ers, long long wrs,
    const TI* __restrict__ ids, const TW* __restrict__ wts, TO* __restrict__ out, int N, int K, int* err, int node) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  W acc[R], acc2[R];
#if DUAL
  const int p = blockIdx.y, n0 = (blockIdx.x * 8 + warp) * R;
  const i64 e = (i64)ids[p];
  if (e < 0 || e >= NE) {
    if (threadIdx.x == 0 && blockIdx.x == 0) rlx_error(err, 3, node, e, NE);
    return;
  }
  rlx_rows1(wa, wb, e, ers, wrs, n0, N, x, K, acc, acc2);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    W v = acc[r];
    const W up = LD(W, ST(TO, acc2[r]));
    EPILOGUE
    v = LD(W, ST(TO, v)) * up;
    if (lane == 0 && n0 + r < N) out[(i64)p * N + n0 + r] = ST(TO, v);
  }
#else
  const int n0 = blockIdx.x * R;
  __shared__ W part[KS][R];
  for (int p = warp; p < KS; p += 8) {
    const i64 e = (i64)ids[p];
    if (e < 0 || e >= NE) continue;
    rlx_rows1(wa, wb, e, ers, wrs, n0, N, x + (i64)p * xrs, K, acc, acc2);
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (lane == 0) part[p][r] = LD(W, ST(T, acc[r]));
  }
  __syncthreads();
  if (threadIdx.x < R && n0 + threadIdx.x < N) {
    W v = 0;
    for (int j = 0; j < KS; ++j) {
      const i64 e = (i64)ids[j];
      if (e >= 0 && e < NE) v += LD(W, wts[j]) * part[j][threadIdx.x];
    }
    out[n0 + threadIdx.x] = ST(TO, v);
  }
#endif
}
// @part route(T, NE, KS, ORDER, NORM)
// moe_route in one launch, a warp per token (after w): ORDER 0 softmax over the NE logits,
// each probability rounded to T, then the KS largest (NORM: divided by their sum, rounded to
// T); ORDER 1 the KS largest logits, softmaxed among themselves. Largest first, the lowest id
// first on ties: KS rounds of a warp argmax. The rounding and order of the softmax and topk
// (and sum, divide) ops the composite lowers to; lane l holds experts l, l + 32, ...
#define EPL ((NE + 31) / 32)
extern "C" __global__ void rlx_moe_route(const T* __restrict__ z, T* __restrict__ wts, long long* __restrict__ ids,
                                         long long rows) {
  const i64 t = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (t >= rows) return;
  const T* zr = z + t * NE;
  W v[EPL];
  W mx = LD(W, zr[lane < NE ? lane : 0]);
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < NE ? LD(W, zr[e]) : (W)0;
    if (e < NE) mx = v[i] > mx ? v[i] : mx;
  }
#if ORDER == 0
  mx = warp_max(mx);
  W den = 0;
#pragma unroll
  for (int i = 0; i < EPL; ++i)
    if (lane + 32 * i < NE) { v[i] = exp(v[i] - mx); den += v[i]; }
  den = warp_sum(den);
#pragma unroll
  for (int i = 0; i < EPL; ++i) v[i] = LD(W, ST(T, v[i] / den));
#endif
  unsigned taken[(EPL + 31) / 32] = {};
  W top[KS];
  int at[KS];
  for (int j = 0; j < KS; ++j) {
    W bv = 0;
    int bi = -1;                          // (none yet)
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const int e = lane + 32 * i;
      if (e < NE && !((taken[i >> 5] >> (i & 31)) & 1u) && (bi < 0 || v[i] > bv)) { bv = v[i]; bi = e; }
    }
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
      const W ov = __shfl_xor_sync(0xffffffffu, bv, d);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, d);
      if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
    }
    top[j] = bv;
    at[j] = bi;
    if ((bi & 31) == lane) taken[(bi >> 5) >> 5] |= 1u << ((bi >> 5) & 31);
  }
  if (lane) return;
#if ORDER == 1
  W s = 0;
  const W m = top[0];
  for (int j = 0; j < KS; ++j) { top[j] = exp(top[j] - m); s += top[j]; }
  for (int j = 0; j < KS; ++j) top[j] = top[j] / s;
#elif NORM
  W s = 0;
  for (int j = 0; j < KS; ++j) s += top[j];
  s = LD(W, ST(T, s));
  for (int j = 0; j < KS; ++j) top[j] = top[j] / s;
#endif
  for (int j = 0; j < KS; ++j) {
    wts[t * KS + j] = ST(T, top[j]);
    ids[t * KS + j] = at[j];
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
// @part gemm_shape(MT, BK)
// The grouped GEMM's tile (before its B loader and the gemm part): BM pairs x BN output rows,
// shared rows of BK 16-bit values padded by 8 (ldmatrix without bank conflicts).
#define BM (16 * MT)
#define BN 64
#define LDS (BK + 8)
// @part gemm_dense()
// Dense expert rows (after deltanet.cu's tc_common and w): a B tile is BN rows x BK weights
// copied by 16-byte cp.async (rows past N zero); the copies join the A tile's group.
__device__ __forceinline__ void rlx_b_tile(hword* s, const u8* w, long long wrs, int n0, int N, int k0, int tid) {
  for (int i = tid; i < BN * (BK / 8); i += 128) {
    const int r = i / (BK / 8), c = (i % (BK / 8)) * 8;
    const bool ok = n0 + r < N;
    rlx_cp16(s + r * LDS + c, w + (i64)(ok ? n0 + r : 0) * wrs + (i64)(k0 + c) * (i64)sizeof(T), ok);
  }
}
// @part gemm_packed()
// Packed expert rows (after dq.cu's common, scheme and qf parts, then tc_common): a B tile is
// BN rows x BK weights decoded into shared memory by the scheme's block decoders, a (block,
// part) unit a thread at a time, each weight d * q + m rounded to T (as the dequantize op
// rounds it). A tile is UPR units of a row: whole blocks (BLK <= BK), or the parts
// [j UPR, (j + 1) UPR) of a K-quant super-block, which cover its elements [j BK, (j + 1) BK)
// at BK = 128 (q4_k, q5_k, q6_k order their parts so). Rows past N decode row N - 1 (their
// columns are never stored).
#define UPR (BLK <= BK ? BK / BLK * PARTS : PARTS * BK / BLK)
__device__ __forceinline__ void rlx_b_tile(hword* s, const u8* w, long long wrs, int n0, int N, int k0, int tid) {
  for (int i = tid; i < BN * UPR; i += 128) {
    const int r = i / UPR, j = i % UPR;
    const u8* row = w + (i64)min(n0 + r, N - 1) * wrs;
    int b, p, base;
    if (BLK <= BK) { b = k0 / BLK + j / PARTS; p = j % PARTS; base = b * BLK - k0; }
    else { b = k0 / BLK; p = (k0 % BLK) / BK * UPR + j; base = -(k0 % BLK); }
    const rlx_raw q = rlx_load(row + (i64)b * BPB, p);
    hword* dst = s + r * LDS + base;
#pragma unroll
    for (int k = 0; k < RUNS; ++k) {
      W d, mn = 0;
      rlx_scale(q, p, k, &d, &mn);
      const u32 qw = rlx_qword(q, p, k);
      float v[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) v[t] = HAS_MIN ? (float)rlx_qf(qw, t) * d + mn : (float)rlx_qf(qw, t) * d;
      *(uint2*)(dst + rlx_run_off(p, k)) = make_uint2(rlx_gtc_pack(v[0], v[1]), rlx_gtc_pack(v[2], v[3]));
    }
  }
}
// @part gemm(TO, STAGES, DUAL, EPILOGUE)
// The grouped GEMM over the sorted pairs on tensor cores (f16 / bf16, mma.sync m16n8k16, f32
// accumulate), for batched decode and prefill. Block (n tile, tile of the sort's list): the
// tile's BM = 16 MT pairs of one expert (A: their x rows p / xdiv, gathered by cp.async)
// times BN = 64 of that expert's output rows (B: rlx_b_tile, dense or decoded), over K in
// steps of BK (STAGES = 2: the next step's copies in flight during this one's products).
// Warp w takes output columns 16w.. 16w + 15 of every m-tile. A block whose tile slot is
// empty (expert -1) exits: the grid is the host's bound, the routing stays on the device.
// Outputs as rlx_moe_gemv writes them (DUAL: act(gate) * up in TO; else the product rounded
// to TO, kept in W).
#if DUAL
typedef TO rlx_out;
#else
typedef W rlx_out;
#endif
__device__ __forceinline__ void rlx_a_tile(hword* s, const T* x, long long xrs, const int* xrow, int k0, int tid) {
  for (int i = tid; i < BM * (BK / 8); i += 128) {
    const int r = i / (BK / 8), c = (i % (BK / 8)) * 8, xr = xrow[r];
    rlx_cp16(s + r * LDS + c, xr >= 0 ? (const void*)(x + (i64)xr * xrs + k0 + c) : (const void*)x, xr >= 0);
  }
}
extern "C" __global__ void __launch_bounds__(128) rlx_moe_gemm(const T* __restrict__ x, long long xrs, int xdiv,
    const u8* __restrict__ wa, const u8* __restrict__ wb, long long ers, long long wrs,
    const int* __restrict__ offsets, const int* __restrict__ order, const int* __restrict__ tiles,
    rlx_out* __restrict__ out, int N, int K) {
  __shared__ __align__(16) hword sa[STAGES][BM * LDS];
  __shared__ __align__(16) hword sb[STAGES][(1 + DUAL) * BN * LDS];
  __shared__ int xrow[BM], prow[BM];
  const int e = tiles[2 * blockIdx.y];
  if (e < 0) return;
  const int p0 = tiles[2 * blockIdx.y + 1], np = min(BM, offsets[e + 1] - p0);
  const int n0 = blockIdx.x * BN, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int m = tid; m < BM; m += 128) {
    const int pr = m < np ? order[p0 + m] : -1;
    prow[m] = pr;
    xrow[m] = pr < 0 ? -1 : pr / xdiv;
  }
  __syncthreads();
  const u8* ga = wa + (i64)e * ers;
  const u8* gb = wb + (i64)e * ers;
  float acc[MT][2][4], acc2[MT][2][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[mt][i / 4][i % 4] = acc2[mt][i / 4][i % 4] = 0.f;
#define RLX_STAGE(st, k0) \
  { rlx_a_tile(sa[st], x, xrs, xrow, (k0), tid); rlx_b_tile(sb[st], ga, wrs, n0, N, (k0), tid); \
    if (DUAL) rlx_b_tile(sb[st] + BN * LDS, gb, wrs, n0, N, (k0), tid); RLX_CP_COMMIT(); }
  const int KT = K / BK;
  RLX_STAGE(0, 0)
  for (int kt = 0; kt < KT; ++kt) {
    const int st = kt % STAGES;
    if (STAGES > 1 && kt + 1 < KT) {
      RLX_STAGE((kt + 1) % STAGES, (kt + 1) * BK)
      RLX_CP_WAIT(1);
    } else {
      RLX_CP_WAIT(0);
    }
    __syncthreads();
    const hword* as = sa[st];
    const hword* bs = sb[st];
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      u32 bf[4], bf2[4];
      rlx_gtc_bn(bf, bs, LDS, kk, warp * 16, lane);
      if (DUAL) rlx_gtc_bn(bf2, bs + BN * LDS, LDS, kk, warp * 16, lane);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        u32 af[4];
        rlx_gtc_a(af, as, LDS, mt * 16, kk, lane);
        rlx_mma(acc[mt][0], af, bf[0], bf[1]);
        rlx_mma(acc[mt][1], af, bf[2], bf[3]);
        if (DUAL) {
          rlx_mma(acc2[mt][0], af, bf2[0], bf2[1]);
          rlx_mma(acc2[mt][1], af, bf2[2], bf2[3]);
        }
      }
    }
    __syncthreads();
    if (STAGES == 1 && kt + 1 < KT) RLX_STAGE(0, (kt + 1) * BK)
  }
#undef RLX_STAGE
  // accumulator i of an m16n8 tile: row (lane / 4) + 8 (i / 2), column 2 (lane % 4) + i % 2
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = mt * 16 + (lane >> 2) + (i >> 1) * 8;
        const int n = n0 + warp * 16 + nt * 8 + (lane & 3) * 2 + (i & 1);
        if (m >= np || n >= N) continue;
        W v = acc[mt][nt][i];
#if DUAL
        const W up = LD(W, ST(TO, acc2[mt][nt][i]));
        EPILOGUE
        v = LD(W, ST(TO, v)) * up;
        out[(i64)prow[m] * N + n] = ST(TO, v);
#else
        out[(i64)prow[m] * N + n] = LD(W, ST(TO, v));
#endif
      }
}
