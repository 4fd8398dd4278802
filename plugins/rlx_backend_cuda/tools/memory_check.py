"""What the GPU holds for the 1B shape (benchmarks/llm_gpu.py's random bf16 weights) after a
generate at each batch: model.memory_report() (weights / KV / arenas / pool) and the CuPy
pool's total, against the issue's bar of 1.3 x (weights + KV), and what each live runner holds.

    python plugins/rlx_backend_cuda/tools/memory_check.py [--batch 1 32] [--ctx 2048]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))
from llm_gpu import LLAMA_1B, make_weights, runtime_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=2048)
    a = ap.parse_args()
    import cupy as cp


    cfg = dict(LLAMA_1B, num_hidden_layers=a.layers)
    model = runtime_model(cfg, make_weights(cfg), a.ctx)
    pool = cp.get_default_memory_pool()

    def fmt(x):
        return f"{x / 1e9:.3f}"

    def held():
        """Each live runner's arena, private buffers and staging (GB)."""
        for mode, exe in model._exes.items():
            for key, r in exe._runners.items():
                priv = sum(int(x.nbytes) for x in r.private)
                print(f"  runner {mode[0]} {dict(key)}: arena {fmt(r.lir.arena_bytes)} "
                      f"(block {fmt(r.arena.mem.size)}), "
                      f"private {fmt(priv)} in {len(r.private)} buffers, inputs {fmt(r.in_bytes)}")
    model.executable("prefill"), model.executable("decode")
    print(f"after binding the weights: pool {fmt(pool.total_bytes())} GB, used {fmt(pool.used_bytes())} GB "
          "(the free blocks go when the first runner is built: CudaBackend.trim)")
    for b in a.batch:
        prompt = np.random.default_rng(1).integers(0, cfg["vocab_size"], (b, a.prompt)).astype(np.int64)
        model.generate(prompt, max_new_tokens=a.ctx - a.prompt - 1, min_new_tokens=4)
        rep = model.memory_report()
        gb = {k: round(v / 1e9, 3) for k, v in rep.items() if isinstance(v, int)}
        bar = 1.3 * (rep["weights_bytes"] + rep["kv_bytes"])
        print(f"batch {b}: {gb}; pool total {pool.total_bytes() / 1e9:.2f} GB = "
              f"{pool.total_bytes() / bar * 1.3:.2f} x (weights + KV) (bar 1.3)", flush=True)
        held()
    for mode, exe in model._exes.items():          # the largest arena slots of each runner
        for key in list(exe._runners):
            lir = exe.lir_cache.get(key)
            if lir is None:
                continue
            big = sorted(((s.nbytes, i) for (i, k), s in lir.slots.items() if s.home == "arena"), reverse=True)[:4]
            desc = [f"%{i} {lir.graph.nodes[i].op} {lir.graph.nodes[i].outs[0]} {n / 1e6:.0f} MB" for n, i in big]
            print(f"{mode} {dict(key)}: arena {lir.arena_bytes / 1e9:.3f} GB (bound {lir.lower_bound / 1e9:.3f}); {desc}")
    sizes = sorted(((getattr(v[1] if isinstance(v, tuple) else v, "nbytes", 0), k) for k, v in model._shared.items()),
                   reverse=True)[:5]
    print("largest resident params:", [(k, f"{n / 1e6:.0f} MB") for n, k in sizes])


if __name__ == "__main__":
    main()
