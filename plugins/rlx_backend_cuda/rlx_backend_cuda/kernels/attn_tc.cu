// Attention on tensor cores (f16 / bf16): mma.sync flash attention, and Hopper's wgmma
// kernel (sm_90a). The MMA operand type MMAT (bf16 / f16) goes into the inline PTX as a
// string (RLX_STR).
// @part common()
// What both tensor-core attention kernels use: 2^x in one MUFU instruction (exp2f adds a
// denormal fix-up around it; a probability under 2^-126 is 0 to the bf16/f16 P.V product
// anyway; a host build, tests/cuda_emu.py, takes exp2f). tc.cu has their other PTX.
__device__ __forceinline__ float rlx_exp2(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}
// @part tc(MT, D, T, VEC, TM, TP, HAS_POS, MASKKIND, MASKMODE)
// Flash-style prefill on tensor cores (f16/bf16, head_dim D % 16 == 0, D <= 256; MT = 1 at 256):
// FlashAttention-2 register layout with mma.sync.m16n8k16 (f32 accumulate). Block = 4
// warps x MT m-tiles of 16 query rows of one head (warp w takes rows mt * 64 + w * 16..);
// Q and 64-key tiles of K and V staged in shared memory (dynamic: attn_tc_smem bytes);
// S = Q K^T and the online softmax stay in registers; P is re-packed to A fragments. Q's A
// and K's and V's B fragments come from shared memory by ldmatrix (V's transposed), each K
// and V fragment feeding the MT m-tiles. With MT = 2 a block reads each K/V tile for 128
// query rows. V read one 16-bit element at a time took 2.40 against 1.91 ms (FLUX's
// 4608-token, 24-head attention, H100). At D = 256 a thread holds O's 128 accumulators (FA2's
// hdim-256 tiles: 64 query rows, 64 keys, 4 warps); 101,376 bytes of shared memory, within
// sm_80's and sm_86's limits.
#define BM (64 * MT)
#define BN 64
#define LDS (D + 8)
#define RLX_LOG2E 1.4426950408889634f
__device__ __forceinline__ u32 rlx_pack(float lo, float hi) {
  T l = ST(T, lo), h = ST(T, hi);
  return (u32)(*(unsigned short*)&l) | ((u32)(*(unsigned short*)&h) << 16);
}
__device__ __forceinline__ void rlx_load_tile(unsigned short* dst, const T* src, long long rstride,
    i64 row0, i64 nrows, int tid, int nr = BN) {
  // rows row0..row0+nr-1 of a [rows, D] strided matrix into dst[nr][LDS]; rows past nrows are 0
#if VEC
  for (int idx = tid; idx < nr * (D / 8); idx += 128) {
    const int r = idx / (D / 8), c = (idx % (D / 8)) * 8;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (row0 + r < nrows) val = *(const uint4*)(src + (row0 + r) * rstride + c);
    *(uint4*)(dst + r * LDS + c) = val;
  }
#else
  for (int idx = tid; idx < nr * D; idx += 128) {
    const int r = idx / D, c = idx % D;
    unsigned short val = 0;
    if (row0 + r < nrows) val = *(const unsigned short*)(src + (row0 + r) * rstride + c);
    dst[r * LDS + c] = val;
  }
#endif
}
__device__ __forceinline__ void rlx_load_tile_async(unsigned short* dst, const T* src, long long rstride,
    i64 row0, i64 nrows, int tid) {
  // rlx_load_tile by cp.async (16 bytes a copy, rows past nrows zero-filled): the copies run
  // while the warps compute; the caller commits the group and waits for it. A thread copies
  // the same 16-byte column of every RSTEP-th row: its addresses advance by one add a copy
#if VEC
  constexpr int CPR = D / 8, RSTEP = 128 / CPR;
  if (tid >= RSTEP * CPR) return;
  const int r0 = tid / CPR, c = (tid % CPR) * 8;
  const int lim = (int)min((i64)BN, nrows - row0);
  const T* p = src + (row0 + r0) * rstride + c;
  const i64 step = (i64)RSTEP * rstride;
#ifdef __CUDA_ARCH__
  unsigned s = (unsigned)__cvta_generic_to_shared(dst + r0 * LDS + c);
#endif
#pragma unroll
  for (int i = 0; i < (BN + RSTEP - 1) / RSTEP; ++i, p += step) {
    const int r = r0 + i * RSTEP;
    if (BN % RSTEP != 0 && r >= BN) break;
    const bool ok = r < lim;
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(s), "l"(ok ? p : src), "r"(ok ? 16 : 0));
    s += RSTEP * LDS * 2;
#else
    rlx_cp16(dst + r * LDS + c, ok ? p : src, ok);
#endif
  }
#else
  rlx_load_tile(dst, src, rstride, row0, nrows, tid);
#endif
}
extern "C" __global__ void __launch_bounds__(128) rlx_attn_tc(
    const T* __restrict__ q, long long qsb, long long qsh, long long qss,
    const T* __restrict__ k, long long ksb, long long ksh, long long kss,
    const T* __restrict__ v, long long vsb, long long vsh, long long vss,
    const TM* __restrict__ mask, long long m0, long long m1, long long m2, long long m3,
    const TP* __restrict__ pos, T* __restrict__ out, long long osb, long long osh, long long oss,
    int B, int H, int KVH, int Sq, int Sk, double scale_d, double cap_d, int window) {
  extern __shared__ __align__(16) unsigned short rlx_smem[];
  unsigned short* Ks = rlx_smem;                  // [BN][LDS]
  unsigned short* Vs = rlx_smem + BN * LDS;       // [BN][LDS]
  unsigned short* Qs = rlx_smem + 2 * BN * LDS;   // [BM][LDS]
  const int qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int G = H / KVH, kvh = h / G;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tg = lane & 3;
  const float scale = (float)scale_d, cap = (float)cap_d, scale2 = scale * RLX_LOG2E;
  const i64 q0 = (i64)qt * BM;
#if HAS_POS
  const i64 p0 = (i64)pos[b];
#else
  const i64 p0 = (i64)(Sk - Sq);
#endif
  rlx_load_tile(Qs, q + b * qsb + h * qsh, qss, q0, Sq, tid, BM);
  float o[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) { o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.f; }
  float mrow[MT][2], lrow[MT][2];
  i64 qi[MT][2], qp[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mrow[mt][r] = -RLX_INF;
      lrow[mt][r] = 0.f;
      qi[mt][r] = q0 + mt * 64 + warp * 16 + g + 8 * r;
      qp[mt][r] = p0 + qi[mt][r];
    }
  const i64 qlast = min(q0 + BM, (i64)Sq) - 1;
  i64 kend = Sk, kbeg = 0;
  if (MASKKIND >= 1) kend = min((i64)Sk, p0 + qlast + 1);
  if (MASKKIND == 2) kbeg = max((i64)0, p0 + q0 - window + 1);
  const T* kb = k + b * ksb + kvh * ksh;
  const T* vb = v + b * vsb + kvh * vsh;
  // Q's A fragments: lanes 0-15 address rows 0-15 of the m-tile at column 0, lanes 16-31 at 8
  const unsigned short* qrow = Qs + (warp * 16 + (lane & 15)) * LDS + (lane >> 4) * 8;
  // pipeline: V's tile loads while S = Q K^T and the softmax run, the next K tile while P V runs
  if (kbeg < kend) rlx_load_tile_async(Ks, kb, kss, kbeg, Sk, tid);
  RLX_CP_COMMIT();
  for (i64 kt = kbeg; kt < kend; kt += BN) {
    rlx_load_tile_async(Vs, vb, vss, kt, Sk, tid);
    RLX_CP_COMMIT();
    RLX_CP_WAIT(1);                                 // this K tile has landed (and Q, first time)
    __syncthreads();
    float s[MT][BN / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ks += 2) {
      u32 qa[MT][2][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        rlx_ldm_x4(qa[mt][0], qrow + mt * 64 * LDS + ks * 16);
        rlx_ldm_x4(qa[mt][1], qrow + mt * 64 * LDS + ks * 16 + 16);
      }
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
        // K's B fragments for two k-steps at once: keys nt*8.. +7, head dims ks*16.. +31
        u32 kf[4];
        rlx_ldm_x4(kf, Ks + (nt * 8 + (lane & 7)) * LDS + (lane >> 3) * 8 + ks * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          rlx_mma(s[mt][nt], qa[mt][0], kf[0], kf[1]);
          rlx_mma(s[mt][nt], qa[mt][1], kf[2], kf[3]);
        }
      }
    }
    // scores in log2 units (exp2 below). A tile every query row sees whole (no mask input,
    // no softcap, in range, below the causal diagonal) keeps raw scores: the scale is folded
    // into the exponent's multiply-add (sm), and the row max of raw scores, scaled, is the max
    const bool whole = MASKMODE == 0 && cap_d == 0.0 && scale_d > 0.0 && kt + BN <= Sk && q0 + BM <= Sq &&
                       (MASKKIND == 0 || (MASKKIND == 1 && kt + BN - 1 <= p0 + q0));
    const float sm = whole ? scale2 : 1.f;
    float mx[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      mx[mt][0] = mx[mt][1] = -RLX_INF;
      if (whole) {
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) mx[mt][e >> 1] = fmaxf(mx[mt][e >> 1], s[mt][nt][e]);
        }
        mx[mt][0] *= sm;
        mx[mt][1] *= sm;
      } else {
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int rsel = e >> 1;
            const i64 j = kt + nt * 8 + tg * 2 + (e & 1);
            float x = s[mt][nt][e] * scale;
            if (cap_d != 0.0) x = tanhf(x / cap) * cap;
            bool keep = (j < Sk) && (qi[mt][rsel] < Sq);
            RLX_KEEP(qp[mt][rsel], j, keep);
#if MASKMODE == 1
            if (keep) keep = mask[b * m0 + h * m1 + qi[mt][rsel] * m2 + j * m3] != 0;
#elif MASKMODE == 2
            if (keep) x = x + tof(mask[b * m0 + h * m1 + qi[mt][rsel] * m2 + j * m3]);
#endif
            x = keep ? x * RLX_LOG2E : -RLX_INF;
            s[mt][nt][e] = x;
            mx[mt][rsel] = x > mx[mt][rsel] ? x : mx[mt][rsel];
          }
        }
      }
    }
    // The running max moves only when a row's max grows past it by 2^8 (any row of the
    // warp: the branch is uniform): until then P = 2^(s - max) stays under 256 and O and l
    // need no rescale; the quotient O / l is the same for any max
    bool grow = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[mt][r] = fmaxf(mx[mt][r], SHFL_XOR(mx[mt][r], 1));
        mx[mt][r] = fmaxf(mx[mt][r], SHFL_XOR(mx[mt][r], 2));
        grow |= mx[mt][r] > mrow[mt][r] + 8.f;
      }
    if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float mn = fmaxf(mrow[mt][r], mx[mt][r]);
          alpha[r] = rlx_exp2(mrow[mt][r] - ((mn > -RLX_INF) ? mn : 0.f));
          mrow[mt][r] = mn;
          lrow[mt][r] *= alpha[r];
        }
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
          o[mt][dt][0] *= alpha[0]; o[mt][dt][1] *= alpha[0]; o[mt][dt][2] *= alpha[1]; o[mt][dt][3] *= alpha[1];
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float mu0 = mrow[mt][0] > -RLX_INF ? mrow[mt][0] : 0.f;
      const float mu1 = mrow[mt][1] > -RLX_INF ? mrow[mt][1] : 0.f;
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float p = rlx_exp2(fmaf(s[mt][nt][e], sm, -(e < 2 ? mu0 : mu1)));
          s[mt][nt][e] = p;
          lrow[mt][e >> 1] += p;
        }
      }
    }
    __syncthreads();                                // every warp is done with this K tile
    if (kt + BN < kend) rlx_load_tile_async(Ks, kb, kss, kt + BN, Sk, tid);
    RLX_CP_COMMIT();
    RLX_CP_WAIT(1);                                 // this V tile has landed
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      u32 a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = rlx_pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = rlx_pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = rlx_pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = rlx_pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
      // V's B fragments for two column tiles at once: keys kk*16.. +15, columns dt*8.. +15
      const unsigned short* vrow = Vs + (kk * 16 + (lane & 7) + (lane & 8)) * LDS + (lane >> 4) * 8;
#pragma unroll
      for (int dt = 0; dt < D / 8; dt += 2) {
        u32 vf[4];
        rlx_ldm_x4<true>(vf, vrow + dt * 8);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          rlx_mma(o[mt][dt], a[mt], vf[0], vf[1]);
          rlx_mma(o[mt][dt + 1], a[mt], vf[2], vf[3]);
        }
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = lrow[mt][r];
      l += SHFL_XOR(l, 1);
      l += SHFL_XOR(l, 2);
      if (qi[mt][r] >= Sq) continue;
      const float inv = l == 0.f ? 0.f : 1.f / l;
      T* orow = out + b * osb + h * osh + qi[mt][r] * oss;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        const int c = dt * 8 + tg * 2;
        orow[c] = ST(T, o[mt][dt][2 * r] * inv);
        orow[c + 1] = ST(T, o[mt][dt][2 * r + 1] * inv);
      }
    }
}
// @part wg(D, BN, MMAT, BF16, T, TM, WHOLE, CAP, KEYMASK, MASKMODE, MASKKIND, TP, HAS_POS, S_REGS, S_OUTS, QK_A, QK_B, QK_ACC, O_REGS, O_OUTS, PV_A0, PV_A1, PV_A2, PV_A3, PV_B, PV_ONE)
// Hopper (sm_90a) prefill attention on wgmma (f16/bf16, head_dim 64, 128 or 256, 16-byte rows).
// Block = 2 warpgroups x 64 query rows of one head. Shared memory: Q, and two slots of a K and
// a V tile of BN keys each (128; 64 for head_dim 256, as FA3 narrows its key tile there: O's
// 128 accumulators a thread and both S tiles then fit the 255 registers, and Q, K and V the
// 227 KB of shared memory; Qwen3.5's 8 / 2 heads x 256, causal, 32k tokens: 527 TFLOP/s), as the 128-byte-swizzled layout wgmma reads (each 64-column half
// of a row is 128 bytes, its 16-byte chunk c at c ^ (row % 8)). Q comes by every thread's
// cp.async; K and V by the copy engine (TMA, tensor maps made by device.tensor_map), which
// one thread issues into a slot once both warpgroups have released it (mbarriers: no
// block-wide barrier a tile, so the warpgroups drift apart and overlap). S = Q K^T with A and
// B from shared memory (K-major); the online softmax on S's registers (the FA2 layout: a
// thread holds 2 rows x 2 columns of every 8); P re-packed as A registers; O += P V with V as
// an MN-major B (LBO: the next 64 columns, SBO: the next 8 keys). S of tile t + 1 runs on the
// tensor cores while the exponentials of tile t run. FLUX's attention (4608 tokens, 24 x 128,
// bf16, H200): 0.473 ms, 552 TFLOP/s (rlx_attn_tc: 0.885 ms; the same kernel with every
// thread's cp.async and a block barrier a tile 0.545; lock-step tiles without the overlap
// 0.602; with per-chunk address math in the copies 0.835).
#define BM 128
// KEYMASK: a boolean mask of keys only (one row for every query row: a padding mask)
#define REWRITE (CAP || MASKMODE == 2 || (MASKMODE == 1 && !KEYMASK))
#define RLX_LOG2E 1.4426950408889634f
__device__ __forceinline__ unsigned long long rlx_desc(unsigned a, unsigned lbo, unsigned sbo) {
  // a wgmma shared-memory matrix descriptor, 128-byte swizzle
  return (unsigned long long)((a & 0x3FFFF) >> 4) | ((unsigned long long)((lbo & 0x3FFFF) >> 4) << 16) |
         ((unsigned long long)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}
// the wgmma operand lists (sources.attn_wg_source writes them for D and BN): S_REGS / O_REGS the
// accumulators' operands as a string ("%0, %1, ..."), S_OUTS / O_OUTS their asm outputs; QK_A,
// QK_B, QK_ACC and PV_A0..3, PV_B, PV_ONE the numbers of the two wgmmas' further operands as strings
__device__ __forceinline__ void rlx_wg_qk(float* d, unsigned long long a, unsigned long long b, int acc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" QK_ACC ", 0;\n"
               "wgmma.mma_async.sync.aligned.m64n" RLX_STR(BN) "k16.f32." RLX_STR(MMAT) "." RLX_STR(MMAT) " {" S_REGS "}, "
               "%" QK_A ", %" QK_B ", p, 1, 1, 0, 0;\n}\n"
               : S_OUTS : "l"(a), "l"(b), "r"(acc));
}
__device__ __forceinline__ void rlx_wg_pv(float* d, const u32* a, unsigned long long b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" PV_ONE ", 0;\n"
               "wgmma.mma_async.sync.aligned.m64n" RLX_STR(D) "k16.f32." RLX_STR(MMAT) "." RLX_STR(MMAT) " {" O_REGS "}, "
               "{%" PV_A0 ", %" PV_A1 ", %" PV_A2 ", %" PV_A3 "}, %" PV_B ", p, 1, 1, 1;\n}\n"
               : O_OUTS : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
#define RLX_WG_FENCE() asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory")
#define RLX_WG_COMMIT() asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory")
#define RLX_WG_WAIT0() asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory")
__device__ __forceinline__ u32 rlx_pack(float lo, float hi) {
  // two floats rounded to one register of 16-bit values (one cvt instruction)
#if BF16
  __nv_bfloat162 t = __floats2bfloat162_rn(lo, hi);
#else
  __half2 t = __floats2half2_rn(lo, hi);
#endif
  return *(u32*)&t;
}
struct rlx_wg_loader {
  // a thread's share of copying 128 rows (Q's) x D columns into D / 64 swizzled [128][128 B]
  // halves: 16-byte column cc of rows r0, r0 + 256 / (D / 8), ... (the same swizzled slot in
  // each: the row step is a multiple of 8)
  static constexpr int CPR = D / 8, RSTEP = 256 / CPR, N = 128 / RSTEP;
  int r0;
  unsigned dst;
  long long col;
  __device__ __forceinline__ rlx_wg_loader(int tid) {
    r0 = tid / CPR;
    const int cc = tid % CPR;
    dst = (cc >> 3) * 128 * 128 + r0 * 128 + (((cc & 7) ^ (r0 & 7)) << 4);
    col = cc * 8;
  }
  __device__ __forceinline__ void operator()(unsigned base, const T* src, long long rstride, i64 row0,
                                             i64 nrows) const {
    const T* p = src + (row0 + r0) * rstride + col;
    const long long step = (long long)RSTEP * rstride;
    if (row0 + 128 <= nrows) {
#pragma unroll
      for (int i = 0; i < N; ++i, p += step)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(base + dst + i * RSTEP * 128), "l"(p));
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i, p += step) {
        const bool ok = row0 + r0 + i * RSTEP < nrows;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                     :: "r"(base + dst + i * RSTEP * 128), "l"(ok ? p : src), "r"(ok ? 16 : 0));
      }
    }
  }
};
template <int N> __device__ __forceinline__ void rlx_wg_settle(float* d) {
  // the compiler may not move reads of registers an async wgmma writes above its wait
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
// mbarriers (shared-memory addresses): a tile's K or V has landed (the copy engine's byte
// count completes the phase), or the warpgroups are done reading a slot (128 arrivals each)
__device__ __forceinline__ void rlx_bar_init(unsigned bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void rlx_bar_wait(unsigned bar, int parity) {
  unsigned ok = 0;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
  } while (!ok);
}
__device__ __forceinline__ void rlx_bar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
struct rlx_wg_attn {
  // one block's state. The pipeline: S = Q K^T of tile t + 1 runs on the tensor cores while
  // the exponentials of tile t run, then P V of tile t. Thread 0 also issues the copy
  // engine's (TMA) loads: K of tile t + 2 and V of tile t + 1 at the start of tile t, each
  // into the slot both warpgroups have released
  const void *tk, *tv;                 // tensor maps of K and V (global memory)
  const TM* mask;
  long long m0, m1, m2, m3;
  i64 q0, p0, kbeg, Sq, Sk;
  int b, h, kvh, tg, window, n, tid;
  float scale, cap, scale2;
  double cap_d, scale_d;
  unsigned KV0, bars;
  unsigned long long qdesc;
  float o[D / 8][4];
  float mrow[2], lrow[2];
  i64 qi[2], qp[2];
#if KEYMASK
  bool kb[BN / 32];                    // the next tile's mask: key kt + 32 i + lane kept
#endif

  __device__ __forceinline__ unsigned kslot(int t) const { return KV0 + (t & 1) * 2 * BN * D * 2; }
  __device__ __forceinline__ unsigned vslot(int t) const { return kslot(t) + BN * D * 2; }
  // barriers: kfull, vfull, kempty, vempty, two slots each
  __device__ __forceinline__ unsigned bar(int which, int t) const { return bars + (which * 2 + (t & 1)) * 8; }
  __device__ __forceinline__ void fetch(const void* map, unsigned dst, unsigned full, int t) const {
    // tile t's rows (kbeg + t * BN ..; rows past Sk are zeros) as D / 64 boxes of [BN][64]
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(full), "r"(BN * D * 2) : "memory");
    const int row = (int)(kbeg + (i64)t * BN);
#pragma unroll
    for (int c = 0; c < D / 64; ++c)
      asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                   "[%0], [%1, {%2, %3, %4, %5}], [%6];\n"
                   :: "r"(dst + c * BN * 128), "l"(map), "r"(c * 64), "r"(row), "r"(kvh), "r"(b), "r"(full)
                   : "memory");
  }
#if KEYMASK
  __device__ __forceinline__ void key_load(int t) {
    const i64 j = kbeg + (i64)t * BN + (tid & 31);
#pragma unroll
    for (int i = 0; i < BN / 32; ++i)
      kb[i] = j + 32 * i < Sk && mask[b * m0 + h * m1 + (j + 32 * i) * m3] != 0;
  }
#endif
  __device__ __forceinline__ void qk(float (&s)[BN / 8][4], int t) const {
    rlx_bar_wait(bar(0, t), (t >> 1) & 1);
    const unsigned long long kd = rlx_desc(kslot(t), 16, 1024);
    RLX_WG_FENCE();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)      // a step along K adds to the descriptor's address (16-byte units)
      rlx_wg_qk(&s[0][0], qdesc + (((ks >> 2) * BM * 128 + (ks & 3) * 32) >> 4),
                kd + (((ks >> 2) * BN * 128 + (ks & 3) * 32) >> 4), ks);
    RLX_WG_COMMIT();
  }
  __device__ __forceinline__ void tile(int t, float (&sc)[BN / 8][4], float (&sn)[BN / 8][4]) {
    if (tid == 0) {
      if (t + 2 < n) {                             // K of tile t + 2 where tile t's was
        rlx_bar_wait(bar(2, t), (t >> 1) & 1);
        fetch(tk, kslot(t), bar(0, t), t + 2);
      }
      if (t + 1 < n) {                             // V of tile t + 1 where tile t - 1's was
        if (t >= 1) rlx_bar_wait(bar(3, t + 1), ((t - 1) >> 1) & 1);
        fetch(tv, vslot(t + 1), bar(1, t + 1), t + 1);
      }
    }
    __syncwarp();
    const i64 kt = kbeg + (i64)t * BN;
#if KEYMASK
    // the tile's mask as bits (every lane the same); a tile whose every key is kept is whole
    unsigned kw[BN / 32];
    bool kall = true;
#pragma unroll
    for (int i = 0; i < BN / 32; ++i) {
      kw[i] = __ballot_sync(0xffffffffu, kb[i]);
      kall = kall && kw[i] == 0xffffffffu;
    }
    if (t + 1 < n) key_load(t + 1);      // (in flight while this tile computes)
#else
    const bool kall = true;
#endif
    // WHOLE: every tile is whole (no mask or softcap, Sk a multiple of the tiles; query rows past
    // Sq are zeros, computed and never stored)
    const bool whole = WHOLE || ((MASKMODE == 0 || KEYMASK) && kall && !CAP && scale_d > 0.0 && kt + BN <= Sk &&
                                 (MASKKIND == 0 || (MASKKIND == 1 && kt + BN - 1 <= p0 + q0)));
    float mx[2] = {-RLX_INF, -RLX_INF};
#if !REWRITE
    unsigned kept[BN / 64];        // a cut tile's kept scores, a bit each
#endif
    if (whole) {
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], sc[nt][e]);
      mx[0] *= scale2;
      mx[1] *= scale2;
    } else {
#if !REWRITE
#pragma unroll
      for (int i = 0; i < BN / 64; ++i) kept[i] = 0u;
#endif
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int rsel = e >> 1;
          const i64 j = kt + nt * 8 + tg * 2 + (e & 1);
          bool keep = (j < Sk) && (qi[rsel] < Sq);
          RLX_KEEP(qp[rsel], j, keep);
#if REWRITE
          // written back into S (the accumulators of a wgmma: ptxas may serialize the wgmmas,
          // C7515), where a score changes or a mask is read (kept bits beside its loads spill)
#if MASKMODE == 1
          if (keep) keep = mask[b * m0 + h * m1 + qi[rsel] * m2 + j * m3] != 0;
#endif
          float x = sc[nt][e] * scale;
          if (CAP) x = tanhf(x / cap) * cap;
#if MASKMODE == 2
          if (keep) x = x + tof(mask[b * m0 + h * m1 + qi[rsel] * m2 + j * m3]);
#endif
          x = keep ? x * RLX_LOG2E : -RLX_INF;
          sc[nt][e] = x;
#else
          // S stays as the wgmma wrote it (no C7515); the exponentials below drop the cut scores
#if KEYMASK
          keep = keep && ((kw[nt >> 2] >> ((nt & 3) * 8 + tg * 2 + (e & 1))) & 1u);
#endif
          const float x = keep ? sc[nt][e] * scale2 : -RLX_INF;
          kept[(nt * 4 + e) >> 5] |= (unsigned)keep << ((nt * 4 + e) & 31);
#endif
          mx[rsel] = fmaxf(mx[rsel], x);
        }
    }
    const float sm = REWRITE && !whole ? 1.f : scale2;
    // as rlx_attn_tc: the running max moves only when a row's max grows past it by 2^8
    bool grow = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], SHFL_XOR(mx[r], 1));
      mx[r] = fmaxf(mx[r], SHFL_XOR(mx[r], 2));
      grow |= mx[r] > mrow[r] + 8.f;
    }
    if (__any_sync(0xffffffffu, grow)) {
      float alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float mn = fmaxf(mrow[r], mx[r]);
        alpha[r] = rlx_exp2(mrow[r] - ((mn > -RLX_INF) ? mn : 0.f));
        mrow[r] = mn;
        lrow[r] *= alpha[r];
      }
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        o[dt][0] *= alpha[0]; o[dt][1] *= alpha[0]; o[dt][2] *= alpha[1]; o[dt][3] *= alpha[1];
      }
    }
    // the next tile's S runs on the tensor cores from here (no other instruction may write
    // an accumulator of a wgmma in flight: O was rescaled above)
    rlx_wg_settle<D / 2>(&o[0][0]);
    if (t + 1 < n) qk(sn, t + 1);
    const float mu0 = mrow[0] > -RLX_INF ? mrow[0] : 0.f;
    const float mu1 = mrow[1] > -RLX_INF ? mrow[1] : 0.f;
    u32 pa[BN / 16][4];
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
      float p[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        p[e] = rlx_exp2(fmaf(sc[nt][e], sm, -(e < 2 ? mu0 : mu1)));
#if !REWRITE
        if (!whole && !((kept[(nt * 4 + e) >> 5] >> ((nt * 4 + e) & 31)) & 1u)) p[e] = 0.f;
#endif
        lrow[e >> 1] += p[e];
      }
      pa[nt >> 1][(nt & 1) * 2] = rlx_pack(p[0], p[1]);
      pa[nt >> 1][(nt & 1) * 2 + 1] = rlx_pack(p[2], p[3]);
    }
    rlx_bar_wait(bar(1, t), (t >> 1) & 1);
    const unsigned long long vd = rlx_desc(vslot(t), BN * 128, 1024);
    RLX_WG_FENCE();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) rlx_wg_pv(&o[0][0], pa[kk], vd + ((kk * 16 * 128) >> 4));
    RLX_WG_COMMIT();
    RLX_WG_WAIT0();                                  // this P V and the next tile's S
    rlx_wg_settle<D / 2>(&o[0][0]);
    rlx_wg_settle<BN / 2>(&sn[0][0]);
    if (t + 1 < n) rlx_bar_arrive(bar(2, t + 1));    // K of tile t + 1 and V of tile t are read
    rlx_bar_arrive(bar(3, t));
  }
};
extern "C" __global__ void __launch_bounds__(256, 1) rlx_attn_wg(
    const T* __restrict__ q, long long qsb, long long qsh, long long qss,
    const void* tk, const void* tv,
    const TM* __restrict__ mask, long long m0, long long m1, long long m2, long long m3,
    const TP* __restrict__ pos, T* __restrict__ out, long long osb, long long osh, long long oss,
    int B, int H, int KVH, int Sq, int Sk, double scale_d, double cap_d, int window) {
  extern __shared__ __align__(1024) unsigned char rlx_smem[];
  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2;
  const int h = blockIdx.y, b = blockIdx.z;
  rlx_wg_attn a;
  const unsigned Qs = ((unsigned)__cvta_generic_to_shared(rlx_smem) + 1023) & ~1023u;   // 1024-byte swizzle atoms
  a.KV0 = Qs + BM * D * 2;             // then two slots, each K and V of a tile
  a.bars = a.KV0 + 4 * BN * D * 2;     // then the 8 mbarriers
  a.qdesc = rlx_desc(Qs + wg * 64 * 128, 16, 1024);
  a.tk = tk; a.tv = tv;
  a.mask = mask; a.m0 = m0; a.m1 = m1; a.m2 = m2; a.m3 = m3;
  a.b = b; a.h = h; a.kvh = h / (H / KVH); a.tg = lane & 3; a.window = window; a.tid = tid;
  a.Sq = Sq; a.Sk = Sk;
  a.scale = (float)scale_d; a.cap = (float)cap_d; a.scale2 = a.scale * RLX_LOG2E;
  a.scale_d = scale_d; a.cap_d = cap_d;
  a.q0 = (i64)blockIdx.x * BM;
#if HAS_POS
  a.p0 = (i64)pos[b];
#else
  a.p0 = (i64)(Sk - Sq);
#endif
  const i64 qlast = min(a.q0 + BM, (i64)Sq) - 1;
  i64 kend = Sk, kbeg = 0;
  if (MASKKIND >= 1) kend = min((i64)Sk, a.p0 + qlast + 1);
  if (MASKKIND == 2) kbeg = max((i64)0, a.p0 + a.q0 - window + 1);
  a.kbeg = kbeg;
  a.n = kbeg < kend ? (int)((kend - kbeg + BN - 1) / BN) : 0;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) a.o[dt][0] = a.o[dt][1] = a.o[dt][2] = a.o[dt][3] = 0.f;
  rlx_wg_settle<D / 2>(&a.o[0][0]);   // zeroed before any wgmma is in flight
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    a.mrow[r] = -RLX_INF;
    a.lrow[r] = 0.f;
    a.qi[r] = a.q0 + wg * 64 + warp * 16 + g + 8 * r;
    a.qp[r] = a.p0 + a.qi[r];
  }
  // prologue: the barriers; Q by every thread's copies; K of tiles 0 and 1 and V of tile 0
  // by the copy engine; S of tile 0. A warpgroup whose rows all lie past Sq (the second of a
  // ViT's last tile: 257 tokens) helps copy Q and leaves; the slots' release counts the rest.
  const int stay = a.q0 + 64 < Sq ? 2 : 1;
  if (tid == 0) {
    for (int i = 0; i < 8; ++i) rlx_bar_init(a.bars + i * 8, i < 4 ? 1 : 128 * stay);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
#if KEYMASK
  if (a.n > 0 && wg < stay) a.key_load(0);
#endif
  if (tid == 0 && a.n > 0) {
    a.fetch(tk, a.kslot(0), a.bar(0, 0), 0);
    if (a.n > 1) a.fetch(tk, a.kslot(1), a.bar(0, 1), 1);
    a.fetch(tv, a.vslot(0), a.bar(1, 0), 0);
  }
  const rlx_wg_loader load(tid);
  load(Qs, q + b * qsb + h * qsh, qss, a.q0, Sq);
  RLX_CP_COMMIT();
  RLX_CP_WAIT(0);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  if (wg >= stay) return;
  float sa[BN / 8][4], sb[BN / 8][4];
  if (a.n > 0) {
    a.qk(sa, 0);
    RLX_WG_WAIT0();
    rlx_wg_settle<BN / 2>(&sa[0][0]);
    rlx_bar_arrive(a.bar(2, 0));
  }
  for (int t = 0; t < a.n; t += 2) {
    a.tile(t, sa, sb);
    if (t + 1 < a.n) a.tile(t + 1, sb, sa);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = a.lrow[r];
    l += SHFL_XOR(l, 1);
    l += SHFL_XOR(l, 2);
    if (a.qi[r] >= Sq) continue;
    const float inv = l == 0.f ? 0.f : 1.f / l;
    T* orow = out + b * osb + h * osh + a.qi[r] * oss;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *(u32*)(orow + dt * 8 + a.tg * 2) = rlx_pack(a.o[dt][2 * r] * inv, a.o[dt][2 * r + 1] * inv);
  }
}
