inline void dq_unit(__global const uchar* b, int u, DT* w) {
  DT d = (DT)f32_at(b);
  __global const char* q = (__global const char*)(b + 4) + u * U;
  #pragma unroll
  for (int l = 0; l < U; ++l) w[l] = (DT)q[l] * d;
}
