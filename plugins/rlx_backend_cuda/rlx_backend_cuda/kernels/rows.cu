// Row reductions: reduce over columns (reduce_cols) and cumsum. Input rows of length n with row
// stride `rs` (elements, last axis unit-stride), outputs contiguous. softmax, reduce over a row,
// argmax and topk are generated from core's description (rows.py, rlx_core.ir.rowkernels).
// @part reduce_cols(LOAD(v), COMB(a, b), TX, TO, ACC, IDENT, FINAL)
// y[o, i] = COMB over r of x[o, r, i], x contiguous as [O, n, I] with I > 1 or n small: one
// thread per output, threadIdx.x along i so a warp's loads are coalesced; with blockDim.y > 1
// (then blockDim.x == 32) the threads of a column split r and meet in shared memory.
extern "C" __global__ void rlx_reduce_cols(const TX* __restrict__ x, TO* __restrict__ y, long long O, int n,
                                           long long I) {
  __shared__ ACC sh[32 * 33];
  const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const bool live = j < O * I;
  ACC a = IDENT;
  if (live) {
    const long long o = j / I;
    const TX* xc = x + o * (long long)n * I + (j - o * I);
#pragma unroll 4
    for (int k = threadIdx.y; k < n; k += blockDim.y) { ACC v = LOAD(xc[(long long)k * I]); a = COMB(a, v); }
  }
  if (blockDim.y > 1) {
    sh[threadIdx.y * 33 + threadIdx.x] = a;
    __syncthreads();
    for (int st = blockDim.y / 2; st > 0; st >>= 1) {
      if (threadIdx.y < st)
        sh[threadIdx.y * 33 + threadIdx.x] = COMB(sh[threadIdx.y * 33 + threadIdx.x],
                                                      sh[(threadIdx.y + st) * 33 + threadIdx.x]);
      __syncthreads();
    }
    a = sh[threadIdx.x];
  }
  if (threadIdx.y == 0 && live) { ACC r = a; y[j] = FINAL; }
}
// @part cumsum(LOAD(v), STORE(v), TX, TO, ACC)
extern "C" __global__ void rlx_cumsum(const TX* __restrict__ x, long long rs, TO* __restrict__ y, int n) {
  const i64 row = blockIdx.x;
  const TX* xr = x + row * rs;
  TO* yr = y + row * (i64)n;
  __shared__ ACC part[1024];
  const int per = (n + blockDim.x - 1) / blockDim.x;
  const int b0 = threadIdx.x * per;
  const int b1 = min(n, b0 + per);
  ACC s = 0;
  for (int i = b0; i < b1; ++i) s += LOAD(xr[i]);
  part[threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    ACC run = 0;
    for (int t = 0; t < (int)blockDim.x; ++t) { ACC v = part[t]; part[t] = run; run += v; }
  }
  __syncthreads();
  ACC run = part[threadIdx.x];
  for (int i = b0; i < b1; ++i) { run += LOAD(xr[i]); yr[i] = STORE(run); }
}
