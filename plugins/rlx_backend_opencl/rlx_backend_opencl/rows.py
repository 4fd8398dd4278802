"""OpenCL's dialect of core's row kernels (rlx_core.ir.rowkernels: softmax, reduce, argmax, topk).

A work-group is LX work-items along a row times LY rows (ROW_SETUP in kernels/rows.cl: `sh`,
this row's LX slots of local memory, and `ok`, whether the row exists); operands are found
through the runner's meta (row_off, INNER), so rows may be strided. reduce takes its op at run
time (one program per dtype signature: PoCL spends about a second building each). Dtypes,
ACC, TO_Y(v) and ACC_LO/ACC_HI come as defines from the runner, so the sources here do not
depend on them.
"""
from __future__ import annotations

import functools

from rlx_core.ir import rowkernels


class OpenCLRows(rowkernels.RowDialect):
    name = "opencl"
    tid = "lx"
    nt = "LX"
    inf = "INFINITY"
    spell = {"max": "MAXP", "min": "MINP", "lowest": "ACC_LO", "highest": "ACC_HI"}

    def kernel(self, name, ins, outs, scalars, shared, body):
        outs = {"argmax": ["__global long* y", "int y_off"],
                "topk": ["__global T_X* y", "int y_off", "__global long* yi", "int yi_off"]}.get(
                    name, ["__global T_Y* y", "int y_off"])
        params = ["__global const T_X* x", "int x_off", *outs, "__global const int* meta", "int moff", "int rows",
                  "int n"] + [f"{t} {v}" for t, v in scalars]
        setup = ["ROW_SETUP"]          # declares sh, this row's ACC slots
        setup += [f"__local {t} {v}_[LMAX]; __local {t}* {v} = {v}_ + get_local_id(1) * LX;"
                  for t, v in shared if v != "sh"]
        setup.append("int xo = x_off + (ok ? row_off(m, row, 0) : 0), xs = INNER(m, 0);")
        setup.append("int yo = y_off + (ok ? row_off(m, row, 1) : 0)" + (", ys = INNER(m, 1);"
                                                                          if name in ("softmax", "topk") else ";"))
        if name == "topk":
            setup.append("int io = yi_off + (ok ? row_off(m, row, 2) : 0), is = INNER(m, 2);")
        return (f"__kernel void {name}({', '.join(params)}) {{\n" + "".join(f"  {line}\n" for line in setup)
                + body + "}\n")

    def helper_head(self, ret, name, params):
        return f"inline {ret} {name}({params})"

    def loop(self, var, chunked):
        return f"if (ok) for (int {var} = lx; {var} < n; {var} += LX)"

    def barrier(self):
        return "barrier(CLK_LOCAL_MEM_FENCE);"

    def load(self, operand, j):
        return f"(ACC)LOAD(T_X, {operand}, {operand}o + {j} * {operand}s)"

    def store(self, operand, j, value):
        return f"STORE(T_Y, {operand}, {operand}o + {j} * {operand}s, TO_Y({value}))"

    topk_cmp = "<"                 # keys KEY(v) (the runner's define: -v, wrapping as numpy's -x), smaller first
    topk_index = "int"

    def topk_key(self, j):
        return f"KEY(LOAD(T_X, x, xo + {j} * xs))"

    def topk_store(self, r, index):
        return (f"if (ok && lx == 0) {{ STORE(T_X, y, yo + {r} * ys, LOAD(T_X, x, xo + {index} * xs)); "
                f"yi[io + {r} * is] = (long){index}; }}")

    def block_max(self, var):
        return f"{var} = seg_max({var}, sh, lx, LX);"

    def block_sum(self, var):
        return f"{var} = seg_sum({var}, sh, lx, LX);"

    def reduction(self, op):
        return self.switched_reduction("op")

    def reduce_result(self, result, red):
        finish = red[3]
        return f"  ACC r = {result};\n  if (ok && lx == 0) STORE(T_Y, y, yo, TO_Y({finish('r')}));\n"

    def argmax_result(self, value, index):
        return f"  if (ok && lx == 0) y[yo] = (long)({index} < 0 ? 0 : {index});\n"


@functools.cache
def source(kind: str) -> str:
    """Row kernel `kind` (rowkernels.KINDS): it follows kernels/rows.cl in a program."""
    return rowkernels.row_kernel(OpenCLRows(), kind)
