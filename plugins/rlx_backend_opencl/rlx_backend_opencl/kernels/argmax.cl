// argmax: NaN is the largest, first index on ties ; topk: sorted by KEY ascending (= -x),
// NaN last, ties by index (numpy's stable argsort of -x)
inline bool am_better(ACC a, int ia, ACC b, int ib) {
  if (ib < 0) return ia >= 0;
  if (ia < 0) return false;
  if (ISNAN(a)) return ISNAN(b) ? ia < ib : true;
  if (ISNAN(b)) return false;
  return a > b || (a == b && ia < ib);
}
__kernel void argmax(__global const T_X* x, int x_off, __global long* y, int y_off,
                     __global const int* meta, int moff, int rows, int n) {
  ROW_SETUP
  __local int shi_[LMAX]; __local int* shi = shi_ + get_local_id(1) * LX;
  int xo = x_off + (ok ? row_off(m, row, 0) : 0), xs = INNER(m, 0);
  int yo = y_off + (ok ? row_off(m, row, 1) : 0);
  ACC bv = 0; int bi = -1;
  if (ok) for (int j = lx; j < n; j += LX) { ACC v = (ACC)LOAD(T_X, x, xo + j * xs); if (am_better(v, j, bv, bi)) { bv = v; bi = j; } }
  sh[lx] = bv; shi[lx] = bi; barrier(CLK_LOCAL_MEM_FENCE);
  for (int hh = LX >> 1; hh > 0; hh >>= 1) {
    if (lx < hh && am_better(sh[lx + hh], shi[lx + hh], sh[lx], shi[lx])) { sh[lx] = sh[lx + hh]; shi[lx] = shi[lx + hh]; }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (ok && lx == 0) y[yo] = (long)shi[0];
}
