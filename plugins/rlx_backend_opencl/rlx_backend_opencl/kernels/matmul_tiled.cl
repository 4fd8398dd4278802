#define TM 64
#define TN 64
#define TK 16
__kernel __attribute__((reqd_work_group_size(16, 16, 1)))
void matmul(__global const T_A* A, int a_off, __global const T_B* B, int b_off, __global T_C* C, int c_off,
            __global const T_BIAS* bias, int bias_off, int bias_st,
            int M, int N, int K, int sam, int sak, int sbk, int sbn, __global const int* meta, int moff) {
  __local ACC As[TK][TM + 1];
  __local ACC Bs[TK][TN + 1];
  int tx = get_local_id(0), ty = get_local_id(1), tid = ty * 16 + tx;
  int m0 = get_group_id(1) * TM, n0 = get_group_id(0) * TN, bz = get_group_id(2);
  int ao = a_off, bo = b_off;
  batch_offsets(meta + moff, bz, &ao, &bo);
  int co = c_off + bz * M * N;
  bool a_kc = sak == 1, b_nc = sbn == 1;
  ACC acc[4][4];
  for (int i = 0; i < 4; ++i) for (int j = 0; j < 4; ++j) acc[i][j] = 0;
  for (int k0 = 0; k0 < K; k0 += TK) {
    for (int i = tid; i < TM * TK; i += 256) {
      int mm = a_kc ? i / TK : i % TM, kk = a_kc ? i % TK : i / TM;
      int gm = m0 + mm, gk = k0 + kk;
      As[kk][mm] = (gm < M && gk < K) ? (ACC)LOAD(T_A, A, ao + gm * sam + gk * sak) : (ACC)0;
      int nn = b_nc ? i % TN : i / TK, kb = b_nc ? i / TN : i % TK;
      int gn = n0 + nn, gkb = k0 + kb;
      Bs[kb][nn] = (gn < N && gkb < K) ? (ACC)LOAD(T_B, B, bo + gkb * sbk + gn * sbn) : (ACC)0;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
#pragma unroll
    for (int kk = 0; kk < TK; ++kk) {
      ACC a[4], b[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) { a[r] = As[kk][ty + 16 * r]; b[r] = Bs[kk][tx + 16 * r]; }
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[r][c] += a[r] * b[c];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  for (int r = 0; r < 4; ++r) for (int c = 0; c < 4; ++c) {
    int gm = m0 + ty + 16 * r, gn = n0 + tx + 16 * c;
    if (gm < M && gn < N) STORE(T_C, C, co + gm * N + gn, TO_C(epilogue(acc[r][c], meta + moff, bias, bias_off, bias_st, gn)));
  }
}
