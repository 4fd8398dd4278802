// Weights asked into L2 ahead of the GEMVs that will stream them (prefetch.py's plan).
// @part l2_prefetch(EVICT_LAST)
// Byte ranges p[r][0, n[r]) brought into L2 in CHUNK-byte bulk prefetches (sm_90's
// cp.async.bulk.prefetch), the ranges' chunks taken in turn so that every range's first bytes
// are asked for first. A hint on a side branch of the step's graph: nothing waits for it or
// reads a result of it (elsewhere it does nothing). Sizes are rounded down to 16 bytes.
// EVICT_LAST: the lines come in at evict_last priority, so that the stream of the GEMV running
// meanwhile does not push them out before their own GEMV reads them.
extern "C" __global__ void rlx_l2_prefetch(const char* p0, long long n0, const char* p1, long long n1,
    const char* p2, long long n2, const char* p3, long long n3, int chunk) {
#if !defined(RLX_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const char* p[4] = {p0, p1, p2, p3};
  const i64 n[4] = {n0, n1, n2, n3};
  const i64 most = (max(max(n0, n1), max(n2, n3)) + chunk - 1) / chunk;
#if EVICT_LAST
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
#endif
  for (i64 c = blockIdx.x * (i64)blockDim.x + threadIdx.x; c < 4 * most; c += (i64)gridDim.x * blockDim.x) {
    const int r = (int)(c & 3);
    const i64 o = (c >> 2) * chunk;
    if (o >= n[r]) continue;
    const unsigned size = (unsigned)min((i64)chunk, n[r] - o) & ~15u;
    if (!size) continue;
#if EVICT_LAST
    asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;"
                 ::"l"(p[r] + o), "r"(size), "l"(policy) : "memory");
#else
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p[r] + o), "r"(size) : "memory");
#endif
  }
#endif
}
