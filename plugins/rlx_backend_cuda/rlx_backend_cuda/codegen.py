"""Elementwise kernels generated from op programs.

One generated kernel runs a whole elementwise region (`fused_elementwise`'s program, or a
single binary/compare/where/activation/cast/fused_swiglu op, or a strided copy): every
operand is read through its own strides over the collapsed output shape, so broadcasts,
transposes, narrows and concat slices need no copies. Intermediate values keep the
dtype the graph gives them (f16/bf16 intermediates are rounded), matching the reference.
This module is pure Python (no cupy), so the generated text can be checked offline.
"""
from __future__ import annotations

from rlx_core.ir.dtype import BF16, BOOL, C64, F16, F32, F64, I64, DType
from rlx_core.ir.errors import BackendError
from rlx_core.ir.expr import BINARY_TABLE, INT_OK_ACTIVATIONS, CRenderer
from rlx_core.ir.ops import step_dtypes

LOW = (F16, BF16)
CT = {  # the C type a value of each dtype is computed in
    DType.F32: "float", DType.F64: "double", DType.F16: "float", DType.BF16: "float",
    DType.I8: "signed char", DType.I16: "short", DType.I32: "int", DType.I64: "long long",
    DType.U8: "unsigned char", DType.U32: "unsigned int", DType.BOOL: "bool", DType.C64: "rlx_c64",
}
STORE = {**CT, DType.F16: "__half", DType.BF16: "__nv_bfloat16"}


def ctype(dt: DType) -> str:
    """The C storage type of dtype `dt` in kernels."""
    try:
        return STORE[dt]
    except KeyError:
        raise BackendError(f"cuda backend: dtype {dt.value} is not supported on the GPU") from None


def acc_of(*dts) -> str:
    """Accumulation type: double when any input is f64, else float."""
    return "double" if F64 in dts else "float"


def load(expr: str, dt: DType) -> str:
    return f"tof({expr})" if dt in LOW else expr


def conv(expr: str, src: DType, dst: DType) -> str:
    """`expr` (computed as CT[src]) as a CT[dst] value, rounded like numpy's unsafe cast."""
    if src is dst:
        return expr
    if dst in LOW:
        r = "rbf" if dst is BF16 else "rhf"
        return f"{r}({expr})" if src is F64 else f"{r}((float)({expr}))"
    if dst is BOOL:
        return f"(({expr}) != 0)"
    return f"(({CT[dst]})({expr}))"


def store(expr: str, dt: DType) -> str:
    if dt in LOW:
        return f"ST({STORE[dt]}, (float)({expr}))"
    return f"(({STORE[dt]})({expr}))"


class CudaRenderer(CRenderer):
    """CUDA C: the C renderer plus the prelude's helpers (rlx_sigmoid, the NaN-keeping
    rlx_max/rlx_min, integer rlx_maxi/rlx_mini/rlx_floordiv/rlx_ipow templates)."""
    name = "CUDA C"
    dtypes = (F32, F64, DType.I8, DType.I16, DType.I32, I64, DType.U8, DType.U32)
    functions = {"sigmoid": "rlx_sigmoid", "isnan": "({0} != {0})"}
    INT = {"max": "rlx_maxi<{ct}>", "min": "rlx_mini<{ct}>", "floordiv": "rlx_floordiv<{ct}>",
           "pow": "rlx_ipow<{ct}>"}

    def function(self, name: str, dt: DType):
        if dt.is_int or dt is BOOL:
            return self.INT.get(name)
        if name in ("max", "min"):
            return f"rlx_{name}"
        return super().function(name, dt)


CUDA = CudaRenderer()


def _render(kind: str, name: str, dt: DType, **values: str) -> str:
    return CUDA.render(kind, name, dt, "cuda", **values)


# what complex64 values may go through (rlx_c64 in the prelude): arithmetic, negation, a
# select, casts to a float or complex type
_COMPLEX_OK = {("binary", "add"), ("binary", "sub"), ("binary", "mul"), ("binary", "div"),
               ("activation", "neg"), ("activation", "identity"), ("where", None), ("cast", None)}


def _check_complex(op: str, a: dict, args: list, out: DType) -> None:
    if C64 not in [t for _, t in args] + [out]:
        return
    kind = a.get("op") if op == "binary" else a.get("fn") if op == "activation" else None
    if (op, kind) not in _COMPLEX_OK or (op == "cast" and not (out.is_float or out is C64)):
        what = f"{op} {kind!r}" if kind else f"{op} to {out.value}" if op == "cast" else op
        raise BackendError(f"cuda backend: {what} on complex64 values is not supported on the GPU "
                           "(complex values take add, sub, mul, div, neg, where and casts)")


def emit_op(op: str, a: dict, args: list, out: DType, lines: list, tmp: str) -> str:
    """C statements (appended to `lines`) computing `op` on `args` [(expr, dtype)];
    returns an expression of CT[out] holding the (rounded) result."""
    _check_complex(op, a, args, out)
    if op == "cast":
        (x, t), = args
        return conv(x, t, out)
    if op == "binary":
        (x, tx), (y, ty) = args
        kind = a["op"]
        cdt = F32 if out in LOW else (I64 if out is BOOL else out)
        X, Y = conv(x, tx, cdt), conv(y, ty, cdt)
        c = CT[cdt]
        if kind not in BINARY_TABLE:
            raise BackendError(f"cuda backend: binary op {kind!r} is not supported")
        e = _render("binary", kind, cdt, a=X, b=Y)
        return conv(f"(({c}){e})", cdt, out)
    if op == "compare":
        (x, tx), (y, ty) = args
        cdt = F64 if (tx.is_float or ty.is_float) else I64
        ct = CT[cdt]
        return _render("compare", a["op"], cdt, a=f"(({ct})({x}))", b=f"(({ct})({y}))")
    if op == "where":
        (c, _), (x, tx), (y, ty) = args
        return f"(({c}) ? {conv(x, tx, out)} : {conv(y, ty, out)})"
    if op == "activation":
        (x, tx), = args
        fn = a["fn"]
        if not out.is_float:
            if fn not in INT_OK_ACTIVATIONS:
                raise BackendError(f"cuda backend: activation {fn!r} needs a float input")
            lines.append(f"const {CT[out]} {tmp} = {conv(x, tx, out)};")
            return f"(({CT[out]}){_render('activation', fn, out, x=tmp)})"
        cdt = F64 if out is F64 else F32
        lines.append(f"const {CT[cdt]} {tmp} = {conv(x, tx, cdt)};")
        return conv(_render("activation", fn, cdt, x=tmp), cdt, out)
    if op == "fused_swiglu":
        (g, tg), (u, tu) = args
        cdt = F64 if F64 in (tg, tu) else F32
        lines.append(f"const {CT[cdt]} {tmp} = {conv(g, tg, cdt)};")
        return conv(_render("fused_swiglu", "fused_swiglu", cdt, a=tmp, b=conv(u, tu, cdt)), cdt, out)
    raise BackendError(f"cuda backend: {op!r} is not an elementwise op")


def swiglu_of(acc: str) -> str:
    """The SWIGLU_OF(g, u) define of GEMV and DQ_GEMV: the expression table's fused_swiglu on
    values of C type `acc` (float or double), so the epilogue is the elementwise op's formula."""
    return CUDA.render("fused_swiglu", "fused_swiglu", F64 if acc == "double" else F32, "cuda", a="(g)", b="(u)")


def collapse(shape: tuple, strides: list) -> tuple:
    """Drop size-1 dims and merge adjacent dims every operand walks contiguously.
    `strides` is a list (one per operand) of per-dim element strides."""
    dims = [(d, [s[i] for s in strides]) for i, d in enumerate(shape) if d != 1]
    out: list = []
    for d, st in dims:
        if out:
            pd, pst = out[-1]
            if all(ps == s * d for ps, s in zip(pst, st)):
                out[-1] = (pd * d, st)
                continue
        out.append((d, st))
    return tuple(d for d, _ in out), [[st[k] for _, st in out] for k in range(len(strides))]


def program_lines(program, in_dtypes: list, operands: list) -> tuple:
    """(C statements, the last value's name, its dtype) computing an elementwise program on
    `operands` (C expressions of the inputs' stored values): value v<k> of each input and step,
    as every kernel running a program computes it."""
    body = [f"const {CT[dt]} v{k} = {load(operands[k], dt)};" for k, dt in enumerate(in_dtypes)]
    slot_dt = list(in_dtypes)
    for s_, ((op, attrs_, args), dt) in enumerate(zip(program, step_dtypes(program, in_dtypes))):
        k = len(in_dtypes) + s_
        lines: list = []
        e = emit_op(op, dict(attrs_), [(f"v{i}", slot_dt[i]) for i in args], dt, lines, f"t{k}")
        body += lines
        body.append(f"const {CT[dt]} v{k} = {e};")
        slot_dt.append(dt)
    return body, f"v{len(slot_dt) - 1}", slot_dt[-1]


def epilogue_function(program, in_dtypes: list, out_dtype: DType, name: str) -> str:
    """A device function `name`(the inputs' stored values) -> the program's stored output: an
    elementwise node a kernel computes in its own store (the decode attention's EPI_FN)."""
    params = ", ".join(f"{ctype(dt)} a{k}" for k, dt in enumerate(in_dtypes))
    lines, last, dt = program_lines(program, in_dtypes, [f"a{k}" for k in range(len(in_dtypes))])
    return (f"__device__ __forceinline__ {ctype(out_dtype)} {name}({params}) {{ " + " ".join(lines)
            + f" return {store(conv(last, dt, out_dtype), out_dtype)}; }}")


def elementwise_source(program, in_dtypes: list, out_dtype: DType, kinds: list, rank: int,
                       idx64: bool, vec: int = 1) -> str:
    """Kernel `rlx_ew` for a program. kinds[k] per operand (inputs then output):
    'c' contiguous over the collapsed shape, 's' strided, 'z' a broadcast scalar, 'r' a row
    vector broadcast over the rows (offset i % d_last). vec > 1: each thread takes `vec`
    consecutive elements, every 'c' and 'r' operand moved as one aligned vector (the caller
    checks n, d_last and the pointers are multiples of it; no 's' operand then)."""
    from .sources import render

    it = "long long" if idx64 else "int"
    nin = len(in_dtypes)
    dts = list(in_dtypes) + [out_dtype]
    params = [f"const {ctype(dt)}* p{k}" for k, dt in enumerate(in_dtypes)]
    params.append(f"{ctype(out_dtype)}* po")
    params.append(f"{it} n")
    strided = [k for k, kd in enumerate(kinds) if kd == "s"]
    if strided or "r" in kinds:
        params += [f"{it} d{j}" for j in range(rank)]
        for k in strided:
            params += [f"{it} s{k}_{j}" for j in range(rank)]
    ptr = [f"p{k}" for k in range(nin)] + ["po"]

    def off(k, i="i"):
        return {"c": i, "z": "0", "s": f"o{k}", "r": f"(({i}) % d{rank - 1})"}[kinds[k]]

    def vtype(k):
        return f"rlx_vec<{ctype(dts[k])}, {vec}>"

    head, body = [], []
    if vec > 1:          # whole vectors of the 'c' and 'r' operands, element u of each below
        for k in range(nin):
            if kinds[k] in "cr":
                head.append(f"const {vtype(k)} a{k} = *(const {vtype(k)}*)(p{k} + {off(k, 'i0')});")
        head.append(f"{vtype(nin)} ao;")
        ptr = [f"a{k}.v" if kinds[k] in "cr" else f"p{k}" for k in range(nin)] + ["ao.v"]
    elif strided:
        body.append(f"{it} r = i;")
        body.append(" ".join(f"{it} o{k} = 0;" for k in strided))
        for j in reversed(range(rank)):
            parts = [f"const {it} c{j} = r % d{j};", f"r /= d{j};"]
            parts += [f"o{k} += c{j} * s{k}_{j};" for k in strided]
            body.append(" ".join(parts))

    def at(k):
        return "u" if vec > 1 and kinds[k] in "cr" else off(k)

    lines, last, last_dt = program_lines(program, in_dtypes, [f"{ptr[k]}[{at(k)}]" for k in range(nin)])
    body += lines
    body.append(f"{ptr[nin]}[{at(nin)}] = {store(conv(last, last_dt, out_dtype), out_dtype)};")
    grid_loop = (f"for ({it} {{i}} = blockIdx.x * ({it})blockDim.x + threadIdx.x; {{i}} < {{n}}; "
                 f"{{i}} += ({it})gridDim.x * blockDim.x)")
    if vec > 1:
        inner = ("    " + "\n    ".join(head) + f"\n#pragma unroll\n    for (int u = 0; u < {vec}; ++u) {{\n"
                 f"      const {it} i = i0 + u;\n      (void)i;\n      " + "\n      ".join(body) + "\n    }\n"
                 f"    *({vtype(nin)}*)(po + i0) = ao;\n")
        loop = grid_loop.format(i="iv", n=f"n / {vec}") + f" {{\n    const {it} i0 = iv * {vec};\n" + inner + "  }"
    else:
        loop = grid_loop.format(i="i", n="n") + " {\n    " + "\n    ".join(body) + "\n  }"
    src = ("extern \"C\" __global__ void rlx_ew(" + ", ".join(params) + ") {\n  " + loop + "\n}\n")
    return render(src.replace("$", "$$"))


def copy16_source(rank: int) -> str:
    """Kernel `rlx_copy16`: dst <- src in 16-byte chunks over `rank` dims (chunk units:
    dims d*, src strides s*, dst strides t*; each last stride 1)."""
    from .sources import render

    params = ", ".join([f"long long d{j}" for j in range(rank)] + [f"long long s{j}" for j in range(rank)]
                       + [f"long long t{j}" for j in range(rank)])
    body = " ".join(f"c = r % d{j}; r /= d{j}; os += c * s{j}; od += c * t{j};" for j in reversed(range(rank)))
    return render(
        "extern \"C\" __global__ void rlx_copy16(const uint4* __restrict__ src, uint4* __restrict__ dst, "
        f"long long n, {params}) {{\n"
        "  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; "
        "i += (long long)gridDim.x * blockDim.x) {\n"
        f"    long long r = i, c, os = 0, od = 0; {body}\n"
        "    dst[od] = src[os];\n  }\n}\n")


__all__ = ["CUDA", "CudaRenderer", "elementwise_source", "copy16_source", "collapse", "ctype", "acc_of", "conv", "emit_op"]
