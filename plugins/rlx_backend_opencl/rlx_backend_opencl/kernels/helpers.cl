// Memory access goes through LOAD/STORE so f16 uses vload_half/vstore_half (core OpenCL):
// the same kernels run with or without cl_khr_fp16 (whether f16 is offered is policy).
#define LOAD(T, p, i) LOAD_(T, p, i)
#define LOAD_(T, p, i) LD_##T(p, i)
#define STORE(T, p, i, v) STORE_(T, p, i, v)
#define STORE_(T, p, i, v) ST_##T(p, i, v)
#define LD_half(p, i) vload_half((i), (p))
#define ST_half(p, i, v) vstore_half_rte((float)(v), (i), (p))
#define LD_float(p, i) ((p)[i])
#define ST_float(p, i, v) ((p)[i] = (v))
#define LD_double(p, i) ((p)[i])
#define ST_double(p, i, v) ((p)[i] = (v))
#define LD_char(p, i) ((p)[i])
#define ST_char(p, i, v) ((p)[i] = (v))
#define LD_short(p, i) ((p)[i])
#define ST_short(p, i, v) ((p)[i] = (v))
#define LD_int(p, i) ((p)[i])
#define ST_int(p, i, v) ((p)[i] = (v))
#define LD_long(p, i) ((p)[i])
#define ST_long(p, i, v) ((p)[i] = (v))
#define LD_uchar(p, i) ((p)[i])
#define ST_uchar(p, i, v) ((p)[i] = (v))
#define LD_uint(p, i) ((p)[i])
#define ST_uint(p, i, v) ((p)[i] = (v))
#define LD_float2(p, i) ((p)[i])
#define ST_float2(p, i, v) ((p)[i] = (v))
inline float rnd_half(float v) {
  ushort u;
  vstore_half_rte(v, 0, (__private half*)&u);
  return vload_half(0, (__private const half*)&u);
}
#define ISNAN(x) ((x) != (x))
#define MAXP(a, b) (ISNAN(a) ? (a) : (ISNAN(b) ? (b) : ((a) > (b) ? (a) : (b))))
#define MINP(a, b) (ISNAN(a) ? (a) : (ISNAN(b) ? (b) : ((a) < (b) ? (a) : (b))))
inline void set_err(__global int* err, int code, int node, int a, int b) {
  if (atomic_cmpxchg(err, 0, code) == 0) { err[1] = node; err[2] = a; err[3] = b; }
}
