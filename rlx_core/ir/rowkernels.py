"""The row-reduction kernels written once for the C-family GPU dialects (issue 43).

softmax, reduce, argmax and topk are each one skeleton here: every thread of a row's group walks a
strided share of the row (elements tid, tid + nt, ... in order), the group combines the
threads' values (a tree that halves the active threads each step: value[t] = f(value[t],
value[t + h]) for h = nt/2, nt/4, ..., 1, or the dialect's own block reduction), and one
thread finishes and stores the row's result. A `RowDialect` (one per backend: CUDA, OpenCL)
supplies only what differs between dialects -- the kernel's head and how it finds its row,
the thread index, barriers, the block-wide sum/max (CUDA's warp shuffles), helper spellings --
and phases of its own (CUDA's rows split over several blocks). The formulas (identities,
combines, finishes, argmax's and topk's orders) are written here once, so both dialects reduce
in the same order they did when each had its own copy. topk's comparison is the dialect's:
OpenCL orders keys -x ascending (numpy's argsort of -x, which wraps on unsigned and integer
minimum values), CUDA orders values descending.

cumsum is not here: a serial scan per row on OpenCL, a blocked two-level scan on CUDA (different
rounding), each dialect keeps its own.

Expressions are C text; ACC names the accumulation type, which each program defines.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import BackendError

# --------------------------------------------------------------------------- formulas


@dataclass(frozen=True)
class Reduction:
    """One reduce op: `identity` (an accumulator no element changed), `combine` of the C
    expressions {a} and {b}, `finish` of the combined row {r} and its length n. {max}, {min},
    {lowest} and {highest} are the dialect's spellings (NaN-propagating max/min, the ACC's
    extremes)."""
    identity: str
    combine: str
    finish: str = "{r}"


# The order is the runtime op code of dialects that switch on it (OpenCL's `op` argument).
REDUCTIONS = {
    "sum": Reduction("(ACC)0", "({a}) + ({b})"),
    "mean": Reduction("(ACC)0", "({a}) + ({b})", "({r} / (ACC)n)"),
    "max": Reduction("{lowest}", "{max}(({a}), ({b}))"),
    "min": Reduction("{highest}", "{min}(({a}), ({b}))"),
    "prod": Reduction("(ACC)1", "({a}) * ({b})"),
}

# argmax's order: whether candidate ({v}, {i}) beats the pick ({b}, {j}); an index < 0 is no
# element. NaN is the largest value, the first index wins ties (numpy's argmax).
ARGMAX_BEATS = """\
  if ({i} < 0) return false;
  if ({j} < 0) return true;
  const bool vn = {v} != {v}, bn = {b} != {b};
  if (vn != bn) return vn;
  if (!vn && {v} != {b}) return {v} > {b};
  return {i} < {j};"""

# topk's order: whether ({a}, {i}) comes before ({b}, {j}) (both real picks); NaN last, then by
# key ({cmp} is the dialect's: > on values, or < on keys that negate them), the first index on ties.
TOPK_BEFORE = """\
  const bool n1 = {a} != {a}, n2 = {b} != {b};
  if (n1 != n2) return !n1;
  if (!n1 && {a} != {b}) return {a} {cmp} {b};
  return {i} < {j};"""

# --------------------------------------------------------------------------- dialect


class RowDialect:
    """What a dialect supplies. Every hook returns C text; a hook a dialect lacks is a
    BackendError naming the dialect and the hook (found when the backend first renders)."""

    name = "?"
    tid = ""            # this thread's index in its row's group
    nt = ""             # the group's size
    inf = ""            # +infinity of ACC's type
    spell: dict = {}    # {max}, {min}, {lowest}, {highest} of the formulas

    def _missing(self, hook: str):
        return BackendError(f"row kernels: dialect {self.name!r} has no {hook!r} hook")

    def kernel(self, name: str, ins: tuple, outs: tuple, scalars: tuple, shared: tuple, body: str) -> str:
        """The kernel `name` around `body`: head, the row's setup (its operands' addresses
        and the `shared` arrays, (type, name) indexed by `tid`), then body."""
        raise self._missing("kernel")

    def helper_head(self, ret: str, name: str, params: str) -> str:
        """The head of a device function (its qualifiers, type, name and parameters)."""
        raise self._missing("helper_head")

    def loop(self, var: str, chunked: bool) -> str:
        """The head of the loop over this thread's share of the row (`chunked`: the kernel
        can split a row over several groups)."""
        raise self._missing("loop")

    def barrier(self) -> str:
        raise self._missing("barrier")

    def load(self, operand: str, j: str) -> str:
        """Element j of input row `operand`, as ACC."""
        raise self._missing("load")

    def store(self, operand: str, j: str, value: str) -> str:
        """The statement storing ACC `value` (rounded to the output's type) at element j."""
        raise self._missing("store")

    def block_max(self, var: str) -> str:
        """The statement setting `var` in every thread to the group's NaN-propagating max."""
        raise self._missing("block_max")

    def block_sum(self, var: str) -> str:
        raise self._missing("block_sum")

    def reduction(self, op: str | None) -> tuple:
        """(prologue, identity, combine(a, b), finish(r)) of reduce op `op`, fixed when the
        program is built; a dialect that takes the op at run time (`op` None) overrides this
        with `switched_reduction`."""
        if op is None:
            raise self._missing("reduction chosen at run time")
        red = REDUCTIONS[op]
        return ("", self.fill(red.identity), lambda a, b: "(" + self.fill(red.combine, a=a, b=b) + ")",
                lambda r: self.fill(red.finish, r=r))

    def switched_reduction(self, code: str = "op") -> tuple:
        """reduction() over every op, chosen by the runtime code `code` (REDUCTIONS' order):
        the combine is one helper, red_comb."""
        ops = list(REDUCTIONS.values())

        def chain(pick) -> str:
            last = pick(ops[-1])
            alts = [(k, pick(r)) for k, r in enumerate(ops[:-1]) if pick(r) != last]
            return "".join(f"{code} == {k} ? {e} : " for k, e in alts) + last

        comb = chain(lambda r: "(" + self.fill(r.combine, a="a", b="b") + ")")
        prologue = f"{self.helper_head('ACC', 'red_comb', f'int {code}, ACC a, ACC b')} {{\n  return {comb};\n}}\n"
        ident = "(" + chain(lambda r: self.fill(r.identity)) + ")"
        return (prologue, ident, lambda a, b: f"red_comb({code}, {a}, {b})",
                lambda r: "(" + chain(lambda red: self.fill(red.finish, r=r)) + ")")

    def reduce_result(self, result: str, red: tuple) -> str:
        """The statements after the tree: finish and store the row's result `result` (the
        tree's slot 0); a dialect adds its own phases (CUDA: merging a split row)."""
        raise self._missing("reduce_result")

    def argmax_result(self, value: str, index: str) -> str:
        raise self._missing("argmax_result")

    # topk: the key a row's element is ordered by, how keys compare, the index type, the store
    topk_cmp = ""           # ">" (larger key first) or "<"
    topk_index = ""         # C type of an element index

    def topk_key(self, j: str) -> str:
        """Element j of input row x as the ACC key topk orders by."""
        raise self._missing("topk_key")

    def topk_store(self, r: str, index: str) -> str:
        """The statement storing pick `r` of the row: x's element `index` and the index."""
        raise self._missing("topk_store")

    def fill(self, template: str, **kw) -> str:
        """A formula with the dialect's spellings and the given names filled in."""
        return template.format(**{**self.spell, **kw})


# --------------------------------------------------------------------------- skeletons


def _tree(d: RowDialect, step) -> str:
    """The group's tree over the shared arrays: the statement `step(t, u)` (u = t + h) runs
    while the active half shrinks, h = nt/2, nt/4, ..., 1."""
    t = d.tid
    return (f"  for (int h = {d.nt} >> 1; h > 0; h >>= 1) {{\n"
            f"    {step(t, f'{t} + h')}\n"
            f"    {d.barrier()}\n"
            f"  }}\n")


def softmax(d: RowDialect) -> str:
    """y = exp(x - max) / sum(exp(x - max)) along the row; a row without a finite max uses
    0 (so an all -inf row is 0 / 1 = 0, a NaN row stays NaN), a zero sum 1."""
    loop, x = d.loop("j", False), d.load("x", "j")
    body = (f"  ACC mx = -{d.inf};\n"
            f"  {loop} {{ ACC v = {x}; mx = {d.fill('{max}')}(mx, v); }}\n"
            f"  {d.block_max('mx')}\n"
            f"  if (!(mx > -{d.inf} && mx < {d.inf})) mx = 0;\n"
            f"  ACC s = 0;\n"
            f"  {loop} s += exp({x} - mx);\n"
            f"  {d.block_sum('s')}\n"
            f"  if (s == 0) s = 1;\n"
            f"  {loop} {d.store('y', 'j', f'exp({x} - mx) / s')};\n")
    return d.kernel("softmax", ("x",), ("y",), (), (), body)


def reduce(d: RowDialect, op: str | None) -> str:
    """One REDUCTIONS op over the row (`op` None: the op is a runtime argument)."""
    if op is not None and op not in REDUCTIONS:
        raise BackendError(f"reduce: no op {op!r} (ops: {', '.join(REDUCTIONS)})")
    red = d.reduction(op)
    prologue, ident, comb, _ = red
    t = d.tid
    body = (f"  ACC a = {ident};\n"
            f"  {d.loop('j', True)} {{ ACC v = {d.load('x', 'j')}; a = {comb('a', 'v')}; }}\n"
            f"  sh[{t}] = a;\n"
            f"  {d.barrier()}\n"
            + _tree(d, lambda t, u: f"if ({t} < h) sh[{t}] = {comb(f'sh[{t}]', f'sh[{u}]')};")
            + d.reduce_result("sh[0]", red))
    scalars = (("int", "op"),) if op is None else ()
    return prologue + d.kernel("reduce", ("x",), ("y",), scalars, (("ACC", "sh"),), body)


def argmax(d: RowDialect) -> str:
    """The index of the row's largest value (ARGMAX_BEATS's order)."""
    beats = (f"{d.helper_head('bool', 'rlx_beats', 'ACC v, int i, ACC b, int j')} {{\n"
             f"{d.fill(ARGMAX_BEATS, v='v', i='i', b='b', j='j')}\n}}\n")
    t = d.tid
    body = (f"  ACC bv = 0; int bi = -1;\n"
            f"  {d.loop('j', True)} {{\n"
            f"    ACC v = {d.load('x', 'j')};\n"
            f"    if (rlx_beats(v, j, bv, bi)) {{ bv = v; bi = j; }}\n"
            f"  }}\n"
            f"  sh[{t}] = bv; si[{t}] = bi;\n"
            f"  {d.barrier()}\n"
            + _tree(d, lambda t, u: f"if ({t} < h && rlx_beats(sh[{u}], si[{u}], sh[{t}], si[{t}])) "
                                    f"{{ sh[{t}] = sh[{u}]; si[{t}] = si[{u}]; }}")
            + d.argmax_result("sh[0]", "si[0]"))
    return beats + d.kernel("argmax", ("x",), ("y",), (), (("ACC", "sh"), ("int", "si")), body)


def topk(d: RowDialect) -> str:
    """The k first elements of the row in TOPK_BEFORE's order, with their indices: k passes,
    each the group's first element strictly after the previous pass's pick."""
    ix = d.topk_index
    before = (f"{d.helper_head('bool', 'rlx_better', f'ACC a, {ix} i, ACC b, {ix} j')} {{\n"
              f"{d.fill(TOPK_BEFORE, a='a', i='i', b='b', j='j', cmp=d.topk_cmp)}\n}}\n")
    t = d.tid
    body = (f"  ACC pv = 0; {ix} pi = -1;\n"
            f"  for (int r = 0; r < k; ++r) {{\n"
            f"    ACC bv = 0; {ix} bi = -1;\n"
            f"    {d.loop('j', False)} {{\n"
            f"      ACC v = {d.topk_key('j')};\n"
            f"      if (pi >= 0 && !rlx_better(pv, pi, v, j)) continue;\n"
            f"      if (bi < 0 || rlx_better(v, j, bv, bi)) {{ bv = v; bi = j; }}\n"
            f"    }}\n"
            f"    sh[{t}] = bv; si[{t}] = bi;\n"
            f"    {d.barrier()}\n"
            + "".join("  " + line + "\n" for line in _tree(d, lambda t, u: (
                f"if ({t} < h) {{ ACC v = sh[{u}]; {ix} i = si[{u}]; "
                f"if (i >= 0 && (si[{t}] < 0 || rlx_better(v, i, sh[{t}], si[{t}]))) {{ sh[{t}] = v; si[{t}] = i; }} }}"
            )).rstrip("\n").split("\n"))
            + f"    pv = sh[0]; pi = si[0];\n"
            f"    {d.topk_store('r', 'pi')}\n"
            f"    {d.barrier()}\n"
            f"  }}\n")
    return before + d.kernel("topk", ("x",), ("y", "yi"), (("int", "k"),), (("ACC", "sh"), (ix, "si")), body)


KINDS = ("softmax", "reduce", "argmax", "topk")


def row_kernel(d: RowDialect, kind: str, op: str | None = None) -> str:
    """The source of row kernel `kind` (KINDS) in dialect `d`."""
    if kind == "reduce":
        return reduce(d, op)
    if kind == "softmax":
        return softmax(d)
    if kind == "argmax":
        return argmax(d)
    if kind == "topk":
        return topk(d)
    raise BackendError(f"row kernels: no kind {kind!r} (kinds: {', '.join(KINDS)})")


__all__ = ["ARGMAX_BEATS", "KINDS", "REDUCTIONS", "Reduction", "RowDialect", "TOPK_BEFORE", "argmax", "reduce",
           "row_kernel", "softmax", "topk"]
