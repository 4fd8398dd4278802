inline void dq_unit(__global const uchar* b, int u, DT* w) {
  DT d = (DT)f16_at(b);
  __global const char* q = (__global const char*)(b + 2);
  #pragma unroll
  for (int l = 0; l < 32; ++l) w[l] = (DT)q[l] * d;
}
