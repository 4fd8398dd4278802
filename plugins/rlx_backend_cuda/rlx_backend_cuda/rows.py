"""CUDA's dialect of core's row kernels (rlx_core.ir.rowkernels: softmax, reduce, argmax, topk).

Rows are contiguous along the reduced axis: row `blockIdx.x` starts at x + row * rs, one
block per row; the output row of softmax is contiguous [rows, n], reduce and argmax write
y[row], topk its k values and indices contiguous [rows, k]. reduce and argmax may split a long row into gridDim.y chunks (ops._row_split): a
block per chunk stores its partial, and the last block of the row to finish (`counters`
start at 0 and it resets its own) merges the partials in chunk order, lanes first, then a
fixed shuffle tree: the same result on every run.
"""
from __future__ import annotations

from rlx_core.ir import rowkernels
from rlx_core.ir.dtype import BOOL, DType

from . import sources
from .codegen import acc_of, ctype

# the partial results of a split row, per chunked kernel
_PARTIALS = {"reduce": "ACC* __restrict__ part", "argmax": "ACC* __restrict__ pv, int* __restrict__ pi"}


class CudaRows(rowkernels.RowDialect):
    """Rows of x (dtype `x_dt`) into y (`y_dt`), accumulating in C type `acc`; with `epilogue`
    (codegen.epilogue_function's `rlx_epi` and its stored dtype) y holds rlx_epi of each
    result rounded to y_dt: the one elementwise reader of a reduce's output, computed in its
    store (ops._reduce_epilogue)."""

    name = "cuda"
    tid = "threadIdx.x"
    nt = "blockDim.x"
    inf = "(ACC)RLX_INF"

    def __init__(self, x_dt: DType, y_dt: DType, acc: str, epilogue: tuple | None = None):
        self.x_dt, self.y_dt, self.acc, self.epilogue = x_dt, y_dt, acc, epilogue
        self.tx, self.to = ctype(x_dt), ctype(epilogue[1] if epilogue else y_dt)
        integer = acc == "long long"
        self.spell = {"max": "rlx_maxi<ACC>" if integer else "rlx_max",
                      "min": "rlx_mini<ACC>" if integer else "rlx_min",
                      "lowest": "((ACC)(-9223372036854775807LL - 1))" if integer else "(-(ACC)RLX_INF)",
                      "highest": "((ACC)9223372036854775807LL)" if integer else "((ACC)RLX_INF)"}

    def kernel(self, name, ins, outs, scalars, shared, body):
        chunked = name in _PARTIALS
        outs = {"argmax": ["long long* __restrict__ y"],
                "topk": [f"{self.tx}* __restrict__ vals", "long long* __restrict__ idx"]}.get(
                    name, [f"{self.to}* __restrict__ y"])
        params = [f"const {self.tx}* __restrict__ x", "long long rs", *outs, "int n"]
        params += [f"{t} {v}" for t, v in scalars]
        if chunked:
            params += ["int chunk", _PARTIALS[name], "int* __restrict__ counters"]
        setup = ["const i64 row = blockIdx.x;"]
        if chunked:
            setup.append("const int ns = gridDim.y, beg = blockIdx.y * chunk, end = min(n, beg + chunk);")
        setup.append(f"const {self.tx}* xr = x + row * rs;")
        if name == "softmax":
            setup.append(f"{self.to}* yr = y + row * (i64)n;")
        setup += [f"__shared__ {t} {v}[1024];" for t, v in shared]
        if chunked:
            setup.append("__shared__ int last;")
        head = f'extern "C" __global__ void rlx_{name}({", ".join(params)}) {{\n'
        return head + "".join(f"  {line}\n" for line in setup) + body + "}\n"

    def helper_head(self, ret, name, params):
        return f"__device__ __forceinline__ {ret} {name}({params})"

    def loop(self, var, chunked):
        if chunked:
            return f"#pragma unroll 4\n  for (int {var} = beg + threadIdx.x; {var} < end; {var} += blockDim.x)"
        return f"for (int {var} = threadIdx.x; {var} < n; {var} += blockDim.x)"

    def barrier(self):
        return "__syncthreads();"

    def load(self, operand, j):
        return f"LD(ACC, {operand}r[{j}])" if self.x_dt.is_float else f"(ACC)({operand}r[{j}])"

    def _rounded(self, value: str) -> str:
        """ACC `value` as the output's type (round to nearest even; bool is != 0), then
        through the epilogue where there is one."""
        if self.y_dt.is_float:
            v = f"ST({ctype(self.y_dt)}, {value})"
        elif self.y_dt is BOOL:
            v = f"({value} != 0)"
        else:
            v = f"({ctype(self.y_dt)})({value})"
        return f"rlx_epi({v})" if self.epilogue else v

    def store(self, operand, j, value):
        return f"{operand}r[{j}] = {self._rounded(value)}"

    topk_cmp = ">"                 # values, larger first
    topk_index = "long long"

    def topk_key(self, j):
        return self.load("x", j)

    def topk_store(self, r, index):
        return f"if (threadIdx.x == 0) {{ vals[row * k + {r}] = xr[{index}]; idx[row * k + {r}] = {index}; }}"

    def block_max(self, var):
        return f"{var} = block_max({var}, -(ACC)RLX_INF);"

    def block_sum(self, var):
        return f"{var} = block_sum({var});"

    def reduce_result(self, result, red):
        _, ident, comb, finish = red
        return (f"  if (ns == 1) {{\n"
                f"    if (threadIdx.x == 0) {{ ACC r = {result}; y[row] = {self._rounded(finish('r'))}; }}\n"
                f"    return;\n"
                f"  }}\n"
                f"  if (threadIdx.x == 0) {{\n"
                f"    part[row * ns + blockIdx.y] = {result};\n"
                f"    last = rlx_last_arrival(counters + row, ns);\n"
                f"  }}\n"
                f"  __syncthreads();\n"
                f"  if (!last || threadIdx.x >= 32) return;\n"
                f"  __threadfence();\n"
                f"  a = {ident};\n"
                f"  for (int k = threadIdx.x; k < ns; k += 32) a = {comb('a', 'LDCG(part + row * ns + k)')};\n"
                f"#pragma unroll\n"
                f"  for (int m = 16; m > 0; m >>= 1) {{ ACC o = SHFL_XOR(a, m); "
                f"a = threadIdx.x & m ? {comb('o', 'a')} : {comb('a', 'o')}; }}\n"
                f"  if (threadIdx.x == 0) {{ ACC r = a; y[row] = {self._rounded(finish('r'))}; }}\n")

    def argmax_result(self, value, index):
        return (f"  if (ns == 1) {{\n"
                f"    if (threadIdx.x == 0) y[row] = {index} < 0 ? 0 : {index};\n"
                f"    return;\n"
                f"  }}\n"
                f"  if (threadIdx.x == 0) {{\n"
                f"    pv[row * ns + blockIdx.y] = {value}; pi[row * ns + blockIdx.y] = {index};\n"
                f"    last = rlx_last_arrival(counters + row, ns);\n"
                f"  }}\n"
                f"  __syncthreads();\n"
                f"  if (!last || threadIdx.x >= 32) return;\n"
                f"  __threadfence();\n"
                f"  bv = 0; bi = -1;\n"
                f"  for (int k = threadIdx.x; k < ns; k += 32) {{\n"
                f"    const ACC v = LDCG(pv + row * ns + k); const int i = LDCG(pi + row * ns + k);\n"
                f"    if (rlx_beats(v, i, bv, bi)) {{ bv = v; bi = i; }}\n"
                f"  }}\n"
                f"#pragma unroll\n"
                f"  for (int m = 16; m > 0; m >>= 1) {{\n"
                f"    const ACC v = SHFL_XOR(bv, m); const int i = SHFL_XOR(bi, m);\n"
                f"    if (rlx_beats(v, i, bv, bi)) {{ bv = v; bi = i; }}\n"
                f"  }}\n"
                f"  if (threadIdx.x == 0) y[row] = bi < 0 ? 0 : bi;\n")


def acc_type(x_dt: DType, op: str | None = None) -> str:
    """The accumulation type of a row kernel over x: float (f16/bf16/f32), double (f64),
    long long for integers, double for an integer mean."""
    if x_dt.is_float:
        return acc_of(x_dt)
    return "double" if op == "mean" else "long long"


def source(kind: str, x_dt: DType, y_dt: DType, op: str | None = None, epilogue: tuple | None = None) -> str:
    """The compilable source of row kernel `kind` (rlx_<kind>) for these dtypes (epilogue:
    CudaRows')."""
    acc = acc_type(x_dt, op)
    head = f"typedef {acc} ACC;\n" + (epilogue[0] + "\n" if epilogue else "")
    return sources.render(head + rowkernels.row_kernel(CudaRows(x_dt, y_dt, acc, epilogue), kind, op))


def reduce_macros(op: str, x_dt: DType, y_dt: DType) -> dict:
    """The macros of sources.REDUCE_COLS (LOAD, COMB, IDENT, FINAL) for reduce op `op`,
    from core's REDUCTIONS in this dialect."""
    acc = acc_type(x_dt, op)
    d = CudaRows(x_dt, y_dt, acc)
    _, ident, comb, finish = d.reduction(op)
    return dict(TX=ctype(x_dt), TO=ctype(y_dt), ACC=acc, LOAD="LD(ACC, v)" if x_dt.is_float else "(ACC)(v)",
                COMB=comb("a", "b"), IDENT=ident, FINAL=d._rounded(finish("r")))
