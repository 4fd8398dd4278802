// mask logic shared by mask_fill and the attention kernels.
// KIND: 0 none/custom/bias, 1 causal, 2 sliding window ; MASK_MODE: 0 none, 1 bool keep, 2 bias
// mmode: 0 no mask, 1 bool keep-mask, 2 additive bias ; hpos: a pos input gives query positions
inline long qpos0(__global const T_P* pos, int p_off, int npos, int hpos, int b, int Sq, int Sk) {
  return hpos ? (long)pos[p_off + (npos == 1 ? 0 : b)] : (long)(Sk - Sq);
}
inline ACC apply_mask(ACC s, long qp, int j, __global const T_M* mk, int mo, int kind, int window, int mmode) {
  if (mmode == 2) s = s + (ACC)LOAD(T_M, mk, mo);
  bool keep = true;
  if (kind >= 1) keep = (long)j <= qp;
  if (kind == 2) keep = keep && (long)j > qp - window;
  if (mmode == 1) keep = keep && LOAD(T_M, mk, mo) != 0;
  return keep ? s : (ACC)(-INFINITY);
}
