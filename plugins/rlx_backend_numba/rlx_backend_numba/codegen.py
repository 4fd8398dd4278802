"""Elementwise kernels generated from op programs: one generator, one expression per op.

A program (`fused_elementwise`'s, or one binary/compare/where/activation/cast/fused_swiglu
op, or a matmul epilogue) becomes numba source over a 2-D iteration space of rows and
columns of the output: every operand is read as `F` (a full contiguous array, flat), `P`
(full, contiguous rows `p` elements apart: read flat from its first element, so loads stay
contiguous and vectorize), `X` (full, any strides: a 2-D view), `R` (one row broadcast over
rows), `C` (one value per row) or `S` (a scalar). The source goes to a file in the cache dir (RLX_NUMBA_CACHE, else
`numba` in the RLX cache dir) and is imported from there, so numba's `cache=True` keeps the machine
code across processes; in-process the module is memoized by the hash of its source.

Each module holds `par` (prange over rows, for large outputs) and `ser` (one thread, no
parallel launch: a decode step's small tensors); only the one a step calls gets compiled.
Values compute in the dtype the graph gives each step (f32 or f64; bool for masks).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import math
import os
import re
import sys
import threading

import numpy as np

from rlx_core.cache import cache_dir as rlx_cache_dir
from rlx_core.cache import code_fingerprint
from rlx_core.ir import expr as E
from rlx_core.ir.dtype import BOOL, F32, F64, DType
from rlx_core.ir.errors import BackendError
from rlx_core.ir.ops import step_dtypes

NATIVE = (F32, F64, BOOL)         # dtypes generated kernels compute in; others run on numpy
CHUNK = 8192                      # columns per row when the output is walked flat
PAR_MIN = 1 << 15                 # elements from which a kernel runs on all threads

_TNAME = {F32: "f32", F64: "f64"}


class NumbaRenderer(E.TextRenderer):
    """Python for numba's nopython mode: math.* functions, `f32(0.5)` literals, NaN-keeping
    max/min as conditional expressions, sigmoid as 0.5 * (1 + tanh(x / 2)) (exact, no overflow).
    f32 overrides: libm's erf and tanh are a call per element, which keeps a loop scalar (a
    matmul's GELU epilogue cost as much as the GEMM, SwiGLU 2.7x NumPy's); erf32 and tanh32 (in
    every generated module) are clamped rational approximations, relative error < 5e-7, that
    vectorize. Their polynomials may contract to FMAs (fastmath "contract" on them alone: a
    304x1536 GELU epilogue 206 -> 138 us on one core); nothing else in a kernel changes."""
    name = "numba"
    dtypes = (F32, F64)
    wrap_top = False
    overrides = {"sigmoid": 0.5 * (1 + E.tanh(E.x * 0.5))}
    functions = {"abs": "abs", "pow": "{0} ** {1}",
                 "max": "({0} if ({0} > {1} or {0} != {0}) else {1})",
                 "min": "({0} if ({0} < {1} or {0} != {0}) else {1})"}
    MATH = ("exp", "log", "tanh", "erf", "sqrt", "sin", "cos")

    def function(self, name: str, dt: DType):
        if dt is F32 and name in ("erf", "tanh"):
            return name + "32"
        return self.functions.get(name) or (f"math.{name}" if name in self.MATH else None)

    def const(self, v, dt: DType) -> str:
        return f"{_TNAME[dt]}({float(v)!r})"

    def select(self, c: str, a: str, b: str) -> str:
        return f"({a} if {c} else {b})"


NUMBA = NumbaRenderer()


def _rendered(kind: str, names) -> dict:
    """{name: {dtype: source}} with the entry's own variable names (x, or a and b)."""
    return {n: {dt: NUMBA.render(kind, n, dt, "numba", **{v: v for v in E.entry(kind, n).variables})
                for dt in NUMBA.dtypes} for n in names}


# One expression per op and compute dtype: `x` (activation) or `a`, `b` (binary, compare).
ACT = _rendered("activation", E.ACTIVATIONS)
BINARY = _rendered("binary", E.BINARY_TABLE)
COMPARE = _rendered("compare", E.COMPARE_TABLE)
SWIGLU = _rendered("fused_swiglu", ["fused_swiglu"])["fused_swiglu"]


def _sub(template: str, **names) -> str:
    for k, v in names.items():
        template = re.sub(rf"\b{k}\b", v, template)
    return template


def _conv(var: str, src: DType, dst: DType) -> str:
    if src is dst:
        return var
    if dst is BOOL:
        return f"({var} != 0)"
    return f"{_TNAME[dst]}({var})"


def _step(op: str, a: dict, args: list, out: DType, k: int, lines: list) -> str | None:
    """Statements computing one step into `v{k}`; None when the step is not native here."""
    dts = [d for _, d in args]
    if any(d not in NATIVE for d in dts) or out not in NATIVE:
        return None
    if op == "cast":
        (v, d), = args
        return _conv(v, d, out)
    if op == "compare":
        if not all(d.is_float for d in dts) or a["op"] not in COMPARE:
            return None
        return _sub(COMPARE[a["op"]][F64], a=args[0][0], b=args[1][0])
    if out is BOOL:
        return None                                      # bool arithmetic runs on numpy
    if op == "where":
        (c, dc), (x, dx), (y, dy) = args
        return f"({_conv(x, dx, out)} if {c} else {_conv(y, dy, out)})" if dc is BOOL else None
    if op == "activation" and a["fn"] in ACT:
        lines.append(f"x{k} = {_conv(args[0][0], dts[0], out)}")
        return _sub(ACT[a["fn"]][out], x=f"x{k}")
    if op in ("binary", "fused_swiglu"):
        expr = BINARY[a["op"]][out] if op == "binary" and a.get("op") in BINARY else \
            SWIGLU[out] if op == "fused_swiglu" else None
        if expr is None:
            return None
        lines.append(f"a{k} = {_conv(args[0][0], dts[0], out)}")
        lines.append(f"b{k} = {_conv(args[1][0], dts[1], out)}")
        return _sub(expr, a=f"a{k}", b=f"b{k}")
    return None


_LOAD = {"F": "x{i}[i]", "P": "x{i}[b{i} + u]", "X": "x{i}[r, u]", "R": "x{i}[u]", "C": "x{i}[r]",
         "S": "x{i}[0]"}
_HEAD = """import math
import numpy as np
from numba import njit, prange
f32 = np.float32
f64 = np.float64


@njit(cache=True, fastmath={"contract"}, error_model="numpy")
def erf32(x):
    x = f32(4.0) if x > f32(4.0) else x            # (written so that a NaN stays NaN)
    x = f32(-4.0) if x < f32(-4.0) else x
    x2 = x * x
    p = x2 * f32(-2.72614225801306e-10) + f32(2.77068142495902e-08)
    p = p * x2 + f32(-2.10102402082508e-06)
    p = p * x2 + f32(-5.69250639462346e-05)
    p = p * x2 + f32(-7.34990630326855e-04)
    p = p * x2 + f32(-2.95459980854025e-03)
    p = p * x2 + f32(-1.60960333262415e-02)
    q = x2 * f32(-1.45660718464996e-05) + f32(-2.13374055278905e-04)
    q = q * x2 + f32(-1.68282697438203e-03)
    q = q * x2 + f32(-7.37332916720468e-03)
    q = q * x2 + f32(-1.42647390514189e-02)
    return x * p / q


@njit(cache=True, fastmath={"contract"}, error_model="numpy")
def tanh32(x):
    x = f32(7.90531110763549805) if x > f32(7.90531110763549805) else x
    x = f32(-7.90531110763549805) if x < f32(-7.90531110763549805) else x
    x2 = x * x
    p = x2 * f32(-2.76076847742355e-16) + f32(2.00018790482477e-13)
    p = p * x2 + f32(-8.60467152213735e-11)
    p = p * x2 + f32(5.12229709037114e-08)
    p = p * x2 + f32(1.48572235717979e-05)
    p = p * x2 + f32(6.37261928875436e-04)
    p = p * x2 + f32(4.89352455891786e-03)
    q = x2 * f32(1.19825839466702e-06) + f32(1.18534705686654e-04)
    q = q * x2 + f32(2.26843463243900e-03)
    q = q * x2 + f32(4.89352518554385e-03)
    return x * p / q
"""


# `swiglu(a, b)` for generated modules that fuse it into something else (a GEMV).
SWIGLU_HEAD = _HEAD + f"""

@njit(cache=True, fastmath=False, error_model="numpy")
def swiglu(a, b):
    return {SWIGLU[F32]}
"""


def elementwise_source(program, in_dtypes: list, out_dtype: DType, kinds: str) -> str | None:
    """Numba module text with `par` and `ser` for `program`; `kinds` has one letter per input.
    None when a step or dtype has no native expression (the caller runs numpy's kernel)."""
    dts = list(in_dtypes)
    try:
        steps = step_dtypes(program, dts)
    except Exception:          # a program the table rejects is not ours to judge here
        return None
    body = [f"v{i} = {_LOAD[kd].format(i=i)}" for i, kd in enumerate(kinds)]
    for s, ((op, attrs_, args), dt) in enumerate(zip(program, steps)):
        k = len(in_dtypes) + s
        lines: list = []
        e = _step(op, dict(attrs_), [(f"v{i}", dts[i]) for i in args], dt, k, lines)
        if e is None:
            return None
        body += lines + [f"v{k} = {e}"]
        dts.append(dt)
    if out_dtype not in NATIVE or (out_dtype is not BOOL and dts[-1] is BOOL):
        return None
    body.append(f"o[i] = {_conv(f'v{len(dts) - 1}', dts[-1], out_dtype)}")
    pitched = [i for i, kd in enumerate(kinds) if kd == "P"]
    params = ", ".join(["o", "n", "C"] + [f"x{i}" for i in range(len(kinds))] + [f"p{i}" for i in pitched])
    inner = "\n".join("            " + line for line in body)
    bases = "".join(f"\n        b{i} = np.uint64(r * p{i})" for i in pitched)
    fns = []
    for name, flags, rng in (("par", "parallel=True, ", "prange"), ("ser", "", "range")):
        fns.append(f"""
@njit({flags}fastmath=False, cache=True, error_model="numpy")
def {name}({params}):
    for r in {rng}((n + C - 1) // C):
        lo = r * C{bases}
        for j in range(min(C, n - lo)):
            i, u = np.uint64(lo + j), np.uint64(j)    # unsigned: no negative-index wraparound, so it vectorizes
{inner}
""")
    return _HEAD + "".join(fns)


# --------------------------------------------------------------------------- compiling
_MODULES: dict = {}
_LOCK = threading.Lock()


def cache_dir() -> str:
    """Generated kernel sources: $RLX_NUMBA_CACHE, else `numba` in the RLX cache dir."""
    return os.environ.get("RLX_NUMBA_CACHE") or os.path.join(rlx_cache_dir(), "numba")


@functools.lru_cache(maxsize=None)
def _plugin_code() -> str:
    return code_fingerprint(__name__.partition(".")[0])


def load_source(src: str):
    """The module for generated source `src` (written once to the cache dir, imported once).
    The file names this plugin's code: numba's cache of a generated kernel checks only that
    file, so a kernel it calls in another module (simd.py, quant_kernels.py) that changed
    must give the source another name, or the old machine code would load."""
    src = f"# rlx_backend_numba {_plugin_code()}\n{src}"
    key = hashlib.sha1(src.encode()).hexdigest()[:20]
    mod = _MODULES.get(key)
    if mod is not None:
        return mod
    with _LOCK:
        if key in _MODULES:
            return _MODULES[key]
        d = cache_dir()
        path = os.path.join(d, f"k{key}.py")
        try:
            os.makedirs(d, exist_ok=True)
            if not os.path.exists(path):
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    f.write(src)
                os.replace(tmp, path)        # atomic: other processes see all or nothing
        except OSError as e:
            raise BackendError(f"numba backend: cannot write generated kernels to {d!r} "
                               f"(set RLX_NUMBA_CACHE to a writable folder): {e}") from None
        name = f"rlx_numba_gen.k{key}"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        _MODULES[key] = mod
        return mod


# --------------------------------------------------------------------------- operand layout
def _flat(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1)


def _kind(x: np.ndarray, od: tuple, p: int):
    """How input `x` (broadcast to `od`) reads with rows od[:p] and columns od[p:]; None if
    it cannot without a copy."""
    if x.size == 1:
        return "S"
    xd = (1,) * (len(od) - x.ndim) + tuple(x.shape)
    if xd == od:
        if x.flags.c_contiguous:
            return "F"
        v = x.reshape(math.prod(od[:p]), math.prod(od[p:]))
        if v.flags.owndata or v.ctypes.data != x.ctypes.data:
            return None                                  # not a view: reshaping copied
        return "P" if v.strides[1] == v.itemsize and v.strides[0] % v.itemsize == 0 and v.strides[0] > 0 else "X"
    if not x.flags.c_contiguous:
        return None
    if all(d == 1 for d in xd[:p]) and xd[p:] == od[p:]:
        return "R"
    if all(d == 1 for d in xd[p:]) and xd[:p] == od[:p]:
        return "C"
    return None


def plan_operands(od: tuple, protos: list) -> tuple:
    """(C, kinds, copies): the column count, one kind per input, and the inputs that must be
    copied (broadcast) into a contiguous scratch first (read as F then)."""
    n = math.prod(od)
    if all(x.size == 1 or (tuple(x.shape) == od and x.flags.c_contiguous) for x in protos):
        return max(min(CHUNK, n), 1), "".join("S" if x.size == 1 and n != 1 else "F" for x in protos), ()
    best = None
    for p in range(len(od) + 1):
        kinds = [_kind(x, od, p) for x in protos]
        if None in kinds:
            continue
        rows, cols = math.prod(od[:p]), math.prod(od[p:])
        key = (min(rows, 256), cols)
        if best is None or key > best[0]:
            best = (key, cols, "".join(kinds))
    if best is not None:
        return max(best[1], 1), best[2], ()
    p = len(od) - 1 if od else 0
    kinds = [_kind(x, od, p) for x in protos]
    copies = tuple(i for i, kd in enumerate(kinds) if kd is None)
    return max(math.prod(od[p:]), 1), "".join(kd or "F" for kd in kinds), copies


def elementwise_step(program, protos: list, out: np.ndarray):
    """`fn(a, out, *ins)` running `program` on inputs laid out like `protos` into `out`, or
    None when the program is not native (the runner keeps numpy's kernel)."""
    if any(x.dtype.kind == "V" for x in protos):
        return None
    try:
        in_dts = [DType.parse(x.dtype) for x in protos]
        out_dt = DType.parse(out.dtype)
    except Exception:
        return None
    od = tuple(out.shape)
    n = out.size
    C, kinds, copies = plan_operands(od, protos)
    src = elementwise_source(program, in_dts, out_dt, kinds)
    if src is None:
        return None
    if n == 0:
        return lambda a, o, *ins: None
    mod = load_source(src)
    kernel = mod.par if n >= PAR_MIN else mod.ser
    rows = n // C if C else 0
    scratch = {i: np.empty(od, protos[i].dtype) for i in copies}
    convs = []
    for i, kd in enumerate(kinds):
        if i in scratch:
            s = scratch[i]
            convs.append(lambda x, s=s: (np.copyto(s, np.broadcast_to(x, od)), s.reshape(-1))[1])
        elif kd == "X":
            convs.append(lambda x: x.reshape(rows, C))
        elif kd == "P":
            convs.append(lambda x: _pitched(x.reshape(rows, C)))
        else:
            convs.append(_flat)
    o_flat = out.reshape(-1)
    pitched = [i for i, kd in enumerate(kinds) if kd == "P"]

    def operands(*ins):
        return (o_flat, n, C, *[f(x) for f, x in zip(convs, ins)], *[_pitch(ins[i], rows, C) for i in pitched])
    if scratch:                         # a broadcast copy reads its input every run: never bound
        return lambda a, o, *ins: kernel(*operands(*ins))
    return as_step(bindable(kernel, operands))


def _pitch(x, rows: int, cols: int) -> int:
    return x.reshape(rows, cols).strides[0] // x.itemsize


def _pitched(v: np.ndarray) -> np.ndarray:
    """Rows of `v` (contiguous, evenly apart) as one flat array from the first element to the
    last: the memory between rows is readable (it lies inside the view's own buffer)."""
    rows, cols = v.shape
    span = (rows - 1) * (v.strides[0] // v.itemsize) + cols if rows else 0
    return np.lib.stride_tricks.as_strided(v, (span,), (v.itemsize,))


def epilogue_step(out: np.ndarray, bias: list, act: str):
    """fn(*bias) adding the bias (if any) and applying `act` to `out` in place: a matmul's
    epilogue as one generated kernel. None when not native here."""
    program = (("binary", (("op", "add"),), (0, 1)),) if bias else ()
    if act != "identity":
        program += (("activation", (("fn", act),), (2 if program else 0,)),)
    if not program:
        return lambda *b: None
    step = elementwise_step(program, [out] + list(bias), out)
    return None if step is None else (lambda *b: step(None, None, out, *b))


def read_only(a):
    """A read-only view of an array (itself where it is read-only already, or not an array):
    weights memory-mapped from a file are read-only, ones derived at load (fused q/k/v,
    huge-page copies) or quantized in this process are not, and numba compiles a kernel once
    per flag (SmolLM2's first run compiled its packed GEMV twice, 2 s)."""
    if not isinstance(a, np.ndarray) or not a.flags.writeable:
        return a
    v = a.view()
    v.flags.writeable = False
    return v


def bindable(kernel, operands):
    """fn(*ins) calling kernel(*operands(*ins)), and fn.bind(*ins): that call with its
    operands taken once, for NumpyRunner's bound calls (buffers that never move: a decode
    step's reshapes and layout checks, hundreds a token, cost 5% of it)."""
    fn = lambda *ins: kernel(*operands(*ins))  # noqa: E731
    fn.bind = lambda *ins: functools.partial(kernel, *operands(*ins))
    return fn


def as_step(fn):
    """fn(*ins) as a runner step fn(a, out, *ins), keeping its `bind`."""
    step = lambda a, out, *ins: fn(*ins)  # noqa: E731
    if hasattr(fn, "bind"):
        step.bind = lambda a, out, *ins: fn.bind(*ins)
    return step


def with_epilogue(mm, out: np.ndarray, bias: list, act: str):
    """A matmul step: `mm(x, w)` writes `out`, then the generated bias/act epilogue; None when
    the epilogue cannot be generated (the step keeps the NumPy kernel)."""
    epi = epilogue_step(out, bias, act)
    if epi is None:
        return None

    def run(a_, o, x, w, *b):
        mm(x, w)
        epi(*b)

    def bind(a_, o, x, w, *b):          # NumpyRunner's bound calls: operands that never move
        m = mm.bind(x, w) if hasattr(mm, "bind") else functools.partial(mm, x, w)
        if not bias and act == "identity":
            return m
        e = functools.partial(epi, *b)
        return lambda: (m(), e())
    run.bind = bind
    return run


__all__ = ["ACT", "NUMBA", "NumbaRenderer", "SWIGLU", "as_step", "bindable", "epilogue_step",
           "BINARY", "COMPARE", "elementwise_source", "elementwise_step", "load_source",
           "plan_operands", "cache_dir", "with_epilogue"]
