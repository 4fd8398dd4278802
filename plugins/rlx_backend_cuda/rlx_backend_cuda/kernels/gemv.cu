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
        const TO h = ST(TO, tof(res[m * rrs + n * R + r]) + tof(ST(TO, s[m][r])));
        y[(i64)m * N + n * R + r] = h;
        yw[(i64)m * N + n * R + r] = ST(TO, tof(h) * (tof(nw[n * R + r]) + noff));
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
