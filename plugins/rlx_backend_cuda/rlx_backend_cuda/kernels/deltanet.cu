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
