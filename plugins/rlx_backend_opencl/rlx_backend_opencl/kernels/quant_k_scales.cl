// the 6-bit scale and min of sub-block j of a K-quant block (llama.cpp's get_scale_min_k4)
inline void k_scale_min(__global const uchar* s, int j, int* sc, int* mn) {
  if (j < 4) { *sc = s[j] & 63; *mn = s[j + 4] & 63; }
  else { *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4); *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}
