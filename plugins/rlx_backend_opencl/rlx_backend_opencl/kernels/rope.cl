// meta: x strides[4], cos strides [b, s, d], sin strides [b, s, d], half, style
DEF_ROT(rot_x, T_X)
__kernel void rope(__global const T_X* x, int x_off, __global const T_C* cs, int c_off, __global const T_C* sn, int s_off,
                   __global T_Y* y, int y_off, __global const int* meta, int moff, int B, int H, int S, int D) {
  int g = get_global_id(0);
  if (g >= B * H * S * D) return;
  __global const int* m = meta + moff;
  int d = g % D, r = g / D, i = r % S; r /= S; int h = r % H, b = r / H;
  int base = x_off + b * m[0] + h * m[1] + i * m[2];
  STORE(T_Y, y, y_off + g, TO_Y(rot_x(x, base, m[3], d, cs, c_off + b * m[4] + i * m[5], m[6],
                              sn, s_off + b * m[7] + i * m[8], m[9], m[10], m[11])));
}
