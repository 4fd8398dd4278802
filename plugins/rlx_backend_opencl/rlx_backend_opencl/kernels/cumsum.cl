__kernel void cumsum(__global const T_X* x, int x_off, __global T_Y* y, int y_off,
                     __global const int* meta, int moff, int rows, int n) {
  int row = get_global_id(0);
  if (row >= rows) return;
  __global const int* m = meta + moff;
  int xo = x_off + row_off(m, row, 0), xs = INNER(m, 0);
  int yo = y_off + row_off(m, row, 1), ys = INNER(m, 1);
  ACC a = 0;
  for (int j = 0; j < n; ++j) { a += (ACC)LOAD(T_X, x, xo + j * xs); STORE(T_Y, y, yo + j * ys, TO_Y(a)); }
}
