#define DPT ((DV + W - 1) / W)
__kernel __attribute__((reqd_work_group_size(W, 1, 1)))
void attn_decode(ATTN_ARGS) {
  __local ACC Qs[D];
  __local ACC Ps[W];
  __local ACC red[W];
  __global const int* m = meta + moff;
  int lid = get_local_id(0), row = get_group_id(0);
  int i = row % Sq, bh = row / Sq, b = bh / H, h = bh % H, kh = h / (H / KVH);
  for (int d = lid; d < D; d += W) Qs[d] = LOADQ(b, h, i, d);
  barrier(CLK_LOCAL_MEM_FENCE);
  long qp = qpos0(pos, p_off, npos, m[23], b, Sq, Sk) + i;
  int kb, ke;
  key_range(qp, qp, Sk, kind, window, &kb, &ke);
  ACC mrow = -INFINITY, lp = 0, acc[DPT];
  for (int t = 0; t < DPT; ++t) acc[t] = 0;
  for (int k0 = kb; k0 < ke; k0 += W) {
    int j = k0 + lid;
    ACC s = -INFINITY;
    if (j < ke) {
      ACC dot = 0;
      for (int d = 0; d < D; ++d) dot += Qs[d] * LOADK(b, kh, j, d);
      s = apply_mask(score_post(dot, scale, softcap), qp, j, mk, MOFF(b, h, i, j), kind, window, m[22]);
    }
    red[lid] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int hh = W >> 1; hh > 0; hh >>= 1) { if (lid < hh) red[lid] = fmax(red[lid], red[lid + hh]); barrier(CLK_LOCAL_MEM_FENCE); }
    ACC mnew = fmax(mrow, red[0]);
    ACC alpha = mrow == -INFINITY ? (ACC)0 : exp(mrow - mnew);
    ACC p = s == -INFINITY ? (ACC)0 : exp(s - mnew);
    Ps[lid] = p;
    barrier(CLK_LOCAL_MEM_FENCE);
    lp = lp * alpha + p;
    int nk = min(W, ke - k0);
    for (int t = 0; t < DPT; ++t) {
      int d = lid + t * W;
      if (d < DV) {
        ACC a = acc[t] * alpha;
        for (int jj = 0; jj < nk; ++jj) if (Ps[jj] != 0) a += Ps[jj] * LOADV(b, kh, k0 + jj, d);
        acc[t] = a;
      }
    }
    mrow = mnew;
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  red[lid] = lp;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int hh = W >> 1; hh > 0; hh >>= 1) { if (lid < hh) red[lid] += red[lid + hh]; barrier(CLK_LOCAL_MEM_FENCE); }
  ACC l = red[0];
  for (int t = 0; t < DPT; ++t) {
    int d = lid + t * W;
    if (d < DV) STORE(T_O, o, o_off + (bh * Sq + i) * DV + d, TO_O(l == 0 ? (ACC)0 : acc[t] / l));
  }
}
