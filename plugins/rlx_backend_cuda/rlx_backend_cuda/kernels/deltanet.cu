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
// (contiguous x, y [B, T, C]; w [C, WID]; state [B, C, WID - 1]), a thread per output.
typedef ACC W;
extern "C" __global__ void rlx_conv1d(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ st,
    const T* __restrict__ bias, T* __restrict__ y, long long B, int steps, int C) {
  const i64 total = B * steps * C;
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
    const int n = (int)(i % C), t = (int)((i / C) % steps);
    const i64 b = i / ((i64)C * steps);
    W v = 0;
#pragma unroll
    for (int j = 0; j < WID; ++j) {
      const int u = t + j;
      const T val = u < WID - 1 ? st[(b * C + n) * (WID - 1) + u] : x[(b * steps + u - (WID - 1)) * C + n];
      v += LD(W, w[(i64)n * WID + j]) * LD(W, val);
    }
    EPILOGUE
    y[i] = ST(T, v);
  }
}
// @part conv_state(T, WID)
// The new state: the last WID - 1 steps of u, a thread per (batch, channel), oldest first so
// that writing over the old state (new == old) reads each old step before it is replaced.
extern "C" __global__ void rlx_conv1d_state(const T* __restrict__ x, const T* st, T* nst, long long B, int steps, int C) {
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < B * C; i += (i64)gridDim.x * blockDim.x) {
    const i64 b = i / C, c = i % C;
    for (int j = 0; j < WID - 1; ++j) {
      const int u = steps + j;
      nst[i * (WID - 1) + j] = u < WID - 1 ? st[i * (WID - 1) + u] : x[(b * steps + u - (WID - 1)) * C + c];
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
