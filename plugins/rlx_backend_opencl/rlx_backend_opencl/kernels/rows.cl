#define LMAX 256
inline int row_off(__global const int* m, int row, int op) {
  int nd = m[0], off = 0;
  __global const int* st = m + 1 + nd + op * (nd + 1);
  for (int d = nd - 1; d >= 0; --d) { int s = m[1 + d]; off += (row % s) * st[d]; row /= s; }
  return off;
}
#define INNER(m, op) ((m)[1 + (m)[0] + (op) * ((m)[0] + 1) + (m)[0]])
inline ACC seg_sum(ACC v, __local ACC* s, int lx, int n) {
  s[lx] = v; barrier(CLK_LOCAL_MEM_FENCE);
  for (int h = n >> 1; h > 0; h >>= 1) { if (lx < h) s[lx] += s[lx + h]; barrier(CLK_LOCAL_MEM_FENCE); }
  ACC r = s[0]; barrier(CLK_LOCAL_MEM_FENCE); return r;
}
inline ACC seg_max(ACC v, __local ACC* s, int lx, int n) {
  s[lx] = v; barrier(CLK_LOCAL_MEM_FENCE);
  for (int h = n >> 1; h > 0; h >>= 1) { if (lx < h) s[lx] = MAXP(s[lx], s[lx + h]); barrier(CLK_LOCAL_MEM_FENCE); }
  ACC r = s[0]; barrier(CLK_LOCAL_MEM_FENCE); return r;
}
#define ROW_SETUP \
  __local ACC sh_[LMAX]; \
  int lx = get_local_id(0), LX = get_local_size(0); \
  __local ACC* sh = sh_ + get_local_id(1) * LX; \
  int row = get_global_id(1); bool ok = row < rows; \
  __global const int* m = meta + moff;
