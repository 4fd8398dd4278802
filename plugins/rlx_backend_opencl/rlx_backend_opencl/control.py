"""Control flow (if_, while_, scan) on OpenCL: each body Graph runs as a runner of its own.

A body is compiled when its graph is, once per control node, for the shapes its operands
have there (specialize + plan): an OpenCLRunner with its own arena, staging, constants and
error flag, so the enclosing graph's live values stay put while it runs. At run time the
node is one host step: operands, carries and results move buffer to buffer (the body's
`run_device` copies them into its staging; its outputs are copied into the node's outputs,
which hold the carries), and only an if_ predicate and a while_ condition come back to the
host, one byte per branch or trip. The queue is in order, so no events are needed; the
top runner's download reads the bodies' error flags with its own.
"""
from __future__ import annotations

import numpy as np

from rlx_core.ir.lir import plan

OPS = ("if_", "while_", "scan")


class Body:
    """One body Graph compiled for the operand shapes it is given at its node."""

    def __init__(self, outer, graph, shapes: list):
        from rlx_core.pipeline import specialize

        env: dict = {}
        for n, shape in zip([n for n in graph.nodes if n.op == "input"], shapes):
            env.update({d: v for d, v in zip(n.outs[0].dims, shape) if isinstance(d, str)})
        # the enclosing runner's class (runner.py imports this module: no import back)
        self.runner = type(outer)(outer.backend, outer.dev, plan(specialize(graph, env)), {}, {})

    def __call__(self, views: list) -> list:
        """Enqueue the body on `views` (its inputs in order): its outputs, valid until it runs again."""
        return self.runner.run_device(views)


def copy_view(q, src, dst) -> None:
    """Enqueue a buffer-to-buffer copy of contiguous View `src` into contiguous `dst` (same size)."""
    import pyopencl as cl

    nbytes = src.numel * src.dtype.itemsize
    if nbytes:
        cl.enqueue_copy(q, dst.st.buf, src.st.buf, byte_count=nbytes, src_offset=src.off * src.dtype.itemsize,
                        dst_offset=dst.off * dst.dtype.itemsize)


def _put(q, srcs, dsts) -> None:
    for s, d in zip(srcs, dsts):
        copy_view(q, s, d)


def _truth(q, v) -> bool:
    """A bool scalar read back to the host (the enqueued work before it finishes first)."""
    import pyopencl as cl

    h = np.zeros(1, np.uint8)
    cl.enqueue_copy(q, h, v.st.buf, src_offset=v.off * v.dtype.itemsize)
    return bool(h[0])


def _row(v, t: int):
    """Row t along axis 0 of a contiguous View (a contiguous View itself)."""
    return v.with_(v.shape[1:], v.strides[1:], off=v.off + t * v.strides[0])


def build(r, node, ins: list, outs: list) -> None:
    """Compile the bodies of control node `node` and add its host step to runner `r`.
    Operands are made contiguous first (strided views are copied); outputs are arena values."""
    a, q = node.a, r.dev.queue
    if node.op == "if_":
        pred, ops = ins[0], [r.contig(v) for v in ins[1:]]
        then_, else_ = (Body(r, a[key], [v.shape for v in ops]) for key in ("then_", "else_"))

        def step():
            _put(q, (then_ if _truth(q, pred) else else_)(ops), outs)
        r.host_step(step, [then_.runner, else_.runner])
        return
    ops = [r.contig(v) for v in ins]
    k = a["n_consts"]
    consts = ops[:k]
    if node.op == "while_":
        cond, body = (Body(r, a[key], [v.shape for v in ops]) for key in ("cond", "body"))

        def step():
            _put(q, ops[k:], outs)
            while _truth(q, cond(consts + outs)[0]):
                _put(q, body(consts + outs), outs)
        r.host_step(step, [cond.runner, body.runner])
        return
    c = a["n_carry"]
    init, xs, carry, ys = ops[k:k + c], ops[k + c:], outs[:c], outs[c:]
    steps = ys[0].shape[0] if ys else (xs[0].shape[0] if xs else a["length"])
    body = Body(r, a["body"], [v.shape for v in consts + init] + [x.shape[1:] for x in xs])
    order = range(steps - 1, -1, -1) if a["reverse"] else range(steps)

    def step():
        _put(q, init, carry)
        for t in order:
            res = body(consts + carry + [_row(x, t) for x in xs])
            _put(q, res[:c], carry)
            _put(q, res[c:], [_row(y, t) for y in ys])
    r.host_step(step, [body.runner])
