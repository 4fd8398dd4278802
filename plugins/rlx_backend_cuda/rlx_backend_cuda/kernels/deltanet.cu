// Gated DeltaNet (gated_delta_rule) and the short causal convolution before it (causal_conv1d).
// @part rule(T, ACC, KD, VD, KPL, VPW, PF)
// The recurrent form, one step after another: a warp holds the state columns [v0, v0 + VPW)
// of one (batch, head), lane l its rows l, l + 32, ... (KPL of them), in registers for the
// whole sequence; the state is read once and written once (a decode step inside the CUDA
// graph; a prefill walks all T steps). Per step, with S the state before it:
//   S' = e^g S + k delta^T,  delta = beta (v - e^g S^T k),  o = scale S'^T q
//      = scale (e^g S^T q + delta (k . q)),
// so the three sums over K (S^T k, S^T q, k . q) come from one round of warp reductions.
// Inputs are loaded PF steps ahead (a ring of registers). Value head h reads key head
// h / (H / HK). Layouts contiguous: q, k [B, T, HK, KD]; v, o [B, T, H, VD]; g, beta [B, T, H];
// states [B, H, KD, VD].
typedef ACC W;
struct rlx_gdn_in { W k[KPL], q[KPL], v[VPW], g, beta; };
__device__ __forceinline__ void rlx_gdn_load(rlx_gdn_in& s, const T* __restrict__ q, const T* __restrict__ k,
    const T* __restrict__ v, const T* __restrict__ g, const T* __restrict__ beta, i64 qk, i64 vo, i64 gb,
    int lane, int v0) {
#pragma unroll
  for (int i = 0; i < KPL; ++i) {
    const int kk = lane + 32 * i;
    s.k[i] = kk < KD ? LD(W, k[qk + kk]) : (W)0;
    s.q[i] = kk < KD ? LD(W, q[qk + kk]) : (W)0;
  }
#pragma unroll
  for (int j = 0; j < VPW; ++j) s.v[j] = v0 + j < VD ? LD(W, v[vo + v0 + j]) : (W)0;
  s.g = LD(W, g[gb]);
  s.beta = LD(W, beta[gb]);
}
extern "C" __global__ void __launch_bounds__(128) rlx_gdn(const T* __restrict__ q, const T* __restrict__ k,
    const T* __restrict__ v, const T* __restrict__ g, const T* __restrict__ beta, const T* s0,
    T* __restrict__ o, T* s1, int steps, int H, int HK, W scale) {
  const int lane = threadIdx.x & 31;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (H / HK);
  const int v0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * VPW;
  if (v0 >= VD) return;
  const i64 sb = ((i64)b * H + h) * KD * VD;
  W S[KPL][VPW];
#pragma unroll
  for (int i = 0; i < KPL; ++i)
#pragma unroll
    for (int j = 0; j < VPW; ++j) {
      const int kk = lane + 32 * i;
      S[i][j] = kk < KD && v0 + j < VD ? LD(W, s0[sb + (i64)kk * VD + v0 + j]) : (W)0;
    }
  // a ring of PF steps' inputs: step t + PF is loaded as soon as step t is done with its slot
  rlx_gdn_in buf[PF];
  const i64 b0 = (i64)b * steps;
#pragma unroll
  for (int d = 0; d < PF; ++d)
    if (d < steps) rlx_gdn_load(buf[d], q, k, v, g, beta, ((b0 + d) * HK + hk) * KD, ((b0 + d) * H + h) * VD, (b0 + d) * H + h, lane, v0);
  for (int t0 = 0; t0 < steps; t0 += PF) {
#pragma unroll
    for (int d = 0; d < PF; ++d) {
      const int t = t0 + d;
      if (t >= steps) break;
      rlx_gdn_in& cur = buf[d];
      W sk[VPW], sq[VPW], kq = 0;
#pragma unroll
      for (int i = 0; i < KPL; ++i) kq += cur.k[i] * cur.q[i];
#pragma unroll
      for (int j = 0; j < VPW; ++j) {
        sk[j] = sq[j] = 0;
#pragma unroll
        for (int i = 0; i < KPL; ++i) { sk[j] += S[i][j] * cur.k[i]; sq[j] += S[i][j] * cur.q[i]; }
      }
#pragma unroll
      for (int m = 16; m > 0; m >>= 1) {
        kq += SHFL_XOR(kq, m);
#pragma unroll
        for (int j = 0; j < VPW; ++j) { sk[j] += SHFL_XOR(sk[j], m); sq[j] += SHFL_XOR(sq[j], m); }
      }
      const W decay = exp(cur.g);
      const i64 vo = ((b0 + t) * H + h) * VD + v0;
#pragma unroll
      for (int j = 0; j < VPW; ++j) {
        const W delta = cur.beta * (cur.v[j] - decay * sk[j]);
#pragma unroll
        for (int i = 0; i < KPL; ++i) S[i][j] = decay * S[i][j] + cur.k[i] * delta;
        if (lane == j && v0 + j < VD) o[vo + j] = ST(T, scale * (decay * sq[j] + delta * kq));
      }
      const i64 tn = b0 + t + PF;
      if (t + PF < steps) rlx_gdn_load(cur, q, k, v, g, beta, (tn * HK + hk) * KD, (tn * H + h) * VD, tn * H + h, lane, v0);
    }
  }
#pragma unroll
  for (int i = 0; i < KPL; ++i)
#pragma unroll
    for (int j = 0; j < VPW; ++j) {
      const int kk = lane + 32 * i;
      if (kk < KD && v0 + j < VD) s1[sb + (i64)kk * VD + v0 + j] = ST(T, S[i][j]);
    }
}
// @part conv(T, ACC, WID, EPILOGUE)
// y[b, t, c] = act(bias[c] + sum_i w[c, i] u[b, t + i, c]), u = the state's W - 1 steps then x
// (x [B, T, C] with unit channel stride, its step and batch strides xt, xb: a column slice of
// a projection is read in place; y [B, T, C] contiguous; w [C, WID]; state [B, C, WID - 1]).
// A thread per channel and run of `run` steps (grid: channel blocks, runs, batch) keeps its
// taps and the window of the last WID inputs in registers, so each input is read once and no
// index is divided (a thread per output read each input WID times, three 64-bit divisions).
typedef ACC W;
extern "C" __global__ void rlx_conv1d(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ st,
    const T* __restrict__ bias, T* __restrict__ y, int steps, int C, int run, i64 xt, i64 xb) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= C) return;
  const i64 b = blockIdx.z;
  const int t0 = blockIdx.y * run, t1 = min(steps, t0 + run);
  const T* xr = x + b * xb + n;
  T* yr = y + b * steps * C + n;
  W tap[WID], win[WID];
#pragma unroll
  for (int j = 0; j < WID; ++j) tap[j] = LD(W, w[(i64)n * WID + j]);
#pragma unroll
  for (int j = 0; j < WID - 1; ++j) {            // u[t0 + j]: the state's step, or x's step t0 + j - (WID - 1)
    const int u = t0 + j;
    win[j] = LD(W, u < WID - 1 ? st[(b * C + n) * (WID - 1) + u] : xr[(u - (WID - 1)) * xt]);
  }
  for (int t = t0; t < t1; ++t) {
    win[WID - 1] = LD(W, xr[t * xt]);
    W v = 0;
#pragma unroll
    for (int j = 0; j < WID; ++j) v += tap[j] * win[j];
    EPILOGUE
    yr[(i64)t * C] = ST(T, v);
#pragma unroll
    for (int j = 0; j < WID - 1; ++j) win[j] = win[j + 1];
  }
}
// @part conv_state(T, WID)
// The new state: the last WID - 1 steps of u, a thread per (batch, channel), oldest first so
// that writing over the old state (new == old) reads each old step before it is replaced
// (x's strides as rlx_conv1d's).
extern "C" __global__ void rlx_conv1d_state(const T* __restrict__ x, const T* st, T* nst, long long B, int steps, int C,
    i64 xt, i64 xb) {
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < B * C; i += (i64)gridDim.x * blockDim.x) {
    const i64 b = i / C, c = i % C;
    for (int j = 0; j < WID - 1; ++j) {
      const int u = steps + j;
      nst[i * (WID - 1) + j] = u < WID - 1 ? st[i * (WID - 1) + u] : x[b * xb + (u - (WID - 1)) * xt + c];
    }
  }
}
// @part chunk_prep(T, C, KD, VD, TILE)
// The chunked (WY / UT) form, pass 1 of 2: the parts of each chunk of C steps that need no
// state, every (chunk, value head, batch) a block of 256 threads, all chunks at once
// (rlx_core.ir.deltanet.delta_chunked's math). With cum the chunk's cumulative log-decay
// (steps past the sequence: g = beta = k = q = v = 0, they change nothing):
//   A  = strictly-lower(beta_i (k_i . k_j) e^(cum_i - cum_j)),  X = (I + A)^-1 (forward
//        substitution, in place),
//   wbuf = X (beta e^cum K) [C, KD],  ubuf = X (beta V) [C, VD],
//   abuf = lower(scale (q_i . k_j) e^(cum_i - cum_j)) [C, C],  cbuf = cum [C]
// (f32 scratch, chunk-major per (batch, head)). Rows of K and V are staged TILE columns at a time.
extern "C" __global__ void __launch_bounds__(256) rlx_gdn_prep(const T* __restrict__ q, const T* __restrict__ k,
    const T* __restrict__ v, const T* __restrict__ g, const T* __restrict__ beta, float* __restrict__ wbuf,
    float* __restrict__ ubuf, float* __restrict__ abuf, float* __restrict__ cbuf, int steps, int H, int HK,
    float scale) {
  constexpr int PER = (C * C + 255) / 256;
  __shared__ float X[C][C + 1];
  __shared__ float ta[C][TILE + 1], tb[C][TILE + 1];
  __shared__ float cum[C], bet[C];
  const int tid = threadIdx.x, c = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / (H / HK);
  const int t0 = c * C, n = min(C, steps - t0);
  const i64 chunk = ((i64)b * H + h) * gridDim.x + c;          // the chunk's index in the scratch
  if (tid < C) {
    const i64 at = ((i64)b * steps + t0 + tid) * H + h;
    bet[tid] = tid < n ? LD(float, beta[at]) : 0.f;
    cum[tid] = tid < n ? LD(float, g[at]) : 0.f;
  }
  __syncthreads();
  if (tid == 0)
    for (int i = 1; i < C; ++i) cum[i] += cum[i - 1];
  __syncthreads();
  if (tid < C) cbuf[chunk * C + tid] = cum[tid];
  // k_i . k_j and q_i . k_j for j <= i, over KD in tiles
  float kk[PER], qk[PER];
#pragma unroll
  for (int r = 0; r < PER; ++r) kk[r] = qk[r] = 0.f;
  for (int d0 = 0; d0 < KD; d0 += TILE) {
    for (int e = tid; e < C * TILE; e += 256) {
      const int i = e / TILE, d = e % TILE;
      const bool ok = i < n && d0 + d < KD;
      const i64 off = (((i64)b * steps + t0 + i) * HK + hk) * KD + d0 + d;
      ta[i][d] = ok ? LD(float, k[off]) : 0.f;
      tb[i][d] = ok ? LD(float, q[off]) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < PER; ++r) {
      const int e = tid + 256 * r, i = e / C, j = e % C;
      if (e < C * C && j <= i) {
#pragma unroll 8
        for (int d = 0; d < TILE; ++d) { kk[r] += ta[i][d] * ta[j][d]; qk[r] += tb[i][d] * ta[j][d]; }
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int r = 0; r < PER; ++r) {
    const int e = tid + 256 * r, i = e / C, j = e % C;
    if (e < C * C) {
      const float decay = j <= i ? expf(cum[i] - cum[j]) : 0.f;
      X[i][j] = j < i ? bet[i] * kk[r] * decay : 0.f;
      abuf[chunk * C * C + e] = scale * qk[r] * decay;
    }
  }
  __syncthreads();
  // X = (I + A)^-1, row by row: X_ic = [i == c] - sum_{c <= j < i} A_ij X_jc, 4 threads a column
  {
    const int col = tid >> 2, part = tid & 3;
    for (int i = 0; i < C; ++i) {
      float s = 0.f;
      if (col < i)
        for (int j = col + part; j < i; j += 4) s += X[i][j] * X[j][col];
      s += SHFL_XOR(s, 1);
      s += SHFL_XOR(s, 2);
      __syncthreads();
      if (col < C && part == 0) X[i][col] = col < i ? -s : (col == i ? 1.f : 0.f);
      __syncthreads();
    }
  }
  // wbuf = X (beta e^cum K), ubuf = X (beta V): TILE columns at a time
  for (int pass = 0; pass < 2; ++pass) {
    const int D = pass == 0 ? KD : VD;
    float* out = pass == 0 ? wbuf : ubuf;
    for (int d0 = 0; d0 < D; d0 += TILE) {
      for (int e = tid; e < C * TILE; e += 256) {
        const int i = e / TILE, d = e % TILE;
        float x = 0.f;
        if (i < n && d0 + d < D)
          x = pass == 0 ? bet[i] * expf(cum[i]) * LD(float, k[(((i64)b * steps + t0 + i) * HK + hk) * KD + d0 + d])
                        : bet[i] * LD(float, v[(((i64)b * steps + t0 + i) * H + h) * VD + d0 + d]);
        ta[i][d] = x;
      }
      __syncthreads();
      for (int e = tid; e < C * TILE; e += 256) {
        const int i = e / TILE, d = e % TILE;
        float s = 0.f;
        for (int j = 0; j <= i; ++j) s += X[i][j] * ta[j][d];
        if (d0 + d < D) out[(chunk * C + i) * D + d0 + d] = s;
      }
      __syncthreads();
    }
  }
}
// @part chunk_scan(T, C, KD, VD, VS)
// Pass 2 of 2: the one walk over the chunks, a block per (VS state columns, value head, batch)
// holding its columns of the state S [KD, VS] in shared memory. Per chunk, from pass 1's
// scratch:
//   U = ubuf - wbuf S,   O = scale e^cum_i (q_i S) + abuf U,
//   S <- e^cum_last S + sum_j e^(cum_last - cum_j) k_j U_j.
// The next chunk's inputs are in flight while this one computes, so the walk waits on memory
// once, not once a chunk: wbuf's and abuf's rows by cp.async into the other of two stages,
// q, k, ubuf and cum in registers (rlx_gdn_next). Shared memory: Wc[2], Qc, Kc [C][KD + 1],
// Ac[2] [C][C + 1], U and Ue (U_j e^(cum_last - cum_j)) [C][VS + 1], S [KD][VS + 1], cum [C].
constexpr int SC_N = (C * KD + 255) / 256, SC_U = (C * VS + 255) / 256;
constexpr int SC_KP = KD + 1, SC_CP = C + 1, SC_VP = VS + 1;
__device__ __forceinline__ void rlx_cp4(float* dst, const float* src) {
#if defined(RLX_HIP) || !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 800
  *dst = *src;
#else
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
#endif
}
__device__ __forceinline__ void rlx_cp_wait() {
#if !defined(RLX_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}
struct rlx_gdn_next { float u[SC_U], cum; T q[SC_N], k[SC_N]; };
__device__ __forceinline__ void rlx_gdn_fetch(rlx_gdn_next& x, float* Wc, float* Ac, const T* __restrict__ q,
    const T* __restrict__ k, const float* __restrict__ wbuf, const float* __restrict__ ubuf,
    const float* __restrict__ abuf, const float* __restrict__ cbuf, i64 chunk, i64 row0, int HK, int n, int v0,
    int tid) {
#pragma unroll 1
  for (int e = tid; e < C * KD; e += 256) rlx_cp4(Wc + (e / KD) * SC_KP + e % KD, wbuf + chunk * C * KD + e);
#pragma unroll 1
  for (int e = tid; e < C * C; e += 256) rlx_cp4(Ac + (e / C) * SC_CP + e % C, abuf + chunk * C * C + e);
  const T* qr = q + row0 * KD;
  const T* kr = k + row0 * KD;
#pragma unroll
  for (int r = 0; r < SC_N; ++r) {
    const int e = tid + 256 * r, i = e / KD, d = e % KD;
    const bool ok = e < C * KD && i < n;
    x.q[r] = ok ? qr[(i64)i * HK * KD + d] : T();
    x.k[r] = ok ? kr[(i64)i * HK * KD + d] : T();
  }
#pragma unroll
  for (int r = 0; r < SC_U; ++r) {
    const int e = tid + 256 * r, i = e / VS, j = e % VS;
    x.u[r] = e < C * VS && v0 + j < VD ? ubuf[(chunk * C + i) * VD + v0 + j] : 0.f;
  }
  x.cum = tid < C ? cbuf[chunk * C + tid] : 0.f;
}
extern "C" __global__ void __launch_bounds__(256, 1) rlx_gdn_scan(const T* __restrict__ q, const T* __restrict__ k,
    const float* __restrict__ wbuf, const float* __restrict__ ubuf, const float* __restrict__ abuf,
    const float* __restrict__ cbuf, const T* s0, T* __restrict__ o, T* s1, int steps, int H, int HK, int nch,
    float scale) {
  constexpr int KP = SC_KP, CP = SC_CP, VP = SC_VP;
  extern __shared__ float sm[];
  float* Wst = sm;                    // two stages of C * KP
  float* Qc = Wst + 2 * C * KP;
  float* Kc = Qc + C * KP;
  float* Ast = Kc + C * KP;           // two stages of C * CP
  float* U = Ast + 2 * C * CP;
  float* Ue = U + C * VP;
  float* S = Ue + C * VP;
  float* cum = S + KD * VP;
  const int tid = threadIdx.x, v0 = blockIdx.x * VS, h = blockIdx.y, b = blockIdx.z, hk = h / (H / HK);
  const i64 sb = ((i64)b * H + h) * KD * VD, head = (i64)b * H + h;
  for (int e = tid; e < KD * VS; e += 256) {
    const int r = e / VS, j = e % VS;
    S[r * VP + j] = v0 + j < VD ? LD(float, s0[sb + (i64)r * VD + v0 + j]) : 0.f;
  }
  rlx_gdn_next nx;
  rlx_gdn_fetch(nx, Wst, Ast, q, k, wbuf, ubuf, abuf, cbuf, head * nch, (i64)b * steps * HK + hk, HK, min(C, steps),
                v0, tid);
  for (int c = 0; c < nch; ++c) {
    const int t0 = c * C, n = min(C, steps - t0);
    const float* Wc = Wst + (c & 1) * C * KP;
    const float* Ac = Ast + (c & 1) * C * CP;
    __syncthreads();                  // the last chunk is done with the stage, U and S
#pragma unroll
    for (int r = 0; r < SC_N; ++r) {
      const int e = tid + 256 * r, i = e / KD, d = e % KD;
      if (e < C * KD) { Qc[i * KP + d] = LD(float, nx.q[r]); Kc[i * KP + d] = LD(float, nx.k[r]); }
    }
    float u0[SC_U];
#pragma unroll
    for (int r = 0; r < SC_U; ++r) u0[r] = nx.u[r];
    if (tid < C) cum[tid] = nx.cum;
    rlx_cp_wait();                    // this chunk's Wc and Ac rows (this thread's copies)
    __syncthreads();
    if (c + 1 < nch) {                // in flight while this chunk computes
      const int tn = t0 + C;
      rlx_gdn_fetch(nx, Wst + ((c + 1) & 1) * C * KP, Ast + ((c + 1) & 1) * C * CP, q, k, wbuf, ubuf, abuf, cbuf,
                    head * nch + c + 1, ((i64)b * steps + tn) * HK + hk, HK, min(C, steps - tn), v0, tid);
    }
    const float last = cum[C - 1];
    float qs[SC_U];
#pragma unroll
    for (int r = 0; r < SC_U; ++r) {
      const int e = tid + 256 * r, i = e / VS, j = e % VS;
      float ws = 0.f;
      qs[r] = 0.f;
      if (e < C * VS) {
#pragma unroll 4
        for (int d = 0; d < KD; ++d) {
          const float sv = S[d * VP + j];
          ws += Wc[i * KP + d] * sv;
          qs[r] += Qc[i * KP + d] * sv;
        }
        qs[r] *= scale * expf(cum[i]);
        U[i * VP + j] = u0[r] - ws;
        Ue[i * VP + j] = (u0[r] - ws) * expf(last - cum[i]);
      }
    }
    __syncthreads();                  // U is complete; every read of S for this chunk is done
#pragma unroll
    for (int r = 0; r < SC_U; ++r) {
      const int e = tid + 256 * r, i = e / VS, j = e % VS;
      if (e < C * VS) {
        float acc = qs[r];
        for (int m = 0; m <= i; ++m) acc += Ac[i * CP + m] * U[m * VP + j];
        if (i < n && v0 + j < VD) o[(((i64)b * steps + t0 + i) * H + h) * VD + v0 + j] = ST(T, acc);
      }
    }
    const float gl = expf(last);
    for (int e = tid; e < KD * VS; e += 256) {
      const int d = e / VS, j = e % VS;
      float acc = gl * S[d * VP + j];
#pragma unroll 4
      for (int m = 0; m < C; ++m) acc += Kc[m * KP + d] * Ue[m * VP + j];
      S[d * VP + j] = acc;
    }
  }
  __syncthreads();
  for (int e = tid; e < KD * VS; e += 256) {
    const int r = e / VS, j = e % VS;
    if (v0 + j < VD) s1[sb + (i64)r * VD + v0 + j] = ST(T, S[r * VP + j]);
  }
}
// @part tc_common(T)
// The chunked form on tensor cores (f16 / bf16 data, chunks of 64 steps, K and V multiples of
// 16): flash-linear-attention's split of chunk_gated_delta_rule in three launches,
//   tc_prep  every chunk at once: cum, A, (I + A)^-1, W = X (beta e^cum K), U = X (beta V);
//   tc_scan  per (BV state columns, head, batch) the one walk over the chunks: the state at
//            each chunk's start H_c (stored), V_new = U - W H_c (stored over U), and
//            H_{c+1} = e^cum_last H_c + K^T (V_new e^(cum_last - cum));
//   tc_out   every chunk at once: O = scale (e^cum Q) H_c + lower(scale Q K^T e^(cum_i - cum_j)) V_new
// (rlx_core.ir.deltanet.delta_chunked's math, its sequential loop cut at the state). Products
// are mma.sync.m16n8k16 with f32 accumulate; their operands (W, U, V_new, H_c, (I + A)^-1, the
// masked Q K^T) are rounded to the data's type as fla rounds them; A, its inverse's
// substitution, the state itself and every decay stay f32. A warp's fragments come from
// shared memory by ldmatrix: a row-major A [m][k] (rlx_gtc_a), a B stored [n][k]
// (rlx_gtc_bn), a B or a transposed A stored [k][n] / [k][m] (.trans: rlx_gtc_bt, rlx_gtc_at).
typedef unsigned short hword;
#define GC 64
// A [16 x 16] at (m0, k0) of a row-major [m][k] matrix
__device__ __forceinline__ void rlx_gtc_a(u32* a, const hword* s, int ld, int m0, int k0, int lane) {
  rlx_ldm_x4(a, s + (m0 + (lane & 15)) * ld + k0 + (lane >> 4) * 8);
}
// A [16 x 16] at (m0, k0) of a matrix stored transposed, [k][m]
__device__ __forceinline__ void rlx_gtc_at(u32* a, const hword* s, int ld, int m0, int k0, int lane) {
  const int i = lane & 7, j = lane >> 3;
  rlx_ldm_x4<true>(a, s + (k0 + i + (j >> 1) * 8) * ld + m0 + (j & 1) * 8);
}
// B of two n-tiles (n0.. n0 + 15) for k0.. k0 + 15, B stored [n][k]: b[0], b[1] the first tile's
__device__ __forceinline__ void rlx_gtc_bn(u32* b, const hword* s, int ld, int k0, int n0, int lane) {
  const int i = lane & 7, j = lane >> 3;
  rlx_ldm_x4(b, s + (n0 + i + (j >> 1) * 8) * ld + k0 + (j & 1) * 8);
}
// the same, B stored [k][n]
__device__ __forceinline__ void rlx_gtc_bt(u32* b, const hword* s, int ld, int k0, int n0, int lane) {
  const int i = lane & 7, j = lane >> 3;
  rlx_ldm_x4<true>(b, s + (k0 + i + (j & 1) * 8) * ld + n0 + (j >> 1) * 8);
}
__device__ __forceinline__ u32 rlx_gtc_pack(float lo, float hi) {
  T l = ST(T, lo), h = ST(T, hi);
  return (u32)(*(hword*)&l) | ((u32)(*(hword*)&h) << 16);
}
// rows r0.. r0 + GC - 1 of a [rows][D] matrix (row stride `stride` elements) into s[GC][D + 8],
// rows at or past `rows` zero; 16-byte copies in flight (the caller commits and waits)
template <int D>
__device__ __forceinline__ void rlx_gtc_rows(hword* s, const T* src, i64 stride, int r0, int rows, int tid) {
  for (int e = tid; e < GC * (D / 8); e += 128) {
    const int r = e / (D / 8), c = (e % (D / 8)) * 8;
    const bool ok = r0 + r < rows;
    rlx_cp16(s + r * (D + 8) + c, ok ? (const void*)(src + (i64)(r0 + r) * stride + c) : (const void*)src,
             ok);
  }
}
// @part tc_prep(KD, VD)
// Pass 1: a block of 4 warps per (chunk, value head, batch); warp w the rows 16w.. 16w + 15.
// Shared: Ks [GC][KD + 8] (K, then beta e^cum K in place), Vs [GC][VD + 8] (beta V),
// Af, Xf [GC][GC + 1] f32 (A; X = (I + A)^-1), Xh [GC][GC + 8] (X rounded, over Af once the
// inverse is done: at K = V = 128 three blocks fit an SM's shared memory, not two),
// Tf [4][16][17] (a warp's block product), cum, bet, fac (beta e^cum).
// Writes W [B, H, NT * GC, KD], U [B, H, NT * GC, VD] and cum [B, H, NT * GC].
extern "C" __global__ void __launch_bounds__(128) rlx_gdn_tc_prep(const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ g, const T* __restrict__ beta, T* __restrict__ wbuf, T* __restrict__ ubuf,
    float* __restrict__ cbuf, int steps, int H, int HK) {
  constexpr int KP = KD + 8, VP = VD + 8, XP = GC + 8;
  extern __shared__ __align__(16) unsigned char rlx_sm[];
  hword* Ks = (hword*)rlx_sm;
  hword* Vs = Ks + GC * KP;
  float* Af = (float*)(Vs + GC * VP);
  hword* Xh = (hword*)Af;
  float* Xf = Af + GC * (GC + 1);
  float* Tf = Xf + GC * (GC + 1);
  float* cum = Tf + 4 * 16 * 17;
  float* bet = cum + GC;
  float* fac = bet + GC;
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, gr = lane >> 2, tg = lane & 3;
  const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / (H / HK), t0 = c * GC;
  const i64 row0 = ((i64)b * H + h) * gridDim.x * GC + t0;     // the chunk's first row in the scratch
  rlx_gtc_rows<KD>(Ks, k + ((i64)b * steps * HK + hk) * KD, (i64)HK * KD, t0, steps, tid);
  rlx_gtc_rows<VD>(Vs, v + ((i64)b * steps * H + h) * VD, (i64)H * VD, t0, steps, tid);
  RLX_CP_COMMIT();
  if (tid < GC) {
    const bool ok = t0 + tid < steps;
    const i64 at = ((i64)b * steps + t0 + tid) * H + h;
    float x = ok ? LD(float, g[at]) : 0.f;
    bet[tid] = ok ? LD(float, beta[at]) : 0.f;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {           // the warp's inclusive prefix sum
      const float y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    cum[tid] = x;
  }
  __syncthreads();
  if (tid >= 32 && tid < GC) cum[tid] += cum[31];
  RLX_CP_WAIT(0);
  __syncthreads();
  if (tid < GC) {
    cbuf[row0 + tid] = cum[tid];
    fac[tid] = bet[tid] * expf(cum[tid]);
  }
  // beta V, in place
  for (int e = tid; e < GC * VD; e += 128) {
    const int r = e / VD, d = e % VD;
    T x = ST(T, bet[r] * tof(*(T*)&Vs[r * VP + d]));
    Vs[r * VP + d] = *(hword*)&x;
  }
  {  // A = strictly-lower(beta_i (k_i . k_j) e^(cum_i - cum_j)): warp w rows 16w.., all 64 columns
    float acc[GC / 8][4];
#pragma unroll
    for (int nt = 0; nt < GC / 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
    for (int k0 = 0; k0 < KD; k0 += 16) {
      u32 a[4];
      rlx_gtc_a(a, Ks, KP, 16 * w, k0, lane);
#pragma unroll
      for (int nt = 0; nt < GC / 8; nt += 2) {
        u32 bf[4];
        rlx_gtc_bn(bf, Ks, KP, k0, nt * 8, lane);
        rlx_mma(acc[nt], a, bf[0], bf[1]);
        rlx_mma(acc[nt + 1], a, bf[2], bf[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < GC / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 16 * w + gr + (e >> 1) * 8, j = nt * 8 + 2 * tg + (e & 1);
        Af[i * (GC + 1) + j] = j < i ? bet[i] * acc[nt][e] * expf(cum[i] - cum[j]) : 0.f;
        Xf[i * (GC + 1) + j] = j == i ? 1.f : 0.f;
      }
  }
  __syncthreads();
  // beta e^cum K, in place (K's products are done)
  for (int e = tid; e < GC * KD; e += 128) {
    const int r = e / KD, d = e % KD;
    T x = ST(T, fac[r] * tof(*(T*)&Ks[r * KP + d]));
    Ks[r * KP + d] = *(hword*)&x;
  }
  {  // X = (I + A)^-1 in 16 x 16 blocks. Warp w inverts diagonal block w by rows (X_ic =
     // -sum_{c <= j < i} A_ij X_jc, X_cc = 1; two lanes a column); then, one block diagonal
     // d after another, warp r makes block (r, r - d): X_rc = -X_rr sum_{c <= m < r} A_rm X_mc
     // (from (I + A) X = I; the blocks X_mc are on earlier diagonals)
    constexpr int XL = GC + 1;
    const int col = lane & 15, half = lane >> 4, r0 = 16 * w;
    for (int i = 1; i < 16; ++i) {
      float sum = 0.f;
      if (col < i)
        for (int j = col + half; j < i; j += 2) sum -= Af[(r0 + i) * XL + r0 + j] * Xf[(r0 + j) * XL + r0 + col];
      sum += __shfl_xor_sync(0xffffffffu, sum, 16);
      if (half == 0 && col < i) Xf[(r0 + i) * XL + r0 + col] = sum;
      __syncwarp();
    }
    float* tw = Tf + w * 16 * 17;
    for (int d = 1; d < 4; ++d) {
      __syncthreads();
      if (w >= d) {                     // lane: row lane / 2, 8 columns (8 independent sums)
        const int c0 = 16 * (w - d), i = lane >> 1, j0 = (lane & 1) * 8;
        float t[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
        for (int m = c0; m < r0; ++m) {      // T = sum_m A_rm X_mc
          const float a = Af[(r0 + i) * XL + m];
#pragma unroll
          for (int q = 0; q < 8; ++q) t[q] += a * Xf[m * XL + c0 + j0 + q];
        }
#pragma unroll
        for (int q = 0; q < 8; ++q) tw[i * 17 + j0 + q] = t[q];
        __syncwarp();
#pragma unroll
        for (int q = 0; q < 8; ++q) t[q] = 0.f;
#pragma unroll
        for (int m = 0; m < 16; ++m) {       // X_rc = -X_rr T (X_rr's upper part is 0)
          const float a = Xf[(r0 + i) * XL + r0 + m];
#pragma unroll
          for (int q = 0; q < 8; ++q) t[q] -= a * tw[m * 17 + j0 + q];
        }
#pragma unroll
        for (int q = 0; q < 8; ++q) Xf[(r0 + i) * XL + c0 + j0 + q] = t[q];
        __syncwarp();
      }
    }
    __syncthreads();
  }
  for (int e = tid; e < GC * GC; e += 128) {
    const int i = e / GC, j = e % GC;
    T x = ST(T, Xf[i * (GC + 1) + j]);
    Xh[i * XP + j] = *(hword*)&x;
  }
  __syncthreads();
  // W = X (beta e^cum K), U = X (beta V): warp w rows 16w.., 16 columns at a time
  u32 xa[GC / 16][4];
#pragma unroll
  for (int k0 = 0; k0 < GC; k0 += 16) rlx_gtc_a(xa[k0 / 16], Xh, XP, 16 * w, k0, lane);
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int D = pass == 0 ? KD : VD, P = pass == 0 ? KP : VP;
    const hword* src = pass == 0 ? Ks : Vs;
    T* out = (pass == 0 ? wbuf : ubuf) + (row0 + 16 * w + gr) * D;
    for (int n0 = 0; n0 < D; n0 += 16) {
      float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int k0 = 0; k0 < GC; k0 += 16) {
        u32 bf[4];
        rlx_gtc_bt(bf, src, P, k0, n0, lane);
        rlx_mma(acc[0], xa[k0 / 16], bf[0], bf[1]);
        rlx_mma(acc[1], xa[k0 / 16], bf[2], bf[3]);
      }
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const int col = n0 + t * 8 + 2 * tg;
        *(u32*)&out[col] = rlx_gtc_pack(acc[t][0], acc[t][1]);
        *(u32*)&out[8 * D + col] = rlx_gtc_pack(acc[t][2], acc[t][3]);
      }
    }
  }
}
// @part tc_scan(KD, VD, BV)
// Pass 2: a block of 4 warps per (BV state columns, value head, batch) walks the chunks. The
// state's [KD x BV] columns live in the warps' accumulators (warp w the row tiles w, w + 4, ..),
// f32 for the whole walk. Per chunk, its W, K and U rows arrive by cp.async two chunks ahead:
//   Ss = H_c rounded (shared, and hbuf[c] for pass 3);
//   V_new = U - W Ss (warp w rows 16w..): over U in ubuf, and Vd = V_new e^(cum_last - cum) shared;
//   H <- e^cum_last H + K^T Vd.
// Shared: Ws[NS], Kc[NS] [GC][KD + 8], Us[NS] [GC][BV + 8], Cs[NS] [GC] f32, Ss [KD][BV + 8],
// Vd [GC][BV + 8]: NS = 3 stages, chunks c + 1 and c + 2 in flight while c computes.
extern "C" __global__ void __launch_bounds__(128, 1) rlx_gdn_tc_scan(const T* __restrict__ k,
    const T* __restrict__ wbuf, T* __restrict__ ubuf, const float* __restrict__ cbuf, const T* s0, T* s1,
    T* __restrict__ hbuf, int steps, int H, int HK, int nch) {
  constexpr int KP = KD + 8, BP = BV + 8, MT = (KD / 16 + 3) / 4, NS = 3;
  extern __shared__ __align__(16) unsigned char rlx_sm[];
  hword* Ws = (hword*)rlx_sm;
  hword* Kc = Ws + NS * GC * KP;
  hword* Us = Kc + NS * GC * KP;
  hword* Ss = Us + NS * GC * BP;
  hword* Vd = Ss + KD * BP;
  float* Cs = (float*)(Vd + GC * BP);
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, gr = lane >> 2, tg = lane & 3;
  const int v0 = blockIdx.x * BV, h = blockIdx.y, b = blockIdx.z, hk = h / (H / HK);
  const i64 head = (i64)b * H + h, rows = head * nch * GC;       // this head's first scratch row
  const T* kh = k + ((i64)b * steps * HK + hk) * KD;
  auto fetch = [&](int c) {
    const int st = c % NS;
    rlx_gtc_rows<KD>(Ws + st * GC * KP, wbuf + rows * KD, KD, c * GC, nch * GC, tid);
    rlx_gtc_rows<KD>(Kc + st * GC * KP, kh, (i64)HK * KD, c * GC, steps, tid);
    for (int e = tid; e < GC * (BV / 8); e += 128) {
      const int r = e / (BV / 8), cc = (e % (BV / 8)) * 8;
      rlx_cp16(Us + st * GC * BP + r * BP + cc, ubuf + (rows + c * GC + r) * VD + v0 + cc, true);
    }
    if (tid < GC / 4) rlx_cp16(Cs + st * GC + tid * 4, cbuf + rows + c * GC + tid * 4, true);
  };
  float S[MT][BV / 8][4];
  const i64 sb = head * KD * VD;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < BV / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int d = (mt * 4 + w) * 16 + gr + (e >> 1) * 8, j = v0 + nt * 8 + 2 * tg + (e & 1);
        S[mt][nt][e] = mt * 4 + w < KD / 16 ? LD(float, s0[sb + (i64)d * VD + j]) : 0.f;
      }
  fetch(0);
  RLX_CP_COMMIT();
  if (nch > 1) fetch(1);
  RLX_CP_COMMIT();
  for (int c = 0; c < nch; ++c) {
    const int st = c % NS;
    if (c + 2 < nch) fetch(c + 2);    // into the stage chunk c - 1 left
    RLX_CP_COMMIT();
    // H_c, rounded: into Ss and hbuf [B, H, NT, KD, VD]
    T* hc = hbuf + (head * nch + c) * KD * VD + v0;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if (mt * 4 + w >= KD / 16) break;
#pragma unroll
      for (int nt = 0; nt < BV / 8; ++nt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int d = (mt * 4 + w) * 16 + gr + r * 8, j = nt * 8 + 2 * tg;
          const u32 x = rlx_gtc_pack(S[mt][nt][2 * r], S[mt][nt][2 * r + 1]);
          *(u32*)&Ss[d * BP + j] = x;
          *(u32*)&hc[(i64)d * VD + j] = x;
        }
    }
    RLX_CP_WAIT(2);                  // this chunk's rows have landed (this thread's copies)
    __syncthreads();
    const hword* Wc = Ws + st * GC * KP;
    const hword* Kt = Kc + st * GC * KP;
    const hword* Uc = Us + st * GC * BP;
    const float* cum = Cs + st * GC;
    const float last = cum[GC - 1];
    {  // V_new = U - W H_c: warp w rows 16w.. (even and odd k-steps in two accumulators: half the chain)
      float acc[BV / 8][4], acc2[BV / 8][4];
#pragma unroll
      for (int nt = 0; nt < BV / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = acc2[nt][e] = 0.f;
#pragma unroll
      for (int k0 = 0; k0 < KD; k0 += 16) {
        u32 a[4];
        rlx_gtc_a(a, Wc, KP, 16 * w, k0, lane);
#pragma unroll
        for (int nt = 0; nt < BV / 8; nt += 2) {
          u32 bf[4];
          rlx_gtc_bt(bf, Ss, BP, k0, nt * 8, lane);
          float* c0 = (k0 & 16) ? acc2[nt] : acc[nt];
          float* c1 = (k0 & 16) ? acc2[nt + 1] : acc[nt + 1];
          rlx_mma(c0, a, bf[0], bf[1]);
          rlx_mma(c1, a, bf[2], bf[3]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < BV / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] += acc2[nt][e];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = 16 * w + gr + r * 8;
        const float dec = expf(last - cum[i]);
        T* un = ubuf + (rows + (i64)c * GC + i) * VD + v0;
#pragma unroll
        for (int nt = 0; nt < BV / 8; ++nt) {
          const int j = nt * 8 + 2 * tg;
          const T* u = (const T*)&Uc[i * BP + j];
          const float x0 = tof(u[0]) - acc[nt][2 * r], x1 = tof(u[1]) - acc[nt][2 * r + 1];
          *(u32*)&un[j] = rlx_gtc_pack(x0, x1);
          *(u32*)&Vd[i * BP + j] = rlx_gtc_pack(x0 * dec, x1 * dec);
        }
      }
    }
    __syncthreads();
    {  // H <- e^cum_last H + K^T Vd
      const float gl = expf(last);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (mt * 4 + w >= KD / 16) break;
#pragma unroll
        for (int nt = 0; nt < BV / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) S[mt][nt][e] *= gl;
#pragma unroll
        for (int k0 = 0; k0 < GC; k0 += 16) {
          u32 a[4];
          rlx_gtc_at(a, Kt, KP, (mt * 4 + w) * 16, k0, lane);
#pragma unroll
          for (int nt = 0; nt < BV / 8; nt += 2) {
            u32 bf[4];
            rlx_gtc_bt(bf, Vd, BP, k0, nt * 8, lane);
            rlx_mma(S[mt][nt], a, bf[0], bf[1]);
            rlx_mma(S[mt][nt + 1], a, bf[2], bf[3]);
          }
        }
      }
    }
    __syncthreads();                  // the stage is free for chunk c + 3, Ss and Vd for the next chunk
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < BV / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int d = (mt * 4 + w) * 16 + gr + (e >> 1) * 8, j = v0 + nt * 8 + 2 * tg + (e & 1);
        if (mt * 4 + w < KD / 16) s1[sb + (i64)d * VD + j] = ST(T, S[mt][nt][e]);
      }
}
// @part tc_out(KD, VD)
// Pass 3: a block of 4 warps per (chunk, value head, batch); warp w the output rows 16w..:
//   P = lower(scale (q_i . k_j) e^(cum_i - cum_j)) (rounded, shared),
//   O = scale e^cum_i (Q H_c)_i + P V_new, 64 output columns at a time.
// Shared: Qs, Ks [GC][KD + 8], Hs [KD][VD + 8], Vs [GC][VD + 8], Ps [GC][GC + 8], cum.
extern "C" __global__ void __launch_bounds__(128) rlx_gdn_tc_out(const T* __restrict__ q, const T* __restrict__ k,
    const T* __restrict__ ubuf, const float* __restrict__ cbuf, const T* __restrict__ hbuf, T* __restrict__ o,
    int steps, int H, int HK, float scale) {
  constexpr int KP = KD + 8, VP = VD + 8, PP = GC + 8;
  extern __shared__ __align__(16) unsigned char rlx_sm[];
  hword* Qs = (hword*)rlx_sm;
  hword* Ks = Qs + GC * KP;
  hword* Hs = Ks + GC * KP;
  hword* Vs = Hs + KD * VP;
  hword* Ps = Vs + GC * VP;
  float* cum = (float*)(Ps + GC * PP);
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, gr = lane >> 2, tg = lane & 3;
  const int c = blockIdx.x, nch = gridDim.x, h = blockIdx.y, b = blockIdx.z, hk = h / (H / HK), t0 = c * GC;
  const i64 head = (i64)b * H + h, row0 = head * nch * GC + t0;
  const i64 qk0 = ((i64)b * steps * HK + hk) * KD;
  rlx_gtc_rows<KD>(Qs, q + qk0, (i64)HK * KD, t0, steps, tid);
  rlx_gtc_rows<KD>(Ks, k + qk0, (i64)HK * KD, t0, steps, tid);
  rlx_gtc_rows<VD>(Vs, ubuf + row0 * VD, VD, 0, GC, tid);
  const T* hc = hbuf + (head * nch + c) * KD * VD;
  for (int e = tid; e < KD * (VD / 8); e += 128) {
    const int r = e / (VD / 8), cc = (e % (VD / 8)) * 8;
    rlx_cp16(Hs + r * VP + cc, hc + (i64)r * VD + cc, true);
  }
  if (tid < GC / 4) rlx_cp16(cum + tid * 4, cbuf + row0 + tid * 4, true);
  RLX_CP_COMMIT();
  RLX_CP_WAIT(0);
  __syncthreads();
  const int i0 = 16 * w + gr, i1 = i0 + 8;
  {  // P: warp w rows 16w.., the keys up to its last row
    float acc[GC / 8][4];
#pragma unroll
    for (int nt = 0; nt < GC / 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
    for (int k0 = 0; k0 < KD; k0 += 16) {
      u32 a[4];
      rlx_gtc_a(a, Qs, KP, 16 * w, k0, lane);
#pragma unroll
      for (int nt = 0; nt < GC / 8; nt += 2) {
        if (nt * 8 > 16 * w + 15) break;
        u32 bf[4];
        rlx_gtc_bn(bf, Ks, KP, k0, nt * 8, lane);
        rlx_mma(acc[nt], a, bf[0], bf[1]);
        rlx_mma(acc[nt + 1], a, bf[2], bf[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < GC / 8; ++nt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = r ? i1 : i0, j = nt * 8 + 2 * tg;
        const float p0 = j <= i ? scale * acc[nt][2 * r] * expf(cum[i] - cum[j]) : 0.f;
        const float p1 = j + 1 <= i ? scale * acc[nt][2 * r + 1] * expf(cum[i] - cum[j + 1]) : 0.f;
        *(u32*)&Ps[i * PP + j] = rlx_gtc_pack(p0, p1);
      }
  }
  __syncwarp();                       // a warp reads only its own rows of P
  u32 pa[GC / 16][4], qa[KD / 16][4];
#pragma unroll
  for (int k0 = 0; k0 < GC; k0 += 16) rlx_gtc_a(pa[k0 / 16], Ps, PP, 16 * w, k0, lane);
#pragma unroll
  for (int k0 = 0; k0 < KD; k0 += 16) rlx_gtc_a(qa[k0 / 16], Qs, KP, 16 * w, k0, lane);
  const float d0 = scale * expf(cum[i0]), d1 = scale * expf(cum[i1]);
  const bool ok0 = t0 + i0 < steps, ok1 = t0 + i1 < steps;
  T* o0 = o + (((i64)b * steps + t0 + i0) * H + h) * VD;
  T* o1 = o + (((i64)b * steps + t0 + i1) * H + h) * VD;
  for (int n0 = 0; n0 < VD; n0 += 16) {
    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int k0 = 0; k0 < KD; k0 += 16) {
      u32 bf[4];
      rlx_gtc_bt(bf, Hs, VP, k0, n0, lane);
      rlx_mma(acc[0], qa[k0 / 16], bf[0], bf[1]);
      rlx_mma(acc[1], qa[k0 / 16], bf[2], bf[3]);
    }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      acc[t][0] *= d0; acc[t][1] *= d0; acc[t][2] *= d1; acc[t][3] *= d1;
    }
#pragma unroll
    for (int k0 = 0; k0 < GC; k0 += 16) {
      if (k0 > 16 * w) break;
      u32 bf[4];
      rlx_gtc_bt(bf, Vs, VP, k0, n0, lane);
      rlx_mma(acc[0], pa[k0 / 16], bf[0], bf[1]);
      rlx_mma(acc[1], pa[k0 / 16], bf[2], bf[3]);
    }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int col = n0 + t * 8 + 2 * tg;
      if (ok0) *(u32*)&o0[col] = rlx_gtc_pack(acc[t][0], acc[t][1]);
      if (ok1) *(u32*)&o1[col] = rlx_gtc_pack(acc[t][2], acc[t][3]);
    }
  }
}
