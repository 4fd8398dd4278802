// RMSNorm and LayerNorm rows (the fused residual variants too). Row kernels work on
// contiguous rows: input rows of length n with row stride `rs` (elements, last axis
// unit-stride), outputs contiguous [rows, n]. One block per row (or LANES lanes, see WARP).
// @part norm_vec()
// Norm rows of 16-bit data in vectors of V values (4 to 16 bytes), NV vectors a thread,
// held in registers: vals[k * V + j] is the row's value (tid + k * nt) * V + j, 0 past the
// row's end; with a residual row r, h = x + r is stored on the way (the fused variants).
template <int NV, int V, bool RES, typename AccT, typename XT, typename RT, typename HT>
__device__ __forceinline__ void rlx_norm_row_vec(AccT* vals, const XT* xr, const RT* rr, HT* hr, int n, int tid,
                                                 int nt) {
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int e0 = (tid + k * nt) * V;
    if (e0 >= n) {
#pragma unroll
      for (int j = 0; j < V; ++j) vals[k * V + j] = (AccT)0;
      continue;
    }
    const rlx_vec<XT, V> xv = *(const rlx_vec<XT, V>*)(xr + e0);
    if (RES) {
      const rlx_vec<RT, V> rv = *(const rlx_vec<RT, V>*)(rr + e0);
      rlx_vec<HT, V> hv;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        vals[k * V + j] = LD(AccT, xv.v[j]) + LD(AccT, rv.v[j]);
        hv.v[j] = ST(HT, vals[k * V + j]);
      }
      *(rlx_vec<HT, V>*)(hr + e0) = hv;
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) vals[k * V + j] = LD(AccT, xv.v[j]);
    }
  }
}
// the row's weights (+ off) at the values rlx_norm_row_vec loads, 0 past the row's end
template <int NV, int V, typename AccT, typename WT>
__device__ __forceinline__ void rlx_norm_row_weights(AccT* wf, const WT* w, AccT off, int n, int tid, int nt) {
#pragma unroll
  for (int k = 0; k < NV; ++k)
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int e = (tid + k * nt) * V + j;
      wf[k * V + j] = e < n ? LD(AccT, w[e]) + off : (AccT)0;
    }
}
// this thread's share of a row's sum (SQ: of squares) from the values rlx_norm_row_vec loaded
template <int NV, int V, bool SQ, typename AccT>
__device__ __forceinline__ AccT rlx_norm_row_sum(const AccT* vals, int n, int tid, int nt) {
  AccT s = 0;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    if ((tid + k * nt) * V >= n) continue;
#pragma unroll
    for (int j = 0; j < V; ++j) s += SQ ? vals[k * V + j] * vals[k * V + j] : vals[k * V + j];
  }
  return s;
}
// @part rms_norm(TX, TR, TW, TH, TO, LANES, ACC, WARP, HAS_R, VEC, VPT, HAS_W, EARLY)
// VPT > 0: a row fits in VPT values per thread, kept in registers between the sum of squares
// and the scaling (one pass over memory: a decode step's norms are latency-bound); 0: two passes.
// EARLY (w a param or constant, no kernel writes it; VPT > 0): the row's weights are loaded
// before the wait for the kernel that writes x (device.Kernel), off the norm's chain of loads.
extern "C" __global__ void rlx_rms_norm(const TX* __restrict__ x, long long xrs,
    const TR* __restrict__ r, long long rrs, const TW* __restrict__ w,
    TH* __restrict__ h, TO* __restrict__ y, int n, double eps_d, double off_d, long long rows,
    const TX* __restrict__ x2, long long xrs2, const TW* __restrict__ w2, TO* __restrict__ y2, long long rows1) {
  // HAS_R: y = rms_norm(x + r) and h = x + r (fused_residual_rms_norm); else y = rms_norm(x).
  // Rows from rows1 on are a second norm's (x2, w2, y2; no residual): a decode step's q and k
  // norms in one launch. WARP: LANES lanes of a warp per row (short rows: FLUX's q/k norms over
  // 128 values, 110k rows, 16 lanes of one 16-byte load each), else a block
#if WARP
  const i64 grp = (i64)blockIdx.x * (blockDim.x / LANES) + threadIdx.x / LANES;
  if (LANES == 32 && grp >= rows) return;
  i64 row = grp < rows ? grp : rows - 1;    // (a group past the end redoes the last row: same bytes)
  const int tid = threadIdx.x % LANES, nt = LANES;
#else
  i64 row = blockIdx.x;
  const int tid = threadIdx.x, nt = blockDim.x;
#endif
  if (row >= rows1) {
    row -= rows1;
    x = x2;
    xrs = xrs2;
    w = w2;
    y = y2;
  }
#if VPT && HAS_W && EARLY
  ACC wf[VPT];
  rlx_norm_row_weights<VPT / VEC, VEC>(wf, w, (ACC)off_d, n, tid, nt);
#define RLX_WT(k, i) wf[k]
#else
#define RLX_WT(k, i) (LD(ACC, w[i]) + off)
#endif
  RLX_GRID_WAIT();
  const TX* xr = x + row * xrs;
  TO* yr = y + row * (i64)n;
#if HAS_R
  const TR* rr = r + row * rrs;
  TH* hr = h + row * (i64)n;
#define RLX_VAL(i) (LD(ACC, xr[i]) + LD(ACC, rr[i]))
#else
#define RLX_VAL(i) LD(ACC, xr[i])
#endif
#if VEC > 1
  // rows in vectors (rlx_norm_row_vec; FLUX's q/k norms over 128 values: a lane's 4 values
  // in one load, not 4)
  constexpr int NV = VPT / VEC;
  ACC vals[VPT];
#if HAS_R
  rlx_norm_row_vec<NV, VEC, true, ACC>(vals, xr, rr, hr, n, tid, nt);
#else
  rlx_norm_row_vec<NV, VEC, false, ACC>(vals, xr, xr, yr, n, tid, nt);
#endif
  ACC ss = rlx_norm_row_sum<NV, VEC, true>(vals, n, tid, nt);
#if WARP
#pragma unroll
  for (int m = LANES / 2; m > 0; m >>= 1) ss += SHFL_XOR(ss, m);
#else
  ss = block_sum(ss);
#endif
  const ACC den = sqrt(ss / (ACC)n + (ACC)eps_d);
  const ACC off = (ACC)off_d;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int e0 = (tid + k * nt) * VEC;
    if (e0 >= n) continue;
    rlx_vec<TO, VEC> yv;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      ACC v = vals[k * VEC + j] / den;
#if HAS_W
      v = v * RLX_WT(k * VEC + j, e0 + j);
#endif
      yv.v[j] = ST(TO, v);
    }
    *(rlx_vec<TO, VEC>*)(yr + e0) = yv;
  }
#else
  ACC ss = 0;
#if VPT
  ACC vals[VPT];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = tid + k * nt;
    vals[k] = i < n ? RLX_VAL(i) : (ACC)0;
  }
#endif
#if VPT
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = tid + k * nt;
    const ACC v = vals[k];
#else
  for (int i = tid; i < n; i += nt) {
    const ACC v = RLX_VAL(i);
#endif
#if HAS_R
    if (i < n) hr[i] = ST(TH, v);
#endif
    ss += v * v;
  }
#if WARP
#pragma unroll
  for (int m = LANES / 2; m > 0; m >>= 1) ss += SHFL_XOR(ss, m);
#else
  ss = block_sum(ss);
#endif
  const ACC den = sqrt(ss / (ACC)n + (ACC)eps_d);
  const ACC off = (ACC)off_d;
#if VPT
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = tid + k * nt;
    if (i >= n) break;
    ACC v = vals[k] / den;
#else
  for (int i = tid; i < n; i += nt) {
    ACC v = RLX_VAL(i) / den;
#endif
#if HAS_W
    v = v * RLX_WT(k, i);
#endif
    yr[i] = ST(TO, v);
  }
#endif
#undef RLX_VAL
#undef RLX_WT
}
// @part layer_norm(TX, TR, TG, TB, TH, TO, ACC, HAS_R, VEC, VPT, HAS_G, HAS_B)
extern "C" __global__ void rlx_layer_norm(const TX* __restrict__ x, long long xrs,
    const TR* __restrict__ r, long long rrs, const TG* __restrict__ g, const TB* __restrict__ b,
    TH* __restrict__ h, TO* __restrict__ y, int n, double eps_d) {
  // HAS_R: y = layer_norm(x + r) and h = x + r (fused_residual_ln); else y = layer_norm(x).
  // VPT: the row is read once into registers (VPT values a thread), else once per pass
  const i64 row = blockIdx.x;
  const int tid = threadIdx.x, nt = blockDim.x;
  const TX* xr = x + row * xrs;
  TO* yr = y + row * (i64)n;
#if HAS_R
  const TR* rr = r + row * rrs;
  TH* hr = h + row * (i64)n;
#define RLX_VAL(i) (LD(ACC, xr[i]) + LD(ACC, rr[i]))
#else
#define RLX_VAL(i) LD(ACC, xr[i])
#endif
#if VEC > 1
  // rows in vectors (rlx_norm_row_vec; FLUX's residual + LayerNorm over 3072 values moved 2
  // bytes a load before)
  constexpr int NV = VPT / VEC;
  ACC vals[VPT];
#if HAS_R
  rlx_norm_row_vec<NV, VEC, true, ACC>(vals, xr, rr, hr, n, tid, nt);
#else
  rlx_norm_row_vec<NV, VEC, false, ACC>(vals, xr, xr, yr, n, tid, nt);
#endif
  ACC s = rlx_norm_row_sum<NV, VEC, false>(vals, n, tid, nt);
  const ACC mean = block_sum(s) / (ACC)n;
  ACC q = 0;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    if ((tid + k * nt) * VEC >= n) continue;
#pragma unroll
    for (int j = 0; j < VEC; ++j) { const ACC d = vals[k * VEC + j] - mean; q += d * d; }
  }
  const ACC den = sqrt(block_sum(q) / (ACC)n + (ACC)eps_d);
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int e0 = (tid + k * nt) * VEC;
    if (e0 >= n) continue;
    rlx_vec<TO, VEC> yv;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      ACC v = (vals[k * VEC + j] - mean) / den;
#if HAS_G
      v = v * LD(ACC, g[e0 + j]);
#endif
#if HAS_B
      v = v + LD(ACC, b[e0 + j]);
#endif
      yv.v[j] = ST(TO, v);
    }
    *(rlx_vec<TO, VEC>*)(yr + e0) = yv;
  }
#else
#if VPT
  ACC vals[VPT];
#define RLX_EACH for (int k = 0, i = tid; k < VPT && i < n; ++k, i += nt)
#define RLX_GET(i) vals[k]
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
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
#if HAS_R
    hr[i] = ST(TH, v);
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
#if HAS_G
    v = v * LD(ACC, g[i]);
#endif
#if HAS_B
    v = v + LD(ACC, b[i]);
#endif
    yr[i] = ST(TO, v);
  }
#undef RLX_EACH
#undef RLX_GET
#endif
#undef RLX_VAL
}
