"""moe_experts on the GPU: routed gated MLPs without a host sync (the steps run inside the
runner's CUDA graph).

Four launches per node (kernels/moe.cu):
  sort     one block groups the (token, slot) pairs by expert from the ids in device memory
           (counting sort) and lists the experts that have any pair;
  gate/up  a warp per intermediate row of each active expert, over that expert's pairs a few
           at a time (each weight row read once per group of pairs, not once per pair):
           h[pair] = act(gate . x) * (up . x), rounded to x's dtype;
  down     the same over down's rows: part[pair] = down . h[pair];
  combine  y[t] = sum_j weights[t, j] * part[t * k + j].
Dense (f16/bf16/f32/f64) and packed stacks (every scheme of the dequant GEMV, decoded by
its block decoders) take the same kernels. Decode reads each chosen expert's rows once; a
prefill re-reads them from cache per group of pairs (SIMT, no tensor cores yet).
"""
from __future__ import annotations

import numpy as np
from rlx_core.ir.dtype import F32, F64, I32
from rlx_core.ir.errors import BackendError
from rlx_core.ir.moe import INT8_SCHEME

from . import sources
from .codegen import acc_of, ctype
from .ops import BUILDERS, _b_host, _dq_epilogue, _packed
from .values import V

i32, i64 = np.int32, np.int64

PAIRS_PER_PASS = 8        # pairs one pass over a weight row serves (registers: 2 x this accumulators)
ROWS_PER_BLOCK = 8        # warps (output rows) of a gemv block



class Stack:
    """One expert stack ([E, rows, K] dense or packed u8 [E, rows, bytes]) as the kernel reads
    it: contiguous bytes, the expert and row strides in bytes, and how to decode a row."""

    def __init__(self, b, w: V, scheme: str, x: V, what: str):
        self.scheme = None
        if scheme:
            from rlx_core.ir.quant import QuantScheme

            self.scheme = QuantScheme.parse(scheme)
            if self.scheme.kind not in sources.DQ_SCHEMES:
                raise BackendError(f"cuda backend: moe_experts {what}: no kernel for scheme {scheme!r} "
                                   f"(node %{b.node})")
            e, rows, nbytes = w.shape
            wv, rs, self.align = _packed(b, w, e * rows, nbytes)
            if rs != nbytes:             # rows of a stride apart: one contiguous copy keeps experts evenly spaced
                wv, rs = b.contiguous(V(wv.arr, wv.dt)), nbytes
                self.align = min(self.align, _align(wv.arr.data.ptr, nbytes))
            self.arr, self.ers, self.rs = wv.arr, rows * nbytes, nbytes
        else:
            if w.dt is not x.dt:
                raise BackendError(f"cuda backend: moe_experts {what} is {w.dt.value}, expected {x.dt.value} "
                                   f"(node %{b.node})")
            c = b.contiguous(w)
            e, rows, k = c.shape
            isz = c.arr.itemsize
            self.arr, self.ers, self.rs, self.align = c.arr, rows * k * isz, k * isz, 16
        self.key = (self.scheme.kind, self.scheme.block, self.align) if self.scheme else ("dense",)

    def source(self, x: V, xalign: int, K: int, **defines) -> str:
        """The gemv kernel over this stack's rows for inputs x (rows `xalign`-byte aligned)."""
        isz = x.arr.itemsize
        if self.scheme is None:
            vec = 1
            while (vec * 2 * isz <= 16 and K % (vec * 2) == 0 and xalign % (vec * 2 * isz) == 0
                   and self.arr.data.ptr % (vec * 2 * isz) == 0 and self.rs % (vec * 2 * isz) == 0):
                vec *= 2
            return sources.render(sources.MOE_DENSE, VEC=vec, **defines)
        s = self.scheme
        source = sources.DQ_COMMON + sources.DQ_SCHEMES[s.kind] + sources.DQ_QF + sources.MOE_PACKED_TAIL
        extra = {"IB": s.block} if "IB" in source.defines() else {}
        return sources.render(source, A=self.align, XV=int(xalign % (4 * isz) == 0), **extra, **defines)


def _align(ptr: int, row_bytes: int) -> int:
    a = 16
    while a > 1 and (ptr % a or row_bytes % a):
        a //= 2
    return a


def _gemv(b, x: V, xdiv: int, a: Stack, bb: Stack | None, sort, out, N: int, K: int, act: str, n_slots: int):
    """One gemv launch: out[pair, :N] from stack a (and bb: gate/up) on x rows pair // xdiv."""
    dual = bb is not None
    xal = _align(x.arr.data.ptr, x.arr.strides[0])
    src = a.source(x, xal, K, T=ctype(x.dt), TO=ctype(x.dt), ACC=acc_of(x.dt), MC=PAIRS_PER_PASS,
                   DUAL=int(dual), EPILOGUE=_dq_epilogue(x.dt, False, act) if dual else "")
    fn = b.kernel(src, "rlx_moe_gemv")
    offsets, order, active = sort
    grid = (-(-N // ROWS_PER_BLOCK), n_slots)
    b.launch(fn, grid, (32 * ROWS_PER_BLOCK,),
             (x.arr, i64(x.arr.strides[0] // x.arr.itemsize), i32(xdiv), a.arr, (bb or a).arr, i64(a.ers),
              i64(a.rs), offsets.arr, order.arr, active.arr, out.arr, i32(N), i32(K)))


def build_moe_experts(b, n, ins, outs):
    x, wts, ids = ins[:3]
    y = outs[0]
    if y.size == 0:
        return
    H, ks = x.shape[-1], wts.shape[-1]
    T = x.size // H                        # the tokens are all leading dims
    E = ins[3].shape[0]
    P = T * ks
    x = _rows(b.contiguous(x), (T, H))
    ids_c, wts_c = (_rows(b.contiguous(t), (T, ks)) for t in (ids, wts))
    part = b.node_buffer((max(P, 1), H), F64 if x.dt is F64 else F32, "moe expert outputs")
    if P and E:
        _experts(b, n, ins, x, ids_c, part)
    dst = y if y.contiguous() else b.buffer(y.shape, y.dt, "moe output")
    src = sources.render(sources.MOE_COMBINE, ACC=acc_of(x.dt), TO=ctype(y.dt), TW=ctype(wts_c.dt), TI=ctype(ids_c.dt), NE=E)
    b.launch(b.kernel(src, "rlx_moe_combine"), (max(1, min(-(-T * H // 256), b.sms * 32)),), (256,),
             (part.arr, wts_c.arr, ids_c.arr, dst.arr, i64(T), i32(H), i32(ks)))
    if dst is not y:
        b.copy(dst, y)


def _experts(b, n, ins, x: V, ids: V, part: V) -> None:
    """part[pair] <- down[e] @ (act(gate[e] @ x[t]) * (up[e] @ x[t])) for every (token t, slot)
    pair with expert e: the sort, then gate/up and down launches."""
    T, H = x.shape
    ks = ids.shape[1]
    E, inter = ins[3].shape[0], ins[3].shape[1]
    P, act = T * ks, n.a["act"]
    gate, up, down = (Stack(b, w, s, x, name) for w, s, name in zip(ins[3:], n.a["schemes"], ("gate", "up", "down")))
    xc = x
    sort = _sort(b, ids, P, E)
    slots = min(E, P)
    h = b.node_buffer((P, inter), x.dt, "moe intermediate rows")
    if gate.key == up.key:
        _gemv(b, xc, ks, gate, up, sort, h, inter, H, act, slots)
    else:                                  # two schemes: each product apart, then act(gate) * up
        hg = b.node_buffer((P, inter), part.dt, "moe gate rows")
        hu = b.node_buffer((P, inter), part.dt, "moe up rows")
        _gemv(b, xc, ks, gate, None, sort, hg, inter, H, act, slots)
        _gemv(b, xc, ks, up, None, sort, hu, inter, H, act, slots)
        to_x = ("cast", (("dtype", x.dt.value),))
        b.elementwise(((*to_x, (0,)), ("activation", (("fn", act),), (2,)), (*to_x, (1,)),
                       ("binary", (("op", "mul"),), (3, 4))), [hg, hu], h)
    if n.a["int8_h"]:                      # (activations = "int8": h rounded as the op says)
        _b_host(b, Rounding(), [h], [h])
    _gemv(b, h, 1, down, None, sort, part, H, inter, act, slots)


class Rounding:
    """The step `_b_host` runs for int8_h: h through int8_b32 blocks (on the host, out of
    graph capture, as every fake_quantize on this backend)."""
    op, a = "fake_quantize", {"scheme": INT8_SCHEME}


def _rows(v: V, shape: tuple) -> V:
    """A contiguous value viewed as `shape` (its tokens' leading dims merged)."""
    return V(v.arr.reshape(shape), v.dt)


def _sort(b, ids: V, P: int, E: int) -> tuple:
    """(offsets [E + 1], order [P], active [E]) int32 scratch, filled by the sort launch."""
    offsets = b.node_buffer((E + 1,), I32, "moe expert offsets")
    order = b.node_buffer((P,), I32, "moe pair order")
    active = b.node_buffer((E,), I32, "moe active experts")
    if E > 8192:
        raise BackendError(f"cuda backend: moe_experts with {E} experts: the sort kernel takes at most 8192 "
                           f"(node %{b.node})")
    fn = b.kernel(sources.render(sources.MOE_SORT, TI=ctype(ids.dt), NE=E), "rlx_moe_sort")
    b.launch(fn, (1,), (1024,), (ids.arr, i32(P), offsets.arr, order.arr, active.arr, b.r.err, i32(b.node)))
    return offsets, order, active


BUILDERS["moe_experts"] = build_moe_experts

__all__ = ["build_moe_experts"]
