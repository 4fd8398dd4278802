"""The expression table: every elementwise op's and activation's formula, written once.

An entry is a small expression tree built with Python operators (`0.5 * x * (1 + erf(x * c))`),
so it reads like the formula. Each backend renders the table in its dialect (CUDA C, OpenCL C,
numba, NumPy) with a `Renderer` that overrides only what differs there: how a primitive function
is spelled per compute dtype (`expf`/`exp`, `erf32`), literals, and, where a dialect keeps an
older form for bitwise-stable results, its own formula for one entry (`overrides`). A call of
another activation (`sigmoid(x)` in silu) is inlined unless the dialect spells it natively
(CUDA's `rlx_sigmoid`). So a new activation is one entry here plus its float64 reference
(rlx_core.testing.parity.REF_ACT); `check_dialect` renders every entry when a backend registers,
so a formula a dialect cannot write is an error then, not at a model's first run.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any

from .dtype import DType
from .errors import BackendError


# --------------------------------------------------------------------------- expressions
@dataclass(frozen=True)
class Expr:
    """A node: `var` (name), `const` (value), `call` (function name, args), `neg`, `add`, `sub`,
    `mul`, `div` (args), `cmp` (comparison name, args), `select` (cond, then, else)."""
    op: str
    args: tuple = ()
    name: Any = None

    def __add__(self, o): return Expr("add", (self, lift(o)))
    def __radd__(self, o): return Expr("add", (lift(o), self))
    def __sub__(self, o): return Expr("sub", (self, lift(o)))
    def __rsub__(self, o): return Expr("sub", (lift(o), self))
    def __mul__(self, o): return Expr("mul", (self, lift(o)))
    def __rmul__(self, o): return Expr("mul", (lift(o), self))
    def __truediv__(self, o): return Expr("div", (self, lift(o)))
    def __rtruediv__(self, o): return Expr("div", (lift(o), self))
    def __pow__(self, o): return call("pow", self, o)
    def __neg__(self): return Expr("neg", (self,))
    def __lt__(self, o): return Expr("cmp", (self, lift(o)), "lt")
    def __le__(self, o): return Expr("cmp", (self, lift(o)), "le")
    def __gt__(self, o): return Expr("cmp", (self, lift(o)), "gt")
    def __ge__(self, o): return Expr("cmp", (self, lift(o)), "ge")


def lift(v) -> Expr:
    if isinstance(v, Expr):
        return v
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return Expr("const", (), v)
    raise TypeError(f"expression operand must be an Expr or a number, got {v!r}")


def var(name: str) -> Expr:
    return Expr("var", (), name)


def call(name: str, *args) -> Expr:
    return Expr("call", tuple(lift(a) for a in args), name)


def select(cond: Expr, a, b) -> Expr:
    """`a` where `cond` holds, else `b` (C's ?:, NumPy's where)."""
    return Expr("select", (cond, lift(a), lift(b)))


def eq(a, b) -> Expr:
    return Expr("cmp", (lift(a), lift(b)), "eq")


def ne(a, b) -> Expr:
    return Expr("cmp", (lift(a), lift(b)), "ne")


def _fn(name):
    return lambda *args: call(name, *args)


# primitive functions: a dialect must spell each one an entry it renders uses; `max`/`min`
# propagate NaN (numpy's maximum/minimum), `floordiv` is integer division rounding down
exp, log, tanh, erf, sqrt, sin, cos = (_fn(n) for n in ("exp", "log", "tanh", "erf", "sqrt", "sin", "cos"))
fabs, maximum, minimum, floordiv, isnan = (_fn(n) for n in ("abs", "max", "min", "floordiv", "isnan"))
# other activations, by name: inlined unless the dialect spells them (a helper function)
sigmoid, silu = _fn("sigmoid"), _fn("silu")

CMP_OPS = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}


# --------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Entry:
    """One op's formula: `expr` for float (and complex) values, `int_expr` for integers (None:
    floats only). `vjp`: an activation's input cotangent from x, its output y and the output's
    cotangent g (autodiff builds it as graph ops)."""
    kind: str            # activation | binary | compare | fused_swiglu
    name: str
    expr: Expr
    int_expr: Expr | None = None
    vjp: Expr | None = None

    @property
    def variables(self) -> tuple:
        return ("x",) if self.kind == "activation" else ("a", "b")


x, y, g, a, b = (var(n) for n in ("x", "y", "g", "a", "b"))
SQRT1_2 = math.sqrt(0.5)                    # 1/sqrt(2), correctly rounded
GELU_C = math.sqrt(2 / math.pi)
_GELU_TANH_T = tanh(GELU_C * (x + 0.044715 * x * x * x))


def _act(name, expr, int_expr=None, vjp=None) -> Entry:
    return Entry("activation", name, expr, int_expr, vjp)


ACTIVATION_TABLE = {e.name: e for e in (
    _act("gelu", 0.5 * x * (1 + erf(x * SQRT1_2)),
         # Phi(x) + x phi(x), with Phi = gelu(x) / x (0.5 at 0): no erf needed
         vjp=g * (select(eq(x, 0.0), 0.5, y / select(eq(x, 0.0), 1.0, x))
                  + x * exp(x * x * -0.5) * (1.0 / math.sqrt(2 * math.pi)))),
    _act("gelu_tanh", 0.5 * x * (1 + _GELU_TANH_T),
         vjp=g * (0.5 * (1.0 + _GELU_TANH_T) + 0.5 * x * (1.0 - _GELU_TANH_T * _GELU_TANH_T) * GELU_C
                  * (1.0 + 3 * 0.044715 * x * x))),
    _act("silu", x * sigmoid(x), vjp=g * (sigmoid(x) * (1.0 + x * (1.0 - sigmoid(x))))),
    _act("relu", maximum(x, 0), maximum(x, 0), vjp=select(x > 0.0, g, 0.0)),
    _act("sigmoid", 1 / (1 + exp(-x)), vjp=g * (y * (1.0 - y))),
    _act("tanh", tanh(x), vjp=g * (1.0 - y * y)),
    _act("exp", exp(x), vjp=g * y),
    _act("log", log(x), vjp=g * call("recip", x)),
    _act("sqrt", sqrt(x), vjp=g * (0.5 / y)),
    _act("rsqrt", 1 / sqrt(x), vjp=g * ((y * -0.5) / x)),
    _act("neg", -x, -x, vjp=-g),
    _act("abs", fabs(x), select(x < 0, -x, x), vjp=select(x < 0.0, -g, g)),
    _act("sin", sin(x), vjp=g * cos(x)),
    _act("cos", cos(x), vjp=g * -sin(x)),
    _act("recip", 1 / x, vjp=g * -(y * y)),
    _act("identity", x, x, vjp=g),
    _act("quick_gelu", x * sigmoid(1.702 * x),          # HF's quick_gelu (CLIP)
         vjp=g * (sigmoid(1.702 * x) * (1.0 + 1.702 * x * (1.0 - sigmoid(1.702 * x))))),
)}
BINARY_TABLE = {e.name: e for e in (
    Entry("binary", "add", a + b, a + b), Entry("binary", "sub", a - b, a - b),
    Entry("binary", "mul", a * b, a * b), Entry("binary", "div", a / b, floordiv(a, b)),
    Entry("binary", "max", maximum(a, b), maximum(a, b)),
    Entry("binary", "min", minimum(a, b), minimum(a, b)),
    Entry("binary", "pow", a ** b, a ** b),
)}
COMPARE_TABLE = {n: Entry("compare", n, Expr("cmp", (a, b), n), Expr("cmp", (a, b), n)) for n in CMP_OPS}
SWIGLU = Entry("fused_swiglu", "fused_swiglu", silu(a) * b)
TABLE = {**{("activation", n): e for n, e in ACTIVATION_TABLE.items()},
         **{("binary", n): e for n, e in BINARY_TABLE.items()},
         **{("compare", n): e for n, e in COMPARE_TABLE.items()},
         ("fused_swiglu", "fused_swiglu"): SWIGLU}

ACTIVATIONS = tuple(ACTIVATION_TABLE)
INT_OK_ACTIVATIONS = tuple(n for n, e in ACTIVATION_TABLE.items() if e.int_expr is not None)


def entry(kind: str, name: str) -> Entry:
    try:
        return TABLE[(kind, name)]
    except KeyError:
        raise BackendError(f"no {kind} {name!r} in the expression table") from None


def substitute(e: Expr, values: dict) -> Expr:
    """`e` with its variables replaced by the expressions in `values`."""
    if e.op == "var":
        return values.get(e.name, e)
    if not e.args:
        return e
    return Expr(e.op, tuple(substitute(c, values) for c in e.args), e.name)


# --------------------------------------------------------------------------- renderers
class MissingFunction(Exception):
    """A formula calls a function the dialect does not spell (internal: becomes BackendError)."""


_INT_DTYPES = (DType.I8, DType.I16, DType.I32, DType.I64, DType.U8, DType.U32, DType.BOOL)


class Renderer(abc.ABC):
    """Writes table entries in one dialect. Subclasses set `functions` (primitive -> spelling,
    or a method `function(name, dtype)` for spellings that depend on the dtype) and may set
    `overrides` (activation -> the dialect's own float formula, each with its reason)."""
    name = "expression"          # "the <name> renderer" in errors
    dtypes: tuple = ()           # compute dtypes it renders (check_dialect covers these)
    functions: dict = {}
    overrides: dict = {}

    def function(self, name: str, dt: DType):
        return self.functions.get(name)

    def formula(self, e: Entry, dt: DType) -> Expr:
        if dt in _INT_DTYPES:
            if e.int_expr is None:
                raise BackendError(f"{e.kind} {e.name!r} needs a float input, got {dt.value}")
            return e.int_expr
        return self.overrides.get(e.name, e.expr) if e.kind == "activation" else e.expr

    def covers(self, e: Entry, dt: DType) -> bool:
        return dt not in _INT_DTYPES or e.int_expr is not None

    def resolve(self, e: Expr, dt: DType, inlining: tuple = ()):
        """(spelling, None) for a call the dialect spells, else (None, the inlined formula)."""
        spelling = self.function(e.name, dt)
        if spelling is not None:
            return spelling, None
        act = ACTIVATION_TABLE.get(e.name)
        if act is None or e.name in inlining:
            raise MissingFunction(e.name)
        return None, substitute(self.formula(act, dt), dict(zip(act.variables, e.args)))

    def root(self, e: Entry, dt: DType) -> tuple:
        """(expression, activations being inlined) to render for entry `e`: an activation is a
        call of itself, so a dialect that spells it (CUDA's rlx_sigmoid) writes the call."""
        if e.kind != "activation":
            return self.formula(e, dt), ()
        expr, inlining = call(e.name, var("x")), tuple[str, ...]()
        while expr.op == "call" and expr.name in ACTIVATION_TABLE and self.function(expr.name, dt) is None:
            name = expr.name
            _, expr = self.resolve(expr, dt, inlining)
            inlining += (name,)
        return expr, inlining

    @abc.abstractmethod
    def check(self, e: Entry, dt: DType, backend: str) -> None:
        """Render entry `e` in `dt` (BackendError naming `backend` if the dialect cannot)."""

    def error(self, e: Entry, dt: DType, missing: str, backend: str | None) -> BackendError:
        who = f"backend {backend!r}" if backend else f"the {self.name} renderer"
        return BackendError(f"{who}: {e.kind} {e.name!r} ({dt.value}) needs function {missing!r}, "
                            f"which the {self.name} renderer does not define")


VAR, ATOM, NEG, MUL, ADD, CMP, LOW = 101, 100, 90, 80, 70, 60, 0     # binding strength
_PREC = {"add": ADD, "sub": ADD, "mul": MUL, "div": MUL}
_SYM = {"add": "+", "sub": "-", "mul": "*", "div": "/"}


def _enclosed(s: str) -> bool:
    """Whether `s` is one parenthesized group, "(...)"."""
    if not (s.startswith("(") and s.endswith(")")):
        return False
    depth = 0
    for i, ch in enumerate(s):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0 and i < len(s) - 1:
            return False
    return True


class TextRenderer(Renderer):
    """Renders to source text with the fewest parentheses precedence needs. A spelling is a
    function name ("expf" -> `expf(x)`) or a template with {0}, {1} ("{0} ** {1}"); `{ct}` in
    it is the C type of the compute dtype."""
    wrap_top = True              # parenthesize a whole compound expression
    wrap_var = False             # ... and a bare variable
    wrap_inlined = False         # parenthesize an inlined activation like the call it replaces

    def render(self, kind: str, name: str, dt: DType, backend: str | None = None, **values: str) -> str:
        """Entry (kind, name) computed in `dt`, its variables bound to the source strings
        `values` (each used as an atom: the caller parenthesizes)."""
        e = entry(kind, name)
        try:
            expr, inlining = self.root(e, dt)
            s, p = self._r(expr, dt, values, inlining)
        except MissingFunction as m:
            raise self.error(e, dt, str(m), backend) from None
        if self.wrap_top and (p < ATOM or (self.wrap_var and p == VAR)):
            return f"({s})"
        return s

    def check(self, e: Entry, dt: DType, backend: str) -> None:
        self.render(e.kind, e.name, dt, backend, **{v: v for v in e.variables})

    def ctype(self, dt: DType) -> str:
        return dt.value

    @abc.abstractmethod
    def const(self, v, dt: DType) -> str:
        """The literal `v` of type `dt` in the dialect."""

    def select(self, c: str, a: str, b: str) -> str:
        return f"({c} ? {a} : {b})"

    def _r(self, e: Expr, dt: DType, values: dict, inlining: tuple) -> tuple:
        op = e.op
        if op == "var":
            return values[e.name], VAR
        if op == "const":
            s = self.const(e.name, dt)
            return s, NEG if s.startswith("-") else ATOM
        if op == "call":
            spelling, inlined = self.resolve(e, dt, inlining)
            if inlined is not None:
                s, p = self._r(inlined, dt, values, inlining + (e.name,))
                return (f"({s})", ATOM) if self.wrap_inlined and p < ATOM else (s, p)
            args = [self._r(c, dt, values, inlining) for c in e.args]
            spelling = spelling.replace("{ct}", self.ctype(dt))
            if "{0}" in spelling:
                s = spelling.format(*[t if p >= ATOM else f"({t})" for t, p in args])
                return s, ATOM if _enclosed(s) else LOW
            return f"{spelling}({', '.join(t for t, _ in args)})", ATOM
        if op == "neg":
            t, p = self._r(e.args[0], dt, values, inlining)
            return f"-{t if p > NEG else f'({t})'}", NEG
        if op == "select":
            (c, _), (t, _), (f, _) = (self._r(c, dt, values, inlining) for c in e.args)
            return self.select(c, t, f), ATOM
        if op == "cmp":
            (l, pl), (r, pr) = (self._r(c, dt, values, inlining) for c in e.args)
            return f"{l if pl > CMP else f'({l})'} {CMP_OPS[e.name]} {r if pr > CMP else f'({r})'}", CMP
        prec = _PREC[op]
        (l, pl), (r, pr) = (self._r(c, dt, values, inlining) for c in e.args)
        return f"{l if pl >= prec else f'({l})'} {_SYM[op]} {r if pr > prec else f'({r})'}", prec


class CRenderer(TextRenderer):
    """C99 (the base of CUDA C and OpenCL C): libm names, `f`-suffixed float literals."""
    name = "C"
    CT = {DType.F32: "float", DType.F64: "double", DType.I8: "signed char", DType.I16: "short",
          DType.I32: "int", DType.I64: "long long", DType.U8: "unsigned char", DType.U32: "unsigned int",
          DType.BOOL: "bool"}
    LIBM = ("exp", "log", "tanh", "erf", "sqrt", "sin", "cos", "pow")

    def ctype(self, dt: DType) -> str:
        return self.CT[dt]

    def function(self, name: str, dt: DType):
        if name in self.functions:
            return self.functions[name]
        if dt is DType.F64 and name in self.LIBM:
            return name
        if dt is DType.F32 and name in self.LIBM:
            return name + "f"
        if name == "abs" and dt in (DType.F32, DType.F64):
            return "fabsf" if dt is DType.F32 else "fabs"
        return None

    def const(self, v, dt: DType) -> str:
        if dt in _INT_DTYPES:
            return str(int(v))
        s = repr(float(v))
        return s + "f" if dt is DType.F32 else s


def check_dialect(renderer: Renderer, backend: str) -> None:
    """Render every table entry for every dtype `renderer` covers; a formula the dialect cannot
    write raises BackendError naming the backend, the op and the missing function."""
    for e in TABLE.values():
        for dt in renderer.dtypes:
            if renderer.covers(e, dt):
                renderer.check(e, dt, backend)


# --------------------------------------------------------------------------- NumPy
class NumpyRenderer(TextRenderer):
    """NumPy: an entry becomes a Python lambda over arrays (ufuncs, operators, Python literals,
    which NumPy casts to the array's dtype), or the ufunc itself when the formula is one ufunc of
    the variables (so callers may pass out=). `functions` adds or replaces spellings with
    callables (numpy_kernels: erf, the tanh-identity sigmoid)."""
    name = "NumPy"
    dtypes = (DType.F32, DType.F64, DType.I32, DType.I64)
    wrap_top = False
    UFUNCS = {"exp": "exp", "log": "log", "tanh": "tanh", "sqrt": "sqrt", "sin": "sin", "cos": "cos",
              "abs": "abs", "pow": "power", "max": "maximum", "min": "minimum",
              "floordiv": "floor_divide", "isnan": "isnan"}

    def __init__(self, functions: dict | None = None):
        import numpy as np

        self.namespace = {"np": np, **{f"_{k}": v for k, v in (functions or {}).items()}}
        self.functions = {**{k: f"np.{v}" for k, v in self.UFUNCS.items()},
                          **{k: f"_{k}" for k in (functions or {})}}

    OPS = {"add": "add", "sub": "subtract", "mul": "multiply", "div": "divide", "neg": "negative",
           "eq": "equal", "ne": "not_equal", "lt": "less", "le": "less_equal", "gt": "greater",
           "ge": "greater_equal"}

    def const(self, v, dt: DType) -> str:
        return str(int(v)) if dt in _INT_DTYPES else repr(float(v))

    def select(self, c: str, a: str, b: str) -> str:
        return f"np.where({c}, {a}, {b})"

    def _r(self, e: Expr, dt: DType, values: dict, inlining: tuple) -> tuple:
        """Arithmetic and comparisons as ufunc calls: `a + b` is np.add(a, b), a ufunc itself."""
        if e.op not in ("add", "sub", "mul", "div", "neg", "cmp"):
            return super()._r(e, dt, values, inlining)
        args = ", ".join(self._r(c, dt, values, inlining)[0] for c in e.args)
        return f"np.{self.OPS[e.name if e.op == 'cmp' else e.op]}({args})", ATOM

    def check(self, e: Entry, dt: DType, backend: str) -> None:
        self.source(e, dt, backend)

    def source(self, e: Entry, dt: DType, backend: str | None = None) -> str:
        return self.render(e.kind, e.name, dt, backend, **{v: v for v in e.variables})

    def build(self, kind: str, name: str, dt: DType | None = None, backend: str | None = None):
        """The callable for entry (kind, name) computed in `dt`; without `dt`, one that runs
        the integer formula on integer (and bool) arrays when that differs."""
        e = entry(kind, name)
        if dt is not None:
            return self._callable(e, self.source(e, dt, backend))
        text = self.source(e, DType.F64, backend)
        f = self._callable(e, text)
        if e.int_expr is None or self.source(e, DType.I64, backend) == text:
            return f
        i = self._callable(e, self.source(e, DType.I64, backend))
        return lambda *xs: (i if xs[0].dtype.kind in "iub" else f)(*xs)

    def _callable(self, e: Entry, text: str):
        args = ", ".join(e.variables)
        head, _, rest = text.partition("(")
        if rest == f"{args})" and head.replace(".", "").replace("_", "").isalnum():
            return eval(head, self.namespace)          # one ufunc (or kernel) of the variables
        return eval(f"lambda {args}: {text}", self.namespace)


__all__ = ["Expr", "Entry", "Renderer", "TextRenderer", "CRenderer", "NumpyRenderer", "TABLE",
           "ACTIVATION_TABLE", "BINARY_TABLE", "COMPARE_TABLE", "SWIGLU", "ACTIVATIONS",
           "INT_OK_ACTIVATIONS", "check_dialect", "entry", "substitute", "var", "call", "select",
           "eq", "ne", "lift"]
