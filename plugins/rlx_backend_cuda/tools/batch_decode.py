"""Batched decode on the GPU through the runtime: the Llama-3.2-1B shape (benchmarks/llm_gpu.py's
random bf16 weights), `generate` on `batch` rows of `--prompt` tokens; ms per decode step at
each batch, then the profiler's table of one decode step at the largest batch (CUDA events
between eagerly launched nodes).

    python plugins/rlx_backend_cuda/tools/batch_decode.py [--layers 16] [--batch 1 8 32] [--prompt 256]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))
from llm_gpu import LLAMA_1B, make_weights, runtime_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--cublas", action="store_true", help="also time each batch with the GEMV off")
    ap.add_argument("--profile", action="store_true", help="profile a decode step at the largest batch")
    a = ap.parse_args()
    import cupy as cp

    from rlx_backend_cuda import set_config

    cfg = dict(LLAMA_1B, num_hidden_layers=a.layers)
    model = runtime_model(cfg, make_weights(cfg), a.prompt + a.new + 128)
    rng = np.random.default_rng(1)
    for b in a.batch:
        prompt = rng.integers(0, cfg["vocab_size"], (b, a.prompt)).astype(np.int64)
        t = time.perf_counter()
        model.generate(prompt, max_new_tokens=a.new, min_new_tokens=a.new)
        first = time.perf_counter() - t
        steps = []
        for _ in range(2):
            model.generate(prompt, max_new_tokens=a.new, min_new_tokens=a.new)
            steps.append(model.last_timings["decode_s_per_token"])
        pool = cp.get_default_memory_pool()
        blas = ""
        if a.cublas:                 # the same steps with cuBLAS where the GEMV would run
            set_config(gemv=False)
            model.generate(prompt, max_new_tokens=a.new, min_new_tokens=a.new)
            blas = f"; cuBLAS only {model.last_timings['decode_s_per_token'] * 1e3:.3f} ms/step"
            set_config(gemv=True)
        print(f"batch {b}: decode {min(steps) * 1e3:.3f} ms/step ({b / min(steps):.0f} tokens/s){blas}; "
              f"prefill {model.last_timings['prefill_s'] * 1e3:.1f} ms; first generate {first:.1f}s; "
              f"pool {pool.total_bytes() / 1e9:.2f} GB", flush=True)
    if not a.profile:
        return
    dec = model.executable("decode")
    b, s = a.batch[-1], a.prompt
    ctx = dec.fixed_dims["ctx"]
    mask = np.zeros((b, 1, 1, ctx), bool)
    mask[..., :s + 1] = True
    ins = {"ids": np.ones((b, 1), np.int64), "positions": np.full((b, 1), s, np.int64),
           "key_mask": mask, "cache_pos": np.full(b, s, np.int32)}
    print(dec.profile(ins, repeat=5, warmup=2).table())


if __name__ == "__main__":
    main()
