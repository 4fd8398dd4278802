__kernel void gather(__global const T_X* t, int t_off, __global const T_I* idx, int i_off, __global T_Y* y, int y_off,
                     int pre, int ni, int nax, int post, __global int* err, int node) {
  int g = get_global_id(0);
  if (g >= pre * ni * post) return;
  int p = g % post, r = g / post, ii = r % ni, a = r / ni;
  long ix = (long)idx[i_off + ii];
  if (ix < 0) ix += nax;
  if (ix < 0 || ix >= nax) {
    set_err(err, 1, node, (int)clamp((long)idx[i_off + ii], (long)INT_MIN, (long)INT_MAX), nax);
    STORE(T_Y, y, y_off + g, 0);
    return;
  }
  STORE(T_Y, y, y_off + g, LOAD(T_X, t, t_off + (a * nax + (int)ix) * post + p));
}
