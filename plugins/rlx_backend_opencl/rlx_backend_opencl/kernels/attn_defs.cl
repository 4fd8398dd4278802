// meta: q[4], k[4], v[4], mask[4], cos[3], sin[3] strides, then mmode, hpos, rope, half, style
DEF_ROT(rot_q, T_Q)
DEF_ROT(rot_k, T_K)
#define ROTARGS(b, i) cs, c_off + (b) * m[16] + (i) * m[17], m[18], sn, s_off + (b) * m[19] + (i) * m[20], m[21], m[25], m[26]
#define LOADQ(b, h, i, d) (m[24] ? rot_q(q, q_off + (b) * m[0] + (h) * m[1] + (i) * m[2], m[3], d, ROTARGS(b, i)) \
  : (ACC)LOAD(T_Q, q, q_off + (b) * m[0] + (h) * m[1] + (i) * m[2] + (d) * m[3]))
#define LOADK(b, h, j, d) (m[24] ? rot_k(k, k_off + (b) * m[4] + (h) * m[5] + (j) * m[6], m[7], d, ROTARGS(b, j)) \
  : (ACC)LOAD(T_K, k, k_off + (b) * m[4] + (h) * m[5] + (j) * m[6] + (d) * m[7]))
#define LOADV(b, h, j, d) ((ACC)LOAD(T_V, v, v_off + (b) * m[8] + (h) * m[9] + (j) * m[10] + (d) * m[11]))
#define MOFF(b, h, i, j) (m_off + (b) * m[12] + (h) * m[13] + (i) * m[14] + (j) * m[15])
#define ATTN_ARGS __global const T_Q* q, int q_off, __global const T_K* k, int k_off, __global const T_V* v, int v_off, \
  __global T_O* o, int o_off, __global const T_M* mk, int m_off, __global const T_P* pos, int p_off, int npos, \
  __global const T_C* cs, int c_off, __global const T_C* sn, int s_off, __global const int* meta, int moff, \
  int B, int H, int KVH, int Sq, int Sk, ACC scale, ACC softcap, int kind, int window
inline ACC score_post(ACC s, ACC scale, ACC softcap) {
  s = s * scale;
  if (softcap != 0) s = tanh(s / softcap) * softcap;
  return s;
}
inline void key_range(long qlo, long qhi, int Sk, int kind, int window, int* kb, int* ke) {
  *kb = 0; *ke = Sk;
  if (kind >= 1) *ke = (int)clamp(qhi + 1, 0L, (long)Sk);
  if (kind == 2) *kb = (int)clamp(qlo - window + 1, 0L, (long)Sk);
}
