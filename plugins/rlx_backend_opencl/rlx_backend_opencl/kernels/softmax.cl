__kernel void softmax(__global const T_X* x, int x_off, __global T_Y* y, int y_off,
                      __global const int* meta, int moff, int rows, int n) {
  ROW_SETUP
  int xo = x_off + (ok ? row_off(m, row, 0) : 0), xs = INNER(m, 0);
  int yo = y_off + (ok ? row_off(m, row, 1) : 0), ys = INNER(m, 1);
  ACC mx = -INFINITY;
  if (ok) for (int j = lx; j < n; j += LX) { ACC v = (ACC)LOAD(T_X, x, xo + j * xs); mx = MAXP(mx, v); }
  mx = seg_max(mx, sh, lx, LX);
  if (!isfinite(mx)) mx = 0;
  ACC s = 0;
  if (ok) for (int j = lx; j < n; j += LX) s += exp((ACC)LOAD(T_X, x, xo + j * xs) - mx);
  s = seg_sum(s, sh, lx, LX);
  if (s == 0) s = 1;
  if (ok) for (int j = lx; j < n; j += LX) STORE(T_Y, y, yo + j * ys, TO_Y(exp((ACC)LOAD(T_X, x, xo + j * xs) - mx) / s));
}
