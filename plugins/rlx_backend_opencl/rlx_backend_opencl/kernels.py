"""OpenCL C sources of the backend: fixed kernel families specialised by `#define`s (dtypes,
activation, head dims), plus a generator for elementwise programs.

Conventions shared by every kernel:
- a tensor operand is a typed base pointer plus an `int` element offset (`x`, `x_off`), so
  one device buffer (the arena) carries many values without sub-buffers;
- strides live in one int buffer per runner (`meta` + `moff`), written at compile time;
- values compute in `ACC` (float for f16/f32, double for f64, long for integers) and are
  rounded once on the store, as the numpy reference does; bool is stored as uchar 0/1;
- kernels that can fail on data (gather bounds, kv_write overflow) record the first failure
  in `err[4]` = {code, node, a, b}; the host raises after the run;
- c64 is a `float2` (interleaved re, im: numpy's complex64 bytes); elementwise programs take
  it in binary add/sub/mul/div, cast and where (c64_error names the rest), the FFT kernels
  (FFT) in and out.
"""
from __future__ import annotations

import math

from rlx_core.ir.dtype import DType
from rlx_core.ir.errors import BackendError

CL_TYPE = {DType.F32: "float", DType.F16: "half", DType.F64: "double", DType.I8: "char",
           DType.I16: "short", DType.I32: "int", DType.I64: "long", DType.U8: "uchar",
           DType.U32: "uint", DType.BOOL: "uchar", DType.C64: "float2"}
UNSIGNED = (DType.U8, DType.U32, DType.BOOL)


def ctype(dt: DType) -> str:
    return CL_TYPE[dt]


def acc_type(*dts: DType) -> str:
    """Compute type of an op over these dtypes: double if any is f64, float if any float,
    else long."""
    if DType.F64 in dts:
        return "double"
    if any(d.is_float for d in dts):
        return "float"
    return "long"


def vtype(dt: DType) -> str:
    """C type of a value of `dt` in registers: f16 values live in float (rounded to half)."""
    return "float" if dt is DType.F16 else CL_TYPE[dt]


def to(dt: DType, expr: str) -> str:
    """Round/convert a computed expression to a value of `dt` (bool is 0/1, f16 is rounded to
    half precision and kept in a float)."""
    if dt is DType.BOOL:
        return f"((uchar)(({expr}) != 0))"
    if dt is DType.F16:
        return f"rnd_half((float)({expr}))"
    if dt is DType.C64:
        return f"({expr})"
    return f"(({ctype(dt)})({expr}))"


def lit(v: float, ct: str) -> str:
    """A literal of C type `ct` that never forces double arithmetic."""
    if isinstance(v, float) and math.isinf(v):
        return f"(({ct})({'-' if v < 0 else ''}INFINITY))"
    if ct == "float":
        return f"{float(v)!r}f"
    if ct == "double":
        return f"{float(v)!r}"
    return f"(({ct}){int(v)})"


def prelude(dts) -> str:
    """Pragmas and helpers every program starts with."""
    dts = set(dts)
    out = []
    if DType.F64 in dts or "double" in dts:
        out.append("#pragma OPENCL EXTENSION cl_khr_fp64 : enable")
    out.append(_HELPERS)
    if DType.C64 in dts:
        out.append(_COMPLEX_HELPERS)
    return "\n".join(out) + "\n"


# Memory access goes through LOAD/STORE so f16 uses vload_half/vstore_half (core OpenCL):
# the same kernels run with or without cl_khr_fp16 (whether f16 is offered is policy).
_HELPERS = r"""
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
"""

# numpy's complex64 arithmetic: the textbook product, Smith's quotient (npy_math's order)
_COMPLEX_HELPERS = r"""
inline float2 cmul(float2 a, float2 b) { return (float2)(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x); }
inline float2 cdiv(float2 a, float2 b) {
  float ar = fabs(b.x), ai = fabs(b.y);
  if (ar >= ai) {
    if (ar == 0.0f && ai == 0.0f) return (float2)(a.x / ar, a.y / ar);
    float rat = b.y / b.x, scl = 1.0f / (b.x + b.y * rat);
    return (float2)((a.x + a.y * rat) * scl, (a.y - a.x * rat) * scl);
  }
  float rat = b.x / b.y, scl = 1.0f / (b.y + b.x * rat);
  return (float2)((a.x * rat + a.y) * scl, (a.y * rat - a.x) * scl);
}
"""

# --------------------------------------------------------------------------- elementwise

ACT_C = {
    "gelu": "((T)0.5 * {v} * ((T)1 + erf({v} * (T)0.7071067811865476)))",
    "gelu_tanh": "((T)0.5 * {v} * ((T)1 + tanh((T)0.7978845608028654 * ({v} + (T)0.044715 * {v} * {v} * {v}))))",
    "silu": "({v} / ((T)1 + exp(-{v})))",
    "relu": "(ISNAN({v}) ? {v} : ({v} > (T)0 ? {v} : (T)0))",
    "sigmoid": "((T)1 / ((T)1 + exp(-{v})))",
    "tanh": "tanh({v})", "exp": "exp({v})", "log": "log({v})", "sqrt": "sqrt({v})",
    "rsqrt": "((T)1 / sqrt({v}))", "neg": "(-{v})", "abs": "fabs({v})", "sin": "sin({v})",
    "cos": "cos({v})", "recip": "((T)1 / {v})", "identity": "({v})",
}
ACT_INT = {"neg": "(-{v})", "abs": "({v} < 0 ? -{v} : {v})", "relu": "({v} > 0 ? {v} : 0)",
           "identity": "({v})"}


def act_expr(fn: str, v: str, ct: str) -> str:
    """Activation `fn` on the C expression `v` (a variable name) computed in C type `ct`."""
    if ct in ("float", "double"):
        return ACT_C[fn].replace("(T)", f"({ct})").format(v=v)
    return ACT_INT[fn].format(v=v)


def _ct(dt: DType) -> str:
    """Compute type for values stored as `dt` (half computes in float)."""
    if dt is DType.F16:
        return "float"
    return ctype(dt)


def _np_result(dts) -> DType:
    import numpy as np

    if DType.C64 in dts:         # numpy would widen c64 with f64 to complex128; the IR keeps c64
        return DType.C64
    return DType.parse(np.result_type(*[d.np for d in dts]))


def step_dtype(op: str, a: dict, dts: list) -> DType:
    """The dtype numpy gives an elementwise step inside fused_elementwise."""
    if op == "compare":
        return DType.BOOL
    if op == "cast":
        return DType.parse(a["dtype"])
    if op == "where":
        return _np_result(dts[1:])
    if op == "fused_swiglu":
        return dts[0]
    return _np_result(dts)


def _cv(name: str, dt: DType, ct: str) -> str:
    """`name` (a value of `dt`) converted to C type `ct`: a real becomes (re, 0), a complex
    keeps its real part (numpy's complex-to-real cast)."""
    if ct == "float2" and dt is not DType.C64:
        return f"((float2)((float)({name}), 0.0f))"
    if dt is DType.C64 and ct != "float2":
        return f"(({ct})({name}).x)"
    return f"(({ct}){name})"


C64_BINARY = ("add", "sub", "mul", "div")


def c64_error(op: str, a: dict) -> BackendError | None:
    """Why the elementwise step `op` has no kernel on c64 values (None: it has one)."""
    if op in ("cast", "where") or (op == "binary" and a.get("op") in C64_BINARY):
        return None
    what = f"{op} {a['op'] if 'op' in a else a.get('fn', '')}".strip()
    return BackendError(f"no OpenCL kernel for {what} on c64 values (c64 elementwise ops here: binary "
                        f"{'/'.join(C64_BINARY)}, cast, where)")


def step_expr(op: str, a: dict, args: list, o: DType) -> str:
    """C expression for one elementwise step writing dtype `o`; args are (var, dtype)."""
    if DType.C64 in (o, *(d for _, d in args)):
        err = c64_error(op, a)
        if err is not None:
            raise err
    if op == "binary":
        (x, xd), (y, yd) = args
        f = a["op"]
        if o is DType.C64:
            xa, ya = _cv(x, xd, "float2"), _cv(y, yd, "float2")
            return {"add": f"({xa} + {ya})", "sub": f"({xa} - {ya})", "mul": f"cmul({xa}, {ya})",
                    "div": f"cdiv({xa}, {ya})"}[f]
        if o is DType.BOOL:
            xb, yb = f"({x} != 0)", f"({y} != 0)"
            e = {"add": f"{xb} | {yb}", "max": f"{xb} | {yb}", "mul": f"{xb} & {yb}",
                 "min": f"{xb} & {yb}", "sub": f"{xb} ^ {yb}", "div": f"{xb} | !{yb}",
                 "pow": f"{xb} | !{yb}"}[f]
            return f"((uchar)({e}))"
        ct = _ct(o)
        xa, ya = _cv(x, xd, ct), _cv(y, yd, ct)
        if ct in ("float", "double"):
            e = {"add": f"{xa} + {ya}", "sub": f"{xa} - {ya}", "mul": f"{xa} * {ya}",
                 "div": f"{xa} / {ya}", "max": f"MAXP({xa}, {ya})", "min": f"MINP({xa}, {ya})",
                 "pow": f"pow({xa}, {ya})"}[f]
            return to(o, e)
        if f == "div":       # integer division floors (numpy floor_divide; x // 0 -> 0)
            return to(o, f"{'udiv_' if o in UNSIGNED else 'fdiv_'}{ct}({xa}, {ya})")
        if f == "pow":
            return to(o, f"ipow_{ct}({xa}, {ya})")
        e = {"add": f"{xa} + {ya}", "sub": f"{xa} - {ya}", "mul": f"{xa} * {ya}",
             "max": f"({xa} > {ya} ? {xa} : {ya})", "min": f"({xa} < {ya} ? {xa} : {ya})"}[f]
        return to(o, e)
    if op == "compare":
        (x, xd), (y, yd) = args
        ct = _ct(_np_result([xd, yd]))
        sym = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}[a["op"]]
        return f"((uchar)({_cv(x, xd, ct)} {sym} {_cv(y, yd, ct)}))"
    if op == "where":
        (c, _), (x, xd), (y, yd) = args
        r = _np_result([xd, yd])
        cx = to(r, _cv(x, xd, _ct(r))) if r is not xd else x
        cy = to(r, _cv(y, yd, _ct(r))) if r is not yd else y
        return to(o, f"(({c}) != 0 ? {_cv(cx, r, _ct(o))} : {_cv(cy, r, _ct(o))})")
    if op == "activation":
        ((x, xd),) = args
        ct = _ct(o)
        return to(o, act_expr(a["fn"], _cv(x, xd, ct), ct))
    if op == "cast":
        ((x, xd),) = args
        if xd is o:
            return x
        if xd is DType.C64 and o is DType.BOOL:
            return f"((uchar)(({x}).x != 0 || ({x}).y != 0))"
        return to(o, _cv(x, xd, _ct(o)) if o is not DType.BOOL else x)
    if op == "fused_swiglu":
        (g, gd), (u, ud) = args
        ct = acc_type(gd, ud) if (gd.is_float or ud.is_float) else _ct(o)
        gv = _cv(g, gd, ct)
        return to(o, f"({gv} / (({ct})1 + exp(-{gv}))) * {_cv(u, ud, ct)}")
    raise KeyError(op)


_INT_HELPERS = r"""
#define DEF_INT(T) \
inline T fdiv_##T(T a, T b) { if (b == 0) return 0; T q = a / b; if ((a % b != 0) && ((a < 0) != (b < 0))) q -= 1; return q; } \
inline T udiv_##T(T a, T b) { return b == 0 ? 0 : a / b; } \
inline T ipow_##T(T a, T b) { T r = 1; if (b < 0) return 0; while (b > 0) { if (b & 1) r *= a; a *= a; b >>= 1; } return r; }
DEF_INT(char) DEF_INT(short) DEF_INT(int) DEF_INT(long) DEF_INT(uchar) DEF_INT(uint)
"""


def elementwise_source(in_dts: list, program: list, out_dt: DType, choices: list | None = None) -> str:
    """One kernel `ew` evaluating `program` (steps (op, attrs, arg slots)) over N-d strided
    operands. meta: [nd, shape[nd], out strides[nd], in_k strides[nd]...]. With `choices`
    (attrs dicts for a one-step program) the step is a switch on a runtime `opc` argument, so
    every binary (compare, activation) op of one dtype signature shares one program."""
    n = len(in_dts)
    params = [f"__global {ctype(out_dt)}* y, int y_off"]
    params += [f"__global const {ctype(d)}* x{k}, int x{k}_off" for k, d in enumerate(in_dts)]
    used = sorted({s for _, _, args in program for s in args if s < n})
    lines = []
    slots = [(f"v{k}", d) for k, d in enumerate(in_dts)]
    for k in used:
        lines.append(f"  {vtype(in_dts[k])} v{k} = LOAD({ctype(in_dts[k])}, x{k}, o{k});")
    for j, (op, a, args) in enumerate(program):
        sd = out_dt if (len(program) == 1) else step_dtype(op, a, [slots[s][1] for s in args])
        if choices:
            cases = " ".join(f"case {c}: t{j} = {step_expr(op, alt, [slots[s] for s in args], sd)}; break;"
                             for c, alt in enumerate(choices))
            lines.append(f"  {vtype(sd)} t{j} = 0;\n  switch (opc) {{ {cases} }}")
        else:
            lines.append(f"  {vtype(sd)} t{j} = {step_expr(op, a, [slots[s] for s in args], sd)};")
        slots.append((f"t{j}", sd))
    last, ld = slots[-1]
    store = last if ld is out_dt else to(out_dt, _cv(last, ld, _ct(out_dt)) if out_dt is not DType.BOOL else last)
    offs = "".join(f"    o{k} += c * m[1 + nd * {k + 2} + d];\n" for k in used)
    ins = "".join(f"  int o{k} = x{k}_off;\n" for k in used)
    body = f"""
__kernel void ew({", ".join(params)}, __global const int* meta, int moff, int total, int opc) {{
  int gid = get_global_id(0);
  if (gid >= total) return;
  __global const int* m = meta + moff;
  int nd = m[0], rem = gid;
  int oy = y_off;
{ins}  for (int d = nd - 1; d >= 0; --d) {{
    int s = m[1 + d], c = rem % s; rem /= s;
    oy += c * m[1 + nd + d];
{offs}  }}
{chr(10).join(lines)}
  STORE({ctype(out_dt)}, y, oy, {store});
}}
"""
    dts = list(in_dts) + [out_dt] + [d for _, d in slots]
    head = prelude(dts)
    if any(not d.is_float for d in dts):
        head += _INT_HELPERS
    return head + body


# --------------------------------------------------------------------------- row kernels
# meta for row kernels: [nd, outer shape[nd], then per operand: outer strides[nd], inner stride]

ROW_COMMON = r"""
#define LMAX 256
inline int row_off(__global const int* m, int row, int op) {
  int nd = m[0], off = 0;
  __global const int* st = m + 1 + nd + op * (nd + 1);
  for (int d = nd - 1; d >= 0; --d) { int s = m[1 + d]; off += (row % s) * st[d]; row /= s; }
  return off;
}
#define INNER(m, op) ((m)[1 + (m)[0] + (op) * ((m)[0] + 1) + (m)[0]])
inline ACC seg_sum(ACC v, __local ACC* s, int lx, int n) {
  s[lx] = v; barrier(CLK_LOCAL_MEM_FENCE);
  for (int h = n >> 1; h > 0; h >>= 1) { if (lx < h) s[lx] += s[lx + h]; barrier(CLK_LOCAL_MEM_FENCE); }
  ACC r = s[0]; barrier(CLK_LOCAL_MEM_FENCE); return r;
}
inline ACC seg_max(ACC v, __local ACC* s, int lx, int n) {
  s[lx] = v; barrier(CLK_LOCAL_MEM_FENCE);
  for (int h = n >> 1; h > 0; h >>= 1) { if (lx < h) s[lx] = MAXP(s[lx], s[lx + h]); barrier(CLK_LOCAL_MEM_FENCE); }
  ACC r = s[0]; barrier(CLK_LOCAL_MEM_FENCE); return r;
}
#define ROW_SETUP \
  __local ACC sh_[LMAX]; \
  int lx = get_local_id(0), LX = get_local_size(0); \
  __local ACC* sh = sh_ + get_local_id(1) * LX; \
  int row = get_global_id(1); bool ok = row < rows; \
  __global const int* m = meta + moff;
"""

SOFTMAX = r"""
__kernel void softmax(__global const T_X* x, int x_off, __global T_Y* y, int y_off,
                      __global const int* meta, int moff, int rows, int n) {
  ROW_SETUP
  int xo = x_off + (ok ? row_off(m, row, 0) : 0), xs = INNER(m, 0);
  int yo = y_off + (ok ? row_off(m, row, 1) : 0), ys = INNER(m, 1);
  ACC mx = -INFINITY;
  if (ok) for (int j = lx; j < n; j += LX) { ACC v = (ACC)LOAD(T_X, x, xo + j * xs); mx = MAXP(mx, v); }
  mx = seg_max(mx, sh, lx, LX);
  if (!isfinite(mx)) mx = 0;
  ACC s = 0;
  if (ok) for (int j = lx; j < n; j += LX) s += exp((ACC)LOAD(T_X, x, xo + j * xs) - mx);
  s = seg_sum(s, sh, lx, LX);
  if (s == 0) s = 1;
  if (ok) for (int j = lx; j < n; j += LX) STORE(T_Y, y, yo + j * ys, TO_Y(exp((ACC)LOAD(T_X, x, xo + j * xs) - mx) / s));
}
"""

# operands (meta order): x, r, h, y ; weights are rank-1 (offset + stride args)
# flags: 1 residual (h = x + r), 2 weight, 4 bias, 8 write h, 16 layer norm (else rms)
NORM = r"""
#define HV(j) (res ? (ACC)LOAD(T_X, x, xo + (j) * xs) + (ACC)LOAD(T_R, r, ro + (j) * rs) : (ACC)LOAD(T_X, x, xo + (j) * xs))
__kernel void norm(__global const T_X* x, int x_off, __global const T_R* r, int r_off,
                   __global const T_W* w, int w_off, int w_st, __global const T_B* bb, int b_off, int b_st,
                   __global T_H* h, int h_off, __global T_Y* y, int y_off,
                   __global const int* meta, int moff, int rows, int n, ACC eps, ACC offset, int flags) {
  ROW_SETUP
  bool res = flags & 1, hw = flags & 2, hb = flags & 4, wh = flags & 8, layer = flags & 16;
  int xo = x_off + (ok ? row_off(m, row, 0) : 0), xs = INNER(m, 0);
  int ro = r_off + (ok ? row_off(m, row, 1) : 0), rs = INNER(m, 1);
  int ho = h_off + (ok ? row_off(m, row, 2) : 0), hs = INNER(m, 2);
  int yo = y_off + (ok ? row_off(m, row, 3) : 0), ys = INNER(m, 3);
  ACC mean = 0;
  if (layer) {
    ACC s = 0;
    if (ok) for (int j = lx; j < n; j += LX) s += HV(j);
    mean = seg_sum(s, sh, lx, LX) / (ACC)n;
  }
  ACC q = 0;
  if (ok) for (int j = lx; j < n; j += LX) { ACC d = HV(j) - mean; q += d * d; }
  ACC den = sqrt(seg_sum(q, sh, lx, LX) / (ACC)n + eps);
  if (ok) for (int j = lx; j < n; j += LX) {
    ACC v = HV(j);
    if (wh) STORE(T_H, h, ho + j * hs, TO_H(v));
    ACC o = (v - mean) / den;
    if (hw) o = o * ((ACC)LOAD(T_W, w, w_off + j * w_st) + offset);
    if (hb) o = o + (ACC)LOAD(T_B, bb, b_off + j * b_st);
    STORE(T_Y, y, yo + j * ys, TO_Y(o));
  }
}
"""

# reduce ops (runtime `op`): 0 sum, 1 mean, 2 max, 3 min, 4 prod ; operands x, y
REDUCE = r"""
inline ACC red_comb(int op, ACC a, ACC b) {
  return op == 2 ? MAXP(a, b) : op == 3 ? MINP(a, b) : op == 4 ? a * b : a + b;
}
__kernel void reduce(__global const T_X* x, int x_off, __global T_Y* y, int y_off,
                     __global const int* meta, int moff, int rows, int n, int op) {
  ROW_SETUP
  int xo = x_off + (ok ? row_off(m, row, 0) : 0), xs = INNER(m, 0);
  int yo = y_off + (ok ? row_off(m, row, 1) : 0);
  ACC a = op == 2 ? ACC_LO : op == 3 ? ACC_HI : op == 4 ? (ACC)1 : (ACC)0;
  if (ok) for (int j = lx; j < n; j += LX) a = red_comb(op, a, (ACC)LOAD(T_X, x, xo + j * xs));
  sh[lx] = a; barrier(CLK_LOCAL_MEM_FENCE);
  for (int hh = LX >> 1; hh > 0; hh >>= 1) { if (lx < hh) sh[lx] = red_comb(op, sh[lx], sh[lx + hh]); barrier(CLK_LOCAL_MEM_FENCE); }
  a = sh[0];
  if (op == 1) a = a / (ACC)n;
  if (ok && lx == 0) STORE(T_Y, y, yo, TO_Y(a));
}
"""

# argmax: NaN is the largest, first index on ties ; topk: sorted by KEY ascending (= -x),
# NaN last, ties by index (numpy's stable argsort of -x)
ARGMAX = r"""
inline bool am_better(ACC a, int ia, ACC b, int ib) {
  if (ib < 0) return ia >= 0;
  if (ia < 0) return false;
  if (ISNAN(a)) return ISNAN(b) ? ia < ib : true;
  if (ISNAN(b)) return false;
  return a > b || (a == b && ia < ib);
}
__kernel void argmax(__global const T_X* x, int x_off, __global long* y, int y_off,
                     __global const int* meta, int moff, int rows, int n) {
  ROW_SETUP
  __local int shi_[LMAX]; __local int* shi = shi_ + get_local_id(1) * LX;
  int xo = x_off + (ok ? row_off(m, row, 0) : 0), xs = INNER(m, 0);
  int yo = y_off + (ok ? row_off(m, row, 1) : 0);
  ACC bv = 0; int bi = -1;
  if (ok) for (int j = lx; j < n; j += LX) { ACC v = (ACC)LOAD(T_X, x, xo + j * xs); if (am_better(v, j, bv, bi)) { bv = v; bi = j; } }
  sh[lx] = bv; shi[lx] = bi; barrier(CLK_LOCAL_MEM_FENCE);
  for (int hh = LX >> 1; hh > 0; hh >>= 1) {
    if (lx < hh && am_better(sh[lx + hh], shi[lx + hh], sh[lx], shi[lx])) { sh[lx] = sh[lx + hh]; shi[lx] = shi[lx + hh]; }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (ok && lx == 0) y[yo] = (long)shi[0];
}
"""

TOPK = r"""
inline bool tk_before(ACC a, int ia, ACC b, int ib) {
  if (ib < 0) return ia >= 0;
  if (ia < 0) return false;
  if (ISNAN(a)) return ISNAN(b) ? ia < ib : false;
  if (ISNAN(b)) return true;
  return a < b || (a == b && ia < ib);
}
__kernel void topk(__global const T_X* x, int x_off, __global T_X* y, int y_off, __global long* yi, int yi_off,
                   __global const int* meta, int moff, int rows, int n, int k) {
  ROW_SETUP
  __local int shi_[LMAX]; __local int* shi = shi_ + get_local_id(1) * LX;
  int xo = x_off + (ok ? row_off(m, row, 0) : 0), xs = INNER(m, 0);
  int yo = y_off + (ok ? row_off(m, row, 1) : 0), ys = INNER(m, 1);
  int io = yi_off + (ok ? row_off(m, row, 2) : 0), is = INNER(m, 2);
  ACC pk = 0; int pi = -1;
  for (int r = 0; r < k; ++r) {
    ACC bk = 0; int bi = -1;
    if (ok) for (int j = lx; j < n; j += LX) {
      ACC kv = KEY(LOAD(T_X, x, xo + j * xs));
      if ((pi < 0 || tk_before(pk, pi, kv, j)) && tk_before(kv, j, bk, bi)) { bk = kv; bi = j; }
    }
    sh[lx] = bk; shi[lx] = bi; barrier(CLK_LOCAL_MEM_FENCE);
    for (int hh = LX >> 1; hh > 0; hh >>= 1) {
      if (lx < hh && tk_before(sh[lx + hh], shi[lx + hh], sh[lx], shi[lx])) { sh[lx] = sh[lx + hh]; shi[lx] = shi[lx + hh]; }
      barrier(CLK_LOCAL_MEM_FENCE);
    }
    pk = sh[0]; pi = shi[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    if (ok && lx == 0) { STORE(T_X, y, yo + r * ys, LOAD(T_X, x, xo + pi * xs)); yi[io + r * is] = (long)pi; }
  }
}
"""

CUMSUM = r"""
__kernel void cumsum(__global const T_X* x, int x_off, __global T_Y* y, int y_off,
                     __global const int* meta, int moff, int rows, int n) {
  int row = get_global_id(0);
  if (row >= rows) return;
  __global const int* m = meta + moff;
  int xo = x_off + row_off(m, row, 0), xs = INNER(m, 0);
  int yo = y_off + row_off(m, row, 1), ys = INNER(m, 1);
  ACC a = 0;
  for (int j = 0; j < n; ++j) { a += (ACC)LOAD(T_X, x, xo + j * xs); STORE(T_Y, y, yo + j * ys, TO_Y(a)); }
}
"""

# --------------------------------------------------------------------------- matmul
# C[b] = act(A[b] @ B[b] + bias), A: (M,K) with strides sam/sak, B: (K,N) with sbk/sbn,
# batch dims (<= 4) with per-operand strides in meta: [nb, shape[nb], a strides[nb], b strides[nb]].
MATMUL_COMMON = r"""
#define ROUND(v) ((ACC)TO_C(v))
inline void batch_offsets(__global const int* m, int bz, int* ao, int* bo) {
  int nb = m[0];
  for (int d = nb - 1; d >= 0; --d) {
    int s = m[1 + d], c = bz % s; bz /= s;
    *ao += c * m[1 + nb + d]; *bo += c * m[1 + 2 * nb + d];
  }
}
// meta[1 + 3 * nb]: 1 when there is a bias
inline ACC epilogue(ACC v, __global const int* m, __global const T_BIAS* bias, int bias_off, int bias_st, int n) {
  v = ROUND(v);
  if (m[1 + 3 * m[0]]) v = ROUND(v + (ACC)LOAD(T_BIAS, bias, bias_off + n * bias_st));
  return ACT(v);
}
"""

MATMUL_TILED = r"""
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
"""

# skinny (M <= 4): split-K across a work-group of 64 per output column (B k-contiguous), or
# one thread per column looping K (B n-contiguous)
MATMUL_SKINNY = r"""
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
"""

# --------------------------------------------------------------------------- attention family
# mask logic shared by mask_fill and the attention kernels.
# KIND: 0 none/custom/bias, 1 causal, 2 sliding window ; MASK_MODE: 0 none, 1 bool keep, 2 bias
ATTN_COMMON = r"""
// mmode: 0 no mask, 1 bool keep-mask, 2 additive bias ; hpos: a pos input gives query positions
inline long qpos0(__global const T_P* pos, int p_off, int npos, int hpos, int b, int Sq, int Sk) {
  return hpos ? (long)pos[p_off + (npos == 1 ? 0 : b)] : (long)(Sk - Sq);
}
inline ACC apply_mask(ACC s, long qp, int j, __global const T_M* mk, int mo, int kind, int window, int mmode) {
  if (mmode == 2) s = s + (ACC)LOAD(T_M, mk, mo);
  bool keep = true;
  if (kind >= 1) keep = (long)j <= qp;
  if (kind == 2) keep = keep && (long)j > qp - window;
  if (mmode == 1) keep = keep && LOAD(T_M, mk, mo) != 0;
  return keep ? s : (ACC)(-INFINITY);
}
"""

MASK_FILL = r"""
// meta: scores strides[4], mask strides[4], mmode, hpos
__kernel void mask_fill(__global const T_X* x, int x_off, __global const T_M* mk, int m_off,
                        __global const T_P* pos, int p_off, int npos, __global T_Y* y, int y_off,
                        __global const int* meta, int moff, int B, int H, int Sq, int Sk, int kind, int window) {
  int g = get_global_id(0);
  if (g >= B * H * Sq * Sk) return;
  __global const int* m = meta + moff;
  int j = g % Sk, r = g / Sk, i = r % Sq; r /= Sq; int h = r % H, b = r / H;
  ACC s = (ACC)LOAD(T_X, x, x_off + b * m[0] + h * m[1] + i * m[2] + j * m[3]);
  long qp = qpos0(pos, p_off, npos, m[9], b, Sq, Sk) + i;
  int mo = m_off + b * m[4] + h * m[5] + i * m[6] + j * m[7];
  STORE(T_Y, y, y_off + g, TO_Y(apply_mask(s, qp, j, mk, mo, kind, window, m[8])));
}
"""

# rope on load: x element d of a row at `base` (stride sd) rotated by table row `cb` (stride cd)
ROPE_LOAD = r"""
#define DEF_ROT(NAME, T) \
inline ACC NAME(__global const T* x, int base, int sd, int d, __global const T_C* cs, int cb, int cd, \
                __global const T_C* sn, int sb, int sdd, int rhalf, int rstyle) { \
  ACC v = (ACC)LOAD(T, x, base + d * sd); \
  if (d >= 2 * rhalf) return v; \
  int e; ACC o; \
  if (rstyle == 0) { \
    if (d < rhalf) { e = d; o = -(ACC)LOAD(T, x, base + (d + rhalf) * sd); } \
    else { e = d - rhalf; o = (ACC)LOAD(T, x, base + e * sd); } \
  } else { \
    e = d >> 1; o = (d & 1) ? (ACC)LOAD(T, x, base + (d - 1) * sd) : -(ACC)LOAD(T, x, base + (d + 1) * sd); \
  } \
  return v * (ACC)LOAD(T_C, cs, cb + e * cd) + o * (ACC)LOAD(T_C, sn, sb + e * sdd); \
}
"""

ROPE = r"""
// meta: x strides[4], cos strides [b, s, d], sin strides [b, s, d], half, style
DEF_ROT(rot_x, T_X)
__kernel void rope(__global const T_X* x, int x_off, __global const T_C* cs, int c_off, __global const T_C* sn, int s_off,
                   __global T_Y* y, int y_off, __global const int* meta, int moff, int B, int H, int S, int D) {
  int g = get_global_id(0);
  if (g >= B * H * S * D) return;
  __global const int* m = meta + moff;
  int d = g % D, r = g / D, i = r % S; r /= S; int h = r % H, b = r / H;
  int base = x_off + b * m[0] + h * m[1] + i * m[2];
  STORE(T_Y, y, y_off + g, TO_Y(rot_x(x, base, m[3], d, cs, c_off + b * m[4] + i * m[5], m[6],
                              sn, s_off + b * m[7] + i * m[8], m[9], m[10], m[11])));
}
"""

# meta: q[4], k[4], v[4], mask[4], cos[3], sin[3] strides, then mmode, hpos, rope, half, style
ATTN_DEFS = r"""
DEF_ROT(rot_q, T_Q)
DEF_ROT(rot_k, T_K)
#define ROTARGS(b, i) cs, c_off + (b) * m[16] + (i) * m[17], m[18], sn, s_off + (b) * m[19] + (i) * m[20], m[21], m[25], m[26]
#define LOADQ(b, h, i, d) (m[24] ? rot_q(q, q_off + (b) * m[0] + (h) * m[1] + (i) * m[2], m[3], d, ROTARGS(b, i)) \
  : (ACC)LOAD(T_Q, q, q_off + (b) * m[0] + (h) * m[1] + (i) * m[2] + (d) * m[3]))
#define LOADK(b, h, j, d) (m[24] ? rot_k(k, k_off + (b) * m[4] + (h) * m[5] + (j) * m[6], m[7], d, ROTARGS(b, j)) \
  : (ACC)LOAD(T_K, k, k_off + (b) * m[4] + (h) * m[5] + (j) * m[6] + (d) * m[7]))
#define LOADV(b, h, j, d) ((ACC)LOAD(T_V, v, v_off + (b) * m[8] + (h) * m[9] + (j) * m[10] + (d) * m[11]))
#define MOFF(b, h, i, j) (m_off + (b) * m[12] + (h) * m[13] + (i) * m[14] + (j) * m[15])
#define ATTN_ARGS __global const T_Q* q, int q_off, __global const T_K* k, int k_off, __global const T_V* v, int v_off, \
  __global T_O* o, int o_off, __global const T_M* mk, int m_off, __global const T_P* pos, int p_off, int npos, \
  __global const T_C* cs, int c_off, __global const T_C* sn, int s_off, __global const int* meta, int moff, \
  int B, int H, int KVH, int Sq, int Sk, ACC scale, ACC softcap, int kind, int window
inline ACC score_post(ACC s, ACC scale, ACC softcap) {
  s = s * scale;
  if (softcap != 0) s = tanh(s / softcap) * softcap;
  return s;
}
inline void key_range(long qlo, long qhi, int Sk, int kind, int window, int* kb, int* ke) {
  *kb = 0; *ke = Sk;
  if (kind >= 1) *ke = (int)clamp(qhi + 1, 0L, (long)Sk);
  if (kind == 2) *kb = (int)clamp(qlo - window + 1, 0L, (long)Sk);
}
"""

# NaN and inf (issue 41, 2.3): a value row whose weight is 0 (a masked key: another segment of
# a packed batch, a slot past the cache position) is skipped, as 0 * NaN would carry its NaN
# into rows that never see it; a NaN score makes the row's sum l NaN, and the output divides
# by l unless l is 0 (`l > 0` dropped the NaN: zeros).
ATTN_PREFILL = r"""
#define DPT ((DV + BK - 1) / BK)
__kernel __attribute__((reqd_work_group_size(BK, BQ, 1)))
void attn_prefill(ATTN_ARGS) {
  __local ACC Qs[BQ][D + 1];
  __local ACC Ks[BK][D + 1];
  __local ACC Vs[BK][DV + 1];
  __local ACC Ps[BQ][BK + 1];
  __global const int* m = meta + moff;
  int lx = get_local_id(0), ly = get_local_id(1), tid = ly * BK + lx;
  int qt = get_group_id(0), bh = get_group_id(1);
  int b = bh / H, h = bh % H, kh = h / (H / KVH);
  int qi = qt * BQ + ly;
  long p0 = qpos0(pos, p_off, npos, m[23], b, Sq, Sk);
  for (int e = tid; e < BQ * D; e += BQ * BK) {
    int r = e / D, d = e % D, qq = qt * BQ + r;
    Qs[r][d] = qq < Sq ? LOADQ(b, h, qq, d) : (ACC)0;
  }
  int kb, ke;
  key_range(p0 + qt * BQ, p0 + min(qt * BQ + BQ, Sq) - 1, Sk, kind, window, &kb, &ke);
  ACC mrow = -INFINITY, l = 0, acc[DPT];
  for (int t = 0; t < DPT; ++t) acc[t] = 0;
  for (int k0 = kb; k0 < ke; k0 += BK) {
    for (int e = tid; e < BK * D; e += BQ * BK) {
      int r = e / D, d = e % D, j = k0 + r;
      Ks[r][d] = j < ke ? LOADK(b, kh, j, d) : (ACC)0;
    }
    for (int e = tid; e < BK * DV; e += BQ * BK) {
      int r = e / DV, d = e % DV, j = k0 + r;
      Vs[r][d] = j < ke ? LOADV(b, kh, j, d) : (ACC)0;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    int j = k0 + lx;
    ACC s = -INFINITY;
    if (j < ke && qi < Sq) {
      ACC dot = 0;
      for (int d = 0; d < D; ++d) dot += Qs[ly][d] * Ks[lx][d];
      s = apply_mask(score_post(dot, scale, softcap), p0 + qi, j, mk, MOFF(b, h, qi, j), kind, window, m[22]);
    }
    Ps[ly][lx] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    ACC tmax = -INFINITY;
    for (int jj = 0; jj < BK; ++jj) tmax = fmax(tmax, Ps[ly][jj]);
    ACC mnew = fmax(mrow, tmax);
    ACC alpha = mrow == -INFINITY ? (ACC)0 : exp(mrow - mnew);
    ACC p = s == -INFINITY ? (ACC)0 : exp(s - mnew);
    barrier(CLK_LOCAL_MEM_FENCE);
    Ps[ly][lx] = p;
    barrier(CLK_LOCAL_MEM_FENCE);
    ACC ps = 0;
    for (int jj = 0; jj < BK; ++jj) ps += Ps[ly][jj];
    l = l * alpha + ps;
    for (int t = 0; t < DPT; ++t) {
      int d = lx + t * BK;
      if (d < DV) {
        ACC a = acc[t] * alpha;
        for (int jj = 0; jj < BK; ++jj) if (Ps[ly][jj] != 0) a += Ps[ly][jj] * Vs[jj][d];
        acc[t] = a;
      }
    }
    mrow = mnew;
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (qi < Sq) for (int t = 0; t < DPT; ++t) {
    int d = lx + t * BK;
    if (d < DV) STORE(T_O, o, o_off + ((b * H + h) * Sq + qi) * DV + d, TO_O(l == 0 ? (ACC)0 : acc[t] / l));
  }
}
"""

ATTN_DECODE = r"""
#define DPT ((DV + W - 1) / W)
__kernel __attribute__((reqd_work_group_size(W, 1, 1)))
void attn_decode(ATTN_ARGS) {
  __local ACC Qs[D];
  __local ACC Ps[W];
  __local ACC red[W];
  __global const int* m = meta + moff;
  int lid = get_local_id(0), row = get_group_id(0);
  int i = row % Sq, bh = row / Sq, b = bh / H, h = bh % H, kh = h / (H / KVH);
  for (int d = lid; d < D; d += W) Qs[d] = LOADQ(b, h, i, d);
  barrier(CLK_LOCAL_MEM_FENCE);
  long qp = qpos0(pos, p_off, npos, m[23], b, Sq, Sk) + i;
  int kb, ke;
  key_range(qp, qp, Sk, kind, window, &kb, &ke);
  ACC mrow = -INFINITY, lp = 0, acc[DPT];
  for (int t = 0; t < DPT; ++t) acc[t] = 0;
  for (int k0 = kb; k0 < ke; k0 += W) {
    int j = k0 + lid;
    ACC s = -INFINITY;
    if (j < ke) {
      ACC dot = 0;
      for (int d = 0; d < D; ++d) dot += Qs[d] * LOADK(b, kh, j, d);
      s = apply_mask(score_post(dot, scale, softcap), qp, j, mk, MOFF(b, h, i, j), kind, window, m[22]);
    }
    red[lid] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int hh = W >> 1; hh > 0; hh >>= 1) { if (lid < hh) red[lid] = fmax(red[lid], red[lid + hh]); barrier(CLK_LOCAL_MEM_FENCE); }
    ACC mnew = fmax(mrow, red[0]);
    ACC alpha = mrow == -INFINITY ? (ACC)0 : exp(mrow - mnew);
    ACC p = s == -INFINITY ? (ACC)0 : exp(s - mnew);
    Ps[lid] = p;
    barrier(CLK_LOCAL_MEM_FENCE);
    lp = lp * alpha + p;
    int nk = min(W, ke - k0);
    for (int t = 0; t < DPT; ++t) {
      int d = lid + t * W;
      if (d < DV) {
        ACC a = acc[t] * alpha;
        for (int jj = 0; jj < nk; ++jj) if (Ps[jj] != 0) a += Ps[jj] * LOADV(b, kh, k0 + jj, d);
        acc[t] = a;
      }
    }
    mrow = mnew;
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  red[lid] = lp;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int hh = W >> 1; hh > 0; hh >>= 1) { if (lid < hh) red[lid] += red[lid + hh]; barrier(CLK_LOCAL_MEM_FENCE); }
  ACC l = red[0];
  for (int t = 0; t < DPT; ++t) {
    int d = lid + t * W;
    if (d < DV) STORE(T_O, o, o_off + (bh * Sq + i) * DV + d, TO_O(l == 0 ? (ACC)0 : acc[t] / l));
  }
}
"""

# --------------------------------------------------------------------------- indexing
# x = solve(A, B) for one matrix of the batch per work-group (dim 1): LU with partial pivoting
# (LAPACK getrf's choice: the first row of largest |value|) applied to W = [A | B] (n rows,
# n + k columns, in ACC: double where the device has it, as numpy.linalg computes every float
# dtype in f64), then back substitution for the k right-hand sides. W lives in local
# memory (W_SPACE __local, w_step 0) or in a global scratch (w_step = n * (n + k) per matrix).
# A zero pivot flags the matrix as singular (err code 3: matrix, column) and leaves x unwritten.
DENSE_SOLVE = r"""
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
"""

GATHER = r"""
__kernel void gather(__global const T_X* t, int t_off, __global const T_I* idx, int i_off, __global T_Y* y, int y_off,
                     int pre, int ni, int nax, int post, __global int* err, int node) {
  int g = get_global_id(0);
  if (g >= pre * ni * post) return;
  int p = g % post, r = g / post, ii = r % ni, a = r / ni;
  long ix = (long)idx[i_off + ii];
  if (ix < 0) ix += nax;
  if (ix < 0 || ix >= nax) {
    set_err(err, 1, node, (int)clamp((long)idx[i_off + ii], (long)INT_MIN, (long)INT_MAX), nax);
    STORE(T_Y, y, y_off + g, 0);
    return;
  }
  STORE(T_Y, y, y_off + g, LOAD(T_X, t, t_off + (a * nax + (int)ix) * post + p));
}
"""

# meta: [nd, new shape[nd], new strides[nd], cache strides[nd]]
KV_WRITE = r"""
__kernel void kv_write(__global T_X* c, int c_off, __global const T_X* nw, int n_off, __global const T_P* pos, int p_off,
                       int npos, __global const int* meta, int moff, int total, int axis, int clen, int slen,
                       __global int* err, int node) {
  int g = get_global_id(0);
  if (g >= total) return;
  long lo = (long)pos[p_off], hi = lo;
  for (int i = 1; i < npos; ++i) { long p = (long)pos[p_off + i]; lo = min(lo, p); hi = max(hi, p); }
  if (lo < 0 || hi + slen > clen) { set_err(err, 2, node, (int)clamp(hi, (long)INT_MIN, (long)INT_MAX), clen); return; }
  __global const int* m = meta + moff;
  int nd = m[0], rem = g, on = n_off, oc = c_off, b = 0;
  for (int d = nd - 1; d >= 0; --d) {
    int s = m[1 + d], k = rem % s; rem /= s;
    on += k * m[1 + nd + d]; oc += k * m[1 + 2 * nd + d];
    if (d == 0) b = k;
  }
  long p = (long)pos[p_off + (npos == 1 ? 0 : b)];
  STORE(T_X, c, oc + (int)p * m[1 + 2 * nd + axis], LOAD(T_X, nw, on));
}
"""

# --------------------------------------------------------------------------- FFT
# Rows are ROW_COMMON's (operand 0 the input, 1 the output, both over the input's shape).
# Stockham autosort of any radix, one output per work-item per stage: with Ns the product of
# the radices before stage R and L = Ns * R,
#   out[o] = sum_r in[j + r n/R] * W^(((r * (o mod L)) mod L) * n/L),  j = (o / L) Ns + o mod Ns,
# W^e = tw[e] = exp(-2 pi i e / n) (float64 on the host, rounded once; sgn = -1 conjugates it),
# the exponent exact in integers. A stage of radix n is the direct DFT.
# MODE 0: c64 -> c64; 1: real -> c64 (the first m outputs); 2: c64 Hermitian half (m of them)
# -> real n outputs (the missing half conjugated; the real part kept, like numpy's irfft).
FFT = r"""
inline float2 fft_in(__global const T_X* x, int xo, int xs, int j, int m, int n) {
#if MODE == 1
  return (float2)((float)LOAD(T_X, x, xo + j * xs), 0.0f);
#elif MODE == 2
  if (j < m) return x[xo + j * xs];
  float2 v = x[xo + (n - j) * xs];
  return (float2)(v.x, -v.y);
#else
  return x[xo + j * xs];
#endif
}
inline void fft_out(__global T_Y* y, int yo, int ys, int k, int m, float2 v) {
#if MODE == 2
  STORE(T_Y, y, yo + k * ys, v.x);
#else
  if (k < m) y[yo + k * ys] = v;
#endif
}
#define FFT_STAGE(acc, SRC, o) { \
  int L_ = Ns * R, q_ = (o) % L_, j_ = (o) / L_ * Ns + (o) % Ns, st_ = n / R, f_ = n / L_, e_ = q_; \
  acc = SRC(j_); \
  for (int r_ = 1; r_ < R; ++r_) { \
    float2 w_ = tw[tw_off + e_ * f_]; \
    acc += cmul(SRC(j_ + r_ * st_), (float2)(w_.x, sgn * w_.y)); \
    e_ += q_; if (e_ >= L_) e_ -= L_; \
  } }
#define FFT_ROW(row) \
  __global const int* mt = meta + moff; \
  int xo = x_off + row_off(mt, row, 0), xs = INNER(mt, 0); \
  int yo = y_off + row_off(mt, row, 1), ys = INNER(mt, 1);

// one work-group per row: the stages ping-pong between two rows of n in local memory
__kernel void fft_local(__global const T_X* x, int x_off, __global T_Y* y, int y_off,
                        __global const float2* tw, int tw_off, __global const int* meta, int moff, int rows,
                        int n, int m, int rad, int nst, float sgn, float scale, __local float2* buf) {
  int lx = get_local_id(0), LX = get_local_size(0);
  FFT_ROW(get_group_id(1))
  __local float2* a = buf;
  __local float2* b = buf + n;
  for (int j = lx; j < n; j += LX) a[j] = fft_in(x, xo, xs, j, m, n);
  barrier(CLK_LOCAL_MEM_FENCE);
#define SRC_L(i) a[i]
  for (int s = 0, Ns = 1; s < nst; ++s) {
    int R = meta[rad + s];
    for (int o = lx; o < n; o += LX) { float2 acc; FFT_STAGE(acc, SRC_L, o) b[o] = acc; }
    barrier(CLK_LOCAL_MEM_FENCE);
    __local float2* t = a; a = b; b = t;
    Ns *= R;
  }
  for (int k = lx; k < n; k += LX) fft_out(y, yo, ys, k, m, a[k] * scale);
}

// one stage of every row (rows too long for local memory): flags 1 reads x (the first
// stage), 2 writes y (the last); between them rows of n in s at s_in / s_out
__kernel void fft_pass(__global const T_X* x, int x_off, __global T_Y* y, int y_off,
                       __global const float2* tw, int tw_off, __global const int* meta, int moff, int rows,
                       int n, int m, int Ns, int R, float sgn, float scale,
                       __global float2* s, int s_in, int s_out, int flags) {
  int g = get_global_id(0);
  if (g >= rows * n) return;
  int row = g / n, o = g % n;
  FFT_ROW(row)
  int si = s_in + row * n;
  float2 acc;
#define SRC_X(i) fft_in(x, xo, xs, (i), m, n)
#define SRC_S(i) s[si + (i)]
  if (flags & 1) FFT_STAGE(acc, SRC_X, o) else FFT_STAGE(acc, SRC_S, o)
  if (flags & 2) fft_out(y, yo, ys, o, m, acc * scale);
  else s[s_out + row * n + o] = acc;
}
"""
