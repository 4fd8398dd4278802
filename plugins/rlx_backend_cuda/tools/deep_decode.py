"""Decode ms/token of the Llama-3.2-1B shape's runtime CausalLM (benchmarks/llm_gpu.py's random
weights, bf16 compute, `--scheme` packed weights or bf16) after a `--prompt`-id prompt: the
second of two generates of `--new` tokens. A deep prompt puts the decode attention past the
short-context kernel's 512 positions; run it once per setting of a switch for an A/B, e.g.

    RLX_CUDA_DECODE_ATTENTION=0 python plugins/rlx_backend_cuda/tools/deep_decode.py --scheme q4_k
    RLX_CUDA_DECODE_ATTENTION=1 python plugins/rlx_backend_cuda/tools/deep_decode.py --scheme q4_k
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))
from llm_gpu import LLAMA_1B, make_weights, packed_tensors, runtime_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scheme", default="q4_k", help="packed scheme of every matrix, or bf16")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--layers", type=int, default=16)
    a = ap.parse_args()
    cfg = dict(LLAMA_1B, num_hidden_layers=a.layers)
    weights = make_weights(cfg)
    if a.scheme != "bf16":
        weights = packed_tensors(weights, a.scheme)
    model = runtime_model(cfg, weights, a.prompt + a.new + 128)
    prompt = np.random.default_rng(1).integers(0, cfg["vocab_size"], (1, a.prompt)).astype(np.int64)
    for _ in range(2):
        model.generate(prompt, max_new_tokens=a.new, min_new_tokens=a.new)
    ms = model.last_timings["decode_s_per_token"] * 1e3
    print(f"{a.scheme}, prompt {a.prompt}: decode {ms:.3f} ms/token")


if __name__ == "__main__":
    main()
