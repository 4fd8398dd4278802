"""Where a decode step's time goes when it runs as one CUDA graph: the Llama-3.2-1B-shape
decode graph (benchmarks/llm_gpu.py's builder graph, bf16), replayed whole, then re-captured
without each op kind in turn (results are then wrong; only the time is of interest), with
the matmuls alone and with each weight shape's matmuls alone (their weight-read rate). Prints
the profiler's table of the step (CUDA events between eagerly launched nodes:
`Executable.profile`), ms per step as a graph and what each op kind costs in the graph next
to its eager event time. `--engine runtime`: the runtime CausalLM's decode
graph instead (greedy arg-max and the logit sum included; no profiler table), after a
`--pos`-token prompt.

    python plugins/rlx_backend_cuda/tools/decode_ablation.py [--layers 16] [--ctx 768] [--pos 600]
        [--engine builder|runtime]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))
from llm_gpu import LLAMA_1B, llama_graphs, make_weights, rope_tables, runtime_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=768)
    ap.add_argument("--pos", type=int, default=600)
    ap.add_argument("--sweep", action="store_true", help="also time other launch shapes")
    ap.add_argument("--engine", choices=("builder", "runtime"), default="builder")
    a = ap.parse_args()
    if a.sweep and a.engine == "runtime":
        ap.error("--sweep times the builder graph: leave --engine out")
    import cupy as cp

    import rlx_core
    from rlx_core.pipeline import StateStore

    cfg = dict(LLAMA_1B, num_hidden_layers=a.layers)
    eager: dict = {}          # op -> the profiler's eager seconds (builder graph)
    if a.engine == "runtime":
        model = runtime_model(cfg, make_weights(cfg), a.ctx)
        prompt = np.random.default_rng(1).integers(0, cfg["vocab_size"], (1, a.pos))
        model.generate(prompt, max_new_tokens=4, min_new_tokens=4)
        dec = model._exes[("decode", False)]
    else:
        dec = rlx_core.compile(llama_graphs(cfg, 1, a.ctx), backend="cuda", params=make_weights(cfg),
                               states=StateStore())
        c, s = rope_tables(cfg, [a.pos])
        ins = {"ids": np.array([[7]]), "pos": np.array([a.pos], np.int32), "cos": c, "sin": s}
        report = dec.profile(dict(ins), repeat=10, warmup=3)     # per node: events between eager launches
        print(report.table())
        print(f"({report.total_s * 1e3:.3f} ms summed over the profiler's eager nodes)")
        eager = {o.op: o.seconds for o in report.by_op()}
    r = next(iter(dec._runners.values()))
    steps = list(r.steps)
    stream = r.stream

    def timed(keep) -> float:
        r.steps = [st for st in steps if keep(st)]
        r._capture()
        with stream:
            for _ in range(3):
                r.graph.launch(stream)
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(stream)
            for _ in range(50):
                r.graph.launch(stream)
            e1.record(stream)
            e1.synchronize()
        return cp.cuda.get_elapsed_time(e0, e1) / 50

    full = timed(lambda st: True)
    print(f"\ndecode graph: {len(steps)} launches, {full:.3f} ms per step as one CUDA graph")
    print("each op kind: its cost in the graph (re-captured without it) | the profiler's eager events")
    for op in sorted({st.op for st in steps}, key=lambda o: -eager.get(o, 0)):
        t = timed(lambda st, op=op: st.op != op)
        k = sum(st.op == op for st in steps)
        print(f"  {op:26s} {k:4d} launches: {full - t:.3f} ms ({(full - t) / k * 1e3:.1f} us each)"
              + (f" | {eager[op] * 1e3:.3f} ms" if op in eager else ""))
    mm = timed(lambda st: st.op == "matmul")
    print(f"  matmuls alone: {mm:.3f} ms")
    g = r.lir.graph
    by_weight: dict = {}                    # weight shape -> its matmul nodes (the GEMVs' rates)
    for st in steps:
        if st.op == "matmul":
            w = g.nodes[st.node].inputs[1]
            by_weight.setdefault(g.nodes[w[0]].outs[w[1]], set()).add(st.node)
    for shape, nodes in sorted(by_weight.items(), key=lambda t: -t[0].nbytes()):
        t = timed(lambda st, nodes=nodes: st.node in nodes)
        print(f"  matmuls of weight {shape} x{len(nodes)} alone: {t:.4f} ms, "
              f"{shape.nbytes() * len(nodes) / t / 1e9:.2f} TB/s of weight bytes")
    r.steps = steps
    r._capture()
    if a.sweep:                   # the launch-shape constants of rlx_backend_cuda.ops
        from rlx_backend_cuda import ops

        for name, values in (("ATTN_BLOCKS_PER_SM", (1, 2, 4, 8)), ("ROW_THREADS", (128, 256, 512, 1024)),
                             ("ATTN_THREADS", (64, 128, 256)), ("GEMV_LOADS", (2, 4, 8))):
            keep = getattr(ops, name)
            for v in values:
                setattr(ops, name, v)
                r._build()
                for _ in range(2):
                    dec.run(dict(ins))
                steps = list(r.steps)
                print(f"  {name} = {v}: {timed(lambda st: True):.3f} ms per step")
            setattr(ops, name, keep)


if __name__ == "__main__":
    main()
