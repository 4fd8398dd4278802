// q4_0, q4_1, q5_0, q5_1: 32 elements of 16 bytes of nibbles (+ a fifth bit in qh); the kind's
// LEGACY_HEAD (its fields), LEGACY_LO / LEGACY_HI (the elements of nibble pair v = qs[l]) are defines
inline void dq_unit(__global const uchar* b, int u, DT* w) {
  DT d = (DT)f16_at(b);
  LEGACY_HEAD
  #pragma unroll
  for (int l = 0; l < 16; ++l) {
    uint v = qs[l];
    w[l] = LEGACY_LO;
    w[l + 16] = LEGACY_HI;
  }
}
