// A Gated DeltaNet layer between its projections (gated_delta_net), step by step, in one launch.
// @part net(T, ACC, KD, VD, R, WID, NW, KPL, VPW, CPT, VEC, EARLY, CS)
// A cluster of CS blocks per (key head hk, batch row b) owns everything that head touches:
// block `rank` the state columns [rank BC, (rank + 1) BC) of its R value heads' recurrent
// states [KD, VD] (BC = R VD / CS), held in registers for all steps (read once, written once: a
// decode step updates both states in place), and the conv channels of q, k (each block computes
// them; rank 0 writes their conv state rows, after a cluster barrier every rank's reads precede)
// and of its columns' v. CS > 1 (sm_90) spreads a decode step's few heads over more SMs: a block
// holds whole value heads (BC a multiple of VD) or PB = VD / BC blocks share one, each pushing
// its part's sum of squares into the others' shared memory (no cluster-wide barrier a step: a
// relaxed one, arrived at after the first step's conv and waited for at the end, keeps rank 0's
// conv rows from overwriting what another rank reads in place). Per step:
//   1. the gates: decay = exp(-exp(A_log) softplus(a + dt_bias)), beta = sigmoid(b) (thread r);
//      the short conv + silu of the block's channels (thread tid the channels tid, tid + NT, ..,
//      its taps and its window of the last WID - 1 inputs in registers); each thread's z
//      values asked for (used in 3);
//   2. the rule (as deltanet.cu:rule) on the l2-normed q (also scaled) and k: warp w the value
//      columns [cb + w VPW, cb + (w + 1) VPW) of the R heads side by side (cb = rank BC), lane
//      l the state rows l, l + 32, ..; S' = e^g S + k delta^T, delta = beta (v - e^g S^T k),
//      o = e^g S^T q + delta (k . q).
//      Every warp sums q's and k's squares in the butterfly that sums S^T k and S^T q, and
//      scales those sums by the norms after it: the norms take no barrier and no warps of
//      their own (a Qwen3.5 decode step's 16 blocks wait on barriers and loads, not math);
//   3. the gated RMSNorm of each value head's o: the sum of squares of each head (or part of
//      one) a warp, then a thread a column: o rsqrt(mean(o^2) + eps) norm_w silu(z).
// The last step stores the new state as soon as the rule has it (its stores overlap the norm).
// Layouts: x [B, T, C] read through its step and batch strides (C = 2 HK KD + HK R VD: q, k, v;
// unit channel stride); conv_w [C, WID]; conv states [B, C, WID - 1]; z [B, T, H, VD] through
// its batch, step and head strides; b, a [B, T, H] through their batch and step strides;
// A_log, dt_bias [H]; norm_w [VD]; states [B, H, KD, VD]; o [B, T, H, VD] contiguous.
// VEC: a warp's VPW columns lie in one head's row and are 16-byte aligned (vector loads).
// EARLY: conv_w, both states, A_log, dt_bias and norm_w come from leaves no kernel of this run
// writes (params, state leaves): they are loaded before waiting for the kernel before (a
// programmatic dependent launch: the state loads overlap the in-projection GEMV's tail).
typedef ACC W;
#define NT (32 * NW)
#define BC (R * VD / CS)                // state columns (and v channels) of a block
#define NC (2 * KD + BC)                // conv channels of a block: q, k and its v
#define KEEP (WID > 1 ? WID - 1 : 1)
#define GPT ((R + NT - 1) / NT)         // gates a thread computes
#define SEG (BC < VD ? BC : VD)         // a value head's columns in one block
#define PB (VD / SEG)                   // blocks sharing a value head (1: a block holds whole heads)
#define NZ ((BC + NT - 1) / NT)         // columns a thread norms
__device__ __forceinline__ W rlx_net_silu(W v) { return v / ((W)1 + exp(-v)); }
__device__ __forceinline__ W rlx_net_sum(W v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += SHFL_XOR(v, m);
  return v;
}
extern "C" __global__ void RLX_CLUSTER(CS, 1, 1) __launch_bounds__(NT) rlx_gdn_net(const T* __restrict__ x,
    const T* __restrict__ cw, const T* cs0, T* cs1, const T* __restrict__ z, const T* __restrict__ bl,
    const T* __restrict__ al, const T* __restrict__ a_log, const T* __restrict__ dt_bias,
    const T* __restrict__ norm_w, const T* s0, T* s1, T* __restrict__ o, int steps, int HK, i64 xb, i64 xt,
    i64 zb, i64 zt, i64 zh, i64 bb, i64 bt, i64 ab, i64 at, W scale, W eps) {
  static_assert(BC * CS == R * VD && SEG * PB == VD && BC % SEG == 0,
                "rlx_gdn_net: a block holds whole value heads or an equal part of one");
  __shared__ W qk[2 * KD];           // the step's q then k (before their l2norms)
  __shared__ W vs[BC];               // its v of the block's columns
  __shared__ W os[BC];               // the rule's output before the norm
  __shared__ W dec[R], bet[R];       // e^g and beta of each value head
#if PB > 1
  __shared__ W part[2][PB];          // the head's parts' sums of squares, a buffer a step parity
  __shared__ unsigned long long got[2];  // the other parts' arrivals into it
#else
  __shared__ W ssq[BC / SEG];        // the sum of squares of each head of os
#endif
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int hk = blockIdx.x / CS, rank = blockIdx.x % CS, b = blockIdx.y, H = HK * R;
  const int cb = rank * BC;          // the block's first column of the key head's R * VD
  const i64 C = (i64)2 * HK * KD + (i64)H * VD;
  // the block's conv channels (taps and window in registers) and the state columns of this
  // warp (rows lane + 32 i): loaded before the wait where EARLY, else after it
  i64 ch[CPT];
  W taps[CPT][WID], win[CPT][KEEP];
  W S[KPL][VPW];
  W ea[GPT], dtb[GPT], nwv[NZ];      // exp(A_log) and dt_bias of the thread's gates, norm_w of its columns
  const int c0 = cb + warp * VPW;
  // the warp's runs of state columns: rows lane + 32 i, columns c0 + j0 .. + RUN (one 16-byte
  // vector where VEC, else one column), `in` where they lie in the block's columns
  constexpr int RUN = VEC ? 16 / sizeof(T) : 1;
  auto each_run = [&](auto f) {
#pragma unroll
    for (int i = 0; i < KPL; ++i)
#pragma unroll
      for (int j0 = 0; j0 < VPW; j0 += RUN)
        f(i, j0, (((i64)b * H + (i64)hk * R + (c0 + j0) / VD) * KD + lane + 32 * i) * VD + (c0 + j0) % VD,
          lane + 32 * i < KD && c0 + j0 < cb + BC);
  };
  auto load_leaves = [&]() {
#pragma unroll
    for (int g = 0; g < GPT; ++g) {
      const int r = tid + g * NT, h = hk * R + r;
      ea[g] = r < R ? exp(LD(W, a_log[h])) : (W)0;
      dtb[g] = r < R ? LD(W, dt_bias[h]) : (W)0;
    }
#pragma unroll
    for (int i = 0; i < NZ; ++i) nwv[i] = tid + i * NT < BC ? LD(W, norm_w[(cb + tid + i * NT) % VD]) : (W)0;
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
      const int lc = tid + j * NT;
      ch[j] = lc < KD ? (i64)hk * KD + lc
            : lc < 2 * KD ? (i64)(HK + hk) * KD + lc - KD : (i64)2 * HK * KD + (i64)hk * R * VD + cb + lc - 2 * KD;
#pragma unroll
      for (int i = 0; i < WID; ++i) taps[j][i] = lc < NC ? LD(W, cw[ch[j] * WID + i]) : (W)0;
#pragma unroll
      for (int i = 0; i < KEEP; ++i) win[j][i] = lc < NC && WID > 1 ? LD(W, cs0[((i64)b * C + ch[j]) * (WID - 1) + i]) : (W)0;
    }
    each_run([&](int i, int j0, i64 at, bool in) {
      rlx_vec<T, RUN> p;
      if (in) p = *(const rlx_vec<T, RUN>*)&s0[at];
#pragma unroll
      for (int e = 0; e < RUN; ++e) S[i][j0 + e] = in ? LD(W, p.v[e]) : (W)0;
    });
  };
  auto store_state = [&]() {
    each_run([&](int i, int j0, i64 at, bool in) {
      rlx_vec<T, RUN> p;
#pragma unroll
      for (int e = 0; e < RUN; ++e) p.v[e] = ST(T, S[i][j0 + e]);
      if (in) *(rlx_vec<T, RUN>*)&s1[at] = p;
    });
  };
  if (EARLY) load_leaves();
#if PB > 1
  rlx_push_start(got, 2);
#endif
  RLX_GRID_WAIT();
  if (!EARLY) load_leaves();
  for (int t = 0; t < steps; ++t) {
    // 1. the step's inputs, every load issued before any is used (one trip to L2, not one a
    //    kind); then the gates and the conv; the z values of the thread's columns (used in 3)
    const T* xr = x + (i64)b * xb + (i64)t * xt;
    T z_in[NZ], a_in[GPT], b_in[GPT], x_in[CPT];
#pragma unroll
    for (int i = 0; i < NZ; ++i) {
      const int col = cb + tid + i * NT;
      if (tid + i * NT < BC) z_in[i] = z[(i64)b * zb + (i64)t * zt + (i64)(hk * R + col / VD) * zh + col % VD];
    }
#pragma unroll
    for (int g = 0; g < GPT; ++g) {
      const int h = hk * R + tid + g * NT;
      if (tid + g * NT < R) {
        a_in[g] = al[(i64)b * ab + (i64)t * at + h];
        b_in[g] = bl[(i64)b * bb + (i64)t * bt + h];
      }
    }
#pragma unroll
    for (int j = 0; j < CPT; ++j)
      if (tid + j * NT < NC) x_in[j] = xr[ch[j]];
#pragma unroll
    for (int g = 0; g < GPT; ++g) {
      const int r = tid + g * NT;
      if (r >= R) break;
      const W a = LD(W, a_in[g]) + dtb[g];
      const W sp = (a > (W)0 ? a : (W)0) + log1p(exp(-fabs(a)));
      dec[r] = exp(-ea[g] * sp);
      bet[r] = (W)1 / ((W)1 + exp(-LD(W, b_in[g])));
    }
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
      const int lc = tid + j * NT;
      if (lc >= NC) break;
      const W xv = LD(W, x_in[j]);
      W y = taps[j][WID - 1] * xv;
#pragma unroll
      for (int i = 0; i < WID - 1; ++i) y += taps[j][i] * win[j][i];
#pragma unroll
      for (int i = 0; i + 1 < WID - 1; ++i) win[j][i] = win[j][i + 1];
      if (WID > 1) win[j][KEEP - 1] = xv;
      y = rlx_net_silu(y);
      if (lc < 2 * KD) qk[lc] = y; else vs[lc - 2 * KD] = y;
    }
#if CS > 1
    if (t == 0) rlx_cluster_arrive();  // (the conv state read: see the end; no launch has 0 steps)
#endif
    __syncthreads();
    // 2. the rule, q's and k's l2norms in its butterfly
    {
      W kr[KPL], qr[KPL], kq = 0, kk2 = 0, qq2 = 0;
#pragma unroll
      for (int i = 0; i < KPL; ++i) {
        const int kk = lane + 32 * i;
        kr[i] = kk < KD ? qk[KD + kk] : (W)0;
        qr[i] = kk < KD ? qk[kk] : (W)0;
        kq += kr[i] * qr[i];
        kk2 += kr[i] * kr[i];
        qq2 += qr[i] * qr[i];
      }
      W sk[VPW], sq[VPW];
#pragma unroll
      for (int j = 0; j < VPW; ++j) {
        sk[j] = sq[j] = 0;
#pragma unroll
        for (int i = 0; i < KPL; ++i) { sk[j] += S[i][j] * kr[i]; sq[j] += S[i][j] * qr[i]; }
      }
#pragma unroll
      for (int m = 16; m > 0; m >>= 1) {
        kq += SHFL_XOR(kq, m);
        kk2 += SHFL_XOR(kk2, m);
        qq2 += SHFL_XOR(qq2, m);
#pragma unroll
        for (int j = 0; j < VPW; ++j) { sk[j] += SHFL_XOR(sk[j], m); sq[j] += SHFL_XOR(sq[j], m); }
      }
      const W ik = rsqrt(kk2 + (W)1e-6), iq = rsqrt(qq2 + (W)1e-6) * scale;
#pragma unroll
      for (int i = 0; i < KPL; ++i) kr[i] *= ik;
#pragma unroll
      for (int j = 0; j < VPW; ++j) {
        const int col = c0 + j;
        if (col >= cb + BC) break;
        const W e = dec[col / VD], delta = bet[col / VD] * (vs[col - cb] - e * sk[j] * ik);
#pragma unroll
        for (int i = 0; i < KPL; ++i) S[i][j] = e * S[i][j] + kr[i] * delta;
        if (lane == (j & 31)) os[col - cb] = e * sq[j] * iq + delta * kq * ik * iq;
      }
    }
    if (t == steps - 1) store_state();
    __syncthreads();
    // 3. the gated RMSNorm: each head's (part's) sum of squares a warp, then a column a thread
    for (int p = warp; p < BC / SEG; p += NW) {
      W ss = 0;
      for (int i = lane; i < SEG; i += 32) ss += os[p * SEG + i] * os[p * SEG + i];
      ss = rlx_net_sum(ss);
#if PB > 1
      if (lane == 0) {                 // (the block's one part: pushed to the head's other blocks)
        const int me = rank % PB;
        part[t & 1][me] = ss;
        rlx_push_expect(&got[t & 1], (PB - 1) * sizeof(W));
        for (int q = 0; q < PB; ++q)
          if (q != me) rlx_push(&part[t & 1][me], rank / PB * PB + q, ss, &got[t & 1]);
      }
#else
      if (lane == 0) ssq[p] = ss;
#endif
    }
#if PB > 1
    rlx_push_wait(&got[t & 1], (t >> 1) & 1);
#else
    __syncthreads();
#endif
#pragma unroll
    for (int i = 0; i < NZ; ++i) {
      const int c = tid + i * NT, col = cb + c;
      if (c >= BC) break;
#if PB > 1
      W ss = 0;                      // the head's parts
#pragma unroll
      for (int p = 0; p < PB; ++p) ss += part[t & 1][p];
#else
      const W ss = ssq[c / SEG];
#endif
      const W inv = rsqrt(ss / (W)VD + eps);
      o[(((i64)b * steps + t) * H + hk * R + col / VD) * VD + col % VD] =
          ST(T, os[c] * inv * nwv[i] * rlx_net_silu(LD(W, z_in[i])));
    }
    // qk, vs, os, ssq, dec and bet are free for the next step (part[t & 1] is not pushed into
    // again before every block of the head has read it: that push waits for this block's next)
    __syncthreads();
  }
  // the new conv states (q's and k's rows by rank 0, once every rank has read them)
#if CS > 1
  rlx_cluster_wait();
#endif
#pragma unroll
  for (int j = 0; j < CPT; ++j) {
    const int lc = tid + j * NT;
    if (lc < NC && WID > 1 && (lc >= 2 * KD || rank == 0))
#pragma unroll
      for (int i = 0; i < KEEP; ++i) cs1[((i64)b * C + ch[j]) * (WID - 1) + i] = ST(T, win[j][i]);
  }
}
