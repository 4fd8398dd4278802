inline void dq_unit(__global const uchar* b, int u, DT* w) {
  int n = u >> 2, k = u & 3;
  __global const uchar* ql = b + 64 * n + 32 * (k & 1);
  __global const uchar* qh = b + 128 + 32 * n;
  __global const char* sc = (__global const char*)(b + 192) + 8 * n + 2 * k;
  int sl = 4 * (k >> 1), sh = 2 * k;
  DT d = (DT)f16_at(b + 208);
  DT d0 = d * (DT)sc[0], d1 = d * (DT)sc[1];
  #pragma unroll
  for (int l = 0; l < 32; ++l)
    w[l] = (l < 16 ? d0 : d1) * (DT)((int)(((ql[l] >> sl) & 15) | (((qh[l] >> sh) & 3) << 4)) - 32);
}
