// rope on load: x element d of a row at `base` (stride sd) rotated by table row `cb` (stride cd)
#define DEF_ROT(NAME, T) \
inline ACC NAME(__global const T* x, int base, int sd, int d, __global const T_C* cs, int cb, int cd, \
                __global const T_C* sn, int sb, int sdd, int rhalf, int rstyle) { \
  ACC v = (ACC)LOAD(T, x, base + d * sd); \
  if (d >= 2 * rhalf) return v; \
  int e; ACC o; \
  if (rstyle == 0) { \
    if (d < rhalf) { e = d; o = -(ACC)LOAD(T, x, base + (d + rhalf) * sd); } \
    else { e = d - rhalf; o = (ACC)LOAD(T, x, base + e * sd); } \
  } else { \
    e = d >> 1; o = (d & 1) ? (ACC)LOAD(T, x, base + (d - 1) * sd) : -(ACC)LOAD(T, x, base + (d + 1) * sd); \
  } \
  return v * (ACC)LOAD(T_C, cs, cb + e * cd) + o * (ACC)LOAD(T_C, sn, sb + e * sdd); \
}
