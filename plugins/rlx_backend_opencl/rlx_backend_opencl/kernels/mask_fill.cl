// meta: scores strides[4], mask strides[4], mmode, hpos
__kernel void mask_fill(__global const T_X* x, int x_off, __global const T_M* mk, int m_off,
                        __global const T_P* pos, int p_off, int npos, __global T_Y* y, int y_off,
                        __global const int* meta, int moff, int B, int H, int Sq, int Sk, int kind, int window) {
  int g = get_global_id(0);
  if (g >= B * H * Sq * Sk) return;
  __global const int* m = meta + moff;
  int j = g % Sk, r = g / Sk, i = r % Sq; r /= Sq; int h = r % H, b = r / H;
  ACC s = (ACC)LOAD(T_X, x, x_off + b * m[0] + h * m[1] + i * m[2] + j * m[3]);
  long qp = qpos0(pos, p_off, npos, m[9], b, Sq, Sk) + i;
  int mo = m_off + b * m[4] + h * m[5] + i * m[6] + j * m[7];
  STORE(T_Y, y, y_off + g, TO_Y(apply_mask(s, qp, j, mk, mo, kind, window, m[8])));
}
