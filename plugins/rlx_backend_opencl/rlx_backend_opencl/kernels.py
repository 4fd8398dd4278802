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

The kernel texts live in `kernels/*.cl` (package data), read once at import by `source`;
what a program varies (dtypes, tile sizes, modes, small macros such as TO_Y(v)) is passed
as `#define`s ahead of them. Only the elementwise programs (`elementwise_source`) and the
activation switch are generated, since their bodies are the program itself.
"""
from __future__ import annotations

import functools
import importlib.resources
import math

from rlx_core.ir import expr as E
from rlx_core.ir.dtype import DType
from rlx_core.ir.errors import BackendError

CL_TYPE = {DType.F32: "float", DType.F16: "half", DType.F64: "double", DType.I8: "char",
           DType.I16: "short", DType.I32: "int", DType.I64: "long", DType.U8: "uchar",
           DType.U32: "uint", DType.BOOL: "uchar", DType.C64: "float2"}
UNSIGNED = (DType.U8, DType.U32, DType.BOOL)


@functools.cache
def source(name: str) -> str:
    """The text of kernel file `name` under this package's kernels/ folder (read once)."""
    return (importlib.resources.files(__package__) / "kernels" / name).read_text(encoding="utf-8")


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


_HELPERS = source("helpers.cl")                 # LOAD/STORE (f16 via vload_half), NaN-aware max/min, set_err
_COMPLEX_HELPERS = source("complex.cl")         # numpy's complex64 product and quotient

# --------------------------------------------------------------------------- elementwise

class OpenCLRenderer(E.CRenderer):
    """OpenCL C: overloaded libm names for float and double, `(float)0.5` literals, the
    prelude's ISNAN/MAXP/MINP and the integer fdiv_/udiv_/ipow_ helpers. Its own formulas (kept
    from before the table, for bitwise-unchanged results): silu as x / (1 + exp(-x)), one
    rounding fewer than x * sigmoid(x); relu as ISNAN(x) ? x : (x > 0 ? x : 0). An inlined
    activation keeps its parentheses (fused_swiglu's `(g / (1 + exp(-g))) * u`)."""
    name = "OpenCL C"
    wrap_inlined = True
    dtypes = (DType.F32, DType.F64, DType.I8, DType.I16, DType.I32, DType.I64, DType.U8, DType.U32)
    CT = {DType.F32: "float", DType.F64: "double", DType.I8: "char", DType.I16: "short", DType.I32: "int",
          DType.I64: "long", DType.U8: "uchar", DType.U32: "uint", DType.BOOL: "uchar"}
    overrides = {"silu": E.x / (1 + E.exp(-E.x)),
                 "relu": E.select(E.isnan(E.x), E.x, E.select(E.x > 0, E.x, 0))}
    wrap_var = True
    FLOAT = {"abs": "fabs", "max": "MAXP", "min": "MINP", "isnan": "ISNAN"}
    INT = {"max": "({0} > {1} ? {0} : {1})", "min": "({0} < {1} ? {0} : {1})", "pow": "ipow_{ct}"}

    def function(self, name: str, dt: DType):
        if dt.is_int or dt is DType.BOOL:
            if name == "floordiv":
                return "udiv_{ct}" if dt in (DType.U8, DType.U32) else "fdiv_{ct}"
            return self.INT.get(name)
        return self.FLOAT.get(name) or (name if name in self.LIBM else None)

    def const(self, v, dt: DType) -> str:
        if dt.is_int or dt is DType.BOOL:
            return str(int(v))
        s = repr(float(v))
        return f"({self.CT[dt]}){s[:-2] if s.endswith('.0') else s}"


class StepRenderer(OpenCLRenderer):
    """The same dialect writing an elementwise step's bare expression: `to()` parenthesizes it."""
    wrap_top = False


OPENCL = OpenCLRenderer()
STEP = StepRenderer()
_ACT_DT = {"float": DType.F32, "double": DType.F64}


def act_expr(fn: str, v: str, ct: str) -> str:
    """Activation `fn` on the C expression `v` (a variable name) computed in C type `ct`."""
    return OPENCL.render("activation", fn, _ACT_DT.get(ct, DType.I64), "opencl", x=v)


def _step(kind: str, name: str, dt: DType, **values: str) -> str:
    """Table entry (kind, name) computed in `dt` (half computes in float) on the C expressions
    `values`, unparenthesized."""
    return STEP.render(kind, name, DType.F32 if dt is DType.F16 else dt, "opencl", **values)


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
        return to(o, _step("binary", f, o, a=_cv(x, xd, ct), b=_cv(y, yd, ct)))
    if op == "compare":
        (x, xd), (y, yd) = args
        r = _np_result([xd, yd])
        ct = _ct(r)
        return f"((uchar)({_step('compare', a['op'], r, a=_cv(x, xd, ct), b=_cv(y, yd, ct))}))"
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
        if not (gd.is_float or ud.is_float):
            raise BackendError(f"opencl backend: fused_swiglu needs a float gate or up, got {gd.value} "
                               f"and {ud.value}")
        ct = acc_type(gd, ud)
        return to(o, _step("fused_swiglu", "fused_swiglu", _ACT_DT[ct], a=_cv(g, gd, ct), b=_cv(u, ud, ct)))
    raise KeyError(op)


_INT_HELPERS = source("int_helpers.cl")


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

ROW_COMMON = source("rows.cl")
# softmax, reduce, argmax and topk: rows.source (core's rowkernels in this dialect)
NORM = source("norm.cl")
CUMSUM = source("cumsum.cl")

# --------------------------------------------------------------------------- matmul
MATMUL_COMMON = source("matmul_common.cl")
MATMUL_TILED = source("matmul_tiled.cl")
MATMUL_SKINNY = source("matmul_skinny.cl")

# --------------------------------------------------------------------------- attention family
ATTN_COMMON = source("attn_common.cl")
MASK_FILL = source("mask_fill.cl")
ROPE_LOAD = source("rope_load.cl")
ROPE = source("rope.cl")
ATTN_DEFS = source("attn_defs.cl")
ATTN_PREFILL = source("attn_prefill.cl")
ATTN_DECODE = source("attn_decode.cl")

# --------------------------------------------------------------------------- indexing
DENSE_SOLVE = source("dense_solve.cl")
GATHER = source("gather.cl")
KV_WRITE = source("kv_write.cl")

# --------------------------------------------------------------------------- FFT
FFT = source("fft.cl")
