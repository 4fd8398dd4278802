// Row reductions: reduce over columns (reduce_cols), topk, cumsum. Input rows of length n with row
// stride `rs` (elements, last axis unit-stride), outputs contiguous. One block per row. softmax,
// reduce over a row and argmax are generated from core's description (rows.py, rlx_core.ir.rowkernels).
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
// @part topk(LOAD(v), ACC, TX)
// topk: k passes of a block-wide selection in the order (value desc, NaN last, index asc),
// each pass taking the best element strictly after the previous pick.
__device__ __forceinline__ bool rlx_better(ACC v1, long long i1, ACC v2, long long i2) {
  bool n1 = v1 != v1, n2 = v2 != v2;
  if (n1 != n2) return !n1;
  if (!n1 && v1 != v2) return v1 > v2;
  return i1 < i2;
}
extern "C" __global__ void rlx_topk(const TX* __restrict__ x, long long rs, TX* __restrict__ vals,
    long long* __restrict__ idx, int n, int k) {
  const i64 row = blockIdx.x;
  const TX* xr = x + row * rs;
  __shared__ ACC sv[1024];
  __shared__ long long si[1024];
  ACC pv = 0; long long pi = -1;
  for (int t = 0; t < k; ++t) {
    ACC bv = 0; long long bi = -1;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      ACC v = LOAD(xr[i]);
      if (pi >= 0 && !rlx_better(pv, pi, v, i)) continue;
      if (bi < 0 || rlx_better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    sv[threadIdx.x] = bv; si[threadIdx.x] = bi;
    __syncthreads();
    for (int st = blockDim.x / 2; st > 0; st >>= 1) {
      if (threadIdx.x < st) {
        ACC v = sv[threadIdx.x + st]; long long i = si[threadIdx.x + st];
        if (i >= 0 && (si[threadIdx.x] < 0 || rlx_better(v, i, sv[threadIdx.x], si[threadIdx.x]))) {
          sv[threadIdx.x] = v; si[threadIdx.x] = i;
        }
      }
      __syncthreads();
    }
    pv = sv[0]; pi = si[0];
    if (threadIdx.x == 0) { vals[row * k + t] = xr[pi]; idx[row * k + t] = pi; }
    __syncthreads();
  }
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
