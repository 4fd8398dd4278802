"""moe_experts on the GPU: routed gated MLPs without a host sync (the steps run inside the
runner's CUDA graph).

Four launches per node (kernels/moe.cu):
  sort     one block groups the (token, slot) pairs by expert from the ids in device memory
           (counting sort), lists the experts that have any pair and, for the GEMM, the tiles
           of BM pairs of one expert;
  gate/up  h[pair] = act(gate . x) * (up . x), rounded to x's dtype;
  down     part[pair] = down . h[pair];
  combine  y[t] = sum_j weights[t, j] * part[t * k + j].
Gate/up and down are each one of two kernels, chosen by the token count known at build time:
  gemv     (decode, few pairs an expert) a warp per output row of each active expert, over the
           expert's pairs a few at a time: each weight row read once per group of pairs;
  gemm     (batched decode, prefill: f16/bf16 on sm_80+) the grouped GEMM on tensor cores, a
           block per (64 output rows, tile of the sort's list), the weight tile copied (dense)
           or decoded (packed) into shared memory once for the tile's pairs; the grid is the
           host's bound on the tiles, empty slots exit.
At one token (batch-1 decode) two launches instead (gemv1): gate/up a block per 8 rows and
pair (expert ids[p], no sort), then down with the combine fused (a block per rows, a warp
per pair, the weighted sum in shared memory).
Dense (f16/bf16/f32/f64) and packed stacks (every scheme of the dequant GEMV, decoded by
its block decoders) take the same kernels. moe_route is one launch too (rlx_moe_route).
"""
from __future__ import annotations

import numpy as np
from rlx_core.ir.dtype import BF16, F16, F32, F64, I32
from rlx_core.ir.errors import BackendError
from rlx_core.ir.moe import ROUTE_ORDERS

from . import device, sources
from .codegen import acc_of, ctype
from .ops import BUILDERS, _dq_epilogue, _packed, round_int8
from .values import V

i32, i64 = np.int32, np.int64

PAIRS_PER_PASS = 8        # pairs one pass over a weight row serves (registers: 2 x this accumulators)
ROWS_PER_BLOCK = 8        # warps (output rows) of a gemv block
GEMM_MIN_PAIRS = 2        # pairs an active expert has on average from which the GEMM takes over
GEMM_BN = 64              # output rows of a gemm tile (moe.cu gemm_shape's BN)
GEMM_BK_PACKED = 128      # weights a packed gemm step decodes a row (K-quants: half a super-block)
# gemv1's rows a warp (its R): gate/up by the stack's kind, down. H200, OLMoE's shape, the
# block's graph replay over R in 1, 2, 4: dense gate/up 2 and down 4 best (34.2 us, all within
# 2 us), packed 4 and 4 (28.1 us; 1 and 2: 32.6)
ONE_TOKEN_ROWS = {"dense": 2, "packed": 4, "down": 4}



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

    def source(self, x: V, xalign: int, K: int, one_token: bool = False, **defines) -> str:
        """The gemv kernel (one_token: gemv1's) over this stack's rows for inputs x (rows
        `xalign`-byte aligned)."""
        isz = x.arr.itemsize
        if self.scheme is None:
            vec = 1
            while (vec * 2 * isz <= 16 and K % (vec * 2) == 0 and xalign % (vec * 2 * isz) == 0
                   and self.arr.data.ptr % (vec * 2 * isz) == 0 and self.rs % (vec * 2 * isz) == 0):
                vec *= 2
            return sources.render(sources.MOE_DENSE1 if one_token else sources.MOE_DENSE, VEC=vec, **defines)
        s = self.scheme
        tail = sources.MOE_PACKED_TAIL1 if one_token else sources.MOE_PACKED_TAIL
        source = sources.DQ_COMMON + sources.DQ_SCHEMES[s.kind] + sources.DQ_QF + tail
        extra = {"IB": s.block} if "IB" in source.defines() else {}
        return sources.render(source, A=self.align, XV=int(xalign % (4 * isz) == 0), **extra, **defines)

    def gemm_step(self, K: int) -> int:
        """BK, the weights a grouped-GEMM step takes of each row, or 0 where the GEMM cannot
        read this stack over K (then the gemv does): dense rows 16-byte aligned and K a
        multiple of 64 or 32; packed blocks whole in a step, or a K-quant's half super-block."""
        if self.scheme is None:
            if self.arr.data.ptr % 16 or self.rs % 16:
                return 0
            return next((bk for bk in (64, 32) if K % bk == 0), 0)
        blk, bk = self.scheme.block, GEMM_BK_PACKED
        halves = self.scheme.kind in ("q4_k", "q5_k", "q6_k")
        return bk if K % bk == 0 and (bk % blk == 0 or halves) else 0

    def gemm_source(self, x: V, BK: int, **defines) -> str:
        """The grouped-GEMM kernel over this stack's rows (tensor cores, x f16/bf16)."""
        mm = dict(T=ctype(x.dt), MMAT="bf16" if x.dt is BF16 else "f16", BK=BK, **defines)
        if self.scheme is None:
            return sources.render(sources.MOE_GEMM_DENSE, ACC=acc_of(x.dt), STAGES=2, **mm)
        s = self.scheme
        source = sources.DQ_COMMON + sources.DQ_SCHEMES[s.kind] + sources.DQ_QF + sources.MOE_GEMM_PACKED_TAIL
        extra = {"IB": s.block} if "IB" in source.defines() else {}
        return sources.render(source, ACC=acc_of(x.dt), A=self.align, STAGES=1, **extra, **mm)


def _align(ptr: int, row_bytes: int) -> int:
    a = 16
    while a > 1 and (ptr % a or row_bytes % a):
        a //= 2
    return a


def _products(b, x: V, xdiv: int, a: Stack, bb: Stack | None, sort: Sort, out, N: int, K: int, act: str):
    """out[pair, :N] from stack a (and bb: gate/up) on x rows pair // xdiv: the grouped GEMM
    where the sort made a tile list and the stacks and x allow it, else the gemv."""
    BK = a.gemm_step(K) if sort.mt else 0
    if bb is not None and BK and bb.gemm_step(K) != BK:
        BK = 0
    if BK and _align(x.arr.data.ptr, x.arr.strides[0]) >= 16:          # (16-byte copies of x rows)
        _gemm(b, x, xdiv, a, bb, sort, out, N, K, act, BK)
    else:
        _gemv(b, x, xdiv, a, bb, sort, out, N, K, act)


def _gemm(b, x: V, xdiv: int, a: Stack, bb: Stack | None, sort: Sort, out, N: int, K: int, act: str, BK: int):
    """One grouped-GEMM launch over the sort's tile list (a block per 64 rows and tile slot)."""
    dual = bb is not None
    src = a.gemm_source(x, BK, TO=ctype(x.dt), MT=sort.mt, DUAL=int(dual),
                        EPILOGUE=_dq_epilogue(x.dt, False, act) if dual else "")
    fn = b.kernel(src, "rlx_moe_gemm")
    b.launch(fn, (-(-N // GEMM_BN), sort.ntiles), (128,),
             (x.arr, i64(x.arr.strides[0] // x.arr.itemsize), i32(xdiv), a.arr, (bb or a).arr, i64(a.ers),
              i64(a.rs), sort.offsets.arr, sort.order.arr, sort.tiles.arr, out.arr, i32(N), i32(K)))


def _gemv(b, x: V, xdiv: int, a: Stack, bb: Stack | None, sort: Sort, out, N: int, K: int, act: str):
    """One gemv launch: a block per 8 output rows and active expert."""
    dual = bb is not None
    xal = _align(x.arr.data.ptr, x.arr.strides[0])
    src = a.source(x, xal, K, T=ctype(x.dt), TO=ctype(x.dt), ACC=acc_of(x.dt), MC=PAIRS_PER_PASS,
                   DUAL=int(dual), EPILOGUE=_dq_epilogue(x.dt, False, act) if dual else "")
    fn = b.kernel(src, "rlx_moe_gemv")
    offsets, order, active, n_slots = sort.offsets, sort.order, sort.active, sort.slots
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
    dst = y if y.contiguous() else b.buffer(y.shape, y.dt, "moe output")
    if T == 1 and E and _one_token(b, n, ins, x, wts_c, ids_c, dst):
        if dst is not y:
            b.copy(dst, y)
        return
    part = b.node_buffer((max(P, 1), H), F64 if x.dt is F64 else F32, "moe expert outputs")
    if P and E:
        _experts(b, n, ins, x, ids_c, part)
    src = sources.render(sources.MOE_COMBINE, ACC=acc_of(x.dt), TO=ctype(y.dt), TW=ctype(wts_c.dt), TI=ctype(ids_c.dt), NE=E)
    b.launch(b.kernel(src, "rlx_moe_combine"), (max(1, min(-(-T * H // 256), b.sms * 32)),), (256,),
             (part.arr, wts_c.arr, ids_c.arr, dst.arr, i64(T), i32(H), i32(ks)))
    if dst is not y:
        b.copy(dst, y)


def _one_token(b, n, ins, x: V, wts: V, ids: V, y: V) -> bool:
    """y <- the token's experts (gemv1: gate/up, then down with the combine): no sort, no
    combine launch. False (nothing launched) where gate and up differ in scheme or h is
    rounded through int8 on the host: the general path then."""
    H, ks = x.shape[1], ids.shape[1]
    E, inter = ins[3].shape[0], ins[3].shape[1]
    if n.a["int8_h"] or n.a["schemes"][0] != n.a["schemes"][1]:
        return False
    gate, up, down = _stacks(b, n, ins, x)
    if gate.key != up.key:                 # (packed rows of another alignment)
        return False
    h = b.node_buffer((ks, inter), x.dt, "moe intermediate rows")
    common = dict(T=ctype(x.dt), ACC=acc_of(x.dt), MC=1, TW=ctype(wts.dt), TI=ctype(ids.dt), NE=E, KS=ks)
    for w, wb, xin, out, N, K, dual in ((gate, up, x, h, inter, H, 1), (down, down, h, y, H, inter, 0)):
        R = ONE_TOKEN_ROWS[("packed" if w.scheme else "dense") if dual else "down"]
        src = w.source(xin, _align(xin.arr.data.ptr, xin.arr.strides[0]), K, one_token=True, TO=ctype(out.dt), R=R,
                       DUAL=dual, EPILOGUE=_dq_epilogue(x.dt, False, n.a["act"]) if dual else "", **common)
        grid = (-(-N // (8 * R)), ks) if dual else (-(-N // R),)
        b.launch(b.kernel(src, "rlx_moe_gemv1"), grid, (256,),
                 (xin.arr, i64(xin.arr.strides[0] // xin.arr.itemsize), w.arr, wb.arr, i64(w.ers), i64(w.rs),
                  ids.arr, wts.arr, out.arr, i32(N), i32(K), b.r.err, i32(b.node)))
    return True


def _stacks(b, n, ins, x: V) -> tuple:
    """The gate, up and down Stacks of a moe_experts node."""
    return tuple(Stack(b, w, s, x, name) for w, s, name in zip(ins[3:], n.a["schemes"], ("gate", "up", "down")))


def _experts(b, n, ins, x: V, ids: V, part: V) -> None:
    """part[pair] <- down[e] @ (act(gate[e] @ x[t]) * (up[e] @ x[t])) for every (token t, slot)
    pair with expert e: the sort, then gate/up and down launches."""
    T, H = x.shape
    ks = ids.shape[1]
    E, inter = ins[3].shape[0], ins[3].shape[1]
    P, act = T * ks, n.a["act"]
    gate, up, down = _stacks(b, n, ins, x)
    sort = Sort(b, ids, P, E, _gemm_m_tiles(b, x, P, E))
    h = b.node_buffer((P, inter), x.dt, "moe intermediate rows")
    if gate.key == up.key:
        _products(b, x, ks, gate, up, sort, h, inter, H, act)
    else:                                  # two schemes: each product apart, then act(gate) * up
        hg = b.node_buffer((P, inter), part.dt, "moe gate rows")
        hu = b.node_buffer((P, inter), part.dt, "moe up rows")
        _products(b, x, ks, gate, None, sort, hg, inter, H, act)
        _products(b, x, ks, up, None, sort, hu, inter, H, act)
        to_x = ("cast", (("dtype", x.dt.value),))
        b.elementwise(((*to_x, (0,)), ("activation", (("fn", act),), (2,)), (*to_x, (1,)),
                       ("binary", (("op", "mul"),), (3, 4))), [hg, hu], h)
    if n.a["int8_h"]:                      # (activations = "int8": h rounded as the op says)
        round_int8(b, h, h)
    _products(b, h, 1, down, None, sort, part, H, inter, act)


def _gemm_m_tiles(b, x: V, P: int, E: int) -> int:
    """m-tiles of 16 pairs a grouped-GEMM tile takes (1 or 2: an expert's pairs mostly in one
    tile, each weight tile read once), or 0: the gemv (f32/f64 data, no mma.sync before sm_80,
    ROCm, or too few pairs an expert for a tile: decode)."""
    if x.dt not in (BF16, F16) or device.mma_missing(b.cc, b.hip):
        return 0
    per_expert = P / min(E, P)
    if per_expert < GEMM_MIN_PAIRS:
        return 0
    return 1 if 1.5 * per_expert <= 16 else 2


def _rows(v: V, shape: tuple) -> V:
    """A contiguous value viewed as `shape` (its tokens' leading dims merged)."""
    return V(v.arr.reshape(shape), v.dt)


class Sort:
    """The sort launch and its int32 scratch: offsets [E + 1], order [P], active [E] and, for
    the grouped GEMM (mt > 0), the tile list [ntiles, 2] of (expert, first position in order)."""

    def __init__(self, b, ids: V, P: int, E: int, mt: int):
        if E > 8192:
            raise BackendError(f"cuda backend: moe_experts with {E} experts: the sort kernel takes at most 8192 "
                               f"(node %{b.node})")
        self.mt, self.slots = mt, min(E, P)
        self.offsets = b.node_buffer((E + 1,), I32, "moe expert offsets")
        self.order = b.node_buffer((P,), I32, "moe pair order")
        self.active = b.node_buffer((E,), I32, "moe active experts")
        bm = 16 * mt
        # each expert's tiles: its pairs // BM whole ones and at most one partial
        self.ntiles = P // bm + min(E, P) if mt else 0
        self.tiles = b.node_buffer((max(self.ntiles, 1), 2), I32, "moe gemm tiles") if mt else None
        fn = b.kernel(sources.render(sources.MOE_SORT, TI=ctype(ids.dt), NE=E, BM=bm), "rlx_moe_sort")
        b.launch(fn, (1,), (1024,), (ids.arr, i32(P), self.offsets.arr, self.order.arr, self.active.arr,
                                     self.tiles.arr if mt else None, i32(self.ntiles), b.r.err, i32(b.node)))


def build_moe_route(b, n, ins, outs):
    """moe_route in one launch (rlx_moe_route: a warp per token), not the softmax, topk (and
    sum, divide) launches of its composite."""
    z = ins[0]
    wts, ids = outs
    E, k = z.shape[-1], n.a["k"]
    rows = z.size // E
    if rows == 0:
        return
    zc = _rows(b.contiguous(z), (rows, E))
    wd = wts if wts.contiguous() else b.buffer(wts.shape, wts.dt, "moe route weights")
    idd = ids if ids.contiguous() else b.buffer(ids.shape, ids.dt, "moe route ids")
    src = sources.render(sources.MOE_ROUTE, T=ctype(z.dt), ACC=acc_of(z.dt), NE=E, KS=k,
                         ORDER=ROUTE_ORDERS.index(n.a["order"]), NORM=int(n.a["normalize"]))
    b.launch(b.kernel(src, "rlx_moe_route"), (-(-rows // 4),), (128,), (zc.arr, wd.arr, idd.arr, i64(rows)))
    for dst, out in ((wd, wts), (idd, ids)):
        if dst is not out:
            b.copy(dst, out)


BUILDERS["moe_experts"] = build_moe_experts
BUILDERS["moe_route"] = build_moe_route

__all__ = ["build_moe_experts", "build_moe_route"]
