"""Compile an LIR module into a list of prepared kernel launches over a few device buffers.

Memory: the LIR arena is one device buffer; graph inputs share one staging buffer; constants
one buffer; kernel metadata (shapes and strides) one int buffer; copies the plan cannot
express as views (a reshape of a non-contiguous view, a gather table that is a view) go to
one scratch buffer. Params and states are resident device arrays. A control-flow body is a
runner of its own (control.py) that `run_device` runs on device values. Every value is a View:
a buffer, an element offset, a shape and strides, so reshape/narrow/expand/transpose are free
and every kernel reads strided operands.

Kernels are built once per device (programs cached by source hash), their arguments are set
at compile time, and a run is: upload inputs, enqueue the launches, read outputs, one sync.
"""
from __future__ import annotations

import math
import time

import numpy as np

from rlx_core.backends.base import Runner
from rlx_core.ir.dtype import DType
from rlx_core.ir.errors import BackendError, ModelError
from rlx_core.ir.lir import ALIGN, LirModule
from rlx_core.ir.ops import ACTIVATIONS, BINARY_OPS, COMPARE_OPS, INT_OK_ACTIVATIONS, MaskKind
from rlx_core.ir.quant import QuantScheme
from rlx_core.ir.rowkernels import REDUCTIONS

from . import control
from . import kernels as K
from . import quant as Q
from . import rows as R
from .device import CLArray, Device, alloc, upload

INT_MAX = 2**31 - 1
EW_OPS = {"binary", "compare", "where", "activation", "cast", "fused_swiglu"}
FFT_OPS = {"fft": (0, False), "ifft": (0, True), "rfft": (1, False), "irfft": (2, True)}  # K.FFT MODE, inverse
FFT_LOCAL_CAP = 256 * 1024      # bytes of local memory one row's FFT may use (2 x n float2)
LEAVES = {"input", "param", "state", "constant"}
# ops that may see c64 values: elementwise ones (their c64 steps checked in kernels.step_expr),
# FFTs, views and copies, control flow (its bodies check their own nodes)
C64_OPS = EW_OPS | set(FFT_OPS) | LEAVES | set(control.OPS) | {
    "fused_elementwise", "reshape", "narrow", "expand", "transpose", "concat", "gather", "assign", "kv_write",
    "custom"}
SOLVE_LOCAL_CAP = 48 * 1024     # bytes of local memory one dense_solve matrix [A | B] may use
SWITCHED = {"binary": BINARY_OPS, "compare": COMPARE_OPS, "activation": ACTIVATIONS}


def _cl():
    import pyopencl as cl

    return cl


def c_strides(shape) -> tuple:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class Storage:
    """A device buffer, bound late (the arena and scratch sizes are known only at the end)."""
    __slots__ = ("buf", "label")

    def __init__(self, label: str, buf=None):
        self.label, self.buf = label, buf


class View:
    __slots__ = ("st", "off", "shape", "strides", "dtype")

    def __init__(self, st, off, shape, strides, dtype):
        self.st, self.off, self.shape, self.strides, self.dtype = st, int(off), tuple(shape), \
            tuple(strides), dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def contiguous(self) -> bool:
        return all(d == 1 or s == c for d, s, c in zip(self.shape, self.strides, c_strides(self.shape)))

    def with_(self, shape=None, strides=None, off=None) -> "View":
        return View(self.st, self.off if off is None else off, self.shape if shape is None else shape,
                    self.strides if strides is None else strides, self.dtype)

    def bcast(self, shape) -> tuple:
        """Strides of this view broadcast (numpy rules) to `shape`."""
        pad = len(shape) - len(self.shape)
        st = []
        for i, d in enumerate(shape):
            j = i - pad
            if j < 0 or self.shape[j] == 1 and d != 1:
                st.append(0)
            else:
                st.append(self.strides[j])
        return tuple(st)

    def permute(self, perm) -> "View":
        return self.with_(tuple(self.shape[p] for p in perm), tuple(self.strides[p] for p in perm))


def nocopy_reshape(shape, strides, new):
    """numpy's _attempt_nocopy_reshape: strides for `new` over the same memory, or None."""
    if math.prod(shape) == 0 or all(d == 1 for d in shape):
        return c_strides(new)
    olds = [(d, s) for d, s in zip(shape, strides) if d != 1]
    nst = [0] * len(new)
    oi, oj, ni, nj = 0, 1, 0, 1
    while ni < len(new) and oi < len(olds):
        np_, op_ = new[ni], olds[oi][0]
        while np_ != op_:
            if np_ < op_:
                np_ *= new[nj]
                nj += 1
            else:
                op_ *= olds[oj][0]
                oj += 1
        for ok in range(oi, oj - 1):
            if olds[ok][1] != olds[ok + 1][0] * olds[ok + 1][1]:
                return None
        nst[nj - 1] = olds[oj - 1][1]
        for nk in range(nj - 1, ni, -1):
            nst[nk - 1] = nst[nk] * new[nk]
        ni, nj = nj, nj + 1
        oi, oj = oj, oj + 1
    return tuple(nst)


def collapse(shape, stride_sets):
    """Drop size-1 dims and merge dims that are contiguous in every operand."""
    dims = [i for i, d in enumerate(shape) if d != 1]
    if not dims:
        return [], [[] for _ in stride_sets]
    sh = [shape[dims[0]]]
    sts = [[s[dims[0]]] for s in stride_sets]
    for i in dims[1:]:
        d = shape[i]
        if all(st[-1] == s[i] * d for st, s in zip(sts, stride_sets)):
            sh[-1] *= d
            for st, s in zip(sts, stride_sets):
                st[-1] = s[i]
        else:
            sh.append(d)
            for st, s in zip(sts, stride_sets):
                st.append(s[i])
    return sh, sts


def fft_radices(n: int) -> list:
    """The stages of an n-point FFT (K.FFT): radix 4 while it divides, then the prime factors
    (a large prime is a direct DFT of that length); [1] (a copy) for n = 1."""
    out = []
    while n % 4 == 0:
        out.append(4)
        n //= 4
    f = 2
    while n > 1:
        if f * f > n:
            out.append(n)
            break
        if n % f:
            f += 1
        else:
            out.append(f)
            n //= f
    return out or [1]


def _defs(**kw) -> str:
    return "".join(f"#define {k} {v}\n" for k, v in kw.items())


class OpenCLRunner(Runner):
    def __init__(self, backend, dev: Device, lir: LirModule, params: dict, states: dict):
        self.backend, self.dev, self.lir = backend, dev, lir
        g = lir.graph
        self.graph, self.name = g, g.name
        self.arena = Storage("arena")
        self.scratch = Storage("scratch")
        self.staging = Storage("inputs")
        self.consts = Storage("constants")
        self.meta_st = Storage("meta")
        self.err_st = Storage("err")
        self._scratch_bytes = 0
        self._meta: list = []
        self._launches: list = []        # (program, kernel name, args, global, local) or callable
        self._launch_nodes: list = []    # the node each launch computes (profiling names it)
        self._at = -1                    # the node being built
        self.inputs: dict = {}
        self.in_views: list = []         # the inputs' Views in the staging buffer, in order
        self.checks = False
        self._kv_info: dict = {}
        self._const_blob: list = []      # (byte offset, host array) of the constants buffer
        self._const_bytes = 0
        self._twiddles: dict = {}        # FFT length -> its table (a constant)
        self.bodies: list = []           # runners of the control-flow bodies under this graph
        self._check_dtypes()
        vals: dict = {}
        in_off = 0
        for i, n in enumerate(g.nodes):
            op = n.op
            s = n.outs[0] if n.outs else None
            try:
                if op == "input":
                    vals[(i, 0)] = View(self.staging, in_off // s.dtype.itemsize, s.dims, c_strides(s.dims), s.dtype)
                    self.inputs[n.name] = (in_off, s)
                    self.in_views.append(vals[(i, 0)])
                    in_off += _align(s.nbytes())
                elif op in ("param", "state"):
                    src = params if op == "param" else states
                    if n.name not in src:
                        raise BackendError(f"{op} {n.name!r} is not bound")
                    arr = src[n.name]
                    if not isinstance(arr, CLArray) or arr.device is not dev:
                        arr = upload(dev, np.asarray(arr).astype(s.dtype.np, copy=False))
                        src[n.name] = arr          # states persist on the device from now on
                    if tuple(arr.shape) != s.dims or arr.rlx_dtype is not s.dtype:
                        raise BackendError(f"{op} {n.name!r}: bound {arr} does not match {s}")
                    vals[(i, 0)] = View(Storage(n.name, arr.buf), 0, s.dims, c_strides(s.dims), s.dtype)
                elif op == "constant":
                    vals[(i, 0)] = self.constant(np.asarray(g.constants[n.name]), s.dtype, s.dims)
                else:
                    self._at = i
                    self._node(i, n, [vals[tuple(r)] for r in n.inputs], vals)
            except (BackendError, ModelError) as e:
                raise type(e)(f"opencl: graph {g.name!r} node %{i} ({op}): {e}") from None
        # outputs: read straight from their buffers, or from a contiguous copy
        self._at = len(g.nodes)
        self.outputs = []
        for name, r in g.outputs:
            v = vals[tuple(r)]
            if not v.contiguous():
                v = self._materialize(v)
            self.outputs.append((name, v))
        self._finish(in_off)

    # ------------------------------------------------------------------ helpers
    def _check_dtypes(self) -> None:
        """Every value in a dtype the device has; c64 only where a kernel handles it (the
        elementwise ops check their c64 steps when generated)."""
        ok = self.dev.dtypes()
        nodes = self.graph.nodes
        for i, n in enumerate(nodes):
            if n.op not in C64_OPS:
                ins = [nodes[r[0]].outs[r[1]] for r in n.inputs]
                if any(s.dtype is DType.C64 for s in (*ins, *n.outs)):
                    raise BackendError(f"opencl: node %{i} ({n.op}) has no OpenCL kernel for c64 values (c64 "
                                       f"goes through binary {'/'.join(K.C64_BINARY)}, cast, where, "
                                       f"{'/'.join(FFT_OPS)}, copies and views)")
            for s in n.outs:
                if s.dtype not in ok:
                    why = ""
                    if s.dtype is DType.F16:
                        why = " (the device lacks cl_khr_fp16; RLX_OPENCL_FP16=1 allows f16 storage anyway)"
                    elif s.dtype is DType.F64:
                        why = " (the device lacks cl_khr_fp64)"
                    raise BackendError(f"opencl: node %{i} ({n.op}) computes in {s.dtype.value}, which "
                                       f"device {self.dev.name} does not support{why}")

    def meta(self, values) -> int:
        off = len(self._meta)
        for v in values:
            v = int(v)
            if not -INT_MAX <= v <= INT_MAX:
                raise BackendError(f"tensor too large for 32-bit indexing ({v})")
            self._meta.append(v)
        return off

    def scratch_view(self, shape, dtype) -> View:
        off = self._scratch_bytes
        self._scratch_bytes += _align(math.prod(shape) * dtype.itemsize)
        return View(self.scratch, off // dtype.itemsize, shape, c_strides(shape), dtype)

    def constant(self, arr: np.ndarray, dtype: DType, shape=None) -> View:
        """A host array placed in the constants buffer (uploaded once, at the end of compile)."""
        arr = np.ascontiguousarray(arr.astype(dtype.np, copy=False))
        shape = arr.shape if shape is None else tuple(shape)
        off = self._const_bytes
        self._const_blob.append((off, arr))
        self._const_bytes += _align(arr.nbytes)
        return View(self.consts, off // dtype.itemsize, shape, c_strides(shape), dtype)

    def out_view(self, i: int, k: int = 0) -> View:
        sl = self.lir.slots[(i, k)]
        s = self.graph.nodes[i].outs[k]
        if sl.home != "arena":
            raise BackendError(f"unexpected home {sl.home!r} for the output of node %{i}")
        return View(self.arena, sl.offset // s.dtype.itemsize, s.dims, c_strides(s.dims), s.dtype)

    def program(self, source: str, what: str):
        return self.dev.build(source, what)

    def launch(self, prg, kname, args, gsize, lsize) -> None:
        if max(gsize, default=0) > INT_MAX or math.prod(gsize) > 2**40:
            raise BackendError(f"launch of {kname} with global size {gsize} is too large for 32-bit indexing")
        if all(gsize) and math.prod(gsize) > 0:
            self._launches.append((prg, kname, args, tuple(gsize), None if lsize is None else tuple(lsize)))
            self._launch_nodes.append(self._at)

    def _materialize(self, v: View, dtype: DType | None = None) -> View:
        out = self.scratch_view(v.shape, dtype or v.dtype)
        self.copy(v, out)
        return out

    def contig(self, v: View) -> View:
        return v if v.contiguous() else self._materialize(v)

    @staticmethod
    def buf(v: View):
        last = v.off + sum((d - 1) * st for d, st in zip(v.shape, v.strides) if d > 0)
        if v.off > INT_MAX or last > INT_MAX:
            raise BackendError(f"a {v.dtype.value}{list(v.shape)} value at element {v.off} of {v.st.label} is "
                               "beyond 32-bit element indexing")
        return (v.st, np.int32(v.off))

    # ------------------------------------------------------------------ elementwise
    def ew(self, ins: list, program: list, out: View, what: str) -> None:
        shape = out.shape
        total = out.numel
        if total == 0:
            return
        sh, sts = collapse(shape, [out.strides] + [v.bcast(shape) for v in ins])
        moff = self.meta([len(sh)] + sh + [x for st in sts for x in st])
        choices, opc = None, 0
        if len(program) == 1 and program[0][0] in SWITCHED:
            op, a, args = program[0]
            key = "fn" if op == "activation" else "op"
            names = SWITCHED[op] if op != "activation" or out.dtype.is_float else INT_OK_ACTIVATIONS
            if DType.C64 in (out.dtype, *(v.dtype for v in ins)):
                err = K.c64_error(op, a)
                if err is not None:
                    raise err
                names = [x for x in names if K.c64_error(op, {key: x}) is None]
            choices, opc = [{key: x} for x in names], names.index(a[key])
            program = [(op, choices[opc], args)]
        src = K.elementwise_source([v.dtype for v in ins], program, out.dtype, choices)
        prg = self.program(src, what)
        args = [*self.buf(out)] + [a for v in ins for a in self.buf(v)] + [self.meta_st, np.int32(moff),
                                                                         np.int32(total), np.int32(opc)]
        ls = min(256, self.dev.max_wg)
        self.launch(prg, "ew", args, ((total + ls - 1) // ls * ls,), (ls,))

    def copy(self, src: View, dst: View) -> None:
        self.ew([src], [("cast", {"dtype": dst.dtype.value}, (0,))], dst, "copy")

    # ------------------------------------------------------------------ row kernels
    def row_meta(self, views, axis) -> tuple:
        """(meta offset, row count) of a row kernel (K.ROW_COMMON's row_off / INNER) over `views`:
        all of the iteration shape of views[0] (or broadcast to it), axis `axis` is the row."""
        shape = views[0].shape
        rank = len(shape)
        ax = axis % rank if rank else 0
        outer = [d for i, d in enumerate(shape) if i != ax] if rank else []
        stsets = []
        inner = []
        for v in views:
            st = v.strides if v.shape == shape else v.bcast(shape)
            stsets.append([s for i, s in enumerate(st) if i != ax] if rank else [])
            inner.append(st[ax] if rank else 0)
        sh, sts = collapse(outer, stsets)
        moff = self.meta([len(sh)] + sh + [x for st, inn in zip(sts, inner) for x in st + [inn]])
        return moff, math.prod(sh)

    def rows(self, kname, template, defs, views, axis, n, extra_args, what, arg_views=None, lx=None):
        """Launch a row kernel: `views` (all of the iteration shape, axis `axis` is the row)
        give the meta strides; `arg_views` the buffer arguments in kernel order."""
        moff, rows_n = self.row_meta(views, axis)
        src = K.prelude(defs["_dtypes"]) + _defs(**{k: v for k, v in defs.items() if k != "_dtypes"}) \
            + K.ROW_COMMON + template
        prg = self.program(src, what)
        args = [a for v in (arg_views or views) for a in (self.buf(v) if isinstance(v, View) else (v,))]
        args += [self.meta_st, np.int32(moff), np.int32(rows_n), np.int32(n)] + list(extra_args)
        if kname == "cumsum":
            ls = 64
            self.launch(prg, kname, args, ((rows_n + ls - 1) // ls * ls,), (ls,))
            return
        if self.dev.is_gpu:
            LX = lx or min(256, _pow2(max(n, 1)))
            LY = max(1, min(256 // LX, _pow2(rows_n)))
        else:       # PoCL compiles a kernel per local size: keep one shape per kernel
            LX, LY = 16, 16
        self.launch(prg, kname, args, (LX, (rows_n + LY - 1) // LY * LY), (LX, LY))

    # ------------------------------------------------------------------ per node
    def _node(self, i, n, ins, vals) -> None:
        op, a = n.op, n.a
        what = f"op {op!r} (node %{i})"
        if op == "reshape":
            v = ins[0]
            st = nocopy_reshape(v.shape, v.strides, n.outs[0].dims)
            vals[(i, 0)] = v.with_(n.outs[0].dims, st) if st is not None else \
                self._materialize(v).with_(n.outs[0].dims, c_strides(n.outs[0].dims))
            return
        if op == "narrow":
            v = ins[0]
            ax = a["axis"] % len(v.shape)
            shape = list(v.shape)
            shape[ax] = a["length"]
            start = a["start"] + v.shape[ax] if a["start"] < 0 else a["start"]   # negative: from the end
            vals[(i, 0)] = v.with_(tuple(shape), off=v.off + start * v.strides[ax])
            return
        if op == "expand":
            v = ins[0]
            vals[(i, 0)] = v.with_(tuple(a["shape"]), v.bcast(tuple(a["shape"])))
            return
        if op == "kv_write":
            self._kv_write(i, a, *ins)
            vals[(i, 0)] = ins[0]
            return
        if op == "assign":
            self.copy(ins[1], ins[0])
            vals[(i, 0)] = ins[0]
            return
        outs = [self.out_view(i, k) for k in range(len(n.outs))]
        for k, v in enumerate(outs):
            vals[(i, k)] = v
        fn = getattr(self, "_op_" + op, None)
        if op in EW_OPS:
            self.ew(ins, [(op, a, tuple(range(len(ins))))], outs[0], what)
        elif op == "fused_elementwise":
            prog = [(o, dict(at), tuple(args)) for o, at, args in a["program"]]
            self.ew(ins, prog, outs[0], what)
        elif fn is not None:
            fn(i, a, ins, outs, what)
        else:
            raise BackendError(f"no OpenCL kernel for op {op!r}")

    # -- data movement
    def _op_transpose(self, i, a, ins, outs, what):
        self.copy(ins[0].permute(a["perm"]), outs[0])

    def _op_concat(self, i, a, ins, outs, what):
        out = outs[0]
        ax = a["axis"] % len(out.shape)
        pos = 0
        for v in ins:
            shape = list(out.shape)
            shape[ax] = v.shape[ax]
            if v.shape[ax]:
                self.copy(v, out.with_(tuple(shape), off=out.off + pos * out.strides[ax]))
            pos += v.shape[ax]

    def _op_gather(self, i, a, ins, outs, what):
        t, idx = self.contig(ins[0]), self.contig(ins[1])
        ax = a["axis"] % len(t.shape)
        pre, post = math.prod(t.shape[:ax]), math.prod(t.shape[ax + 1:])
        ni = idx.numel
        y = outs[0]
        src = K.prelude([t.dtype, idx.dtype, y.dtype]) + _defs(
            T_X=K.ctype(t.dtype), T_I=K.ctype(idx.dtype), T_Y=K.ctype(y.dtype)) + K.GATHER
        prg = self.program(src, what)
        self.checks = True
        total = pre * ni * post
        args = [*self.buf(t), *self.buf(idx), *self.buf(y), np.int32(pre), np.int32(ni),
                np.int32(t.shape[ax]), np.int32(post), self.err_st, np.int32(i)]
        self.launch(prg, "gather", args, ((total + 255) // 256 * 256,), (256,))

    def _kv_write(self, i, a, cache, new, pos):
        rank = len(cache.shape)
        ax = a["axis"] % rank
        if ax == 0:
            raise ModelError("kv_write: axis 0 is the batch axis")
        pos = self.contig(pos)
        tshape = list(cache.shape)
        tshape[ax] = new.shape[ax]
        tshape = tuple(tshape)
        moff = self.meta([rank, *tshape, *new.bcast(tshape), *cache.strides])
        src = K.prelude([cache.dtype, pos.dtype]) + _defs(T_X=K.ctype(cache.dtype), T_P=K.ctype(pos.dtype)) \
            + K.KV_WRITE
        prg = self.program(src, f"op 'kv_write' (node %{i})")
        self.checks = True
        total = math.prod(tshape)
        args = [*self.buf(cache), *self.buf(new), *self.buf(pos), np.int32(pos.numel), self.meta_st,
                np.int32(moff), np.int32(total), np.int32(ax), np.int32(cache.shape[ax]),
                np.int32(new.shape[ax]), self.err_st, np.int32(i)]
        self._kv_info[i] = new.shape[ax]
        if pos.numel == 0:
            return
        self.launch(prg, "kv_write", args, ((total + 255) // 256 * 256,), (256,))

    # -- matmul
    def _op_matmul(self, i, a, ins, outs, what):
        self._matmul(ins[0], ins[1], None, a["trans_a"], a["trans_b"], "identity", outs[0], what)

    def _op_fused_matmul_bias_act(self, i, a, ins, outs, what):
        self._matmul(ins[0], ins[1], ins[2] if len(ins) > 2 else None, False, a["trans_b"], a["act"],
                     outs[0], what)

    def _matmul(self, x, w, bias, ta, tb, act, out, what):
        M, N = out.shape[-2], out.shape[-1]
        K_ = x.shape[-2] if ta else x.shape[-1]
        sam, sak = (x.strides[-1], x.strides[-2]) if ta else (x.strides[-2], x.strides[-1])
        sbk, sbn = (w.strides[-1], w.strides[-2]) if tb else (w.strides[-2], w.strides[-1])
        bshape = out.shape[:-2]
        xa = x.with_(x.shape[:-2], x.strides[:-2]).bcast(bshape) if bshape else ()
        wb = w.with_(w.shape[:-2], w.strides[:-2]).bcast(bshape) if bshape else ()
        bsh, (ast, bst) = collapse(bshape, [list(xa), list(wb)])
        moff = self.meta([len(bsh), *bsh, *ast, *bst, int(bias is not None)])
        nbatch = math.prod(bsh)
        acc = K.acc_type(x.dtype, w.dtype)
        dts = [x.dtype, w.dtype, out.dtype] + ([bias.dtype] if bias is not None else [])
        defs = dict(T_A=K.ctype(x.dtype), T_B=K.ctype(w.dtype), T_C=K.ctype(out.dtype), ACC=acc,
                    T_BIAS=K.ctype(bias.dtype) if bias is not None else K.ctype(out.dtype), TO_C="(v)",
                    ACT="(v)" if act == "identity" else "(" + K.act_expr(act, "(v)", acc) + ")")
        head = K.prelude(dts + [acc]) + "#define TO_C(v) " + K.to(out.dtype, "v") + "\n" + \
            "#define ACT(v) " + defs.pop("ACT") + "\n"
        defs.pop("TO_C")
        bias_args = [*self.buf(bias), np.int32(bias.strides[0])] if bias is not None else \
            [self.meta_st, np.int32(0), np.int32(0)]
        args = [*self.buf(x), *self.buf(w), *self.buf(out), *bias_args, np.int32(M), np.int32(N),
                np.int32(K_), np.int32(sam), np.int32(sak), np.int32(sbk), np.int32(sbn),
                self.meta_st, np.int32(moff)]
        if M <= 4:
            prg = self.program(head + _defs(**defs) + K.MATMUL_COMMON + K.MATMUL_SKINNY, what)
            if sbk == 1 or K_ == 1 or sbn != 1:
                self.launch(prg, "gemv_k", args, (64 * N, nbatch), (64, 1))
            else:
                self.launch(prg, "gemv_n", args, ((N + 63) // 64 * 64, nbatch), (64, 1))
            return
        prg = self.program(head + _defs(**defs) + K.MATMUL_COMMON + K.MATMUL_TILED, what)
        self.launch(prg, "matmul", args, ((N + 63) // 64 * 16, (M + 63) // 64 * 16, nbatch), (16, 16, 1))

    # -- packed weights (quant.py): GEMV for a few rows of x, the tiled GEMM above that
    def _op_dequant_matmul(self, i, a, ins, outs, what):
        s = self._scheme(i, a)
        x, w, y = self.contig(ins[0]), self._packed(ins[1]), outs[0]
        bias = ins[2] if len(ins) > 2 else None
        K_, N = x.shape[-1], y.shape[-1]
        M = x.numel // K_
        prg = self.program(Q.source(s, x.dtype, y.dtype, bias.dtype if bias is not None else y.dtype), what)
        bias_args = [*self.buf(bias), np.int32(bias.strides[0])] if bias is not None else \
            [self.meta_st, np.int32(0), np.int32(0)]
        args = [*self.buf(x), *self.buf(w), *self.buf(y), *bias_args, np.int32(M), np.int32(N), np.int32(K_),
                np.int32(bias is not None), np.int32(ACTIVATIONS.index(a["act"]))]
        if M <= Q.GEMV_ROWS:
            self.launch(prg, "dq_gemv", args, (64 * N, 1), (64, 1))
        else:
            self.launch(prg, "dq_gemm", args, ((N + 63) // 64 * 16, (M + 63) // 64 * 16), (16, 16))

    def _op_dequantize(self, i, a, ins, outs, what):
        s = self._scheme(i, a)
        raw, y = self._packed(ins[0]), outs[0]
        K_ = y.shape[-1]
        units = y.numel // Q.unit(s)
        prg = self.program(Q.source(s, y.dtype, y.dtype, y.dtype), what)
        self.launch(prg, "dq_rows", [*self.buf(raw), *self.buf(y), np.int32(units), np.int32(K_)],
                    ((units + 63) // 64 * 64,), (64,))

    def _scheme(self, i, a) -> QuantScheme:
        """The node's scheme (the pipeline checked that this backend supports it)."""
        return QuantScheme.parse(a["scheme"])

    def _packed(self, v: View) -> View:
        """Packed bytes as the kernels read them: contiguous rows, f16 fields 2-byte aligned."""
        return self._materialize(v) if v.off % 2 or not v.contiguous() else v

    # -- row ops
    def _row_defs(self, x: DType, y: DType, *more) -> dict:
        acc = K.acc_type(x, *more)
        return dict(_dtypes=[x, y, *more, acc], T_X=K.ctype(x), T_Y=K.ctype(y), ACC=acc,
                    **{"TO_Y(v)": K.to(y, "v")})

    def _op_softmax(self, i, a, ins, outs, what):
        x, y = ins[0], outs[0]
        ax = a["axis"] % len(x.shape)
        self.rows("softmax", R.source("softmax"), self._row_defs(x.dtype, y.dtype), [x, y], ax, x.shape[ax], [], what)

    def _norm(self, what, x, r, w, b, h, y, eps, offset, layer):
        acc = K.acc_type(*[v.dtype for v in (x, r, w, b) if v is not None])
        tx = K.ctype(x.dtype)
        defs = dict(_dtypes=[v.dtype for v in (x, r, w, b, h, y) if v is not None] + [acc],
                    T_X=tx, T_R=K.ctype(r.dtype) if r is not None else tx,
                    T_W=K.ctype(w.dtype) if w is not None else tx,
                    T_B=K.ctype(b.dtype) if b is not None else tx,
                    T_H=K.ctype(h.dtype) if h is not None else K.ctype(y.dtype), T_Y=K.ctype(y.dtype), ACC=acc,
                    **{"TO_Y(v)": K.to(y.dtype, "v"),
                       "TO_H(v)": K.to(h.dtype if h is not None else y.dtype, "v")})
        flags = (r is not None) | (w is not None) << 1 | (b is not None) << 2 | (h is not None) << 3 | layer << 4
        dummy = y
        views = [x, r or x, h or y, y]
        arg_views = [x, r or dummy, *(self.buf(w) if w is not None else (self.meta_st, np.int32(0))),
                     np.int32(w.strides[0] if w is not None else 0),
                     *(self.buf(b) if b is not None else (self.meta_st, np.int32(0))),
                     np.int32(b.strides[0] if b is not None else 0), h or dummy, y]
        sc = np.float64 if acc == "double" else np.float32
        n = x.shape[-1]
        self.rows("norm", K.NORM, defs, views, -1, n, [sc(eps), sc(offset), np.int32(flags)], what, arg_views)

    def _op_rms_norm(self, i, a, ins, outs, what):
        self._norm(what, ins[0], None, ins[1] if len(ins) > 1 else None, None, None, outs[0],
                   a["eps"], a["offset"], False)

    def _op_layer_norm(self, i, a, ins, outs, what):
        self._norm(what, ins[0], None, ins[1] if len(ins) > 1 else None, ins[2] if len(ins) > 2 else None,
                   None, outs[0], a["eps"], 0.0, True)

    def _op_fused_residual_rms_norm(self, i, a, ins, outs, what):
        self._norm(what, ins[0], ins[1], ins[2] if len(ins) > 2 else None, None, outs[0], outs[1],
                   a["eps"], a["offset"], False)

    def _op_fused_residual_ln(self, i, a, ins, outs, what):
        self._norm(what, ins[0], ins[1], ins[2] if len(ins) > 2 else None, ins[3] if len(ins) > 3 else None,
                   outs[0], outs[1], a["eps"], 0.0, True)

    def _op_reduce(self, i, a, ins, outs, what):
        x, y = ins[0], outs[0]
        rank = len(x.shape)
        axes = (a["axes"],) if isinstance(a["axes"], int) else tuple(a["axes"])
        axes = sorted({ax % rank for ax in axes}) if rank else []
        kept = [d for d in range(rank) if d not in axes]
        xp = x.permute(kept + axes)
        inner_shape = [x.shape[d] for d in axes]
        ish, (ist,) = collapse(inner_shape, [[x.strides[d] for d in axes]])
        if len(ish) > 1:
            xp = self._materialize(xp)
            ish, ist = [math.prod(inner_shape)], [1]
        kshape = tuple(x.shape[d] for d in kept)
        n = ish[0] if ish else 1
        xv = View(xp.st, xp.off, kshape + (n,), tuple(xp.strides[:len(kept)]) + (ist[0] if ist else 0,), x.dtype)
        yv = View(y.st, y.off, kshape + (1,), c_strides(kshape) + (0,), y.dtype)
        defs = self._row_defs(x.dtype, y.dtype)
        code = list(REDUCTIONS).index(a["op"])         # the op code of rows.source("reduce")
        acc = defs["ACC"]
        lo, hi = ("(-INFINITY)", "INFINITY") if acc != "long" else ("LONG_MIN", "LONG_MAX")
        defs.update(ACC_LO=lo, ACC_HI=hi)
        self.rows("reduce", R.source("reduce"), defs, [xv, yv], -1, n, [np.int32(code)], what)

    def _op_argmax(self, i, a, ins, outs, what):
        x, y = ins[0], outs[0]
        rank = len(x.shape)
        ax = a["axis"] % rank
        kshape = tuple(d for k, d in enumerate(x.shape) if k != ax)
        yst = list(c_strides(kshape))
        yst.insert(ax, 0)
        yv = View(y.st, y.off, x.shape, tuple(yst), y.dtype)
        defs = self._row_defs(x.dtype, y.dtype)
        defs["ACC"] = K.acc_type(x.dtype) if x.dtype.is_float else "long"
        self.rows("argmax", R.source("argmax"), defs, [x, yv], ax, x.shape[ax], [], what)

    def _op_cumsum(self, i, a, ins, outs, what):
        x, y = ins[0], outs[0]
        ax = a["axis"] % len(x.shape)
        self.rows("cumsum", K.CUMSUM, self._row_defs(x.dtype, y.dtype), [x, y], ax, x.shape[ax], [], what)

    def _op_topk(self, i, a, ins, outs, what):
        x, yv, yi = ins[0], outs[0], outs[1]
        ax = a["axis"] % len(x.shape)
        defs = self._row_defs(x.dtype, yv.dtype)
        if x.dtype.is_float:
            defs["KEY(v)"] = f"(-({defs['ACC']})(v))"
        else:
            defs["ACC"] = "long"
            defs["KEY(v)"] = f"((long)({K.ctype(x.dtype)})(-(v)))"
        # the outputs have k along the axis; describe them with the input's iteration shape
        def over(v):
            st = list(v.strides)
            return View(v.st, v.off, x.shape, tuple(st), v.dtype)
        self.rows("topk", R.source("topk"), defs, [x, over(yv), over(yi)], ax, x.shape[ax], [np.int32(a["k"])], what)

    # -- FFT (K.FFT): a row in local memory when 2 x n float2 fit, else one launch per stage
    def _op_fft(self, i, a, ins, outs, what):
        self._fft(self.graph.nodes[i].op, a, ins[0], outs[0], what)

    _op_ifft = _op_rfft = _op_irfft = _op_fft

    def _fft(self, op, a, x, y, what):
        mode, inverse = FFT_OPS[op]
        ax = a["axis"] % len(x.shape)
        n, m = (y.shape[ax], x.shape[ax]) if op == "irfft" else (x.shape[ax], y.shape[ax])
        if x.numel == 0 or y.numel == 0:
            return
        moff, rows = self.row_meta([x, View(y.st, y.off, x.shape, y.strides, y.dtype)], ax)
        tw = self._twiddles.get(n)
        if tw is None:
            tw = self._twiddles[n] = self.constant(np.exp(-2j * np.pi * np.arange(n) / n), DType.C64)
        src = K.prelude([x.dtype, y.dtype, DType.C64]) + _defs(T_X=K.ctype(x.dtype), T_Y=K.ctype(y.dtype),
                                                                ACC="float", MODE=mode) + K.ROW_COMMON + K.FFT
        prg = self.program(src, what)
        # numpy's norms: "ortho" scales both ways by 1/sqrt(n), "backward" the inverse by 1/n,
        # "forward" the forward transform by 1/n
        scaled = "backward" if inverse else "forward"
        scale = n ** -0.5 if a["norm"] == "ortho" else 1.0 / n if a["norm"] == scaled else 1.0
        radices = fft_radices(n)
        args = [*self.buf(x), *self.buf(y), *self.buf(tw), self.meta_st, np.int32(moff), np.int32(rows),
                np.int32(n), np.int32(m)]
        sg, sc = np.float32(-1.0 if inverse else 1.0), np.float32(scale)
        local_bytes = 2 * n * 8
        if local_bytes <= min(self.dev.local_mem - 1024, FFT_LOCAL_CAP):
            lx = min(256, _pow2(n)) if self.dev.is_gpu else 64      # PoCL: one local size per kernel
            args += [np.int32(self.meta(radices)), np.int32(len(radices)), sg, sc,
                     _cl().LocalMemory(local_bytes)]
            self.launch(prg, "fft_local", args, (lx, rows), (lx, 1))
            return
        st, off = self.buf(self.scratch_view((2, rows, n), DType.C64))
        ns = 1
        for k, r in enumerate(radices):
            flags = int(k == 0) | int(k == len(radices) - 1) << 1
            s_in, s_out = off + (k + 1) % 2 * rows * n, off + k % 2 * rows * n
            self.launch(prg, "fft_pass", args + [np.int32(ns), np.int32(r), sg, sc, st, np.int32(s_in),
                                                np.int32(s_out), np.int32(flags)],
                        ((rows * n + 63) // 64 * 64,), (64,))
            ns *= r

    # -- attention family
    def _op_rope(self, i, a, ins, outs, what):
        x, cs, sn = ins
        y = outs[0]
        if sn.dtype is not cs.dtype:
            sn = self._materialize(sn, cs.dtype)
        acc = K.acc_type(x.dtype)
        B, H, S, D = x.shape
        defs = dict(T_X=K.ctype(x.dtype), T_C=K.ctype(cs.dtype), T_Y=K.ctype(y.dtype), ACC=acc)
        src = K.prelude([x.dtype, cs.dtype, y.dtype, acc]) + _defs(**defs) + \
            f"#define TO_Y(v) {K.to(y.dtype, 'v')}\n" + K.ROPE_LOAD + K.ROPE
        prg = self.program(src, what)
        moff = self.meta([*x.strides, *self._table_strides(cs), *self._table_strides(sn), cs.shape[-1],
                          0 if a["style"] == "half" else 1])
        total = B * H * S * D
        args = [*self.buf(x), *self.buf(cs), *self.buf(sn), *self.buf(y), self.meta_st, np.int32(moff),
                np.int32(B), np.int32(H), np.int32(S), np.int32(D)]
        self.launch(prg, "rope", args, ((total + 255) // 256 * 256,), (256,))

    @staticmethod
    def _table_strides(t: View) -> list:
        return [0, *t.strides] if len(t.shape) == 2 else list(t.strides)

    @staticmethod
    def _kind(a) -> np.int32:
        return np.int32({MaskKind.CAUSAL: 1, MaskKind.SLIDING_WINDOW: 2}.get(MaskKind(a["mask_kind"]), 0))

    @staticmethod
    def _mask_defs(mask, pos):
        return dict(T_M=K.ctype(mask.dtype) if mask is not None else "float",
                    T_P=K.ctype(pos.dtype) if pos is not None else "int")

    @staticmethod
    def _mask_meta(mask, pos) -> list:
        return [0 if mask is None else (1 if mask.dtype is DType.BOOL else 2), int(pos is not None)]

    def _split(self, a, rest):
        rest = list(rest)
        mask = rest.pop(0) if a["has_mask"] else None
        pos = self.contig(rest.pop(0)) if a["has_pos"] else None
        return mask, pos

    def _op_mask_fill(self, i, a, ins, outs, what):
        x, y = ins[0], outs[0]
        mask, pos = self._split(a, ins[1:])
        B, H, Sq, Sk = x.shape
        acc = K.acc_type(x.dtype, *([mask.dtype] if mask is not None and mask.dtype.is_float else []))
        defs = dict(T_X=K.ctype(x.dtype), T_Y=K.ctype(y.dtype), ACC=acc, **self._mask_defs(mask, pos))
        src = K.prelude([x.dtype, y.dtype, acc] + ([mask.dtype] if mask is not None else [])) + _defs(**defs) + \
            f"#define TO_Y(v) {K.to(y.dtype, 'v')}\n" + K.ATTN_COMMON + K.MASK_FILL
        prg = self.program(src, what)
        mst = mask.bcast(x.shape) if mask is not None else (0, 0, 0, 0)
        moff = self.meta([*x.strides, *mst, *self._mask_meta(mask, pos)])
        total = B * H * Sq * Sk
        args = [*self.buf(x), *(self.buf(mask) if mask is not None else (self.meta_st, np.int32(0))),
                *(self.buf(pos) if pos is not None else (self.meta_st, np.int32(0))),
                np.int32(pos.numel if pos is not None else 1), *self.buf(y), self.meta_st, np.int32(moff),
                np.int32(B), np.int32(H), np.int32(Sq), np.int32(Sk), self._kind(a), np.int32(a["window"])]
        self.launch(prg, "mask_fill", args, ((total + 255) // 256 * 256,), (256,))

    def _op_attention(self, i, a, ins, outs, what):
        q, k, v, *rest = ins
        mask, pos = self._split(a, rest)
        self._attention(a, q, k, v, None, None, mask, pos, outs[0], what)

    def _op_fused_attention_block(self, i, a, ins, outs, what):
        q, k, v, cs, sn, *rest = ins
        mask, pos = self._split(a, rest)
        if sn.dtype is not cs.dtype:
            sn = self._materialize(sn, cs.dtype)
        self._attention(a, q, k, v, cs, sn, mask, pos, outs[0], what)

    def _attention(self, a, q, k, v, cs, sn, mask, pos, out, what):
        B, H, Sq, D = q.shape
        KVH, Sk, DV = k.shape[1], k.shape[2], v.shape[3]
        fl = [q.dtype, k.dtype, v.dtype] + ([mask.dtype] if mask is not None and mask.dtype.is_float else [])
        acc = K.acc_type(*fl)
        asz = 8 if acc == "double" else 4
        defs = dict(T_Q=K.ctype(q.dtype), T_K=K.ctype(k.dtype), T_V=K.ctype(v.dtype), T_O=K.ctype(out.dtype),
                    ACC=acc, D=D, DV=DV, T_C=K.ctype(cs.dtype) if cs is not None else K.ctype(q.dtype),
                    **self._mask_defs(mask, pos))
        decode = Sq <= 4
        if decode:
            W = 64
            defs["W"] = W
            body = K.ATTN_DECODE
        else:
            budget = min(self.dev.local_mem, 48 * 1024) - 1024
            for bq, bk in ((16, 16), (16, 8), (8, 8), (4, 4), (2, 2), (1, 1)):
                need = (bq * (D + 1) + bk * (D + 1) + bk * (DV + 1) + bq * (bk + 1)) * asz
                if need <= budget and bq * bk <= self.dev.max_wg:
                    break
            else:
                raise BackendError(f"attention head dims {D}/{DV} do not fit the device's local memory")
            defs.update(BQ=bq, BK=bk)
            body = K.ATTN_PREFILL
        dts = [q.dtype, k.dtype, v.dtype, out.dtype, acc] + ([cs.dtype] if cs is not None else []) + \
            ([mask.dtype] if mask is not None else [])
        src = K.prelude(dts) + _defs(**defs) + f"#define TO_O(v) {K.to(out.dtype, 'v')}\n" + \
            K.ATTN_COMMON + K.ROPE_LOAD + K.ATTN_DEFS + body
        prg = self.program(src, what)
        mst = mask.bcast((B, H, Sq, Sk)) if mask is not None else (0, 0, 0, 0)
        tst = (self._table_strides(cs) + self._table_strides(sn)) if cs is not None else [0] * 6
        rope = [int(cs is not None), cs.shape[-1] if cs is not None else 0,
                0 if a.get("style", "half") == "half" else 1]
        moff = self.meta([*q.strides, *k.strides, *v.strides, *mst, *tst, *self._mask_meta(mask, pos), *rope])
        sc = np.float64 if acc == "double" else np.float32
        dummy = (self.meta_st, np.int32(0))
        args = [*self.buf(q), *self.buf(k), *self.buf(v), *self.buf(out),
                *(self.buf(mask) if mask is not None else dummy), *(self.buf(pos) if pos is not None else dummy),
                np.int32(pos.numel if pos is not None else 1),
                *(self.buf(cs) if cs is not None else dummy), *(self.buf(sn) if sn is not None else dummy),
                self.meta_st, np.int32(moff), np.int32(B), np.int32(H), np.int32(KVH), np.int32(Sq),
                np.int32(Sk), sc(a["scale"]), sc(a["softcap"]), self._kind(a), np.int32(a["window"])]
        if decode:
            self.launch(prg, "attn_decode", args, (W * B * H * Sq,), (W,))
        else:
            self.launch(prg, "attn_prefill", args, ((Sq + bq - 1) // bq * bk, B * H * bq), (bk, bq))

    # -- control flow (control.py): bodies are runners of their own, driven by a host step
    def _op_if_(self, i, a, ins, outs, what):
        control.build(self, self.graph.nodes[i], ins, outs)

    _op_while_ = _op_scan = _op_if_

    def host_step(self, fn, bodies=()) -> None:
        """A step the host runs in order with the launches (it may enqueue work itself);
        `bodies`: the runners it drives (their error flags are read after a run)."""
        self._launches.append(fn)
        self._launch_nodes.append(self._at)
        self.bodies.extend(bodies)

    # -- dense_solve (K.DENSE_SOLVE): a work-group per matrix, [A | B] in local memory or scratch
    def _op_dense_solve(self, i, a, ins, outs, what):
        A, B, x = self.contig(ins[0]), self.contig(ins[1]), outs[0]
        n = A.shape[-1]
        k = 1 if len(B.shape) == len(A.shape) - 1 else B.shape[-1]
        batch = math.prod(A.shape[:-2])
        if x.numel == 0 or batch == 0:
            return
        acc = "double" if self.dev.fp64 else "float"    # numpy.linalg solves every float dtype in f64
        asz = 8 if acc == "double" else 4
        lx = min(256, max(32, _pow2(n))) if self.dev.is_gpu else 64   # PoCL: one local size per kernel
        wbytes = n * (n + k) * asz
        # [A | B] in local memory when it fits beside the pivot search's 256 (value, row) pairs
        local = wbytes + 256 * (asz + 4) <= min(self.dev.local_mem - 1024, SOLVE_LOCAL_CAP)
        src = K.prelude([A.dtype, x.dtype, acc]) + _defs(T_X=K.ctype(A.dtype), T_Y=K.ctype(x.dtype), ACC=acc,
                                                           W_SPACE="__local" if local else "__global") + \
            f"#define TO_Y(v) {K.to(x.dtype, 'v')}\n" + K.DENSE_SOLVE
        prg = self.program(src, what)
        if local:
            w = [_cl().LocalMemory(wbytes), np.int32(0), np.int32(0)]
        else:
            w = [*self.buf(self.scratch_view((batch, n, n + k), DType.F64 if acc == "double" else DType.F32)),
                 np.int32(n * (n + k))]
        self.checks = True
        args = [*self.buf(A), *self.buf(B), *self.buf(x), *w, np.int32(n), np.int32(k), self.err_st,
                np.int32(i)]
        self.launch(prg, "dense_solve", args, (lx, batch), (lx, 1))

    # -- custom ops: an "opencl" kernel fn(*pyopencl.array.Array, **params) -> Array(s)
    def _op_custom(self, i, a, ins, outs, what):
        from rlx_core.ir.custom import custom_op

        fn = custom_op(a["name"]).kernels.get("opencl")
        if fn is None:
            raise BackendError(f"custom op {a['name']!r} has no 'opencl' kernel")
        ins = [self.contig(v) for v in ins]
        params = dict(a["params"])
        q = self.dev.queue

        def step(fn=fn, ins=ins, outs=outs, params=params, name=a["name"]):
            import pyopencl.array as cla

            cl = _cl()
            arrs = [cla.Array(q, v.shape, np.uint8 if v.dtype is DType.BOOL else v.dtype.np, data=v.st.buf,
                              offset=v.off * v.dtype.itemsize) for v in ins]
            res = fn(*arrs, **params)
            res = res if isinstance(res, tuple) else (res,)
            if len(res) != len(outs):
                raise BackendError(f"custom op {name!r} returned {len(res)} values, expected {len(outs)}")
            for o, r in zip(outs, res):
                nb = o.numel * o.dtype.itemsize
                if isinstance(r, cla.Array):
                    if tuple(r.shape) != o.shape or r.nbytes != nb:
                        raise BackendError(f"custom op {name!r} returned {r.dtype}{list(r.shape)}, "
                                           f"expected {o.dtype.value}{list(o.shape)}")
                    if nb:
                        cl.enqueue_copy(q, o.st.buf, r.base_data, dst_offset=o.off * o.dtype.itemsize,
                                        src_offset=r.offset, byte_count=nb)
                else:
                    h = np.ascontiguousarray(np.asarray(r).astype(o.dtype.np)).reshape(o.shape)
                    if nb:
                        cl.enqueue_copy(q, o.st.buf, h.reshape(-1).view(np.uint8),
                                        dst_offset=o.off * o.dtype.itemsize)
        self._launches.append(step)
        self._launch_nodes.append(self._at)

    # ------------------------------------------------------------------ finish and run
    def _finish(self, in_bytes) -> None:
        cl = _cl()
        dev = self.dev
        self.arena.buf = alloc(dev, self.lir.arena_bytes)
        self.scratch.buf = alloc(dev, self._scratch_bytes)
        self.staging.buf = alloc(dev, in_bytes)
        self.consts.buf = alloc(dev, self._const_bytes)
        for off, arr in self._const_blob:
            if arr.nbytes:
                cl.enqueue_copy(dev.queue, self.consts.buf, arr.reshape(-1).view(np.uint8), dst_offset=off)
        meta = np.asarray(self._meta or [0], np.int32)
        self.meta_st.buf = cl.Buffer(dev.ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=meta)
        self.err_host = np.zeros(4, np.int32)
        self.err_st.buf = cl.Buffer(dev.ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                                    hostbuf=self.err_host)
        self.steps = []
        for item in self._launches:
            if callable(item):
                self.steps.append(item)
                continue
            prg, kname, args, gsize, lsize = item
            kern = cl.Kernel(prg, kname)
            kern.set_args(*[x.buf if isinstance(x, Storage) else x for x in args])
            if lsize is not None:
                gsize, lsize = self._fit_local(kern, kname, gsize, lsize)
            self.steps.append((kern, gsize, lsize))
        self.step_nodes = self._launch_nodes
        self._launches, self._launch_nodes = [], []
        dev.queue.finish()

    def _fit_local(self, kern, kname, gsize, lsize):
        """Shrink a launch's local size to what the compiled kernel allows on this device
        (register-heavy kernels can be below the device maximum). Fixed-size kernels
        (reqd_work_group_size) cannot shrink: that is a clear error instead of a launch failure."""
        cl = _cl()
        kmax = kern.get_work_group_info(cl.kernel_work_group_info.WORK_GROUP_SIZE, self.dev.dev)
        if math.prod(lsize) <= kmax:
            return gsize, lsize
        fixed = kern.get_work_group_info(cl.kernel_work_group_info.COMPILE_WORK_GROUP_SIZE, self.dev.dev)
        if any(fixed):
            raise BackendError(f"kernel {kname} needs work-groups of {lsize} but {self.dev.name} allows "
                               f"{kmax} work-items for it")
        lsize = list(lsize)
        while math.prod(lsize) > kmax:           # shrink rows per group first, then the row width
            k = len(lsize) - 1 if lsize[-1] > 1 else 0
            lsize[k] //= 2
        if len(lsize) == 1:
            gsize = ((gsize[0] + lsize[0] - 1) // lsize[0] * lsize[0],)
        else:           # row kernels: dim 0 is one group wide (a row's threads), dim 1 counts rows
            gsize = (lsize[0], *gsize[1:])
        return tuple(gsize), tuple(lsize)

    def poison(self, byte: int = 0xFF) -> None:
        """Fill the arena and scratch with `byte` (0xFF: NaN for floats, -1 for ints), the
        bodies' too: a test that then sees it found an element no kernel wrote."""
        cl = _cl()
        for st, n in ((self.arena, self.lir.arena_bytes), (self.scratch, self._scratch_bytes)):
            if n:
                cl.enqueue_fill_buffer(self.dev.queue, st.buf, np.uint8(byte), 0, _align(n))
        for body in self.bodies:
            body.poison(byte)
        self.dev.queue.finish()

    def enqueue(self, steps=None) -> None:
        """Enqueue the kernels of `steps` (default: the whole graph; no input upload, no sync)."""
        cl = _cl()
        q = self.dev.queue
        for st in self.steps if steps is None else steps:
            if type(st) is tuple:
                cl.enqueue_nd_range_kernel(q, st[0], st[1], st[2])
            else:
                st()

    profile_clock = "host clock (the queue finished after every step)"

    def run(self, inputs: dict) -> dict:
        keep = self._upload(inputs)
        self.enqueue()
        return self._download(keep)

    def run_device(self, views: list) -> list:
        """Enqueue a run on device values, one contiguous View per input in order (copied
        buffer to buffer into the staging buffer): the output Views, valid until the next
        run. No sync; the top runner's download reads this runner's error flag."""
        q = self.dev.queue
        for src, dst in zip(views, self.in_views):
            control.copy_view(q, src, dst)
        self.enqueue()
        return [v for _, v in self.outputs]

    def run_profiled(self, inputs: dict) -> tuple:
        """run() with the queue finished after each step, so the host clock times the step."""
        q = self.dev.queue
        self._upload(inputs)
        q.finish()
        clock, times = time.perf_counter, []
        t0 = clock()
        for node, st in zip(self.step_nodes, self.steps):
            self.enqueue((st,))
            q.finish()
            t1 = clock()
            times.append((node, t1 - t0))
            t0 = t1
        return self._download([]), times

    def _upload(self, inputs: dict) -> list:
        """Enqueue the inputs' copies to the staging buffer; returns the host arrays to keep
        alive until the queue has run them."""
        cl = _cl()
        q = self.dev.queue
        keep = []
        for name, (off, s) in self.inputs.items():
            if name not in inputs:
                raise ModelError(f"graph {self.name!r}: missing input {name!r}")
            arr = np.asarray(inputs[name])
            if arr.shape != s.dims and not (arr.size == 1 and not s.dims):   # ascontiguousarray makes 0-d 1-d
                raise ModelError(f"input {name!r}: expected {s}, got shape {list(arr.shape)}")
            arr = np.ascontiguousarray(arr.astype(s.dtype.np, copy=False))
            if arr.nbytes:
                cl.enqueue_copy(q, self.staging.buf, arr.reshape(-1).view(np.uint8), dst_offset=off,
                                is_blocking=False)
                keep.append(arr)
        return keep

    def _download(self, keep: list) -> dict:
        """The outputs read back (and the error flag checked) once the queue finishes; `keep`
        (the uploaded host arrays) stays referenced until then."""
        cl = _cl()
        q = self.dev.queue
        out = {}
        for name, v in self.outputs:
            host = np.empty(v.shape, v.dtype.np)
            if host.nbytes:
                cl.enqueue_copy(q, host.reshape(-1).view(np.uint8), v.st.buf,
                                src_offset=v.off * v.dtype.itemsize, is_blocking=False)
            out[name] = host
        flagged = self._flagged()
        for r in flagged:
            cl.enqueue_copy(q, r.err_host, r.err_st.buf, is_blocking=False)
        q.finish()
        keep.clear()
        errors = [r._take_err() for r in flagged if r.err_host[0]]
        if errors:
            raise errors[0]
        return out

    def _flagged(self) -> list:
        """This runner and the bodies under it (at any depth) whose kernels can flag an error."""
        below = [r for b in self.bodies for r in b._flagged()]
        return [self] + below if self.checks else below

    def _take_err(self) -> Exception:
        """The error the kernels flagged (err_host as read back), the flag cleared for the next run."""
        cl = _cl()
        code, node, x, y = (int(v) for v in self.err_host)
        self.err_host[:] = 0
        cl.enqueue_copy(self.dev.queue, self.err_st.buf, self.err_host)
        where = f"graph {self.name!r} node %{node} ({self.graph.nodes[node].op})"
        if code == 3:           # what numpy.linalg.solve raises as LinAlgError (a BackendError on numpy)
            return BackendError(f"opencl: {where}: singular matrix (matrix {x} of the batch has a zero "
                                f"pivot in column {y})")
        if code == 1:
            msg = f"gather: index out of range [0, {y}) (index {x})"
        else:
            msg = (f"kv_write: writing {self._kv_info.get(node, '?')} entries at position {x} overflows the "
                   f"cache of length {y} (context full)")
        return ModelError(f"{where}: {msg}")


def kernel_ops() -> set:
    """Op names this runner has a kernel (or view) for: the backend's supported_ops()."""
    own = {name[4:] for name in dir(OpenCLRunner) if name.startswith("_op_")}
    return own | EW_OPS | {"reshape", "narrow", "expand", "kv_write", "assign", "fused_elementwise", "input",
                           "param", "state", "constant"}
