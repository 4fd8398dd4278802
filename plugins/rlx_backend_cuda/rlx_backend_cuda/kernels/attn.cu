// Attention on CUDA cores: the mask shared by every attention kernel, mask_fill, split-K
// decode attention (any float type) and the short-cache decode kernel.
// @part mask(MASKKIND, MASKMODE)
// Masking shared by the attention kernels and mask_fill. MASKKIND: 0 none, 1 causal,
// 2 sliding window. MASKMODE: 0 none, 1 bool keep-mask, 2 additive bias.
#define RLX_KEEP(qpos, j, keep) do { \
  if (MASKKIND >= 1) keep = keep && ((j) <= (qpos)); \
  if (MASKKIND == 2) keep = keep && ((j) > (qpos) - window); } while (0)
// the keys [*kbeg, *kend) of Sk that the mask kind may keep for queries at qmin..qmax (the
// decode kernels' key range)
__device__ __forceinline__ void rlx_key_range(i64 qmin, i64 qmax, int Sk, int window, i64* kbeg, i64* kend) {
  *kbeg = 0;
  *kend = Sk;
  if (MASKKIND >= 1) *kend = max((i64)0, min((i64)Sk, qmax + 1));
  if (MASKKIND == 2) *kbeg = min(*kend, max((i64)0, qmin - window + 1));
}
// a mask entry as the decode kernels hold it: the keep flag at p where ok (MASKMODE 1), or
// the bias at p as an A where ok, else 0 (MASKMODE 2)
#if MASKMODE == 1
#define RLX_MASK_T(A) bool
#define RLX_MASK_AT(p, ok, A) ((ok) && *(p) != 0)
#elif MASKMODE == 2
#define RLX_MASK_T(A) A
#define RLX_MASK_AT(p, ok, A) ((ok) ? LD(A, *(p)) : (A)0)
#endif
// @part mask_fill(TS, TM, TP, TO, ACC, HAS_POS, MASKMODE)
extern "C" __global__ void rlx_mask_fill(const TS* __restrict__ sc, long long s0, long long s1,
    long long s2, long long s3, const TM* __restrict__ mask, long long m0, long long m1, long long m2,
    long long m3, const TP* __restrict__ pos, TO* __restrict__ out, int B, int H, int Sq, int Sk,
    int window) {
  const i64 total = (i64)B * H * Sq * Sk;
  for (i64 o = blockIdx.x * (i64)blockDim.x + threadIdx.x; o < total; o += (i64)gridDim.x * blockDim.x) {
    int j = (int)(o % Sk); i64 t = o / Sk; int i = (int)(t % Sq); t /= Sq; int h = (int)(t % H); int b = (int)(t / H);
    ACC v = LD(ACC, sc[b * s0 + h * s1 + i * s2 + j * s3]);
    bool keep = true;
#if HAS_POS
    const i64 qpos = (i64)pos[b] + i;
#else
    const i64 qpos = (i64)(Sk - Sq) + i;
#endif
    RLX_KEEP(qpos, (i64)j, keep);
#if MASKMODE == 1
    keep = keep && (mask[b * m0 + h * m1 + i * m2 + j * m3] != 0);
#elif MASKMODE == 2
    v = v + LD(ACC, mask[b * m0 + h * m1 + i * m2 + j * m3]);
#endif
    out[o] = ST(TO, keep ? v : -(ACC)RLX_INF);
  }
}
// @part vec(HAS_POS)
template <typename T, int N> struct alignas(sizeof(T) * N) RlxVec { T v[N]; };
template <int N, typename T> __device__ __forceinline__ RlxVec<T, N> rlx_vload(const T* p, bool ok) {
  RlxVec<T, N> r;
  if (ok) {
    r = *reinterpret_cast<const RlxVec<T, N>*>(p);
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) r.v[e] = ST(T, 0.0f);
  }
  return r;
}
// a decode kernel's query position (row b's pos, else `last`): read past L1 before the wait for
// the kernel before (to aim L2 prefetches; that kernel may still write it), and after it
#if HAS_POS
#define RLX_POS_EARLY(pos, b, last) ((i64)LDCG((pos) + (b)))
#define RLX_POS(pos, b, early) ((i64)(pos)[b])
#else
#define RLX_POS_EARLY(pos, b, last) ((i64)(last))
#define RLX_POS(pos, b, early) (early)
#endif
// the weight exp(m - M) of partial sums with max m in a merge whose max is M (0: they saw no key)
template <typename A>
__device__ __forceinline__ A rlx_part_weight(A m, A M) {
  return (M != -(A)RLX_INF && m != -(A)RLX_INF) ? exp(m - M) : (A)0;
}
// rows [r0, r1) of `bytes` bytes each (stride rs elements) asked into L2, a 128-byte line a thread
template <typename T>
__device__ __forceinline__ void rlx_prefetch_rows(const T* base, i64 rs, i64 r0, i64 r1, int bytes, int tid, int nt) {
#if !defined(RLX_HIP) && defined(__CUDA_ARCH__)        // (a host build of the kernel: tests/cuda_emu.py)
  const int lines = (bytes + 127) / 128;
  for (i64 t = tid; t < (r1 - r0) * lines; t += nt) {
    const char* line = (const char*)(base + (r0 + t / lines) * rs) + (t % lines) * 128;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
  }
#endif
}
// @part split(NT, TQ, TK, TV, TM, TP, ACC, TO, ROWS, DK, DV, TILE, VK, TPK, NVK, VV, TPV, NVV, MASKMODE)
// Split-K attention on CUDA cores (any float type; decode and the f32/f64 path).
// grid (B*KVH, ceil(Sq*G/ROWS), nsplit), NT threads. A block's rows are (query i, head g of
// this kv head) pairs, so K/V are read once for all G heads (GQA-native). The block's keys
// (the range the mask can keep, cut into nsplit chunks at run time, so splits follow the
// position) go in tiles of TILE: groups of TPK lanes each load a key row with VK-element
// vector loads (16 bytes where the base and strides allow), NVK per lane, UK keys per lane,
// K and V of the whole tile issued before any math; the group's dot products are summed by
// lane shuffles; the tile's scores go to shared memory, where one warp per row takes their
// max and exponentials (online softmax across tiles); then groups of TPV lanes accumulate
// P.V for their keys in registers. At the end the key groups' sums meet in shared memory:
// with one split they are the output; else each split writes unnormalized partials (acc,
// max, sum) and the last block of each (b, kv head, row block) to finish merges them in the
// same launch (one launch, not a second combine kernel; `counters` start at 0 and that block
// resets its own).
#define NW (NT / 32)
extern "C" __global__ void __launch_bounds__(NT) rlx_attn_split(
    const TQ* __restrict__ q, long long qsb, long long qsh, long long qss,
    const TK* __restrict__ k, long long ksb, long long ksh, long long kss,
    const TV* __restrict__ v, long long vsb, long long vsh, long long vss,
    const TM* __restrict__ mask, long long m0, long long m1, long long m2, long long m3,
    const TP* __restrict__ pos, ACC* __restrict__ part_o, ACC* __restrict__ part_ml,
    int B, int H, int KVH, int Sq, int Sk, int minchunk, double scale_d, double cap_d, int window,
    int* __restrict__ counters, TO* __restrict__ out, long long osb, long long osh, long long oss) {
  constexpr int LDT = TILE + 1;
  constexpr int KPB = NT / TPK, UK = TILE / KPB;
  constexpr int KPBV = NT / TPV, UV = TILE / KPBV;
  constexpr int WR = (ROWS + TPK - 1) / TPK;      // score rows each lane of a key group writes
  constexpr int SH = 2 * ROWS * LDT > NW * ROWS * DV ? 2 * ROWS * LDT : NW * ROWS * DV;
  // two tiles of scores / probabilities [2][ROWS][LDT], later the warps' sums [NW][ROWS][DV]
  __shared__ ACC sh[SH];
  __shared__ ACC s_m[ROWS], s_l[ROWS], s_a[ROWS];
  const int G = H / KVH;
  const int b = blockIdx.x / KVH, kvh = blockIdx.x % KVH;
  const int r0 = blockIdx.y * ROWS;
  const int split = blockIdx.z, nsplit = gridDim.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gk = tid / TPK, lk = tid % TPK, gv = tid / TPV, lv = tid % TPV;
  const ACC scale = (ACC)scale_d, cap = (ACC)cap_d;
  const TK* kb = k + b * ksb + kvh * ksh;
  const TV* vb = v + b * vsb + kvh * vsh;
  // this split's share [cs, ce) of the keys the mask may keep for some row of the block, query
  // 0 at position p0
  const int rows_here = min(ROWS, Sq * G - r0);
  auto split_keys = [&](i64 p0, i64* cs, i64* ce) {
    i64 kbeg, kend;
    rlx_key_range(p0 + r0 / G, p0 + (r0 + rows_here - 1) / G, Sk, window, &kbeg, &kend);
    i64 chunk = (kend - kbeg + nsplit - 1) / nsplit;
    chunk = max((i64)minchunk, (chunk + KPB - 1) / KPB * KPB);
    *cs = min(kend, kbeg + split * chunk);
    *ce = min(kend, *cs + chunk);
  };
  // the split's first two tiles of K and V asked into L2 before the wait for the kernel that
  // writes q (device.Kernel): the cache rows come from DRAM, the loop's loads then from L2.
  // The position read here (past L1) may be one the kernel before still writes: then only
  // the prefetch is of less use.
  const i64 early = RLX_POS_EARLY(pos, b, Sk - Sq);
  {
    i64 cs, ce;
    split_keys(early, &cs, &ce);
    rlx_prefetch_rows(kb, kss, cs, min(ce, cs + 2 * TILE), DK * (int)sizeof(TK), tid, NT);
    rlx_prefetch_rows(vb, vss, cs, min(ce, cs + 2 * TILE), DV * (int)sizeof(TV), tid, NT);
  }
  RLX_GRID_WAIT();
  const i64 p0 = RLX_POS(pos, b, early);
  ACC qr[ROWS][NVK * VK];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int rr = r0 + r, ok = rr < Sq * G;
    const i64 qo = b * qsb + (kvh * G + (ok ? rr % G : 0)) * qsh + (ok ? rr / G : 0) * qss;
#pragma unroll
    for (int n = 0; n < NVK; ++n)
#pragma unroll
      for (int e = 0; e < VK; ++e) {
        const int d = (lk + TPK * n) * VK + e;
        qr[r][n * VK + e] = (ok && d < DK) ? LD(ACC, q[qo + d]) : (ACC)0;
      }
  }
  // the rows this lane finishes scores for (r = lk + TPK * w): position, mask row, validity
  i64 mq[WR], mo[WR]; bool mine[WR];
#pragma unroll
  for (int w = 0; w < WR; ++w) {
    const int r = lk + TPK * w, rr = r0 + r;
    mine[w] = r < ROWS && rr < Sq * G;
    const int i = mine[w] ? rr / G : 0, h = kvh * G + (mine[w] ? rr % G : 0);
    mq[w] = p0 + i;
    mo[w] = b * m0 + h * m1 + i * m2;
  }
  i64 cs, ce;
  split_keys(p0, &cs, &ce);
  if (tid < ROWS) { s_m[tid] = -(ACC)RLX_INF; s_l[tid] = 0; }
  ACC acc[ROWS][NVV * VV];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int x = 0; x < NVV * VV; ++x) acc[r][x] = 0;
  int buf = 0;
  for (i64 t0 = cs; t0 < ce; t0 += TILE, buf ^= 1) {
    ACC* sp = sh + buf * ROWS * LDT;
    // every load of the tile first: K, V and the mask entries this lane needs
    RlxVec<TK, VK> kr[UK][NVK];
    RlxVec<TV, VV> vr[UV][NVV];
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      const i64 j = t0 + gk + u * KPB;
#pragma unroll
      for (int n = 0; n < NVK; ++n) {
        const int c = (lk + TPK * n) * VK;
        kr[u][n] = rlx_vload<VK>(kb + j * kss + c, j < ce && c < DK);
      }
    }
#pragma unroll
    for (int u = 0; u < UV; ++u) {
      const i64 j = t0 + gv + u * KPBV;
#pragma unroll
      for (int n = 0; n < NVV; ++n) {
        const int c = (lv + TPV * n) * VV;
        vr[u][n] = rlx_vload<VV>(vb + j * vss + c, j < ce && c < DV);
      }
    }
#if MASKMODE
    RLX_MASK_T(ACC) mk[UK][WR];
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      const i64 j = t0 + gk + u * KPB;
#pragma unroll
      for (int w = 0; w < WR; ++w) mk[u][w] = RLX_MASK_AT(mask + mo[w] + j * m3, mine[w] && j < ce, ACC);
    }
#endif
    // scores: each lane's part of the dot products, summed over its group of TPK lanes
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      const i64 j = t0 + gk + u * KPB;
      ACC s[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        ACC t = 0;
#pragma unroll
        for (int n = 0; n < NVK; ++n)
#pragma unroll
          for (int e = 0; e < VK; ++e) t += qr[r][n * VK + e] * LD(ACC, kr[u][n].v[e]);
        s[r] = t;
      }
#pragma unroll
      for (int m = TPK / 2; m > 0; m >>= 1)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) s[r] += SHFL_XOR(s[r], m);
#pragma unroll
      for (int w = 0; w < WR; ++w) {
        const int r = lk + TPK * w;
        if (r >= ROWS) continue;
        ACC x = 0;
#pragma unroll
        for (int t = 0; t < ROWS; ++t) x = t == r ? s[t] : x;
        x = x * scale;
        if (cap_d != 0.0) x = tanh(x / cap) * cap;
        bool keep = mine[w] && j < ce;
        RLX_KEEP(mq[w], j, keep);
#if MASKMODE == 1
        keep = keep && mk[u][w];
#elif MASKMODE == 2
        x = x + mk[u][w];
#endif
        sp[r * LDT + gk + u * KPB] = keep ? x : -(ACC)RLX_INF;
      }
    }
    __syncthreads();
    // online softmax over the tile: one warp per row
    for (int r = warp; r < ROWS; r += NW) {
      ACC* pr = sp + r * LDT;
      ACC mx = -(ACC)RLX_INF;
      for (int c = lane; c < TILE; c += 32) mx = rlx_max(mx, pr[c]);   // a NaN score stays
      mx = warp_max(mx);
      const ACC mold = s_m[r], mn = rlx_max(mx, mold);
      const bool live = mn != -(ACC)RLX_INF;    // (NaN is live: its row comes out NaN)
      ACC sum = 0;
      for (int c = lane; c < TILE; c += 32) {
        const ACC p = live ? exp(pr[c] - mn) : (ACC)0;
        pr[c] = p;
        sum += p;
      }
      sum = warp_sum(sum);
      __syncwarp();
      if (lane == 0) {
        const ACC a = live ? exp(mold - mn) : (ACC)1;
        s_a[r] = a; s_l[r] = s_l[r] * a + sum; s_m[r] = mn;
      }
    }
    __syncthreads();
    // P.V for this lane's keys and head dims (the next tile's scores go to the other buffer)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const ACC a = s_a[r];
#pragma unroll
      for (int x = 0; x < NVV * VV; ++x) acc[r][x] *= a;
    }
#pragma unroll
    for (int u = 0; u < UV; ++u) {
      const int c = gv + u * KPBV;
      ACC p[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) p[r] = sp[r * LDT + c];
#pragma unroll
      for (int n = 0; n < NVV; ++n)
#pragma unroll
        for (int e = 0; e < VV; ++e) {
          const ACC x = LD(ACC, vr[u][n].v[e]);
#pragma unroll
          for (int r = 0; r < ROWS; ++r) acc[r][n * VV + e] += p[r] == (ACC)0 ? (ACC)0 : p[r] * x;
        }
    }
  }
  // sum the key groups: within each warp by shuffles, then the warps through shared memory
#pragma unroll
  for (int m = TPV; m < 32; m <<= 1)
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int x = 0; x < NVV * VV; ++x) acc[r][x] += SHFL_XOR(acc[r][x], m);
  __syncthreads();
  if (lane < TPV) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int n = 0; n < NVV; ++n)
#pragma unroll
        for (int e = 0; e < VV; ++e) {
          const int d = (lv + TPV * n) * VV + e;
          if (d < DV) sh[(warp * ROWS + r) * DV + d] = acc[r][n * VV + e];
        }
  }
  __syncthreads();
  for (int t = tid; t < ROWS * DV; t += NT) {
    const int r = t / DV, d = t % DV;
    const int rr = r0 + r;
    if (rr >= Sq * G) continue;
    ACC O = 0;
#pragma unroll
    for (int w = 0; w < NW; ++w) O += sh[(w * ROWS + r) * DV + d];
    const int i = rr / G, h = kvh * G + rr % G;
    const ACC L = s_l[r];
    if (nsplit == 1) {
      out[b * osb + h * osh + i * oss + d] = ST(TO, L == 0 ? (ACC)0 : O / L);
      continue;
    }
    const i64 orow = (((i64)split * B + b) * H + h) * Sq + i;
    part_o[orow * DV + d] = O;
    if (d == 0) { part_ml[orow * 2] = s_m[r]; part_ml[orow * 2 + 1] = L; }
  }
  if (nsplit == 1) return;
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = rlx_last_arrival(counters + blockIdx.x * gridDim.y + blockIdx.y, nsplit);
  __syncthreads();
  if (!last) return;
  __threadfence();
  // merge the splits (at most 64): one warp per row; lanes take the splits' (max, sum) and
  // weights in one round, then each lane sums its head dims over the splits with the loads
  // independent of each other (a few L2 round trips, not one per split)
  __shared__ ACC wsplit[NW][64];
  constexpr int EV = (DV + 31) / 32;
  const i64 rows = (i64)B * H * Sq;
  for (int r = warp; r < ROWS; r += NW) {
    const int rr = r0 + r;
    if (rr >= Sq * G) continue;
    const int h = kvh * G + rr % G, i = rr / G;
    const i64 row = ((i64)b * H + h) * Sq + i;
    const ACC* ml = part_ml + row * 2;
    ACC mv[2], lv2[2], M = -(ACC)RLX_INF;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int sp = lane + 32 * t;
      mv[t] = sp < nsplit ? LDCG(ml + sp * rows * 2) : -(ACC)RLX_INF;
      lv2[t] = sp < nsplit ? LDCG(ml + sp * rows * 2 + 1) : (ACC)0;
      M = rlx_max(M, mv[t]);
    }
    M = warp_max(M);
    ACC L = 0;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const ACC f = rlx_part_weight(mv[t], M);
      wsplit[warp][lane + 32 * t] = f;
      L += lv2[t] * f;
    }
    L = warp_sum(L);
    __syncwarp();
    ACC O[EV];
#pragma unroll
    for (int e = 0; e < EV; ++e) O[e] = 0;
#pragma unroll 16
    for (int sp = 0; sp < nsplit; ++sp) {
      const ACC f = wsplit[warp][sp];
#pragma unroll
      for (int e = 0; e < EV; ++e) {
        const int d = lane + 32 * e;
        if (d < DV && f != (ACC)0) O[e] += LDCG(part_o + (sp * rows + row) * DV + d) * f;
      }
    }
#pragma unroll
    for (int e = 0; e < EV; ++e) {
      const int d = lane + 32 * e;
      if (d < DV) out[b * osb + h * osh + i * oss + d] = ST(TO, L == 0 ? (ACC)0 : O[e] / L);
    }
    __syncwarp();
  }
}
// @part short(NT, TQ, TK, TV, TM, TP, TO, G, D, SK, VK, HAS_POS, MASKMODE)
// Decode attention over a short KV cache (one query row per head): one block per (batch, kv
// head), no split over blocks and so no merge. Its G heads' q rows go to shared memory; each
// thread scores whole keys (all its K rows loaded first, VK-element loads along the row: a
// warp reads 32 consecutive rows); one warp per head turns its row of scores into
// probabilities; then each warp sums P.V over every NW-th key, a lane per D/32 head dims (its
// first value rows were loaded with the keys, later ones 8 at a time), and the warps' sums
// meet in shared memory.
// The split kernel's 96 small blocks and cross-block merge made a Llama-3.2-1B decode layer's
// attention latency-bound (11.6 us on an H100 for 1.2 MB of K/V at batch 1).
#define NW (NT / 32)
extern "C" __global__ void __launch_bounds__(NT) rlx_attn_short(
    const TQ* __restrict__ q, long long qsb, long long qsh,
    const TK* __restrict__ k, long long ksb, long long ksh, long long kss,
    const TV* __restrict__ v, long long vsb, long long vsh, long long vss,
    const TM* __restrict__ mask, long long m0, long long m1, long long m3,
    const TP* __restrict__ pos, int H, int KVH, int Sk, double scale_d, double cap_d, int window,
    TO* __restrict__ out, long long osb, long long osh) {
  typedef float ACC;
  constexpr int VD = D / 32;
  constexpr int SH = G * SK > NW * G * D ? G * SK : NW * G * D;
  __shared__ ACC sq[G * D];
  __shared__ ACC sh[SH];          // scores, then probabilities, then the warps' P.V sums
  __shared__ ACC s_l[G];
  const int b = blockIdx.x / KVH, kvh = blockIdx.x % KVH;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const ACC scale = (ACC)scale_d, cap = (ACC)cap_d;
  for (int t = tid; t < G * D; t += NT)
    sq[t] = LD(ACC, q[b * qsb + (kvh * G + t / D) * qsh + t % D]);
#if HAS_POS
  const i64 p0 = (i64)pos[b];
#else
  const i64 p0 = (i64)(Sk - 1);
#endif
  i64 kbeg, kend;
  rlx_key_range(p0, p0, Sk, window, &kbeg, &kend);
  __syncthreads();
  // every thread's key rows (SK <= U1 * NT keys) and its warp's first UP value rows are
  // loaded before any score is computed: one round trip to memory for most of the work
  constexpr int U1 = (SK + NT - 1) / NT, NV = D / VK, UV = 8;
  constexpr int UP = (SK + NW - 1) / NW < 2 * UV ? (SK + NW - 1) / NW : 2 * UV;
  const TK* kb = k + b * ksb + kvh * ksh;
  const TV* vb = v + b * vsb + kvh * vsh + lane * VD;
  RlxVec<TK, VK> kr[U1][NV];
#pragma unroll
  for (int u = 0; u < U1; ++u) {
    const i64 j = kbeg + tid + u * NT;
#pragma unroll
    for (int n = 0; n < NV; ++n) kr[u][n] = rlx_vload<VK>(kb + j * kss + n * VK, j < kend);
  }
  RlxVec<TV, VD> vp[UP];
#pragma unroll
  for (int u = 0; u < UP; ++u) vp[u] = rlx_vload<VD>(vb + (kbeg + warp + u * NW) * vss, kbeg + warp + u * NW < kend);
#pragma unroll
  for (int u = 0; u < U1; ++u) {
    const i64 j = kbeg + tid + u * NT;
    if (j >= kend) continue;
    ACC s[G];
#pragma unroll
    for (int g = 0; g < G; ++g) s[g] = 0;
#pragma unroll
    for (int n = 0; n < NV; ++n)
#pragma unroll
      for (int e = 0; e < VK; ++e) {
        const ACC x = LD(ACC, kr[u][n].v[e]);
#pragma unroll
        for (int g = 0; g < G; ++g) s[g] += sq[g * D + n * VK + e] * x;
      }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      ACC x = s[g] * scale;
      if (cap_d != 0.0) x = tanh(x / cap) * cap;
      bool keep = true;
#if MASKMODE == 1
      keep = mask[b * m0 + (kvh * G + g) * m1 + j * m3] != 0;
#elif MASKMODE == 2
      x = x + LD(ACC, mask[b * m0 + (kvh * G + g) * m1 + j * m3]);
#endif
      sh[g * SK + j] = keep ? x : -(ACC)RLX_INF;
    }
  }
  __syncthreads();
  for (int g = warp; g < G; g += NW) {
    ACC* row = sh + g * SK;
    ACC mx = -(ACC)RLX_INF;
    for (i64 j = kbeg + lane; j < kend; j += 32) mx = row[j] > mx ? row[j] : mx;
    mx = warp_max(mx);
    const bool live = mx > -(ACC)RLX_INF;
    ACC sum = 0;
    for (i64 j = kbeg + lane; j < kend; j += 32) {
      const ACC p = live ? exp(row[j] - mx) : (ACC)0;
      row[j] = p;
      sum += p;
    }
    sum = warp_sum(sum);
    if (lane == 0) s_l[g] = sum;
  }
  __syncthreads();
  ACC acc[G][VD];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < VD; ++e) acc[g][e] = 0;
  // P.V: warp w takes keys w, w + NW, ...: the UP it holds, then UV rows at a time
#pragma unroll
  for (int u = 0; u < UP; ++u) {
    const i64 j = kbeg + warp + u * NW;
    if (j >= kend) break;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const ACC p = sh[g * SK + j];
#pragma unroll
      for (int e = 0; e < VD; ++e) acc[g][e] += p * LD(ACC, vp[u].v[e]);
    }
  }
  for (i64 j0 = kbeg + warp + UP * NW; j0 < kend; j0 += NW * UV) {
    RlxVec<TV, VD> vv[UV];
#pragma unroll
    for (int u = 0; u < UV; ++u) vv[u] = rlx_vload<VD>(vb + (j0 + u * NW) * vss, j0 + u * NW < kend);
#pragma unroll
    for (int u = 0; u < UV; ++u) {
      const i64 j = j0 + u * NW;
      if (j >= kend) break;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const ACC p = sh[g * SK + j];
#pragma unroll
        for (int e = 0; e < VD; ++e) acc[g][e] += p * LD(ACC, vv[u].v[e]);
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < VD; ++e) sh[(warp * G + g) * D + lane * VD + e] = acc[g][e];
  __syncthreads();
  for (int t = tid; t < G * D; t += NT) {
    const int g = t / D, d = t % D;
    ACC o = 0;
#pragma unroll
    for (int w = 0; w < NW; ++w) o += sh[(w * G + g) * D + d];
    const ACC l = s_l[g];
    out[b * osb + (kvh * G + g) * osh + d] = ST(TO, l == 0 ? (ACC)0 : o / l);
  }
}
// @part decode(NT, TQ, TK, TV, TM, TP, TO, G, D, VK, QV, NL, CL, PF, MASKMODE, HEADMASK, ROPE, TC, TN, EPI, EPI_FN, EPI_CALL(o, e), TE, TY)
// Decode attention (one query row per head) over a KV cache longer than the short kernel
// takes (up to ATTN_DECODE_KEYS, sources.py) with few batch x kv heads: a cluster of CL
// blocks per (batch, kv head) shares its keys, a chunk of NL * KPL keys to a warp at a time.
// A warp scores its chunk for all G heads of the kv head at once: LPK lanes take a key row
// in VK-element loads (K and V of the chunk issued before any math), a butterfly sums each
// row's dot products, and the warp keeps its own online softmax (no shared memory and no
// barrier in the loop). The warps' (max, sum, P.V) meet in shared memory; each block then
// pushes its P.V sums into the shared memory of the block finishing them (block r the outputs
// [r PER, (r + 1) PER)) and its (max, sum) of every head into every block's (sm_90 clusters,
// st.async counted on the receiver's mbarrier): no partials in global memory, no GPU-wide
// fence, no counter, no cluster barrier after the one before the wait (H100, against remote
// loads between two cluster barriers: Qwen3.5-2B decode 1.764 -> 1.761 ms a token, Llama-1B
// q4_k 0.700 -> 0.694).
// Llama-3.2-1B-shaped decode at 563 cached positions (32 / 8 heads x 64, bf16, H200): the
// split-K kernel (80 blocks of 4 warps; at 409 positions ncu counted ~2,300
// instructions a warp at 6 cycles each) took 12.0 us a launch, this one 7.2; the q4_k step went
// 0.760 -> 0.699 ms. One block per (batch, kv head), no cluster, made that step 0.908 ms.
// HEADMASK 0: the mask has no head stride (a decode step's key mask), so a lane reads a key's
// mask once for its G heads, not G times. Grid z splits a kv head's H / KVH query heads into
// groups of G (blocks z): more blocks read the same keys (from L2), each with fewer heads.
// ROPE: the step's RoPE is this launch's, not one of its own (ops.AttnRope): q holds the raw
// query rows, which each block norms (qnw: rms_norm(x) * (qnw + qoff); null: none) and rotates
// (tables rc / rs: [B or 1, half], rpb) into shared memory as the RoPE launch would write them
// (rope.cu:row); the block whose warps score position pos[b] does the same to the new key row
// xk (knw, keps, koff), copies the value row xv, scores that position from those shared rows and
// writes both into the caches kc / vc (k's and v's memory: no key is read from the cache at the
// position this launch writes). A position past the cache is flagged (kv_write's error 2, node).
// EPI: the elementwise node reading the output (Qwen3.5's output gate, o * sigmoid(gate)) is
// computed in the store: ey[b, h, d] = EPI_CALL(o as stored, ex[b, h, d]) (EPI_FN, ops.AttnEpilogue)
// instead of out.
EPI_FN
#define NW (NT / 32)
extern "C" __global__ void RLX_CLUSTER(1, CL, 1) __launch_bounds__(NT) rlx_attn_decode(
    const TQ* __restrict__ q, long long qsb, long long qsh,
    const TK* __restrict__ k, long long ksb, long long ksh, long long kss,
    const TV* __restrict__ v, long long vsb, long long vsh, long long vss,
    const TM* __restrict__ mask, long long m0, long long m1, long long m3,
    const TP* __restrict__ pos, int H, int KVH, int Sk, double scale_d, double cap_d, int window,
    TO* __restrict__ out, long long osb, long long osh,
    const TK* __restrict__ xk, long long xksb, long long xksh, const TV* __restrict__ xv, long long xvsb,
    long long xvsh, TK* kc, TV* vc, const TC* __restrict__ rc, const TC* __restrict__ rs, int half, int rpb,
    const TN* __restrict__ qnw, const TN* __restrict__ knw, float qeps, float qoff, float keps, float koff,
    int* err, int node, const TE* __restrict__ ex, long long exsb, long long exsh, TY* __restrict__ ey,
    long long eysb, long long eysh) {
  typedef float ACC;
  constexpr int LPK = D / VK, KPL = 32 / LPK, CH = NL * KPL;
  static_assert(LPK * KPL == 32 && LPK * VK == D, "rlx_attn_decode: a key row takes a power of two lanes");
#if ROPE
  __shared__ __align__(32) TQ s_q[G][D];          // the roped query rows
  __shared__ __align__(32) TK s_k[D];             // the new key row, roped (the block scoring it)
  __shared__ __align__(32) TV s_v[D];             // the new value row
#endif
  __shared__ ACC s_o[NW][G][D];
  __shared__ ACC s_m[NW][G], s_l[NW][G];
  constexpr int PER = (G * D + CL - 1) / CL;       // outputs a block finishes
  __shared__ ACC c_o[CL][PER];                     // the cluster's P.V sums of this block's outputs
  __shared__ __align__(8) ACC c_ml[CL][G][2];      // and its (max, sum) of each head
  __shared__ unsigned long long got;               // their arrivals
  const int b = blockIdx.x / KVH, kvh = blockIdx.x % KVH, h0 = kvh * (H / KVH) + blockIdx.z * G;
  const unsigned rank = rlx_cluster_rank();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sl = lane % LPK, kg = lane / LPK;       // this lane's slice of a row, its key in a load
  const ACC scale = (ACC)scale_d, cap = (ACC)cap_d;
  const TK* kb = k + b * ksb + kvh * ksh + sl * VK;
  const TV* vb = v + b * vsb + kvh * vsh + sl * VK;
  const i64 gw = (i64)rank * NW + warp, step = (i64)CL * NW * CH;    // chunks gw, gw + CL * NW, ...
  // this warp's first PF chunks asked into L2 before the wait for the kernel before
  const i64 early = RLX_POS_EARLY(pos, b, Sk - 1);
  {
    i64 kbeg, kend;
    rlx_key_range(early, early, Sk, window, &kbeg, &kend);
    for (int c = 0; c < PF && kbeg + gw * CH + c * step < kend; ++c) {
      const i64 c0 = kbeg + gw * CH + c * step;
      rlx_prefetch_rows(k + b * ksb + kvh * ksh, kss, c0, min(kend, c0 + CH), D * (int)sizeof(TK), lane, 32);
      rlx_prefetch_rows(v + b * vsb + kvh * vsh, vss, c0, min(kend, c0 + CH), D * (int)sizeof(TV), lane, 32);
    }
  }
  rlx_push_start(&got, 1);
  RLX_GRID_WAIT();
  const i64 p0 = RLX_POS(pos, b, early);
  i64 kbeg, kend;
  rlx_key_range(p0, p0, Sk, window, &kbeg, &kend);
#if ROPE
  // this block scores position p0 where its chunk is one of this block's warps' (see the loop)
  const bool fresh = p0 >= kbeg && p0 < kend && ((p0 - kbeg) / CH) % ((i64)CL * NW) / NW == rank;
  if ((p0 < 0 || p0 >= Sk) && tid == 0 && rank == 0 && blockIdx.z == 0) rlx_error(err, 2, node, p0, (i64)Sk);
  const i64 ci = rpb ? (i64)b * half : 0;
  for (int r = warp; r < G + (int)fresh; r += NW) {
    if (r < G)
      rlx_rope_row<TQ, TQ, TC, TN, ACC>(q, b * qsb + (h0 + r) * qsh, qsh, 1, D, half, qnw != nullptr, 1, 0, qnw,
                                        qeps, qoff, 1, rc + ci, rs + ci, &s_q[r][0], 1, lane);
    else
      rlx_rope_row<TK, TK, TC, TN, ACC>(xk, b * xksb + kvh * xksh, xksh, 1, D, half, knw != nullptr, 1, 0, knw,
                                        keps, koff, 1, rc + ci, rs + ci, s_k, 1, lane);
  }
  if (fresh)
    for (int d = tid; d < D; d += NT) s_v[d] = xv[b * xvsb + kvh * xvsh + d];
  __syncthreads();
  if (fresh)
    for (int d = tid; d < D; d += NT) {
      kc[b * ksb + kvh * ksh + p0 * kss + d] = s_k[d];
      vc[b * vsb + kvh * vsh + p0 * vss + d] = s_v[d];
    }
#endif
  ACC qr[G][VK], m[G], l[G], acc[G][VK];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -(ACC)RLX_INF;
    l[g] = 0;
#if ROPE
    const RlxVec<TQ, VK> qv = *(const RlxVec<TQ, VK>*)&s_q[g][sl * VK];
#else
    const TQ* qg = q + b * qsb + (h0 + g) * qsh + sl * VK;
#if QV
    const RlxVec<TQ, VK> qv = rlx_vload<VK>(qg, true);    // (QV: q's rows and base allow VK-element loads)
#endif
#endif
#pragma unroll
    for (int e = 0; e < VK; ++e) {
#if QV || ROPE
      qr[g][e] = LD(ACC, qv.v[e]);
#else
      qr[g][e] = LD(ACC, qg[e]);
#endif
      acc[g][e] = 0;
    }
  }
  for (i64 j0 = kbeg + gw * CH; j0 < kend; j0 += step) {
    RlxVec<TK, VK> kr[NL];
    RlxVec<TV, VK> vr[NL];
#pragma unroll
    for (int n = 0; n < NL; ++n) {
      const i64 j = j0 + n * KPL + kg;
#if ROPE
      if (j == p0 && fresh) {
        kr[n] = *(const RlxVec<TK, VK>*)&s_k[sl * VK];
        vr[n] = *(const RlxVec<TV, VK>*)&s_v[sl * VK];
        continue;
      }
#endif
      kr[n] = rlx_vload<VK>(kb + j * kss, j < kend);
      vr[n] = rlx_vload<VK>(vb + j * vss, j < kend);
    }
#if MASKMODE
    RLX_MASK_T(ACC) mk[NL][G];
#pragma unroll
    for (int n = 0; n < NL; ++n) {
      const i64 j = j0 + n * KPL + kg;
#pragma unroll
      for (int g = 0; g < G; ++g)
        mk[n][g] = HEADMASK || g == 0
                   ? RLX_MASK_AT(mask + b * m0 + (h0 + g) * m1 + j * m3, j < kend, ACC) : mk[n][0];
    }
#endif
    ACC s[NL][G];
#pragma unroll
    for (int n = 0; n < NL; ++n)
#pragma unroll
      for (int g = 0; g < G; ++g) {
        ACC t = 0;
#pragma unroll
        for (int e = 0; e < VK; ++e) t += qr[g][e] * LD(ACC, kr[n].v[e]);
        s[n][g] = t;
      }
#pragma unroll
    for (int o = LPK / 2; o > 0; o >>= 1)
#pragma unroll
      for (int n = 0; n < NL; ++n)
#pragma unroll
        for (int g = 0; g < G; ++g) s[n][g] += SHFL_XOR(s[n][g], o);
#pragma unroll
    for (int n = 0; n < NL; ++n) {
      const i64 j = j0 + n * KPL + kg;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        ACC x = s[n][g] * scale;
        if (cap_d != 0.0) x = tanh(x / cap) * cap;
        bool keep = j < kend;
        RLX_KEEP(p0, j, keep);
#if MASKMODE == 1
        keep = keep && mk[n][g];
#elif MASKMODE == 2
        x = x + mk[n][g];
#endif
        s[n][g] = keep ? x : -(ACC)RLX_INF;
      }
    }
    // online softmax over the chunk: the max and sum over the warp's key groups
#pragma unroll
    for (int g = 0; g < G; ++g) {
      ACC cm = -(ACC)RLX_INF;
#pragma unroll
      for (int n = 0; n < NL; ++n) cm = rlx_max(cm, s[n][g]);     // a NaN score stays
#pragma unroll
      for (int o = LPK; o < 32; o <<= 1) cm = rlx_max(cm, SHFL_XOR(cm, o));
      const ACC mn = rlx_max(m[g], cm);
      const bool live = mn != -(ACC)RLX_INF;     // (NaN is live: its row comes out NaN)
      const ACC a = live ? exp(m[g] - mn) : (ACC)1;
      ACC ps = 0;
#pragma unroll
      for (int n = 0; n < NL; ++n) {
        s[n][g] = live ? exp(s[n][g] - mn) : (ACC)0;
        ps += s[n][g];
      }
#pragma unroll
      for (int o = LPK; o < 32; o <<= 1) ps += SHFL_XOR(ps, o);
      l[g] = l[g] * a + ps;
      m[g] = mn;
#pragma unroll
      for (int e = 0; e < VK; ++e) acc[g][e] *= a;
    }
#pragma unroll
    for (int n = 0; n < NL; ++n)
#pragma unroll
      for (int e = 0; e < VK; ++e) {
        const ACC x = LD(ACC, vr[n].v[e]);
#pragma unroll
        for (int g = 0; g < G; ++g) acc[g][e] += s[n][g] == (ACC)0 ? (ACC)0 : s[n][g] * x;
      }
  }
  // the warp's key groups summed (lanes of one slice), then the block's warps merged
#pragma unroll
  for (int o = LPK; o < 32; o <<= 1)
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int e = 0; e < VK; ++e) acc[g][e] += SHFL_XOR(acc[g][e], o);
  if (kg == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int e = 0; e < VK; ++e) s_o[warp][g][sl * VK + e] = acc[g][e];
  }
  if (lane < G) {
#pragma unroll
    for (int g = 0; g < G; ++g)
      if (g == lane) { s_m[warp][g] = m[g]; s_l[warp][g] = l[g]; }
  }
  __syncthreads();
  const int mine = max(0, min(PER, G * D - (int)rank * PER));
  if (tid == 0) rlx_push_expect(&got, CL * (unsigned)(mine + 2 * G) * sizeof(ACC));
  for (int t = tid; t < G * D; t += NT) {
    const int g = t / D, d = t % D;
    ACC M = -(ACC)RLX_INF, O = 0, L = 0;
#pragma unroll
    for (int w = 0; w < NW; ++w) M = rlx_max(M, s_m[w][g]);
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const ACC f = rlx_part_weight(s_m[w][g], M);
      O += f == (ACC)0 ? (ACC)0 : s_o[w][g][d] * f;
      L += s_l[w][g] * f;
    }
    rlx_push(&c_o[rank][t % PER], t / PER, O, &got);
    if (d == 0)
      for (int r = 0; r < CL; ++r) rlx_push2(&c_ml[rank][g][0], r, M, L, &got);
  }
  // the cluster's partials in: block `rank` finishes its share of the G x D outputs
  rlx_push_wait(&got, 0);
  for (int t = tid; t < mine; t += NT) {
    const int g = (rank * PER + t) / D, d = (rank * PER + t) % D;
    ACC M = -(ACC)RLX_INF, O = 0, L = 0;
#pragma unroll
    for (int r = 0; r < CL; ++r) M = rlx_max(M, c_ml[r][g][0]);
#pragma unroll
    for (int r = 0; r < CL; ++r) {
      const ACC f = rlx_part_weight(c_ml[r][g][0], M);
      O += f == (ACC)0 ? (ACC)0 : c_o[r][t] * f;
      L += c_ml[r][g][1] * f;
    }
#if EPI
    ey[b * eysb + (h0 + g) * eysh + d] = EPI_CALL(ST(TO, L == 0 ? (ACC)0 : O / L), ex[b * exsb + (h0 + g) * exsh + d]);
#else
    out[b * osb + (h0 + g) * osh + d] = ST(TO, L == 0 ? (ACC)0 : O / L);
#endif
  }
}
