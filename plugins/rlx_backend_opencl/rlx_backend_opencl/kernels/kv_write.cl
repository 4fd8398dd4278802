// meta: [nd, new shape[nd], new strides[nd], cache strides[nd]]
__kernel void kv_write(__global T_X* c, int c_off, __global const T_X* nw, int n_off, __global const T_P* pos, int p_off,
                       int npos, __global const int* meta, int moff, int total, int axis, int clen, int slen,
                       __global int* err, int node) {
  int g = get_global_id(0);
  if (g >= total) return;
  long lo = (long)pos[p_off], hi = lo;
  for (int i = 1; i < npos; ++i) { long p = (long)pos[p_off + i]; lo = min(lo, p); hi = max(hi, p); }
  if (lo < 0 || hi + slen > clen) { set_err(err, 2, node, (int)clamp(hi, (long)INT_MIN, (long)INT_MAX), clen); return; }
  __global const int* m = meta + moff;
  int nd = m[0], rem = g, on = n_off, oc = c_off, b = 0;
  for (int d = nd - 1; d >= 0; --d) {
    int s = m[1 + d], k = rem % s; rem /= s;
    on += k * m[1 + nd + d]; oc += k * m[1 + 2 * nd + d];
    if (d == 0) b = k;
  }
  long p = (long)pos[p_off + (npos == 1 ? 0 : b)];
  STORE(T_X, c, oc + (int)p * m[1 + 2 * nd + axis], LOAD(T_X, nw, on));
}
