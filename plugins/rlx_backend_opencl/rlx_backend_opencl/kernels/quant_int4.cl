inline void dq_unit(__global const uchar* b, int u, DT* w) {
  DT d = (DT)f32_at(b);
  #pragma unroll
  for (int l = 0; l < U; ++l) {
    int e = u * U + l;
    uint v = b[4 + e % (QK / 2)];
    w[l] = (DT)((int)(e < QK / 2 ? (v & 15) : (v >> 4)) - 8) * d;
  }
}
