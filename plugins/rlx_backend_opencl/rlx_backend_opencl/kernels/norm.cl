// operands (meta order): x, r, h, y ; weights are rank-1 (offset + stride args)
// flags: 1 residual (h = x + r), 2 weight, 4 bias, 8 write h, 16 layer norm (else rms)
#define HV(j) (res ? (ACC)LOAD(T_X, x, xo + (j) * xs) + (ACC)LOAD(T_R, r, ro + (j) * rs) : (ACC)LOAD(T_X, x, xo + (j) * xs))
__kernel void norm(__global const T_X* x, int x_off, __global const T_R* r, int r_off,
                   __global const T_W* w, int w_off, int w_st, __global const T_B* bb, int b_off, int b_st,
                   __global T_H* h, int h_off, __global T_Y* y, int y_off,
                   __global const int* meta, int moff, int rows, int n, ACC eps, ACC offset, int flags) {
  ROW_SETUP
  bool res = flags & 1, hw = flags & 2, hb = flags & 4, wh = flags & 8, layer = flags & 16;
  int xo = x_off + (ok ? row_off(m, row, 0) : 0), xs = INNER(m, 0);
  int ro = r_off + (ok ? row_off(m, row, 1) : 0), rs = INNER(m, 1);
  int ho = h_off + (ok ? row_off(m, row, 2) : 0), hs = INNER(m, 2);
  int yo = y_off + (ok ? row_off(m, row, 3) : 0), ys = INNER(m, 3);
  ACC mean = 0;
  if (layer) {
    ACC s = 0;
    if (ok) for (int j = lx; j < n; j += LX) s += HV(j);
    mean = seg_sum(s, sh, lx, LX) / (ACC)n;
  }
  ACC q = 0;
  if (ok) for (int j = lx; j < n; j += LX) { ACC d = HV(j) - mean; q += d * d; }
  ACC den = sqrt(seg_sum(q, sh, lx, LX) / (ACC)n + eps);
  if (ok) for (int j = lx; j < n; j += LX) {
    ACC v = HV(j);
    if (wh) STORE(T_H, h, ho + j * hs, TO_H(v));
    ACC o = (v - mean) / den;
    if (hw) o = o * ((ACC)LOAD(T_W, w, w_off + j * w_st) + offset);
    if (hb) o = o + (ACC)LOAD(T_B, bb, b_off + j * b_st);
    STORE(T_Y, y, yo + j * ys, TO_Y(o));
  }
}
