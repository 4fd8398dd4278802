// Matmul helpers: the 16-bit decode GEMV and the naive integer / bool matmul.
// @part gemv(T, TO, KS, SWIGLU, R, U, MMAX, SWIGLU_OF(g, u), NORM, TN, RESID, EARLY)
// Decode GEMV: y[M, N] = x[M, K] @ W[N, K]^T for small M, 16-bit data: KS warps per R
// rows of W, 16-byte loads, U of them in flight per row and lane (the weight bytes bound
// a decode step, so the loads are issued before any arithmetic). Few rows: more warps per
// row, so more loads are in flight and each warp waits for fewer of them in turn. SWIGLU: W is [2N, K]
// (gate rows, then up rows); the warp computes gate row n and up row n + N and writes
// SWIGLU_OF(gate, up) (the expression table's fused_swiglu), each rounded to TO first as the
// unfused matmul would.
// NORM: the product's x is rms_norm(x0) * (nw + noff), where x holds x0 * (nw + noff) (written
// beside x0 by the GEMV that wrote x0, RESID) and nsq[m * 32 + j] the sum of row m's squares of x0
// in 32 parts: each row's sum is divided by sqrt(mean square + eps) at the end (the norm's 1 / den
// moved past the sum: nothing before the products, the sums' load in flight during them; x0 * w is
// rounded to T where the norm's own output rounds x0 / den * w). Each block norming x first cost
// more than the norm launches it saved on the H200 (the gate/up GEMV 26.2 us against 18.8
// unfused), and so did loading nw in the product loop in the packed GEMV (dq.cu: 13.6 -> 30 us).
// Block 0 zeroes `zero` (zn floats): the sums the NORM GEMV before this one read, whose launch
// has finished once this one's wait returns (ops.GemvSums: a ring over the step; a counter of the
// blocks that had read their own sums, one atomic a block on one address, cost the gate/up GEMV
// 6.3 us more). So a decode step has no norm launch between two GEMVs.
// RESID: y = res + the product (res rows of stride rrs, the product rounded to TO first): the
// h of a fused_residual_rms_norm whose r is this product; yw = y * (nw + noff) (the next NORM
// GEMV's x) and the squares of the (rounded) y added into osq (one atomic a warp and row, spread
// over the 32 parts by block).
#if SWIGLU && RESID
#error "rlx_gemv: RESID takes no SWIGLU"
#endif
extern "C" __global__ void __launch_bounds__(256) rlx_gemv(const T* __restrict__ x, long long xrs,
    const T* __restrict__ w, TO* __restrict__ y, int M, int N, int K, float eps, const float* nsq,
    const TN* __restrict__ nw, float noff, const TO* __restrict__ res, long long rrs, TO* __restrict__ yw,
    float* osq, float* zero, int zn) {
  // KS: warps per row (each a KS-th of the row's 512-byte chunks)
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, part = wib % KS;
  const int n = blockIdx.x * (8 / KS) + wib / KS;
#if SWIGLU
  const bool live = n < N;
#else
  const bool live = n * R < N;
#endif
  // (with KS > 1 the row's warps meet at a barrier below)
  if (KS == 1 && !live) return;
  const uint4* wr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#if SWIGLU
    const int row = min(n, N - 1) + r * N;
#else
    const int row = min(n * R + r, N - 1);
#endif
    wr[r] = (const uint4*)(w + (i64)row * K);
  }
  const int KV = K / 8;
  uint4 wv[U][R];
#define RLX_LOAD_W(c0) \
  _Pragma("unroll") for (int u = 0; u < U; ++u) \
  _Pragma("unroll") for (int r = 0; r < R; ++r) \
    wv[u][r] = (c0) + 32 * KS * u < KV ? __ldg(wr[r] + (c0) + 32 * KS * u) : make_uint4(0u, 0u, 0u, 0u);
  // EARLY (w a param or constant: no kernel writes it): the first iteration's loads are issued
  // before the wait for the kernel that writes x (device.Kernel). The 1B-shape decode graph on
  // the H100: 1.157 ms; with an L2 prefetch of each row's first 4 KB there instead, 1.358 ms.
  const int first = part * 32 + lane;
#if EARLY
  RLX_LOAD_W(first)
#endif
  RLX_GRID_WAIT();
#if !EARLY
  RLX_LOAD_W(first)
#endif
#if NORM
  float sq[MMAX];
  rlx_norm_sums(sq, nsq, M, lane, blockIdx.x == 0 && wib == 0, zero, zn);
#endif
#if RESID
  // the residual and norm weights the storing lane takes at the end, loaded now (after the wait:
  // a kernel before wrote res) so their round trip runs under the products, not after the sums
  float rv[MMAX][R], nwv[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int c = min(n * R + r, N - 1);
    nwv[r] = lane == 0 ? tof(nw[c]) + noff : 0.f;
#pragma unroll
    for (int m = 0; m < MMAX; ++m) rv[m][r] = lane == 0 && m < M ? tof(res[m * rrs + c]) : 0.f;
  }
#endif
  float acc[R][MMAX];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < MMAX; ++m) acc[r][m] = 0.f;
  for (int c0 = first; c0 < KV; c0 += 32 * U * KS) {
    if (c0 != first) {
      RLX_LOAD_W(c0)
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * KS * u;
      if (c >= KV) break;
#pragma unroll
      for (int m = 0; m < MMAX; ++m) {
        if (m < M) {
          const uint4 xv = *(const uint4*)(x + m * xrs + c * 8);
          const T* xp = (const T*)&xv;
          float xf[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) xf[e] = tof(xp[e]);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const T* wp = (const T*)&wv[u][r];
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[r][m] += tof(wp[e]) * xf[e];
          }
        }
      }
    }
  }
  float s[MMAX][R];
#pragma unroll
  for (int m = 0; m < MMAX; ++m) {
#if NORM
    const float den = rlx_norm_den(sq[m], K, eps);
#else
    const float den = 1.f;
#endif
#pragma unroll
    for (int r = 0; r < R; ++r) s[m][r] = m < M ? warp_sum(acc[r][m]) / den : 0.f;
  }
  if (KS > 1) {                     // the row's warps add their parts in a fixed order
    __shared__ float red[8][MMAX][R];
    if (lane == 0)
#pragma unroll
      for (int m = 0; m < MMAX; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) red[wib][m][r] = s[m][r];
    __syncthreads();
    if (part != 0 || !live) return;
#pragma unroll
    for (int m = 0; m < MMAX; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float t = red[wib][m][r];
#pragma unroll
        for (int p = 1; p < KS; ++p) t += red[wib + p][m][r];
        s[m][r] = t;
      }
  }
  if (lane != 0) return;
#pragma unroll
  for (int m = 0; m < MMAX; ++m) {
    if (m >= M) continue;
#if SWIGLU
    const float g = tof(ST(TO, s[m][0])), u = tof(ST(TO, s[m][1]));
    y[(i64)m * N + n] = ST(TO, SWIGLU_OF(g, u));
#else
#if RESID
    float sq = 0.f;
#endif
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (n * R + r < N) {
#if RESID
        const TO h = ST(TO, rv[m][r] + tof(ST(TO, s[m][r])));
        y[(i64)m * N + n * R + r] = h;
        yw[(i64)m * N + n * R + r] = ST(TO, tof(h) * nwv[r]);
        sq += tof(h) * tof(h);
#else
        y[(i64)m * N + n * R + r] = ST(TO, s[m][r]);
#endif
      }
#if RESID
    atomicAdd(osq + m * 32 + (blockIdx.x & 31), sq);
#endif
#endif
  }
}
// @part gemv_tc(T, TO, MT, KC, EARLY, SWIGLU, SWIGLU_OF(g, u))
// Decode GEMV past the plain GEMV's rows (3 to 8 MT rows of x) on tensor cores: y[M, N] =
// x[M, K] @ W[N, K]^T, 16-bit data, f32 sums (opt-in: measured slower than cuBLAS on the H200,
// ops.GEMV_TC). Past 2 rows the plain GEMV's FMAs bound it. So W streams as in a
// GEMV: warp w of a block's 8 owns W's rows n0 + 16 w .. + 15 and loads them straight into
// mma.sync's A fragments. Lane (g, q) = (lane / 4, lane % 4) loads 8 consecutive k of rows g and
// g + 8 in one 16-byte load, and its B fragment the same 8 k of x's row g: the sum over k is the
// same in any order of k the A and B fragments agree on, so no ldmatrix and no shuffle. The
// block's warps share x's 8 MT rows (rows past M zero), KC columns at a time in shared memory.
// gridDim.y splits K (KB a block); then the f32 sums go to ws[gridDim.y][M][N] and the last block
// of a column of blocks (counter cnt[blockIdx.x], left at zero again) adds them in k order and
// stores y.
// SWIGLU: W is [2N, K] (gate rows, then up rows); warps 0-3 take 64 gate rows, warps 4-7 the
// same up rows, which pass their sums through shared memory for y = SWIGLU_OF(gate, up), each
// rounded to TO first as the unfused matmul would (ws then [gridDim.y][M][2N]).
// y[m, n] <- the sum v (under SWIGLU: of gate v and up u), where (m, n) is in y
__device__ __forceinline__ void rlx_gemv_tc_store(TO* y, int m, int n, int M, int N, float v, float u) {
  if (m >= M || n >= N) return;
#if SWIGLU
  y[(i64)m * N + n] = ST(TO, SWIGLU_OF(tof(ST(TO, v)), tof(ST(TO, u))));
#else
  y[(i64)m * N + n] = ST(TO, v);
#endif
}
extern "C" __global__ void __launch_bounds__(256) rlx_gemv_tc(const T* __restrict__ x, long long xrs,
    const T* __restrict__ w, TO* __restrict__ y, int M, int N, int K, int KB, float* ws, int* cnt) {
  constexpr int C = KC / 32, XP = KC + 32;    // (row pitch: rows g and g + 1 16 banks apart)
  __shared__ __align__(16) unsigned short xs[8 * MT * XP];
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int wib = threadIdx.x >> 5;
#if SWIGLU
  const int n0 = blockIdx.x * 64 + (wib & 3) * 16, half = (wib >> 2) * N, NW = 2 * N;
#else
  const int n0 = blockIdx.x * 128 + wib * 16, half = 0, NW = N;
#endif
  const int k0 = blockIdx.y * KB, k1 = min(K, k0 + KB);
  const T* wr[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) wr[h] = w + (i64)(half + min(n0 + 8 * h + g, N - 1)) * K + 8 * q;
  uint4 wv[C][2];
#define RLX_LOAD_W(kb) \
  _Pragma("unroll") for (int c = 0; c < C; ++c) \
  _Pragma("unroll") for (int h = 0; h < 2; ++h) \
    wv[c][h] = (kb) + 32 * c < k1 ? __ldg((const uint4*)(wr[h] + (kb) + 32 * c)) : make_uint4(0u, 0u, 0u, 0u);
#if EARLY
  RLX_LOAD_W(k0)
#endif
  RLX_GRID_WAIT();
#if !EARLY
  RLX_LOAD_W(k0)
#endif
  float acc[MT][4];
#pragma unroll
  for (int j = 0; j < MT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  for (int kb = k0; kb < k1; kb += KC) {
    if (kb != k0) {
      RLX_LOAD_W(kb)
    }
    __syncthreads();                  // (the last slice of x is read)
    for (int e = threadIdx.x; e < 8 * MT * (KC / 8); e += 256) {
      const int r = e / (KC / 8), c = (e % (KC / 8)) * 8;
      const bool ok = r < M && kb + c < k1;
      rlx_cp16(xs + r * XP + c, ok ? (const void*)(x + r * xrs + kb + c) : (const void*)x, ok);
    }
    RLX_CP_COMMIT();
    RLX_CP_WAIT(0);
    __syncthreads();
#pragma unroll
    for (int c = 0; c < C; ++c) {
      if (kb + 32 * c >= k1) break;
      const u32* w0 = (const u32*)&wv[c][0];
      const u32* w1 = (const u32*)&wv[c][1];
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        const uint4 xv = *(const uint4*)(xs + (8 * j + g) * XP + 32 * c + 8 * q);
        const u32* b = (const u32*)&xv;
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const u32 a[4] = {w0[2 * s], w1[2 * s], w0[2 * s + 1], w1[2 * s + 1]};
          rlx_mma(acc[j], a, b[2 * s], b[2 * s + 1]);
        }
      }
    }
  }
#undef RLX_LOAD_W
  // acc[j][e]: y's row m = 8 j + 2 q + (e & 1), column n0 + g + 8 (e >> 1) (W's row half + that)
  if (gridDim.y > 1) {
    float* part = ws + (i64)blockIdx.y * M * NW + half;
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = 8 * j + 2 * q + (e & 1), n = n0 + g + 8 * (e >> 1);
        if (m < M && n < N) part[(i64)m * NW + n] = acc[j][e];
      }
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = rlx_last_arrival(cnt + blockIdx.x, gridDim.y);
    __syncthreads();
    if (!last) return;
    __threadfence();
    // the column's outputs spread over the block's threads, consecutive columns on consecutive
    // lanes, EB of a thread's at a time; a part's loads all issued before its adds (a thread
    // adding its own outputs' parts one load at a time waited on L2 for each: 8-16 parts of
    // 16-32 outputs)
    constexpr int COLS = SWIGLU ? 64 : 128, EPT = 8 * MT * COLS / 256, EB = EPT < 16 ? EPT : 16;
    const int c0 = blockIdx.x * COLS;
    for (int i0 = 0; i0 < EPT; i0 += EB) {
      float t[EB], up[EB];
#pragma unroll
      for (int i = 0; i < EB; ++i) t[i] = up[i] = 0.f;
      for (int p = 0; p < (int)gridDim.y; ++p)
#pragma unroll
        for (int i = 0; i < EB; ++i) {
          const int e = threadIdx.x + 256 * (i0 + i), m = e / COLS, n = c0 + e % COLS;
          if (m < M && n < N) {
            const float* r = ws + ((i64)p * M + m) * NW + n;
            t[i] += LDCG(r);
            if (SWIGLU) up[i] += LDCG(r + N);
          }
        }
#pragma unroll
      for (int i = 0; i < EB; ++i) {
        const int e = threadIdx.x + 256 * (i0 + i);
        rlx_gemv_tc_store(y, e / COLS, c0 + e % COLS, M, N, t[i], up[i]);
      }
    }
    return;
  }
  // (SWIGLU: the up warps' sums, through shared memory, to the gate warps of the same rows)
  __shared__ float ups[SWIGLU ? 4 : 1][SWIGLU ? MT * 4 : 1][32];
  if (SWIGLU && half) {
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) ups[wib & 3][4 * j + e][lane] = acc[j][e];
  }
  if (SWIGLU) {
    __syncthreads();
    if (half) return;
  }
#pragma unroll
  for (int j = 0; j < MT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      rlx_gemv_tc_store(y, 8 * j + 2 * q + (e & 1), n0 + g + 8 * (e >> 1), M, N, acc[j][e],
                        SWIGLU ? ups[wib][4 * j + e][lane] : 0.f);
}
// @part matmul_naive(MAC(s, a, b), TA, TB, TO, ACC)
// Fallback matmul for integer / bool data (cuBLAS covers the float types).
extern "C" __global__ void rlx_matmul_naive(const TA* __restrict__ a, const TB* __restrict__ b,
    TO* __restrict__ c, long long batch, int M, int N, int K,
    long long sab, long long sam, long long sak, long long sbb, long long sbk, long long sbn) {
  const i64 total = batch * M * N;
  for (i64 o = blockIdx.x * (i64)blockDim.x + threadIdx.x; o < total; o += (i64)gridDim.x * blockDim.x) {
    const int n = (int)(o % N); const i64 t = o / N; const int m = (int)(t % M); const i64 bi = t / M;
    ACC s = 0;
    for (int kk = 0; kk < K; ++kk)
      s = MAC(s, (ACC)a[bi * sab + m * sam + kk * sak], (ACC)b[bi * sbb + kk * sbk + n * sbn]);
    c[o] = (TO)s;
  }
}
