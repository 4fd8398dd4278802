// Indexing: gather along an axis, the KV-cache write at per-batch positions, many copies at once.
// @part gather(TT, TI)
typedef TT rlx_tt;     // a one-word name: `unsigned char()` is no valid expression
extern "C" __global__ void rlx_gather(const TT* __restrict__ table, const TI* __restrict__ ind,
    TT* __restrict__ out, long long outer, long long nax, long long ni, long long inner,
    int* err, int node) {
  const i64 total = outer * ni * inner;
  for (i64 o = blockIdx.x * (i64)blockDim.x + threadIdx.x; o < total; o += (i64)gridDim.x * blockDim.x) {
    i64 in_i = o % inner; i64 t = o / inner; i64 ii = t % ni; i64 ou = t / ni;
    i64 ix = (i64)ind[ii];
    if (ix < -nax || ix >= nax) { rlx_error(err, 1, node, ix, nax); out[o] = rlx_tt(); continue; }
    if (ix < 0) ix += nax;
    out[o] = table[(ou * nax + ix) * inner + in_i];
  }
}
// @part gather_norm(TT, TI, TW)
// Table rows whose RMSNorm the GEMVs after it compute (ops._gather_norm: a decode step's token
// embeddings and the first layer's norm): block r copies row ind[r] of table [nax, n] (16-bit, n
// a multiple of 8, 16-byte rows) to out, writes xw = out * (w + off) (the NORM GEMV's x) and adds
// the row's squares into ssq[r * 32 + warp] (the sums that GEMV divides by at the end).
extern "C" __global__ void rlx_gather_norm(const TT* __restrict__ table, const TI* __restrict__ ind,
    TT* __restrict__ out, TT* __restrict__ xw, const TW* __restrict__ w, float off, float* __restrict__ ssq,
    long long nax, int n, int* err, int node) {
  typedef rlx_vec<TT, 8> V8;
  const int r = blockIdx.x;
  i64 ix = (i64)ind[r];
  const bool ok = ix >= -nax && ix < nax;
  if (!ok && threadIdx.x == 0) rlx_error(err, 1, node, ix, nax);
  ix = ok ? (ix < 0 ? ix + nax : ix) : 0;
  float ss = 0.f;
#pragma unroll 4
  for (int c = threadIdx.x * 8; c < n; c += blockDim.x * 8) {
    V8 v = *(const V8*)(table + ix * n + c), vw;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float x = ok ? LD(float, v.v[e]) : 0.f;
      v.v[e] = ST(TT, x);
      vw.v[e] = ST(TT, x * (LD(float, w[c + e]) + off));
      ss += x * x;
    }
    *(V8*)(out + (i64)r * n + c) = v;
    *(V8*)(xw + (i64)r * n + c) = vw;
  }
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) atomicAdd(ssq + r * 32 + (threadIdx.x >> 5), ss);
}
// @part kv_write(T, TP, DIMS_ARGS, NSTR_ARGS, CSTR_ARGS, DECOMP, AXIS)
// kv_write: cache (contiguous) gets `new` (strided, rank R) at pos[b] along `axis`
extern "C" __global__ void rlx_kv_write(T* cache, const T* __restrict__ nw, const TP* __restrict__ pos,
    long long total, DIMS_ARGS, NSTR_ARGS, CSTR_ARGS, long long nax, long long snew,
    int* err, int node) {
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
    i64 r = i, src = 0, dst = 0, b = 0;
DECOMP
    i64 p = (i64)pos[b];
    if (p < 0 || p + snew > nax) { rlx_error(err, 2, node, p, nax); continue; }
    cache[dst + p * RLX_CAT(cs, AXIS)] = nw[src];
  }
}
// @part copy_many(T, RANK)
// Copies of one geometry, many in one launch (a prefix cache's blocks into or out of every KV
// state): table holds the shape [RANK], the source's and the destination's strides [RANK
// each] in units of T, then a (source, destination) address pair a copy; copy p is done by
// the blocks of y p, p + gridDim.y, ...
extern "C" __global__ void rlx_copy_many(const long long* __restrict__ table, long long n, long long copies) {
  const long long *shape = table, *ss = table + RANK, *ds = table + 2 * RANK;
  for (i64 p = blockIdx.y; p < copies; p += gridDim.y) {
    const T* src = (const T*)table[3 * RANK + 2 * p];
    T* dst = (T*)table[3 * RANK + 2 * p + 1];
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
      i64 r = i, so = 0, dof = 0;
#pragma unroll
      for (int d = RANK - 1; d >= 0; --d) {
        const i64 c = r % shape[d];
        r /= shape[d];
        so += c * ss[d];
        dof += c * ds[d];
      }
      dst[dof] = src[so];
    }
  }
}
