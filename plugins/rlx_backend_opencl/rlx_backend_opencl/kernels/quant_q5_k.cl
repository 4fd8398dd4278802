inline void dq_unit(__global const uchar* b, int u, DT* w) {
  int sc, mn;
  k_scale_min(b + 4, u, &sc, &mn);
  DT ds = (DT)f16_at(b) * (DT)sc, dm = (DT)f16_at(b + 2) * (DT)mn;
  __global const uchar* qh = b + 16;
  __global const uchar* q = b + 48 + 32 * (u >> 1);
  int sh = 4 * (u & 1);
  #pragma unroll
  for (int l = 0; l < 32; ++l) w[l] = ds * (DT)(((q[l] >> sh) & 15) | (((qh[l] >> u) & 1) << 4)) - dm;
}
