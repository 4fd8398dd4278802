// Tensor-core PTX every mma.sync kernel shares: the m16n8k16 product (f16 / bf16 operands
// named by MMAT, f32 accumulators), ldmatrix x4 (and .trans) from shared memory, and cp.async
// 16-byte copies with their group commit and wait. A host build (tests/cuda_emu.py) runs the
// rlx_emu_* forms: the warp collectives with PTX's fragment layouts; a copy lands when issued.
// @part mma(MMAT)
__device__ __forceinline__ void rlx_mma(float* c, const u32* a, u32 b0, u32 b1) {
#ifdef __CUDA_ARCH__
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." RLX_STR(MMAT) "." RLX_STR(MMAT) ".f32 "
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  rlx_emu_mma16816(c, a, b0, b1, RLX_STR(MMAT)[0] == 'b');
#endif
}
// four 8x8 16-bit matrices from shared memory: lanes 8i..8i+7 give matrix i's rows (TRANS:
// each matrix transposed)
template <bool TRANS = false> __device__ __forceinline__ void rlx_ldm_x4(u32* r, const unsigned short* p) {
#ifdef __CUDA_ARCH__
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  if constexpr (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
#else
  rlx_emu_ldmatrix_x4(r, p, TRANS);
#endif
}
// 16 bytes from global src into shared dst, zeros where !ok (src then only needs to be valid)
__device__ __forceinline__ void rlx_cp16(void* dst, const void* src, bool ok) {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "r"(ok ? 16 : 0) : "memory");
#else
  rlx_emu_cp16(dst, src, ok ? 16 : 0);
#endif
}
#ifdef __CUDA_ARCH__
#define RLX_CP_COMMIT() asm volatile("cp.async.commit_group;\n" ::: "memory")
#define RLX_CP_WAIT(n) asm volatile("cp.async.wait_group " #n ";\n" ::: "memory")
#else
#define RLX_CP_COMMIT()
#define RLX_CP_WAIT(n)
#endif
