// NaN and inf (issue 41, 2.3): a value row whose weight is 0 (a masked key: another segment of
// a packed batch, a slot past the cache position) is skipped, as 0 * NaN would carry its NaN
// into rows that never see it; a NaN score makes the row's sum l NaN, and the output divides
// by l unless l is 0 (`l > 0` dropped the NaN: zeros).
#define DPT ((DV + BK - 1) / BK)
__kernel __attribute__((reqd_work_group_size(BK, BQ, 1)))
void attn_prefill(ATTN_ARGS) {
  __local ACC Qs[BQ][D + 1];
  __local ACC Ks[BK][D + 1];
  __local ACC Vs[BK][DV + 1];
  __local ACC Ps[BQ][BK + 1];
  __global const int* m = meta + moff;
  int lx = get_local_id(0), ly = get_local_id(1), tid = ly * BK + lx;
  int qt = get_group_id(0), bh = get_group_id(1);
  int b = bh / H, h = bh % H, kh = h / (H / KVH);
  int qi = qt * BQ + ly;
  long p0 = qpos0(pos, p_off, npos, m[23], b, Sq, Sk);
  for (int e = tid; e < BQ * D; e += BQ * BK) {
    int r = e / D, d = e % D, qq = qt * BQ + r;
    Qs[r][d] = qq < Sq ? LOADQ(b, h, qq, d) : (ACC)0;
  }
  int kb, ke;
  key_range(p0 + qt * BQ, p0 + min(qt * BQ + BQ, Sq) - 1, Sk, kind, window, &kb, &ke);
  ACC mrow = -INFINITY, l = 0, acc[DPT];
  for (int t = 0; t < DPT; ++t) acc[t] = 0;
  for (int k0 = kb; k0 < ke; k0 += BK) {
    for (int e = tid; e < BK * D; e += BQ * BK) {
      int r = e / D, d = e % D, j = k0 + r;
      Ks[r][d] = j < ke ? LOADK(b, kh, j, d) : (ACC)0;
    }
    for (int e = tid; e < BK * DV; e += BQ * BK) {
      int r = e / DV, d = e % DV, j = k0 + r;
      Vs[r][d] = j < ke ? LOADV(b, kh, j, d) : (ACC)0;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    int j = k0 + lx;
    ACC s = -INFINITY;
    if (j < ke && qi < Sq) {
      ACC dot = 0;
      for (int d = 0; d < D; ++d) dot += Qs[ly][d] * Ks[lx][d];
      s = apply_mask(score_post(dot, scale, softcap), p0 + qi, j, mk, MOFF(b, h, qi, j), kind, window, m[22]);
    }
    Ps[ly][lx] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    ACC tmax = -INFINITY;
    for (int jj = 0; jj < BK; ++jj) tmax = fmax(tmax, Ps[ly][jj]);
    ACC mnew = fmax(mrow, tmax);
    ACC alpha = mrow == -INFINITY ? (ACC)0 : exp(mrow - mnew);
    ACC p = s == -INFINITY ? (ACC)0 : exp(s - mnew);
    barrier(CLK_LOCAL_MEM_FENCE);
    Ps[ly][lx] = p;
    barrier(CLK_LOCAL_MEM_FENCE);
    ACC ps = 0;
    for (int jj = 0; jj < BK; ++jj) ps += Ps[ly][jj];
    l = l * alpha + ps;
    for (int t = 0; t < DPT; ++t) {
      int d = lx + t * BK;
      if (d < DV) {
        ACC a = acc[t] * alpha;
        for (int jj = 0; jj < BK; ++jj) if (Ps[ly][jj] != 0) a += Ps[ly][jj] * Vs[jj][d];
        acc[t] = a;
      }
    }
    mrow = mnew;
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (qi < Sq) for (int t = 0; t < DPT; ++t) {
    int d = lx + t * BK;
    if (d < DV) STORE(T_O, o, o_off + ((b * H + h) * Sq + qi) * DV + d, TO_O(l == 0 ? (ACC)0 : acc[t] / l));
  }
}
