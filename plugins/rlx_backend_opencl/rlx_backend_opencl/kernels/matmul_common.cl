// C[b] = act(A[b] @ B[b] + bias), A: (M,K) with strides sam/sak, B: (K,N) with sbk/sbn,
// batch dims (<= 4) with per-operand strides in meta: [nb, shape[nb], a strides[nb], b strides[nb]].
#define ROUND(v) ((ACC)TO_C(v))
inline void batch_offsets(__global const int* m, int bz, int* ao, int* bo) {
  int nb = m[0];
  for (int d = nb - 1; d >= 0; --d) {
    int s = m[1 + d], c = bz % s; bz /= s;
    *ao += c * m[1 + nb + d]; *bo += c * m[1 + 2 * nb + d];
  }
}
// meta[1 + 3 * nb]: 1 when there is a bias
inline ACC epilogue(ACC v, __global const int* m, __global const T_BIAS* bias, int bias_off, int bias_st, int n) {
  v = ROUND(v);
  if (m[1 + 3 * m[0]]) v = ROUND(v + (ACC)LOAD(T_BIAS, bias, bias_off + n * bias_st));
  return ACT(v);
}
