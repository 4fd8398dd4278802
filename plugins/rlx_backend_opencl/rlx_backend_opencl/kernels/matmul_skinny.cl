// skinny (M <= 4): split-K across a work-group of 64 per output column (B k-contiguous), or
// one thread per column looping K (B n-contiguous)
#define MMAX 4
__kernel __attribute__((reqd_work_group_size(64, 1, 1)))
void gemv_k(__global const T_A* A, int a_off, __global const T_B* B, int b_off, __global T_C* C, int c_off,
            __global const T_BIAS* bias, int bias_off, int bias_st,
            int M, int N, int K, int sam, int sak, int sbk, int sbn, __global const int* meta, int moff) {
  __local ACC sh[MMAX][64];
  int lid = get_local_id(0), n = get_group_id(0), bz = get_group_id(1);
  int ao = a_off, bo = b_off;
  batch_offsets(meta + moff, bz, &ao, &bo);
  ACC acc[MMAX];
  for (int r = 0; r < MMAX; ++r) acc[r] = 0;
  for (int k = lid; k < K; k += 64) {
    ACC b = (ACC)LOAD(T_B, B, bo + k * sbk + n * sbn);
    for (int r = 0; r < MMAX; ++r) if (r < M) acc[r] += (ACC)LOAD(T_A, A, ao + r * sam + k * sak) * b;
  }
  for (int r = 0; r < MMAX; ++r) sh[r][lid] = acc[r];
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int h = 32; h > 0; h >>= 1) {
    if (lid < h) for (int r = 0; r < MMAX; ++r) sh[r][lid] += sh[r][lid + h];
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (lid < M) STORE(T_C, C, c_off + bz * M * N + lid * N + n, TO_C(epilogue(sh[lid][0], meta + moff, bias, bias_off, bias_st, n)));
}
__kernel void gemv_n(__global const T_A* A, int a_off, __global const T_B* B, int b_off, __global T_C* C, int c_off,
                     __global const T_BIAS* bias, int bias_off, int bias_st,
                     int M, int N, int K, int sam, int sak, int sbk, int sbn, __global const int* meta, int moff) {
  int n = get_global_id(0), bz = get_group_id(1);
  if (n >= N) return;
  int ao = a_off, bo = b_off;
  batch_offsets(meta + moff, bz, &ao, &bo);
  ACC acc[MMAX];
  for (int r = 0; r < MMAX; ++r) acc[r] = 0;
  for (int k = 0; k < K; ++k) {
    ACC b = (ACC)LOAD(T_B, B, bo + k * sbk + n * sbn);
    for (int r = 0; r < MMAX; ++r) if (r < M) acc[r] += (ACC)LOAD(T_A, A, ao + r * sam + k * sak) * b;
  }
  for (int r = 0; r < MMAX; ++r) if (r < M) STORE(T_C, C, c_off + bz * M * N + r * N + n, TO_C(epilogue(acc[r], meta + moff, bias, bias_off, bias_st, n)));
}
