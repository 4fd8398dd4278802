inline bool tk_before(ACC a, int ia, ACC b, int ib) {
  if (ib < 0) return ia >= 0;
  if (ia < 0) return false;
  if (ISNAN(a)) return ISNAN(b) ? ia < ib : false;
  if (ISNAN(b)) return true;
  return a < b || (a == b && ia < ib);
}
__kernel void topk(__global const T_X* x, int x_off, __global T_X* y, int y_off, __global long* yi, int yi_off,
                   __global const int* meta, int moff, int rows, int n, int k) {
  ROW_SETUP
  __local int shi_[LMAX]; __local int* shi = shi_ + get_local_id(1) * LX;
  int xo = x_off + (ok ? row_off(m, row, 0) : 0), xs = INNER(m, 0);
  int yo = y_off + (ok ? row_off(m, row, 1) : 0), ys = INNER(m, 1);
  int io = yi_off + (ok ? row_off(m, row, 2) : 0), is = INNER(m, 2);
  ACC pk = 0; int pi = -1;
  for (int r = 0; r < k; ++r) {
    ACC bk = 0; int bi = -1;
    if (ok) for (int j = lx; j < n; j += LX) {
      ACC kv = KEY(LOAD(T_X, x, xo + j * xs));
      if ((pi < 0 || tk_before(pk, pi, kv, j)) && tk_before(kv, j, bk, bi)) { bk = kv; bi = j; }
    }
    sh[lx] = bk; shi[lx] = bi; barrier(CLK_LOCAL_MEM_FENCE);
    for (int hh = LX >> 1; hh > 0; hh >>= 1) {
      if (lx < hh && tk_before(sh[lx + hh], shi[lx + hh], sh[lx], shi[lx])) { sh[lx] = sh[lx + hh]; shi[lx] = shi[lx + hh]; }
      barrier(CLK_LOCAL_MEM_FENCE);
    }
    pk = sh[0]; pi = shi[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    if (ok && lx == 0) { STORE(T_X, y, yo + r * ys, LOAD(T_X, x, xo + pi * xs)); yi[io + r * is] = (long)pi; }
  }
}
