// Row reductions: softmax, reduce (sum / mean / prod / max / min over a row or over columns),
// argmax, topk, cumsum. Input rows of length n with row stride `rs` (elements, last axis
// unit-stride), outputs contiguous. One block per row.
// @part softmax(TX, TO, ACC)
extern "C" __global__ void rlx_softmax(const TX* __restrict__ x, long long rs, TO* __restrict__ y, int n) {
  const i64 row = blockIdx.x;
  const TX* xr = x + row * rs;
  TO* yr = y + row * (i64)n;
  ACC m = -(ACC)RLX_INF;
  for (int i = threadIdx.x; i < n; i += blockDim.x) { ACC v = LD(ACC, xr[i]); m = rlx_max(m, v); }
  m = block_max(m, -(ACC)RLX_INF);
  if (!(m > -(ACC)RLX_INF && m < (ACC)RLX_INF)) m = 0;
  ACC s = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += exp(LD(ACC, xr[i]) - m);
  s = block_sum(s);
  if (s == 0) s = 1;
  for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = ST(TO, exp(LD(ACC, xr[i]) - m) / s);
}
// @part reduce(LOAD(v), COMB(a, b), TX, TO, ACC, IDENT, FINAL)
// A row per blockIdx.x. Few long rows (decode's sums over a 128k-entry vocabulary row: one
// block took 28 us) are cut into gridDim.y chunks: a block per chunk writes its partial, and
// the last block of the row to finish (`counters` start at 0 and it resets its own) combines
// the partials in chunk order, lanes first, then a fixed shuffle tree: the same result on
// every run. With one chunk (chunk = n) part and counters are not used.
extern "C" __global__ void rlx_reduce(const TX* __restrict__ x, long long rs, TO* __restrict__ y, int n,
                                      int chunk, ACC* __restrict__ part, int* __restrict__ counters) {
  const i64 row = blockIdx.x;
  const int ns = gridDim.y, beg = blockIdx.y * chunk, end = min(n, beg + chunk);
  const TX* xr = x + row * rs;
  __shared__ ACC sh[1024];
  __shared__ int last;
  ACC a = IDENT;
#pragma unroll 4
  for (int i = beg + threadIdx.x; i < end; i += blockDim.x) { ACC v = LOAD(xr[i]); a = COMB(a, v); }
  sh[threadIdx.x] = a;
  __syncthreads();
  for (int st = blockDim.x / 2; st > 0; st >>= 1) {
    if (threadIdx.x < st) sh[threadIdx.x] = COMB(sh[threadIdx.x], sh[threadIdx.x + st]);
    __syncthreads();
  }
  if (ns == 1) {
    if (threadIdx.x == 0) { ACC r = sh[0]; y[row] = FINAL; }
    return;
  }
  if (threadIdx.x == 0) {
    part[row * ns + blockIdx.y] = sh[0];
    last = rlx_last_arrival(counters + row, ns);
  }
  __syncthreads();
  if (!last || threadIdx.x >= 32) return;
  __threadfence();
  a = IDENT;
  for (int k = threadIdx.x; k < ns; k += 32) a = COMB(a, LDCG(part + row * ns + k));
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) { ACC o = SHFL_XOR(a, m); a = threadIdx.x & m ? COMB(o, a) : COMB(a, o); }
  if (threadIdx.x == 0) { ACC r = a; y[row] = FINAL; }
}
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
// @part argmax(LOAD(v), ACC, TX)
// argmax (NaN is the largest, first index wins ties). Rows of gridDim.y > 1 chunks: a block
// per chunk, the last to finish takes the best of the chunks' picks (as in REDUCE).
// whether candidate (v, i) beats the current pick (b, j); i < 0 / j < 0: none
__device__ __forceinline__ bool rlx_beats(ACC v, int i, ACC b, int j) {
  if (i < 0) return false;
  if (j < 0) return true;
  const bool vn = v != v, bn = b != b;
  if (vn != bn) return vn;
  if (!vn && v != b) return v > b;
  return i < j;
}
extern "C" __global__ void rlx_argmax(const TX* __restrict__ x, long long rs, long long* __restrict__ y, int n,
                                      int chunk, ACC* __restrict__ pv, int* __restrict__ pi, int* __restrict__ counters) {
  const i64 row = blockIdx.x;
  const int ns = gridDim.y, beg = blockIdx.y * chunk, end = min(n, beg + chunk);
  const TX* xr = x + row * rs;
  __shared__ ACC sv[1024];
  __shared__ int si[1024];
  __shared__ int last;
  ACC bv = 0; int bi = -1;
#pragma unroll 4
  for (int i = beg + threadIdx.x; i < end; i += blockDim.x) {
    ACC v = LOAD(xr[i]);
    if (rlx_beats(v, i, bv, bi)) { bv = v; bi = i; }
  }
  sv[threadIdx.x] = bv; si[threadIdx.x] = bi;
  __syncthreads();
  for (int st = blockDim.x / 2; st > 0; st >>= 1) {
    if (threadIdx.x < st && rlx_beats(sv[threadIdx.x + st], si[threadIdx.x + st], sv[threadIdx.x], si[threadIdx.x])) {
      sv[threadIdx.x] = sv[threadIdx.x + st]; si[threadIdx.x] = si[threadIdx.x + st];
    }
    __syncthreads();
  }
  if (ns == 1) {
    if (threadIdx.x == 0) y[row] = si[0] < 0 ? 0 : si[0];
    return;
  }
  if (threadIdx.x == 0) {
    pv[row * ns + blockIdx.y] = sv[0]; pi[row * ns + blockIdx.y] = si[0];
    last = rlx_last_arrival(counters + row, ns);
  }
  __syncthreads();
  if (!last || threadIdx.x >= 32) return;
  __threadfence();
  bv = 0; bi = -1;
  for (int k = threadIdx.x; k < ns; k += 32) {
    const ACC v = LDCG(pv + row * ns + k); const int i = LDCG(pi + row * ns + k);
    if (rlx_beats(v, i, bv, bi)) { bv = v; bi = i; }
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    const ACC v = SHFL_XOR(bv, m); const int i = SHFL_XOR(bi, m);
    if (rlx_beats(v, i, bv, bi)) { bv = v; bi = i; }
  }
  if (threadIdx.x == 0) y[row] = bi < 0 ? 0 : bi;
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
