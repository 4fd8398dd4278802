// Rows are ROW_COMMON's (operand 0 the input, 1 the output, both over the input's shape).
// Stockham autosort of any radix, one output per work-item per stage: with Ns the product of
// the radices before stage R and L = Ns * R,
//   out[o] = sum_r in[j + r n/R] * W^(((r * (o mod L)) mod L) * n/L),  j = (o / L) Ns + o mod Ns,
// W^e = tw[e] = exp(-2 pi i e / n) (float64 on the host, rounded once; sgn = -1 conjugates it),
// the exponent exact in integers. A stage of radix n is the direct DFT.
// MODE 0: c64 -> c64; 1: real -> c64 (the first m outputs); 2: c64 Hermitian half (m of them)
// -> real n outputs (the missing half conjugated; the real part kept, like numpy's irfft).
inline float2 fft_in(__global const T_X* x, int xo, int xs, int j, int m, int n) {
#if MODE == 1
  return (float2)((float)LOAD(T_X, x, xo + j * xs), 0.0f);
#elif MODE == 2
  if (j < m) return x[xo + j * xs];
  float2 v = x[xo + (n - j) * xs];
  return (float2)(v.x, -v.y);
#else
  return x[xo + j * xs];
#endif
}
inline void fft_out(__global T_Y* y, int yo, int ys, int k, int m, float2 v) {
#if MODE == 2
  STORE(T_Y, y, yo + k * ys, v.x);
#else
  if (k < m) y[yo + k * ys] = v;
#endif
}
#define FFT_STAGE(acc, SRC, o) { \
  int L_ = Ns * R, q_ = (o) % L_, j_ = (o) / L_ * Ns + (o) % Ns, st_ = n / R, f_ = n / L_, e_ = q_; \
  acc = SRC(j_); \
  for (int r_ = 1; r_ < R; ++r_) { \
    float2 w_ = tw[tw_off + e_ * f_]; \
    acc += cmul(SRC(j_ + r_ * st_), (float2)(w_.x, sgn * w_.y)); \
    e_ += q_; if (e_ >= L_) e_ -= L_; \
  } }
#define FFT_ROW(row) \
  __global const int* mt = meta + moff; \
  int xo = x_off + row_off(mt, row, 0), xs = INNER(mt, 0); \
  int yo = y_off + row_off(mt, row, 1), ys = INNER(mt, 1);

// one work-group per row: the stages ping-pong between two rows of n in local memory
__kernel void fft_local(__global const T_X* x, int x_off, __global T_Y* y, int y_off,
                        __global const float2* tw, int tw_off, __global const int* meta, int moff, int rows,
                        int n, int m, int rad, int nst, float sgn, float scale, __local float2* buf) {
  int lx = get_local_id(0), LX = get_local_size(0);
  FFT_ROW(get_group_id(1))
  __local float2* a = buf;
  __local float2* b = buf + n;
  for (int j = lx; j < n; j += LX) a[j] = fft_in(x, xo, xs, j, m, n);
  barrier(CLK_LOCAL_MEM_FENCE);
#define SRC_L(i) a[i]
  for (int s = 0, Ns = 1; s < nst; ++s) {
    int R = meta[rad + s];
    for (int o = lx; o < n; o += LX) { float2 acc; FFT_STAGE(acc, SRC_L, o) b[o] = acc; }
    barrier(CLK_LOCAL_MEM_FENCE);
    __local float2* t = a; a = b; b = t;
    Ns *= R;
  }
  for (int k = lx; k < n; k += LX) fft_out(y, yo, ys, k, m, a[k] * scale);
}

// one stage of every row (rows too long for local memory): flags 1 reads x (the first
// stage), 2 writes y (the last); between them rows of n in s at s_in / s_out
__kernel void fft_pass(__global const T_X* x, int x_off, __global T_Y* y, int y_off,
                       __global const float2* tw, int tw_off, __global const int* meta, int moff, int rows,
                       int n, int m, int Ns, int R, float sgn, float scale,
                       __global float2* s, int s_in, int s_out, int flags) {
  int g = get_global_id(0);
  if (g >= rows * n) return;
  int row = g / n, o = g % n;
  FFT_ROW(row)
  int si = s_in + row * n;
  float2 acc;
#define SRC_X(i) fft_in(x, xo, xs, (i), m, n)
#define SRC_S(i) s[si + (i)]
  if (flags & 1) FFT_STAGE(acc, SRC_X, o) else FFT_STAGE(acc, SRC_S, o)
  if (flags & 2) fft_out(y, yo, ys, o, m, acc * scale);
  else s[s_out + row * n + o] = acc;
}
