"""gated_delta_rule and causal_conv1d on the GPU (kernels/deltanet.cu).

gated_delta_rule, two forms:
* recurrent (decode, T < GDN_CHUNKED_MIN, f64): a warp keeps a few state columns of one
  (batch, head) in registers across all steps, so a decode step reads and writes the state
  once, inside the CUDA graph;
* chunked on tensor cores (prefill, f16/bf16, K and V multiples of 16 up to 128, chunk >= 64,
  16-byte aligned q, k and v): flash-linear-attention's three passes (kernels/deltanet.cu tc_*):
  every chunk's state-free parts at once (rlx_gdn_tc_prep), the one walk over the chunks
  that keeps the state in mma accumulators and stores it at each chunk's start
  (rlx_gdn_tc_scan), then every chunk's outputs at once (rlx_gdn_tc_out); chunks of 64;
* chunked with f32 FMA (prefill otherwise: f32, odd head sizes, shorter chunks): the same
  WY / UT form in two launches: every chunk's state-free parts at once (rlx_gdn_prep: the
  decays, (I + A)^-1, W, U and the masked q k^T, into f32 node-local scratch), then one walk
  over the chunks per (state columns, head, batch) that also writes the outputs
  (rlx_gdn_scan). Chunk length: the op's `chunk`, at most GDN_CHUNK_MAX (shared memory),
  halved until the walk's stage fits.
causal_conv1d: a thread per channel and run of CONV_RUN steps (its window in registers), x
read through its strides (a column slice of a projection is not copied), then the new state
(its last W - 1 inputs).
gated_delta_net (kernels/gdn_net.cu): the whole layer between its projections in one launch,
a block (on sm_90 a cluster of sources.net_cluster blocks, splitting the state's columns and
pushing their norms' parts to each other) per (key head, batch row) walking the steps (a decode
step: one), both states read once and written once in place; x, z, b and a read through their
strides (column slices of the one in-projection GEMV's output are not copied).
"""
from __future__ import annotations

import numpy as np

from rlx_core.ir.deltanet import net_heads
from rlx_core.ir.dtype import BF16, F16, F32
from rlx_core.ir.shape import Shape

from . import device, sources
from .codegen import acc_of, ctype
from .ops import BUILDERS, _dq_epilogue

i32, i64 = np.int32, np.int64

GDN_WARPS = 4             # warps of a block
GDN_COLUMNS = 4           # state columns a warp holds (registers: K / 32 x this)
GDN_PREFETCH = 4          # steps whose inputs are in flight ahead of the one computed
GDN_CHUNKED_MIN = 64      # shortest T the chunked form runs (below: the recurrent kernel)
GDN_CHUNK_MAX = 64        # longest chunk the chunked kernels take (their thread mapping)
GDN_TILE = 32             # K / V columns pass 1 stages at a time
GDN_SCAN_COLS = 16        # state columns a block of pass 2 holds
GDN_SMEM_MAX = 200 * 1024  # pass 2's shared memory stage, at most
GDN_TC_CHUNK = 64         # the tensor-core kernels' chunk (4 warps x 16 rows)
GDN_TC_DIM_MAX = 128      # largest K / V the tensor-core kernels stage (shared memory)
GDN_TC_BV = 16            # state columns a block of the tensor-core walk holds (H200, bf16, 16 heads,
                          # K = V = 128, 32k steps: 16 columns 2.65 ms a layer, 32 3.03, 64 3.85)
CONV_THREADS = 128        # channels a block of causal_conv1d takes
CONV_RUN = 16             # steps a causal_conv1d thread walks (its window in registers)
GRID_Y_MAX = 65535        # CUDA's limit on a grid's y extent


def _scan_smem(c: int, kd: int) -> int:
    """Bytes of rlx_gdn_scan's dynamic shared memory (its layout comment)."""
    return 4 * (4 * c * (kd + 1) + 2 * c * (c + 1) + 2 * c * (GDN_SCAN_COLS + 1) + kd * (GDN_SCAN_COLS + 1) + c)


def _chunk_len(chunk: int, kd: int) -> int | None:
    """The chunk length the chunked kernels use for the op's `chunk`, or None (stay recurrent)."""
    c = max(1, min(chunk, GDN_CHUNK_MAX))
    while c > 1 and _scan_smem(c, kd) > GDN_SMEM_MAX:
        c //= 2
    return c if _scan_smem(c, kd) <= GDN_SMEM_MAX else None


def build_gated_delta_rule(b, n, ins, outs):
    q, k, v, g, beta, s0 = (b.contiguous(t) for t in ins)
    o, s1 = outs
    T, KD = q.shape[1], q.shape[3]
    if s1.size == 0:
        return
    od = o if o.contiguous() else b.buffer(o.shape, o.dt, "gated_delta_rule output")
    sd = s1 if s1.contiguous() else b.buffer(s1.shape, s1.dt, "gated_delta_rule state")
    c = _chunk_len(n.a["chunk"], KD) if T >= GDN_CHUNKED_MIN and acc_of(q.dt) == "float" else None
    if c is None:
        _recurrent(b, n, (q, k, v, g, beta, s0), od, sd)
    elif c == GDN_TC_CHUNK and _tensor_cores(b, q, k, v):
        _chunked_tc(b, n, (q, k, v, g, beta, s0), od, sd)
    else:
        _chunked(b, n, (q, k, v, g, beta, s0), od, sd, c)
    for src_v, dst in ((od, o), (sd, s1)):
        if src_v is not dst:
            b.copy(src_v, dst)


def _recurrent(b, n, ins, od, sd):
    q, k, v, g, beta, s0 = ins
    B, T, HK, KD = q.shape
    H, VD = v.shape[2], v.shape[3]
    src = sources.render(sources.GDN_RULE, T=ctype(q.dt), ACC=acc_of(q.dt), KD=KD, VD=VD, KPL=-(-KD // 32), VPW=GDN_COLUMNS,
                         PF=GDN_PREFETCH)
    fn = b.kernel(src, "rlx_gdn")
    per_block = GDN_WARPS * GDN_COLUMNS
    scale = np.float64(n.a["scale"]) if acc_of(q.dt) == "double" else np.float32(n.a["scale"])
    b.launch(fn, (-(-VD // per_block), H, B), (32 * GDN_WARPS,),
             (q.arr, k.arr, v.arr, g.arr, beta.arr, s0.arr, od.arr, sd.arr, i32(T), i32(H), i32(HK), scale))


def _chunked(b, n, ins, od, sd, c):
    q, k, v, g, beta, s0 = ins
    B, T, HK, KD = q.shape
    H, VD = v.shape[2], v.shape[3]
    nch = -(-T // c)
    wbuf = b.node_buffer((B, H, nch, c, KD), F32, "gated_delta_rule W")
    ubuf = b.node_buffer((B, H, nch, c, VD), F32, "gated_delta_rule U")
    abuf = b.node_buffer((B, H, nch, c, c), F32, "gated_delta_rule qk")
    cbuf = b.node_buffer((B, H, nch, c), F32, "gated_delta_rule decay")
    t, scale = ctype(q.dt), np.float32(n.a["scale"])
    prep = b.kernel(sources.render(sources.GDN_PREP, T=t, C=c, KD=KD, VD=VD, TILE=GDN_TILE), "rlx_gdn_prep")
    b.launch(prep, (nch, H, B), (256,), (q.arr, k.arr, v.arr, g.arr, beta.arr, wbuf.arr, ubuf.arr, abuf.arr,
                                         cbuf.arr, i32(T), i32(H), i32(HK), scale))
    smem = _scan_smem(c, KD)
    scan = b.kernel(sources.render(sources.GDN_SCAN, T=t, C=c, KD=KD, VD=VD, VS=GDN_SCAN_COLS), "rlx_gdn_scan", smem)
    grid, stream = (-(-VD // GDN_SCAN_COLS), H, B), b.stream
    args = (q.arr, k.arr, wbuf.arr, ubuf.arr, abuf.arr, cbuf.arr, s0.arr, od.arr, sd.arr, i32(T), i32(H), i32(HK),
            i32(nch), scale)

    def run():
        scan(grid, (256,), args, smem, stream)
    b.add(run)


def _tensor_cores(b, q, k, v) -> bool:
    """Whether the tensor-core kernels take this call: 16-bit data on an mma.sync GPU (CUDA,
    sm_80+), K and V multiples of 16 up to GDN_TC_DIM_MAX, q's, k's and v's rows 16-byte aligned."""
    KD, VD = q.shape[3], v.shape[3]
    return (q.dt in (BF16, F16) and not device.mma_missing(b.cc, b.hip)
            and KD % 16 == 0 and VD % 16 == 0 and KD <= GDN_TC_DIM_MAX and VD <= GDN_TC_DIM_MAX
            and all(t.arr.data.ptr % 16 == 0 for t in (q, k, v)))


def _tc_smem(KD: int, VD: int, BV: int) -> tuple:
    """Bytes of dynamic shared memory of rlx_gdn_tc_prep, _scan and _out (their layout comments)."""
    c, kp, vp, bp = GDN_TC_CHUNK, KD + 8, VD + 8, BV + 8
    prep = 2 * c * (kp + vp) + 4 * (2 * c * (c + 1) + 4 * 16 * 17 + 3 * c)
    scan = 2 * (6 * c * kp + 4 * c * bp + KD * bp) + 4 * 3 * c
    out = 2 * (2 * c * kp + KD * vp + c * vp + c * (c + 8)) + 4 * c
    return prep, scan, out


def _chunked_tc(b, n, ins, od, sd):
    q, k, v, g, beta, s0 = ins
    B, T, HK, KD = q.shape
    H, VD = v.shape[2], v.shape[3]
    c = GDN_TC_CHUNK
    nch = -(-T // c)
    bv = GDN_TC_BV if VD % GDN_TC_BV == 0 else 16
    wbuf = b.node_buffer((B, H, nch * c, KD), q.dt, "gated_delta_rule W")
    ubuf = b.node_buffer((B, H, nch * c, VD), q.dt, "gated_delta_rule U")        # V_new after the walk
    cbuf = b.node_buffer((B, H, nch * c), F32, "gated_delta_rule decay")
    hbuf = b.node_buffer((B, H, nch, KD, VD), q.dt, "gated_delta_rule chunk states")
    mm = {"T": ctype(q.dt), "MMAT": "bf16" if q.dt is BF16 else "f16", "KD": KD, "VD": VD}
    sm_prep, sm_scan, sm_out = _tc_smem(KD, VD, bv)
    prep = b.kernel(sources.render(sources.GDN_TC_PREP, **mm), "rlx_gdn_tc_prep", sm_prep)
    scan = b.kernel(sources.render(sources.GDN_TC_SCAN, BV=bv, **mm), "rlx_gdn_tc_scan", sm_scan)
    out = b.kernel(sources.render(sources.GDN_TC_OUT, **mm), "rlx_gdn_tc_out", sm_out)
    common = (i32(T), i32(H), i32(HK))
    launches = (
        (prep, (nch, H, B), sm_prep, (k.arr, v.arr, g.arr, beta.arr, wbuf.arr, ubuf.arr, cbuf.arr, *common)),
        (scan, (VD // bv, H, B), sm_scan, (k.arr, wbuf.arr, ubuf.arr, cbuf.arr, s0.arr, sd.arr, hbuf.arr, *common,
                                           i32(nch))),
        (out, (nch, H, B), sm_out, (q.arr, k.arr, ubuf.arr, cbuf.arr, hbuf.arr, od.arr, *common,
                                    np.float32(n.a["scale"]))))
    stream = b.stream
    for fn, grid, smem, args in launches:
        def run(fn=fn, grid=grid, smem=smem, args=args):
            fn(grid, (128,), args, smem, stream)
        b.add(run)


def _step_rows(b, x):
    """(x, its step stride, its batch stride) for a [B, T, C] value read with unit channel
    stride: a column slice of a projection's output as it is (a contiguous copy otherwise)."""
    if x.es[2] != 1 or any(s < 0 for s in x.es):
        x = b.contiguous(x)
    return x, i64(x.es[1]), i64(x.es[0])


def build_causal_conv1d(b, n, ins, outs):
    x, xt, xb = _step_rows(b, ins[0])
    w, st = (b.contiguous(t) for t in ins[1:3])
    bias = b.contiguous(ins[3]) if len(ins) > 3 else None
    y, nst = outs
    B, T, C = x.shape
    width = w.shape[1]
    if y.size:
        yd = y if y.contiguous() else b.buffer(y.shape, y.dt, "causal_conv1d output")
        src = sources.render(sources.CONV1D, T=ctype(x.dt), ACC=acc_of(x.dt), WID=width,
                             EPILOGUE=_dq_epilogue(x.dt, bias is not None, n.a["act"]))
        run = max(CONV_RUN, -(-T // GRID_Y_MAX))
        b.launch(b.kernel(src, "rlx_conv1d"), (-(-C // CONV_THREADS), -(-T // run), B), (CONV_THREADS,),
                 (x.arr, w.arr, st.arr, bias.arr if bias is not None else None, yd.arr, i32(T), i32(C), i32(run),
                  xt, xb))
        if yd is not y:
            b.copy(yd, y)
    if nst.size == 0:
        return
    if T == 0:
        b.copy(st, nst)
        return
    nd = nst if nst.contiguous() else b.buffer(nst.shape, nst.dt, "causal_conv1d state")
    src = sources.render(sources.CONV1D_STATE, T=ctype(x.dt), WID=width)
    b.launch(b.kernel(src, "rlx_conv1d_state"), (max(1, min(-(-B * C // 256), b.sms * 32)),), (256,),
             (x.arr, st.arr, nd.arr, i64(B), i32(T), i32(C), xt, xb))
    if nd is not nst:
        b.copy(nd, nst)


def _unit_last(b, x):
    """(x, its strides but the last) for a value read with unit stride along its last axis (a
    column slice of a projection's output as it is; a contiguous copy otherwise)."""
    if (x.es[-1] != 1 and x.shape[-1] > 1) or any(s < 0 for s in x.es):
        x = b.contiguous(x)
    return x, tuple(i64(s) for s in x.es[:-1])


def _from_leaf(b, ref) -> bool:
    """Whether value `ref` is a leaf (param, state, constant, input) or a view of one: no kernel
    of the run writes it before the node reading it."""
    g, i = b.r.lir.graph, ref[0]
    while g.nodes[i].op not in ("param", "state", "constant", "input"):
        if b.r.lir.slots.get((i, 0)) is None or b.r.lir.slots[(i, 0)].home != "view" or not g.nodes[i].inputs:
            return False
        i = g.nodes[i].inputs[0][0]
    return True


def _in_place(b, n, k: int, j: int, state, out):
    """Where node b.node's output k (a new state) goes: into the state leaf its input j reads
    when the one reader of output k is the assign of it to that leaf and nothing else reads the
    leaf (the assign then copies nothing: ops._v_assign), else `out`."""
    g = b.r.lir.graph
    src = tuple(n.inputs[j])
    readers = b.uses.get((b.node, k), [])
    if (g.nodes[src[0]].op != "state" or len(readers) != 1 or readers[0] < 0 or not state.contiguous()
            or g.nodes[readers[0]].op != "assign"
            or [tuple(r) for r in g.nodes[readers[0]].inputs] != [src, (b.node, k)]
            or sorted(b.uses.get(src, [])) != sorted([b.node, readers[0]])):
        return out
    b.vals[(b.node, k)] = state
    return state


def build_gated_delta_net(b, n, ins, outs):
    x, xt, xb = _step_rows(b, ins[0])
    w, cs0 = (b.contiguous(t) for t in ins[1:3])
    (z, zs), (bl, bs), (al, as_) = (_unit_last(b, t) for t in ins[3:6])
    a_log, dt_bias, norm_w, s0 = (b.contiguous(t) for t in ins[6:10])
    o, cs1, s1 = outs
    B, T, C = x.shape
    hk, kd, h, vd = net_heads(Shape(x.shape, x.dt), Shape(s0.shape, s0.dt))
    if T == 0 or B == 0:
        for src_v, dst in ((cs0, cs1), (s0, s1)):
            if dst.size and src_v.arr.data.ptr != dst.arr.data.ptr:
                b.copy(src_v, dst)
        return
    cs1, s1 = (_in_place(b, n, k, j, ins[j], out) for k, j, out in ((1, 2, cs1), (2, 9, s1)))
    od, cd, sd = (t if t.contiguous() else b.buffer(t.shape, t.dt, f"gated_delta_net {what}")
                  for t, what in ((o, "output"), (cs1, "conv state"), (s1, "state")))
    r = h // hk
    acc = acc_of(x.dt)
    clusters = acc != "double" and not device.cluster_missing(b.cc, b.hip)
    cs = sources.net_cluster(vd, r, hk * B, b.sms) if clusters else 1
    lay = sources.net_layout(kd, vd, r, w.shape[1], s0.arr.itemsize, cs)
    lay["VEC"] &= int(s0.arr.data.ptr % 16 == 0 and sd.arr.data.ptr % 16 == 0)
    early = int(all(_from_leaf(b, n.inputs[j]) for j in (1, 2, 9)))
    src = sources.render(sources.GDN_NET, T=ctype(x.dt), ACC=acc, KD=kd, VD=vd, R=r, WID=w.shape[1], EARLY=early,
                         **lay)
    num = np.float64 if acc == "double" else np.float32
    b.launch(b.kernel(src, "rlx_gdn_net"), (hk * cs, B), (32 * lay["NW"],),
             (x.arr, w.arr, cs0.arr, cd.arr, z.arr, bl.arr, al.arr, a_log.arr, dt_bias.arr, norm_w.arr, s0.arr,
              sd.arr, od.arr, i32(T), i32(hk), xb, xt, *zs, *bs, *as_, num(n.a["scale"]), num(n.a["eps"])))
    for src_v, dst in ((od, o), (cd, cs1), (sd, s1)):
        if src_v is not dst:
            b.copy(src_v, dst)


BUILDERS.update({"gated_delta_rule": build_gated_delta_rule, "causal_conv1d": build_causal_conv1d,
                 "gated_delta_net": build_gated_delta_net})

__all__ = ["build_gated_delta_rule", "build_causal_conv1d", "build_gated_delta_net"]
