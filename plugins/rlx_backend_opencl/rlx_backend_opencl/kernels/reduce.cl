// reduce ops (runtime `op`): 0 sum, 1 mean, 2 max, 3 min, 4 prod ; operands x, y
inline ACC red_comb(int op, ACC a, ACC b) {
  return op == 2 ? MAXP(a, b) : op == 3 ? MINP(a, b) : op == 4 ? a * b : a + b;
}
__kernel void reduce(__global const T_X* x, int x_off, __global T_Y* y, int y_off,
                     __global const int* meta, int moff, int rows, int n, int op) {
  ROW_SETUP
  int xo = x_off + (ok ? row_off(m, row, 0) : 0), xs = INNER(m, 0);
  int yo = y_off + (ok ? row_off(m, row, 1) : 0);
  ACC a = op == 2 ? ACC_LO : op == 3 ? ACC_HI : op == 4 ? (ACC)1 : (ACC)0;
  if (ok) for (int j = lx; j < n; j += LX) a = red_comb(op, a, (ACC)LOAD(T_X, x, xo + j * xs));
  sh[lx] = a; barrier(CLK_LOCAL_MEM_FENCE);
  for (int hh = LX >> 1; hh > 0; hh >>= 1) { if (lx < hh) sh[lx] = red_comb(op, sh[lx], sh[lx + hh]); barrier(CLK_LOCAL_MEM_FENCE); }
  a = sh[0];
  if (op == 1) a = a / (ACC)n;
  if (ok && lx == 0) STORE(T_Y, y, yo, TO_Y(a));
}
