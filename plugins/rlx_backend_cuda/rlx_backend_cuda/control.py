"""Control flow (if_, while_, scan) and dense_solve on the GPU.

A body Graph runs as a runner of its own, compiled for this backend once per shape of its
operands, over a private arena (the backend's shared arena holds the enclosing graph's live
values while the body runs). Operands, carries and results move device to device; only an
if_ predicate and a while_ condition come back to the host, one scalar per branch or trip.
Such a step keeps its graph out of CUDA-graph capture (the trip count is data).
dense_solve is cuSOLVER's getrf/getrs through cupy.linalg.solve.
"""
from __future__ import annotations

from rlx_core.ir.control import bodies
from rlx_core.ir.dtype import DType
from rlx_core.ir.lir import plan

from .ops import BUILDERS


class Body:
    """One body Graph, run on device arrays: a runner per shape of its operands."""

    def __init__(self, backend, graph):
        self.backend, self.graph = backend, graph
        self.ins = [n for n in graph.nodes if n.op == "input"]
        self.runners: dict = {}

    def __call__(self, arrays: list) -> list:
        """The body's outputs for `arrays` (its inputs in order), as device arrays that stay
        valid until this body runs again."""
        from rlx_core.pipeline import specialize

        from .runner import CudaRunner

        key = tuple(a.shape for a in arrays)
        r = self.runners.get(key)
        if r is None:
            env: dict = {}
            for n, a in zip(self.ins, arrays):
                env.update({d: v for d, v in zip(n.outs[0].dims, a.shape) if isinstance(d, str)})
            r = self.runners[key] = CudaRunner(self.backend, plan(specialize(self.graph, env)), {}, {},
                                               private_arena=True)
        return r.run_device({n.name: a for n, a in zip(self.ins, arrays)})

    def check(self) -> None:
        """Raise what a kernel of the body flagged (an index out of range)."""
        for r in self.runners.values():
            r.check_flags()


def _scalar_true(arr) -> bool:
    return bool(arr.reshape(-1)[:1].get()[0])


def _b_control(b, n, ins, outs):
    a = dict(n.a)
    body = {k: Body(b.r.backend, g) for k, g in bodies(n).items()}
    arrays = [v.arr for v in ins]
    stream = b.stream

    def put(results):
        for o, r in zip(outs, results):
            o.arr[...] = r

    def run_if():
        pred, *operands = arrays
        put(body["then_" if _scalar_true(pred) else "else_"](operands))

    def run_while():
        k = a["n_consts"]
        consts, carry = arrays[:k], [x.copy() for x in arrays[k:]]
        while _scalar_true(body["cond"](consts + carry)[0]):
            carry = [x.copy() for x in body["body"](consts + carry)]
        put(carry)

    def run_scan():
        k, c = a["n_consts"], a["n_carry"]
        consts, carry, xs = arrays[:k], [x.copy() for x in arrays[k:k + c]], arrays[k + c:]
        steps = outs[c].shape[0] if len(outs) > c else (xs[0].shape[0] if xs else a["length"])
        for t in (range(steps - 1, -1, -1) if a["reverse"] else range(steps)):
            res = body["body"](consts + carry + [x[t] for x in xs])
            carry = [x.copy() for x in res[:c]]
            for o, y in zip(outs[c:], res[c:]):
                o.arr[t, ...] = y
        put(carry)

    fn = {"if_": run_if, "while_": run_while, "scan": run_scan}[n.op]

    def run():
        with stream:
            fn()
            for bd in body.values():
                bd.check()
    b.add(run, capturable=False)


def _b_dense_solve(b, n, ins, outs):
    a_, rhs = ins
    out = outs[0]
    vector = len(rhs.shape) == len(a_.shape) - 1
    res = out
    if out.dt in (DType.F16, DType.BF16):      # solved in f32, like the NumPy kernel
        a_, rhs, res = b.contiguous(a_, DType.F32), b.contiguous(rhs, DType.F32), b.buffer(out.shape, DType.F32)
    cp, stream = b.cp, b.stream

    def run():
        with stream:
            r = cp.linalg.solve(a_.arr, rhs.arr[..., None] if vector else rhs.arr)
            res.arr[...] = r[..., 0] if vector else r
    b.add(run, capturable=False)
    if res is not out:
        b.copy(res, out)


BUILDERS.update({"if_": _b_control, "while_": _b_control, "scan": _b_control, "dense_solve": _b_dense_solve})

__all__ = ["Body"]
