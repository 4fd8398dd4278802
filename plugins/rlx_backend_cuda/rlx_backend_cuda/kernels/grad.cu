// Backward rows: softmax's and the norms' gradients (contiguous rows, one block per row).
// @part softmax_grad(TY, TG, TO, ACC)
// The backward of a softmax row: dx = y * (g - sum(g * y)); y, g, dx contiguous [rows, n].
extern "C" __global__ void rlx_softmax_grad(const TY* __restrict__ y, const TG* __restrict__ g,
                                            TO* __restrict__ dx, int n) {
  const i64 row = blockIdx.x;
  const TY* yr = y + row * (i64)n;
  const TG* gr = g + row * (i64)n;
  TO* o = dx + row * (i64)n;
  ACC s = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += LD(ACC, yr[i]) * LD(ACC, gr[i]);
  s = block_sum(s);
  for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = ST(TO, LD(ACC, yr[i]) * (LD(ACC, gr[i]) - s));
}
// @part norm_grad(TX, TW, TG, TO, ACC, CENTER)
// The backward of an rms_norm (CENTER 0) or layer_norm (CENTER 1) row, n = (x - mean?) * inv
// scaled by w (+ offset): dx = inv * (dn - mean(dn)? - n * mean(dn * n)) with dn = g * (w +
// offset); pw[row] = g * n, which a column sum over the rows turns into the weight's gradient.
extern "C" __global__ void rlx_norm_grad(const TX* __restrict__ x, const TW* __restrict__ w,
    const TG* __restrict__ g, TO* __restrict__ dx, ACC* __restrict__ pw, int n, double eps_d, double off_d) {
  const i64 row = blockIdx.x;
  const TX* xr = x + row * (i64)n;
  const TG* gr = g + row * (i64)n;
  TO* o = dx + row * (i64)n;
  ACC* p = pw + row * (i64)n;
  const ACC off = (ACC)off_d;
  ACC mu = 0;
#if CENTER
  ACC s = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += LD(ACC, xr[i]);
  mu = block_sum(s) / (ACC)n;
#endif
  ACC q = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) { const ACC d = LD(ACC, xr[i]) - mu; q += d * d; }
  const ACC inv = (ACC)1 / sqrt(block_sum(q) / (ACC)n + (ACC)eps_d);
  ACC a = 0, c = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const ACC dn = LD(ACC, gr[i]) * (LD(ACC, w[i]) + off);
    a += dn;
    c += dn * (LD(ACC, xr[i]) - mu) * inv;
  }
  c = block_sum(c) / (ACC)n;
#if CENTER
  a = block_sum(a) / (ACC)n;
#else
  a = 0;
#endif
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const ACC gv = LD(ACC, gr[i]);
    const ACC nv = (LD(ACC, xr[i]) - mu) * inv;
    o[i] = ST(TO, inv * (gv * (LD(ACC, w[i]) + off) - a - nv * c));
    p[i] = gv * nv;
  }
}
