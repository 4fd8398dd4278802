"""Core's row-kernel description (rlx_core.ir.rowkernels): what a dialect must supply, and that
the formulas mean what numpy means. The dialects' renderings are tested in the plugins."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

from rlx_core.ir import rowkernels as rk
from rlx_core.ir.errors import BackendError
from rlx_core.ir.ops import REDUCE_OPS


class _Bare(rk.RowDialect):
    name = "bare"


class _Py(rk.RowDialect):
    """Just enough of a dialect to evaluate the formulas as Python expressions."""
    name = "py"
    spell = {"max": "_max", "min": "_min", "lowest": "-math.inf", "highest": "math.inf"}

    def helper_head(self, ret, name, params):
        return f"{ret} {name}({params})"


def _max(a, b):          # NaN-propagating, like MAXP / rlx_max
    return a if a != a else b if b != b else max(a, b)


def _min(a, b):
    return a if a != a else b if b != b else min(a, b)


def _py(expr: str) -> str:
    """A C expression of the formulas (casts to ACC, && || !) as Python."""
    expr = expr.replace("(ACC)", "").replace("&&", " and ").replace("||", " or ")
    expr = re.sub(r"\btrue\b", "True", re.sub(r"\bfalse\b", "False", expr))
    return re.sub(r"!(?!=)", " not ", expr)


def _eval(expr: str, **names):
    return eval(_py(expr), {"math": math, "_max": _max, "_min": _min}, names)


def _pick(chain: str, code: int) -> str:
    """The alternative that C's right-nested `op == k ? e : ...` chooses for op == code."""
    chain = chain.strip()
    if chain.startswith("(op =="):
        chain = chain[1:-1]
    while (m := re.match(r"op == (\d+) \? (.+?) : (.*)$", chain, re.S)):
        if int(m[1]) == code:
            return m[2]
        chain = m[3]
    return chain


def test_reductions_are_core_ops():
    assert tuple(rk.REDUCTIONS) == REDUCE_OPS


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_each_reduction_folds_like_numpy(op, rng):
    d = _Py()
    x = rng.standard_normal(37)
    _, ident, comb, finish = d.reduction(op)
    acc = _eval(ident)
    for v in x:
        acc = _eval(comb("a", "b"), a=acc, b=float(v))
    got = _eval(finish("r"), r=acc, n=len(x))
    want = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}[op](x.astype(np.float64))
    assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("op", ["max", "min"])
def test_max_min_keep_nan(op):
    d = _Py()
    _, ident, comb, _ = d.reduction(op)
    acc = _eval(ident)
    for v in (1.0, float("nan"), 3.0):
        acc = _eval(comb("a", "b"), a=acc, b=v)
    assert math.isnan(acc)


def _c_function(text: str):
    """A bool function's C statements (if-return, const bool declarations, return) as Python."""
    lines = []
    for st in text.strip().splitlines():
        st = st.strip().rstrip(";")
        if (m := re.match(r"if \((.*)\) return (.*)$", st)):
            lines.append(f"if {_py(m[1])}: return {_py(m[2])}")
        elif st.startswith("const bool "):
            lines += [decl.strip() for decl in st[len("const bool "):].split(",")]
        else:
            assert st.startswith("return "), st
            lines.append(_py(st))
    scope: dict = {}
    exec("def f(v, i, b, j):\n" + "".join(f"    {ln}\n" for ln in lines), {}, scope)
    return scope["f"]


def _beats(v, i, b, j) -> bool:
    return _c_function(rk.ARGMAX_BEATS.format(v="v", i="i", b="b", j="j"))(v, i, b, j)


@pytest.mark.parametrize("row", [[1.0, 3.0, 3.0, 2.0], [1.0, float("nan"), 5.0, float("nan")], [-1.0, -1.0],
                                 [float("-inf"), float("-inf")]])
def test_argmax_order_is_numpys(row):
    bv, bi = 0.0, -1
    for j, v in enumerate(row):
        if _beats(v, j, bv, bi):
            bv, bi = v, j
    assert bi == int(np.argmax(np.array(row)))


@pytest.mark.parametrize("cmp, key", [(">", lambda x: x), ("<", lambda x: -x)])
def test_topk_order_is_numpys_stable_argsort_of_minus_x(cmp, key, rng):
    """Both dialects' orders (values with >, negated keys with <) give numpy's order."""
    before = _c_function(rk.TOPK_BEFORE.format(a="v", i="i", b="b", j="j", cmp=cmp))
    x = np.round(rng.standard_normal(40), 1)           # ties
    x[[3, 17]] = np.nan
    x[[5, 6]] = [-0.0, 0.0]
    keys = [key(float(v)) for v in x]
    order, prev = [], None
    for _ in range(len(x)):                             # the kernel's passes: the first after the last pick
        best = None
        for j, kv in enumerate(keys):
            if prev is not None and not before(keys[prev], prev, kv, j):
                continue
            if best is None or before(kv, j, keys[best], best):
                best = j
        order.append(best)
        prev = best
    assert order == list(np.argsort(-x, kind="stable"))


def test_a_dialect_without_a_hook_is_named():
    with pytest.raises(BackendError, match=r"dialect 'bare' has no 'loop' hook"):
        rk.softmax(_Bare())
    with pytest.raises(BackendError, match=r"dialect 'bare' has no 'reduction chosen at run time' hook"):
        _Bare().reduction(None)


def test_unknown_kind_or_op_is_named():
    with pytest.raises(BackendError, match=r"no kind 'cumsum'"):
        rk.row_kernel(_Bare(), "cumsum")
    with pytest.raises(BackendError, match=r"reduce: no op 'median'"):
        rk.reduce(_Bare(), "median")


def test_switched_reduction_picks_each_op_by_code():
    d = _Py()
    prologue, ident, comb, finish = d.switched_reduction("op")
    assert comb("x", "y") == "red_comb(op, x, y)"
    chain = prologue.split("return ", 1)[1].rsplit(";", 1)[0]
    for code, red in enumerate(rk.REDUCTIONS.values()):
        assert _eval(_pick(chain, code), a=2.0, b=5.0) == _eval(d.fill(red.combine, a="a", b="b"), a=2.0, b=5.0)
        assert _eval(_pick(ident, code)) == _eval(d.fill(red.identity))
        assert _eval(_pick(finish("r"), code), r=6.0, n=3) == _eval(d.fill(red.finish, r="r"), r=6.0, n=3)
