// Packed weights (GGUF / RLX int blocks): the decode GEMV and dequantize over any scheme. A
// kernel is common + the scheme's parts + qf + x4 / gemv or dequant (sources.dq_source).
// @part common(ACC, A)
// Packed (GGUF / RLX int block) weights, layouts in rlx_core/ir/quant.py. A row is K / BLK
// blocks of BPB bytes; each block is cut into PARTS parts, the unit one lane decodes: a part's
// bytes are loaded into registers (`rlx_raw`, `rlx_load`), then taken RUNS times as 4
// consecutive weights at element offset `rlx_run_off(p, k)` of the block, as a word of 4
// bytes b (`rlx_qword`) and a scale d and offset m (`rlx_scale`): weight = d * (b - BIAS) + m
// (m only where HAS_MIN); QXG consecutive runs share d, m and an int8 block of 32 of x, and
// each QXC of them are consecutive elements (the GEMV's QX). One snippet per format
// (DQ_SCHEMES) serves every kernel below.
// A byte becomes an exact float in two full-rate instructions (a byte permute into the
// mantissa of 2^23, a subtraction; no int-to-float conversion), and the GEMV factors d and m
// out of each 4-run's dot product (at one x row, out of each QXG runs' sum), so a weight costs
// about three instructions. W = ACC (f32, f64 for f64 data). A: the alignment (2..16 bytes) of
// the row base and row length, so loads are as wide as the offsets allow: `rlx_ldw<AL, N>` loads
// N 32-bit words at a byte offset aligned to AL within the row (2-aligned offsets in 4-aligned
// rows: aligned words + funnel shifts).
typedef ACC W;
typedef unsigned char u8;
typedef unsigned short u16;
struct rlx_tcs { float d[2], m[2]; };      // a TC view's two sub-blocks: weight = d (b - BIAS) + m
__device__ __forceinline__ W rlx_h2w(u32 h) { return (W)__half2float(__ushort_as_half((u16)(h & 0xffffu))); }
__device__ __forceinline__ int rlx_byte(u32 v, int i) { return (int)((v >> (8 * i)) & 255u); }
// bits 0..3 of h at bits 0, 8, 16, 24
__device__ __forceinline__ u32 rlx_spread4(u32 h) { return ((h & 15u) * 0x00204081u) & 0x01010101u; }
template <int AL, int N> __device__ __forceinline__ void rlx_ldw(const u8* p, u32* w) {
  constexpr int al = AL < A ? AL : A;
  if constexpr (al >= 16 && N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const uint4 v = __ldg((const uint4*)p + i);
      w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
    }
  } else if constexpr (al >= 8 && N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) { const uint2 v = __ldg((const uint2*)p + i); w[2 * i] = v.x; w[2 * i + 1] = v.y; }
  } else if constexpr (al >= 4) {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = __ldg((const u32*)p + i);
  } else if constexpr (A >= 4) {
    // a 2-aligned offset in a 4-aligned row: the aligned words around it, shifted; the extra
    // word lies inside the row (the row ends 4-aligned, the bytes asked for 2 bytes before)
    const u32* q = (const u32*)((size_t)p & ~(size_t)3);
    const int sh = (int)((size_t)p & 2) * 8;
    u32 lo = __ldg(q);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const u32 hi = (i + 1 < N || sh) ? __ldg(q + i + 1) : 0u;
      w[i] = __funnelshift_r(lo, hi, sh);
      lo = hi;
    }
  } else {
    const u16* q = (const u16*)p;
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = (u32)__ldg(q + 2 * i) | ((u32)__ldg(q + 2 * i + 1) << 16);
  }
}
// @part qf()
// after a snippet: byte i of a q-word as the exact float (b - BIAS)
__device__ __forceinline__ float rlx_qf(u32 qw, int i) {
  return __int_as_float(__byte_perm(qw, 0x4B00u, 0x5440u | (u32)i)) - (8388608.0f + (float)BIAS);
}
// The GEMVs' form of a run, decoded once for every x row it meets: weight i = d * qf[i] + mn
// (a fold of the subtraction into the offset term was measured slower: benchmarks/README.md).
struct rlx_drun { W d, mn, qf[4]; };
__device__ __forceinline__ rlx_drun rlx_decode_run(const rlx_raw& q, int p, int k) {
  rlx_drun r;
  r.mn = 0;
  rlx_scale(q, p, k, &r.d, &r.mn);
  const u32 qw = rlx_qword(q, p, k);
#pragma unroll
  for (int i = 0; i < 4; ++i) r.qf[i] = (W)rlx_qf(qw, i);
  return r;
}
// a decoded run dotted with 4 x values (xs: their sum, read where HAS_MIN)
__device__ __forceinline__ W rlx_run_dot(const rlx_drun& r, const W* xv, W xs) {
  const W s = r.qf[0] * xv[0] + r.qf[1] * xv[1] + r.qf[2] * xv[2] + r.qf[3] * xv[3];
  return HAS_MIN ? r.d * s + r.mn * xs : r.d * s;
}
__device__ __forceinline__ W rlx_sum4(const W* v) { return (v[0] + v[1]) + (v[2] + v[3]); }
// @part nib()
// Legacy GGUF formats: a part is 8 bytes of nibbles (16 weights: 4-runs at 8p, 8p+4 from the
// low nibbles, 16 further on from the high ones) or 16 int8 bytes (q8_0).
#define BLK 32
#define PARTS 2
#define RUNS 4
#define QXG 4
#define QXC 2
__device__ __forceinline__ int rlx_run_off(int p, int k) { return 8 * p + 4 * (k & 1) + 16 * (k >> 1); }
__device__ __forceinline__ u32 rlx_nibs(const u32* q, int k) { return (q[k & 1] >> (4 * (k >> 1))) & 0x0F0F0F0Fu; }
// @part q4_0()
#define BPB 18
#define BIAS 8
#define HAS_MIN 0
struct rlx_raw { u32 q[2]; u32 d; };
__device__ __forceinline__ rlx_raw rlx_load(const u8* b, int p) {
  rlx_raw r; r.d = __ldg((const u16*)b); rlx_ldw<2, 2>(b + 2 + 8 * p, r.q); return r;
}
__device__ __forceinline__ u32 rlx_qword(const rlx_raw& r, int p, int k) { return rlx_nibs(r.q, k); }
__device__ __forceinline__ void rlx_scale(const rlx_raw& r, int p, int k, W* d, W* m) { *d = rlx_h2w(r.d); }
// @part q4_1()
#define BPB 20
#define BIAS 0
#define HAS_MIN 1
struct rlx_raw { u32 q[2]; u32 dm; };
__device__ __forceinline__ rlx_raw rlx_load(const u8* b, int p) {
  rlx_raw r; rlx_ldw<4, 1>(b, &r.dm); rlx_ldw<4, 2>(b + 4 + 8 * p, r.q); return r;
}
__device__ __forceinline__ u32 rlx_qword(const rlx_raw& r, int p, int k) { return rlx_nibs(r.q, k); }
__device__ __forceinline__ void rlx_scale(const rlx_raw& r, int p, int k, W* d, W* m) {
  *d = rlx_h2w(r.dm); *m = rlx_h2w(r.dm >> 16);
}
// @part q5_0()
#define BPB 22
#define BIAS 16
#define HAS_MIN 0
struct rlx_raw { u32 q[2]; u32 qh; u32 d; };
__device__ __forceinline__ rlx_raw rlx_load(const u8* b, int p) {
  rlx_raw r; r.d = __ldg((const u16*)b); rlx_ldw<2, 1>(b + 2, &r.qh); rlx_ldw<2, 2>(b + 6 + 8 * p, r.q); return r;
}
__device__ __forceinline__ u32 rlx_qword(const rlx_raw& r, int p, int k) {
  return rlx_nibs(r.q, k) | (rlx_spread4(r.qh >> rlx_run_off(p, k)) << 4);
}
__device__ __forceinline__ void rlx_scale(const rlx_raw& r, int p, int k, W* d, W* m) { *d = rlx_h2w(r.d); }
// @part q5_1()
#define BPB 24
#define BIAS 0
#define HAS_MIN 1
struct rlx_raw { u32 q[2]; u32 qh; u32 dm; };
__device__ __forceinline__ rlx_raw rlx_load(const u8* b, int p) {
  rlx_raw r; rlx_ldw<4, 1>(b, &r.dm); rlx_ldw<4, 1>(b + 4, &r.qh); rlx_ldw<8, 2>(b + 8 + 8 * p, r.q); return r;
}
__device__ __forceinline__ u32 rlx_qword(const rlx_raw& r, int p, int k) {
  return rlx_nibs(r.q, k) | (rlx_spread4(r.qh >> rlx_run_off(p, k)) << 4);
}
__device__ __forceinline__ void rlx_scale(const rlx_raw& r, int p, int k, W* d, W* m) {
  *d = rlx_h2w(r.dm); *m = rlx_h2w(r.dm >> 16);
}
// @part q8_0()
#define BLK 32
#define BPB 34
#define PARTS 2
#define RUNS 4
#define QXG 4
#define QXC 4
#define BIAS 128
#define HAS_MIN 0
struct rlx_raw { u32 q[4]; u32 d; };
__device__ __forceinline__ int rlx_run_off(int p, int k) { return 16 * p + 4 * k; }
__device__ __forceinline__ rlx_raw rlx_load(const u8* b, int p) {
  rlx_raw r; r.d = __ldg((const u16*)b); rlx_ldw<2, 4>(b + 2 + 16 * p, r.q); return r;
}
__device__ __forceinline__ u32 rlx_qword(const rlx_raw& r, int p, int k) { return r.q[k] ^ 0x80808080u; }
__device__ __forceinline__ void rlx_scale(const rlx_raw& r, int p, int k, W* d, W* m) { *d = rlx_h2w(r.d); }
// @part int8(IB)
// RLX int blocks of IB weights: f32 scale, then int8 values (int8) or q4_0-style nibbles (int4)
#define BLK IB
#define BPB (4 + IB)
#define PARTS (IB / 8)
#define RUNS 2
#define QXG 2
#define QXC 2
#define BIAS 128
#define HAS_MIN 0
struct rlx_raw { u32 q[2]; u32 d; };
__device__ __forceinline__ int rlx_run_off(int p, int k) { return 8 * p + 4 * k; }
__device__ __forceinline__ rlx_raw rlx_load(const u8* b, int p) {
  rlx_raw r; rlx_ldw<4, 1>(b, &r.d); rlx_ldw<4, 2>(b + 4 + 8 * p, r.q); return r;
}
__device__ __forceinline__ u32 rlx_qword(const rlx_raw& r, int p, int k) { return r.q[k] ^ 0x80808080u; }
__device__ __forceinline__ void rlx_scale(const rlx_raw& r, int p, int k, W* d, W* m) { *d = (W)__uint_as_float(r.d); }
// @part int4(IB)
#define BLK IB
#define BPB (4 + IB / 2)
#define PARTS (IB / 8)
#define RUNS 2
#define QXG (1 + ((IB) <= 32))
#define QXC 1
#define BIAS 8
#define HAS_MIN 0
struct rlx_raw { u32 q; u32 d; };
__device__ __forceinline__ int rlx_run_off(int p, int k) { return 4 * p + k * (IB / 2); }
__device__ __forceinline__ rlx_raw rlx_load(const u8* b, int p) {
  rlx_raw r; rlx_ldw<4, 1>(b, &r.d); rlx_ldw<4, 1>(b + 4 + 4 * p, &r.q); return r;
}
__device__ __forceinline__ u32 rlx_qword(const rlx_raw& r, int p, int k) { return (r.q >> (4 * k)) & 0x0F0F0F0Fu; }
__device__ __forceinline__ void rlx_scale(const rlx_raw& r, int p, int k, W* d, W* m) { *d = (W)__uint_as_float(r.d); }
// @part k45()
// K-quants, super-blocks of 256. Q4_K/Q5_K: part p = half (p & 1) of 64-element chunk p >> 1:
// 16 nibble bytes whose low nibbles are 16 weights of sub-block 2c, high ones of 2c + 1 (runs
// 0-3 and 4-7); the 16-byte header (d, dmin, six-bit scales) comes along.
#define BLK 256
#define PARTS 8
#define RUNS 8
#define QXG 4
#define QXC 4
#define BIAS 0
#define HAS_MIN 1
__device__ __forceinline__ int rlx_run_off(int p, int k) { return 64 * (p >> 1) + 16 * (p & 1) + 4 * (k & 3) + 32 * (k >> 2); }
// the part's two sub-blocks 2c, 2c+1 (c = p >> 1): llama.cpp get_scale_min_k4 over the 12
// scale bytes (header words 1..3), four sub-blocks at a time, decoded once per part:
// weight = (d * sc) * q - dmin * mn
__device__ __forceinline__ void rlx_k_scales(rlx_raw& r, const u32* hd, int p) {
  const int c = p >> 1, sh = 16 * (c & 1);            // byte 2c & 3 of the words
  const u32 sc = c < 2 ? hd[1] & 0x3F3F3F3Fu : (hd[3] & 0x0F0F0F0Fu) | ((hd[1] >> 2) & 0x30303030u);
  const u32 mn = c < 2 ? hd[2] & 0x3F3F3F3Fu : ((hd[3] >> 4) & 0x0F0F0F0Fu) | ((hd[2] >> 2) & 0x30303030u);
  const W d = rlx_h2w(hd[0]), dmin = rlx_h2w(hd[0] >> 16);
  r.d[0] = d * (W)((sc >> sh) & 255u); r.d[1] = d * (W)((sc >> (sh + 8)) & 255u);
  r.m[0] = -(dmin * (W)((mn >> sh) & 255u)); r.m[1] = -(dmin * (W)((mn >> (sh + 8)) & 255u));
}
__device__ __forceinline__ void rlx_scale(const rlx_raw& r, int p, int k, W* d, W* m) {
  *d = r.d[k >> 2]; *m = r.m[k >> 2];
}
// @part q4_k_raw()
// Q4_K: this, then k45, then q4_k; Q5_K likewise
#define BPB 144
struct rlx_raw { u32 q[4]; W d[2]; W m[2]; };
// @part q4_k()
__device__ __forceinline__ rlx_raw rlx_load(const u8* b, int p) {
  rlx_raw r; u32 hd[4]; rlx_ldw<16, 4>(b, hd); rlx_ldw<16, 4>(b + 16 + 16 * p, r.q); rlx_k_scales(r, hd, p); return r;
}
__device__ __forceinline__ u32 rlx_qword(const rlx_raw& r, int p, int k) {
  return (r.q[k & 3] >> (4 * (k >> 2))) & 0x0F0F0F0Fu;
}
// @part tc_q4_k()
// Q4_K as the tensor-core GEMV (TC in gemv) takes it: TCG groups of 8 sub-blocks a super-block,
// each sub-block's pairs taken by TCM = 16 / TCG mmas. Lane t's unit is chunk t of a super-block
// of one row, its 32 nibble bytes (low nibbles: sub-block 2t, high: 2t + 1) and the 16-byte
// header. mma i takes, of word i / 2, bytes h and h + 2 (h = i % 2): their low nibbles are the
// lane's k pair (2t, 2t + 1), elements (4(i / 2) + h, +2) of sub-block 2t, their high nibbles
// its pair (2t + 8, 2t + 9), the same elements of 2t + 1. A pair is two bf16 128 + b: one masked
// or of the shifted word (the byte in 128.0's mantissa).
#define TCG 1
struct rlx_tcraw { u32 hd[4]; u32 q[8]; };
__device__ __forceinline__ rlx_tcraw rlx_tc_load(const u8* b, int g, int t) {
  rlx_tcraw r; rlx_ldw<16, 4>(b, r.hd); rlx_ldw<16, 8>(b + 16 + 32 * t, r.q); return r;
}
__device__ __forceinline__ u32 rlx_tc_pair(const rlx_tcraw& r, int t, int i, int hi) {
  return ((r.q[i >> 1] >> (8 * (i & 1) + 4 * hi)) & 0x000F000Fu) | 0x43004300u;
}
// d * scale and -dmin * min of sub-blocks 2t, 2t + 1 (rlx_k_scales of part 2t)
__device__ __forceinline__ rlx_tcs rlx_tc_scales(const rlx_tcraw& r, int t) {
  rlx_raw k; rlx_k_scales(k, r.hd, 2 * t);
  return {{k.d[0], k.d[1]}, {k.m[0], k.m[1]}};
}
// @part tc_q6_k()
// Q6_K for TC: a super-block is two groups (its halves n) of 8 sub-blocks of 16. In half n,
// lane t takes quarter t: the 32 bytes ql[64n + 32(t % 2) + l] (low nibbles for t < 2, high ones
// for t >= 2) and bits 2t, 2t + 1 of qh[32n + l], l < 32; sub-block 2t is its l < 16 (words
// 0-3), 2t + 1 its l >= 16 (words 4-7). mma i takes bytes h, h + 2 of word i / 2 (the low pair)
// and of word 4 + i / 2 (the high pair), as Q4_K's view does.
#define TCG 2
struct rlx_tcraw { u32 ql[8]; u32 qh[8]; u32 sc; u32 d; };
__device__ __forceinline__ rlx_tcraw rlx_tc_load(const u8* b, int n, int t) {
  rlx_tcraw r;
  rlx_ldw<2, 8>(b + 64 * n + 32 * (t & 1), r.ql); rlx_ldw<2, 8>(b + 128 + 32 * n, r.qh);
  r.sc = __ldg((const u16*)(b + 192 + 8 * n + 2 * t)); r.d = __ldg((const u16*)(b + 208));
  return r;
}
__device__ __forceinline__ u32 rlx_tc_pair(const rlx_tcraw& r, int t, int i, int hi) {
  const int j = (i >> 1) + 4 * hi, sh = 8 * (i & 1);
  return ((r.ql[j] >> (sh + 4 * (t >> 1))) & 0x000F000Fu) | (((r.qh[j] >> (sh + 2 * t)) & 0x00030003u) << 4) |
         0x43004300u;
}
__device__ __forceinline__ rlx_tcs rlx_tc_scales(const rlx_tcraw& r, int t) {
  const float d = rlx_h2w(r.d);
  return {{d * (float)(signed char)(r.sc & 255u), d * (float)(signed char)(r.sc >> 8)}, {0.f, 0.f}};
}
// @part q5_k_raw()
#define BPB 176
struct rlx_raw { u32 qh[4]; u32 q[4]; W d[2]; W m[2]; };
// @part q5_k()
__device__ __forceinline__ rlx_raw rlx_load(const u8* b, int p) {
  rlx_raw r; u32 hd[4]; rlx_ldw<16, 4>(b, hd); rlx_ldw<16, 4>(b + 16 + 16 * (p & 1), r.qh);
  rlx_ldw<16, 4>(b + 48 + 16 * p, r.q); rlx_k_scales(r, hd, p); return r;
}
__device__ __forceinline__ u32 rlx_qword(const rlx_raw& r, int p, int k) {
  const int j = 2 * (p >> 1) + (k >> 2);        // sub-block: bit j of each qh byte
  return ((r.q[k & 3] >> (4 * (k >> 2))) & 0x0F0F0F0Fu) | (((r.qh[k & 3] >> j) & 0x01010101u) << 4);
}
// @part q6_k()
// Q6_K: part p = 8 lanes l in [8j, 8j + 8) (j = p & 3) of half n = p >> 2; quarter t of the
// half takes low (t < 2) or high nibbles of ql[64n + l] (t even) / ql[64n + 32 + l] (t odd)
// and bits 2t, 2t+1 of qh[32n + l]; runs k = 2t + (4-run within the 8 lanes).
#define BLK 256
#define BPB 210
#define PARTS 8
#define RUNS 8
#define QXG 2
#define QXC 2
#define BIAS 32
#define HAS_MIN 0
struct rlx_raw { u32 a[2]; u32 b[2]; u32 h[2]; W d[4]; };
__device__ __forceinline__ int rlx_run_off(int p, int k) { return 128 * (p >> 2) + 32 * (k >> 1) + 8 * (p & 3) + 4 * (k & 1); }
__device__ __forceinline__ rlx_raw rlx_load(const u8* b, int p) {
  const int n = p >> 2, j = p & 3;
  rlx_raw r;
  rlx_ldw<2, 2>(b + 64 * n + 8 * j, r.a); rlx_ldw<2, 2>(b + 64 * n + 32 + 8 * j, r.b);
  u32 s[2];
  rlx_ldw<2, 2>(b + 128 + 32 * n + 8 * j, r.h); rlx_ldw<2, 2>(b + 192 + 8 * n, s);
  const W d = rlx_h2w(__ldg((const u16*)(b + 208)));
  const u32 sw = (j >> 1) ? __funnelshift_r(s[0], s[1], 8) : s[0];   // scales j>>1 + 2t, t = 0..3
#pragma unroll
  for (int t = 0; t < 4; ++t) r.d[t] = d * (W)(signed char)rlx_byte(t < 2 ? sw : (j >> 1) ? s[1] >> 8 : s[1], 2 * (t & 1));
  return r;
}
__device__ __forceinline__ u32 rlx_qword(const rlx_raw& r, int p, int k) {
  const int t = k >> 1, half = k & 1;
  const u32 lo = (t & 1) ? r.b[half] : r.a[half];
  return ((lo >> (4 * (t >> 1))) & 0x0F0F0F0Fu) | (((r.h[half] >> (2 * t)) & 0x03030303u) << 4);
}
__device__ __forceinline__ void rlx_scale(const rlx_raw& r, int p, int k, W* d, W* m) { *d = r.d[k >> 1]; }
// @part x4(T, XV)
// 4 consecutive x values as W (one vector load where XV says x rows and offsets allow it)
struct alignas(4 * sizeof(T)) rlx_x4t { T v[4]; };
__device__ __forceinline__ void rlx_x4(const T* p, W* o) {
#if XV
  const rlx_x4t t = *(const rlx_x4t*)p;
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = LD(W, t.v[i]);
#else
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = LD(W, p[i]);
#endif
}
// @part q8x(TO)
// int8 activations (`[precision] activations = "int8"`: a packed matmul's x arrives through a
// fake_quantize to int8_b32): eight lanes hold a block of 32 values, four each (lanes 8i..8i+7;
// all 32 lanes call together), rounded as rlx_core.ir.quant's int8_b32 does: d = amax / 127 over
// the block, q = x * (1 / d) rounded half away from zero. -> the lane's four q as the bytes of a
// word; *d NaN where the block holds NaN or inf (the reference's whole block comes out NaN).
__device__ __forceinline__ u32 rlx_q8_lanes(const W* v, float* d) {
  float a = 0.f;
  int bad = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) { a = fmaxf(a, fabsf((float)v[i])); bad |= !isfinite((float)v[i]); }
#pragma unroll
  for (int s = 4; s; s >>= 1) {
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, s));
    bad |= __shfl_xor_sync(0xffffffffu, bad, s);
  }
  const float dd = a / 127.f, inv = dd != 0.f ? 1.f / dd : 0.f;
  u32 word = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    word |= ((u32)(int)fminf(fmaxf(roundf((float)v[i] * inv), -127.f), 127.f) & 255u) << (8 * i);
  *d = bad ? __int_as_float(0x7fc00000) : dd;
  return word;
}
// x's M rows of K (row stride xrs; 32 divides K) rounded to int8_b32 blocks, eight lanes a block,
// four blocks a warp (the loop bound is the warp's, as rlx_q8_lanes needs), the blocks shared
// out over `blocks` thread blocks of which this is `block`. INT8: into out's int8 rows [M][K],
// then their scales [M][K / 32] (the int8 GEMVs' x: gemv's QX); else the rounded values
// themselves, out [M][K] of TO. den: each row's divisor of its scales, or null.
template <bool INT8>
__device__ __forceinline__ void rlx_round_rows(const T* x, i64 xrs, i64 M, int K, void* out, const float* den,
                                               int blocks, int block) {
  const int lane = threadIdx.x & 31, nbx = K / 32;
  const i64 total = M * nbx;
  for (i64 g0 = ((i64)block * (blockDim.x >> 5) + (threadIdx.x >> 5)) * 4; g0 < total;
       g0 += (i64)blocks * (blockDim.x >> 5) * 4) {
    const i64 g = min(g0 + (lane >> 3), total - 1), m = g / nbx, o = 32 * (g - m * nbx) + 4 * (lane & 7);
    W v[4];
    rlx_x4(x + m * xrs + o, v);
    float d;
    const u32 word = rlx_q8_lanes(v, &d);
    if (den) d /= den[m];
    if (g0 + (lane >> 3) >= total) continue;
    if (INT8) {
      *(u32*)((unsigned char*)out + m * K + o) = word;
      if ((lane & 7) == 0) ((float*)((unsigned char*)out + M * K))[g] = d;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) ((TO*)out)[m * K + o + i] = ST(TO, d * (float)(signed char)(word >> (8 * i)));
    }
  }
}
// @part round_q8(TO, NORM)
// y = x rounded through int8_b32 blocks and back (the fake_quantize of int8 activations whose
// readers are no int8 GEMVs): `blocks` contiguous blocks of 32, taken as rows of 32.
extern "C" __global__ void __launch_bounds__(256) rlx_fake_q8(const T* __restrict__ x, TO* __restrict__ y,
    long long blocks) {
  rlx_round_rows<false>(x, 32, blocks, 32, y, nullptr, gridDim.x, blockIdx.x);
}
// x's M rows rounded into y8 for the int8 GEMVs. NORM: x holds x0 * (nw + noff) of a residual norm
// whose row sums of squares of x0 nsq holds (32 parts a row, as the NORM GEMVs read them): a
// block's q are those of x0 * (nw + noff) and its scale is divided by the row's norm, so y8 is
// the norm's y rounded; block 0 zeroes `zero` (zn floats) as a NORM GEMV does (ops.GemvSums).
extern "C" __global__ void __launch_bounds__(256) rlx_quant_q8(const T* __restrict__ x, long long xrs, int M,
    int K, unsigned char* __restrict__ y8, const float* nsq, float eps, float* zero, int zn) {
#if NORM
  __shared__ float den[8];                 // each row's norm (M <= 8: the decode GEMVs' rows)
  const int lane = threadIdx.x & 31;
  if (threadIdx.x < 32) {
    for (int m = 0; m < M; ++m) {
      const float dm = rlx_norm_den(LDCG(nsq + m * 32 + lane), K, eps);
      if (lane == 0) den[m] = dm;
    }
    if (blockIdx.x == 0)
      for (int j = lane; j < zn; j += 32) zero[j] = 0.f;
  }
  __syncthreads();
  rlx_round_rows<true>(x, xrs, M, K, y8, den, gridDim.x, blockIdx.x);
#else
  rlx_round_rows<true>(x, xrs, M, K, y8, nullptr, gridDim.x, blockIdx.x);
#endif
}
// @part gemv(T, TB, TO, KW, SWIGLU, R, U, MMAX, EPILOGUE, SWIGLU_OF(g, u), EARLY, NORM, TN, RESID, QX, Q8, TC)
// Decode: y[M, N] = act(x[M, K] @ dequant(w)^T + bias) for M <= MMAX <= 8. A block is 8
// warps: KW of them split a row's parts, 8 / KW take R rows each, so x is read once per
// R rows. Each lane loads its next U parts of every row first (the packed bytes bound a
// decode step), then decodes them in registers. Partial sums meet in shared memory; the
// epilogue rounds like the unfused ops (to TO, + bias, round, activation). SWIGLU: w is
// [2N, K] (gate rows, then up rows); a warp's first R/2 rows are gate rows, the others the
// up rows of the same outputs, and y[M, N] = SWIGLU_OF(gate, up) (the expression table's
// fused_swiglu), each rounded to TO first.
// NORM and RESID: the residual RMSNorms between decode GEMVs, as in gemv.cu's rlx_gemv (the
// same arguments and sums; ops.GemvNorm, ops.GemvSums): NORM divides each warp's sums by the row's
// norm from nsq (x holds x0 * (nw + noff)); RESID writes y = res + the rounded product, yw = y *
// (nw + noff), and adds the squares of y's rows into osq (one atomic a warp and row).
// QX (int8 activations: x arrives through a fake_quantize to int8_b32; ops.py's `_int8_x`): x
// points at quant_q8's y8 (the rows' q, then their scales), which the block copies into dynamic
// shared memory once its weight loads are in flight (QX 2: x holds the float rows, which each
// block rounds into that shared memory itself: no quant_q8 launch before a small x); each
// run's 4 weight bytes b times 4 x bytes is one dp4a (of b - 128: signed by signed; the sum of
// x's bytes times 128 - BIAS added back), a group of QXG runs (one weight scale, one x block)
// scaled once: about one instruction a weight where the float form takes three (the q4_k GEMVs
// were bound by instructions, not bytes). A large x is rounded once per product, not in each
// block: by instruction counts that would cost more than the products (a block of the down
// projection has 4 rows of 8192 weights, x 8192 values; not measured); ops.QX_ROUND_MAX bounds
// the x a block rounds (QX 2).
// Q8 (the product's reader is a fake_quantize for QX GEMVs; ops.py's `_q8_reader`): the outputs
// are also rounded into those GEMVs' int8 rows y8 here, so no quant_q8 launch sits between the
// two GEMVs. The last block to finish a group of 32 outputs of a row rounds it (a counter a
// group where a block has fewer than 32 outputs); RESID rounds yw, and the last block of all
// then divides the scales by the rows' norms (every block's squares are in osq by then) and
// zeroes the sums the NORM GEMV before read: the bytes quant_q8 with NORM writes.
// TC (one bf16 x row, a scheme with a view dq.cu:tc_*; ops.DQ_TC, off: slower as measured): the
// products on tensor cores, 16 rows a warp, each block's copy of x in shared memory (below).
#if SWIGLU && RESID
#error "rlx_dq_gemv: RESID takes no SWIGLU"
#endif
#if QX
// N words of int8 x at p (4N-aligned) in one shared-memory load: the lanes' loads of single
// words conflicted in the banks (their parts lie 64 words apart)
template <int N> __device__ __forceinline__ void rlx_xwords(const signed char* p, int* o) {
  if constexpr (N == 4) {
    const int4 v = *(const int4*)p; o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
  } else if constexpr (N == 2) {
    const int2 v = *(const int2*)p; o[0] = v.x; o[1] = v.y;
  } else {
    o[0] = *(const int*)p;
  }
}
#endif
#if Q8
// Q8's rounding, after a block's outputs (PB of each row, from column blockIdx.x * PB) are written
template <int PB> __device__ __forceinline__ void rlx_q8_out(const TO* src, int M, int N, unsigned char* y8,
    int* cnt, const float* osq, float eps, float* zero, int zn) {
  constexpr int BPG = PB >= 32 ? 1 : 32 / PB, GB = PB >= 32 ? PB / 32 : 1;   // blocks a group, groups a block
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, ng = N / 32;
  const int g0 = blockIdx.x * PB / 32, mine = min(GB, ng - g0), n = M * mine;
  __shared__ int q8_go;
  __syncthreads();                                  // (the block's outputs and squares written)
  if (threadIdx.x == 0) {
    q8_go = 1;
    if (BPG > 1) {
      __threadfence();
      q8_go = atomicAdd(cnt + g0, 1) == BPG - 1;
      if (q8_go) cnt[g0] = 0;                          // (every block of the group has counted)
    }
  }
  __syncthreads();
  if (!q8_go) return;
  __threadfence();
  signed char* q = (signed char*)y8;
  float* sc = (float*)(y8 + (i64)M * N);
  for (int g = warp * 4; g < n; g += (int)(blockDim.x >> 3)) {    // four groups a warp, eight lanes each
    const int gi = min(g + (lane >> 3), n - 1), m = gi / mine, grp = g0 + gi % mine;
    const i64 o = (i64)m * N + 32 * grp + 4 * (lane & 7);
    W v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = LD(W, LDCG(src + o + i));
    float d;
    const u32 word = rlx_q8_lanes(v, &d);
    if (g + (lane >> 3) < n) {
      *(u32*)(q + o) = word;
      if ((lane & 7) == 0) sc[m * ng + grp] = d;
    }
  }
#if RESID
  __shared__ int q8_all;
  __shared__ float q8_den[MMAX];
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    q8_all = atomicAdd(cnt + ng, n) + n == M * ng;
    if (q8_all) cnt[ng] = 0;
  }
  __syncthreads();
  if (!q8_all) return;
  __threadfence();
  if (warp == 0) {
    for (int m = 0; m < M; ++m) {
      const float dm = rlx_norm_den(LDCG(osq + m * 32 + lane), N, eps);
      if (lane == 0) q8_den[m] = dm;
    }
    for (int j = lane; j < zn; j += 32) zero[j] = 0.f;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < M * ng; i += blockDim.x) sc[i] = LDCG(sc + i) / q8_den[i / ng];
#endif
}
#endif
// the float form at one x row: at most 64 registers a thread, 4 blocks an SM (summing a group's
// products before scaling them took the q4_k SwiGLU form to 75, 3 blocks); the others take what
// they need
#define RLX_DQ_MIN_BLOCKS (MMAX == 1 && !QX && !TC ? 4 : 0)
extern "C" __global__ void __launch_bounds__(256, RLX_DQ_MIN_BLOCKS) rlx_dq_gemv(const T* __restrict__ x,
    long long xrs, const u8* __restrict__ w, long long wrs, const TB* __restrict__ bias, TO* __restrict__ y,
    int M, int N, int nb, unsigned char* __restrict__ y8, int* q8cnt, float eps, const float* nsq,
    const TN* __restrict__ nw, float noff, const TO* __restrict__ res, long long rrs, TO* __restrict__ yw,
    float* osq, float* zero, int zn) {
  constexpr int RW = 8 / KW, OUTR = SWIGLU ? R / 2 : R;     // outputs per warp
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kw = warp % KW, rw = warp / KW;
  const int n0 = (blockIdx.x * RW + rw) * OUTR;
  // the block's output t (of RW * OUTR * MMAX): its warp group g, their row r, x's row m; returns n
  const auto out_at = [&](int t, int& g, int& r, int& m) {
    g = t / (OUTR * MMAX), r = (t / MMAX) % OUTR, m = t % MMAX;
    return (blockIdx.x * RW + g) * OUTR + r;
  };
#if TC
  // the mma's rows: lane tg + 4 tt holds rows tg and tg + 8 of the warp's 16, its part tt of each
  // group; a warp's unit is one group (TCG a super-block) of its rows (the next loaded while
  // this one's products run: `cur` then `nxt`)
  static_assert(R == 16 && MMAX == 1 && !QX, "TC: 16 rows a warp, one bf16 x row");
  constexpr int TCM = 16 / TCG;                 // mmas a group, pairs a sub-block
  const int tg = lane >> 2, tt = lane & 3, first = kw, units = nb * TCG;
  const u8* wt[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int r = tg + 8 * j;
    wt[j] = w + (i64)(min(n0 + r % OUTR, N - 1) + (r / OUTR) * N) * wrs;
  }
  rlx_tcraw cur[2], nxt[2];
#define RLX_TC_LOAD(dst, u) \
  if ((u) < units) \
    _Pragma("unroll") for (int j = 0; j < 2; ++j) dst[j] = rlx_tc_load(wt[j] + (i64)((u) / TCG) * BPB, (u) % TCG, tt);
#define RLX_LOAD_Q(sb) RLX_TC_LOAD(cur, sb)
#else
  const u8* wr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) wr[r] = w + (i64)(min(n0 + r % OUTR, N - 1) + (r / OUTR) * N) * wrs;
  const int units = nb * PARTS, first = kw * 32 + lane;
  rlx_raw q[U][R];
#define RLX_LOAD_Q(u0) \
  _Pragma("unroll") for (int u = 0; u < U; ++u) { \
    const int uu = (u0) + 32 * KW * u; \
    if (uu < units) \
      _Pragma("unroll") for (int r = 0; r < R; ++r) q[u][r] = rlx_load(wr[r] + (i64)(uu / PARTS) * BPB, uu % PARTS); \
  }
#endif
  // EARLY (w a param or constant: no kernel writes it): the first iteration's loads are issued
  // before the wait (as in GEMV). q4_k 1B-shape decode on the H100: 0.940 -> 0.896 ms/token;
  // an L2 prefetch of each row's first 4 KB beside them made no difference (0.903); a grid of
  // 2-3 blocks an SM looping over groups of rows, the next group's loads in flight (registers
  // or L2) during this group's products, was slower (0.675 -> 0.80, 0.78: benchmarks/README.md)
#if EARLY
  RLX_LOAD_Q(first)
#endif
  RLX_GRID_WAIT();
#if !EARLY
  RLX_LOAD_Q(first)
#endif
#if NORM
  float sq[MMAX];
  rlx_norm_sums(sq, nsq, M, lane, blockIdx.x == 0 && warp == 0, zero, zn);
#endif
#if RESID
  // this thread's output's residual and norm weight (the store below), loaded now (as in GEMV)
  static_assert(RW * OUTR * MMAX <= 256, "RESID: one output a thread");
  W rv = 0;
  float nwv = 0.f;
  {
    int g, r, m;
    const int t = threadIdx.x, n = out_at(t, g, r, m);
    if (t < RW * OUTR * MMAX && m < M && n < N) {
      rv = LD(W, res[m * rrs + n]);
      nwv = tof(nw[n]) + noff;
    }
  }
#endif
#if QX
  extern __shared__ __align__(16) unsigned char rlx_qx[];
  const int K = nb * BLK, nbx = K / 32;
#if QX == 2
  rlx_round_rows<true>(x, xrs, M, K, rlx_qx, nullptr, 1, 0);
#else
  for (int i = threadIdx.x; i < M * (K + nbx * 4) / 4; i += blockDim.x)
    ((u32*)rlx_qx)[i] = __ldg((const u32*)(const void*)x + i);
#endif
  const signed char* xq = (const signed char*)rlx_qx;
  const float* xd = (const float*)(rlx_qx + (i64)M * K);
  __syncthreads();
#endif
#if TC
  // x in the order of the mmas' B pairs (sub-block s's pair i: its elements (4(i / 2) + i % 2, +2)),
  // and each sub-block's sum, in dynamic shared memory
  extern __shared__ __align__(16) unsigned char rlx_qx[];
  const int K = nb * BLK;
  u32* xf = (u32*)rlx_qx;
  float* xsum = (float*)(xf + K / 2);
  for (int i = threadIdx.x; i < K / 2; i += blockDim.x) {      // (whole warps: 128 divides K / 2)
    const T* p = x + (i / TCM) * 2 * TCM + 4 * ((i % TCM) >> 1) + (i & 1);
    xf[i] = (u32)*(const u16*)p | ((u32)*(const u16*)(p + 2) << 16);      // (bf16 bits)
    float a = tof(p[0]) + tof(p[2]);
#pragma unroll
    for (int o = TCM / 2; o; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);   // the sub-block's lanes
    if (i % TCM == 0) xsum[i / TCM] = a;
  }
  __syncthreads();
  // Column n of an mma's D is sub-block n of the group: lane (n, tt) gives B its x pair where n
  // is 2 tt (the low pair, b0) or 2 tt + 1 (the high, b1), every other B value is 0; so D holds
  // the 8 sub-blocks' sums of (128 + b) x apart, and lane tt scales its two (columns 2 tt,
  // 2 tt + 1): w = d (b - BIAS) + m = d (128 + b) + (m - d (128 + BIAS)).
  const int role = tg - 2 * tt;                 // 0: the low pairs' lane, 1: the high pairs', else none
  u32 xb[2][TCM];
#pragma unroll
  for (int i = 0; i < TCM; ++i) xb[0][i] = xb[1][i] = 0u;
  W tacc[2] = {0, 0};
  for (int u = first; u < units; u += KW) {
    RLX_TC_LOAD(nxt, u + KW)
    if (role == 0 || role == 1) {
      const uint4* f = (const uint4*)(xf + (u * 8 + 2 * tt + role) * TCM);
#pragma unroll
      for (int v = 0; v < TCM / 4; ++v) {
        const uint4 fv = f[v];
        u32* o = xb[role] + 4 * v;              // (role is fixed per lane: the other half stays 0)
        o[0] = fv.x; o[1] = fv.y; o[2] = fv.z; o[3] = fv.w;
      }
    }
    float dd[2][4] = {};                        // (two chains of mmas: half the chain's latency)
#pragma unroll
    for (int i = 0; i < TCM; ++i) {
      const u32 a[4] = {rlx_tc_pair(cur[0], tt, i, 0), rlx_tc_pair(cur[1], tt, i, 0),
                        rlx_tc_pair(cur[0], tt, i, 1), rlx_tc_pair(cur[1], tt, i, 1)};
      rlx_mma(dd[i & 1], a, xb[0][i], xb[1][i]);
    }
    float d[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) d[c] = dd[0][c] + dd[1][c];
    const float* xs = xsum + u * 8 + 2 * tt;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const rlx_tcs sc = rlx_tc_scales(cur[j], tt);
#pragma unroll
      for (int c = 0; c < 2; ++c)
        tacc[j] += sc.d[c] * d[2 * j + c] + (sc.m[c] - (128.f + BIAS) * sc.d[c]) * xs[c];
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) cur[j] = nxt[j];
  }
#else
  W acc[R][MMAX];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < MMAX; ++m) acc[r][m] = 0;
  for (int u0 = first; u0 < units; u0 += 32 * KW * U) {
    if (u0 != first) {
      RLX_LOAD_Q(u0)
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int uu = u0 + 32 * KW * u;
      if (uu >= units) break;
      const int p = uu % PARTS;
      const i64 e0 = (i64)(uu / PARTS) * BLK;
#if QX
#pragma unroll
      for (int k0 = 0; k0 < RUNS; k0 += QXG) {
        const int xb = (int)((e0 + rlx_run_off(p, k0)) >> 5);      // the group's x block
        int xw[MMAX][QXG], xs[MMAX];
        float xdv[MMAX];
#pragma unroll
        for (int m = 0; m < MMAX; ++m)
          if (m < M) {
            xdv[m] = xd[m * nbx + xb];
#pragma unroll
            for (int j = 0; j < QXG; j += QXC) rlx_xwords<QXC>(xq + (i64)m * K + e0 + rlx_run_off(p, k0 + j), xw[m] + j);
            xs[m] = 0;
#pragma unroll
            for (int j = 0; j < QXG; ++j) xs[m] = __dp4a(0x01010101, xw[m][j], xs[m]);   // (dead: BIAS 128, no min)
          }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          W d, mn = 0;
          rlx_scale(q[u][r], p, k0, &d, &mn);
          int dot[MMAX];
#pragma unroll
          for (int m = 0; m < MMAX; ++m) dot[m] = 0;
#pragma unroll
          for (int j = 0; j < QXG; ++j) {
            const int qs = (int)(rlx_qword(q[u][r], p, k0 + j) ^ 0x80808080u);     // the bytes b - 128
#pragma unroll
            for (int m = 0; m < MMAX; ++m)
              if (m < M) dot[m] = __dp4a(qs, xw[m][j], dot[m]);
          }
#pragma unroll
          for (int m = 0; m < MMAX; ++m)
            if (m < M) {
#if HAS_MIN
              acc[r][m] += xdv[m] * (d * (W)(dot[m] + (128 - BIAS) * xs[m]) + mn * (W)xs[m]);
#else
              acc[r][m] += xdv[m] * (d * (W)(dot[m] + (128 - BIAS) * xs[m]));
#endif
            }
        }
      }
#else
#if MMAX == 1
      // one x row: QXG runs share d and m, so their products are summed first and scaled once
      // (more rows: each run scaled, below; the sums would take too many registers). The m
      // loops and M guards stay as the other form has them: written for the one row, ptxas
      // spilled the q4_k forms (24-40 bytes at the 64-register bound)
#pragma unroll
      for (int k0 = 0; k0 < RUNS; k0 += QXG) {
        W sg[R][MMAX], xg[MMAX];
#pragma unroll
        for (int m = 0; m < MMAX; ++m) {
          xg[m] = 0;
#pragma unroll
          for (int r = 0; r < R; ++r) sg[r][m] = 0;
        }
#pragma unroll
        for (int k = k0; k < k0 + QXG; ++k) {
          const i64 e = e0 + rlx_run_off(p, k);
          W xv[MMAX][4];
#pragma unroll
          for (int m = 0; m < MMAX; ++m)
            if (m < M) {
              rlx_x4(x + m * xrs + e, xv[m]);
              if (HAS_MIN) xg[m] += rlx_sum4(xv[m]);
            }
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const u32 qw = rlx_qword(q[u][r], p, k);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const W qf = (W)rlx_qf(qw, i);
#pragma unroll
              for (int m = 0; m < MMAX; ++m)
                if (m < M) sg[r][m] += qf * xv[m][i];
            }
          }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          W d, mn = 0;
          rlx_scale(q[u][r], p, k0, &d, &mn);
#pragma unroll
          for (int m = 0; m < MMAX; ++m)
            if (m < M) acc[r][m] += HAS_MIN ? d * sg[r][m] + mn * xg[m] : d * sg[r][m];
        }
      }
#else
#pragma unroll
      for (int k = 0; k < RUNS; ++k) {
        const i64 e = e0 + rlx_run_off(p, k);
        W xv[MMAX][4], xs[MMAX];
#pragma unroll
        for (int m = 0; m < MMAX; ++m)
          if (m < M) {
            rlx_x4(x + m * xrs + e, xv[m]);
            xs[m] = HAS_MIN ? rlx_sum4(xv[m]) : (W)0;
          }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const rlx_drun run = rlx_decode_run(q[u][r], p, k);
#pragma unroll
          for (int m = 0; m < MMAX; ++m)
            if (m < M) acc[r][m] += rlx_run_dot(run, xv[m], xs[m]);
        }
      }
#endif
#endif
    }
  }
#endif
  __shared__ W red[8][R][MMAX];
#pragma unroll
  for (int m = 0; m < MMAX; ++m) {
#if NORM
    const W den = rlx_norm_den(sq[m], nb * BLK, eps);
#else
    const W den = 1;
#endif
#if TC
#pragma unroll
    for (int j = 0; j < 2; ++j) {             // (the four lanes of a row hold its sub-blocks)
      W v = tacc[j];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      if (tt == 0) red[warp][tg + 8 * j][m] = v / den;
    }
#else
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const W s = warp_sum(acc[r][m]) / den;
      if (lane == 0) red[warp][r][m] = s;
    }
#endif
  }
  __syncthreads();
#if RESID
  float hsq = 0.f;                  // (the square of this thread's output of y)
#endif
  for (int t = threadIdx.x; t < RW * OUTR * MMAX; t += blockDim.x) {
    int g, r, m;
    const int n = out_at(t, g, r, m);
    if (m >= M || n >= N) continue;
    W v = 0;
#pragma unroll
    for (int j = 0; j < KW; ++j) v += red[g * KW + j][r][m];
#if SWIGLU
    W u = 0;
#pragma unroll
    for (int j = 0; j < KW; ++j) u += red[g * KW + j][r + OUTR][m];
    v = LD(W, ST(TO, v));
    v = SWIGLU_OF(v, LD(W, ST(TO, u)));
    y[(i64)m * N + n] = ST(TO, v);
#elif RESID
    const TO h = ST(TO, rv + LD(W, ST(TO, v)));
    y[(i64)m * N + n] = h;
    yw[(i64)m * N + n] = ST(TO, tof(h) * nwv);
    hsq = tof(h) * tof(h);
#else
    EPILOGUE
    y[(i64)m * N + n] = ST(TO, v);
#endif
  }
#if RESID
  // thread t holds row t % MMAX (MMAX divides 32): each warp's lanes of a row add up, lane m adds
  for (int o = MMAX; o < 32; o <<= 1) hsq += __shfl_xor_sync(0xffffffffu, hsq, o);
  if (lane < M && threadIdx.x < RW * OUTR * MMAX) atomicAdd(osq + lane * 32 + (blockIdx.x & 31), hsq);
#endif
#if Q8
  rlx_q8_out<RW * OUTR>(RESID ? yw : y, M, N, y8, q8cnt, osq, eps, zero, zn);
#endif
}
// @part dequant(THREADS, TO, STAGE, BPT, YV)
// Dequantize rows into a contiguous y [rows, K]. STAGE: a tile of BPT blocks (one run of
// elements of y) is decoded into shared memory, a part per thread, then written with 16-byte
// stores (YV) so the writes coalesce (a part's own runs are scattered over its block); blocks
// too large for a tile are decoded straight into y.
extern "C" __global__ void __launch_bounds__(THREADS) rlx_dequant(const u8* __restrict__ w, long long wrs,
    TO* __restrict__ y, long long rows, int nb) {
  const i64 blocks = rows * nb;
#if STAGE
  __shared__ __align__(16) TO tile[BPT * BLK];
  for (i64 g0 = (i64)blockIdx.x * BPT; g0 < blocks; g0 += (i64)gridDim.x * BPT) {
    const int nbl = (int)min((i64)BPT, blocks - g0);
    for (int t = threadIdx.x; t < nbl * PARTS; t += blockDim.x) {
      const int lb = t / PARTS, p = t % PARTS;
      const i64 g = g0 + lb, row = g / nb;
      const rlx_raw q = rlx_load(w + row * wrs + (g - row * nb) * BPB, p);
      TO* yr = tile + lb * BLK;
#else
  for (i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x; t < blocks * PARTS; t += (i64)gridDim.x * blockDim.x) {
    {
      const i64 g = t / PARTS, row = g / nb;
      const int p = (int)(t % PARTS);
      const rlx_raw q = rlx_load(w + row * wrs + (g - row * nb) * BPB, p);
      TO* yr = y + g * BLK;
#endif
#pragma unroll
      for (int k = 0; k < RUNS; ++k) {
        W d, mn = 0;
        rlx_scale(q, p, k, &d, &mn);
        const u32 qw = rlx_qword(q, p, k);
        const int o = rlx_run_off(p, k);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const W qf = (W)rlx_qf(qw, i);
          yr[o + i] = ST(TO, HAS_MIN ? qf * d + mn : qf * d);
        }
      }
    }
#if STAGE
    __syncthreads();
    TO* dst = y + g0 * BLK;
    const int n = nbl * BLK;
#if YV
    for (int i = threadIdx.x; i < n * (int)sizeof(TO) / 16; i += blockDim.x) ((uint4*)dst)[i] = ((const uint4*)tile)[i];
#else
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = tile[i];
#endif
    __syncthreads();
#endif
  }
}
