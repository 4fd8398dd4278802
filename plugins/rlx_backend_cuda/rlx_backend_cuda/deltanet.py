"""gated_delta_rule and causal_conv1d on the GPU (kernels/deltanet.cu).

gated_delta_rule runs the recurrent form for every T: a warp keeps a few state columns of
one (batch, head) in registers across all steps, so a decode step reads and writes the
state once, inside the CUDA graph. A prefill walks its T steps in order (the same kernel;
the `chunk` attribute, the chunked form's tuning, has no effect here: no chunked kernel yet).
causal_conv1d: a thread per output, then the new state (its last W - 1 inputs).
"""
from __future__ import annotations

import numpy as np

from . import sources
from .codegen import acc_of, ctype
from .ops import BUILDERS, _dq_epilogue

i32, i64 = np.int32, np.int64

GDN_WARPS = 4             # warps of a block
GDN_COLUMNS = 4           # state columns a warp holds (registers: K / 32 x this)
GDN_PREFETCH = 4          # steps whose inputs are in flight ahead of the one computed


def build_gated_delta_rule(b, n, ins, outs):
    q, k, v, g, beta, s0 = (b.contiguous(t) for t in ins)
    o, s1 = outs
    B, T, HK, KD = q.shape
    H, VD = v.shape[2], v.shape[3]
    if s1.size == 0:
        return
    od = o if o.contiguous() else b.buffer(o.shape, o.dt, "gated_delta_rule output")
    sd = s1 if s1.contiguous() else b.buffer(s1.shape, s1.dt, "gated_delta_rule state")
    src = sources.render(sources.GDN_RULE, T=ctype(q.dt), ACC=acc_of(q.dt), KD=KD, VD=VD, KPL=-(-KD // 32), VPW=GDN_COLUMNS,
                         PF=GDN_PREFETCH)
    fn = b.kernel(src, "rlx_gdn")
    per_block = GDN_WARPS * GDN_COLUMNS
    scale = np.float64(n.a["scale"]) if acc_of(q.dt) == "double" else np.float32(n.a["scale"])
    b.launch(fn, (-(-VD // per_block), H, B), (32 * GDN_WARPS,),
             (q.arr, k.arr, v.arr, g.arr, beta.arr, s0.arr, od.arr, sd.arr, i32(T), i32(H), i32(HK), scale))
    for src_v, dst in ((od, o), (sd, s1)):
        if src_v is not dst:
            b.copy(src_v, dst)


def build_causal_conv1d(b, n, ins, outs):
    x, w, st = (b.contiguous(t) for t in ins[:3])
    bias = b.contiguous(ins[3]) if len(ins) > 3 else None
    y, nst = outs
    B, T, C = x.shape
    width = w.shape[1]
    if y.size:
        yd = y if y.contiguous() else b.buffer(y.shape, y.dt, "causal_conv1d output")
        src = sources.render(sources.CONV1D, T=ctype(x.dt), ACC=acc_of(x.dt), WID=width,
                             EPILOGUE=_dq_epilogue(x.dt, bias is not None, n.a["act"]))
        b.launch(b.kernel(src, "rlx_conv1d"), (max(1, min(-(-y.size // 256), b.sms * 32)),), (256,),
                 (x.arr, w.arr, st.arr, bias.arr if bias is not None else None, yd.arr, i64(B), i32(T), i32(C)))
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
             (x.arr, st.arr, nd.arr, i64(B), i32(T), i32(C)))
    if nd is not nst:
        b.copy(nd, nst)


BUILDERS.update({"gated_delta_rule": build_gated_delta_rule, "causal_conv1d": build_causal_conv1d})

__all__ = ["build_gated_delta_rule", "build_causal_conv1d"]
