#define UPB (QK / U)
inline DT epi(DT v, int n, __global const T_BIAS* bias, int bias_off, int bias_st, int has_bias, int act) {
  v = (DT)TO_Y(v);
  if (has_bias) v = (DT)TO_Y(v + (DT)LOAD(T_BIAS, bias, bias_off + n * bias_st));
  return act_fn(act, v);
}
#define DQ_ARGS __global const T_X* x, int x_off, __global const uchar* w, int w_off, __global T_Y* y, int y_off, \
  __global const T_BIAS* bias, int bias_off, int bias_st, int M, int N, int K, int has_bias, int act

// One work-group per output column n: each work-item decodes one unit of 64 consecutive ones
// into local memory, then all of them walk those 64*U elements with x read coalesced.
__kernel __attribute__((reqd_work_group_size(64, 1, 1)))
void dq_gemv(DQ_ARGS) {
  __local DT Ws[64][U + 1];
  __local DT sh[MR][64];
  int lid = get_local_id(0), n = get_group_id(0), m0 = get_group_id(1) * MR;
  int mr = min(MR, M - m0), nu = K / U;
  __global const uchar* wr = w + w_off + n * ((K / QK) * BPB);
  int xo = x_off + m0 * K;
  DT acc[MR];
#pragma unroll
  for (int r = 0; r < MR; ++r) acc[r] = 0;
  for (int c0 = 0; c0 < nu; c0 += 64) {
    int t = c0 + lid;
    DT wv[U];
    if (t < nu) dq_unit(wr + (t / UPB) * BPB, t % UPB, wv);
    #pragma unroll
    for (int l = 0; l < U; ++l) Ws[lid][l] = t < nu ? wv[l] : (DT)0;
    barrier(CLK_LOCAL_MEM_FENCE);
    int kb = c0 * U, ke = min(K - kb, 64 * U);
    for (int e = lid; e < ke; e += 64) {
      DT wk = Ws[e / U][e % U];
#pragma unroll
      for (int r = 0; r < MR; ++r) if (r < mr) acc[r] += wk * (DT)LOAD(T_X, x, xo + r * K + kb + e);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
#pragma unroll
  for (int r = 0; r < MR; ++r) sh[r][lid] = acc[r];
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int h = 32; h > 0; h >>= 1) {
    if (lid < h) for (int r = 0; r < mr; ++r) sh[r][lid] += sh[r][lid + h];
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (lid < mr) STORE(T_Y, y, y_off + (m0 + lid) * N + n, TO_Y(epi(sh[lid][0], n, bias, bias_off, bias_st, has_bias, act)));
}

// 64x64 output tile per 16x16 work-group (4x4 per work-item); each K step is one unit: 64
// work-items decode the tile's 64 weight rows into local memory, all multiply.
__kernel __attribute__((reqd_work_group_size(16, 16, 1)))
void dq_gemm(DQ_ARGS) {
  __local DT Xs[U][65];
  __local DT Ws[U][65];
  int tx = get_local_id(0), ty = get_local_id(1), tid = ty * 16 + tx;
  int m0 = get_group_id(1) * 64, n0 = get_group_id(0) * 64, nu = K / U, rb = (K / QK) * BPB;
  DT acc[4][4];
  for (int i = 0; i < 4; ++i) for (int j = 0; j < 4; ++j) acc[i][j] = 0;
  for (int t = 0; t < nu; ++t) {
    for (int i = tid; i < 64 * U; i += 256) {
      int mm = i / U, kk = i % U, gm = m0 + mm;
      Xs[kk][mm] = gm < M ? (DT)LOAD(T_X, x, x_off + gm * K + t * U + kk) : (DT)0;
    }
    if (tid < 64) {
      DT wv[U];
      int gn = n0 + tid;
      if (gn < N) dq_unit(w + w_off + gn * rb + (t / UPB) * BPB, t % UPB, wv);
      else for (int l = 0; l < U; ++l) wv[l] = 0;
      #pragma unroll
      for (int l = 0; l < U; ++l) Ws[l][tid] = wv[l];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int kk = 0; kk < U; ++kk) {
      DT a[4], bb[4];
      for (int r = 0; r < 4; ++r) { a[r] = Xs[kk][ty + 16 * r]; bb[r] = Ws[kk][tx + 16 * r]; }
      for (int r = 0; r < 4; ++r) for (int c = 0; c < 4; ++c) acc[r][c] += a[r] * bb[c];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  for (int r = 0; r < 4; ++r) for (int c = 0; c < 4; ++c) {
    int gm = m0 + ty + 16 * r, gn = n0 + tx + 16 * c;
    if (gm < M && gn < N) STORE(T_Y, y, y_off + gm * N + gn, TO_Y(epi(acc[r][c], gn, bias, bias_off, bias_st, has_bias, act)));
  }
}

// rows x RB bytes -> rows x K values, one work-item per unit
__kernel void dq_rows(__global const uchar* w, int w_off, __global T_Y* y, int y_off, int units, int K) {
  int g = get_global_id(0);
  if (g >= units) return;
  int nu = K / U, row = g / nu, t = g % nu;
  DT wv[U];
  dq_unit(w + w_off + row * ((K / QK) * BPB) + (t / UPB) * BPB, t % UPB, wv);
  #pragma unroll
  for (int l = 0; l < U; ++l) STORE(T_Y, y, y_off + row * K + t * U + l, TO_Y(wv[l]));
}
