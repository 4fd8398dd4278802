// Rotary position embedding, up to three jobs (decode's q, k, v) in one launch.
// @part row(INTERLEAVED)
// One row of a RoPE job by one warp (`lane` of 32): x's row at x + xb (dh values, element stride
// xs3) normed (norm 1: rms over its dh values; 2: over the hn heads of its position, head stride
// xs1, nw that job's weights of all heads, h this row's head), rotated where `rope` by the
// table rows cs / sn (pairs (t, t + half), or (2t, 2t + 1) where INTERLEAVED; elements past
// 2 half copied), written to orow (element stride os3). The rope launch and the decode
// attention that ropes its own q and new key (attn.cu:decode ROPE) share it, so both round alike.
// A row of unit strides in one 16-byte vector a lane (a decode step's q and k heads) takes the
// vector path: its loads (x, the norm's weights, the table rows) all issued before any arithmetic,
// a rotated value's partner from the lane half a row on (a shuffle), one store a lane. `ok`
// false: nothing stored (the caller's position is out of range; its loads need not wait for it).
template <typename RX, typename RO, typename RC, typename RN, typename RA>
__device__ __forceinline__ bool rlx_rope_row_vec(const RX* __restrict__ x, i64 xb, i64 xs3, int dh, int half,
    int norm, const RN* nw, float neps, float noff, int rope, const RC* cs, const RC* sn, RO* orow, i64 os3,
    int lane, bool ok) {
  constexpr int VL = 16 / sizeof(RX) > 1 ? 16 / sizeof(RX) : 2;   // values in a 16-byte load
  const int hv = half / VL;           // lanes between a rotated value and its partner (half style)
  if (norm == 2 || xs3 != 1 || os3 != 1 || dh % VL || dh > 32 * VL || (unsigned long long)(x + xb) % 16 ||
      (unsigned long long)orow % 16 || (!INTERLEAVED && (half % VL || (hv & (hv - 1)))))
    return false;
  const int d0 = lane * VL;
  const bool mine = d0 < dh;
  rlx_vec<RX, VL> v;
  if (mine) v = *(const rlx_vec<RX, VL>*)(x + xb + d0);
  RA w[VL], c[VL], s[VL];
#pragma unroll
  for (int j = 0; j < VL; ++j) {
    const int d = d0 + j, t = INTERLEAVED ? d / 2 : (d < half ? d : d - half);
    const bool rot = rope && mine && (INTERLEAVED ? t < half : d < 2 * half);
    w[j] = norm && mine ? LD(RA, nw[d]) + (RA)noff : (RA)1;
    c[j] = rot ? LD(RA, cs[t]) : (RA)1;
    s[j] = rot ? LD(RA, sn[t]) : (RA)0;
  }
  RA xv[VL], ss = 0;
#pragma unroll
  for (int j = 0; j < VL; ++j) {
    xv[j] = mine ? LD(RA, v.v[j]) : (RA)0;
    ss += xv[j] * xv[j];
  }
  if (norm) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) ss += SHFL_XOR(ss, m);
    const RA den = sqrt(ss / (RA)dh + (RA)neps);
#pragma unroll
    for (int j = 0; j < VL; ++j) xv[j] = xv[j] / den * w[j];
  }
  rlx_vec<RO, VL> out;
#pragma unroll
  for (int j = 0; j < VL; ++j) {
#if INTERLEAVED
    const RA other = xv[j ^ 1];
    const bool first = (j & 1) == 0;
#else
    const RA other = SHFL_XOR(xv[j], hv > 0 ? hv : 1);
    const bool first = d0 + j < half;
#endif
    // (d1: x1 c - x2 s; d2: x2 c + x1 s; the rest: c 1, s 0)
    out.v[j] = ST(RO, first ? xv[j] * c[j] - other * s[j] : xv[j] * c[j] + other * s[j]);
  }
  if (ok && mine) *(rlx_vec<RO, VL>*)(orow + d0) = out;
  return true;
}
template <typename RX, typename RO, typename RC, typename RN, typename RA>
__device__ __forceinline__ void rlx_rope_row(const RX* __restrict__ x, i64 xb, i64 xs1, i64 xs3, int dh,
    int half, int norm, int hn, int h, const RN* nw, float neps, float noff, int rope, const RC* cs,
    const RC* sn, RO* orow, i64 os3, int lane, bool ok = true) {
  if (rlx_rope_row_vec<RX, RO, RC, RN, RA>(x, xb, xs3, dh, half, norm, nw, neps, noff, rope, cs, sn, orow,
                                           os3, lane, ok))
    return;
  if (!ok) return;
  RA den = 1;
  if (norm) {              // the norm's row: this head's dh values, or all hn heads' (the warp sums them)
    const int span = norm == 2 ? hn * dh : dh;
    const i64 nb = norm == 2 ? xb - h * xs1 : xb;
    constexpr int VL = 16 / sizeof(RX) > 0 ? 16 / sizeof(RX) : 1;   // values in a 16-byte load
    RA ss = 0;
    if (xs3 == 1 && dh % VL == 0 && xs1 % VL == 0 && (unsigned long long)(x + nb) % 16 == 0) {
      for (int e = lane * VL; e < span; e += 32 * VL) {
        const rlx_vec<RX, VL> v = *(const rlx_vec<RX, VL>*)(x + nb + (e / dh) * xs1 + e % dh);
#pragma unroll
        for (int j = 0; j < VL; ++j) ss += LD(RA, v.v[j]) * LD(RA, v.v[j]);
      }
    } else {
      for (int e = lane; e < span; e += 32) {
        const RA v = LD(RA, x[nb + (e / dh) * xs1 + (e % dh) * xs3]);
        ss += v * v;
      }
    }
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) ss += SHFL_XOR(ss, m);
    den = sqrt(ss / (RA)span + (RA)neps);
    if (norm == 2) nw += h * dh;
  }
  // x[d], normed where the job norms
#define RLX_X(d) (norm ? LD(RA, x[xb + (d) * xs3]) / den * (LD(RA, nw[d]) + (RA)noff) : LD(RA, x[xb + (d) * xs3]))
  const int pairs = half + (dh - 2 * half);    // (rotated pairs, then the rest one by one)
  for (int t = lane; t < pairs; t += 32) {
    if (t < half) {
#if INTERLEAVED
      const int d1 = 2 * t, d2 = 2 * t + 1;
#else
      const int d1 = t, d2 = t + half;
#endif
      const RA x1 = RLX_X(d1), x2 = RLX_X(d2);
      if (rope) {
        const RA cc = LD(RA, cs[t]), ss = LD(RA, sn[t]);
        orow[d1 * os3] = ST(RO, x1 * cc - x2 * ss);
        orow[d2 * os3] = ST(RO, x2 * cc + x1 * ss);
      } else {
        orow[d1 * os3] = ST(RO, x1);
        orow[d2 * os3] = ST(RO, x2);
      }
    } else {
      const int d = 2 * half + (t - half);
      orow[d * os3] = ST(RO, RLX_X(d));
    }
  }
#undef RLX_X
}
// @part rope(TX, TO, TC, TP, ACC, TN)
// RoPE for up to three jobs in one launch (decode's q, k and v of a layer): job j maps
// x_j [B, H_j, S, D] (any strides) to o_j (any strides), rotated (rope_j) or copied as is;
// at_j: o_j is a KV cache and row s goes to position pos[b] + s (the kv_write the job does).
// norm_j: x_j is normed as it is loaded, rms_norm(x) * (nw_j + noff_j) over one head's row (1)
// or over the position's H_j heads (2): the q/k norms before the rope, no launch of their own.
#define RLX_JOB(j) const TX* __restrict__ x##j, long long xa##j, long long xb##j, long long xc##j, \
    long long xd##j, TO* o##j, long long oa##j, long long ob##j, long long oc##j, long long od##j, \
    int H##j, int rope##j, int at##j, const TN* __restrict__ nw##j, int norm##j, float neps##j, float noff##j
#define RLX_PICK(j) { x = x##j; xs0 = xa##j; xs1 = xb##j; xs2 = xc##j; xs3 = xd##j; o = o##j; os0 = oa##j; \
    os1 = ob##j; os2 = oc##j; os3 = od##j; rope = rope##j; at = at##j; nw = nw##j; norm = norm##j; \
    neps = neps##j; noff = noff##j; hn = H##j; }
extern "C" __global__ void rlx_rope(const TC* __restrict__ cs, const TC* __restrict__ sn, int B, int S,
    int D, int half, int per_batch, const TP* __restrict__ pos, long long nax, int* err, int node,
    RLX_JOB(0), RLX_JOB(1), RLX_JOB(2)) {
  // rows (head, batch, position) go to the block's threadIdx.y, a warp each (rlx_rope_row)
  const i64 per_head = (i64)B * S;
  const i64 total = per_head * (H0 + H1 + H2);
  for (i64 row = blockIdx.x * (i64)blockDim.y + threadIdx.y; row < total; row += (i64)gridDim.x * blockDim.y) {
    i64 h = row / per_head;
    const TX* x; TO* o; const TN* nw; long long xs0, xs1, xs2, xs3, os0, os1, os2, os3;
    int rope, at, norm, hn; float neps, noff;
    if (h < H0) RLX_PICK(0)
    else if (h < H0 + H1) { RLX_PICK(1) h -= H0; }
    else { RLX_PICK(2) h -= H0 + H1; }
    const i64 rem = row % per_head;
    const int s = (int)(rem % S), b = (int)(rem / S);
    // (the row's loads are not held back by the position's: a bad one only stops the stores)
    const i64 p = at ? (i64)pos[b] : 0;
    const bool ok = !at || (p >= 0 && p + S <= nax);
    if (!ok && threadIdx.x == 0) rlx_error(err, 2, node, p, nax);
    const i64 ci = (per_batch ? (i64)b * S * half : 0) + (i64)s * half;
    rlx_rope_row<TX, TO, TC, TN, ACC>(x, b * xs0 + h * xs1 + s * xs2, xs1, xs3, D, half, norm, hn, (int)h, nw,
                                      neps, noff, rope, cs + ci, sn + ci,
                                      o + b * os0 + h * os1 + (s + (ok ? p : 0)) * os2, os3, threadIdx.x, ok);
  }
}
// @part rope_vec(TX, TO, TC, ACC, INTERLEAVED)
// RoPE over 16-bit rows of unit element stride and 16-byte aligned starts, every pair rotated:
// a thread reads and writes 8 elements as one 16-byte vector (interleaved: 4 pairs; half
// style: 8 elements and their 8 partners half a row on). The launch shape and jobs of ROPE.
#define RLX_JOB(j) const TX* __restrict__ x##j, long long xa##j, long long xb##j, long long xc##j, \
    TO* o##j, long long oa##j, long long ob##j, long long oc##j, int H##j
#define RLX_PICK(j) { x = x##j; xs0 = xa##j; xs1 = xb##j; xs2 = xc##j; o = o##j; os0 = oa##j; \
    os1 = ob##j; os2 = oc##j; }
extern "C" __global__ void rlx_rope_vec(const TC* __restrict__ cs, const TC* __restrict__ sn, int B, int S,
    int D, int half, int per_batch, RLX_JOB(0), RLX_JOB(1), RLX_JOB(2)) {
  typedef rlx_vec<TX, 8> VX;
  typedef rlx_vec<TO, 8> VO;
  const int per_row = (INTERLEAVED ? D : half) / 8;
  const i64 per_head = (i64)B * S;
  const i64 total = per_head * (H0 + H1 + H2) * per_row;
  for (i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
    const int c = (int)(idx % per_row) * 8;
    const i64 row = idx / per_row;
    i64 h = row / per_head;
    const TX* x; TO* o; long long xs0, xs1, xs2, os0, os1, os2;
    if (h < H0) RLX_PICK(0)
    else if (h < H0 + H1) { RLX_PICK(1) h -= H0; }
    else { RLX_PICK(2) h -= H0 + H1; }
    const i64 rem = row % per_head;
    const int s = (int)(rem % S), b = (int)(rem / S);
    const TX* xr = x + b * xs0 + h * xs1 + s * xs2;
    TO* orow = o + b * os0 + h * os1 + s * os2;
    const i64 cb = (per_batch ? (i64)b * S * half : 0) + (i64)s * half;
#if INTERLEAVED
    const VX xv = *(const VX*)(xr + c);
    VO ov;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const ACC x1 = LD(ACC, xv.v[2 * e]), x2 = LD(ACC, xv.v[2 * e + 1]);
      const ACC cc = LD(ACC, cs[cb + c / 2 + e]), ss = LD(ACC, sn[cb + c / 2 + e]);
      ov.v[2 * e] = ST(TO, x1 * cc - x2 * ss);
      ov.v[2 * e + 1] = ST(TO, x2 * cc + x1 * ss);
    }
    *(VO*)(orow + c) = ov;
#else
    const VX a = *(const VX*)(xr + c), z = *(const VX*)(xr + c + half);
    VO oa, oz;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const ACC x1 = LD(ACC, a.v[e]), x2 = LD(ACC, z.v[e]);
      const ACC cc = LD(ACC, cs[cb + c + e]), ss = LD(ACC, sn[cb + c + e]);
      oa.v[e] = ST(TO, x1 * cc - x2 * ss);
      oz.v[e] = ST(TO, x2 * cc + x1 * ss);
    }
    *(VO*)(orow + c) = oa;
    *(VO*)(orow + c + half) = oz;
#endif
  }
}
