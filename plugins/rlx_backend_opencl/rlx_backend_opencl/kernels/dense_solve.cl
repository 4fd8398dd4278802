// x = solve(A, B) for one matrix of the batch per work-group (dim 1): LU with partial pivoting
// (LAPACK getrf's choice: the first row of largest |value|) applied to W = [A | B] (n rows,
// n + k columns, in ACC: double where the device has it, as numpy.linalg computes every float
// dtype in f64), then back substitution for the k right-hand sides. W lives in local
// memory (W_SPACE __local, w_step 0) or in a global scratch (w_step = n * (n + k) per matrix).
// A zero pivot flags the matrix as singular (err code 3: matrix, column) and leaves x unwritten.
#define SYNC barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE)
__kernel void dense_solve(__global const T_X* a, int a_off, __global const T_X* b, int b_off, __global T_Y* x,
                          int x_off, W_SPACE ACC* w, int w_off, int w_step, int n, int k,
                          __global int* err, int node) {
  __local ACC best_v[256];
  __local int best_i[256];
  int g = get_group_id(1), lx = get_local_id(0), LX = get_local_size(0), m = n + k;
  W_SPACE ACC* W = w + w_off + g * w_step;
  a_off += g * n * n; b_off += g * n * k; x_off += g * n * k;
  for (int e = lx; e < n * m; e += LX) {
    int r = e / m, c = e % m;
    W[e] = c < n ? (ACC)LOAD(T_X, a, a_off + r * n + c) : (ACC)LOAD(T_X, b, b_off + r * k + c - n);
  }
  SYNC;
  for (int j = 0; j < n; ++j) {
    ACC bv = -1; int bi = j;
    for (int r = j + lx; r < n; r += LX) { ACC v = fabs(W[r * m + j]); if (v > bv) { bv = v; bi = r; } }
    best_v[lx] = bv; best_i[lx] = bi;
    SYNC;
    for (int h = LX >> 1; h > 0; h >>= 1) {
      if (lx < h) {
        ACC o = best_v[lx + h]; int oi = best_i[lx + h];
        if (o > best_v[lx] || (o == best_v[lx] && oi < best_i[lx])) { best_v[lx] = o; best_i[lx] = oi; }
      }
      SYNC;
    }
    int p = best_i[0];
    ACC piv = W[p * m + j];
    if (piv == 0) {                   // the same in every work-item: the group leaves together
      if (lx == 0) set_err(err, 3, node, g, j);
      return;
    }
    SYNC;                             // all have read best_i and the pivot before the swap
    if (p != j)
      for (int c = j + lx; c < m; c += LX) {
        ACC t = W[j * m + c]; W[j * m + c] = W[p * m + c]; W[p * m + c] = t;
      }
    SYNC;
    for (int r = j + 1 + lx; r < n; r += LX) W[r * m + j] /= piv;
    SYNC;
    int nc = m - j - 1;
    for (int e = lx; e < (n - j - 1) * nc; e += LX) {
      int r = j + 1 + e / nc, c = j + 1 + e % nc;
      W[r * m + c] -= W[r * m + j] * W[j * m + c];
    }
    SYNC;
  }
  for (int j = n - 1; j >= 0; --j) {  // column-oriented back substitution: x_j, then rows above
    for (int q = lx; q < k; q += LX) W[j * m + n + q] /= W[j * m + j];
    SYNC;
    for (int e = lx; e < j * k; e += LX) {
      int r = e / k, q = e % k;
      W[r * m + n + q] -= W[r * m + j] * W[j * m + n + q];
    }
    SYNC;
  }
  for (int e = lx; e < n * k; e += LX) STORE(T_Y, x, x_off + e, TO_Y(W[(e / k) * m + n + e % k]));
}
